#include "common/call_stats.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "common/fork.h"

namespace argrpc {

namespace {

// A few seconds of a busy server's calls between two takes; beyond it records are
// counted, not kept, so a stalled taker costs no memory.
constexpr size_t kMaxQueued = 65536;

struct CallQueue {
  const uint64_t born = fork_generation();
  std::mutex mu;
  std::condition_variable cv;
  std::deque<CallRecord> q;
  uint64_t dropped = 0;
  size_t bound = kMaxQueued;
};

// The queue of this process. A forked child gets a new one instead of emptying the
// parent's copy: that copy's mutex may be held by a thread of the parent, which does
// not exist here, so the child never touches it (nor destroys it).
CallQueue& queue() {
  // Never destroyed: engine threads may record at exit.
  static std::atomic<CallQueue*> current{new CallQueue};
  CallQueue* q = current.load(std::memory_order_acquire);
  while (q->born != fork_generation()) {
    auto* fresh = new CallQueue;
    if (current.compare_exchange_strong(q, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread of this child replaced it first: q is now its queue
  }
  return *q;
}

}  // namespace

void record_call(CallRecord r) {
  CallQueue& cq = queue();
  std::lock_guard<std::mutex> g(cq.mu);
  if (cq.q.size() >= cq.bound) {
    ++cq.dropped;
    return;
  }
  cq.q.push_back(std::move(r));
  cq.cv.notify_one();
}

std::vector<CallRecord> take_call_stats(int timeout_ms, uint64_t* dropped) {
  CallQueue& cq = queue();
  std::unique_lock<std::mutex> lk(cq.mu);
  cq.cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return !cq.q.empty() || cq.dropped; });
  std::vector<CallRecord> out(std::make_move_iterator(cq.q.begin()), std::make_move_iterator(cq.q.end()));
  cq.q.clear();
  *dropped = cq.dropped;
  cq.dropped = 0;
  return out;
}

size_t set_call_stats_bound(size_t bound) {
  CallQueue& cq = queue();
  std::lock_guard<std::mutex> g(cq.mu);
  const size_t old = cq.bound;
  cq.bound = bound;
  return old;
}

}  // namespace argrpc
