// The verbs fabric: the Fabric interface over RC queue pairs (libibverbs, loaded at run
// time through ibv_loader.h). Per connection:
//   QP 0     eager batches as RDMA WRITE_WITH_IMM into the peer's receive ring (the
//            immediate is the batch length; one RECV WR per CQ slot, reposted as each
//            completes), and ring credits as a plain RDMA WRITE of {consumed_bytes,
//            consumed_batches} into the peer's credit mailbox;
//   QP 0..n  rendezvous RDMA READs from the peer's pool, round-robin.
// One CQ and one completion channel per connection: wait_fd() is the channel's fd,
// arm() is ibv_req_notify_cq + a re-poll. Per engine and device (VerbsDomain): the
// device context, the PD and the pool's registrations, shared by every connection.
// Remote access: the ring and mailbox are remote-writable (QP 0 only). The pool has no
// remote rights of its own: each block announced in an RTS gets a type 1 memory window
// (remote read of exactly that block, a fresh rkey per bind), bound and completed before
// the RTS is written and unbound at the FIN; a failed connection deallocates its windows.
// Binds go to a queue pair of their own, connected to itself, which never sends a
// packet: Soft-RoCE replays the local operations still in a send queue when it
// retransmits that queue's remote ones, and a replayed bind (its rkey already advanced)
// fails and leaves the queue pair hung. A device without memory windows falls back to a remote-readable pool, which
// the set-up log and `argrpc doctor` say.
// One .cc per concern (registration, QP set-up, data path, remote access); each group
// below names the file that defines it.
#pragma once
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/mapping.h"
#include "fabric/fabric.h"
#include "fabric/verbs/device.h"
#include "fabric/verbs/ibv_loader.h"
#include "engine_config.h"

namespace argrpc {

class Pool;

namespace verbs {

// RAII for every verbs object. The deleters use the loaded table, which exists
// whenever such an object does.
struct CtxDel { void operator()(ibv_context* p) const { api()->close_device(p); } };
struct PdDel { void operator()(ibv_pd* p) const { api()->dealloc_pd(p); } };
struct MrDel { void operator()(ibv_mr* p) const { api()->dereg_mr(p); } };
struct CqDel { void operator()(ibv_cq* p) const { api()->destroy_cq(p); } };
struct ChanDel { void operator()(ibv_comp_channel* p) const { api()->destroy_comp_channel(p); } };
struct QpDel { void operator()(ibv_qp* p) const { api()->destroy_qp(p); } };
// ibv_dealloc_mw is an inline dispatch through the context's ops: no symbol needed.
struct MwDel { void operator()(ibv_mw* p) const { ibv_dealloc_mw(p); } };
using Ctx = std::unique_ptr<ibv_context, CtxDel>;
using Pd = std::unique_ptr<ibv_pd, PdDel>;
using Mr = std::unique_ptr<ibv_mr, MrDel>;
using Cq = std::unique_ptr<ibv_cq, CqDel>;
using Chan = std::unique_ptr<ibv_comp_channel, ChanDel>;
using Qp = std::unique_ptr<ibv_qp, QpDel>;
using Mw = std::unique_ptr<ibv_mw, MwDel>;

// ---------------------------------------------------------------- verbs_register.cc

// "ibv_reg_mr(what, n bytes): <errno>; the locked-memory limit (ulimit -l) is ..."
std::string reg_mr_error(const std::string& what, size_t len);

// Device context + PD + the pool's registrations, one per (engine pool, device).
class VerbsDomain {
 public:
  static std::shared_ptr<VerbsDomain> get(const Selection& sel, const std::shared_ptr<Pool>& pool);
  VerbsDomain(const Selection& sel, std::shared_ptr<Pool> pool);  // use get()
  ibv_context* ctx() const { return ctx_.get(); }
  ibv_pd* pd() const { return pd_.get(); }
  const ibv_device_attr& attr() const { return attr_; }
  uint64_t pool_addr() const;
  size_t pool_size() const;
  // Keys of a registration covering [p, p+len) of the pool. The pool is registered in
  // growing prefixes (16 MiB, then doubling) as blocks further in are used, so a
  // sparse 1 GiB pool does not pin 1 GiB up front; older prefixes stay registered
  // because their rkeys may be announced. False (why set) if [p, p+len) is not pool
  // memory or registration failed.
  bool pool_keys(const void* p, size_t len, uint32_t* lkey, uint32_t* rkey, std::string* why,
                 ibv_mr** mr = nullptr);
  // Blocks are exposed through memory windows (the device has type 1 windows and
  // ARGRPC_VERBS_NO_WINDOWS is unset), so the pool registration has no remote rights.
  bool windows() const { return windows_; }

 private:
  std::shared_ptr<Pool> pool_;  // outlives the registrations of its memory
  Ctx ctx_;
  Pd pd_;
  ibv_device_attr attr_{};
  bool windows_ = false;
  std::mutex mu_;
  std::vector<Mr> pool_mrs_;
};

// ---------------------------------------------------------------- verbs_endpoint.cc

// The local half, created before the handshake so its blob can be sent to the peer.
// This process's verbs receive rings count against knobs::kVerbsRingBudget: a ring
// that would pass it is halved, down to the smallest ring the connection's eager
// batches fit (four times acc_size, at least 64K). Held by the endpoint, given back
// when it goes.
class RingShare {
 public:
  RingShare() = default;
  RingShare(size_t wanted, size_t acc_size);
  RingShare(RingShare&& o) noexcept : bytes_(o.bytes_) { o.bytes_ = 0; }
  RingShare& operator=(RingShare&& o) noexcept;
  RingShare(const RingShare&) = delete;
  ~RingShare();
  size_t bytes() const { return bytes_; }
  static uint64_t in_use();

 private:
  size_t bytes_ = 0;
};

class VerbsEndpoint {
 public:
  static std::unique_ptr<VerbsEndpoint> create(const ConnConfig& cfg, const VerbsConfig& vcfg,
                                               const Selection& sel, std::shared_ptr<Pool> pool);
  // Everything the peer needs: GID/LID, QPNs and PSNs, ring/mailbox/pool address and
  // keys, MTU, stream window, CQ slots.
  std::string blob() const;
  int qps() const { return static_cast<int>(qps_.size()); }
  // The ring it registered (its share of the budget); the connection may use less.
  size_t ring_size() const { return cfg_.ring_size; }
  const Selection& selection() const { return sel_; }

 private:
  friend class VerbsFabric;
  VerbsEndpoint() = default;
  void make_bind_qp();
  ConnConfig cfg_;
  VerbsConfig vcfg_;
  Selection sel_;
  std::shared_ptr<VerbsDomain> dom_;
  RingShare ring_share_;
  Mapping ring_mem_, mbox_mem_;
  Chan chan_;
  Cq cq_, bind_cq_;
  Mr ring_mr_, mbox_mr_;
  Qp bind_qp_;           // memory-window binds only (when the domain uses windows)
  std::vector<Qp> qps_;  // destroyed first (declared last)
  std::vector<uint32_t> psns_;
  uint32_t sq_depth_ = 0, max_inline_ = 0, max_msg_ = 0, rd_atom_ = 0, init_rd_atom_ = 0;
};

class VerbsFabric final : public Fabric {
 public:
  // verbs_endpoint.cc
  // Validates the peer's blob, brings the QPs to RTR/RTS; throws CoreError.
  VerbsFabric(std::unique_ptr<VerbsEndpoint> local, const std::string& peer_blob);
  ~VerbsFabric() override;

  const char* name() const override { return "verbs"; }
  const uint8_t* ring() const override { return ep_->ring_mem_.data(); }
  // Both ways, the smaller of the two sides' rings (what each registered may be more).
  size_t ring_size() const override { return ring_size_; }
  size_t peer_ring_size() const override { return peer_ring_size_; }
  uint32_t peer_slots() const override { return peer_slots_; }
  size_t peer_stream_window() const override { return peer_window_; }
  // No socket of its own: a dead peer shows as a completion error (retry exceeded).
  int liveness_fd() const override { return -1; }

  // verbs_datapath.cc
  bool write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) override;
  bool read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) override;
  void publish_consumed(uint64_t bytes, uint64_t batches) override;
  void peer_consumed(uint64_t* bytes, uint64_t* batches) const override;
  bool lazy_credits() const override { return true; }
  int poll(Completion* out, int max) override;
  int wait_fd() const override;
  bool arm() override;
  void disarm() override {}  // verbs cannot un-request a notification; a spurious wake-up is harmless
  void ack_wakeup() override;
  std::string error() const override;

  // verbs_windows.cc
  bool exposable(const Block& b, std::string* why) override;
  bool landable(void* dst, size_t len, std::string* why) override;
  RemoteRef expose(const Block& b) override;
  void unexpose(const Block& b) override;
  void shutdown() override;

 private:
  struct Queued {  // a send WR waiting for send-queue room
    int qp;
    ibv_send_wr wr;
    ibv_sge sge;
  };
  struct Window {
    Mw mw;
    uint32_t rkey;  // after the last bind posted or queued
  };
  // verbs_datapath.cc
  bool submit_locked(int qp, ibv_send_wr& wr, ibv_sge& sge);
  void drain_locked();
  void post_credit_locked();
  bool translate(const ibv_wc& wc, Completion* out);
  int qp_index(uint32_t qpn) const;
  void set_error(const std::string& why);
  // verbs_windows.cc
  bool bind_locked(Window& w, ibv_mr* mr, const void* addr, size_t len);

  std::unique_ptr<VerbsEndpoint> ep_;
  int nqp_ = 1;  // QPs in use: the smaller count of the two sides
  uint64_t peer_ring_addr_ = 0, peer_mbox_addr_ = 0, peer_pool_addr_ = 0, peer_pool_size_ = 0;
  uint32_t peer_ring_rkey_ = 0, peer_mbox_rkey_ = 0, peer_slots_ = 0;
  size_t peer_ring_size_ = 0, peer_window_ = 0, ring_size_ = 0;
  // Eager batches above the inline size are staged here at the same offset as in the
  // peer's ring, so a staged batch is never overwritten before the peer consumed it;
  // the tail holds the credit-write sources.
  Mapping staging_mem_;
  Mr staging_mr_;

  std::mutex sq_mu_;  // send-queue accounting, queued WRs, credits, reads
  std::vector<int> sq_free_, queued_on_;
  std::deque<Queued> queued_;
  uint64_t credit_bytes_ = 0, credit_batches_ = 0, credit_seq_ = 0;
  int credit_inflight_ = 0;
  bool credit_dirty_ = false;
  uint32_t rr_ = 0;
  std::unordered_map<uint64_t, uint32_t> read_parts_;  // engine wr_id -> WRs outstanding
  std::unordered_map<uint64_t, Mr> tmp_mrs_;           // reads into non-pool memory
  std::vector<Window> windows_;                        // allocated on first need, reused
  std::vector<size_t> free_windows_;
  std::unordered_map<uintptr_t, size_t> bound_;        // exposed block address -> window

  std::mutex cq_mu_;
  std::vector<ibv_wc> early_;  // completions arm() polled; poll() hands them out first

  mutable std::mutex err_mu_;
  std::string error_;
  std::atomic<bool> fail_pending_{false};  // a failure outside a completion: next poll reports it
  std::atomic<bool> shut_{false};
};

}  // namespace verbs
}  // namespace argrpc
