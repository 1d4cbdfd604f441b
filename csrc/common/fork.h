// fork() safety. A child inherits the parent's engine, connections and calls as copies
// whose fds, sockets and shared mappings are still the parent's: touching one (writing a
// ring, shutting a socket down, even destroying it) corrupts or kills the parent's
// connection. So every object remembers the fork generation it was made in, and a
// child treats older objects as gone: never used, never destroyed.
#pragma once
#include <atomic>
#include <cstdint>

namespace argrpc {

// Bumped in the child of every fork() (pthread_atfork); cheap enough for hot paths.
uint64_t fork_generation();

// Keeps an object of the parent alive for the rest of the child's life, so that its
// destructor (which would act on the parent's fds and mappings) never runs here.
template <class T>
void keep_forever(T&& v) {
  new T(static_cast<T&&>(v));  // deliberate leak, bounded by what the child inherited
}

// This process's instance of T (T has `const uint64_t born = fork_generation();`), made on
// first use. A forked child gets a new one rather than reusing the parent's copy, whose
// mutex a thread of the parent may have held at fork() (that thread does not exist
// here): the child never touches that copy, nor destroys it. Never destroyed: engine
// threads may use it at exit.
template <class T>
T& per_process() {
  static std::atomic<T*> current{new T};
  T* p = current.load(std::memory_order_acquire);
  while (p->born != fork_generation()) {
    auto* fresh = new T;
    if (current.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread of this child replaced it first: p is now its own
  }
  return *p;
}

}  // namespace argrpc
