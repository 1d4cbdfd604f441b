// What each frame the peer sends does, one handler per kind. They run under the poll
// lock, in the order the peer wrote the frames; a false return means the connection
// failed and the rest of the batch is not read.
#include <algorithm>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/server.h"

namespace argrpc {

namespace {
constexpr int64_t kMaxWindow = int64_t(1) << 40;

// grpc's words, which differ by side.
std::string too_large(uint64_t n, int64_t max, bool client) {
  const std::string what = "Received message larger than max (" + std::to_string(n) + " vs. " +
                           std::to_string(max) + ")";
  return client ? "Stream removed (CLIENT: " + what + ")" : "SERVER: " + what;
}
}  // namespace

bool Connection::handle_frame(const FrameHead& h, const uint8_t* p) {
  Reader r(p, h.len);
  switch (h.type) {
    case kHeaders: return on_headers(h, r);
    case kMessage: return on_message(h, p);
    case kRts: return on_rts(h, r);
    case kFin: return on_fin(r);
    case kHalfClose: return on_half_close(h);
    case kTrailers: return on_trailers(h, r);
    case kRst: return on_rst(h, r);
    case kWindow: return on_window(h, r);
    case kPing: return on_ping(h);
    default:
      protocol_error("unknown frame type " + std::to_string(h.type));
      return false;
  }
}

bool Connection::malformed(const char* what) {
  protocol_error(std::string("malformed ") + what + " frame");
  return false;
}

void Connection::oversize(const std::shared_ptr<Stream>& s, uint64_t n) {
  // The limit fails the message that breaks it: those before it are still read, in order.
  abort_stream(s, kResourceExhausted, too_large(n, cfg_.max_recv, client_), kCancelled, true);
}

bool Connection::on_headers(const FrameHead& h, Reader& r) {
  return client_ ? on_initial_metadata(h, r) : on_new_call(h, r);
}

bool Connection::on_initial_metadata(const FrameHead& h, Reader& r) {
  auto s = find(h.stream);
  Metadata md;
  if (!r.metadata(&md)) return malformed("HEADERS");
  if (!s) return true;
  std::lock_guard<std::mutex> g(s->mu);
  if (!s->ended) {
    s->have_initial_md = true;
    s->initial_md = std::move(md);
    s->notify_locked();
  }
  return true;
}

bool Connection::on_new_call(const FrameHead& h, Reader& r) {
  if (h.stream <= last_peer_stream_ || h.stream % 2 == 0) {
    protocol_error("stream id " + std::to_string(h.stream) + " reused or not a client id");
    return false;
  }
  last_peer_stream_ = h.stream;
  const int64_t timeout_us = r.i64();
  std::string method;
  Metadata md;
  if (!r.str(&method) || !r.metadata(&md) || !r.ok()) return malformed("HEADERS");
  const Deadline dl = timeout_us < 0 ? Deadline::never()
                                     : Deadline::after_seconds(double(timeout_us) / 1e6);
  auto s = new_stream(h.stream, dl, std::move(method));
  if (!alive()) return false;  // failed meanwhile: new_stream() ended it
  s->request_md = std::move(md);
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    streams_[h.stream] = s;
  }
  engine_->deadline_set(dl);
  if (!server_->enqueue(s)) {
    const std::string why = "server is shutting down";
    end_stream(s, kUnavailable, why, true, nullptr, false);
    queue_ctrl(kTrailers, h.stream, status_body(kUnavailable, why, &kNoMetadata));
  }
  return true;
}

bool Connection::on_message(const FrameHead& h, const uint8_t* p) {
  TransportCounters::add(counters_.eager_bytes_received, h.len);  // arrived, whatever its stream
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
      s->rcvd_bytes += h.len;
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

bool Connection::on_rts(const FrameHead& h, Reader& r) {
  RtsBody b;
  b.rdv_id = r.u64();
  b.length = r.u64();
  b.addr = r.u64();
  b.key = r.u32();
  if (!r.ok()) return malformed("RTS");
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
      s->rcvd_bytes += b.length;
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

bool Connection::on_fin(Reader& r) {
  const uint64_t rdv = r.u64();
  if (!r.ok()) return malformed("FIN");
  if (withdraw(rdv)) return true;
  // Only now, out of exposed_mu_: fail() takes it to release every exposed block.
  protocol_error("FIN for a rendezvous that was never announced");
  return false;
}

bool Connection::on_half_close(const FrameHead& h) {
  auto s = find(h.stream);
  if (!s) return true;
  std::lock_guard<std::mutex> g(s->mu);
  s->peer_half_closed = true;
  s->notify_locked();
  return true;
}

bool Connection::on_trailers(const FrameHead& h, Reader& r) {
  if (!client_) return malformed("TRAILERS (from a client)");
  uint32_t code = r.u32();
  std::string details;
  Metadata md;
  if (!r.str(&details) || !r.metadata(&md) || !r.ok()) return malformed("TRAILERS");
  if (code > kUnauthenticated) code = kUnknown;
  auto s = find(h.stream);
  if (s) end_stream(s, code, details, false, &md, true);
  return true;
}

bool Connection::on_rst(const FrameHead& h, Reader& r) {
  uint32_t code = r.u32();
  std::string details;
  if (!r.str(&details) || !r.ok()) return malformed("RST");
  if (code > kUnauthenticated) code = kUnknown;
  auto s = find(h.stream);
  if (!s) return true;
  if (client_) end_stream(s, code, details, false, nullptr, false);
  else end_stream(s, kCancelled, details, true, nullptr, false);
  return true;
}

bool Connection::on_window(const FrameHead& h, Reader& r) {
  const uint64_t n = r.u64();
  if (!r.ok()) return malformed("WINDOW");
  auto s = find(h.stream);
  if (!s) return true;
  std::lock_guard<std::mutex> g(s->mu);
  s->send_window = std::min<int64_t>(s->send_window + int64_t(std::min<uint64_t>(n, kMaxWindow)), kMaxWindow);
  s->notify_locked();
  return true;
}

bool Connection::on_ping(const FrameHead& h) {
  if (!(h.flags & kPingAck)) queue_ctrl(kPing, 0, {}, kPingAck);  // flushed after the batch
  return true;
}

}  // namespace argrpc
