// The server side of the engine: calls arriving on every connection attached to this
// server wait here for a worker. Workers are the user's thread-pool threads looping in
// accept(); one of them at a time spins (polling the fabric), the others sleep, so a
// new call is picked up by an already-running thread with no hand-off.
//
// Workers are started on demand: next_event() tells the server's dispatcher (a thread
// of its own, as grpc's server has one) when calls wait and no worker is there to take
// them, so the user's pool is untouched until the first call and grows only as far as
// the calls need. The concurrency limit is counted here, at arrival, as grpc counts it;
// calls beyond it go to the dispatcher to be refused, never into the queue.
#pragma once
#include <atomic>
#include <condition_variable>
#include <string>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common/clock.h"
#include "engine/notifier.h"

namespace argrpc {

class Engine;
class Stream;

// What the dispatcher has to do next.
struct ServerEvent {
  enum class Kind { kNone, kCancelled, kOverLimit, kStarved };
  Kind kind = Kind::kNone;
  std::shared_ptr<Stream> stream;  // kCancelled, kOverLimit
  int workers = 0;                 // kStarved: how many workers to start
};

class Server {
 public:
  // max_concurrent < 0: no limit.
  Server(std::shared_ptr<Engine> engine, int max_concurrent);

  std::shared_ptr<Stream> accept(const Deadline& dl);
  void wakeup(int n);
  // A worker asked for by a kStarved event is running.
  void worker_started();
  // A worker that finished its call holds a polling lease (engine/polling_lease.h): it
  // is on its way back to accept(), so it counts as a worker for the calls that wait,
  // and the spin is kept for it. lease_returned(): back, or gone elsewhere.
  void lease_taken();
  void lease_returned();
  // Workers inside accept() right now.
  int idle_workers() const { return acceptors_.load(std::memory_order_relaxed); }
  // Calls waiting for a worker.
  size_t queued() const { return pending_count_.load(std::memory_order_relaxed); }
  ServerEvent next_event(const Deadline& dl);
  // A call served outside the engine (the plain-gRPC port) takes a place under the
  // limit; false when none is left. release() gives it back.
  bool admit();
  void release();
  // Ends the calls no worker took yet (the pool refused to run one).
  void cancel_pending(uint32_t code, const std::string& details);
  void shutdown();
  bool is_shutdown();
  void cancel_all(uint32_t code, const std::string& details);
  int active();
  // An asyncio server: its loop takes calls with accept() and events with next_event()
  // without waiting, when `w` fires; no workers are asked for.
  void set_watch(std::shared_ptr<Watch> w);

  // From connections.
  bool enqueue(const std::shared_ptr<Stream>& s);
  void report_cancelled(const std::shared_ptr<Stream>& s);
  void remove_active(const Stream* s);

 private:
  int starved_locked() const;
  std::shared_ptr<Stream> accept_locked(std::unique_lock<std::mutex>& lk, const Deadline& dl);

  std::shared_ptr<Engine> engine_;
  const int limit_;
  std::mutex mu_;
  std::condition_variable cv_, events_cv_;
  std::deque<std::shared_ptr<Stream>> pending_, cancelled_, over_limit_;
  std::unordered_map<const Stream*, std::weak_ptr<Stream>> active_;
  std::atomic<size_t> pending_count_{0};
  std::atomic<int> wakeup_count_{0};
  std::atomic<int> acceptors_{0};
  int sleepers_ = 0, wakeups_ = 0;
  int requested_ = 0;   // workers asked for and not started yet
  int returning_ = 0;   // workers holding a lease (lease_taken)
  int admitted_ = 0;    // calls counted through admit()
  bool spinner_ = false, shutdown_ = false;
  // Which acceptor spins: a worker back from a call takes the spin over (spin_turn_
  // moves on, and the one spinning before sleeps), so in a ping-pong one worker serves
  // and polls and the others sleep, instead of two workers taking turns, each spinning
  // while the other serves: a third busy thread beside the client's on two cores.
  std::atomic<uint64_t> spin_turn_{0};
  std::shared_ptr<Watch> watch_;
};

}  // namespace argrpc
