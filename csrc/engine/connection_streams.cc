// Stream lifetimes on a connection: made (new_stream), found by id, and ended exactly
// once, whether by the peer, the deadline, the application, or the connection's failure.
// Those two places are also where a recorded call's records come from (call stats).
#include <algorithm>
#include <chrono>
#include <limits>
#include <string>

#include "common/call_stats.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/connection_wait.h"
#include "engine/server.h"

namespace argrpc {

std::shared_ptr<Stream> Connection::find(uint64_t id) {
  std::lock_guard<std::mutex> g(streams_mu_);
  auto it = streams_.find(id);
  return it == streams_.end() ? nullptr : it->second;
}

std::shared_ptr<Stream> Connection::new_stream(uint64_t id, const Deadline& dl,
                                               std::string method, uint64_t group) {
  auto s = std::make_shared<Stream>(id, client_, shared_from_this(), dl);
  s->method = std::move(method);
  s->group = group;
  s->send_window = static_cast<int64_t>(fabric_->peer_stream_window());
  // Before the stream is registered, so its start is queued before anything can end it.
  if (call_stats_on()) record_start(*s);
  std::string group_ended;
  bool in_ended_group = false;
  {
    std::lock_guard<std::mutex> g(live_mu_);
    live_.emplace(s.get(), s);
    // Under the same lock as end_group(): either its sweep sees this stream, or this
    // sees the group ended.
    if (group) {
      auto it = ended_groups_.find(group);
      if (it != ended_groups_.end()) {
        in_ended_group = true;
        group_ended = it->second;
      }
    }
  }
  // After the insert: either fail()'s sweep sees it, or this sees dead_.
  if (dead_.load(std::memory_order_acquire)) end_failed(s);
  else if (in_ended_group) abort_stream(s, kCancelled, group_ended, kCancelled);
  // A call whose deadline passed before it started ends here, unsent: otherwise the
  // server's end (its handler let go of an expired call) could reach the caller before
  // this side's sweep, and the caller would see that status instead of its deadline.
  else if (client_ && dl.expired()) expire(s);
  return s;
}

void Connection::end_group(uint64_t group, const std::string& why) {
  {
    std::lock_guard<std::mutex> g(live_mu_);
    ended_groups_.emplace(group, why);
  }
  // Recorded first: a call started from here on sees it (new_stream); one started
  // before is live now.
  for (auto& s : live_streams())
    if (s->group == group) abort_stream(s, kCancelled, why, kCancelled);
  try_flush_ctrl();
}

void Connection::forget_group(uint64_t group) {
  std::lock_guard<std::mutex> g(live_mu_);
  ended_groups_.erase(group);
}

void Connection::forget_stream(Stream* s) {
  std::lock_guard<std::mutex> g(live_mu_);
  live_.erase(s);
}

std::vector<std::shared_ptr<Stream>> Connection::live_streams() {
  std::vector<std::shared_ptr<Stream>> all;
  std::lock_guard<std::mutex> g(live_mu_);
  for (auto& kv : live_)
    if (auto s = kv.second.lock()) all.push_back(std::move(s));
  return all;  // released by the caller, outside live_mu_
}

Stream::~Stream() {
  // A forked child's copy of the parent's stream: the parent's locks are not ours.
  if (!conn->inherited()) conn->forget_stream(this);
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
  uint64_t sent = 0, rcvd = 0;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->ended) return false;
    s->ended = true;
    sent = s->sent_bytes;
    rcvd = s->rcvd_bytes;
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
  if (s->recorded) record_end(*s, code, sent, rcvd);
  if (server_) {
    server_->remove_active(s.get());
    if (report) server_->report_cancelled(s);
  }
  return true;
}

void Connection::record_start(Stream& s) {
  s.recorded = true;
  s.started = Clock::now();
  if (client_) {
    std::lock_guard<std::mutex> g(stats_target_mu_);
    s.stats_target = stats_target_;
  }
  CallRecord r;
  r.kind = client_ ? CallEvent::kClientStarted : CallEvent::kServerStarted;
  r.method = s.method;
  r.target = s.stats_target;
  r.transport = fabric_->name();
  record_call(std::move(r));
}

void Connection::record_end(const Stream& s, uint32_t code, uint64_t sent, uint64_t rcvd) {
  CallRecord r;
  r.kind = client_ ? CallEvent::kClientEnded : CallEvent::kServerEnded;
  r.method = s.method;
  r.target = s.stats_target;
  r.code = code;
  r.duration_s = std::chrono::duration<double>(Clock::now() - s.started).count();
  r.sent_bytes = sent;
  r.rcvd_bytes = rcvd;
  r.transport = fabric_->name();
  record_call(std::move(r));
}

void Connection::abandon(const std::shared_ptr<Stream>& s) {
  bool ended;
  {
    std::lock_guard<std::mutex> g(s->mu);
    ended = s->ended;
  }
  if (!ended) {
    // A server call dropped after its deadline passed (its handler saw it inactive and
    // let go before the sweep ended it) ends as the sweep would have ended it.
    if (!client_ && s->deadline.expired()) expire(s);
    else cancel(s, kCancelled, "Cancelled");
  }
  std::vector<uint64_t> fins;
  {
    std::lock_guard<std::mutex> g(s->mu);
    release_inbox_locked(*s, &fins);
  }
  for (uint64_t f : fins) queue_fin(f);
  try_flush_ctrl();
}

bool Connection::abandon_needed(const std::shared_ptr<Stream>& s) {
  std::lock_guard<std::mutex> g(s->mu);
  return !s->ended || !s->inbox.empty();
}

void Connection::expire(const std::shared_ptr<Stream>& s) {
  abort_stream(s, kDeadlineExceeded, "Deadline Exceeded", kDeadlineExceeded);
  try_flush_ctrl();
}

bool Connection::end_at_deadline(const std::shared_ptr<Stream>& sp, const Deadline& limit) {
  Stream& s = *sp;
  const auto sender_waits = [&] { return s.awaiting_pool.load(std::memory_order_acquire); };
  // The sender's own wait ends at the same deadline; an allocation that succeeds clears
  // the flag without a notify, which the wait's bounded naps catch.
  if (sender_waits() && !wait(sp, limit, [&] { return s.ended || !sender_waits(); }))
    return false;
  expire(sp);  // nothing if the sender ended it
  return true;
}

bool Connection::abort_stream(const std::shared_ptr<Stream>& s, uint32_t code,
                              const std::string& why, uint32_t rst_code, bool keep_inbox) {
  if (!end_stream(s, code, why, !client_, nullptr, keep_inbox)) return false;
  if (!client_) queue_ctrl(kTrailers, s->id, status_body(code, why, &kNoMetadata));
  else if (s->id) queue_ctrl(kRst, s->id, status_body(rst_code, why, nullptr));
  return true;
}

uint64_t Connection::sweep_deadlines() {
  std::vector<std::shared_ptr<Stream>> due;
  uint64_t next = std::numeric_limits<uint64_t>::max();
  {
    std::lock_guard<std::mutex> g(streams_mu_);
    for (auto& kv : streams_) {
      if (!kv.second->deadline.expired()) next = std::min(next, kv.second->deadline.at_us());
      else if (!kv.second->awaiting_pool.load(std::memory_order_acquire)) due.push_back(kv.second);
    }
  }
  for (auto& s : due) expire(s);
  return next;
}

bool Connection::cancel(const std::shared_ptr<Stream>& s, uint32_t code, const std::string& details) {
  const bool ended = abort_stream(s, code, details, code);
  try_flush_ctrl();
  return ended;
}

bool Connection::end_failed(const std::shared_ptr<Stream>& s) {
  // Only after fail() set dead_ and the error: a forked child's view of the parent's
  // connection is not alive() either, and must not touch the parent's locks.
  if (!dead_.load(std::memory_order_acquire) || inherited()) return false;
  if (s->status_sent.load(std::memory_order_acquire)) return false;  // finish() ends it
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

}  // namespace argrpc
