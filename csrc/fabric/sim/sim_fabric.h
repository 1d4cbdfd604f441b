// The test fabric: two fabrics in one process, connected through ordinary heap memory,
// that inject faults on request. Writes with immediate copy into the peer's ring and
// queue the peer's kRecv at once; rendezvous reads check the key and range of what the
// peer exposed and copy when their completion is polled, as a verbs READ lands some
// time before its completion. A RemoteRef is a pool offset, as on shm, and a key that
// counts from 1 per side and dies with unexpose(), as a memory window's does. Everything it injects comes from a SimPlan fixed when
// the pair is made and a generator seeded from it, so a failing run replays, and it
// counts what it injected, so a test can tell the fault happened and was not dodged.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "fabric/fabric.h"
#include "engine_config.h"

namespace argrpc {

// The faults of one side. Delays and reordering act on the completions this side
// polls; failures and silence on the operations it issues. Operation indices count
// from 1 per side and kind; 0 means never.
struct SimFaults {
  // Each completion is passed over by this many polls of its side before it can be
  // delivered, or, with jitter, by a seeded number of polls in [0, delay_polls].
  uint32_t delay_polls = 0;
  bool delay_jitter = false;
  // The Nth batch this side receives, or the completion of its Nth read, is passed
  // over by hold_polls more.
  uint64_t hold_recv = 0;
  uint64_t hold_read = 0;
  uint32_t hold_polls = 0;
  // Read completions come in a seeded order, never their issue order when two or more
  // are ready: verbs promises no order between READs spread over several QPs. Batches
  // always come in order, as on one RC QP.
  bool reorder_reads = false;
  // Each read's data takes this long to land, spent inside the poll that delivers its
  // completion: a slow link (Soft-RoCE under emulation completes a READ inside the calls
  // that post and poll it), so a long pull keeps its poller busy with completions.
  uint32_t read_us = 0;
  // The Nth write_imm / read fails: by a kError completion whose error() is
  // fail_reason (a QP gone to error: nothing issued after it arrives), or, with
  // fail_refuse, by returning false.
  uint64_t fail_write = 0;
  uint64_t fail_read = 0;
  bool fail_refuse = false;
  std::string fail_reason;
  // After this side's first N write_imm (0: from the start) the side is silent, as a
  // dead peer whose NIC no longer answers: what it writes and what is written to it
  // vanishes while every write succeeds, reads of or by it never complete, its ring
  // credits stop, and its own shutdown tells the peer nothing, so only a keepalive
  // notices. -1: never.
  int64_t drop_after_writes = -1;
};

struct SimPlan {
  uint64_t seed = 1;
  SimFaults side[2];
  // true: credits go back late, as on verbs, which the fabric stands in for; false: as on
  // shm, after every batch.
  bool lazy_credits = true;
  // false: nudge() rings nothing, as on verbs, whose doorbell is the receiver's own
  // completion event: a doorbell the engine loses is then never rung again.
  bool nudge = true;
};

// What one side did and what was done to it.
struct SimCounters {
  uint64_t writes = 0, reads = 0;        // operations issued (failed ones included)
  uint64_t completions = 0;              // delivered by poll()
  uint64_t delayed = 0;                  // completions queued with a delay or a hold
  uint64_t reordered = 0;                // read completions delivered before an earlier read's
  uint64_t failed_writes = 0, failed_reads = 0;    // injected failures
  uint64_t flushed = 0;                  // operations issued after a failure (never arrive)
  uint64_t dropped_writes = 0, dropped_reads = 0;  // lost to silence
  uint64_t refused_reads = 0;            // outside what the peer exposed (a remote access error)
  uint64_t exposed = 0;                  // expose() calls
  uint64_t credit_returns = 0;           // publish_consumed() calls (each a write on verbs)
  uint64_t batches_read = 0;             // the last batch count returned
  uint64_t nudges = 0;                   // doorbells nudge() rang (the side said it polled)
};

struct SimSide;

// The state both fabrics of a pair share, and what a test keeps to watch and steer the
// pair once the engine owns the fabrics.
class SimLink {
 public:
  SimLink(const ConnConfig& a, const ConnConfig& b, const SimPlan& plan);
  ~SimLink();
  SimLink(const SimLink&) = delete;
  SimLink& operator=(const SimLink&) = delete;

  SimCounters counters(int side) const;
  // The side goes silent now (see SimFaults::drop_after_writes).
  void silence(int side);

 private:
  friend class SimFabric;
  std::unique_ptr<SimSide> sides_[2];
  bool lazy_credits_;
  bool nudge_;
};

class SimFabric;

struct SimPair {
  std::unique_ptr<SimFabric> a, b;  // side 0 and side 1
  std::shared_ptr<SimLink> link;
};

class SimFabric final : public Fabric {
 public:
  // Side 0 has ring, slots and stream window from `a`, side 1 from `b`.
  static SimPair pair(const ConnConfig& a, const ConnConfig& b, const SimPlan& plan);
  ~SimFabric() override;

  const char* name() const override { return "sim"; }
  const uint8_t* ring() const override;
  size_t ring_size() const override;
  size_t peer_ring_size() const override;
  uint32_t peer_slots() const override;
  size_t peer_stream_window() const override;
  bool write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) override;
  RemoteRef expose(const Block& b) override;
  void unexpose(const Block& b) override;
  bool read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) override;
  void publish_consumed(uint64_t bytes, uint64_t batches) override;
  void peer_consumed(uint64_t* bytes, uint64_t* batches) const override;
  bool lazy_credits() const override;
  int poll(Completion* out, int max) override;
  int wait_fd() const override;
  bool arm() override;
  void disarm() override;
  void ack_wakeup() override;
  void nudge() override;
  int liveness_fd() const override;
  bool peer_gone() const override;
  void shutdown() override;
  std::string error() const override;

 private:
  SimFabric(std::shared_ptr<SimLink> link, int side);
  SimSide& me() const;
  SimSide& peer() const;

  const std::shared_ptr<SimLink> link_;
  const int side_;
};

}  // namespace argrpc
