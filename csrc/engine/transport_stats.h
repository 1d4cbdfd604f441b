// An engine's always-on counters, one set per transport (fabric name: shm, verbs, sim),
// cumulative from the engine's start. Relaxed atomics: each is a sum read on its own,
// never a value other memory is published through.
//
// What each message path is in this engine, per direction; every message byte counts in
// exactly one path of each side:
//   eager        a message of at most acc_size minus a frame header (and within the
//                peer's stream window), carried inline in a batch written to the
//                peer's ring. Sent: counted by the sender; received: counted by the
//                receiver as its frame arrives.
//   rendezvous   every larger message. The sender always copies it into a block of its
//                pool and announces it (RTS): there is no zero-copy send, so every such
//                message counts as rendezvous sent. The receiver takes it one of two
//                ways, counted apart: pulled chunk by chunk with fabric READs into its
//                own pool (or the heap when its pool is full) counts as rendezvous
//                received, per chunk as each lands;
//   zero copy    or, on a fabric that maps the peer's pool (shm), a message of at least
//                zero_copy_min handed to the application as a read-only view of the
//                sender's block (while the connection's view budget lasts): zero-copy
//                received, counted when the view is taken. So one side's rendezvous
//                sent is the peer's rendezvous plus zero-copy received.
// A message counts as sent once it is committed to the connection (its stream had not
// ended); a connection that fails under it does not take it back.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace argrpc {

// Every connection of a transport adds to the same counters: senders and the threads
// reading batches each get cache lines of their own, so they do not contend.
struct TransportCounters {
  alignas(64) std::atomic<uint64_t> eager_bytes_sent{0};
  std::atomic<uint64_t> rendezvous_bytes_sent{0};
  alignas(64) std::atomic<uint64_t> eager_bytes_received{0};
  std::atomic<uint64_t> rendezvous_bytes_received{0};
  std::atomic<uint64_t> zero_copy_bytes_received{0};
  alignas(64) std::atomic<int64_t> connections_open{0};  // attached and not failed or closed yet
  // Connections failed because a keepalive PING went unanswered for keepalive_timeout.
  std::atomic<uint64_t> keepalive_failures{0};

  static void add(std::atomic<uint64_t>& c, uint64_t n) { c.fetch_add(n, std::memory_order_relaxed); }
};

struct TransportSnapshot {
  int64_t connections_open;
  uint64_t eager_bytes_sent, eager_bytes_received, rendezvous_bytes_sent,
      rendezvous_bytes_received, zero_copy_bytes_received, keepalive_failures;
};

class TransportStats {
 public:
  // Made on first use and kept for the engine's life: connections hold the reference.
  TransportCounters& of(const std::string& transport) {
    std::lock_guard<std::mutex> g(mu_);
    auto& c = by_name_[transport];
    if (!c) c = std::make_unique<TransportCounters>();
    return *c;
  }

  std::vector<std::pair<std::string, TransportSnapshot>> snapshot() const {
    std::vector<std::pair<std::string, TransportSnapshot>> out;
    std::lock_guard<std::mutex> g(mu_);
    constexpr auto r = std::memory_order_relaxed;
    for (const auto& kv : by_name_) {
      const TransportCounters& c = *kv.second;
      out.emplace_back(kv.first, TransportSnapshot{
          c.connections_open.load(r), c.eager_bytes_sent.load(r), c.eager_bytes_received.load(r),
          c.rendezvous_bytes_sent.load(r), c.rendezvous_bytes_received.load(r),
          c.zero_copy_bytes_received.load(r), c.keepalive_failures.load(r)});
    }
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<TransportCounters>> by_name_;
};

}  // namespace argrpc
