// Connection::wait(), for the .cc files whose operations block on a stream's state (the
// call API, and the send side waiting for window credits). A waiter first spins driving
// progress() itself, which answers fastest on few cores, then sleeps on the stream.
#pragma once
#include <algorithm>
#include <chrono>
#include <mutex>

#include "common/clock.h"
#include "common/interrupt.h"
#include "common/spin.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/polling_lease.h"

namespace argrpc {

template <class Pred>
bool Connection::wait(const std::shared_ptr<Stream>& sp, const Deadline& dl, Pred pred) {
  Stream& s = *sp;
  auto ready = [&] {
    std::lock_guard<std::mutex> g(s.mu);
    return pred();
  };
  if (ready()) return true;
  engine_->cool_and_pay_if_due();
  engine_->enter_polling();
  const bool ok = spin_until(engine_->config().spin_us, dl, ready, [&] { progress(); });
  engine_->leave_polling();
  if (ok) return true;
  WaitInterrupt* const interrupt = current_interrupt();
  auto next_check = Clock::now() + kInterruptPoll;
  auto nudge_at = Clock::now() + kLeaseCheck;
  std::unique_lock<std::mutex> lk(s.mu);
  bool checked_dead = false, nudged = false;
  while (!pred()) {
    if (dl.expired()) return false;
    if (!nudged && Clock::now() >= nudge_at) {
      // What this wait is for may sit unread behind a polling lease whose holder is held
      // up, in the peer's process or in this one, while its progress thread sleeps long
      // (engine/polling_lease.h): look once, and ring the peer even if it says it polls.
      nudged = true;
      lk.unlock();
      progress();
      fabric_->nudge();
      lk.lock();
      continue;
    }
    if (!checked_dead && dead_.load(std::memory_order_acquire)) {
      // fail() reaches every stream (live_) and wakes its sleepers, so this is only a
      // second line: no waiter outlives its connection by more than one nap.
      checked_dead = true;
      lk.unlock();
      end_failed(sp);
      lk.lock();
      continue;
    }
    if (interrupt != nullptr && Clock::now() >= next_check) {
      // Unlocked: the check runs the application's code, which may touch this stream.
      lk.unlock();
      if (interrupt->interrupted()) throw Interrupted();
      lk.lock();
      next_check = Clock::now() + kInterruptPoll;
      continue;
    }
    ++s.sleepers;
    // The bound is a safety net only: every state change notifies.
    auto until = std::min(dl.at(), Clock::now() + std::chrono::milliseconds(100));
    if (interrupt != nullptr) until = std::min(until, next_check);
    if (!nudged) until = std::min(until, nudge_at);
    s.cv.wait_until(lk, until);
    --s.sleepers;
  }
  return true;
}

}  // namespace argrpc
