// Reading the peer: whoever holds the poll lock polls the fabric, copies each batch out
// of the receive ring, returns the ring credits and hands every frame to handle_frame().
#include <cstring>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "engine/connection.h"

namespace argrpc {

namespace {
constexpr int kMaxCompletions = 64;
// How long one progress_locked() may keep going while completions keep coming (a long
// pull on a slow fabric never lets the CQ run dry): the progress thread's sweep (the
// keepalive, owed credits, deadlines) runs between calls.
constexpr uint64_t kMaxPollHoldUs = uint64_t(knobs::kPollHoldMs) * 1000;
}  // namespace

bool Connection::progress() {
  if (inherited()) return false;  // the parent's ring: only the parent reads it
  bool did = false;
  for (;;) {
    if (!poll_mu_.try_lock()) return did;
    kick_.store(false, std::memory_order_seq_cst);
    if (alive()) did |= progress_locked();
    poll_mu_.unlock();
    // Someone asked for work while we held the lock and could not take it.
    if (!kick_.load(std::memory_order_seq_cst)) return did;
  }
}

void Connection::drain() {
  if (inherited()) return;
  std::lock_guard<std::mutex> g(poll_mu_);  // wait out a poller: it may hold the last batch
  while (alive() && progress_locked()) {
  }
}

bool Connection::progress_locked() {
  Completion comps[kMaxCompletions];
  bool did = false;
  const uint64_t started = now_us();
  start_queued_pulls();
  for (;;) {
    const int n = fabric_->poll(comps, kMaxCompletions);
    if (n <= 0) break;
    did = true;
    const uint64_t heard = now_us();
    last_heard_us_.store(heard, std::memory_order_relaxed);
    const uint64_t before = rbatches_;
    for (int i = 0; i < n; ++i) {
      switch (comps[i].kind) {
        case Completion::kRecv:
          last_recv_us_.store(heard, std::memory_order_relaxed);
          if (!handle_batch(comps[i].len)) return true;
          // A PING's answer goes out now: not once the CQ runs dry, which during a long
          // pull may be only at its end (a PING unanswered that long declares this live
          // process dead), nor behind the READs the next completions post (on
          // Soft-RoCE a post can last as long as its chunk's transfer).
          if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
          break;
        case Completion::kReadDone:
          on_read_done(comps[i].wr_id);
          break;
        case Completion::kError:
          fail(kUnavailable, "argrpc: " + fabric_->error());
          return true;
      }
      if (!alive()) return true;
    }
    // Ring space is free again as soon as batches are copied out.
    if (rbatches_ != before) consumed_locked();
    start_queued_pulls();
    // What the completions asked for goes out now, not once the CQ is empty (FINs):
    // during a long pull the CQ may never be empty until the pull ends.
    if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
    if (heard - started >= kMaxPollHoldUs) break;
  }
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
  return did;
}

bool Connection::handle_batch(uint32_t imm) {
  const size_t ring = fabric_->ring_size();
  const uint32_t len = imm & ~kBatchFlags;
  if (len == 0 || (imm & kBatchFlags & ~kBatchRestart) || len > ring / 2) {
    protocol_error("batch immediate " + std::to_string(imm) + " is invalid");
    return false;
  }
  size_t off = rpos_ % ring;
  if (off != 0 && ((imm & kBatchRestart) || ring - off < len)) {
    rpos_ += ring - off;
    off = 0;
  }
  // Parse a private copy: the peer can write the ring while we read it.
  const uint8_t* src = fabric_->ring() + off;
  scratch_.assign(src, src + len);
  rpos_ += len;
  ++rbatches_;
  const uint8_t* p = scratch_.data();
  size_t at = 0;
  while (at < len) {
    if (len - at < kFrameHeader) {
      protocol_error("truncated frame header");
      return false;
    }
    FrameHead h;
    std::memcpy(&h, p + at, kFrameHeader);
    if (h.len > len - at - kFrameHeader) {
      protocol_error("frame length " + std::to_string(h.len) + " runs past its batch");
      return false;
    }
    if (!handle_frame(h, p + at + kFrameHeader)) return false;
    at += pad8(kFrameHeader + h.len);
  }
  return true;
}

}  // namespace argrpc
