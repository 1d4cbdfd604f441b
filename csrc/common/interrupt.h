// A blocking wait of the engine can be cut short by the thread that waits. The engine
// knows nothing of Python: the bindings install a check on a thread that must stay
// responsive (the one that runs Python's signal handlers), and the stream waits call it
// every kInterruptPoll once they sleep. A check that says stop makes the wait throw
// Interrupted, which the bindings catch before it reaches Python.
#pragma once
#include <chrono>
#include <exception>

#include "knobs.h"

namespace argrpc {

constexpr auto kInterruptPoll = std::chrono::milliseconds(knobs::kInterruptPollMs);

class WaitInterrupt {
 public:
  virtual ~WaitInterrupt() = default;
  // True: stop waiting. Called with no engine lock held.
  virtual bool interrupted() = 0;
};

struct Interrupted : std::exception {
  const char* what() const noexcept override { return "argrpc: wait interrupted"; }
};

// The calling thread's check, or null.
WaitInterrupt*& current_interrupt();

// Installs `check` on this thread for its lifetime.
class InterruptScope {
 public:
  explicit InterruptScope(WaitInterrupt* check) : prev_(current_interrupt()) {
    current_interrupt() = check;
  }
  ~InterruptScope() { current_interrupt() = prev_; }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  WaitInterrupt* prev_;
};

// A thread about to wait inside the engine (for ring credits, or for a send lock another
// thread holds) calls before_wait() first. The bindings keep the GIL through the calls
// that should return at once (a small send, a receive) and install a hook that lets it go
// here: a peer slow to read then holds up this thread and no other Python thread.
class WaitHook {
 public:
  virtual ~WaitHook() = default;
  // Called with engine locks possibly held: must not take any.
  virtual void before_wait() = 0;
};

// The calling thread's hook, or null.
WaitHook*& current_wait_hook();

inline void before_wait() {
  if (WaitHook* h = current_wait_hook()) h->before_wait();
}

}  // namespace argrpc
