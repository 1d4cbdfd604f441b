// The fabric interface: the only thing the engine knows about how bytes move. It is
// verbs-shaped on purpose (write-with-immediate into the peer's receive ring, read from
// announced remote memory, poll completions, a fd to block on), so the shm fabric and
// the verbs fabric are interchangeable, and a new one is a folder beside shm/ and verbs/
// plus its unit in bindings/.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace argrpc {

class Block;

// Where a peer can read an announced block from (RTS frame).
struct RemoteRef {
  uint64_t addr = 0;
  uint32_t key = 0;
};

struct Completion {
  enum Kind : uint8_t { kRecv, kReadDone, kError };
  Kind kind = kRecv;
  uint32_t len = 0;     // kRecv: the immediate of the batch the peer wrote (length, flags)
  uint64_t wr_id = 0;   // kReadDone: the id given to read()
};

class Fabric {
 public:
  virtual ~Fabric() = default;
  virtual const char* name() const = 0;

  // The local receive ring the peer writes batches into.
  virtual const uint8_t* ring() const = 0;
  virtual size_t ring_size() const = 0;
  // What the peer declared at connection time.
  virtual size_t peer_ring_size() const = 0;
  virtual uint32_t peer_slots() const = 0;          // batches it can hold unconsumed
  virtual size_t peer_stream_window() const = 0;    // unread eager bytes per stream

  // Copies [src, src+len) into the peer's ring at `remote_off` and delivers `imm` to
  // the peer as the immediate of a kRecv completion (its `len`: the engine's batch
  // length and flags). Thread-compatible: the engine serialises calls.
  virtual bool write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) = 0;

  // Whether expose() can make `b` readable by the peer; false, with the reason, when
  // it cannot (verbs: registering that part of the pool is past the locked-memory
  // limit). Asked before the peer hears of the block, so only that message fails.
  virtual bool exposable(const Block& b, std::string* why) { return true; }
  // Whether reads may land in [dst, dst+len); false, with the reason, when they cannot
  // (verbs: that memory cannot be registered). Asked before the first read, so only
  // that message fails.
  virtual bool landable(void* dst, size_t len, std::string* why) { return true; }
  // Makes a local pool block readable by the peer until the peer's FIN; unexpose()
  // (at the FIN, or when the RTS never went out) ends that access.
  virtual RemoteRef expose(const Block& b) = 0;
  virtual void unexpose(const Block& b) {}
  // Reads len bytes of announced peer memory into dst; a kReadDone completion with
  // wr_id follows. False if the reference is outside what the peer may announce.
  virtual bool read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) = 0;
  // Fabrics whose peer memory is load/store accessible (shm) return a read-only
  // pointer to announced memory, so a receiver can use it in place of a read; others
  // return nullptr. Valid while the fabric lives. Budget: bytes a receiver may hold.
  virtual const uint8_t* peer_view(const RemoteRef& src, size_t len) const { return nullptr; }
  virtual size_t peer_view_budget() const { return 0; }

  // Ring credits travel out of band so that returning them never needs ring space.
  virtual void publish_consumed(uint64_t bytes, uint64_t batches) = 0;
  virtual void peer_consumed(uint64_t* bytes, uint64_t* batches) const = 0;
  // A return costs packets of its own (verbs): the engine returns credits late, in
  // bulk. False: publish_consumed is a store, made after every batch.
  virtual bool lazy_credits() const { return false; }

  virtual int poll(Completion* out, int max) = 0;

  // Blocking: the engine waits for wait_fd() to become readable. arm() asks to be
  // signalled for the next completion and returns false if one is already pending.
  virtual int wait_fd() const = 0;
  virtual bool arm() = 0;
  virtual void disarm() = 0;
  virtual void ack_wakeup() = 0;
  // Rings the peer's doorbell although the peer said it polls, if what this side wrote
  // is still unread there: a waiter that has waited long suspects the peer's poller is
  // held up (a polling lease: engine/polling_lease.h). Fabrics whose peer cannot stop
  // being signalled (verbs) have nothing to do. Thread-safe.
  virtual void nudge() {}
  // Readable/hung up when the peer is gone (-1 if the fabric has no such fd).
  virtual int liveness_fd() const = 0;
  // Non-blocking: true if the peer has certainly hung up (false if it cannot tell), for
  // loops that wait on the peer and must not rely on another thread to notice.
  virtual bool peer_gone() const { return false; }
  // Stop signalling and release what the peer could still reach; idempotent.
  virtual void shutdown() = 0;
  // Why the fabric failed (after a kError completion).
  virtual std::string error() const = 0;
};

}  // namespace argrpc
