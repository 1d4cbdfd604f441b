#include "common/heap_bound.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "common/fork.h"

namespace argrpc::heap_bound {

namespace {
std::atomic<size_t> g_min_message{0};
std::atomic<size_t> g_retain_max{0};
std::atomic<uint64_t> g_checks{0}, g_settles{0}, g_trims{0}, g_trim_ns{0}, g_free_before{0};
std::atomic<uint64_t> g_last_ns{0};  // the last large message
std::atomic<bool> g_settle_pending{false};
std::atomic<int> g_settle_step{0};  // settle checks done since the last large message
std::atomic<bool> g_settle_all{false};  // a message too large to keep came since
// A large message's buffers are freed after the last check it triggers (the handler's
// response once sent, the caller's request once the call returns or its reply is
// parsed): the engine checks again once no large message came for 0.1 s, 1 s and 10 s.
constexpr uint64_t kSettleNs[] = {100'000'000, 1'000'000'000, 10'000'000'000};
constexpr int kSettleSteps = 3;

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count());
}
// One trim at a time: a second thread would find the heap trimmed. Per process, so a
// forked child is not left with a lock a thread of its parent held.
struct TrimLock {
  const uint64_t born = fork_generation();
  std::mutex mu;
};
}  // namespace

void configure(size_t min_message, size_t retain_max) {
  g_retain_max.store(retain_max, std::memory_order_relaxed);
  g_min_message.store(min_message, std::memory_order_relaxed);
}

namespace {
// A message's buffers take about four times its size (protobuf's encode block is the
// next power of two above it, then the bytes, then the next message's): above a quarter
// of the cap they cannot be kept anyway, so they are given back whole, as glibc's own
// mappings would be, instead of first pushing the heap to the cap beside the pools.
bool too_large_to_keep(size_t len) {
  return len > g_retain_max.load(std::memory_order_relaxed) / 4;
}

// Trims the heap if it holds more than the cap free (`all`: anything free); on whichever
// thread got here.
void check(bool all) {
  // fordblks counts free chunks whose pages an earlier trim already gave back, so a heap
  // left fragmented by one huge message may be trimmed at every large message until
  // those chunks are reused or merge into the top: that costs faults, never memory.
  const size_t free_bytes = ::mallinfo2().fordblks;
  if (!all && free_bytes <= g_retain_max.load(std::memory_order_relaxed)) return;
  std::unique_lock<std::mutex> g(per_process<TrimLock>().mu, std::try_to_lock);
  if (!g.owns_lock()) return;
  const uint64_t t0 = now_ns();
  ::malloc_trim(0);
  g_trims.fetch_add(1, std::memory_order_relaxed);
  g_trim_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  g_free_before.store(free_bytes, std::memory_order_relaxed);
}
}  // namespace

void note_message(size_t len) {
  const size_t min_message = g_min_message.load(std::memory_order_relaxed);
  if (min_message == 0 || len < min_message) return;
  g_checks.fetch_add(1, std::memory_order_relaxed);
  g_last_ns.store(now_ns(), std::memory_order_relaxed);
  const bool all = too_large_to_keep(len);
  if (all) g_settle_all.store(true, std::memory_order_relaxed);
  g_settle_step.store(0, std::memory_order_relaxed);
  g_settle_pending.store(true, std::memory_order_relaxed);
  check(all);
}

void settle() {  // only the progress thread calls it
  if (!g_settle_pending.load(std::memory_order_relaxed)) return;
  const int step = g_settle_step.load(std::memory_order_relaxed);
  if (step >= kSettleSteps) return;
  if (now_ns() - g_last_ns.load(std::memory_order_relaxed) < kSettleNs[step]) return;
  g_settle_step.store(step + 1, std::memory_order_relaxed);
  const bool last = step + 1 == kSettleSteps;
  if (last) g_settle_pending.store(false, std::memory_order_relaxed);
  g_settles.fetch_add(1, std::memory_order_relaxed);
  check(last ? g_settle_all.exchange(false, std::memory_order_relaxed)
             : g_settle_all.load(std::memory_order_relaxed));
}

Stats stats() {
  Stats s;
  s.checks = g_checks.load(std::memory_order_relaxed);
  s.settles = g_settles.load(std::memory_order_relaxed);
  s.trims = g_trims.load(std::memory_order_relaxed);
  s.trim_ns = g_trim_ns.load(std::memory_order_relaxed);
  s.free_before = g_free_before.load(std::memory_order_relaxed);
  return s;
}

}  // namespace argrpc::heap_bound
