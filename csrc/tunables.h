// Every tunable of the engine, with its default, in one place. The Python layer
// (argrpc/_config.py) validates user input and passes these structs in; the C++
// side only clamps what would be unsafe.
#pragma once
#include <cstddef>
#include <cstdint>

namespace argrpc {

constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

struct EngineConfig {
  size_t buf_size = 1 * GiB;   // TF_RDMA_BUF_SIZE: registered pool per process (cap)
  size_t slab_size = 16 * MiB; // first pool growth step (pre-faulted); later steps double
  int spin_us = 50;            // TF_RDMA_SPIN_US: spin (with sched_yield) before blocking
  size_t parallel_copy_min = 2 * MiB;  // copies at least this big use two threads
  // TF_RDMA_MALLOC_TUNING: protobuf builds a fresh buffer per message; with glibc's
  // defaults each multi-MiB one is new, page-faulting memory (1.3-2.8 GB/s here), so
  // keep freed memory for reuse instead.
  bool malloc_tuning = true;
  size_t malloc_mmap_threshold = 32 * MiB;   // glibc's maximum
  size_t malloc_trim_threshold = 256 * MiB;
};

struct ConnConfig {
  size_t ring_size = 1 * MiB;        // TF_RDMA_RING_SIZE: receive ring per connection side
  size_t acc_size = 8 * KiB;         // TF_RDMA_ACC_SIZE: eager batch (coalescing) limit
  size_t chunk_size = 4 * MiB;       // TF_RDMA_CHUNK_SIZE: rendezvous read chunk
  int reads_in_flight = 4;           // TF_RDMA_READS_IN_FLIGHT: chunks outstanding per message
  size_t stream_window = 1 * MiB;    // TF_RDMA_STREAM_WINDOW: unread eager bytes per stream
  int64_t max_recv = 4 * MiB;        // grpc.max_receive_message_length (-1: unlimited)
  uint32_t cq_slots = 1024;          // batches in flight before the receiver consumes
  int pull_ahead = 2;                // large messages pulled ahead of the reader per stream
  // A connection with calls in flight (or pool blocks the peer may still read) that
  // heard nothing from its peer for this long sends a PING: on a fabric without a liveness fd (verbs) the write to a dead peer
  // fails, and so do the calls, instead of waiting for their deadlines.
  uint32_t keepalive_ms = 1000;
  // The same for an idle connection on a fabric without a liveness fd (verbs), so a
  // peer that died between calls is found before the next call needs it (0: never).
  uint32_t idle_keepalive_ms = 2000;
  // A PING unanswered for this long fails the connection and its calls (UNAVAILABLE):
  // the peer died where the fabric cannot tell, or it hangs (a stopped process's NIC
  // still acknowledges writes).
  uint32_t keepalive_timeout_ms = 10000;
  // TF_RDMA_ZERO_COPY_MIN: on fabrics that can map the sender's pool (shm), messages at
  // least this big are handed to the reader as a view of the sender's block instead of
  // being copied (0: never).
  size_t view_min = 1 * MiB;
};

// Verbs fabric (csrc/fabric/verbs). Device/port/GID selection is not here: it comes
// from TF_RDMA_DEV_NAME / TF_RDMA_PORT_NUM / TF_RDMA_GID_INDEX through verbs_select().
struct VerbsConfig {
  int qps = 2;            // TF_RDMA_QPS: RC QPs per connection; QP 0 carries eager batches and credits, rendezvous READs go round-robin over all
  int qp_timeout = 14;    // TF_RDMA_QP_TIMEOUT: local ACK timeout exponent, 4.096 us * 2^14 = 67 ms per try
  int qp_retry = 6;       // TF_RDMA_QP_RETRY: transport and RNR retries before a completion error (7 means forever on rxe: peer loss never surfaces)
  int cq_depth = 8192;    // TF_RDMA_CQ_DEPTH: CQ entries per connection; receive slots (cq_slots) + the send queues share it
};

}  // namespace argrpc
