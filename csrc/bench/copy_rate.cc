#include "bench/copy_rate.h"

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/error.h"
#include "common/mapping.h"

namespace argrpc {

namespace {

Mapping prefaulted(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
  if (p == MAP_FAILED) throw CoreError(errno_text("mmap(copy rate buffer)"));
  std::memset(p, 0x5a, n);  // MAP_POPULATE may leave the zero page mapped for reads
  return Mapping(p, n);
}

// Every thread copies its slice of copy number `gen` once the main thread posts it.
struct Crew {
  std::atomic<uint64_t> gen{0};
  std::atomic<int> done{0};
  std::atomic<bool> stop{false};
};

template <class Pred>
void yield_until(Pred&& p) {
  while (!p()) sched_yield();
}

}  // namespace

CopyRate measure_copy_rate(size_t size, int threads, double seconds, size_t min_copies) {
  if (size == 0) throw CoreError("copy rate: size must be > 0");
  if (threads < 1 || threads > 64) throw CoreError("copy rate: threads must be in 1..64");
  Mapping src = prefaulted(size), dst = prefaulted(size);
  const size_t slice = (size + size_t(threads) - 1) / size_t(threads);
  auto copy_slice = [&](int i) {
    const size_t off = std::min(size, slice * size_t(i));
    const size_t n = std::min(slice, size - off);
    std::memcpy(dst.data() + off, src.data() + off, n);
  };
  Crew crew;
  std::vector<std::thread> helpers;
  for (int i = 1; i < threads; ++i) {
    helpers.emplace_back([&, i] {
      uint64_t seen = 0;
      for (;;) {
        yield_until([&] { return crew.stop.load() || crew.gen.load() != seen; });
        if (crew.stop.load()) return;
        seen = crew.gen.load();
        copy_slice(i);
        crew.done.fetch_add(1);
      }
    });
  }
  // Small copies take well under a microsecond: time them in nanoseconds.
  using Ns = std::chrono::duration<double, std::nano>;
  std::vector<double> us;
  const auto start = Clock::now();
  const auto until = start + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(std::max(0.0, seconds)));
  for (;;) {
    const auto t0 = Clock::now();
    if (us.size() >= min_copies && t0 >= until) break;
    crew.done.store(0);
    crew.gen.fetch_add(1);
    copy_slice(0);
    yield_until([&] { return crew.done.load() == threads - 1; });
    us.push_back(Ns(Clock::now() - t0).count() / 1e3);
  }
  const double total_s = Ns(Clock::now() - start).count() / 1e9;
  crew.stop.store(true);
  for (auto& t : helpers) t.join();
  CopyRate r;
  r.copies = us.size();
  double sum = 0;
  for (double u : us) sum += u;
  r.mean_us = sum / double(us.size());
  r.gbps = double(size) * double(us.size()) / std::max(total_s, 1e-9) / 1e9;
  std::sort(us.begin(), us.end());
  r.p99_us = us[std::min(us.size() - 1, static_cast<size_t>(double(us.size()) * 0.99))];
  return r;
}

}  // namespace argrpc
