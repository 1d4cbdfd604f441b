// fork() safety. A child inherits the parent's engine, connections and calls as copies
// whose fds, sockets and shared mappings are still the parent's: touching one (writing a
// ring, shutting a socket down, even destroying it) corrupts or kills the parent's
// connection. So every object remembers the fork generation it was made in, and a
// child treats older objects as gone: never used, never destroyed.
#pragma once
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

}  // namespace argrpc
