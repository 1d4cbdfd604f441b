// Endpoint and QP setup: the local half (CQ, channel, ring and mailbox, QPs in INIT, the
// blob the peer needs), then connecting it to the peer's blob (RTR, RTS) and teardown.
#include <fcntl.h>
#include <algorithm>
#include <cstring>
#include <random>

#include "common/error.h"
#include "fabric/verbs/verbs_fabric.h"
#include "common/knob_check.h"
#include "fabric/verbs/verbs_internal.h"

namespace argrpc {
namespace verbs {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the blob is little-endian host order");

constexpr uint64_t kBlobMagic = 0x31766273627276ULL;  // "vrbsbv1"
// 2: both sides use the smaller of the two rings (a version 1 peer would use its own).
constexpr uint32_t kBlobVersion = 2;

std::atomic<uint64_t> g_ring_bytes{0};

struct BlobHead {
  uint64_t magic;
  uint32_t version, qps;
  uint8_t gid[16];
  uint32_t lid, mtu_enum;
  uint32_t ethernet, cq_slots;
  uint64_t ring_addr, ring_size;
  uint32_t ring_rkey, mbox_rkey;
  uint64_t mbox_addr, pool_addr, pool_size, stream_window;
  uint32_t rd_atom, reserved;
};
struct BlobQp {
  uint32_t qpn, psn;
};
static_assert(sizeof(BlobHead) == 112, "blob layout is fixed");

}  // namespace

RingShare::RingShare(size_t wanted, size_t acc_size) {
  size_t least = size_t(knobs::kRingSize.lo);
  while (least < 4 * acc_size) least *= 2;
  const uint64_t budget = uint64_t(knobs::kVerbsRingBudget);
  const uint64_t used = g_ring_bytes.load(std::memory_order_relaxed);
  size_t ring = wanted;
  while (ring / 2 >= least && used + ring > budget) ring /= 2;
  bytes_ = ring;
  g_ring_bytes.fetch_add(ring, std::memory_order_relaxed);
}

RingShare& RingShare::operator=(RingShare&& o) noexcept {
  if (this != &o) {
    g_ring_bytes.fetch_sub(bytes_, std::memory_order_relaxed);
    bytes_ = o.bytes_;
    o.bytes_ = 0;
  }
  return *this;
}

RingShare::~RingShare() { g_ring_bytes.fetch_sub(bytes_, std::memory_order_relaxed); }

uint64_t RingShare::in_use() { return g_ring_bytes.load(std::memory_order_relaxed); }

std::unique_ptr<VerbsEndpoint> VerbsEndpoint::create(const ConnConfig& cfg, const VerbsConfig& vcfg,
                                                     const Selection& sel, std::shared_ptr<Pool> pool) {
  const Api& a = require();
  std::unique_ptr<VerbsEndpoint> ep(new VerbsEndpoint());
  ep->cfg_ = cfg;
  ep->vcfg_ = vcfg;
  ep->sel_ = sel;
  ep->dom_ = VerbsDomain::get(sel, pool);
  ibv_context* ctx = ep->dom_->ctx();
  const ibv_device_attr& da = ep->dom_->attr();
  const int n = vcfg.qps;
  if (int64_t(cfg.cq_slots) > da.max_qp_wr)
    throw CoreError("cq_slots " + std::to_string(cfg.cq_slots) + " exceeds the device's max_qp_wr " +
                    std::to_string(da.max_qp_wr));
  // Each QP's send queue gets an equal share of what the CQ has left after the
  // receive slots, so the CQ can never overflow (an overflow kills every QP on it).
  const int64_t cqe = std::min<int64_t>(vcfg.cq_depth, da.max_cqe);
  const int64_t sq = std::min<int64_t>((cqe - int64_t(cfg.cq_slots)) / n, da.max_qp_wr);
  if (sq < 16)
    throw CoreError("TF_RDMA_CQ_DEPTH " + std::to_string(vcfg.cq_depth) + " (device max_cqe " +
                    std::to_string(da.max_cqe) + ") leaves fewer than 16 send-queue entries per QP after " +
                    std::to_string(cfg.cq_slots) + " receive slots");
  ep->sq_depth_ = static_cast<uint32_t>(sq);
  ep->rd_atom_ = static_cast<uint32_t>(std::max(1, da.max_qp_rd_atom));
  ep->init_rd_atom_ = static_cast<uint32_t>(std::max(1, da.max_qp_init_rd_atom));
  ibv_port_attr pa{};
  if (query_port(ctx, static_cast<uint8_t>(sel.port), &pa) != 0) throw CoreError(errno_text("ibv_query_port"));
  ep->max_msg_ = pa.max_msg_sz ? std::min<uint64_t>(pa.max_msg_sz, 1u << 30) : (1u << 30);

  ep->chan_.reset(a.create_comp_channel(ctx));
  if (!ep->chan_) throw CoreError(errno_text("ibv_create_comp_channel"));
  // Non-blocking: ack_wakeup() drains events without ever sleeping in read().
  const int fl = ::fcntl(ep->chan_->fd, F_GETFL);
  if (fl < 0 || ::fcntl(ep->chan_->fd, F_SETFL, fl | O_NONBLOCK) != 0)
    throw CoreError(errno_text("fcntl(completion channel)"));
  ep->cq_.reset(a.create_cq(ctx, static_cast<int>(cqe), nullptr, ep->chan_.get(), 0));
  if (!ep->cq_) throw CoreError(errno_text("ibv_create_cq(" + std::to_string(cqe) + ")"));

  ep->ring_share_ = RingShare(cfg.ring_size, cfg.acc_size);
  ep->cfg_.ring_size = ep->ring_share_.bytes();  // what the blob announces
  ep->ring_mem_ = map_anon(ep->cfg_.ring_size, "verbs ring");
  ep->mbox_mem_ = map_anon(kMboxBytes, "verbs credit mailbox");
  ibv_pd* pd = ep->dom_->pd();
  ep->ring_mr_ = reg(pd, ep->ring_mem_.data(), ep->cfg_.ring_size,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "ring");
  ep->mbox_mr_ = reg(pd, ep->mbox_mem_.data(), kMboxBytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
                     "credit mailbox");

  std::random_device rd;
  for (int i = 0; i < n; ++i) {
    ibv_qp_init_attr ia{};
    ia.send_cq = ep->cq_.get();
    ia.recv_cq = ep->cq_.get();
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = ep->sq_depth_;
    // Only QP 0 receives (WRITE_WITH_IMM consumes a RECV); the others need none.
    ia.cap.max_recv_wr = i == 0 ? cfg.cq_slots : 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = 256;
    Qp qp(a.create_qp(pd, &ia));
    if (!qp) {  // some providers have no inline data
      ia.cap.max_inline_data = 0;
      qp.reset(a.create_qp(pd, &ia));
    }
    if (!qp) throw CoreError(errno_text("ibv_create_qp(RC, send queue " + std::to_string(ep->sq_depth_) + ")"));
    if (i == 0) ep->max_inline_ = ia.cap.max_inline_data;
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_INIT;
    at.pkey_index = 0;
    at.port_num = static_cast<uint8_t>(sel.port);
    // Narrow: the peer writes (ring, mailbox) only through QP 0; every QP serves READs.
    at.qp_access_flags = IBV_ACCESS_REMOTE_READ | (i == 0 ? IBV_ACCESS_REMOTE_WRITE : 0);
    if (a.modify_qp(qp.get(), &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0)
      throw CoreError(errno_text("ibv_modify_qp(INIT)"));
    ep->psns_.push_back(rd() & 0xffffff);
    ep->qps_.push_back(std::move(qp));
  }
  if (ep->dom_->windows()) ep->make_bind_qp();
  // One RECV per CQ slot: the peer never has more than cq_slots batches unconsumed
  // and each is reposted as soon as it is polled. No SGE: the data lands by RDMA.
  std::vector<ibv_recv_wr> wrs(cfg.cq_slots);
  for (size_t i = 0; i < wrs.size(); ++i) {
    wrs[i] = ibv_recv_wr{};
    wrs[i].wr_id = tag_id(kTagRecv);
    wrs[i].next = i + 1 < wrs.size() ? &wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(ep->qps_[0].get(), wrs.data(), &bad))
    throw CoreError(std::string("ibv_post_recv: ") + std::strerror(rc));
  return ep;
}

// A queue pair connected to itself that only ever executes memory-window binds (see
// verbs_fabric.h): it sends no packet, so nothing on it is ever retransmitted.
void VerbsEndpoint::make_bind_qp() {
  const Api& a = require();
  bind_cq_.reset(a.create_cq(dom_->ctx(), kBindSlots, nullptr, nullptr, 0));
  if (!bind_cq_) throw CoreError(errno_text("ibv_create_cq(memory-window binds)"));
  ibv_qp_init_attr ia{};
  ia.send_cq = bind_cq_.get();
  ia.recv_cq = bind_cq_.get();
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = kBindSlots;
  ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  bind_qp_.reset(a.create_qp(dom_->pd(), &ia));
  if (!bind_qp_) throw CoreError(errno_text("ibv_create_qp(RC, memory-window binds)"));
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_INIT;
  at.port_num = static_cast<uint8_t>(sel_.port);
  at.qp_access_flags = 0;
  if (a.modify_qp(bind_qp_.get(), &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0)
    throw CoreError(errno_text("ibv_modify_qp(INIT, memory-window binds)"));
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = static_cast<ibv_mtu>(sel_.mtu_enum);
  at.dest_qp_num = bind_qp_->qp_num;
  at.ah_attr.port_num = static_cast<uint8_t>(sel_.port);
  at.ah_attr.dlid = static_cast<uint16_t>(sel_.lid);
  if (sel_.link_layer == "Ethernet") {
    at.ah_attr.is_global = 1;
    std::memcpy(at.ah_attr.grh.dgid.raw, sel_.gid_raw, 16);
    at.ah_attr.grh.sgid_index = static_cast<uint8_t>(sel_.gid_index);
    at.ah_attr.grh.hop_limit = 1;
  }
  at.min_rnr_timer = 12;
  if (a.modify_qp(bind_qp_.get(), &at,
                  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
    throw CoreError(errno_text("ibv_modify_qp(RTR, memory-window binds)"));
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTS;
  at.timeout = 14;
  at.retry_cnt = 1;
  at.rnr_retry = 1;
  if (a.modify_qp(bind_qp_.get(), &at,
                  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                      IBV_QP_MAX_QP_RD_ATOMIC) != 0)
    throw CoreError(errno_text("ibv_modify_qp(RTS, memory-window binds)"));
}

std::string VerbsEndpoint::blob() const {
  BlobHead h{};
  h.magic = kBlobMagic;
  h.version = kBlobVersion;
  h.qps = static_cast<uint32_t>(qps_.size());
  std::memcpy(h.gid, sel_.gid_raw, 16);
  h.lid = static_cast<uint32_t>(sel_.lid);
  h.mtu_enum = static_cast<uint32_t>(sel_.mtu_enum);
  h.ethernet = sel_.link_layer == "Ethernet";
  h.cq_slots = cfg_.cq_slots;
  h.ring_addr = reinterpret_cast<uintptr_t>(ring_mem_.data());
  h.ring_size = cfg_.ring_size;
  h.ring_rkey = ring_mr_->rkey;
  h.mbox_addr = reinterpret_cast<uintptr_t>(mbox_mem_.data());
  h.mbox_rkey = mbox_mr_->rkey;
  h.pool_addr = dom_->pool_addr();
  h.pool_size = dom_->pool_size();
  h.stream_window = cfg_.stream_window;
  h.rd_atom = rd_atom_;
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  for (size_t i = 0; i < qps_.size(); ++i) {
    BlobQp q{qps_[i]->qp_num, psns_[i]};
    out.append(reinterpret_cast<const char*>(&q), sizeof q);
  }
  return out;
}

VerbsFabric::VerbsFabric(std::unique_ptr<VerbsEndpoint> local, const std::string& blob)
    : ep_(std::move(local)) {
  const Api& a = require();
  if (!ep_) throw CoreError("this endpoint was already attached");
  BlobHead h;
  if (blob.size() < sizeof h) throw CoreError("peer verbs blob is too short (" + std::to_string(blob.size()) + " bytes)");
  std::memcpy(&h, blob.data(), sizeof h);
  if (h.magic != kBlobMagic) throw CoreError("peer verbs blob has a wrong magic");
  if (h.version != kBlobVersion)
    throw CoreError("peer's verbs handshake is version " + std::to_string(h.version) + ", this side's " +
                    std::to_string(kBlobVersion) + " (argrpc differs between the two hosts: install the same on both)");
  if (!in_bounds(knobs::kQps, h.qps) || blob.size() != sizeof h + h.qps * sizeof(BlobQp))
    throw CoreError("peer verbs blob declares " + std::to_string(h.qps) + " QPs but is " +
                    std::to_string(blob.size()) + " bytes");
  if (!in_bounds(knobs::kRingSize, int64_t(h.ring_size)) || !power_of_two(h.ring_size))
    throw CoreError("peer ring size " + std::to_string(h.ring_size) + " is not a power of two in " +
                    bounds_text(knobs::kRingSize));
  if (h.cq_slots < 16 || h.cq_slots > (1u << 20)) throw CoreError("peer completion queue size out of range");
  if (!in_bounds(knobs::kStreamWindow, int64_t(h.stream_window)))
    throw CoreError("peer stream window " + std::to_string(h.stream_window) + " is outside " +
                    bounds_text(knobs::kStreamWindow));
  if (h.mtu_enum < IBV_MTU_256 || h.mtu_enum > IBV_MTU_4096) throw CoreError("peer MTU out of range");
  if (h.pool_size > (1ull << 44) || h.pool_addr > ~uint64_t(0) - h.pool_size)
    throw CoreError("peer pool range is invalid");
  if (h.ring_addr == 0 || h.ring_addr > ~uint64_t(0) - h.ring_size || h.mbox_addr == 0)
    throw CoreError("peer ring/mailbox address is invalid");
  if (bool(h.ethernet) != (ep_->sel_.link_layer == "Ethernet"))
    throw CoreError("peer link layer differs (Ethernet vs InfiniBand)");
  std::vector<BlobQp> pq(h.qps);
  std::memcpy(pq.data(), blob.data() + sizeof h, h.qps * sizeof(BlobQp));
  for (auto& q : pq)
    if (q.qpn == 0 || q.qpn > 0xffffff || q.psn > 0xffffff) throw CoreError("peer QP number/PSN out of range");

  peer_ring_addr_ = h.ring_addr;
  // Both directions use the smaller ring: a side short of pinned memory (a server with
  // many clients) registered a small one, and its send staging mirrors the peer's.
  ring_size_ = peer_ring_size_ = std::min<size_t>(h.ring_size, ep_->cfg_.ring_size);
  peer_ring_rkey_ = h.ring_rkey;
  peer_mbox_addr_ = h.mbox_addr;
  peer_mbox_rkey_ = h.mbox_rkey;
  peer_pool_addr_ = h.pool_addr;
  peer_pool_size_ = h.pool_size;
  peer_window_ = h.stream_window;
  peer_slots_ = h.cq_slots;
  // Different TF_RDMA_QPS on the two sides: use the common prefix; extra QPs stay idle.
  nqp_ = std::min<int>(ep_->qps(), static_cast<int>(h.qps));

  const Selection& sel = ep_->sel_;
  for (int i = 0; i < nqp_; ++i) {
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_RTR;
    at.path_mtu = static_cast<ibv_mtu>(std::min<int>(sel.mtu_enum, static_cast<int>(h.mtu_enum)));
    at.dest_qp_num = pq[i].qpn;
    at.rq_psn = pq[i].psn;
    at.max_dest_rd_atomic = static_cast<uint8_t>(std::min<uint32_t>(ep_->rd_atom_, 255));
    at.min_rnr_timer = 12;  // 0.64 ms
    at.ah_attr.port_num = static_cast<uint8_t>(sel.port);
    at.ah_attr.dlid = static_cast<uint16_t>(h.lid);
    if (h.ethernet) {
      // RoCE is always GRH-routed (on Soft-RoCE over the loopback too).
      at.ah_attr.is_global = 1;
      std::memcpy(at.ah_attr.grh.dgid.raw, h.gid, 16);
      at.ah_attr.grh.sgid_index = static_cast<uint8_t>(sel.gid_index);
      at.ah_attr.grh.hop_limit = 64;
    }
    if (a.modify_qp(ep_->qps_[i].get(), &at,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
      throw CoreError(errno_text("ibv_modify_qp(RTR, QP " + std::to_string(i) + ")"));
    ibv_qp_attr rt{};
    rt.qp_state = IBV_QPS_RTS;
    rt.timeout = static_cast<uint8_t>(ep_->vcfg_.qp_timeout);
    rt.retry_cnt = static_cast<uint8_t>(ep_->vcfg_.qp_retry);
    rt.rnr_retry = static_cast<uint8_t>(ep_->vcfg_.qp_retry);
    rt.sq_psn = ep_->psns_[i];
    rt.max_rd_atomic = static_cast<uint8_t>(std::min<uint32_t>({ep_->init_rd_atom_, h.rd_atom, 255}));
    if (a.modify_qp(ep_->qps_[i].get(), &rt,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC) != 0)
      throw CoreError(errno_text("ibv_modify_qp(RTS, QP " + std::to_string(i) + ")"));
  }

  staging_mem_ = map_anon(peer_ring_size_ + kCreditArea, "verbs send staging");
  staging_mr_ = reg(ep_->dom_->pd(), staging_mem_.data(), staging_mem_.size(), IBV_ACCESS_LOCAL_WRITE, "send staging");
  sq_free_.assign(static_cast<size_t>(nqp_), static_cast<int>(ep_->sq_depth_));
  queued_on_.assign(static_cast<size_t>(nqp_), 0);
}

VerbsFabric::~VerbsFabric() {
  shutdown();
  // QPs go before the memory their WRs reference; the endpoint's members then unwind
  // in reverse order (MRs, CQ, channel, mappings, domain).
  ep_->qps_.clear();
  tmp_mrs_.clear();
  staging_mr_.reset();
}

}  // namespace verbs
}  // namespace argrpc
