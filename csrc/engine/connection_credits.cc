// Returning ring credits. On shm a return is a store into shared memory, made after
// every batch read. On verbs each return is an RDMA WRITE plus its ACK, as many packets
// as the batch it pays for, so a request and its response would cost four packets each
// way instead of two. There the receiver owes credits and returns them late: when the
// debt reaches 1/kCreditOweFraction of its ring or of its receive slots, at the first
// sweep after a debt is kCreditOweMs old, or at once when this side's own sender finds
// the peer's ring full (the peer may be waiting for ours just the same). A sender thus
// sees at most that fraction of the ring as still in use, and a call's round trip is
// one batch and its ACK each way. Only a debt brings the progress thread round: a
// connection that owes nothing, the idle one's case, costs its process no wake-up.
#include <limits>

#include "common/clock.h"
#include "engine/connection.h"
#include "engine/engine.h"

namespace argrpc {

void Connection::consumed_locked() {
  consumed_bytes_.store(rpos_, std::memory_order_release);
  consumed_batches_.store(rbatches_, std::memory_order_release);
  if (!fabric_->lazy_credits()) {
    fabric_->publish_consumed(rpos_, rbatches_);
    return;
  }
  bool due;
  {
    std::lock_guard<std::mutex> g(credit_mu_);
    due = rpos_ - returned_bytes_ >= fabric_->ring_size() / knobs::kCreditOweFraction ||
          rbatches_ - returned_batches_ >= cfg_.cq_slots / knobs::kCreditOweFraction;
  }
  if (due) {
    return_credits();
    return;
  }
  // A sweep that found nothing owed sleeps on: tell it. Ordered after the store above,
  // as the sweep clears the flag before it reads what was consumed, so one of the two
  // sees the other.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!debt_watched_.load(std::memory_order_relaxed) &&
      !debt_watched_.exchange(true, std::memory_order_seq_cst))
    engine_->look_by(now_us() + uint64_t(knobs::kCreditOweMs) * 1000);
}

void Connection::return_credits() {
  std::lock_guard<std::mutex> g(credit_mu_);
  // Batches first: bytes read after them are never older, and each value alone only
  // understates what was consumed.
  const uint64_t batches = consumed_batches_.load(std::memory_order_acquire);
  const uint64_t bytes = consumed_bytes_.load(std::memory_order_acquire);
  if (batches == returned_batches_ && bytes == returned_bytes_) return;
  fabric_->publish_consumed(bytes, batches);
  returned_bytes_ = bytes;
  returned_batches_ = batches;
}

uint64_t Connection::sweep_credits(uint64_t now) {
  constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
  if (!fabric_->lazy_credits() || !alive()) return kNever;
  debt_watched_.store(false, std::memory_order_seq_cst);
  const uint64_t owe_us = uint64_t(knobs::kCreditOweMs) * 1000;
  auto returned = [&] {
    std::lock_guard<std::mutex> g(credit_mu_);
    return returned_batches_;
  };
  uint64_t back = returned();
  if (back < owed_mark_ && now - owed_mark_us_ >= owe_us) {
    return_credits();
    back = returned();
  }
  if (back >= owed_mark_) {  // the marked debt is paid: mark what is owed now
    owed_mark_ = consumed_batches_.load(std::memory_order_seq_cst);
    owed_mark_us_ = now;
  }
  if (back >= owed_mark_) return kNever;
  debt_watched_.store(true, std::memory_order_relaxed);
  return owed_mark_us_ + owe_us;
}

}  // namespace argrpc
