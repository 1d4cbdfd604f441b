// The data path: eager WRITE_WITH_IMMs, rendezvous READs and credit WRITEs posted (or
// queued while a send queue is full), the CQ polled and its completions turned into the
// engine's, and the completion channel armed and drained.
#include <arpa/inet.h>
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "fabric/verbs/verbs_fabric.h"
#include "fabric/verbs/verbs_internal.h"

namespace argrpc {
namespace verbs {

namespace {

const char* tag_name(Tag t) {
  switch (t) {
    case kTagRecv: return "receive of an RDMA WRITE_WITH_IMM";
    case kTagEager: return "RDMA WRITE_WITH_IMM (eager batch)";
    case kTagCredit: return "RDMA WRITE (ring credits)";
    case kTagRead: return "RDMA READ (rendezvous)";
    case kTagBind: return "memory window bind";
  }
  return "unknown work request";
}

}  // namespace

int VerbsFabric::wait_fd() const { return ep_->chan_->fd; }

void VerbsFabric::set_error(const std::string& why) {
  std::lock_guard<std::mutex> g(err_mu_);
  if (error_.empty()) error_ = why;
}

std::string VerbsFabric::error() const {
  std::lock_guard<std::mutex> g(err_mu_);
  return error_;
}

int VerbsFabric::qp_index(uint32_t qpn) const {
  for (int i = 0; i < nqp_; ++i)
    if (ep_->qps_[i]->qp_num == qpn) return i;
  return -1;
}

bool VerbsFabric::submit_locked(int qp, ibv_send_wr& wr, ibv_sge& sge) {
  if (sq_free_[qp] > 0 && queued_on_[qp] == 0) {
    wr.sg_list = wr.num_sge ? &sge : nullptr;
    wr.next = nullptr;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ep_->qps_[qp].get(), &wr, &bad)) {
      set_error(std::string("ibv_post_send(") + tag_name(tag_of(wr.wr_id)) + ") failed: " + std::strerror(rc));
      fail_pending_.store(true);
      return false;
    }
    --sq_free_[qp];
    return true;
  }
  // Send queue full (completions not polled yet): keep order per QP and post from
  // poll() as completions free room.
  queued_.push_back(Queued{qp, wr, sge});
  ++queued_on_[qp];
  return true;
}

void VerbsFabric::drain_locked() {
  if (queued_.empty() || shut_.load()) return;
  std::deque<Queued> rest;
  std::vector<bool> blocked(static_cast<size_t>(nqp_), false);
  for (auto& q : queued_) {
    if (blocked[q.qp] || sq_free_[q.qp] == 0) {
      blocked[q.qp] = true;
      rest.push_back(q);
      continue;
    }
    q.wr.sg_list = q.wr.num_sge ? &q.sge : nullptr;
    q.wr.next = nullptr;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ep_->qps_[q.qp].get(), &q.wr, &bad)) {
      set_error(std::string("ibv_post_send(") + tag_name(tag_of(q.wr.wr_id)) + ") failed: " + std::strerror(rc));
      fail_pending_.store(true);
      blocked[q.qp] = true;
      rest.push_back(q);
      continue;
    }
    --sq_free_[q.qp];
    --queued_on_[q.qp];
  }
  queued_.swap(rest);
}

bool VerbsFabric::write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) {
  if (shut_.load(std::memory_order_relaxed)) return false;
  if (remote_off > peer_ring_size_ || len > peer_ring_size_ - remote_off) return false;
  std::lock_guard<std::mutex> g(sq_mu_);
  ibv_send_wr wr{};
  ibv_sge sge{};
  wr.wr_id = tag_id(kTagEager);
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = peer_ring_addr_ + remote_off;
  wr.wr.rdma.rkey = peer_ring_rkey_;
  wr.num_sge = len ? 1 : 0;
  const bool direct = sq_free_[0] > 0 && queued_on_[0] == 0;
  if (direct && len <= ep_->max_inline_) {
    // Inline: the provider copies the bytes at post time, so src may go right after.
    wr.send_flags |= IBV_SEND_INLINE;
    sge = ibv_sge{reinterpret_cast<uintptr_t>(src), len, 0};
  } else {
    uint8_t* st = staging_mem_.data() + remote_off;
    std::memcpy(st, src, len);
    sge = ibv_sge{reinterpret_cast<uintptr_t>(st), len, staging_mr_->lkey};
  }
  return submit_locked(0, wr, sge);
}

bool VerbsFabric::read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) {
  if (shut_.load(std::memory_order_relaxed)) return false;
  // Only memory inside the pool the peer announced at connection time.
  if (src.addr < peer_pool_addr_) return false;
  const uint64_t off = src.addr - peer_pool_addr_;
  if (off > peer_pool_size_ || len > peer_pool_size_ - off || len == 0) return false;
  if (value_of(wr_id) != wr_id) return false;
  std::lock_guard<std::mutex> g(sq_mu_);
  uint32_t lkey = 0;
  if (!ep_->dom_->pool_keys(dst, len, &lkey, nullptr, nullptr)) {
    // The engine fell back to heap memory (pool full): register it for this read.
    Mr mr(api()->reg_mr(ep_->dom_->pd(), dst, len, IBV_ACCESS_LOCAL_WRITE));
    if (!mr) {
      set_error(reg_mr_error("rendezvous destination", len));
      fail_pending_.store(true);
      return true;  // the connection fails with the reason on the next poll()
    }
    lkey = mr->lkey;
    tmp_mrs_[wr_id] = std::move(mr);
  }
  const size_t part = ep_->max_msg_;
  read_parts_[wr_id] = static_cast<uint32_t>((len + part - 1) / part);
  for (size_t o = 0; o < len; o += part) {
    const uint32_t n = static_cast<uint32_t>(std::min(part, len - o));
    ibv_send_wr wr{};
    ibv_sge sge{reinterpret_cast<uintptr_t>(dst) + o, n, lkey};
    wr.wr_id = tag_id(kTagRead, wr_id);
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = src.addr + o;
    wr.wr.rdma.rkey = src.key;
    // Round-robin, skipping QPs whose send queue is full.
    int qp = static_cast<int>(rr_++ % static_cast<uint32_t>(nqp_));
    for (int k = 0; k < nqp_; ++k) {
      const int c = (qp + k) % nqp_;
      if (sq_free_[c] > 0 && queued_on_[c] == 0) {
        qp = c;
        break;
      }
    }
    if (!submit_locked(qp, wr, sge)) return true;  // fail_pending_ reports it
  }
  return true;
}

void VerbsFabric::publish_consumed(uint64_t bytes, uint64_t batches) {
  std::lock_guard<std::mutex> g(sq_mu_);
  credit_bytes_ = bytes;
  credit_batches_ = batches;
  post_credit_locked();
}

void VerbsFabric::post_credit_locked() {
  if (shut_.load(std::memory_order_relaxed)) return;
  // Credits are cumulative: if too many are in flight, the latest values go out when
  // one completes.
  if (credit_inflight_ >= kCreditInflight || sq_free_[0] == 0) {
    credit_dirty_ = true;
    return;
  }
  credit_dirty_ = false;
  auto* slot = reinterpret_cast<Credits*>(staging_mem_.data() + peer_ring_size_) + (credit_seq_++ % kCreditSlots);
  slot->consumed_bytes = credit_bytes_;
  slot->consumed_batches = credit_batches_;
  ibv_send_wr wr{};
  ibv_sge sge{reinterpret_cast<uintptr_t>(slot), sizeof(Credits), staging_mr_->lkey};
  wr.wr_id = tag_id(kTagCredit);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.num_sge = 1;
  wr.sg_list = &sge;
  wr.wr.rdma.remote_addr = peer_mbox_addr_;
  wr.wr.rdma.rkey = peer_mbox_rkey_;
  ibv_send_wr* bad = nullptr;
  // Posted directly (credits need no order against queued eager writes).
  if (int rc = ibv_post_send(ep_->qps_[0].get(), &wr, &bad)) {
    set_error(std::string("ibv_post_send(ring credits) failed: ") + std::strerror(rc));
    fail_pending_.store(true);
    return;
  }
  --sq_free_[0];
  ++credit_inflight_;
}

void VerbsFabric::peer_consumed(uint64_t* bytes, uint64_t* batches) const {
  // Written by the peer's RDMA WRITE; both counters only grow, so a stale pair only
  // understates the credit.
  const auto* c = reinterpret_cast<const Credits*>(ep_->mbox_mem_.data());
  *batches = __atomic_load_n(&c->consumed_batches, __ATOMIC_ACQUIRE);
  *bytes = __atomic_load_n(&c->consumed_bytes, __ATOMIC_ACQUIRE);
}

bool VerbsFabric::translate(const ibv_wc& wc, Completion* out) {
  const Tag tag = tag_of(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    // wc.opcode is undefined on errors: the work request is named from our wr_id.
    char vendor[32];
    std::snprintf(vendor, sizeof vendor, "0x%x", wc.vendor_err);
    set_error("RDMA completion error on " + ep_->sel_.device + " QP " + std::to_string(wc.qp_num) + ": " +
              api()->wc_status_str(wc.status) + " (" + tag_name(tag) + ", status " +
              std::to_string(int(wc.status)) + ", vendor_err " + vendor + ")");
    *out = Completion{};
    out->kind = Completion::kError;
    return true;
  }
  if (tag == kTagRecv) {
    if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM)) {
      set_error("peer sent an unexpected operation (opcode " + std::to_string(int(wc.opcode)) + ") on QP 0");
      *out = Completion{};
      out->kind = Completion::kError;
      return true;
    }
    ibv_recv_wr rw{};
    rw.wr_id = tag_id(kTagRecv);
    ibv_recv_wr* bad = nullptr;
    if (!shut_.load(std::memory_order_relaxed))
      if (int rc = ibv_post_recv(ep_->qps_[0].get(), &rw, &bad)) {
        set_error(std::string("ibv_post_recv failed: ") + std::strerror(rc));
        fail_pending_.store(true);
      }
    *out = Completion{};
    out->kind = Completion::kRecv;
    out->len = ntohl(wc.imm_data);
    return true;
  }
  // A send-side completion: room in that send queue again.
  std::lock_guard<std::mutex> g(sq_mu_);
  const int qi = qp_index(wc.qp_num);
  if (qi >= 0) ++sq_free_[qi];
  bool produced = false;
  if (tag == kTagCredit) {
    --credit_inflight_;
  } else if (tag == kTagRead) {
    const uint64_t id = value_of(wc.wr_id);
    auto it = read_parts_.find(id);
    if (it != read_parts_.end() && --it->second == 0) {
      read_parts_.erase(it);
      tmp_mrs_.erase(id);
      *out = Completion{};
      out->kind = Completion::kReadDone;
      out->wr_id = id;
      produced = true;
    }
  }
  drain_locked();
  if (credit_dirty_) post_credit_locked();
  return produced;
}

int VerbsFabric::poll(Completion* out, int max) {
  std::lock_guard<std::mutex> g(cq_mu_);
  int n = 0;
  if (max <= 0) return 0;
  if (fail_pending_.load(std::memory_order_acquire)) {
    out[0] = Completion{};
    out[0].kind = Completion::kError;
    return 1;
  }
  size_t i = 0;
  for (; i < early_.size() && n < max; ++i)
    if (translate(early_[i], &out[n])) ++n;
  early_.erase(early_.begin(), early_.begin() + static_cast<long>(i));
  while (n < max) {
    ibv_wc wcs[32];
    // Each WC yields at most one Completion, so never take more than there is room for.
    const int k = ibv_poll_cq(ep_->cq_.get(), std::min(32, max - n), wcs);
    if (k < 0) {
      set_error("ibv_poll_cq failed");
      out[n] = Completion{};
      out[n++].kind = Completion::kError;
      break;
    }
    if (k == 0) break;
    for (int j = 0; j < k; ++j)
      if (translate(wcs[j], &out[n])) ++n;
  }
  return n;
}

bool VerbsFabric::arm() {
  std::lock_guard<std::mutex> g(cq_mu_);
  if (!early_.empty() || fail_pending_.load()) return false;
  if (ibv_req_notify_cq(ep_->cq_.get(), 0) != 0) return false;
  // A completion that arrived before the request raised no event: look once more and
  // keep what we find for poll().
  ibv_wc wcs[16];
  const int k = ibv_poll_cq(ep_->cq_.get(), 16, wcs);
  if (k > 0) early_.insert(early_.end(), wcs, wcs + k);
  return k == 0;
}

void VerbsFabric::ack_wakeup() {
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  unsigned n = 0;
  while (api()->get_cq_event(ep_->chan_.get(), &cq, &ctx) == 0) ++n;  // fd is non-blocking
  if (n) api()->ack_cq_events(ep_->cq_.get(), n);
}

}  // namespace verbs
}  // namespace argrpc
