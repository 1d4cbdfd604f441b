// Test instruments of one connection, behind the _probe_* bindings: what the last RTS
// received announced, READs of arbitrary peer memory, and a one-shot fail point. A
// connection has them only once a test asks (ProbeSlot), so the production path pays
// a pointer test where it would record something, never this lock.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "fabric/fabric.h"

namespace argrpc {

// Where a test can make a connection fail as if its peer had just hung up, to prove
// that a failure at that exact point still ends every call (tests/test_fail_points.py).
enum class FailPoint : int {
  kNone = 0,
  kSubmit,    // a call's submit() starts: the stream is not registered yet
  kCopyIn,    // a large message was copied into the pool, the send lock not yet taken
  kRegister,  // a new client stream was just registered, before it checks the connection
  kFlush,     // a batch is about to be written to the peer
  kPull,      // the first chunk of a rendezvous pull has arrived
  kFinished,  // a server call's status went out, the call not yet ended
};

class Probes {
 public:
  void record_rts(const RemoteRef& src, uint64_t len);
  RemoteRef last_rts(uint64_t* len);

  // The destination of probe READ `wr_id`, kept until the probes go, which is after
  // the connection's fabric: a READ that never completes still has somewhere to land.
  uint8_t* start_read(uint64_t wr_id, size_t len);
  // A completion the connection did not post itself: if it is a probe's, it is done.
  void read_done(uint64_t wr_id);
  // True once, when probe READ `wr_id` has completed.
  bool take_done(uint64_t wr_id);

  void arm(FailPoint p) { fail_at_.store(int(p), std::memory_order_relaxed); }
  // True the first time the connection reaches the armed point.
  bool fire(FailPoint p) {
    return fail_at_.load(std::memory_order_relaxed) == int(p) &&
           fail_at_.exchange(0, std::memory_order_relaxed) == int(p);
  }

 private:
  std::mutex mu_;
  RemoteRef last_rts_;
  uint64_t last_rts_len_ = 0;
  std::set<uint64_t> reads_, done_;
  std::vector<std::unique_ptr<uint8_t[]>> bufs_;
  std::atomic<int> fail_at_{0};
};

// A connection's Probes, made the first time a test asks for them and kept until the
// connection goes. get() is all the production path pays: one acquire load.
class ProbeSlot {
 public:
  ProbeSlot() = default;
  ProbeSlot(const ProbeSlot&) = delete;
  ProbeSlot& operator=(const ProbeSlot&) = delete;
  ~ProbeSlot() { delete ptr_.load(std::memory_order_acquire); }

  Probes* get() const { return ptr_.load(std::memory_order_acquire); }
  Probes& enable();

 private:
  std::atomic<Probes*> ptr_{nullptr};
};

}  // namespace argrpc
