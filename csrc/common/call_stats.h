// Per-call records for an application's metrics (grpc's per-call metrics: started and
// ended calls, their status, duration and message bytes). Off by default: while off,
// the engine's only cost is one relaxed load when a call starts. Engine threads never
// take the GIL, so, as with the engine's log (common/log.h), records queue here and a
// Python thread takes them.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace argrpc {

// The numbers the bindings hand to Python unchanged.
enum class CallEvent : int { kClientStarted = 0, kClientEnded = 1, kServerStarted = 2, kServerEnded = 3 };

struct CallRecord {
  CallEvent kind = CallEvent::kClientStarted;
  std::string method;
  std::shared_ptr<const std::string> target;  // the client connection's label; null: ""
  uint32_t code = 0;
  double duration_s = 0;
  uint64_t sent_bytes = 0, rcvd_bytes = 0;
  const char* transport = "";  // the fabric's name, a string literal
};

namespace detail {
inline std::atomic<bool> call_stats_on{false};
}

// Whether a call starting now is recorded. A call is recorded whole or not at all: its
// end is recorded because its start was, whatever the switch says by then.
inline bool call_stats_on() { return detail::call_stats_on.load(std::memory_order_relaxed); }
inline void set_call_stats(bool on) { detail::call_stats_on.store(on, std::memory_order_relaxed); }

void record_call(CallRecord r);

// Waits up to timeout_ms for a record; returns every queued one and, in *dropped, how
// many were not kept (the queue was full) since the last take. A forked child starts
// with an empty queue: what is queued is the parent's to take.
std::vector<CallRecord> take_call_stats(int timeout_ms, uint64_t* dropped);

// Test-only: the queue's bound (records kept between two takes); returns the old one.
size_t set_call_stats_bound(size_t bound);

}  // namespace argrpc
