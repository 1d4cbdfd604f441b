// One RPC on a connection, as both ends see it: what arrived (in order), how it ended,
// and the flow-control state. All fields below `mu` are guarded by it; waiters spin on
// the connection, then sleep on `cv`, and whoever changes the state notifies.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/clock.h"
#include "common/fifo.h"
#include "engine/frame.h"
#include "engine/notifier.h"
#include "fabric/fabric.h"
#include "pool/pool.h"

namespace argrpc {

class Connection;
class Stream;

// A received message's bytes: inline (eager), in a pool block, or on the heap when the
// pool had no room right then (slower, but a reader holding messages never deadlocks).
// Or, on fabrics that can map the peer's pool (shm), a read-only view of the sender's
// block, held by a lease whose end sends the FIN: one copy fewer per message.
struct Payload {
  std::string inline_bytes;
  Block block;
  std::unique_ptr<uint8_t[]> heap;
  const uint8_t* view = nullptr;
  std::shared_ptr<void> lease;
  size_t len = 0;
  bool is_inline = true;
  uint8_t* data() {
    if (is_inline) return reinterpret_cast<uint8_t*>(inline_bytes.data());
    if (view) return const_cast<uint8_t*>(view);
    return block.valid() ? block.data() : heap.get();
  }
};

// A rendezvous message the receiver is pulling (or will pull) from the sender's pool.
struct Pull {
  uint64_t stream_id = 0, rdv_id = 0, len = 0;
  RemoteRef src;
  Payload dst;
  uint64_t next_off = 0, done = 0;  // guarded by the connection's poll lock
  int inflight = 0;
  bool started = false;   // guarded by the stream's mu
  bool complete = false;  // guarded by the stream's mu
  bool orphaned = false;  // the stream ended: FIN and drop when the reads finish
  std::weak_ptr<Stream> stream;
};

struct Incoming {
  Payload eager;
  std::shared_ptr<Pull> pull;
  bool ready() const { return !pull || pull->complete; }
};

class Stream {
 public:
  // Made only by Connection::new_stream(), which registers it with the connection
  // for its whole life; the destructor leaves that registry.
  Stream(uint64_t id_, bool client_, std::shared_ptr<Connection> conn_, Deadline dl)
      : id(id_), client(client_), conn(std::move(conn_)), deadline(dl) {}
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Client streams get their id when their HEADERS are encoded (under the send lock),
  // so ids reach the server in increasing order whatever order the calls started in.
  uint64_t id;
  const bool client;
  const std::shared_ptr<Connection> conn;
  const Deadline deadline;
  // Its sender waits for pool room until the deadline and then ends it itself, with the
  // cause (RESOURCE_EXHAUSTED naming the pool): the deadline sweep leaves it alone, and
  // a thread waiting on it waits for that end (Connection::end_at_deadline).
  std::atomic<bool> awaiting_pool{false};
  // Server: its status went out (finish() handed the TRAILERS to the fabric). The call
  // is complete even if the connection fails before finish() ends it (a client that
  // exits as soon as it has its answer): fail() leaves it to finish(), which ends it
  // with its own status, so it is neither counted lost nor reported cancelled.
  std::atomic<bool> status_sent{false};
  std::string method;   // set at birth (new_stream), never changed
  uint64_t group = 0;   // client: the call group it was started in (set at birth; 0: none)
  Metadata request_md;  // client: the call's; server: what its HEADERS carried

  std::mutex mu;
  std::condition_variable cv;
  int sleepers = 0;
  Fifo<Incoming> inbox;
  int pulls_active = 0;
  bool peer_half_closed = false;
  bool have_initial_md = false;
  Metadata initial_md;
  bool ended = false;
  bool cancelled = false;  // server side: ended by the peer, the deadline or stop()
  bool reported_cancel = false;
  uint32_t code = 0;
  std::string details;
  Metadata trailing_md;
  int64_t send_window = 0;
  uint64_t recv_unacked = 0;
  uint64_t recv_held = 0;  // eager bytes received and not yet returned by a WINDOW frame
  bool headers_sent = false;   // server: initial metadata went out
  bool trailers_sent = false;
  // Message bytes, payloads only: committed to the wire by this side, and arrived from
  // the peer while the stream ran (a rendezvous message counts when announced, so the
  // sum is whole when the trailers that follow it end the call).
  uint64_t sent_bytes = 0, rcvd_bytes = 0;
  // Set at birth, then never changed: whether this call is in the call stats
  // (common/call_stats.h), since when, and the client connection's label then.
  bool recorded = false;
  Clock::time_point started;
  std::shared_ptr<const std::string> stats_target;
  // An asyncio call's subscription (engine/notifier.h): told of every change, as the
  // sleepers are.
  std::shared_ptr<Watch> watch;

  void notify_locked() {
    if (sleepers) cv.notify_all();
    if (watch) watch->fire();
  }
};

}  // namespace argrpc
