// Spin-then-block support. Measurements on 2-vCPU machines (docs/design.md): a waiter that
// spins ~50 us calling sched_yield() gets woken in a few us, a futex wake-up costs
// 60-90 us, and a PAUSE-only spin starves the thread it waits for. So every wait in the
// engine first spins with sched_yield() for spin_us, then blocks.
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
