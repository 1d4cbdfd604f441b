#include "pool/copier.h"

#include <sched.h>
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

void Copier::copy(void* dst, const void* src, size_t n) {
  if (n < parallel_min_ || !use_mu_.try_lock()) {
    std::memcpy(dst, src, n);
    return;
  }
  std::lock_guard<std::mutex> use(use_mu_, std::adopt_lock);
  // Split on a page boundary so both halves write whole pages.
  size_t first = (n / 2) & ~size_t(4095);
  job_dst_ = static_cast<uint8_t*>(dst) + first;
  job_src_ = static_cast<const uint8_t*>(src) + first;
  job_n_ = n - first;
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    state_.store(1, std::memory_order_release);
    wake = helper_sleeping_;
  }
  if (wake) cv_.notify_one();
  std::memcpy(dst, src, first);
  while (state_.load(std::memory_order_acquire) != 2) sched_yield();
  state_.store(0, std::memory_order_relaxed);
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
    std::memcpy(job_dst_, job_src_, job_n_);
    state_.store(2, std::memory_order_release);
  }
}

}  // namespace argrpc
