// Shared-memory fabric for two processes on one host. Each side owns a sealed memfd
// segment holding its receive ring and a completion queue of immediates; the peer maps
// it read-write and "RDMA-writes" by memcpy, plus a doorbell rung only when the owner
// announced it sleeps. Rendezvous reads copy from the peer's pool memfd, mapped
// read-only. Both fds are exchanged over an authenticated Unix socket (Python side); the
// socket stays open as the connection's only descriptor: a byte on it is the peer's
// doorbell, its hang-up means the peer is gone. Neither memfd is kept once mapped, and
// the ring's pages are faulted in as the peer first writes them, so an idle connection
// holds one descriptor and the few pages it used.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/mapping.h"
#include "common/unique_fd.h"
#include "fabric/fabric.h"
#include "engine_config.h"

namespace argrpc {

class Copier;
class Pool;
struct ShmHeader;

// The local half, created before the handshake so its fds can be sent to the peer.
class ShmEndpoint {
 public:
  static std::unique_ptr<ShmEndpoint> create(const ConnConfig& cfg);
  int ring_fd() const { return seg_fd_.get(); }
  size_t ring_size() const { return ring_size_; }

 private:
  friend class ShmFabric;
  UniqueFd seg_fd_;  // sent to the peer in the handshake, closed once attached
  Mapping seg_;
  size_t ring_size_ = 0;
  uint32_t slots_ = 0;
};

struct ShmPeer {
  UniqueFd ring_fd, pool_fd;
  size_t ring_size = 0, pool_size = 0;
};

class ShmFabric final : public Fabric {
 public:
  // Validates everything the peer handed over (sizes, seals, fd kinds); throws CoreError.
  // `own_wake_fd` (not owned; -1 for none) is the eventfd that wakes this process's
  // progress thread when a read of ours completes while it sleeps.
  ShmFabric(std::unique_ptr<ShmEndpoint> local, ShmPeer peer, UniqueFd sock,
            std::shared_ptr<Pool> pool, Copier* copier, int own_wake_fd);
  ~ShmFabric() override;

  const char* name() const override { return "shm"; }
  const uint8_t* ring() const override;
  size_t ring_size() const override { return local_->ring_size_; }
  size_t peer_ring_size() const override { return peer_ring_size_; }
  uint32_t peer_slots() const override { return peer_slots_; }
  size_t peer_stream_window() const override { return peer_window_; }
  bool write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) override;
  RemoteRef expose(const Block& b) override;
  bool read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) override;
  const uint8_t* peer_view(const RemoteRef& src, size_t len) const override;
  size_t peer_view_budget() const override { return peer_pool_.size() / 4; }
  void publish_consumed(uint64_t bytes, uint64_t batches) override;
  void peer_consumed(uint64_t* bytes, uint64_t* batches) const override;
  int poll(Completion* out, int max) override;
  int wait_fd() const override { return sock_.get(); }
  bool arm() override;
  void disarm() override;
  void ack_wakeup() override;
  void nudge() override;
  int liveness_fd() const override { return sock_.get(); }
  bool peer_gone() const override;
  void shutdown() override;
  std::string error() const override;

 private:
  void ring_own_doorbell_if_armed();

  std::unique_ptr<ShmEndpoint> local_;
  ShmHeader* local_hdr_;
  Mapping peer_seg_, peer_pool_;
  UniqueFd sock_;
  int own_wake_fd_;
  ShmHeader* peer_hdr_ = nullptr;
  uint8_t* peer_ring_ = nullptr;
  uint32_t* peer_cq_ = nullptr;
  size_t peer_ring_size_ = 0, peer_window_ = 0;
  uint32_t peer_slots_ = 0;
  uint64_t sent_batches_ = 0;   // our producer index into the peer's CQ
  uint64_t cq_tail_ = 0;        // our consumer index into our CQ
  std::shared_ptr<Pool> pool_;
  Copier* copier_;
  std::mutex local_mu_;
  std::vector<uint64_t> local_done_;  // finished reads
  std::atomic<bool> local_pending_{false};
  std::string error_;
  std::atomic<bool> shut_{false};
};

}  // namespace argrpc
