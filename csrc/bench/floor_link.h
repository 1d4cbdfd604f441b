// The benchmark's latency floor: one shm fabric driven directly, with no engine
// connection, stream, frame or call object on top. A strict ping-pong of whole
// messages, each written at the start of the peer's ring, waited for the way the
// engine's waiters wait (spin with sched_yield() for spin_us, then arm the doorbell and
// sleep on the fabric's fd). What argrpc adds to a round trip is its time minus this.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "fabric/fabric.h"

namespace argrpc {

class FloorLink {
 public:
  FloorLink(std::unique_ptr<Fabric> fabric, int spin_us);
  ~FloorLink();
  FloorLink(const FloorLink&) = delete;
  FloorLink& operator=(const FloorLink&) = delete;

  // Largest message: the peer's ring (one message in flight, never wrapped).
  size_t max_message() const;
  // Waits until the peer consumed the previous message, then writes this one.
  // Throws CoreError when the peer is gone or the wait passes timeout_s.
  void send(const void* data, size_t len, double timeout_s);
  // Waits for the next message and copies it into dst; returns its length. Throws
  // CoreError when it does not fit, the peer is gone or the wait passes timeout_s.
  size_t recv_into(void* dst, size_t cap, double timeout_s);

 private:
  // Polls the fabric; true once a received message is pending.
  bool poll_once();
  void block(int timeout_ms);

  std::unique_ptr<Fabric> fabric_;
  const int spin_us_;
  uint64_t sent_ = 0;             // messages written to the peer
  uint64_t consumed_bytes_ = 0;   // what this side has read from its ring
  uint64_t consumed_batches_ = 0;
  bool pending_ = false;          // a received message not yet copied out
  uint32_t pending_len_ = 0;
};

}  // namespace argrpc
