// The registered buffer pool: one sealed memfd of TF_RDMA_BUF_SIZE bytes per process,
// mapped once. It is sparse until used and grows in slabs, each pre-faulted when it is
// added, so no page fault (and, for verbs, no registration) sits on the hot path while
// a process that never moves a large message does not pay for the cap. Peers map the
// same memfd read-only to pull announced blocks.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "common/clock.h"
#include "common/mapping.h"
#include "common/unique_fd.h"
#include "engine_config.h"

namespace argrpc {

class Pool;

// A block of the pool; returns itself to the pool when destroyed.
class Block {
 public:
  Block() = default;
  Block(std::shared_ptr<Pool> pool, size_t off, size_t len, bool received = false)
      : pool_(std::move(pool)), off_(off), len_(len), received_(received) {}
  Block(Block&&) noexcept = default;
  Block& operator=(Block&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = std::move(o.pool_);
      off_ = o.off_;
      len_ = o.len_;
      received_ = o.received_;
    }
    return *this;
  }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() { release(); }

  bool valid() const { return pool_ != nullptr; }
  uint8_t* data() const;
  size_t offset() const { return off_; }
  size_t size() const { return len_; }
  void release();

 private:
  std::shared_ptr<Pool> pool_;
  size_t off_ = 0, len_ = 0;
  bool received_ = false;  // holds a received message (Pool::try_alloc_received)
};

enum class AllocStatus { kOk, kTimeout, kTooBig, kShutdown, kAborted };

struct PoolStats {
  size_t capacity, grown, in_use;
  size_t received;  // of in_use, what received messages hold
  int waiters;
  uint64_t waits;  // alloc()s that had to wait for room, since the pool was made
};

class Pool : public std::enable_shared_from_this<Pool> {
 public:
  static std::shared_ptr<Pool> create(const EngineConfig& cfg);
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int fd() const { return fd_.get(); }
  size_t capacity() const { return map_.size(); }
  uint8_t* base() const { return map_.data(); }

  // Waits (back-pressure) until `dl` for room. kTooBig: n exceeds the whole pool.
  // kAborted: *abort became true (whoever sets it calls wake_waiters()).
  Block alloc(size_t n, const Deadline& dl, AllocStatus* status,
              const std::atomic<bool>* abort = nullptr);
  // Makes every alloc() look at its abort flag again.
  void wake_waiters();
  // Never waits; an invalid Block if there is no room right now.
  Block try_alloc(size_t n);
  // try_alloc() for a message being received, which the caller then receives into heap
  // memory instead: received messages never hold more than half the pool. A service
  // keeps received messages for as long as its handler likes, and sends wait for room
  // (alloc()); were the pool full of what it received, a handler that answers before
  // letting go of its requests would wait for itself.
  Block try_alloc_received(size_t n);
  PoolStats stats() const;
  void shutdown();

 private:
  friend class Block;
  Pool(UniqueFd fd, Mapping map, size_t slab);
  bool take_locked(size_t n, size_t* off);
  bool grow_locked(size_t need);
  // Room for n bytes: a free range, else one the pool grows into.
  bool take_or_grow_locked(size_t n, size_t* off);
  void give_back(size_t off, size_t len, bool received);

  UniqueFd fd_;
  Mapping map_;
  const size_t slab_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<size_t, size_t> free_;  // offset -> length, coalesced
  size_t grown_ = 0, in_use_ = 0, received_ = 0;
  int waiters_ = 0;
  uint64_t waits_ = 0;
  bool shutdown_ = false;
};

constexpr size_t kPageSize = 4096;
inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace argrpc
