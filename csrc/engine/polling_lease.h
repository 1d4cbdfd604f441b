// A server worker that has just sent its call's status is on its way back to accept(),
// where it polls again. Nobody polls in between, so the peer's next request, written
// while the worker still unwinds the facade, rings the doorbell and wakes the progress
// thread: a third runnable thread on a two-core host and a syscall on both sides, the
// latency row's tail. Counting the worker as a poller for that way ("a lease") spares
// both (docs/benchmarks.md, "Where a round trip's time goes").
//
// A lease only covers the facade's own bounded work: it is taken by the thread that
// accept() gave the call, when that call's status goes out and no other call waits, and
// dropped when the thread is back in accept(), before anything the application controls
// (callbacks, other executor work), and when the thread ends. A holder held up on that
// way (preempted, waiting for the GIL) holds back this process's messages until someone
// looks in its stead: the progress thread, finding a lease out as it goes to sleep,
// sleeps at most kLeaseCheck; a lease taken while it sleeps longer is caught by the
// waiters, since what is held back is what some call waits for: a thread waiting that
// long in Connection::wait looks itself and rings its peer even if the peer says it
// polls (Fabric::nudge). Waking the progress thread for every lease instead would cost
// the ping-pong more than the lease saves, and so would a short sleep for every process
// that serves.
#pragma once
#include <chrono>
#include <memory>

#include "engine_config.h"

namespace argrpc {

inline constexpr auto kLeaseCheck = std::chrono::milliseconds(knobs::kLeaseCheckMs);

class Engine;
class Server;
class Stream;

namespace polling_lease {

// accept() hands `s` to this thread (after dropping any lease the thread held).
void serving(const Stream* s);
// finish() of `s` by this thread: takes the lease if `s` is the call accept() gave it.
// `server` counts the holder as a worker on its way back (Server::lease_taken).
void finishing(Engine* engine, const std::shared_ptr<Server>& server, const Stream* s);
// Ends this thread's lease, if any; cheap when there is none.
void drop();
bool held();

}  // namespace polling_lease
}  // namespace argrpc
