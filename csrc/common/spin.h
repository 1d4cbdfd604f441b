// Spin-then-block support. A waiter that spins calling sched_yield() sees its wake-up
// much sooner than one asleep on a futex, and a PAUSE-only spin starves the thread it
// waits for when the two share a CPU (docs/design.md has the figures). So every wait in
// the engine first spins with sched_yield() for spin_us, then blocks.
#pragma once
#include <sched.h>
#include <sys/resource.h>
#include <time.h>

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

// Two threads that wait for each other (a caller and the server thread that answers it)
// can end up spinning on one CPU while another idles: each message then costs a context
// switch, and the kernel's balancer leaves the pair so for tens of milliseconds, both
// being always runnable and cache-hot. Only a wake-up places a thread again, so a waiter
// whose yields kept running another thread kShareNapAfter times in a row sleeps once on
// a timer; the wake-up puts it on an idle CPU if there is one. Counted across waits: in
// such a pair each wait sees one yield.
inline constexpr uint32_t kShareNapAfter = uint32_t(knobs::kShareNapAfter);
inline thread_local uint32_t t_shared_yields = 0;

// This thread's involuntary context switches so far: a yield that ran another thread is
// one, as is a preemption by another thread; time the hypervisor took from this vCPU is
// none.
inline long involuntary_switches() {
  rusage ru;
  return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nivcsw : 0;
}
// The count at this thread's last slow yield.
inline thread_local long t_switches = -1;

// Notes what a yield from `before` to `after` said of this thread's CPU, napping as above.
// A slow yield shared the CPU only if the kernel switched this thread out since its last
// slow yield (read only then: a system call): on a
// VM, a yield is also slow when the hypervisor takes the vCPU away for tens of
// microseconds (hundreds of times a second on a busy host), and reading that as a shared
// CPU made the waiter yield at every turn and nap, each nap a call slower by tens of
// microseconds (docs/benchmarks.md).
inline void note_yield(uint64_t before, uint64_t after) {
  t_cpu_shared = false;
  if (after - before >= kYieldSharedUs) {
    const long switches = involuntary_switches();
    t_cpu_shared = switches != t_switches;
    t_switches = switches;
  }
  if (!t_cpu_shared) {
    t_shared_yields = 0;
  } else if (++t_shared_yields >= kShareNapAfter) {
    t_shared_yields = 0;
    timespec nap{0, 1000};  // the timer's slack makes it tens of microseconds
    nanosleep(&nap, nullptr);
  }
}

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
    note_yield(t, after);
    yield_at = after + (t_cpu_shared ? 0 : kSpinPollUs);
  }
}

}  // namespace argrpc
