// Every tunable of the engine in one place. Defaults, bounds and fixed limits come from
// knobs.h, which is generated from the knob table in argrpc/_config.py: the Python layer
// validates user input against the same bounds and passes these structs in; the C++
// side checks what would be unsafe (a hostile peer's values, a device's limits).
#pragma once
#include <cstddef>
#include <cstdint>

#include "knobs.h"

namespace argrpc {

constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

struct EngineConfig {
  size_t buf_size = knobs::kBufSize.def;          // registered pool per process (cap)
  size_t slab_size = knobs::kSlabSize;            // first pool growth step
  int spin_us = int(knobs::kSpinUs.def);          // spin (with sched_yield) before blocking
  size_t parallel_copy_min = knobs::kParallelCopyMin;
  // protobuf builds a fresh buffer per message; with glibc's defaults each multi-MiB
  // one is new, page-faulting memory (several times slower to fill than memory already
  // touched: docs/design.md, "Bulk bytes"), so keep freed memory instead.
  bool malloc_tuning = knobs::kMallocTuning.def != 0;
  size_t malloc_mmap_threshold = knobs::kMallocMmapThreshold;
  size_t malloc_trim_threshold = knobs::kMallocTrimThreshold;
  int malloc_mmap_max = int(knobs::kMallocMmapMax);
  int malloc_arena_max = int(knobs::kMallocArenaMax);
  size_t malloc_retain_max = knobs::kMallocRetainMax;
};

struct ConnConfig {
  size_t ring_size = knobs::kRingSize.def;        // receive ring per connection side
  size_t acc_size = knobs::kAccSize.def;          // eager batch (coalescing) limit
  size_t chunk_size = knobs::kChunkSize.def;      // rendezvous read chunk
  int reads_in_flight = int(knobs::kReadsInFlight.def);
  size_t stream_window = knobs::kStreamWindow.def;  // unread eager bytes per stream
  int64_t max_recv = 4 * MiB;        // grpc.max_receive_message_length (-1: unlimited)
  uint32_t cq_slots = knobs::kCqSlots;
  int pull_ahead = int(knobs::kPullAhead);
  // With calls in flight (or pool blocks the peer may still read), a connection that
  // heard nothing for keepalive_ms sends a PING: on a fabric without a liveness fd
  // (verbs) the write to a dead peer fails, and so do the calls, instead of waiting for
  // their deadlines. Idle ones do the same after idle_keepalive_ms (0: never).
  uint32_t keepalive_ms = knobs::kKeepaliveMs;
  uint32_t idle_keepalive_ms = knobs::kIdleKeepaliveMs;
  uint32_t keepalive_timeout_ms = uint32_t(knobs::kKeepaliveTimeoutMs.def);
  // On fabrics that can map the sender's pool (shm), messages at least this big are
  // handed to the reader as a view of the sender's block instead of copied (0: never).
  size_t zero_copy_min = knobs::kZeroCopyMin.def;
};

// Verbs fabric (csrc/fabric/verbs). Device/port/GID selection is not here: it comes
// from TF_RDMA_DEV_NAME / TF_RDMA_PORT_NUM / TF_RDMA_GID_INDEX through verbs_select().
struct VerbsConfig {
  int qps = int(knobs::kQps.def);  // QP 0 carries eager batches and credits; READs round-robin
  int qp_timeout = int(knobs::kQpTimeout.def);
  int qp_retry = int(knobs::kQpRetry.def);
  int cq_depth = int(knobs::kCqDepth.def);  // receive slots (cq_slots) + send queues share it
};

}  // namespace argrpc
