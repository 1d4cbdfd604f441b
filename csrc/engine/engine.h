// One engine per process: the pool, the copier, every connection, and the progress
// thread. Threads that wait for something (a client call, a server worker) poll the
// fabric themselves while they spin; the progress thread sleeps in epoll and takes over
// only when nobody is polling, so a busy path has no thread hand-off and an idle one
// burns no CPU. "Polling" is counted: while anyone polls, peers are asked not to ring
// the doorbell; the last one to stop re-arms every connection and looks once more.
// Only "hot" connections take part in that: those heard from or called on within
// cool_ms. A quiet one is armed and left to its doorbell (the progress thread wakes for
// it), so a poll pass, entering and leaving polling cost what the busy connections cost,
// not every connection of the process. The threads that poll drop the quiet ones as they
// start to spin (cool_and_pay_if_due), not the progress thread on a timer: a timed
// wake-up takes a CPU from one of those spinning threads, and nobody reads the hot set
// while nobody polls (it is armed then). They pay the hot connections' old credit
// debts (verbs) at the same look, for the same reason.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/unique_fd.h"
#include "engine/peer_info.h"
#include "engine/transport_stats.h"
#include "engine_config.h"

namespace argrpc {

class Connection;
class Copier;
class Fabric;
class Pool;
class Server;
class Notifier;

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(const EngineConfig& cfg);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineConfig& config() const { return cfg_; }
  const std::shared_ptr<Pool>& pool() const { return pool_; }
  Copier& copier() { return *copier_; }
  TransportStats& transport_stats() { return transport_stats_; }

  std::shared_ptr<Connection> attach(std::unique_ptr<Fabric> fabric, const ConnConfig& cfg,
                                     std::shared_ptr<Server> server, PeerInfo peer);
  void detach(Connection* conn);

  void enter_polling();
  void leave_polling();
  // A counted poller that polls later (engine/polling_lease.h); false once shut down.
  bool begin_lease();
  void end_lease();
  int leases_out() const { return leases_.load(std::memory_order_relaxed); }
  // An event loop's notifier that takes leases (Notifier::poll): the progress thread
  // ends one its loop kept lease_check_ms without polling again (the loop stopped, or
  // runs a long callback), since a stopped loop never comes back to end it.
  void add_loop(std::weak_ptr<Notifier> n);
  // Passes of the progress thread that no doorbell started, with nobody polling and no
  // lease out (a timed wake: a sweep or its longest sleep), that found work anyway: each
  // is a wake-up lost on the way, which cost that work up to longest_sleep_ms.
  uint64_t missed_doorbells() const { return missed_doorbells_.load(std::memory_order_relaxed); }
  // Passes of the progress thread that its own timer started (a sweep due, its longest
  // sleep, a lease to look at): on a busy host each takes a CPU from a thread that polls.
  uint64_t timed_wakeups() const { return timed_wakeups_.load(std::memory_order_relaxed); }
  // Reads every hot connection once.
  bool progress_all();
  // A thread about to spin drops the connections quiet for cool_ms from the hot set and
  // pays credit debts credit_owe_ms old, if either is due (one thread looks at a time).
  void cool_and_pay_if_due();
  // Tests only: cool() waits this long once it armed a connection, holding the lock
  // that heat() takes, so a doorbell rung meanwhile meets a connection in mid-cooling.
  void pause_cooling_for_test(uint32_t us) { cool_pause_us_.store(us, std::memory_order_relaxed); }
  // `c` is about to expect an answer (a call starts) or rang: it joins the hot set.
  void heat(Connection* c);
  size_t connection_count();
  size_t hot_count();
  void shutdown();
  // Makes the progress thread run a round (e.g. to flush queued control frames).
  void wake();
  // The eventfd wake() writes (a fabric rings it when work of its own completes).
  int wake_fd() const { return ctl_.get(); }
  // A stream with this deadline entered a connection's map: the progress thread, which
  // sleeps until the earliest deadline it knows of, sweeps again if this one is earlier.
  void deadline_set(const Deadline& dl);

 private:
  using ConnList = std::vector<std::shared_ptr<Connection>>;
  std::shared_ptr<const ConnList> snapshot() const;
  std::shared_ptr<const ConnList> hot_snapshot() const;
  void progress_loop();
  // Arms and drops from the hot set the connections quiet for cool_ms, and pays their
  // credit debts credit_owe_ms old; returns when the next of either is due (now_us()
  // scale). Called by cool_and_pay_if_due only.
  uint64_t cool(uint64_t now);
  // Puts the connections into the hot set or takes them out (under conns_mu_); a
  // detached one is never put back.
  void set_hot(const std::vector<Connection*>& which, bool hot);
  bool arm_all();  // false: a fabric held work already and stays unarmed
  void disarm_all();

  const EngineConfig cfg_;
  std::shared_ptr<Pool> pool_;
  std::unique_ptr<Copier> copier_;
  TransportStats transport_stats_;
  UniqueFd epoll_, ctl_;
  std::atomic<int> pollers_{0};
  std::atomic<int> leases_{0};
  std::mutex loops_mu_;
  std::vector<std::weak_ptr<Notifier>> loops_;  // add_loop()
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> missed_doorbells_{0};  // written by the progress thread only
  std::atomic<uint64_t> timed_wakeups_{0};     // likewise
  std::atomic<uint32_t> cool_pause_us_{0};
  // When the progress thread sweeps next (now_us() scale; the maximum while it sweeps,
  // so that every deadline set meanwhile asks for another), and
  // whether a deadline set since asks it to sweep sooner.
  alignas(64) std::atomic<uint64_t> next_sweep_us_{0};
  std::atomic<bool> sweep_asked_{false};
  // When cool_and_pay_if_due looks next (now_us() scale); taken by the thread that looks.
  alignas(64) std::atomic<uint64_t> next_cool_us_{0};

  // Held by heat(), cool(), arm_all() and disarm_all(): a connection that leaves the hot
  // set is armed after the last disarm_all() that could see it, so a cold connection is
  // never left disarmed (its peer would ring nobody).
  std::mutex arm_mu_;
  mutable std::mutex conns_mu_;
  std::shared_ptr<const ConnList> conns_, hot_;
  std::unordered_map<uint64_t, std::shared_ptr<Connection>> by_serial_;
  uint64_t next_serial_ = 1;
  std::thread progress_;
};

}  // namespace argrpc
