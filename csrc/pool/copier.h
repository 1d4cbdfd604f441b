// Bulk copies with two threads: one thread does not saturate memory bandwidth into
// pre-faulted memory, two come close (docs/design.md, "Bulk bytes"), so large copies are
// split with one helper thread.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>

namespace argrpc {

class Copier {
 public:
  Copier(size_t parallel_min, int spin_us);
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // Copies n bytes; returns when done. Thread-safe: if the helper is busy, the caller
  // copies alone. With `abort`, both threads look at it every kAbortSlice bytes and stop
  // once it is set (the connection the copy is for failed): false then, and the
  // destination holds part of the bytes.
  bool copy(void* dst, const void* src, size_t n, const std::atomic<bool>* abort = nullptr);

  // How much is copied between two looks at `abort`: once the failure is known, a call
  // copying a large message for a dead peer ends within one slice's copy, not the whole
  // message's; a look per slice costs nothing next to the slice's copy.
  static constexpr size_t kAbortSlice = size_t(8) << 20;

 private:
  void helper_loop();

  const size_t parallel_min_;
  const int spin_us_;
  std::mutex use_mu_;  // one split copy at a time
  std::mutex mu_;
  std::condition_variable cv_;
  bool helper_sleeping_ = false;
  bool stop_ = false;
  std::atomic<int> state_{0};  // 0 idle, 1 job posted, 2 job done
  void* job_dst_ = nullptr;
  const void* job_src_ = nullptr;
  size_t job_n_ = 0;
  const std::atomic<bool>* job_abort_ = nullptr;
  std::thread helper_;
};

}  // namespace argrpc
