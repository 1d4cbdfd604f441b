#include "fabric/verbs/verbs_fabric.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>

#include "common/error.h"
#include "pool/pool.h"

namespace argrpc {
namespace verbs {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the blob is little-endian host order");

constexpr uint64_t kBlobMagic = 0x31766273627276ULL;  // "vrbsbv1"
constexpr uint32_t kBlobVersion = 1;
constexpr int kMaxQps = 16;
constexpr size_t kMboxBytes = 4096;
constexpr size_t kCreditArea = 4096;  // staging tail: credit-write sources
constexpr int kCreditSlots = 8;       // > kCreditInflight: a slot is reused only after it completed
constexpr int kCreditInflight = 4;
constexpr size_t kFirstPoolPrefix = 16 * MiB;

// wr_id = tag << 56 | value (the engine's read id for kTagRead).
enum Tag : uint64_t { kTagRecv = 1, kTagEager = 2, kTagCredit = 3, kTagRead = 4, kTagBind = 5 };
constexpr uint64_t tag_id(Tag t, uint64_t v = 0) { return (uint64_t(t) << 56) | v; }
constexpr Tag tag_of(uint64_t id) { return static_cast<Tag>(id >> 56); }
constexpr uint64_t value_of(uint64_t id) { return id & ((uint64_t(1) << 56) - 1); }

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

struct Credits {  // the mailbox, written by the peer
  uint64_t consumed_bytes, consumed_batches;
};

// Registered private memory must not be copy-on-write shared with a forked child: the
// first write by the parent would move its page away from under the HCA, which keeps
// DMA-ing into the old one (the classic RDMA fork bug). The child never uses these (its
// copies of connections are the parent's: common/fork.h), so it does not get them at all.
// The pool needs nothing: it is a MAP_SHARED memfd, never copied on write.
Mapping map_anon(size_t n, const char* what) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) throw CoreError(errno_text(std::string("mmap(") + what + ")"));
  Mapping m(p, n);
  if (::madvise(p, n, MADV_DONTFORK) != 0) throw CoreError(errno_text(std::string("madvise(") + what + ", MADV_DONTFORK)"));
  return m;
}

Mr reg(ibv_pd* pd, void* p, size_t n, int access, const char* what) {
  Mr mr(api()->reg_mr(pd, p, n, access));
  if (!mr) throw CoreError(reg_mr_error(what, n));
  return mr;
}

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

std::string reg_mr_error(const std::string& what, size_t len) {
  const int e = errno;
  std::string s = "ibv_reg_mr(" + what + ", " + std::to_string(len) + " bytes) failed: " + std::strerror(e);
  rlimit r{};
  ::getrlimit(RLIMIT_MEMLOCK, &r);
  s += "; the locked-memory limit (ulimit -l) is ";
  s += r.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(r.rlim_cur / 1024) + " KiB";
  if (e == ENOMEM || e == EPERM || e == EAGAIN)
    s += " (raise it: ulimit -l unlimited, or memlock in /etc/security/limits.conf or the container's ulimits)";
  return s;
}

// ---------------------------------------------------------------- domain

std::shared_ptr<VerbsDomain> VerbsDomain::get(const Selection& sel, const std::shared_ptr<Pool>& pool) {
  static std::mutex mu;
  static std::map<std::pair<std::string, const Pool*>, std::weak_ptr<VerbsDomain>> cache;
  std::lock_guard<std::mutex> g(mu);
  auto key = std::make_pair(sel.device, static_cast<const Pool*>(pool.get()));
  // A live domain holds its pool, so a Pool* key cannot be reused while it is cached.
  if (auto d = cache[key].lock()) return d;
  for (auto it = cache.begin(); it != cache.end();)
    it = it->second.expired() ? cache.erase(it) : std::next(it);
  auto d = std::make_shared<VerbsDomain>(sel, pool);
  cache[key] = d;
  return d;
}

VerbsDomain::VerbsDomain(const Selection& sel, std::shared_ptr<Pool> pool) : pool_(std::move(pool)) {
  const Api& a = require();
  int n = 0;
  ibv_device** list = a.get_device_list(&n);
  if (!list) throw CoreError(errno_text("ibv_get_device_list"));
  for (int i = 0; i < n && !ctx_; ++i)
    if (sel.device == a.get_device_name(list[i])) {
      ctx_.reset(a.open_device(list[i]));
      if (!ctx_) {
        const std::string why = errno_text("ibv_open_device(" + sel.device + ")");
        a.free_device_list(list);
        throw CoreError(why);
      }
    }
  a.free_device_list(list);
  if (!ctx_) throw CoreError("RDMA device " + sel.device + " disappeared");
  if (a.query_device(ctx_.get(), &attr_) != 0) throw CoreError(errno_text("ibv_query_device"));
  pd_.reset(a.alloc_pd(ctx_.get()));
  if (!pd_) throw CoreError(errno_text("ibv_alloc_pd(" + sel.device + ")"));
  const char* no_windows = std::getenv("ARGRPC_VERBS_NO_WINDOWS");
  windows_ = (attr_.device_cap_flags & IBV_DEVICE_MEM_WINDOW) && !(no_windows && *no_windows);
  if (!windows_)
    std::fprintf(stderr, "argrpc: %s has no memory windows: its whole registered pool is "
                         "remotely readable by connected peers\n", sel.device.c_str());
  // Register the first prefix now so a too-low memlock limit is a set-up error with
  // the reason, not a failure in the middle of a call.
  std::string why;
  uint32_t k;
  if (!pool_keys(pool_->base(), 1, &k, &k, &why)) throw CoreError(why);
}

uint64_t VerbsDomain::pool_addr() const { return reinterpret_cast<uintptr_t>(pool_->base()); }
size_t VerbsDomain::pool_size() const { return pool_->capacity(); }

bool VerbsDomain::pool_keys(const void* p, size_t len, uint32_t* lkey, uint32_t* rkey, std::string* why,
                            ibv_mr** mr_out) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(pool_->base());
  const size_t cap = pool_->capacity();
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (len == 0) len = 1;
  if (at < base || at - base > cap || len > cap - (at - base)) {
    if (why) *why = "not pool memory";
    return false;
  }
  const size_t end = at - base + len;
  std::lock_guard<std::mutex> g(mu_);
  if (pool_mrs_.empty() || pool_mrs_.back()->length < end) {
    size_t want = pool_mrs_.empty() ? std::min(kFirstPoolPrefix, cap) : pool_mrs_.back()->length;
    while (want < end) want *= 2;
    want = std::min(want, cap);
    // LOCAL_WRITE: the pool is also where rendezvous READs land. Remote rights come
    // from the windows bound over it, one per announced block.
    const int remote = windows_ ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_READ;
    Mr mr(api()->reg_mr(pd_.get(), pool_->base(), want, IBV_ACCESS_LOCAL_WRITE | remote));
    if (!mr) {
      if (why) *why = reg_mr_error("pool", want);
      return false;
    }
    pool_mrs_.push_back(std::move(mr));
  }
  // The newest prefix is the largest and covers everything.
  if (lkey) *lkey = pool_mrs_.back()->lkey;
  if (rkey) *rkey = windows_ ? 0 : pool_mrs_.back()->rkey;
  if (mr_out) *mr_out = pool_mrs_.back().get();
  return true;
}

// ---------------------------------------------------------------- endpoint

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
  if (n < 1 || n > kMaxQps) throw CoreError("TF_RDMA_QPS must be in [1, 16], got " + std::to_string(n));
  if (vcfg.qp_timeout < 1 || vcfg.qp_timeout > 31) throw CoreError("TF_RDMA_QP_TIMEOUT must be in [1, 31]");
  if (vcfg.qp_retry < 0 || vcfg.qp_retry > 7) throw CoreError("TF_RDMA_QP_RETRY must be in [0, 7]");
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

  ep->ring_mem_ = map_anon(cfg.ring_size, "verbs ring");
  ep->mbox_mem_ = map_anon(kMboxBytes, "verbs credit mailbox");
  ibv_pd* pd = ep->dom_->pd();
  ep->ring_mr_ = reg(pd, ep->ring_mem_.data(), cfg.ring_size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "ring");
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

// ---------------------------------------------------------------- fabric

VerbsFabric::VerbsFabric(std::unique_ptr<VerbsEndpoint> local, const std::string& blob)
    : ep_(std::move(local)) {
  const Api& a = require();
  if (!ep_) throw CoreError("this endpoint was already attached");
  BlobHead h;
  if (blob.size() < sizeof h) throw CoreError("peer verbs blob is too short (" + std::to_string(blob.size()) + " bytes)");
  std::memcpy(&h, blob.data(), sizeof h);
  if (h.magic != kBlobMagic || h.version != kBlobVersion) throw CoreError("peer verbs blob has a wrong magic/version");
  if (h.qps < 1 || h.qps > kMaxQps || blob.size() != sizeof h + h.qps * sizeof(BlobQp))
    throw CoreError("peer verbs blob declares " + std::to_string(h.qps) + " QPs but is " +
                    std::to_string(blob.size()) + " bytes");
  if (h.ring_size < 64 * KiB || h.ring_size > 256 * MiB || (h.ring_size & (h.ring_size - 1)))
    throw CoreError("peer ring size " + std::to_string(h.ring_size) + " is not a power of two in [64K, 256M]");
  if (h.cq_slots < 16 || h.cq_slots > (1u << 20)) throw CoreError("peer completion queue size out of range");
  if (h.stream_window < 4 * KiB || h.stream_window > (1ull << 40)) throw CoreError("peer stream window out of range");
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
  peer_ring_size_ = h.ring_size;
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
    if (q.mw) {
      const int rc = ibv_bind_mw(ep_->qps_[q.qp].get(), q.mw, &q.bind);
      if (rc || q.mw->rkey != q.rkey) {
        set_error(rc ? std::string("ibv_bind_mw failed: ") + std::strerror(rc)
                     : std::string("ibv_bind_mw gave an rkey other than the one announced"));
        fail_pending_.store(true);
        blocked[q.qp] = true;
        rest.push_back(q);
        continue;
      }
    } else {
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
    }
    --sq_free_[q.qp];
    --queued_on_[q.qp];
  }
  queued_.swap(rest);
}

bool VerbsFabric::write_imm(const void* src, uint32_t len, size_t remote_off) {
  if (shut_.load(std::memory_order_relaxed)) return false;
  if (remote_off > peer_ring_size_ || len > peer_ring_size_ - remote_off) return false;
  std::lock_guard<std::mutex> g(sq_mu_);
  ibv_send_wr wr{};
  ibv_sge sge{};
  wr.wr_id = tag_id(kTagEager);
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(len);
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

RemoteRef VerbsFabric::expose(const Block& b) {
  uint32_t rkey = 0;
  ibv_mr* mr = nullptr;
  std::string why;
  // The interface cannot fail here: on error the next poll() fails the connection.
  if (!ep_->dom_->pool_keys(b.data(), b.size(), nullptr, &rkey, &why, &mr)) {
    set_error(why);
    fail_pending_.store(true);
    return RemoteRef{0, 0};
  }
  const uintptr_t addr = reinterpret_cast<uintptr_t>(b.data());
  if (!ep_->dom_->windows()) return RemoteRef{addr, rkey};
  std::lock_guard<std::mutex> g(sq_mu_);
  if (shut_.load()) return RemoteRef{0, 0};
  size_t idx;
  if (!free_windows_.empty()) {
    idx = free_windows_.back();
    free_windows_.pop_back();
  } else {
    Mw mw(ibv_alloc_mw(ep_->dom_->pd(), IBV_MW_TYPE_1));
    if (!mw) {
      set_error(errno_text("ibv_alloc_mw(type 1) for an announced block"));
      fail_pending_.store(true);
      return RemoteRef{0, 0};
    }
    const uint32_t k = mw->rkey;
    windows_.push_back(Window{std::move(mw), k});
    idx = windows_.size() - 1;
  }
  if (!bind_locked(windows_[idx], mr, b.data(), b.size())) {
    free_windows_.push_back(idx);
    return RemoteRef{0, 0};
  }
  bound_[addr] = idx;
  return RemoteRef{addr, windows_[idx].rkey};
}

void VerbsFabric::unexpose(const Block& b) {
  if (!ep_->dom_->windows()) return;
  std::lock_guard<std::mutex> g(sq_mu_);
  auto it = bound_.find(reinterpret_cast<uintptr_t>(b.data()));
  if (it == bound_.end() || shut_.load()) return;
  const size_t idx = it->second;
  bound_.erase(it);
  // A zero-length bind invalidates the window (and its rkey); a later bind of the
  // same window comes after it on QP 0's send queue.
  ibv_mr* mr = nullptr;
  if (ep_->dom_->pool_keys(b.data(), b.size(), nullptr, nullptr, nullptr, &mr) &&
      bind_locked(windows_[idx], mr, b.data(), 0))
    free_windows_.push_back(idx);
}

// Binds on QP 0, the queue that also carries the RTS: the send queue runs in order, so
// the window is in place before the peer can learn its rkey.
bool VerbsFabric::bind_locked(Window& w, ibv_mr* mr, const void* addr, size_t len) {
  ibv_mw_bind mb{};
  mb.wr_id = tag_id(kTagBind);
  mb.send_flags = IBV_SEND_SIGNALED;
  mb.bind_info.mr = mr;
  mb.bind_info.addr = reinterpret_cast<uintptr_t>(addr);
  mb.bind_info.length = len;
  mb.bind_info.mw_access_flags = len ? IBV_ACCESS_REMOTE_READ : 0;
  // Providers give each bind ibv_inc_rkey of the window's current rkey.
  const uint32_t next = ibv_inc_rkey(w.rkey);
  if (sq_free_[0] > 0 && queued_on_[0] == 0) {
    if (int rc = ibv_bind_mw(ep_->qps_[0].get(), w.mw.get(), &mb)) {
      set_error(std::string("ibv_bind_mw failed: ") + std::strerror(rc));
      fail_pending_.store(true);
      return false;
    }
    --sq_free_[0];
    w.rkey = w.mw->rkey;
    return true;
  }
  Queued q{};
  q.qp = 0;
  q.mw = w.mw.get();
  q.bind = mb;
  q.rkey = next;
  queued_.push_back(q);
  ++queued_on_[0];
  w.rkey = next;
  return true;
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

void VerbsFabric::shutdown() {
  if (shut_.exchange(true)) return;
  // ERR stops the peer's writes into our ring and reads of our pool at once and
  // flushes our outstanding work requests.
  for (auto& qp : ep_->qps_) {
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    api()->modify_qp(qp.get(), &at, IBV_QP_STATE);
  }
  // Windows are per PD, not per QP: deallocating them is what ends remote access to
  // blocks the engine is about to return to the pool.
  std::lock_guard<std::mutex> g(sq_mu_);
  queued_.clear();
  bound_.clear();
  free_windows_.clear();
  windows_.clear();
}

}  // namespace verbs
}  // namespace argrpc
