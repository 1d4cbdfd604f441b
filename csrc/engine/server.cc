#include "engine/server.h"

#include <vector>

#include "common/spin.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/stream.h"

namespace argrpc {

Server::Server(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {}

bool Server::enqueue(const std::shared_ptr<Stream>& s) {
  bool wake;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shutdown_) return false;
    active_[s.get()] = s;
    pending_.push_back(s);
    pending_count_.fetch_add(1);
    // The spinner will take the first call; wake a sleeper only for calls beyond it.
    wake = sleepers_ > 0 && (!spinner_ || pending_.size() > 1);
  }
  if (wake) cv_.notify_one();
  return true;
}

std::shared_ptr<Stream> Server::accept(const Deadline& dl) {
  std::unique_lock<std::mutex> lk(mu_);
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
    if (!spinner_) {
      spinner_ = true;
      lk.unlock();
      engine_->enter_polling();
      spin_until(
          engine_->config().spin_us, dl,
          [&] { return pending_count_.load() > 0 || wakeup_count_.load() > 0; },
          [&] { engine_->progress_all(); });
      engine_->leave_polling();
      lk.lock();
      spinner_ = false;
      if (!pending_.empty() || wakeups_ > 0 || shutdown_) continue;
    }
    ++sleepers_;
    cv_.wait_until(lk, std::min(dl.at(), Clock::now() + std::chrono::milliseconds(100)));
    --sleepers_;
  }
}

void Server::wakeup(int n) {
  {
    std::lock_guard<std::mutex> g(mu_);
    wakeups_ += n;
    wakeup_count_.fetch_add(n);
  }
  cv_.notify_all();
}

std::shared_ptr<Stream> Server::next_cancelled(const Deadline& dl) {
  std::unique_lock<std::mutex> lk(mu_);
  while (cancelled_.empty()) {
    if (shutdown_ || dl.expired()) return nullptr;
    cancelled_cv_.wait_until(lk, std::min(dl.at(), Clock::now() + std::chrono::milliseconds(100)));
  }
  auto s = std::move(cancelled_.front());
  cancelled_.pop_front();
  return s;
}

void Server::report_cancelled(const std::shared_ptr<Stream>& s) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (shutdown_) return;
    cancelled_.push_back(s);
  }
  cancelled_cv_.notify_one();
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
  std::deque<std::shared_ptr<Stream>> pending, cancelled;
  {
    std::lock_guard<std::mutex> g(mu_);
    shutdown_ = true;
    // Nobody takes these any more, and each holds its connection, which holds this
    // server: dropping them here is what lets both go.
    pending.swap(pending_);
    cancelled.swap(cancelled_);
    pending_count_.store(0);
  }
  cv_.notify_all();
  cancelled_cv_.notify_all();
  for (auto& st : pending) st->conn->cancel(st, kUnavailable, "server is shutting down");
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
