// What the bindings call on a connection for one call: start it, send, receive, wait
// for its metadata or its end, finish it. Sending goes through submit().
#include <algorithm>
#include <string>

#include "engine/connection.h"
#include "engine/connection_wait.h"

namespace argrpc {

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
