// A connection's life as a whole: construction, the keepalive that notices a silent
// peer, and fail(), which every ending of the connection goes through. The rest of
// Connection is split by concern into connection_*.cc (see connection.h).
#include "engine/connection.h"

#include <algorithm>
#include <limits>

#include "common/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "engine/engine.h"
#include "pool/pool.h"

namespace argrpc {

Connection::Connection(Engine* engine, std::unique_ptr<Fabric> fabric, const ConnConfig& cfg,
                       std::shared_ptr<Server> server, PeerInfo peer)
    : engine_(engine),
      fabric_(std::move(fabric)),
      cfg_(cfg),
      server_(std::move(server)),
      peer_(std::move(peer)),
      client_(server_ == nullptr),
      counters_(engine->transport_stats().of(fabric_->name())) {
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

uint64_t Connection::sweep(uint64_t now) {
  sweep_credits(now);
  return std::min(sweep_deadlines(), keepalive(now));
}

uint64_t Connection::keepalive(uint64_t now) {
  constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
  const uint64_t timeout = uint64_t(cfg_.keepalive_timeout_ms) * 1000;
  if (!alive()) return kNever;
  {
    // Credits are written by the peer's engine as it consumes our batches: the peer's
    // process is alive even when none of its own batches got through yet (its ring
    // toward us full, or a long rendezvous ahead of them).
    uint64_t bytes = 0, batches = 0;
    fabric_->peer_consumed(&bytes, &batches);
    if (batches != peer_consumed_seen_) {
      peer_consumed_seen_ = batches;
      last_heard_us_.store(now, std::memory_order_relaxed);
      last_recv_us_.store(now, std::memory_order_relaxed);
    }
  }
  if (ping_sent_us_ && last_recv_us_.load(std::memory_order_relaxed) < ping_sent_us_ &&
      now - ping_sent_us_ >= timeout) {
    // Judge only on what this side has read: the answer may sit in our own completion
    // queue while another thread holds the poll lock (busy with a long operation of its
    // own), and it is silence of the peer, not ours, that fails the connection.
    if (!poll_mu_.try_lock()) return now + uint64_t(knobs::kSweepMs) * 1000;  // judged later
    while (alive() && last_recv_us_.load(std::memory_order_relaxed) < ping_sent_us_ &&
           progress_locked()) {
    }
    poll_mu_.unlock();
    if (!alive()) return kNever;
  }
  if (ping_sent_us_) {
    if (last_recv_us_.load(std::memory_order_relaxed) >= ping_sent_us_) {
      ping_sent_us_ = 0;  // answered (any batch or credit will do)
    } else if (now - ping_sent_us_ >= timeout) {
      const bool failed = fail(kUnavailable, "argrpc: peer " + peer_.name + " did not answer a keepalive for " +
                             (cfg_.keepalive_timeout_ms % 1000
                                  ? std::to_string(cfg_.keepalive_timeout_ms) + " ms"
                                  : std::to_string(cfg_.keepalive_timeout_ms / 1000) + " s") +
                             " (it died or hangs)");
      if (failed) TransportCounters::add(counters_.keepalive_failures, 1);
      return kNever;
    }
  }
  // The earliest this side may have to PING, or to judge the PING out.
  const uint64_t judge = ping_sent_us_ ? ping_sent_us_ + timeout : kNever;
  const uint64_t heard = last_heard_us_.load(std::memory_order_relaxed);
  const uint64_t period = uint64_t(cfg_.keepalive_ms) * 1000;
  if (now - heard < period) return std::min(judge, heard + period);
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
  // (Looked at again a period on: calls may start meanwhile.)
  if (idle && (fabric_->liveness_fd() >= 0 || cfg_.idle_keepalive_ms == 0 ||
               now - heard < uint64_t(cfg_.idle_keepalive_ms) * 1000))
    return std::min(judge, now + period);
  // Restart the clock so a silent but live peer gets one PING per interval.
  last_heard_us_.store(now, std::memory_order_relaxed);
  if (!ping_sent_us_) ping_sent_us_ = now;
  queue_ctrl(kPing, 0, {});
  try_flush_ctrl();
  return std::min(ping_sent_us_ + timeout, now + period);
}

void Connection::protocol_error(const std::string& what) {
  fail(kInternal, "argrpc: connection to " + peer_.name + " closed: protocol error: " + what);
}

bool Connection::fail(uint32_t code, const std::string& why) {
  if (inherited()) return false;  // the parent's: its fabric must not be touched from here
  if (dead_.exchange(true)) return false;
  const auto self = shared_from_this();  // detach() below may drop the engine's reference
  {
    std::lock_guard<std::mutex> g(epitaph_->mu);
    epitaph_->why = why;
    epitaph_->code = code;
  }
  fabric_->shutdown();
  // dead_ is set: a stream made from here on ends at birth (new_stream), so this
  // sweep and that check between them reach every stream of the connection.
  size_t lost = 0;
  for (auto& s : live_streams()) lost += end_failed(s);
  // An idle connection whose peer went away is routine; lost calls and protocol
  // errors are not, and must be visible.
  const LogLevel level = code == kInternal ? LogLevel::kError
                         : code != kCancelled && lost ? LogLevel::kWarning
                                                      : LogLevel::kDebug;
  log_message(level, why + " (" + std::to_string(lost) + (lost == 1 ? " call" : " calls") + " affected)");
  {
    std::lock_guard<std::mutex> g(exposed_mu_);
    exposed_.clear();
  }
  // A submit() of this connection waiting for pool room must not outwait its death.
  engine_->pool()->wake_waiters();
  {
    std::lock_guard<std::mutex> g(pullq_mu_);
    pullq_.clear();
    pullq_queued_.store(false, std::memory_order_relaxed);
  }
  engine_->detach(this);
  return true;
}

void Connection::close(const std::string& why) {
  if (client_ && alive())
    for (auto& s : live_streams()) abort_stream(s, kCancelled, why, kCancelled);
  flush_pending();
  fail(kCancelled, why);
}

void Connection::set_stats_target(std::string target) {
  auto t = std::make_shared<const std::string>(std::move(target));
  std::lock_guard<std::mutex> g(stats_target_mu_);
  stats_target_ = std::move(t);
}

}  // namespace argrpc
