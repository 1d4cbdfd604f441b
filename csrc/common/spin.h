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

inline constexpr uint32_t kSharedYieldsMove = uint32_t(knobs::kSharedYieldsMove);
inline constexpr uint64_t kCpuMoveGapUs = uint64_t(knobs::kCpuMoveGapMs) * 1000;
// Yields in a row that ran another thread, and when this thread may move next.
inline thread_local uint32_t t_shared_run = 0;
inline thread_local uint64_t t_move_after = 0;

// Moves the calling thread off its CPU and gives it back every CPU it had: the kernel
// keeps two busy threads that share a CPU together while they stay cache-hot, even with
// another CPU idle, and its wake-up placement does not help a thread that never sleeps.
// Narrowing the affinity for a moment is the one request it carries out at once. A
// thread the user confined to one CPU stays.
inline void move_off_shared_cpu() {
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof mask, &mask) != 0 || CPU_COUNT(&mask) < 2) return;
  const int cpu = sched_getcpu();
  if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &mask)) return;
  cpu_set_t others = mask;
  CPU_CLR(cpu, &others);
  if (sched_setaffinity(0, sizeof others, &others) == 0) sched_setaffinity(0, sizeof mask, &mask);
}

// After each yield of a spin: t_cpu_shared, and a move when the CPU stays shared.
inline void after_yield(uint64_t before, uint64_t after) {
  t_cpu_shared = after - before >= kYieldSharedUs;
  if (!t_cpu_shared) {
    t_shared_run = 0;
  } else if (++t_shared_run >= kSharedYieldsMove && after >= t_move_after) {
    t_shared_run = 0;
    t_move_after = after + kCpuMoveGapUs;
    move_off_shared_cpu();
  }
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
    after_yield(t, after);
    yield_at = after + (t_cpu_shared ? 0 : kSpinPollUs);
  }
}

}  // namespace argrpc
