#include "pool/copier.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/clock.h"

namespace argrpc {

Copier::Copier(size_t parallel_min, int spin_us)
    : parallel_min_(parallel_min), spin_us_(spin_us), helper_([this] { helper_loop(); }) {}

Copier::~Copier() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  helper_.join();
}

namespace {

// memcpy in slices, looking at *abort before each one; false if it was set.
bool copy_slices(uint8_t* dst, const uint8_t* src, size_t n, const std::atomic<bool>* abort) {
  if (!abort) {
    std::memcpy(dst, src, n);
    return true;
  }
  for (size_t off = 0; off < n; off += Copier::kAbortSlice) {
    if (abort->load(std::memory_order_relaxed)) return false;
    std::memcpy(dst + off, src + off, std::min(Copier::kAbortSlice, n - off));
  }
  return true;
}

}  // namespace

bool Copier::copy(void* dst, const void* src, size_t n, const std::atomic<bool>* abort) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if (n < parallel_min_ || !use_mu_.try_lock()) return copy_slices(d, s, n, abort);
  std::lock_guard<std::mutex> use(use_mu_, std::adopt_lock);
  // Split on a page boundary so both halves write whole pages.
  size_t first = (n / 2) & ~size_t(4095);
  job_dst_ = d + first;
  job_src_ = s + first;
  job_n_ = n - first;
  job_abort_ = abort;
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    state_.store(1, std::memory_order_release);
    wake = helper_sleeping_;
  }
  if (wake) cv_.notify_one();
  copy_slices(d, s, first, abort);
  while (state_.load(std::memory_order_acquire) != 2) sched_yield();
  state_.store(0, std::memory_order_relaxed);
  // Either half may have stopped: one look after both settles it.
  return !(abort && abort->load(std::memory_order_acquire));
}

void Copier::helper_loop() {
  for (;;) {
    const uint64_t until = now_us() + static_cast<uint64_t>(spin_us_);
    while (state_.load(std::memory_order_acquire) != 1 && now_us() < until) sched_yield();
    if (state_.load(std::memory_order_acquire) != 1) {
      std::unique_lock<std::mutex> lk(mu_);
      helper_sleeping_ = true;
      cv_.wait(lk, [&] { return stop_ || state_.load(std::memory_order_acquire) == 1; });
      helper_sleeping_ = false;
      if (stop_) return;
    }
    copy_slices(static_cast<uint8_t*>(job_dst_), static_cast<const uint8_t*>(job_src_), job_n_,
                job_abort_);
    state_.store(2, std::memory_order_release);
  }
}

}  // namespace argrpc
