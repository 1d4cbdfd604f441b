// Engine messages for Python's logging. Engine threads never take the GIL (a Python
// thread may hold it while it waits for the engine), so a message is queued here and
// a Python thread takes the queue and hands each message to logging. Until one does,
// in a process that is not Python or a forked child that has not started one, messages
// go to stderr as they used to.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace argrpc {

// Python's logging levels, so the bindings pass them on unchanged.
enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

void log_message(LogLevel level, std::string text);

struct LogEntry {
  int level;
  std::string text;
};

// The taker: from the first call on in this process (fork generation), messages queue
// (at most kMaxQueued; the rest are counted in *dropped). Waits up to timeout_ms for
// the first message.
std::vector<LogEntry> take_log(int timeout_ms, uint64_t* dropped);

}  // namespace argrpc
