// The engine's configuration structs from the dicts argrpc._config builds, with the
// engine's own bounds checks, and the defaults the engine uses when Python passes nothing.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "common/knob_check.h"
#include "tunables.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

EngineConfig engine_config(const py::dict& d) {
  EngineConfig c;
  c.buf_size = get_or<size_t>(d, "buf_size", c.buf_size);
  c.spin_us = get_or<int>(d, "spin_us", c.spin_us);
  c.malloc_tuning = get_or<int>(d, "malloc_tuning", c.malloc_tuning) != 0;
  c.slab_size = get_or<size_t>(d, "slab_size", c.slab_size);
  c.parallel_copy_min = get_or<size_t>(d, "parallel_copy_min", c.parallel_copy_min);
  check_knob(knobs::kBufSize, int64_t(c.buf_size));
  check_knob(knobs::kSpinUs, c.spin_us);
  return c;
}

ConnConfig conn_config(const py::dict& d) {
  ConnConfig c;
  c.ring_size = get_or<size_t>(d, "ring_size", c.ring_size);
  c.acc_size = get_or<size_t>(d, "acc_size", c.acc_size);
  c.chunk_size = get_or<size_t>(d, "chunk_size", c.chunk_size);
  c.reads_in_flight = get_or<int>(d, "reads_in_flight", c.reads_in_flight);
  c.stream_window = get_or<size_t>(d, "stream_window", c.stream_window);
  c.max_recv = get_or<int64_t>(d, "max_recv", c.max_recv);
  c.zero_copy_min = get_or<size_t>(d, "zero_copy_min", c.zero_copy_min);
  c.keepalive_timeout_ms = get_or<uint32_t>(d, "keepalive_timeout_ms", c.keepalive_timeout_ms);
  check_knob(knobs::kRingSize, int64_t(c.ring_size), power_of_two(c.ring_size),
             ": ring_size must be a power of two");
  check_knob(knobs::kAccSize, int64_t(c.acc_size), c.acc_size <= c.ring_size / 4,
             " and at most TF_RDMA_RING_SIZE/4");
  check_knob(knobs::kChunkSize, int64_t(c.chunk_size));
  check_knob(knobs::kReadsInFlight, c.reads_in_flight);
  check_knob(knobs::kStreamWindow, int64_t(c.stream_window));
  check_knob(knobs::kKeepaliveTimeoutMs, int64_t(c.keepalive_timeout_ms));
  if (c.zero_copy_min == 0)
    c.zero_copy_min = ~size_t(0);  // off: no message is that big
  else
    check_knob(knobs::kZeroCopyMin, int64_t(c.zero_copy_min), true, " or 0 (off)");
  return c;
}

void add_config(py::module_& m) {
  // What the engine uses when Python passes nothing: tests compare it with the knob table.
  m.def("_config_defaults", [] {
    const EngineConfig e;
    const ConnConfig c;
    const VerbsConfig v;
    py::dict engine, conn, verbs;
    engine["buf_size"] = e.buf_size;
    engine["spin_us"] = e.spin_us;
    engine["malloc_tuning"] = e.malloc_tuning;
    engine["slab_size"] = e.slab_size;
    engine["parallel_copy_min"] = e.parallel_copy_min;
    engine["malloc_mmap_threshold"] = e.malloc_mmap_threshold;
    engine["malloc_trim_threshold"] = e.malloc_trim_threshold;
    engine["malloc_retain_max"] = e.malloc_retain_max;
    conn["ring_size"] = c.ring_size;
    conn["acc_size"] = c.acc_size;
    conn["chunk_size"] = c.chunk_size;
    conn["reads_in_flight"] = c.reads_in_flight;
    conn["stream_window"] = c.stream_window;
    conn["zero_copy_min"] = c.zero_copy_min;
    conn["cq_slots"] = c.cq_slots;
    conn["pull_ahead"] = c.pull_ahead;
    conn["keepalive_ms"] = c.keepalive_ms;
    conn["idle_keepalive_ms"] = c.idle_keepalive_ms;
    conn["keepalive_timeout_ms"] = c.keepalive_timeout_ms;
    verbs["qps"] = v.qps;
    verbs["qp_timeout"] = v.qp_timeout;
    verbs["qp_retry"] = v.qp_retry;
    verbs["cq_depth"] = v.cq_depth;
    py::dict out;
    out["EngineConfig"] = engine;
    out["ConnConfig"] = conn;
    out["VerbsConfig"] = verbs;
    return out;
  });
}

}  // namespace bindings
}  // namespace argrpc
