#include "engine/notifier.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/fork.h"
#include "common/spin.h"
#include "engine/engine.h"
#include "engine/polling_lease.h"

namespace argrpc {

void Watch::fire() {
  if (posted_.exchange(true, std::memory_order_acq_rel)) return;
  notifier_->post(shared_from_this());
}

Notifier::Notifier() : efd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (!efd_.valid()) throw CoreError(std::string("argrpc: eventfd: ") + std::strerror(errno));
}

void Notifier::post(std::shared_ptr<Watch> w) {
  // The eventfd is written and read under mu_, so signalled_ always says whether it
  // holds a count: a write between drain()'s unlock and its read would otherwise be
  // swallowed (a loop watching only the fd then sleeps forever), or one after it left
  // the fd readable with nothing to drain (a level-triggered loop spins).
  std::lock_guard<std::mutex> g(mu_);
  posted_.push_back(std::move(w));
  count_.store(posted_.size(), std::memory_order_release);
  if (!polling_ && looker_.load(std::memory_order_acquire) != std::this_thread::get_id())
    signal_locked();
}

void Notifier::signal_locked() {
  if (signalled_) return;
  signalled_ = true;
  const uint64_t one = 1;
  ssize_t r = ::write(efd_.get(), &one, sizeof one);
  (void)r;  // EAGAIN only when the counter is full, and then it is readable anyway
}

std::vector<uint64_t> Notifier::drain() {
  std::vector<std::shared_ptr<Watch>> got;
  {
    std::lock_guard<std::mutex> g(mu_);
    got.swap(posted_);
    count_.store(0, std::memory_order_release);
    if (signalled_) {
      uint64_t v;
      ssize_t r = ::read(efd_.get(), &v, sizeof v);
      (void)r;
      signalled_ = false;
    }
  }
  std::vector<uint64_t> tokens;
  tokens.reserve(got.size());
  // Re-armed before the loop looks at the calls: a change from here on posts again.
  for (auto& w : got) {
    w->posted_.store(false, std::memory_order_release);
    tokens.push_back(w->token_);
  }
  return tokens;
}

std::vector<uint64_t> Notifier::poll(Engine& engine, int64_t limit_us) {
  const int spin = static_cast<int>(std::min<int64_t>(engine.config().spin_us, limit_us));
  if (!pending() && spin > 0) {
    {
      std::lock_guard<std::mutex> g(mu_);
      polling_ = true;
    }
    engine.cool_and_pay_if_due();
    engine.enter_polling();
    end_lease();  // after entering: no arming in between
    spin_until(spin, Deadline::never(), [&] { return pending(); },
               [&] { engine.progress_all(); });
    if (pending() && engine.begin_lease()) {
      if (lease_engine_.get() != &engine) {
        lease_engine_ = engine.shared_from_this();
        lease_engine_at_.store(&engine, std::memory_order_release);
        engine.add_loop(weak_from_this());
      }
      lease_generation_ = fork_generation();
      leased_at_us_.store(now_us(), std::memory_order_relaxed);
      leased_.store(true, std::memory_order_release);
    }
    engine.leave_polling();
    std::lock_guard<std::mutex> g(mu_);
    polling_ = false;
  }
  return drain();
}

void Notifier::end_lease() {
  if (!leased_.load(std::memory_order_acquire)) return;
  // A forked child's copy of the parent's engine is never touched (common/fork.h).
  if (lease_generation_ != fork_generation()) return;
  if (!leased_.exchange(false, std::memory_order_acq_rel)) return;
  // Ending it reads what the peer wrote without a doorbell meanwhile (leave_polling), and
  // posts it from this thread, which is the loop's on its way to sleep: past its look at
  // pending(), so its own posts must write the eventfd here or wait for the next wake.
  lease_engine_->end_lease();
  std::lock_guard<std::mutex> g(mu_);
  if (!posted_.empty() && !polling_) signal_locked();
}

void Notifier::expire_lease(Engine& engine, uint64_t now) {
  if (!leased_.load(std::memory_order_acquire) ||
      lease_engine_at_.load(std::memory_order_acquire) != &engine)
    return;
  const uint64_t at = leased_at_us_.load(std::memory_order_relaxed);
  if (now < at || now - at < uint64_t(kLeaseCheck.count()) * 1000) return;
  if (leased_.exchange(false, std::memory_order_acq_rel)) engine.end_lease();
}

Notifier::~Notifier() {
  // Ended by then (the bindings' notifier ends it when it goes), but in a forked child,
  // whose copy of the parent's engine is never destroyed either.
  if (lease_engine_ && lease_generation_ != fork_generation())
    keep_forever(std::move(lease_engine_));
}

}  // namespace argrpc
