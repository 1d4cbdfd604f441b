#include "engine/connection.h"

#include <sched.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <thread>

#include "common/interrupt.h"
#include "common/spin.h"
#include "common/status.h"
#include "engine/engine.h"
#include "engine/server.h"
#include "pool/copier.h"
#include "pool/pool.h"

namespace argrpc {

namespace {
constexpr int kMaxCompletions = 64;
constexpr double kCreditStallSeconds = 10.0;
constexpr int64_t kMaxWindow = int64_t(1) << 40;
const Metadata kNoMetadata;

std::string too_large(uint64_t n, int64_t max) {
  return "Received message larger than max (" + std::to_string(n) + " vs. " +
         std::to_string(max) + ")";
}

std::vector<uint8_t> status_body(uint32_t code, const std::string& details, const Metadata* md) {
  std::vector<uint8_t> b;
  Writer w(&b);
  w.u32(code);
  w.str(details);
  if (md) w.metadata(*md);
  return b;
}
}  // namespace

Connection::Connection(Engine* engine, std::unique_ptr<Fabric> fabric, const ConnConfig& cfg,
                       std::shared_ptr<Server> server, std::string peer_name,
                       std::string peer_user_agent)
    : engine_(engine),
      fabric_(std::move(fabric)),
      cfg_(cfg),
      server_(std::move(server)),
      peer_name_(std::move(peer_name)),
      peer_user_agent_(std::move(peer_user_agent)),
      client_(server_ == nullptr) {
  batch_.reserve(cfg_.acc_size + 64);
  scratch_.reserve(cfg_.acc_size + 64);
  last_heard_us_.store(now_us(), std::memory_order_relaxed);
  last_recv_us_.store(now_us(), std::memory_order_relaxed);
}

Connection::~Connection() {
  fabric_->shutdown();
  // The QPs go before the blocks they may still be reading into return to the pool.
  fabric_.reset();
}

// ---------------------------------------------------------------- progress

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

void Connection::flush_pending() {
  if (!alive()) return;
  std::lock_guard<std::mutex> g(send_mu_);
  if (!alive()) return;
  flush_ctrl_locked();
  flush_locked();
}

bool Connection::progress_locked() {
  Completion comps[kMaxCompletions];
  bool did = false;
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
    if (rbatches_ != before) fabric_->publish_consumed(rpos_, rbatches_);
    start_queued_pulls();
  }
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
  return did;
}

bool Connection::handle_batch(uint32_t len) {
  const size_t ring = fabric_->ring_size();
  if (len == 0 || len % 8 || len > ring / 2) {
    protocol_error("batch length " + std::to_string(len) + " is invalid");
    return false;
  }
  size_t off = rpos_ % ring;
  if (ring - off < len) {
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

bool Connection::handle_frame(const FrameHead& h, const uint8_t* p) {
  Reader r(p, h.len);
  auto bad = [&](const char* what) {
    protocol_error(std::string("malformed ") + what + " frame");
    return false;
  };
  switch (h.type) {
    case kHeaders: {
      if (client_) {
        auto s = find(h.stream);
        Metadata md;
        if (!r.metadata(&md)) return bad("HEADERS");
        if (!s) return true;
        std::lock_guard<std::mutex> g(s->mu);
        if (!s->ended) {
          s->have_initial_md = true;
          s->initial_md = std::move(md);
          s->notify_locked();
        }
        return true;
      }
      if (h.stream <= last_peer_stream_ || h.stream % 2 == 0) {
        protocol_error("stream id " + std::to_string(h.stream) + " reused or not a client id");
        return false;
      }
      last_peer_stream_ = h.stream;
      const int64_t timeout_us = r.i64();
      std::string method;
      Metadata md;
      if (!r.str(&method) || !r.metadata(&md) || !r.ok()) return bad("HEADERS");
      const Deadline dl = timeout_us < 0 ? Deadline::never()
                                         : Deadline::after_seconds(double(timeout_us) / 1e6);
      auto s = new_stream(h.stream, dl);
      if (!alive()) return false;  // failed meanwhile: new_stream() ended it
      s->method = std::move(method);
      s->request_md = std::move(md);
      {
        std::lock_guard<std::mutex> g(streams_mu_);
        streams_[h.stream] = s;
      }
      if (!server_->enqueue(s)) {
        const std::string why = "server is shutting down";
        end_stream(s, kUnavailable, why, true, nullptr, false);
        queue_ctrl(kTrailers, h.stream, status_body(kUnavailable, why, &kNoMetadata));
      }
      return true;
    }
    case kMessage: {
      auto s = find(h.stream);
      if (!s) return true;
      if (cfg_.max_recv >= 0 && int64_t(h.len) > cfg_.max_recv) {
        oversize(s, h.len);
        return true;
      }
      Incoming in;
      in.eager.inline_bytes.assign(reinterpret_cast<const char*>(p), h.len);
      in.eager.len = h.len;
      bool overrun;
      {
        std::lock_guard<std::mutex> g(s->mu);
        if (s->ended) return true;
        // The window is the receiver's memory bound: a peer that ignores it is hostile.
        overrun = s->recv_held + h.len > cfg_.stream_window;
        if (!overrun) {
          s->recv_held += h.len;
          s->inbox.push_back(std::move(in));
          s->notify_locked();
        }
      }
      if (overrun) {
        protocol_error("peer overran the flow-control window of stream " + std::to_string(h.stream));
        return false;
      }
      return true;
    }
    case kRts: {
      RtsBody b;
      b.rdv_id = r.u64();
      b.length = r.u64();
      b.addr = r.u64();
      b.key = r.u32();
      if (!r.ok()) return bad("RTS");
      auto s = find(h.stream);
      if (!s) {
        queue_fin(b.rdv_id);
        return true;
      }
      if (cfg_.max_recv >= 0 && b.length > uint64_t(cfg_.max_recv)) {
        queue_fin(b.rdv_id);
        oversize(s, b.length);
        return true;
      }
      auto pull = std::make_shared<Pull>();
      pull->stream_id = h.stream;
      pull->rdv_id = b.rdv_id;
      pull->len = b.length;
      pull->src = RemoteRef{b.addr, b.key};
      pull->stream = s;
      if (Probes* probes = probes_.get()) probes->record_rts(pull->src, b.length);
      bool start = false, refuse = false;
      {
        std::lock_guard<std::mutex> g(s->mu);
        if (s->ended) {
          refuse = true;
        } else {
          s->inbox.push_back(Incoming{Payload(), pull});
          if (s->pulls_active < cfg_.pull_ahead) {
            ++s->pulls_active;
            pull->started = true;
            start = true;
          }
        }
      }
      if (refuse) queue_fin(b.rdv_id);
      if (start) start_pull(pull);
      return true;
    }
    case kFin: {
      const uint64_t rdv = r.u64();
      if (!r.ok()) return bad("FIN");
      {
        std::lock_guard<std::mutex> g(exposed_mu_);
        auto it = exposed_.find(rdv);
        if (it != exposed_.end()) {
          fabric_->unexpose(it->second);
          exposed_.erase(it);
          return true;
        }
      }
      // Not under exposed_mu_: fail() takes it to release every exposed block.
      protocol_error("FIN for a rendezvous that was never announced");
      return false;
    }
    case kHalfClose: {
      auto s = find(h.stream);
      if (!s) return true;
      std::lock_guard<std::mutex> g(s->mu);
      s->peer_half_closed = true;
      s->notify_locked();
      return true;
    }
    case kTrailers: {
      if (!client_) return bad("TRAILERS (from a client)");
      uint32_t code = r.u32();
      std::string details;
      Metadata md;
      if (!r.str(&details) || !r.metadata(&md) || !r.ok()) return bad("TRAILERS");
      if (code > kUnauthenticated) code = kUnknown;
      auto s = find(h.stream);
      if (s) end_stream(s, code, details, false, &md, true);
      return true;
    }
    case kRst: {
      uint32_t code = r.u32();
      std::string details;
      if (!r.str(&details) || !r.ok()) return bad("RST");
      if (code > kUnauthenticated) code = kUnknown;
      auto s = find(h.stream);
      if (!s) return true;
      if (client_) end_stream(s, code, details, false, nullptr, false);
      else end_stream(s, kCancelled, details, true, nullptr, false);
      return true;
    }
    case kPing:
      if (!(h.flags & kPingAck)) queue_ctrl(kPing, 0, {}, kPingAck);  // flushed after the batch
      return true;
    case kWindow: {
      const uint64_t n = r.u64();
      if (!r.ok()) return bad("WINDOW");
      auto s = find(h.stream);
      if (!s) return true;
      std::lock_guard<std::mutex> g(s->mu);
      s->send_window = std::min<int64_t>(s->send_window + int64_t(std::min<uint64_t>(n, kMaxWindow)), kMaxWindow);
      s->notify_locked();
      return true;
    }
    default:
      protocol_error("unknown frame type " + std::to_string(h.type));
      return false;
  }
}

void Connection::oversize(const std::shared_ptr<Stream>& s, uint64_t n) {
  abort_stream(s, kResourceExhausted, too_large(n, cfg_.max_recv), kCancelled);
}

// ---------------------------------------------------------------- rendezvous

namespace {
class ViewLease {
 public:
  ViewLease(std::shared_ptr<Connection> conn, uint64_t rdv_id, uint64_t len)
      : conn_(std::move(conn)), rdv_id_(rdv_id), len_(len) {}
  ViewLease(const ViewLease&) = delete;
  ViewLease& operator=(const ViewLease&) = delete;
  ~ViewLease() { conn_->release_view(rdv_id_, len_); }

 private:
  std::shared_ptr<Connection> conn_;
  uint64_t rdv_id_, len_;
};
}  // namespace

bool Connection::try_view(const std::shared_ptr<Pull>& p) {
  if (p->len < cfg_.view_min) return false;
  const uint8_t* v = fabric_->peer_view(p->src, p->len);
  if (!v) return false;
  // Bounded so a reader that keeps views cannot drain the sender's pool.
  const uint64_t held = leased_bytes_.fetch_add(p->len);
  if (held + p->len > fabric_->peer_view_budget()) {
    leased_bytes_.fetch_sub(p->len);
    return false;
  }
  p->dst.view = v;
  p->dst.lease = std::make_shared<ViewLease>(shared_from_this(), p->rdv_id, p->len);
  if (auto s = p->stream.lock()) {
    std::lock_guard<std::mutex> g(s->mu);
    p->complete = true;
    s->notify_locked();
  }
  return true;
}

void Connection::release_view(uint64_t rdv_id, uint64_t len) {
  leased_bytes_.fetch_sub(len);
  if (!alive()) return;
  queue_fin(rdv_id);
  // Runs wherever the last reference died (often a Python thread): hand the flush to
  // the progress thread rather than wait on ring credits here.
  engine_->wake();
}

void Connection::start_pull(const std::shared_ptr<Pull>& p) {
  p->dst.is_inline = false;
  p->dst.len = p->len;
  if (try_view(p)) return;
  Block b = engine_->pool()->try_alloc(p->len);
  if (b.valid()) {
    p->dst.block = std::move(b);
  } else {
    p->dst.heap.reset(new (std::nothrow) uint8_t[p->len ? p->len : 1]);
    if (!p->dst.heap) {
      queue_fin(p->rdv_id);
      if (auto s = p->stream.lock())
        abort_stream(s, kResourceExhausted,
                     "argrpc: no memory to receive a " + std::to_string(p->len) + "-byte message",
                     kCancelled);
      return;
    }
  }
  if (p->len == 0) {
    queue_fin(p->rdv_id);
    if (auto s = p->stream.lock()) {
      std::lock_guard<std::mutex> g(s->mu);
      p->complete = true;
      s->notify_locked();
    }
    return;
  }
  post_reads(p);
}

void Connection::post_reads(const std::shared_ptr<Pull>& p) {
  while (p->inflight < cfg_.reads_in_flight && p->next_off < p->len) {
    const size_t n = std::min<uint64_t>(cfg_.chunk_size, p->len - p->next_off);
    const uint64_t wr = next_wr_++;
    const uint64_t off = p->next_off;
    reads_[wr] = Read{p, n};
    ++p->inflight;
    p->next_off += n;
    if (off > std::numeric_limits<uint64_t>::max() - p->src.addr ||
        !fabric_->read(p->dst.data() + off, RemoteRef{p->src.addr + off, p->src.key}, n, wr)) {
      reads_.erase(wr);
      protocol_error("RTS announces memory outside the peer's pool");
      return;
    }
  }
}

void Connection::on_read_done(uint64_t wr_id) {
  auto it = reads_.find(wr_id);
  if (it == reads_.end()) {
    if (Probes* probes = probes_.get()) probes->read_done(wr_id);
    return;
  }
  Read rd = std::move(it->second);
  reads_.erase(it);
  auto& p = rd.pull;
  --p->inflight;
  p->done += rd.len;
  fail_point(FailPoint::kPull);
  if (!alive()) return;
  if (p->next_off < p->len) {
    post_reads(p);
    return;
  }
  if (p->inflight > 0) return;
  queue_fin(p->rdv_id);
  if (auto s = p->stream.lock()) {
    std::lock_guard<std::mutex> g(s->mu);
    if (!p->orphaned) {
      p->complete = true;
      s->notify_locked();
    }
  }
}

bool Connection::probe_raw_batch(const uint8_t* p, size_t len) {
  std::lock_guard<std::mutex> lk(send_mu_);
  if (!alive() || len == 0 || len > fabric_->peer_ring_size() / 2) return false;
  if (!flush_locked()) return false;  // what honest senders queued goes first
  batch_.assign(p, p + len);
  return flush_locked();
}

RemoteRef Connection::probe_last_rts(uint64_t* len) { return probes_.enable().last_rts(len); }

std::string Connection::probe_read(const RemoteRef& src, size_t len, double timeout) {
  Probes& probes = probes_.enable();
  uint64_t wr;
  {
    // next_wr_ and the fabric's reads belong to the poll lock's holder.
    std::lock_guard<std::mutex> g(poll_mu_);
    if (!alive()) return error();
    wr = next_wr_++;
    uint8_t* dst = probes.start_read(wr, len);
    if (!fabric_->read(dst, src, len, wr)) return "refused locally: outside the peer's pool";
  }
  const Deadline dl = Deadline::after_seconds(timeout);
  while (!dl.expired()) {
    progress();
    if (probes.take_done(wr)) return "";
    if (!alive()) return error();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return "timed out";
}

void Connection::start_queued_pulls() {
  std::vector<std::shared_ptr<Pull>> q;
  {
    std::lock_guard<std::mutex> g(pullq_mu_);
    if (pullq_.empty()) return;
    q.swap(pullq_);
  }
  for (auto& p : q) start_pull(p);
}

void Connection::queue_fin(uint64_t rdv_id) {
  std::vector<uint8_t> b;
  Writer(&b).u64(rdv_id);
  queue_ctrl(kFin, 0, b);
}

// ---------------------------------------------------------------- sending

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
    if (!batch_.empty() && batch_.size() + f.size() > cfg_.acc_size && !flush_locked()) return;
    Writer(&batch_).raw(f.data(), f.size());
  }
}

bool Connection::frame_begin_locked(uint8_t type, uint64_t stream, size_t len) {
  const size_t total = pad8(kFrameHeader + len);
  if (!batch_.empty() && batch_.size() + total > cfg_.acc_size && !flush_locked()) return false;
  FrameHead h{type, 0, 0, static_cast<uint32_t>(len), stream};
  Writer(&batch_).raw(&h, kFrameHeader);
  return true;
}

void Connection::frame_end_locked() { batch_.resize(pad8(batch_.size()), 0); }

bool Connection::flush_locked() {
  if (batch_.empty()) return true;
  const size_t ring = fabric_->peer_ring_size();
  const uint32_t len = static_cast<uint32_t>(batch_.size());
  const size_t off = wpos_ % ring;
  const size_t skip = ring - off < len ? ring - off : 0;
  const Deadline stall = Deadline::after_seconds(kCreditStallSeconds);
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
    if (wpos_ + skip + len - cb <= ring && wbatches_ - cn < fabric_->peer_slots()) break;
    if (stall.expired()) {
      batch_.clear();
      fail(kUnavailable, "argrpc: peer " + peer_name_ + " stopped consuming its ring for 10 s");
      return false;
    }
    // A dead peer never returns credits, and the thread stuck here may be the progress
    // thread, the one that would otherwise learn of the hang-up.
    if (spins >= 1000 && spins % 64 == 0 && fabric_->peer_gone()) {
      batch_.clear();
      fail(kUnavailable, "argrpc: connection to " + peer_name_ +
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
  if (!fabric_->write_imm(batch_.data(), len, wpos_ % ring)) {
    batch_.clear();
    fail(kUnavailable, "argrpc: write to peer " + peer_name_ + " failed");
    return false;
  }
  wpos_ += len;
  ++wbatches_;
  batch_.clear();
  return true;
}

bool Connection::reserve_window(const std::shared_ptr<Stream>& sp, size_t n) {
  Stream& s = *sp;
  const bool ok = wait(sp, s.deadline, [&] { return s.ended || s.send_window >= int64_t(n); });
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.ended) return false;
    if (ok) {
      s.send_window -= int64_t(n);
      return true;
    }
  }
  expire(sp);
  return false;
}

bool Connection::submit(const std::shared_ptr<Stream>& sp, const Outgoing& o) {
  Stream& s = *sp;
  fail_point(FailPoint::kSubmit);
  if (!alive()) {
    end_failed(sp);
    return false;
  }
  // A handler that noticed the deadline (is_active() is false once it passes) may answer
  // before the sweep has ended the call: the answer must not reach the client as OK.
  if (!client_ && s.deadline.expired()) {
    expire(sp);
    return false;
  }
  // Eager only if the peer's stream window can ever hold it (the peers' knobs may
  // differ); otherwise reserve_window() would wait forever.
  const bool eager = o.has_msg && o.msg_len + kFrameHeader <= cfg_.acc_size &&
                     o.msg_len <= fabric_->peer_stream_window();
  uint64_t rdv = 0;
  bool rts_queued = false;
  RemoteRef ref;
  bool client_headers = false, server_headers = false;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.ended) return false;
    if (client_) client_headers = !s.headers_sent;
    else server_headers = !s.headers_sent && (o.initial_md || o.has_msg);
    s.headers_sent = s.headers_sent || client_headers || server_headers;
  }
  if (o.has_msg && eager && !reserve_window(sp, o.msg_len)) return false;
  if (o.has_msg && !eager) {
    AllocStatus st;
    Block block = engine_->pool()->alloc(o.msg_len, s.deadline, &st, &dead_);
    if (!block.valid()) {
      if (st == AllocStatus::kAborted) {  // the connection failed meanwhile
        end_failed(sp);
        return false;
      }
      const std::string cap = std::to_string(engine_->pool()->capacity());
      std::string why;
      if (st == AllocStatus::kTooBig)
        why = "argrpc: a " + std::to_string(o.msg_len) +
              "-byte message is larger than the whole registered pool (TF_RDMA_BUF_SIZE=" + cap + ")";
      else if (st == AllocStatus::kTimeout)
        why = "argrpc: no room in the registered pool (TF_RDMA_BUF_SIZE=" + cap +
              ") for a " + std::to_string(o.msg_len) + "-byte message before the deadline";
      else
        why = "argrpc: engine is shutting down";
      // The peer learns of the stream only if headers went out earlier.
      if (client_headers) end_stream(sp, kResourceExhausted, why, false, nullptr, false);
      else cancel(sp, kResourceExhausted, why);
      return false;
    }
    engine_->copier().copy(block.data(), o.msg, o.msg_len);
    fail_point(FailPoint::kCopyIn);
    ref = fabric_->expose(block);
    std::lock_guard<std::mutex> g(exposed_mu_);
    rdv = next_rdv_++;
    exposed_.emplace(rdv, std::move(block));
  }

  const size_t frame_cap = fabric_->peer_ring_size() / 2 - kFrameHeader;
  appenders_.fetch_add(1, std::memory_order_seq_cst);
  std::unique_lock<std::mutex> lk(send_mu_);
  appenders_.fetch_sub(1, std::memory_order_seq_cst);
  bool ok = alive();
  if (ok && ctrl_pending_.load(std::memory_order_seq_cst)) flush_ctrl_locked();
  if (ok && client_headers) {
    {
      std::lock_guard<std::mutex> g(streams_mu_);
      s.id = next_stream_id_;
      next_stream_id_ += 2;
      streams_[s.id] = sp;
    }
    fail_point(FailPoint::kRegister);
    // fail() may have swept the map just before the insert (ended at the end below).
    ok = alive();
  }
  if (ok && client_headers) {
    const int64_t timeout_us =
        s.deadline.infinite() ? -1 : int64_t(std::max(0.0, s.deadline.remaining_seconds()) * 1e6);
    const size_t n = 8 + str_size(s.method) + metadata_size(s.request_md);
    ok = n <= frame_cap && frame_begin_locked(kHeaders, s.id, n);
    if (ok) {
      Writer w(&batch_);
      w.i64(timeout_us);
      w.str(s.method);
      w.metadata(s.request_md);
      frame_end_locked();
    }
  }
  if (ok && server_headers) {
    const Metadata& md = o.initial_md ? *o.initial_md : kNoMetadata;
    const size_t n = metadata_size(md);
    ok = n <= frame_cap && frame_begin_locked(kHeaders, s.id, n);
    if (ok) {
      Writer(&batch_).metadata(md);
      frame_end_locked();
    }
  }
  if (ok && o.has_msg && eager) {
    ok = frame_begin_locked(kMessage, s.id, o.msg_len);
    if (ok) {
      Writer(&batch_).raw(o.msg, o.msg_len);
      frame_end_locked();
    }
  }
  if (ok && o.has_msg && !eager) {
    ok = frame_begin_locked(kRts, s.id, 32);
    rts_queued = ok;
    if (ok) {
      Writer w(&batch_);
      w.u64(rdv);
      w.u64(o.msg_len);
      w.u64(ref.addr);
      w.u32(ref.key);
      w.u32(0);
      frame_end_locked();
    }
  }
  if (ok && o.half_close) {
    ok = frame_begin_locked(kHalfClose, s.id, 0);
    if (ok) frame_end_locked();
  }
  if (ok && o.trailers) {
    auto body = status_body(o.code, o.details ? *o.details : std::string(),
                            o.trailing ? o.trailing : &kNoMetadata);
    ok = body.size() <= frame_cap && frame_begin_locked(kTrailers, s.id, body.size());
    if (ok) {
      Writer(&batch_).raw(body.data(), body.size());
      frame_end_locked();
    }
  }
  // Coalescing across threads: if another sender is queued on the lock, leave the
  // batch to it; the last one in line always flushes.
  if (ok && appenders_.load(std::memory_order_seq_cst) == 0) ok = flush_locked();
  // An oversized metadata frame was refused before it was appended: what is in the
  // batch are whole frames, other senders' among them, and they still go out.
  else if (!ok && alive()) flush_locked();
  lk.unlock();
  if (!eager && rdv != 0 && (!rts_queued || !alive())) {
    // The RTS never went out, or fail() swept exposed_ before this block was added:
    // nobody will FIN it.
    std::lock_guard<std::mutex> g(exposed_mu_);
    auto it = exposed_.find(rdv);
    if (it != exposed_.end()) {
      fabric_->unexpose(it->second);
      exposed_.erase(it);
    }
  }
  if (ctrl_pending_.load(std::memory_order_seq_cst)) try_flush_ctrl();
  if (ok) return true;
  // The connection failed at any point above. fail() has ended this stream (live_);
  // ending it here too costs nothing and keeps this path self-evidently complete.
  if (!alive()) {
    end_failed(sp);
    return false;
  }
  // Only an oversized header/trailer frame gets here with the connection alive.
  cancel(sp, kResourceExhausted, "argrpc: metadata too large for the receive ring");
  return false;
}

// ---------------------------------------------------------------- streams

std::shared_ptr<Stream> Connection::find(uint64_t id) {
  std::lock_guard<std::mutex> g(streams_mu_);
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : it->second;
}

void Connection::release_inbox_locked(Stream& s, std::vector<uint64_t>* fins) {
  for (auto& in : s.inbox) {
    if (!in.pull) continue;
    if (!in.pull->started) fins->push_back(in.pull->rdv_id);
    else in.pull->orphaned = true;
  }
  s.inbox.clear();
  s.pulls_active = 0;
}

bool Connection::end_stream(const std::shared_ptr<Stream>& s, uint32_t code,
                            const std::string& details, bool cancelled, Metadata* trailing,
                            bool keep_inbox) {
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    auto it = streams_.find(s->id);
    if (it != streams_.end() && it->second == s) streams_.erase(it);
  }
  std::vector<uint64_t> fins;
  bool report = false;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->ended) return false;
    s->ended = true;
    s->code = code;
    s->details = details;
    if (trailing) s->trailing_md = std::move(*trailing);
    if (cancelled) {
      s->cancelled = true;
      report = !s->reported_cancel;
      s->reported_cancel = true;
    }
    if (!keep_inbox) release_inbox_locked(*s, &fins);
    s->notify_locked();
  }
  for (uint64_t f : fins) queue_fin(f);
  if (server_) {
    server_->remove_active(s.get());
    if (report) server_->report_cancelled(s);
  }
  return true;
}

void Connection::abandon(const std::shared_ptr<Stream>& s) {
  bool ended;
  {
    std::lock_guard<std::mutex> g(s->mu);
    ended = s->ended;
  }
  if (!ended) cancel(s, kCancelled, "Cancelled");
  std::vector<uint64_t> fins;
  {
    std::lock_guard<std::mutex> g(s->mu);
    release_inbox_locked(*s, &fins);
  }
  for (uint64_t f : fins) queue_fin(f);
  try_flush_ctrl();
}

void Connection::expire(const std::shared_ptr<Stream>& s) {
  abort_stream(s, kDeadlineExceeded, "Deadline Exceeded", kDeadlineExceeded);
  try_flush_ctrl();
}

bool Connection::abort_stream(const std::shared_ptr<Stream>& s, uint32_t code,
                              const std::string& why, uint32_t rst_code) {
  if (!end_stream(s, code, why, !client_, nullptr, false)) return false;
  if (!client_) queue_ctrl(kTrailers, s->id, status_body(code, why, &kNoMetadata));
  else if (s->id) queue_ctrl(kRst, s->id, status_body(rst_code, why, nullptr));
  return true;
}

void Connection::keepalive(uint64_t now) {
  if (!alive()) return;
  if (ping_sent_us_) {
    if (last_recv_us_.load(std::memory_order_relaxed) >= ping_sent_us_) {
      ping_sent_us_ = 0;  // answered (any batch will do)
    } else if (now - ping_sent_us_ >= uint64_t(cfg_.keepalive_timeout_ms) * 1000) {
      fail(kUnavailable, "argrpc: peer " + peer_name_ + " did not answer a keepalive for " +
                             std::to_string(cfg_.keepalive_timeout_ms / 1000) +
                             " s (it died or hangs)");
      return;
    }
  }
  const uint64_t heard = last_heard_us_.load(std::memory_order_relaxed);
  if (now - heard < uint64_t(cfg_.keepalive_ms) * 1000) return;
  bool idle;
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    idle = streams_.empty();
  }
  if (idle) {
    // A peer still holding our pool blocks (a large answer it has not pulled or still
    // views) is not idle: if it hangs, they are lost to everyone else.
    std::lock_guard<std::mutex> g(exposed_mu_);
    idle = exposed_.empty();
  }
  // An idle shm peer's death shows on its socket; an idle verbs peer's only on a write.
  if (idle && (fabric_->liveness_fd() >= 0 || cfg_.idle_keepalive_ms == 0 ||
               now - heard < uint64_t(cfg_.idle_keepalive_ms) * 1000))
    return;
  // Restart the clock so a silent but live peer gets one PING per interval.
  last_heard_us_.store(now, std::memory_order_relaxed);
  if (!ping_sent_us_) ping_sent_us_ = now;
  queue_ctrl(kPing, 0, {});
  try_flush_ctrl();
}

void Connection::sweep_deadlines() {
  std::vector<std::shared_ptr<Stream>> due;
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    for (auto& kv : streams_)
      if (kv.second->deadline.expired()) due.push_back(kv.second);
  }
  for (auto& s : due) expire(s);
}

bool Connection::cancel(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details) {
  const bool ended = abort_stream(s, code, details, code);
  try_flush_ctrl();
  return ended;
}

void Connection::protocol_error(const std::string& what) {
  fail(kInternal, "argrpc: connection to " + peer_name_ + " closed: protocol error: " + what);
}

void Connection::fail(uint32_t code, const std::string& why) {
  if (inherited()) return;  // the parent's: its fabric must not be touched from here
  if (dead_.exchange(true)) return;
  const auto self = shared_from_this();  // detach() below may drop the engine's reference
  {
    std::lock_guard<std::mutex> g(epitaph_->mu);
    epitaph_->why = why;
    epitaph_->code = code;
  }
  fabric_->shutdown();
  // dead_ is set: a stream made from here on ends at birth (new_stream), so this
  // sweep and that check between them reach every stream of the connection.
  std::vector<std::shared_ptr<Stream>> all;
  {
    std::lock_guard<std::mutex> g(live_mu_);
    for (auto& kv : live_)
      if (auto s = kv.second.lock()) all.push_back(std::move(s));
  }
  size_t lost = 0;
  for (auto& s : all) lost += end_failed(s);
  // An idle connection whose peer went away is routine; lost calls and protocol
  // errors are not, and must be visible.
  if (code == kInternal || (code != kCancelled && lost))
    std::fprintf(stderr, "%s (%zu calls affected)\n", why.c_str(), lost);
  {
    std::lock_guard<std::mutex> g(exposed_mu_);
    exposed_.clear();
  }
  // A submit() of this connection waiting for pool room must not outwait its death.
  engine_->pool()->wake_waiters();
  {
    std::lock_guard<std::mutex> g(pullq_mu_);
    pullq_.clear();
  }
  engine_->detach(this);
}

bool Connection::end_failed(const std::shared_ptr<Stream>& s) {
  // Only after fail() set dead_ and the error: a forked child's view of the parent's
  // connection is not alive() either, and must not touch the parent's locks.
  if (!dead_.load(std::memory_order_acquire) || inherited()) return false;
  uint32_t code;
  std::string why;
  {
    std::lock_guard<std::mutex> g(epitaph_->mu);
    code = epitaph_->code;
    why = epitaph_->why;
  }
  if (!client_) code = kCancelled;
  if (end_stream(s, code, why, !client_, nullptr, false)) return true;
  // It had ended (its trailers came) while a message was still being pulled or waited
  // to be: the reader gets what arrived whole, then this error instead of the status.
  std::lock_guard<std::mutex> g(s->mu);
  auto lost = std::find_if(s->inbox.begin(), s->inbox.end(),
                           [](const Incoming& in) { return !in.ready(); });
  if (lost == s->inbox.end()) return false;
  for (auto it = lost; it != s->inbox.end(); ++it)
    if (it->pull) it->pull->orphaned = true;
  s->inbox.erase(lost, s->inbox.end());
  s->pulls_active = 0;
  s->code = code;
  s->details = why;
  s->trailing_md.clear();
  s->notify_locked();
  return true;
}

std::shared_ptr<Stream> Connection::new_stream(uint64_t id, const Deadline& dl) {
  auto s = std::make_shared<Stream>(id, client_, shared_from_this(), dl);
  s->send_window = static_cast<int64_t>(fabric_->peer_stream_window());
  {
    std::lock_guard<std::mutex> g(live_mu_);
    live_.emplace(s.get(), s);
  }
  // After the insert: either fail()'s sweep sees it, or this sees dead_.
  if (dead_.load(std::memory_order_acquire)) end_failed(s);
  return s;
}

void Connection::forget_stream(Stream* s) {
  std::lock_guard<std::mutex> g(live_mu_);
  live_.erase(s);
}

Stream::~Stream() {
  // A forked child's copy of the parent's stream: the parent's locks are not ours.
  if (!conn->inherited()) conn->forget_stream(this);
}

// ---------------------------------------------------------------- public call API

std::shared_ptr<Stream> Connection::start_call(const std::string& method, const Metadata& md,
                                               double timeout, bool send_headers_now) {
  const Deadline dl = timeout < 0 ? Deadline::never() : Deadline::after_seconds(timeout);
  auto s = new_stream(0, dl);
  s->method = method;
  s->request_md = md;
  if (send_headers_now) submit(s, Outgoing{});  // a dead connection ends it there
  return s;
}

bool Connection::send_initial_metadata(const std::shared_ptr<Stream>& s, const Metadata& md) {
  Outgoing o;
  o.initial_md = &md;
  return submit(s, o);
}

bool Connection::send(const std::shared_ptr<Stream>& s, const uint8_t* msg, size_t len,
                      bool half_close) {
  Outgoing o;
  o.msg = msg;
  o.msg_len = len;
  o.has_msg = true;
  o.half_close = half_close;
  return submit(s, o);
}

bool Connection::half_close(const std::shared_ptr<Stream>& s) {
  Outgoing o;
  o.half_close = true;
  return submit(s, o);
}

bool Connection::finish(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details,
                        const Metadata& trailing, const uint8_t* msg, size_t len, bool has_msg) {
  Outgoing o;
  o.msg = msg;
  o.msg_len = len;
  o.has_msg = has_msg;
  o.trailers = true;
  o.code = code;
  o.details = &details;
  o.trailing = &trailing;
  const bool ok = submit(s, o);
  if (ok) end_stream(s, code, details, false, nullptr, false);
  return ok;
}

template <class Pred>
bool Connection::wait(const std::shared_ptr<Stream>& sp, const Deadline& dl, Pred pred) {
  Stream& s = *sp;
  auto ready = [&] {
    std::lock_guard<std::mutex> g(s.mu);
    return pred();
  };
  if (ready()) return true;
  engine_->enter_polling();
  const bool ok = spin_until(engine_->config().spin_us, dl, ready, [&] { progress(); });
  engine_->leave_polling();
  if (ok) return true;
  WaitInterrupt* const interrupt = current_interrupt();
  auto next_check = Clock::now() + kInterruptPoll;
  std::unique_lock<std::mutex> lk(s.mu);
  bool checked_dead = false;
  while (!pred()) {
    if (dl.expired()) return false;
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
    s.cv.wait_until(lk, until);
    --s.sleepers;
  }
  return true;
}

bool Connection::recv(const std::shared_ptr<Stream>& sp, Payload* out) {
  Stream& s = *sp;
  auto pred = [&] {
    return (!s.inbox.empty() && s.inbox.front().ready()) ||
           (s.inbox.empty() && (s.peer_half_closed || s.ended));
  };
  if (!wait(sp, s.deadline, pred)) {
    expire(sp);
    return false;
  }
  std::shared_ptr<Pull> next;
  uint64_t ack = 0;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.inbox.empty() || !s.inbox.front().ready()) return false;
    Incoming in = std::move(s.inbox.front());
    s.inbox.pop_front();
    if (in.pull) {
      *out = std::move(in.pull->dst);
      if (s.pulls_active > 0) --s.pulls_active;
      for (auto& e : s.inbox) {
        if (e.pull && !e.pull->started) {
          e.pull->started = true;
          ++s.pulls_active;
          next = e.pull;
          break;
        }
      }
    } else {
      *out = std::move(in.eager);
      s.recv_unacked += out->len;
      if (!s.ended && s.recv_unacked >= cfg_.stream_window / 4) {
        ack = s.recv_unacked;
        s.recv_unacked = 0;
        s.recv_held -= std::min(s.recv_held, ack);
      }
    }
  }
  if (next) {
    {
      std::lock_guard<std::mutex> g(pullq_mu_);
      pullq_.push_back(next);
    }
    kick_.store(true, std::memory_order_seq_cst);
    progress();
  }
  if (ack) {
    std::vector<uint8_t> b;
    Writer(&b).u64(ack);
    queue_ctrl(kWindow, s.id, b);
    try_flush_ctrl();
  }
  return true;
}

bool Connection::wait_initial_metadata(const std::shared_ptr<Stream>& sp) {
  Stream& s = *sp;
  if (!wait(sp, s.deadline, [&] { return s.have_initial_md || s.ended; })) expire(sp);
  std::lock_guard<std::mutex> g(s.mu);
  return s.have_initial_md;
}

bool Connection::wait_end(const std::shared_ptr<Stream>& sp, const Deadline& limit) {
  Stream& s = *sp;
  if (wait(sp, limit.earlier(s.deadline), [&] { return s.ended; })) return true;
  if (s.deadline.expired()) {
    expire(sp);
    return true;
  }
  return false;
}

}  // namespace argrpc
