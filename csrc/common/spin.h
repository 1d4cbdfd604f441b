// Spin-then-block support. A waiter that spins calling sched_yield() sees its wake-up
// much sooner than one asleep on a futex, and a PAUSE-only spin starves the thread it
// waits for when the two share a CPU (docs/design.md has the figures). So every wait in
// the engine first spins with sched_yield() for spin_us, then blocks.
#pragma once
#include <sched.h>
#include <cstdint>
#include "common/clock.h"

namespace argrpc {

// Calls poll() and checks ready() until ready() holds or spin_us elapsed.
template <class Ready, class Poll>
bool spin_until(int spin_us, const Deadline& dl, Ready&& ready, Poll&& poll) {
  if (ready()) return true;
  if (spin_us <= 0) return false;
  const uint64_t until = now_us() + static_cast<uint64_t>(spin_us);
  for (;;) {
    poll();
    if (ready()) return true;
    const uint64_t t = now_us();
    if (t >= until || dl.expired()) return false;
    sched_yield();
  }
}

}  // namespace argrpc
