// What the bindings call on a connection for one call: start it, send, receive, wait
// for its metadata or its end, finish it. Sending goes through submit().
#include <algorithm>
#include <string>

#include "common/heap_bound.h"
#include "engine/connection.h"
#include "engine/connection_wait.h"
#include "engine/polling_lease.h"
#include "engine/server.h"

namespace argrpc {

namespace {
Outgoing finish_frames(uint32_t code, const std::string& details, const Metadata& trailing,
                       const uint8_t* msg, size_t len, bool has_msg) {
  Outgoing o;
  o.msg = msg;
  o.msg_len = len;
  o.has_msg = has_msg;
  o.trailers = true;
  o.code = code;
  o.details = &details;
  o.trailing = &trailing;
  return o;
}

Outgoing message_frames(const uint8_t* msg, size_t len, bool half_close) {
  Outgoing o;
  o.msg = msg;
  o.msg_len = len;
  o.has_msg = true;
  o.half_close = half_close;
  return o;
}

// A message is ready to take, or none will come.
bool recv_ready(const Stream& s) {
  return (!s.inbox.empty() && s.inbox.front().ready()) ||
         (s.inbox.empty() && (s.peer_half_closed || s.ended));
}
}  // namespace

std::shared_ptr<Stream> Connection::start_call(const std::string& method, const Metadata& md,
                                               double timeout, bool send_headers_now,
                                               uint64_t group) {
  const Deadline dl = timeout < 0 ? Deadline::never() : Deadline::after_seconds(timeout);
  auto s = new_stream(0, dl, method, group);
  s->request_md = md;
  if (send_headers_now) submit(s, Outgoing{});  // a dead connection ends it there
  return s;
}

bool Connection::never_sent(const std::shared_ptr<Stream>& s) {
  if (!client_) return false;
  uint64_t id;
  {
    std::unique_lock<std::mutex> g = lock_send();  // where the id is given
    id = s->id;
  }
  std::lock_guard<std::mutex> g(s->mu);
  return id == 0 && s->ended && s->code == kUnavailable;
}

bool Connection::send_initial_metadata(const std::shared_ptr<Stream>& s, const Metadata& md) {
  Outgoing o;
  o.initial_md = &md;
  return submit(s, o);
}

bool Connection::send(const std::shared_ptr<Stream>& s, const uint8_t* msg, size_t len,
                      bool half_close) {
  return submit(s, message_frames(msg, len, half_close));
}

bool Connection::half_close(const std::shared_ptr<Stream>& s) {
  Outgoing o;
  o.half_close = true;
  return submit(s, o);
}

bool Connection::finish(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details,
                        const Metadata& trailing, const uint8_t* msg, size_t len, bool has_msg) {
  // Before the status goes out: the peer may answer it with its next request at once.
  if (!client_ && server_ && server_->queued() == 0) polling_lease::finishing(engine_, server_, s.get());
  const bool ok = submit(s, finish_frames(code, details, trailing, msg, len, has_msg));
  if (ok) {
    fail_point(FailPoint::kFinished);
    end_stream(s, code, details, false, nullptr, false);
  }
  return ok;
}

SendResult Connection::try_send(const std::shared_ptr<Stream>& s, const uint8_t* msg, size_t len,
                                bool half_close) {
  return try_submit(s, message_frames(msg, len, half_close));
}

SendResult Connection::try_finish(const std::shared_ptr<Stream>& s, uint32_t code,
                                  const std::string& details, const Metadata& trailing,
                                  const uint8_t* msg, size_t len, bool has_msg) {
  const SendResult r = try_submit(s, finish_frames(code, details, trailing, msg, len, has_msg));
  if (r == SendResult::kSent) {
    fail_point(FailPoint::kFinished);
    end_stream(s, code, details, false, nullptr, false);
  }
  return r;
}

bool Connection::recv(const std::shared_ptr<Stream>& sp, Payload* out) {
  Stream& s = *sp;
  if (!wait(sp, s.deadline, [&] { return recv_ready(s); })) {
    end_at_deadline(sp, Deadline::never());
    return false;
  }
  return take_message(sp, out);
}

int Connection::try_recv(const std::shared_ptr<Stream>& sp, Payload* out) {
  {
    std::lock_guard<std::mutex> g(sp->mu);
    if (!recv_ready(*sp)) return 0;
  }
  return take_message(sp, out) ? 1 : -1;
}

bool Connection::take_message(const std::shared_ptr<Stream>& sp, Payload* out) {
  Stream& s = *sp;
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
      pullq_queued_.store(true, std::memory_order_release);
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
  // Before the caller parses it: what the last large message left free is bounded first.
  heap_bound::note_message(out->len);
  return true;
}

bool Connection::wait_initial_metadata(const std::shared_ptr<Stream>& sp) {
  Stream& s = *sp;
  if (!wait(sp, s.deadline, [&] { return s.have_initial_md || s.ended; }))
    end_at_deadline(sp, Deadline::never());
  std::lock_guard<std::mutex> g(s.mu);
  return s.have_initial_md;
}

bool Connection::wait_end(const std::shared_ptr<Stream>& sp, const Deadline& limit) {
  Stream& s = *sp;
  if (wait(sp, limit.earlier(s.deadline), [&] { return s.ended; })) return true;
  return s.deadline.expired() && end_at_deadline(sp, limit);
}

}  // namespace argrpc
