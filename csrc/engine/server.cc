#include "engine/server.h"

#include <algorithm>
#include <vector>

#include "common/spin.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/polling_lease.h"
#include "engine/stream.h"

namespace argrpc {

Server::Server(std::shared_ptr<Engine> engine, int max_concurrent)
    : engine_(std::move(engine)), limit_(max_concurrent) {}

int Server::starved_locked() const {
  if (watch_) return 0;  // the loop takes every call itself
  // A wake-up is work too (the facade queued something for a worker to run).
  const int waiting = static_cast<int>(pending_.size()) + wakeups_;
  return std::max(0, waiting - acceptors_.load(std::memory_order_relaxed) - requested_ -
                         returning_);
}

bool Server::enqueue(const std::shared_ptr<Stream>& s) {
  bool wake, tell;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shutdown_) return false;
    if (limit_ >= 0 && static_cast<int>(active_.size()) + admitted_ >= limit_) {
      over_limit_.push_back(s);
      wake = false;
      tell = true;
    } else {
      active_[s.get()] = s;
      pending_.push_back(s);
      pending_count_.fetch_add(1);
      // The spinner will take the first call; wake a sleeper only for calls beyond it.
      wake = sleepers_ > 0 && (!spinner_ || pending_.size() > 1);
      tell = starved_locked() > 0;
    }
    if (watch_) watch_->fire();
  }
  if (wake) cv_.notify_one();
  if (tell) events_cv_.notify_one();
  return true;
}

std::shared_ptr<Stream> Server::accept(const Deadline& dl) {
  std::unique_lock<std::mutex> lk(mu_);
  acceptors_.fetch_add(1, std::memory_order_relaxed);
  auto s = accept_locked(lk, dl);
  acceptors_.fetch_sub(1, std::memory_order_relaxed);
  // Leaving with a call may leave other work (calls, wake-ups) with nobody to take it.
  const bool tell = s && starved_locked() > 0;
  const bool worker = !watch_;  // an asyncio loop finishes its calls elsewhere
  lk.unlock();
  if (s && worker)
    polling_lease::serving(s.get());
  else
    polling_lease::drop();
  if (tell) events_cv_.notify_one();
  return s;
}

std::shared_ptr<Stream> Server::accept_locked(std::unique_lock<std::mutex>& lk, const Deadline& dl) {
  for (;;) {
    if (shutdown_) return nullptr;
    if (!pending_.empty()) {
      auto s = std::move(pending_.front());
      pending_.pop_front();
      pending_count_.fetch_sub(1);
      if (!pending_.empty() && sleepers_ > 0) cv_.notify_one();
      return s;
    }
    if (wakeups_ > 0) {
      --wakeups_;
      wakeup_count_.fetch_sub(1);
      return nullptr;
    }
    if (dl.expired()) return nullptr;
    const bool back = polling_lease::held();
    // Spin when nobody does and no worker is on its way back to (it will), or when this
    // thread is that worker: it takes the spin over.
    if (back || (!spinner_ && returning_ == 0)) {
      spinner_ = true;
      const uint64_t turn = spin_turn_.fetch_add(1, std::memory_order_relaxed) + 1;
      lk.unlock();
      engine_->cool_and_pay_if_due();
      engine_->enter_polling();
      polling_lease::drop();  // this thread polls now: the lease has done its part
      const bool ready = spin_until(
          engine_->config().spin_us, dl,
          [&] {
            return pending_count_.load() > 0 || wakeup_count_.load() > 0 ||
                   spin_turn_.load(std::memory_order_relaxed) != turn;
          },
          [&] { engine_->progress_all(); });
      engine_->leave_polling();
      lk.lock();
      const bool mine = spin_turn_.load(std::memory_order_relaxed) == turn;
      if (mine) spinner_ = false;
      if (!pending_.empty() || wakeups_ > 0 || shutdown_) continue;
      // Work another thread took first: spin on. Handed over, or spun out: sleep.
      if (mine && ready) continue;
    }
    ++sleepers_;
    cv_.wait_until(lk, std::min(dl.at(), Clock::now() + std::chrono::milliseconds(100)));
    --sleepers_;
  }
}

void Server::wakeup(int n) {
  bool tell;
  {
    std::lock_guard<std::mutex> g(mu_);
    wakeups_ += n;
    wakeup_count_.fetch_add(n);
    tell = starved_locked() > 0;
  }
  cv_.notify_all();
  if (tell) events_cv_.notify_one();
}

void Server::lease_taken() {
  std::lock_guard<std::mutex> g(mu_);
  ++returning_;
}

void Server::lease_returned() {
  bool tell;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (returning_ > 0) --returning_;
    tell = starved_locked() > 0;
  }
  if (tell) events_cv_.notify_one();
}

void Server::worker_started() {
  std::lock_guard<std::mutex> g(mu_);
  if (requested_ > 0) --requested_;
}

ServerEvent Server::next_event(const Deadline& dl) {
  std::unique_lock<std::mutex> lk(mu_);
  ServerEvent ev;
  for (;;) {
    if (shutdown_) return ev;
    if (!cancelled_.empty()) {
      ev.kind = ServerEvent::Kind::kCancelled;
      ev.stream = std::move(cancelled_.front());
      cancelled_.pop_front();
      return ev;
    }
    if (!over_limit_.empty()) {
      ev.kind = ServerEvent::Kind::kOverLimit;
      ev.stream = std::move(over_limit_.front());
      over_limit_.pop_front();
      return ev;
    }
    if (const int n = starved_locked(); n > 0) {
      requested_ += n;
      ev.kind = ServerEvent::Kind::kStarved;
      ev.workers = n;
      return ev;
    }
    if (dl.expired()) return ev;
    events_cv_.wait_until(lk, std::min(dl.at(), Clock::now() + std::chrono::milliseconds(100)));
  }
}

bool Server::admit() {
  std::lock_guard<std::mutex> g(mu_);
  if (limit_ >= 0 && static_cast<int>(active_.size()) + admitted_ >= limit_) return false;
  ++admitted_;
  return true;
}

void Server::release() {
  std::lock_guard<std::mutex> g(mu_);
  if (admitted_ > 0) --admitted_;
}

void Server::cancel_pending(uint32_t code, const std::string& details) {
  std::deque<std::shared_ptr<Stream>> pending;
  {
    std::lock_guard<std::mutex> g(mu_);
    pending.swap(pending_);
    pending_count_.store(0);
    requested_ = 0;
  }
  for (auto& st : pending) st->conn->cancel(st, code, details);
}

void Server::report_cancelled(const std::shared_ptr<Stream>& s) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shutdown_) return;
    cancelled_.push_back(s);
    if (watch_) watch_->fire();
  }
  events_cv_.notify_one();
}

void Server::remove_active(const Stream* s) {
  std::lock_guard<std::mutex> g(mu_);
  active_.erase(s);
}

int Server::active() {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<int>(active_.size());
}

void Server::shutdown() {
  std::deque<std::shared_ptr<Stream>> pending, cancelled, over;
  {
    std::lock_guard<std::mutex> g(mu_);
    shutdown_ = true;
    // Nobody takes these any more, and each holds its connection, which holds this
    // server: dropping them here is what lets both go.
    pending.swap(pending_);
    cancelled.swap(cancelled_);
    over.swap(over_limit_);
    pending_count_.store(0);
    if (watch_) watch_->fire();
  }
  cv_.notify_all();
  events_cv_.notify_all();
  for (auto& st : pending) st->conn->cancel(st, kUnavailable, "server is shutting down");
  for (auto& st : over) st->conn->cancel(st, kUnavailable, "server is shutting down");
}

void Server::set_watch(std::shared_ptr<Watch> w) {
  std::lock_guard<std::mutex> g(mu_);
  watch_ = std::move(w);
  if (watch_ && (!pending_.empty() || !cancelled_.empty() || !over_limit_.empty()))
    watch_->fire();
}

bool Server::is_shutdown() {
  std::lock_guard<std::mutex> g(mu_);
  return shutdown_;
}

void Server::cancel_all(uint32_t code, const std::string& details) {
  std::vector<std::shared_ptr<Stream>> all;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& kv : active_)
      if (auto s = kv.second.lock()) all.push_back(s);
    // Calls not yet picked up by a worker are cancelled as well.
    pending_.clear();
    pending_count_.store(0);
  }
  for (auto& s : all) s->conn->cancel(s, code, details);
}

}  // namespace argrpc
