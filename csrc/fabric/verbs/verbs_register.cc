// Memory registration: the private mappings the HCA may DMA into, and the pool's
// registrations, per (engine pool, device), in growing prefixes.
#include <sys/mman.h>
#include <sys/resource.h>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "common/error.h"
#include "common/log.h"
#include "fabric/verbs/verbs_fabric.h"
#include "fabric/verbs/verbs_internal.h"
#include "pool/pool.h"

namespace argrpc {
namespace verbs {

namespace {
constexpr size_t kFirstPoolPrefix = 16 * MiB;
}  // namespace

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
    log_message(LogLevel::kWarning, sel.device + " has no memory windows: its whole registered pool "
                                    "is remotely readable by connected peers");
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

}  // namespace verbs
}  // namespace argrpc
