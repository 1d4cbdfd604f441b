#include "common/log.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>

#include "common/fork.h"

namespace argrpc {

namespace {

// Enough for a burst (every connection of a busy server failing at once) between two
// takes; beyond it messages are counted, not kept, so a stalled taker costs no memory.
constexpr size_t kMaxQueued = 4096;

struct LogQueue {
  const uint64_t born = fork_generation();
  std::mutex mu;
  std::condition_variable cv;
  std::deque<LogEntry> q;
  uint64_t dropped = 0;
  bool taken = false;  // a taker of this process takes them (else stderr)
};

LogQueue& queue() { return per_process<LogQueue>(); }

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

void log_message(LogLevel level, std::string text) {
  LogQueue& lq = queue();
  {
    std::lock_guard<std::mutex> g(lq.mu);
    if (lq.taken) {
      if (lq.q.size() >= kMaxQueued) {
        ++lq.dropped;
        return;
      }
      lq.q.push_back(LogEntry{static_cast<int>(level), std::move(text)});
      lq.cv.notify_one();
      return;
    }
  }
  // Nobody takes them here: as before there was a taker, and as Python's own last-resort
  // handler does, warnings and errors reach stderr.
  if (level >= LogLevel::kWarning) std::fprintf(stderr, "argrpc %s: %s\n", level_name(level), text.c_str());
}

std::vector<LogEntry> take_log(int timeout_ms, uint64_t* dropped) {
  LogQueue& lq = queue();
  std::unique_lock<std::mutex> lk(lq.mu);
  lq.taken = true;
  lq.cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return !lq.q.empty() || lq.dropped; });
  std::vector<LogEntry> out(std::make_move_iterator(lq.q.begin()), std::make_move_iterator(lq.q.end()));
  lq.q.clear();
  *dropped = lq.dropped;
  lq.dropped = 0;
  return out;
}

}  // namespace argrpc
