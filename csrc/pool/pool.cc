#include "pool/pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>

#include "common/error.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace argrpc {

uint8_t* Block::data() const { return pool_ ? pool_->base() + off_ : nullptr; }

void Block::release() {
  if (pool_) pool_->give_back(off_, len_, received_);
  pool_.reset();
}

std::shared_ptr<Pool> Pool::create(const EngineConfig& cfg) {
  const size_t cap = round_up(cfg.buf_size, kPageSize);
  UniqueFd fd(::memfd_create("argrpc-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) throw CoreError(errno_text("memfd_create(pool)"));
  if (::ftruncate(fd.get(), static_cast<off_t>(cap)) != 0)
    throw CoreError(errno_text("ftruncate(pool, TF_RDMA_BUF_SIZE)"));
  // Sealed so a peer holding the fd cannot shrink it under our mapping (SIGBUS).
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    throw CoreError(errno_text("sealing the pool memfd"));
  void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd.get(), 0);
  if (p == MAP_FAILED) throw CoreError(errno_text("mmap(pool)"));
  const size_t slab = round_up(cfg.slab_size ? cfg.slab_size : 64 * MiB, kPageSize);
  return std::shared_ptr<Pool>(new Pool(std::move(fd), Mapping(p, cap), slab));
}

Pool::Pool(UniqueFd fd, Mapping map, size_t slab)
    : fd_(std::move(fd)), map_(std::move(map)), slab_(slab) {}

bool Pool::grow_locked(size_t need) {
  if (grown_ >= capacity()) return false;
  // Geometric growth (slab, slab, 2x, 4x ...): few growth steps for a busy process,
  // little pre-faulted memory for a quiet one.
  size_t add = round_up(std::max({need, slab_, grown_}), kPageSize);
  add = std::min(add, capacity() - grown_);
  if (add == 0) return false;
  uint8_t* start = base() + grown_;
  // Pre-fault the whole slab now: a page fault on the hot path costs more than the copy
  // into that page (docs/design.md, "Bulk bytes").
  if (::madvise(start, add, MADV_POPULATE_WRITE) != 0) {
    for (size_t i = 0; i < add; i += kPageSize) start[i] = 0;
  }
  size_t off = grown_;
  grown_ += add;
  // Insert and coalesce with a free range ending at `off`.
  auto it = free_.lower_bound(off);
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == off) {
      prev->second += add;
      return true;
    }
  }
  free_[off] = add;
  return true;
}

bool Pool::take_locked(size_t n, size_t* off) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= n) {
      *off = it->first;
      size_t rest = it->second - n;
      size_t rest_off = it->first + n;
      free_.erase(it);
      if (rest) free_[rest_off] = rest;
      in_use_ += n;
      return true;
    }
  }
  return false;
}

bool Pool::take_or_grow_locked(size_t n, size_t* off) {
  return take_locked(n, off) || (grow_locked(n) && take_locked(n, off));
}

Block Pool::alloc(size_t n, const Deadline& dl, AllocStatus* status,
                  const std::atomic<bool>* abort) {
  const size_t len = round_up(n ? n : 1, kPageSize);
  if (len > capacity()) {
    *status = AllocStatus::kTooBig;
    return Block();
  }
  std::unique_lock<std::mutex> lk(mu_);
  bool waited = false;
  for (;;) {
    if (shutdown_) {
      *status = AllocStatus::kShutdown;
      return Block();
    }
    size_t off;
    if (take_or_grow_locked(len, &off)) {
      *status = AllocStatus::kOk;
      return Block(shared_from_this(), off, len);
    }
    if (dl.expired()) {
      *status = AllocStatus::kTimeout;
      return Block();
    }
    // Read under mu_, and wake_waiters() takes mu_: a flag set after this read comes
    // with a notify this wait receives.
    if (abort && abort->load(std::memory_order_acquire)) {
      *status = AllocStatus::kAborted;
      return Block();
    }
    if (!waited) {  // counted once per allocation, however often it wakes
      waited = true;
      ++waits_;
    }
    ++waiters_;
    if (dl.infinite()) cv_.wait(lk);
    else cv_.wait_until(lk, dl.at());
    --waiters_;
  }
}

Block Pool::try_alloc(size_t n) {
  const size_t len = round_up(n ? n : 1, kPageSize);
  if (len > capacity()) return Block();
  std::lock_guard<std::mutex> g(mu_);
  size_t off;
  if (take_or_grow_locked(len, &off))
    return Block(shared_from_this(), off, len);
  return Block();
}

Block Pool::try_alloc_received(size_t n) {
  const size_t len = round_up(n ? n : 1, kPageSize);
  std::lock_guard<std::mutex> g(mu_);
  if (received_ + len > capacity() / 2) return Block();
  size_t off;
  if (take_or_grow_locked(len, &off)) {
    received_ += len;
    return Block(shared_from_this(), off, len, true);
  }
  return Block();
}

void Pool::give_back(size_t off, size_t len, bool received) {
  {
    std::lock_guard<std::mutex> g(mu_);
    in_use_ -= len;
    if (received) received_ -= len;
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + len == next->first) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += len;
        len = 0;
      }
    }
    if (len) free_[off] = len;
    if (waiters_ == 0) return;
  }
  cv_.notify_all();
}

PoolStats Pool::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return PoolStats{capacity(), grown_, in_use_, received_, waiters_, waits_};
}

void Pool::wake_waiters() {
  { std::lock_guard<std::mutex> g(mu_); }
  cv_.notify_all();
}

void Pool::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

}  // namespace argrpc
