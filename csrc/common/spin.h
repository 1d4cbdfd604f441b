// Spin-then-block support. A waiter that spins calling sched_yield() sees its wake-up
// much sooner than one asleep on a futex, and a PAUSE-only spin starves the thread it
// waits for when the two share a CPU (docs/design.md has the figures). So every wait in
// the engine first spins with sched_yield() for spin_us, then blocks.
#pragma once
#include <sched.h>
#include <cstdint>
#include "common/clock.h"
#include "knobs.h"

namespace argrpc {

// Between yields a waiter polls for up to spin_poll_us (a yield is a system call, and a
// message that comes during one is seen only after it), but only while no other thread
// ran on this CPU during its last yield: a thread that shares the CPU with the one it
// waits for yields at every turn, or it would hold that one off.
inline constexpr uint64_t kSpinPollUs = uint64_t(knobs::kSpinPollUs);
inline constexpr uint64_t kYieldSharedUs = uint64_t(knobs::kYieldSharedUs);
// What this thread's last yield said of its CPU.
inline thread_local bool t_cpu_shared = false;

// Tells the core this is a spin (x86's PAUSE, Arm's YIELD): it lets the sibling
// hyperthread run and spares the memory-order flush when the awaited line changes.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Calls poll() and checks ready() until ready() holds or spin_us elapsed.
template <class Ready, class Poll>
bool spin_until(int spin_us, const Deadline& dl, Ready&& ready, Poll&& poll) {
  if (ready()) return true;
  if (spin_us <= 0) return false;
  uint64_t t = now_us();
  const uint64_t until = t + static_cast<uint64_t>(spin_us);
  uint64_t yield_at = t + (t_cpu_shared ? 0 : kSpinPollUs);
  for (;;) {
    poll();
    if (ready()) return true;
    t = now_us();
    if (t >= until || dl.expired()) return false;
    if (t < yield_at) {
      cpu_relax();
      continue;
    }
    sched_yield();
    const uint64_t after = now_us();
    t_cpu_shared = after - t >= kYieldSharedUs;
    yield_at = after + (t_cpu_shared ? 0 : kSpinPollUs);
  }
}

}  // namespace argrpc
