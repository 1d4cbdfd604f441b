// Remote access to the pool: a type 1 memory window bound over each announced block and
// unbound at its FIN, and at shutdown the revocation of everything the peer could reach.
#include <sched.h>
#include <cstring>

#include "common/clock.h"

#include "common/error.h"
#include "fabric/verbs/verbs_fabric.h"
#include "fabric/verbs/verbs_internal.h"
#include "pool/pool.h"

namespace argrpc {
namespace verbs {

bool VerbsFabric::exposable(const Block& b, std::string* why) {
  uint32_t rkey = 0;
  return ep_->dom_->pool_keys(b.data(), b.size(), nullptr, &rkey, why);
}

bool VerbsFabric::landable(void* dst, size_t len, std::string* why) {
  uint32_t lkey = 0;
  if (ep_->dom_->pool_keys(dst, len, &lkey, nullptr, nullptr)) return true;
  // Heap memory (the pool was full) is registered read by read; tried once whole here
  // so a locked-memory limit fails this message, not the connection in read().
  Mr mr(api()->reg_mr(ep_->dom_->pd(), dst, len, IBV_ACCESS_LOCAL_WRITE));
  if (mr) return true;
  *why = reg_mr_error("rendezvous destination", len);
  return false;
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
  // A zero-length bind invalidates the window (and its rkey) before it is reused.
  ibv_mr* mr = nullptr;
  if (ep_->dom_->pool_keys(b.data(), b.size(), nullptr, nullptr, nullptr, &mr) &&
      bind_locked(windows_[idx], mr, b.data(), 0))
    free_windows_.push_back(idx);
}

// Binds on the bind-only queue pair and waits for the completion, so the window is in
// place before the caller writes the RTS that announces its rkey.
bool VerbsFabric::bind_locked(Window& w, ibv_mr* mr, const void* addr, size_t len) {
  ibv_mw_bind mb{};
  mb.wr_id = tag_id(kTagBind);
  mb.send_flags = IBV_SEND_SIGNALED;
  mb.bind_info.mr = mr;
  mb.bind_info.addr = reinterpret_cast<uintptr_t>(addr);
  mb.bind_info.length = len;
  mb.bind_info.mw_access_flags = len ? IBV_ACCESS_REMOTE_READ : 0;
  if (int rc = ibv_bind_mw(ep_->bind_qp_.get(), w.mw.get(), &mb)) {
    set_error(std::string("ibv_bind_mw failed: ") + std::strerror(rc));
    fail_pending_.store(true);
    return false;
  }
  // A local operation: Soft-RoCE completes it inside the post, hardware within
  // microseconds; the bound only guards against a device that never answers.
  ibv_wc wc{};
  int n = 0;
  const uint64_t until = now_us() + kBindWaitUs;
  while ((n = ibv_poll_cq(ep_->bind_cq_.get(), 1, &wc)) == 0 && now_us() < until) sched_yield();
  if (n != 1 || wc.status != IBV_WC_SUCCESS) {
    set_error(n < 0    ? std::string("ibv_poll_cq failed on the memory-window queue")
              : n == 0 ? std::string("a memory window bind did not complete within 1 s")
                       : std::string("memory window bind failed: ") + api()->wc_status_str(wc.status));
    fail_pending_.store(true);
    return false;
  }
  w.rkey = w.mw->rkey;
  return true;
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
