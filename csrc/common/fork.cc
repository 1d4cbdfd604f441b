#include "common/fork.h"

#include <pthread.h>

#include <atomic>

namespace argrpc {
namespace {

std::atomic<uint64_t> generation{0};

void in_child() { generation.fetch_add(1, std::memory_order_relaxed); }

const bool registered = [] {
  ::pthread_atfork(nullptr, nullptr, in_child);
  return true;
}();

}  // namespace

uint64_t fork_generation() {
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

}  // namespace argrpc
