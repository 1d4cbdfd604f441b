// Returning ring credits. On shm a return is a store into shared memory, made after
// every batch read. On verbs each return is an RDMA WRITE plus its ACK, as many packets
// as the batch it pays for, so a request and its response would cost four packets each
// way instead of two. There the receiver owes credits and returns them late: when the
// debt reaches 1/kCreditOweFraction of its ring or of its receive slots, once it is
// kCreditOweMs old, or at once when this side's own sender finds the peer's ring full
// (the peer may be waiting for ours just the same). A sender thus sees at most that
// fraction of the ring as still in use, and a call's round trip is one batch and its
// ACK each way.
//
// An old debt is paid by whichever thread next starts to poll (Engine::cool, from
// cool_and_pay_if_due), not on a timer of the progress thread: on a busy host each
// timed wake-up takes a CPU from a thread that polls, and while calls flow there always
// is a debt.
// The progress thread's sweep pays what is left when nobody polls any more, within its
// longest sleep. A debt that old never holds a sender up: it is under the fraction above,
// and a peer that fills the rest of the ring rings for it to be read, which pays it.
#include <limits>

#include "common/clock.h"
#include "engine/connection.h"

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
  // A debt begins: date it. Ordered after the stores above, as return_credits() clears
  // the date before it reads them, so a batch it did not pay for is dated again here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (debt_since_us_.load(std::memory_order_relaxed) == 0) {
    uint64_t none = 0;
    debt_since_us_.compare_exchange_strong(none, now_us(), std::memory_order_relaxed);
  }
}

void Connection::return_credits() {
  std::lock_guard<std::mutex> g(credit_mu_);
  debt_since_us_.store(0, std::memory_order_seq_cst);
  // Batches first: bytes read after them are never older, and each value alone only
  // understates what was consumed.
  const uint64_t batches = consumed_batches_.load(std::memory_order_seq_cst);
  const uint64_t bytes = consumed_bytes_.load(std::memory_order_seq_cst);
  if (batches == returned_batches_ && bytes == returned_bytes_) return;
  fabric_->publish_consumed(bytes, batches);
  returned_bytes_ = bytes;
  returned_batches_ = batches;
}

namespace {
// When a debt dated `since` (now_us() scale, nonzero) is due.
uint64_t due_after(uint64_t since) { return since + uint64_t(knobs::kCreditOweMs) * 1000; }
}  // namespace

uint64_t Connection::credits_due_at() const {
  const uint64_t since = debt_since_us_.load(std::memory_order_relaxed);
  return since == 0 ? std::numeric_limits<uint64_t>::max() : due_after(since);
}

void Connection::return_credits_if_due(uint64_t now) {
  if (now >= credits_due_at() && alive()) return_credits();
}

void Connection::sweep_credits(uint64_t now) {
  if (!fabric_->lazy_credits() || !alive()) return;
  bool owed;
  {
    std::lock_guard<std::mutex> g(credit_mu_);
    owed = consumed_batches_.load(std::memory_order_acquire) != returned_batches_ ||
           consumed_bytes_.load(std::memory_order_acquire) != returned_bytes_;
  }
  // Undated, a debt's batch raced a return (see consumed_locked): pay it too.
  const uint64_t since = debt_since_us_.load(std::memory_order_relaxed);
  if (owed && (since == 0 || now >= due_after(since)))
    return_credits();
}

}  // namespace argrpc
