// Completions for an event loop. An asyncio loop cannot sleep in the engine, so the
// calls it owns report state changes here instead: each call (and an asyncio server)
// holds a Watch, a state change posts the watch's token once until the loop drains it,
// and the first post after a drain writes an eventfd the loop watches. One notifier
// per loop; the loop reads what changed and asks the calls without blocking.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

namespace argrpc {

class Engine;
class Notifier;

// A call's or a server's subscription: posted at most once per drain.
class Watch : public std::enable_shared_from_this<Watch> {
 public:
  Watch(std::shared_ptr<Notifier> n, uint64_t token) : notifier_(std::move(n)), token_(token) {}
  // Any thread, under any lock: takes only the notifier's own.
  void fire();
  uint64_t token() const { return token_; }

 private:
  friend class Notifier;
  const std::shared_ptr<Notifier> notifier_;
  const uint64_t token_;
  std::atomic<bool> posted_{false};
};

class Notifier : public std::enable_shared_from_this<Notifier> {
 public:
  Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  int fd() const { return efd_.get(); }
  // The tokens posted since the last drain, each once, and re-arms their watches: a
  // change after this returns posts again.
  std::vector<uint64_t> drain();
  bool pending() const { return count_.load(std::memory_order_acquire) > 0; }
  // The loop had nothing else to do: drive the engine for up to spin_us (or until
  // `limit_us` from now, if sooner) while nothing is posted, then drain. The loop's own
  // thread is awake meanwhile, so posts do not write the eventfd.
  //
  // When something came, the loop's thread goes on counting as a poller while it runs
  // what came (a lease, as a server worker's on its way back to accept(),
  // engine/polling_lease.h): a peer's next message, written meanwhile (a client's next
  // request, answered to within the loop's callbacks), then rings no doorbell and wakes
  // no progress thread, a third busy thread beside the loop and its peer; the loop reads
  // it on its next poll. The loop's thread ends the lease there, or with end_lease()
  // before it sleeps or closes; one the loop keeps lease_check_ms (it stopped without
  // sleeping, or runs a long callback) the progress thread ends (expire_lease).
  std::vector<uint64_t> poll(Engine& engine, int64_t limit_us);
  // Any thread; cheap without a lease (the bindings' notifier also ends one left when it
  // goes). What ending it posts writes the eventfd, from the looker's thread too: that
  // thread ends the lease after its last look at pending(), just before it sleeps.
  void end_lease();
  bool leased() const { return leased_.load(std::memory_order_acquire); }
  // The progress thread of `engine`, which holds this lease, at `now_us`.
  void expire_lease(Engine& engine, uint64_t now_us);
  ~Notifier();
  // The loop's thread looks at pending() before it sleeps (a selector loop that polls),
  // so a post made on that thread, by its own engine calls, need not write the
  // eventfd: that write would only make the loop take one more turn to read it.
  void set_looker(std::thread::id t) { looker_.store(t, std::memory_order_release); }

 private:
  friend class Watch;
  void post(std::shared_ptr<Watch> w);
  void signal_locked();  // under mu_: the eventfd counts one, unless it already does

  UniqueFd efd_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Watch>> posted_;
  std::atomic<size_t> count_{0};
  bool signalled_ = false;  // the eventfd holds a count nobody read yet
  bool polling_ = false;    // the loop's thread is in poll(): no need to wake it
  std::atomic<std::thread::id> looker_{};  // see set_looker(); none by default
  // The lease (poll): taken and ended by whoever flips `leased_`. The engine is kept
  // from the first lease on (the loop's thread alone touches the pointer; the progress
  // thread compares the address).
  std::shared_ptr<Engine> lease_engine_;
  std::atomic<const Engine*> lease_engine_at_{nullptr};
  std::atomic<bool> leased_{false};
  std::atomic<uint64_t> leased_at_us_{0};
  uint64_t lease_generation_ = 0;
};

}  // namespace argrpc
