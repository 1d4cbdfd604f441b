// Generated from the knob table in argrpc/_config.py by `python3 -m argrpc._knob_header`.
// Do not edit: change the table and regenerate (the test suite compares the two).
#pragma once
#include <cstdint>

namespace argrpc::knobs {

// A TF_RDMA_* variable the engine uses: its name (for error messages), default and
// inclusive bounds, whether it must be a power of two and whether 0 means off. Python
// validates user input against the same bounds.
struct Knob {
  const char* name;
  int64_t def, lo, hi;
  bool power_of_two, zero_off;
};

// VerbsConfig::qps: RC queue pairs per verbs connection, over which rendezvous reads are
// spread; raise it where one queue pair does not fill the link.
inline constexpr Knob kQps{"TF_RDMA_QPS", 1, 1, 16, false, false};

// VerbsConfig::qp_timeout: Verbs local ACK timeout exponent: a queue pair waits 4.096 µs
// × 2^value for an acknowledgement before it retries (18: 1.07 s). Lower it only where
// peers ack promptly.
inline constexpr Knob kQpTimeout{"TF_RDMA_QP_TIMEOUT", 18, 1, 31, false, false};

// VerbsConfig::qp_retry: Verbs transport and RNR retries before a send fails (7: RNR
// retries never end); with the timeout it bounds how long a dead peer's connection takes
// to fail.
inline constexpr Knob kQpRetry{"TF_RDMA_QP_RETRY", 6, 0, 7, false, false};

// VerbsConfig::cq_depth: Completion queue entries per verbs connection, shared by its
// receive slots and its queue pairs' send queues (capped at the device's max_cqe).
inline constexpr Knob kCqDepth{"TF_RDMA_CQ_DEPTH", 8192, 256, 4194304, false, false};

// ConnConfig::chunk_size: Rendezvous chunk size in bytes: large messages are pulled in
// chunks of this size.
inline constexpr Knob kChunkSize{"TF_RDMA_CHUNK_SIZE", 4194304, 65536, 1073741824, false, false};

// ConnConfig::acc_size: Eager (coalescing) limit in bytes: smaller messages are batched
// into one write, larger ones go rendezvous.
inline constexpr Knob kAccSize{"TF_RDMA_ACC_SIZE", 8192, 1024, 1048576, false, false};

// EngineConfig::buf_size: Size in bytes of the process's registered, pre-faulted buffer
// pool; process-wide: environment only.
inline constexpr Knob kBufSize{"TF_RDMA_BUF_SIZE", 1073741824, 67108864, 68719476736, false, false};

// ConnConfig::ring_size: Receive ring size in bytes, per connection and direction.
inline constexpr Knob kRingSize{"TF_RDMA_RING_SIZE", 1048576, 65536, 268435456, true, false};

// EngineConfig::spin_us: Microseconds a waiting thread spins (yielding) before it blocks;
// process-wide: environment only.
inline constexpr Knob kSpinUs{"TF_RDMA_SPIN_US", 50, 0, 100000, false, false};

// ConnConfig::reads_in_flight: Rendezvous chunks pulled concurrently per message.
inline constexpr Knob kReadsInFlight{"TF_RDMA_READS_IN_FLIGHT", 4, 1, 64, false, false};

// ConnConfig::stream_window: Eager bytes one stream may have unread at the receiver (flow
// control).
inline constexpr Knob kStreamWindow{"TF_RDMA_STREAM_WINDOW", 1048576, 65536, 1073741824, false, false};

// ConnConfig::keepalive_timeout_ms: Milliseconds a PING may go unanswered before the
// connection and its calls fail (UNAVAILABLE); raise it for peers whose handlers hold the
// GIL or whose CPUs are starved for longer.
inline constexpr Knob kKeepaliveTimeoutMs{"TF_RDMA_KEEPALIVE_TIMEOUT_MS", 10000, 1000, 3600000, false, false};

// ConnConfig::zero_copy_min: Shm only: a received message of at least this many bytes is
// handed to the deserializer as a read-only view of the sender's pool block instead of a
// copy.
inline constexpr Knob kZeroCopyMin{"TF_RDMA_ZERO_COPY_MIN", 1048576, 4096, 68719476736, false, true};

// EngineConfig::malloc_tuning: `true`: tune glibc malloc to keep freed heap memory for
// reuse (see the malloc_* limits), so protobuf's multi-MiB buffers do not page-fault on
// every message; process-wide: environment only.
inline constexpr Knob kMallocTuning{"TF_RDMA_MALLOC_TUNING", 1, 0, 1, false, false};

// Fixed limits and timeouts: not settable, each with its reason.

// a sender waiting this long for ring credits from a peer that does answer keepalives
// fails the connection (the peer stopped reading)
inline constexpr double kCreditStallSeconds = 10.0;

// a connection with calls in flight that heard nothing from its peer for this long sends
// a PING
inline constexpr int64_t kKeepaliveMs = 1000;

// the same for an idle connection on a fabric without a liveness fd (verbs), so a peer
// that died between calls is found before the next call
inline constexpr int64_t kIdleKeepaliveMs = 2000;

// a sleeping wait on the main thread runs Python's signal handlers this often
inline constexpr int64_t kInterruptPollMs = 50;

// eager batches a connection may have in flight before the receiver consumes them
inline constexpr int64_t kCqSlots = 1024;

// verbs: ring credits a reader may owe, as a fraction of its ring and of its receive
// slots, before it returns them (each return is an RDMA write and an ACK of its own, so a
// call returns none and costs one batch and its ACK each way)
inline constexpr int64_t kCreditOweFraction = 8;

// verbs: credits owed this long are returned, however few, by the next thread that starts
// to poll (when none does, by the progress thread within longest_sleep_ms)
inline constexpr int64_t kCreditOweMs = 5;

// metrics: call records the engine keeps for the OpenTelemetry plugin between two takes;
// beyond it they are counted as dropped (argrpc.metrics.dropped_records)
inline constexpr int64_t kCallRecordsMax = 65536;

// how soon a keepalive verdict held back by a busy poll lock is tried again
inline constexpr int64_t kSweepMs = 5;

// the progress thread's longest sleep: otherwise it sweeps a shared-memory connection
// only when a deadline or keepalive is due, so an idle process does not wake hundreds of
// times a second
inline constexpr int64_t kLongestSleepMs = 100;

// a server worker that has just answered a call counts as polling until it is back in
// accept(), so the peer's next request rings no doorbell; a worker held up on that way
// (preempted, waiting for the GIL) holds the process's messages back about this long at
// most: the progress thread, finding such a worker on its way as it goes to sleep, sleeps
// this long instead, and a thread that has waited this long on a call looks itself and
// rings the peer even if the peer says it polls (an asyncio client's calls have no such
// thread: for them, longest_sleep_ms). An asyncio loop that found work counts as polling
// the same way until it polls again; the progress thread ends that once the loop has not
// come back for this long
inline constexpr int64_t kLeaseCheckMs = 1;

// a waiting thread that spins polls for up to this long between two yields of its CPU (a
// yield is a system call, and what arrives during one is seen only after it), as long as
// its last yield came back within yield_shared_us: otherwise another thread wants that
// CPU, perhaps the one it waits for, and it yields at every turn
inline constexpr int64_t kSpinPollUs = 2;

// a yield that takes this long or longer ran another thread on the CPU meanwhile if the
// kernel switched the thread out (its involuntary context switches, read only then; see
// spin_poll_us): one that ran nothing returns within half a microsecond, unless the
// hypervisor took the vCPU away, which a VM on a busy host sees hundreds of times a
// second and which is no other thread wanting the CPU
inline constexpr int64_t kYieldSharedUs = 1;

// a waiting thread whose yields ran another thread this many times in a row naps once (a
// timer sleep of some tens of microseconds): two threads that wait for each other from
// one CPU while another CPU idles hand that CPU back and forth at every message, and the
// kernel leaves them so for tens of milliseconds, as neither ever sleeps; waking from the
// nap, the thread is placed on an idle CPU if there is one
inline constexpr int64_t kShareNapAfter = 16;

// rounds in which the last thread to stop polling reads what came in before it could ask
// the peers to ring again, and asks again, before it leaves the rest to the progress
// thread (a fabric that already holds work cannot be armed)
inline constexpr int64_t kArmTries = 4;

// a connection neither heard from nor called on for this long is left to its doorbell:
// armed, and no longer read by every polling thread, so a poll pass costs what the busy
// connections cost, not every connection of the process (dropped by the next thread that
// starts to poll, or by the progress thread's next pass: not on a timer of its own, which
// would take a CPU from the threads that poll)
inline constexpr int64_t kCoolMs = 5;

// longest stretch one thread reads a connection while completions keep coming (a long
// pull on a slow fabric) before it lets go, so the sweep and PING answers are not held
// back
inline constexpr int64_t kPollHoldMs = 5;

// verbs: receive-ring bytes a process registers (pins) across its connections before new
// connections get smaller rings, halved down to 64K (and no lower than four times
// TF_RDMA_ACC_SIZE); a connection uses the smaller of its two sides' rings both ways, so
// a server with many clients pins little per connection
inline constexpr int64_t kVerbsRingBudget = 67108864;

// large messages pulled ahead of the reader per stream
inline constexpr int64_t kPullAhead = 2;

// the buffer pool's first growth step (pre-faulted); later steps double
inline constexpr int64_t kSlabSize = 16777216;

// copies at least this big use two threads
inline constexpr int64_t kParallelCopyMin = 2097152;

// glibc M_MMAP_THRESHOLD under TF_RDMA_MALLOC_TUNING (glibc's maximum)
inline constexpr int64_t kMallocMmapThreshold = 33554432;

// glibc M_TRIM_THRESHOLD under TF_RDMA_MALLOC_TUNING: a free top of the heap above it
// goes back at once; at 64 MiB a protobuf client frees 256 MiB there between calls (upb's
// 128 MiB encode block and two 64 MiB messages)
inline constexpr int64_t kMallocTrimThreshold = 402653184;

// glibc M_MMAP_MAX under TF_RDMA_MALLOC_TUNING: no block is a mapping of its own, so
// blocks above the 32M threshold (a 64 MiB protobuf message's buffers) are reused from
// the heap instead of mapped and page-faulted afresh for every message; what the heap
// keeps is bounded by malloc_retain_max
inline constexpr int64_t kMallocMmapMax = 0;

// glibc M_ARENA_MAX under TF_RDMA_MALLOC_TUNING (set when argrpc is imported, again when
// the fast path starts): threads that first allocate after that share the main heap
// instead of per-thread ones, which map anything near 64M afresh every time
inline constexpr int64_t kMallocArenaMax = 1;

// under TF_RDMA_MALLOC_TUNING, freed heap memory kept for reuse: when a message of at
// least malloc_mmap_threshold is sent or received and the heap holds more than this free,
// argrpc gives all of it back (glibc malloc_trim(0)); again 0.1, 1 and 10 s after such
// messages stop. A message above a quarter of this gives all free memory back at those
// checks, whatever the amount (its buffers could not be kept anyway)
inline constexpr int64_t kMallocRetainMax = 402653184;

// Values Python passes from grpc's options: their defaults.

// ConnConfig::max_recv: grpc.max_receive_message_length (-1: unlimited)
inline constexpr int64_t kMaxRecv = 4194304;

}  // namespace argrpc::knobs

// Each config struct's fields (csrc/engine_config.h) as X(kind, type, field, constant):
// KNOB, a knob Python passes and the engine checks against the knob's bounds; FIXED, a
// fixed limit Python does not pass; ARG, a value Python passes from grpc's options (its
// constant is the default).

#define ARGRPC_ENGINE_CONFIG_FIELDS(X) \
  X(KNOB, size_t, buf_size, kBufSize) \
  X(KNOB, int, spin_us, kSpinUs) \
  X(KNOB, bool, malloc_tuning, kMallocTuning) \
  X(FIXED, size_t, slab_size, kSlabSize) \
  X(FIXED, size_t, parallel_copy_min, kParallelCopyMin) \
  X(FIXED, size_t, malloc_mmap_threshold, kMallocMmapThreshold) \
  X(FIXED, size_t, malloc_trim_threshold, kMallocTrimThreshold) \
  X(FIXED, int, malloc_mmap_max, kMallocMmapMax) \
  X(FIXED, int, malloc_arena_max, kMallocArenaMax) \
  X(FIXED, size_t, malloc_retain_max, kMallocRetainMax)

#define ARGRPC_CONN_CONFIG_FIELDS(X) \
  X(KNOB, size_t, chunk_size, kChunkSize) \
  X(KNOB, size_t, acc_size, kAccSize) \
  X(KNOB, size_t, ring_size, kRingSize) \
  X(KNOB, int, reads_in_flight, kReadsInFlight) \
  X(KNOB, size_t, stream_window, kStreamWindow) \
  X(KNOB, uint32_t, keepalive_timeout_ms, kKeepaliveTimeoutMs) \
  X(KNOB, size_t, zero_copy_min, kZeroCopyMin) \
  X(FIXED, uint32_t, keepalive_ms, kKeepaliveMs) \
  X(FIXED, uint32_t, idle_keepalive_ms, kIdleKeepaliveMs) \
  X(FIXED, uint32_t, cq_slots, kCqSlots) \
  X(FIXED, int, pull_ahead, kPullAhead) \
  X(ARG, int64_t, max_recv, kMaxRecv)

#define ARGRPC_VERBS_CONFIG_FIELDS(X) \
  X(KNOB, int, qps, kQps) \
  X(KNOB, int, qp_timeout, kQpTimeout) \
  X(KNOB, int, qp_retry, kQpRetry) \
  X(KNOB, int, cq_depth, kCqDepth)

// The config structs, as X(struct, its field list).
#define ARGRPC_CONFIG_STRUCTS(X) \
  X(EngineConfig, ARGRPC_ENGINE_CONFIG_FIELDS) \
  X(ConnConfig, ARGRPC_CONN_CONFIG_FIELDS) \
  X(VerbsConfig, ARGRPC_VERBS_CONFIG_FIELDS)
