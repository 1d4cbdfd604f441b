// The benchmark's bandwidth reference: how fast this machine copies between two
// pre-faulted buffers with one thread or several, the bound on any transport that
// copies a message once.
#pragma once
#include <cstddef>

namespace argrpc {

struct CopyRate {
  double gbps = 0;       // bytes copied per second / 1e9, all threads together
  double mean_us = 0;    // per copy of `size` bytes
  double p99_us = 0;
  size_t copies = 0;
};

// Copies `size` bytes `repeats`-many times or for at least `seconds` (whichever is
// later), split evenly over `threads` threads that start each copy together.
CopyRate measure_copy_rate(size_t size, int threads, double seconds, size_t min_copies);

}  // namespace argrpc
