#include "common/call_stats.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "common/fork.h"
#include "knobs.h"

namespace argrpc {

namespace {

// A few seconds of a busy server's calls between two takes; beyond it records are
// counted, not kept, so a stalled taker costs no memory.
constexpr size_t kMaxQueued = size_t(knobs::kCallRecordsMax);

struct CallQueue {
  const uint64_t born = fork_generation();
  std::mutex mu;
  std::condition_variable cv;
  std::deque<CallRecord> q;
  uint64_t dropped = 0;
  size_t bound = kMaxQueued;
};

CallQueue& queue() { return per_process<CallQueue>(); }

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
