// The send side. Frames are appended to one batch under send_mu_, and a batch goes to
// the peer's ring as one write once the ring has credits for it. Control frames (FIN,
// WINDOW, PING, the TRAILERS of aborted calls) come from threads that must not wait for
// that lock: they queue, and the next holder of the lock writes them.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "common/clock.h"
#include "common/heap_bound.h"
#include "common/interrupt.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/connection_wait.h"
#include "engine/engine.h"

namespace argrpc {

// What submit() settled before it takes the send lock.
struct Connection::SubmitPlan {
  bool eager = false;           // the message goes inline, else by rendezvous
  bool client_headers = false;  // this submit carries the call's HEADERS
  bool server_headers = false;  // this submit carries the server's initial metadata
  uint64_t rdv = 0;             // the rendezvous of the exposed block (0: none)
  RemoteRef ref;                // where the peer reads that block
  bool rts_queued = false;
};

bool Connection::submit(const std::shared_ptr<Stream>& sp, const Outgoing& o, bool* would_block) {
  if (!may_submit(sp)) return false;
  // The caller has just built this message (a large one leaves the serializer's scratch
  // block free): keep what the heap holds free bounded before the pool copy.
  if (o.has_msg) heap_bound::note_message(o.msg_len);
  SubmitPlan plan;
  // Eager only if the peer's stream window can ever hold it (the peers' knobs may
  // differ); otherwise reserve_window() would wait forever.
  plan.eager = o.has_msg && o.msg_len + kFrameHeader <= cfg_.acc_size &&
               o.msg_len <= fabric_->peer_stream_window();
  // What may wait (window, pool room) comes before the headers are claimed, so a send
  // that would block leaves the stream as it was.
  if (o.has_msg && plan.eager && !reserve_window(sp, o.msg_len, would_block)) return false;
  Block block;
  if (o.has_msg && !plan.eager) {
    block = exposable_block(sp, o.msg_len, would_block);
    if (!block.valid()) return false;
  }
  if (!claim_headers(*sp, o, &plan)) return false;
  // Counted before it goes out: a peer's answer to it may be read before this thread
  // runs again, and whoever reads the counters then must see this message in them.
  if (o.has_msg)
    TransportCounters::add(plan.eager ? counters_.eager_bytes_sent : counters_.rendezvous_bytes_sent,
                           o.msg_len);
  if (block.valid()) {
    // The copy into the pool happens here, outside the send lock other calls wait on.
    plan.rdv = expose_message(o, std::move(block), &plan.ref);
    if (!plan.rdv) {  // the connection failed during the copy, which stopped there
      submit_failed(sp);
      return false;
    }
  }
  const bool ok = append_and_flush(sp, o, &plan);
  // The RTS never went out, or fail() swept exposed_ before this block was added:
  // nobody will FIN it.
  if (plan.rdv && (!plan.rts_queued || !alive())) withdraw(plan.rdv);
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
  if (ok) return true;
  submit_failed(sp);
  return false;
}

SendResult Connection::try_submit(const std::shared_ptr<Stream>& sp, const Outgoing& o) {
  bool would_block = false;
  if (submit(sp, o, &would_block)) return SendResult::kSent;
  return would_block ? SendResult::kWouldBlock : SendResult::kEnded;
}

bool Connection::may_submit(const std::shared_ptr<Stream>& sp) {
  fail_point(FailPoint::kSubmit);
  if (!alive()) {
    end_failed(sp);
    return false;
  }
  // A handler that noticed the deadline (is_active() is false once it passes) may answer
  // before the sweep has ended the call: the answer must not reach the client as OK.
  if (!client_ && sp->deadline.expired()) {
    expire(sp);
    return false;
  }
  return true;
}

// Under the stream's lock, so that of several submits on one stream exactly one carries
// its headers. False if the stream has ended. The message is committed from here on,
// so it counts in the stream's sent bytes here, under the lock its end is decided under.
bool Connection::claim_headers(Stream& s, const Outgoing& o, SubmitPlan* plan) {
  std::lock_guard<std::mutex> g(s.mu);
  if (s.ended) return false;
  if (o.has_msg) s.sent_bytes += o.msg_len;
  if (client_) plan->client_headers = !s.headers_sent;
  else plan->server_headers = !s.headers_sent && (o.initial_md || o.has_msg);
  s.headers_sent = s.headers_sent || plan->client_headers || plan->server_headers;
  return true;
}

bool Connection::reserve_window(const std::shared_ptr<Stream>& sp, size_t n, bool* would_block) {
  Stream& s = *sp;
  const int64_t need = int64_t(n);
  if (would_block) {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.ended) return false;
    if (s.send_window < need) {
      *would_block = true;
      return false;
    }
    s.send_window -= need;
    return true;
  }
  const bool ok = wait(sp, s.deadline, [&] { return s.ended || s.send_window >= need; });
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.ended) return false;
    if (ok) {
      s.send_window -= need;
      return true;
    }
  }
  expire(sp);
  return false;
}

bool Connection::append_and_flush(const std::shared_ptr<Stream>& sp, const Outgoing& o,
                                  SubmitPlan* plan) {
  appenders_.fetch_add(1, std::memory_order_seq_cst);
  std::unique_lock<std::mutex> lk = lock_send();
  appenders_.fetch_sub(1, std::memory_order_seq_cst);
  bool ok = alive();
  if (ok && ctrl_pending_.load(std::memory_order_seq_cst)) flush_ctrl_locked();
  if (ok && plan->client_headers) ok = register_client_stream_locked(sp);
  if (ok) ok = append_frames_locked(*sp, o, plan);
  // Before the flush: the doorbell may hand the CPU to the peer, which reads the status,
  // exits and is seen gone before this thread runs again. A failed flush takes it back.
  const bool status = ok && o.trailers;
  if (status) sp->status_sent.store(true, std::memory_order_release);
  // Coalescing across threads: if another sender is queued on the lock, leave the
  // batch to it; the last one in line always flushes.
  if (ok && appenders_.load(std::memory_order_seq_cst) == 0) ok = flush_locked();
  // An oversized metadata frame was refused before it was appended: what is in the
  // batch are whole frames, other senders' among them, and they still go out.
  else if (!ok && alive()) flush_locked();
  if (status && !ok) sp->status_sent.store(false, std::memory_order_release);
  lk.unlock();
  // A control frame queued while this thread held the lock found it busy and left the
  // frame to it (try_flush_ctrl): otherwise it would wait for the next progress pass,
  // up to the progress thread's longest sleep (a FIN: the sender's pool block; a
  // WINDOW: the sender's stream).
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
  return ok;
}

// Under the send lock, so that ids reach the server in the order their HEADERS do,
// increasing, whatever order the calls started in.
bool Connection::register_client_stream_locked(const std::shared_ptr<Stream>& sp) {
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    sp->id = next_stream_id_;
    next_stream_id_ += 2;
    streams_[sp->id] = sp;
  }
  engine_->deadline_set(sp->deadline);
  // Its answer is read by polling, not by a doorbell that wakes the progress thread.
  engine_->heat(this);
  fail_point(FailPoint::kRegister);
  // fail() may have swept the map just before the insert (submit_failed() ends it).
  return alive();
}

template <class Encode>
bool Connection::append_locked(uint8_t type, uint64_t stream, size_t len, Encode&& encode) {
  const size_t size = pad8(kFrameHeader + len);
  if (!room_locked(size)) return false;
  // One grow for the frame, its padding zeroed with it; then its fields in place.
  const size_t at = batch_.size();
  batch_.resize(at + size);
  const FrameHead h{type, 0, 0, static_cast<uint32_t>(len), stream};
  FrameWriter w(WriteAt(batch_.data() + at, kFrameHeader + len));
  w.raw(&h, kFrameHeader);
  encode(w);
  return true;
}

bool Connection::append_frames_locked(const Stream& s, const Outgoing& o, SubmitPlan* plan) {
  // Metadata is the peer's to size: a frame must fit the largest batch its ring takes.
  const size_t frame_cap = fabric_->peer_ring_size() / 2 - kFrameHeader;
  if (plan->client_headers) {
    const int64_t timeout_us =
        s.deadline.infinite() ? -1 : int64_t(std::max(0.0, s.deadline.remaining_seconds()) * 1e6);
    const size_t n = 8 + str_size(s.method) + metadata_size(s.request_md);
    if (n > frame_cap || !append_locked(kHeaders, s.id, n, [&](FrameWriter& w) {
          w.i64(timeout_us);
          w.str(s.method);
          w.metadata(s.request_md);
        }))
      return false;
  }
  if (plan->server_headers) {
    const Metadata& md = o.initial_md ? *o.initial_md : kNoMetadata;
    const size_t n = metadata_size(md);
    if (n > frame_cap || !append_locked(kHeaders, s.id, n, [&](FrameWriter& w) { w.metadata(md); }))
      return false;
  }
  if (o.has_msg && plan->eager &&
      !append_locked(kMessage, s.id, o.msg_len, [&](FrameWriter& w) { w.raw(o.msg, o.msg_len); }))
    return false;
  if (o.has_msg && !plan->eager) {
    plan->rts_queued = append_locked(kRts, s.id, 32, [&](FrameWriter& w) {
      w.u64(plan->rdv);
      w.u64(o.msg_len);
      w.u64(plan->ref.addr);
      w.u32(plan->ref.key);
      w.u32(0);
    });
    if (!plan->rts_queued) return false;
  }
  if (o.half_close && !append_locked(kHalfClose, s.id, 0, [](FrameWriter&) {})) return false;
  if (o.trailers) {
    static const std::string kNoDetails;
    const std::string& details = o.details ? *o.details : kNoDetails;
    const Metadata* md = o.trailing ? o.trailing : &kNoMetadata;
    const size_t n = status_body_size(details, md);
    if (n > frame_cap || !append_locked(kTrailers, s.id, n, [&](FrameWriter& w) {
          write_status_body(w, o.code, details, md);
        }))
      return false;
  }
  return true;
}

void Connection::submit_failed(const std::shared_ptr<Stream>& sp) {
  // fail() has ended this stream (live_); ending it here too costs nothing and keeps
  // the failed path self-evidently complete.
  if (!alive()) {
    end_failed(sp);
    return;
  }
  // Only an oversized header/trailer frame gets here with the connection alive.
  cancel(sp, kResourceExhausted, "argrpc: metadata too large for the receive ring");
}

void Connection::flush_pending() {
  if (!alive()) return;
  {
    std::unique_lock<std::mutex> g = lock_send();
    if (!alive()) return;
    flush_ctrl_locked();
    flush_locked();
  }
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();  // as append_and_flush
}

void Connection::queue_ctrl(uint8_t type, uint64_t stream, const std::vector<uint8_t>& body,
                            uint8_t flags) {
  std::vector<uint8_t> f;
  FrameHead h{type, flags, 0, static_cast<uint32_t>(body.size()), stream};
  Writer w(&f);
  w.raw(&h, kFrameHeader);
  w.raw(body.data(), body.size());
  f.resize(pad8(f.size()));
  {
    std::lock_guard<std::mutex> g(ctrl_mu_);
    ctrl_.push_back(std::move(f));
  }
  ctrl_pending_.store(true, std::memory_order_seq_cst);
}

void Connection::try_flush_ctrl() {
  while (ctrl_pending_.load(std::memory_order_seq_cst) && alive()) {
    // If the lock is busy its holder flushes the queue when it lets go.
    if (!send_mu_.try_lock()) return;
    flush_ctrl_locked();
    flush_locked();
    send_mu_.unlock();
  }
}

void Connection::flush_ctrl_locked() {
  std::vector<std::vector<uint8_t>> frames;
  {
    std::lock_guard<std::mutex> g(ctrl_mu_);
    frames.swap(ctrl_);
    ctrl_pending_.store(false, std::memory_order_seq_cst);
  }
  for (auto& f : frames) {
    if (!room_locked(f.size())) return;
    Writer(&batch_).raw(f.data(), f.size());
  }
}

// A batch never grows past acc_size: what is already in it goes out first.
bool Connection::room_locked(size_t n) {
  return batch_.empty() || batch_.size() + n <= cfg_.acc_size || flush_locked();
}

std::unique_lock<std::mutex> Connection::lock_send() {
  std::unique_lock<std::mutex> lk(send_mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    // Its holder may be waiting for ring credits.
    before_wait();
    lk.lock();
  }
  return lk;
}

bool Connection::flush_locked() {
  if (batch_.empty()) return true;
  const size_t ring = fabric_->peer_ring_size();
  const uint32_t len = static_cast<uint32_t>(batch_.size());
  const size_t off = wpos_ % ring;
  size_t skip = ring - off < len ? ring - off : 0;
  uint32_t imm = len;
  const Deadline stall = Deadline::after_seconds(knobs::kCreditStallSeconds);
  for (int spins = 0;; ++spins) {
    if (!alive()) {
      batch_.clear();
      return false;
    }
    uint64_t cb, cn;
    fabric_->peer_consumed(&cb, &cn);
    if (cb > wpos_ || cn > wbatches_) {
      batch_.clear();
      protocol_error("peer returned more ring credits than it was given");
      return false;
    }
    // The peer has read everything: start again at the ring's start (kBatchRestart).
    // Not where credits come back late (verbs): the skipped bytes would make them due.
    if (spins == 0 && skip == 0 && off != 0 && cb == wpos_ && !fabric_->lazy_credits()) {
      skip = ring - off;
      imm |= kBatchRestart;
    }
    // Free up to here: what the peer read, or what a restart skipped with everything
    // before it read (the peer's credits pass that point only once it reads the batch
    // that restarted).
    const uint64_t done = (imm & kBatchRestart) ? wpos_ + skip : std::max(cb, wfree_);
    if (wpos_ + skip + len - done <= ring && wbatches_ - cn < fabric_->peer_slots()) break;
    // The peer may be stuck the same way, waiting for credits we still owe it.
    if (spins == 0) {
      return_credits();
      before_wait();
    }
    if (stall.expired()) {
      batch_.clear();
      fail(kUnavailable, "argrpc: peer " + peer_.name + " stopped consuming its ring for " +
                           std::to_string(int(knobs::kCreditStallSeconds)) + " s");
      return false;
    }
    // A dead peer never returns credits, and the thread stuck here may be the progress
    // thread, the one that would otherwise learn of the hang-up.
    if (spins >= 1000 && spins % 64 == 0 && fabric_->peer_gone()) {
      batch_.clear();
      fail(kUnavailable, "argrpc: connection to " + peer_.name +
                             " lost (the peer closed it or exited)");
      return false;
    }
    if (spins < 1000) sched_yield();
    else ::usleep(50);
  }
  fail_point(FailPoint::kFlush);
  if (!alive()) {
    batch_.clear();
    return false;
  }
  wpos_ += skip;
  if (imm & kBatchRestart) wfree_ = wpos_;
  if (!fabric_->write_imm(batch_.data(), len, wpos_ % ring, imm)) {
    batch_.clear();
    fail(kUnavailable, "argrpc: write to peer " + peer_.name + " failed");
    return false;
  }
  wpos_ += len;
  ++wbatches_;
  batch_.clear();
  return true;
}

}  // namespace argrpc
