// A bound on the freed heap memory malloc tuning keeps for reuse.
//
// Under TF_RDMA_MALLOC_TUNING glibc serves every block, however large, from the main heap
// (M_MMAP_MAX=0) so that protobuf's fresh buffers of a large message reuse memory that is
// already faulted in. glibc gives back only the free top of that heap (above
// M_TRIM_THRESHOLD); a freed block with a live one above it stays resident for good, so
// a service moving messages of hundreds of MiB would keep hundreds of MiB per message
// size it has seen. Each message of at least the mmap threshold sent or received checks
// how much the heap holds free (mallinfo2, well under a microsecond) and, above the cap,
// hands every free page back (malloc_trim(0)): about what glibc's own munmap of those
// blocks would have cost, paid once per cap's worth of freed memory rather than on every
// free; the engine checks again when large messages stop (settle()). A message above a
// quarter of the cap keeps nothing: its checks give back whatever is free. Process-wide,
// like malloc's settings.
#pragma once
#include <cstddef>
#include <cstdint>

namespace argrpc::heap_bound {

// From the engine when malloc tuning is on: messages of at least `min_message` bytes
// check the heap; more than `retain_max` bytes free there is trimmed. min_message 0:
// off (the default, and what a process without tuning keeps).
void configure(size_t min_message, size_t retain_max);

// After a message of `len` bytes was sent or received, on the caller's thread.
void note_message(size_t len);

// From the engine's progress thread now and then: once no large message came for 0.1 s,
// 1 s and 10 s, one more check each, for what their buffers' owners freed since.
void settle();

struct Stats {
  uint64_t checks = 0;        // heap checks (messages of at least min_message)
  uint64_t settles = 0;       // checks after a quiet spell (settle())
  uint64_t trims = 0;         // malloc_trim(0) calls
  uint64_t trim_ns = 0;       // time spent in them
  uint64_t free_before = 0;   // bytes free in the heap before the last trim
};
Stats stats();

}  // namespace argrpc::heap_bound
