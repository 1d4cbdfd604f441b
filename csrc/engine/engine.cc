#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/heap_bound.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/notifier.h"
#include "fabric/fabric.h"
#include "pool/copier.h"
#include "pool/pool.h"

namespace argrpc {

namespace {
constexpr int kLeaseCheckMs = int(knobs::kLeaseCheckMs);
constexpr uint64_t kLongestSleepUs = uint64_t(knobs::kLongestSleepMs) * 1000;
constexpr int kArmTries = int(knobs::kArmTries);
constexpr uint64_t kCoolUs = uint64_t(knobs::kCoolMs) * 1000;
}

Engine::Engine(const EngineConfig& cfg) : cfg_(cfg) {
  if (cfg_.malloc_tuning) {
    ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(cfg_.malloc_mmap_threshold));
    ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(cfg_.malloc_trim_threshold));
    // glibc caps M_MMAP_THRESHOLD at 32 MiB, so without these a 64 MiB message's
    // buffers (protobuf's encode arena and bytes, the parse arena, the field's bytes)
    // are each a fresh mapping, 16k page faults apiece. Only the main heap can serve
    // them without a mapping (a per-thread heap is at most 64 MiB): threads that
    // first allocate from here on share existing heaps instead of making new ones
    // (argrpc/_malloc.py sets the same cap at import, before the application's
    // threads exist, so that they share the main one).
    ::mallopt(M_MMAP_MAX, cfg_.malloc_mmap_max);
    ::mallopt(M_ARENA_MAX, cfg_.malloc_arena_max);
    // What the heap then keeps of freed large blocks is bounded by a trim when a
    // message that large goes by (common/heap_bound.h).
    heap_bound::configure(cfg_.malloc_mmap_threshold, cfg_.malloc_retain_max);
  }
  pool_ = Pool::create(cfg_);
  copier_ = std::make_unique<Copier>(cfg_.parallel_copy_min, cfg_.spin_us);
  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) throw CoreError(errno_text("epoll_create1"));
  ctl_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!ctl_.valid()) throw CoreError(errno_text("eventfd"));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, ctl_.get(), &ev) != 0)
    throw CoreError(errno_text("epoll_ctl"));
  conns_ = std::make_shared<const ConnList>();
  hot_ = std::make_shared<const ConnList>();
  progress_ = std::thread([this] {
    // Named for top -H, py-spy and perf, where a user looks for who wakes how often.
    ::pthread_setname_np(::pthread_self(), "argrpc-progress");
    progress_loop();
  });
}

Engine::~Engine() { shutdown(); }

void Engine::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(ctl_.get(), &one, sizeof one);
  (void)r;
}

void Engine::deadline_set(const Deadline& dl) {
  if (dl.at_us() >= next_sweep_us_.load(std::memory_order_seq_cst)) return;
  sweep_asked_.store(true, std::memory_order_seq_cst);
  wake();
}

void Engine::shutdown() {
  if (stop_.exchange(true)) return;
  uint64_t one = 1;
  ssize_t r = ::write(ctl_.get(), &one, sizeof one);
  (void)r;
  if (progress_.joinable()) progress_.join();
  auto list = snapshot();
  for (auto& c : *list) c->fail(kUnavailable, "argrpc: engine shut down");
  pool_->shutdown();
}

std::shared_ptr<const Engine::ConnList> Engine::snapshot() const {
  std::lock_guard<std::mutex> g(conns_mu_);
  return conns_;
}

std::shared_ptr<const Engine::ConnList> Engine::hot_snapshot() const {
  std::lock_guard<std::mutex> g(conns_mu_);
  return hot_;
}

std::shared_ptr<Connection> Engine::attach(std::unique_ptr<Fabric> fabric, const ConnConfig& cfg,
                                           std::shared_ptr<Server> server, PeerInfo peer) {
  if (stop_.load()) throw CoreError("argrpc engine is shut down");
  auto conn = std::make_shared<Connection>(this, std::move(fabric), cfg, std::move(server),
                                           std::move(peer));
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    conn->serial = next_serial_++;
    epoll_event ev{};
    // One descriptor may be both (shm's socket): its readability is the doorbell, its
    // hang-up the peer's end.
    const bool one_fd = conn->fabric().liveness_fd() == conn->fabric().wait_fd();
    ev.events = one_fd ? EPOLLIN | EPOLLRDHUP : EPOLLIN;
    ev.data.u64 = conn->serial << 1;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conn->fabric().wait_fd(), &ev) != 0)
      throw CoreError(errno_text("epoll_ctl(connection)"));
    if (conn->fabric().liveness_fd() >= 0 && !one_fd) {
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.u64 = (conn->serial << 1) | 1;
      if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conn->fabric().liveness_fd(), &ev) != 0) {
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, conn->fabric().wait_fd(), nullptr);
        throw CoreError(errno_text("epoll_ctl(connection socket)"));
      }
    }
    auto next = std::make_shared<ConnList>(*conns_);
    next->push_back(conn);
    conns_ = std::move(next);
    by_serial_[conn->serial] = conn;
    // Under conns_mu_, as detach()'s decrement is: never counted down before up.
    conn->counters().connections_open.fetch_add(1, std::memory_order_relaxed);
  }
  heat(conn.get());  // a new connection's first calls are near
  return conn;
}

void Engine::detach(Connection* conn) {
  std::lock_guard<std::mutex> g(conns_mu_);
  by_serial_.erase(conn->serial);
  if (conn->hot.load(std::memory_order_acquire)) {
    auto hot = std::make_shared<ConnList>();
    for (auto& c : *hot_)
      if (c.get() != conn) hot->push_back(c);
    hot_ = std::move(hot);
  }
  auto next = std::make_shared<ConnList>();
  for (auto& c : *conns_) {
    if (c.get() == conn) {
      conn->counters().connections_open.fetch_sub(1, std::memory_order_relaxed);
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->fabric().wait_fd(), nullptr);
      if (c->fabric().liveness_fd() >= 0 && c->fabric().liveness_fd() != c->fabric().wait_fd())
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->fabric().liveness_fd(), nullptr);
    } else {
      next->push_back(c);
    }
  }
  conns_ = std::move(next);
}

size_t Engine::connection_count() { return snapshot()->size(); }

size_t Engine::hot_count() { return hot_snapshot()->size(); }

bool Engine::progress_all() {
  auto list = hot_snapshot();
  bool did = false;
  for (auto& c : *list) did |= c->progress();
  return did;
}

void Engine::disarm_all() {
  std::lock_guard<std::mutex> a(arm_mu_);
  auto list = hot_snapshot();
  for (auto& c : *list) c->fabric().disarm();
}

bool Engine::arm_all() {
  std::lock_guard<std::mutex> a(arm_mu_);
  auto list = hot_snapshot();
  bool all = true;
  for (auto& c : *list) all &= c->fabric().arm();
  return all;
}

void Engine::heat(Connection* c) {
  c->heated_us.store(now_us(), std::memory_order_relaxed);
  if (c->hot.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> a(arm_mu_);
  {
    std::lock_guard<std::mutex> g(conns_mu_);
    if (c->hot.load(std::memory_order_relaxed)) return;
    auto it = by_serial_.find(c->serial);
    if (it == by_serial_.end()) return;  // detached: nothing reads it any more
    auto next = std::make_shared<ConnList>(*hot_);
    next->push_back(it->second);
    hot_ = std::move(next);
    c->hot.store(true, std::memory_order_release);
  }
  // Read after it joined: a last poller leaving now arms it (arm_all, after this lock).
  if (pollers_.load(std::memory_order_seq_cst) > 0) c->fabric().disarm();
}

void Engine::cool_and_pay_if_due() {
  uint64_t due = next_cool_us_.load(std::memory_order_relaxed);
  const uint64_t now = now_us();
  if (now < due) return;
  // Whoever moves the mark looks; the others spin on.
  if (!next_cool_us_.compare_exchange_strong(due, now + kCoolUs, std::memory_order_relaxed))
    return;
  // An empty hot set says nothing of when it fills again: look again within cool_ms.
  next_cool_us_.store(std::min(std::max(cool(now), now + 1000), now + kCoolUs),
                      std::memory_order_relaxed);
}

uint64_t Engine::cool(uint64_t now) {
  uint64_t next = std::numeric_limits<uint64_t>::max();
  auto list = hot_snapshot();
  std::vector<Connection*> quiet;
  for (auto& c : *list) {
    // An old credit debt (verbs) is paid here too, on a thread about to poll anyway.
    c->return_credits_if_due(now);
    next = std::min(next, c->credits_due_at());
    const uint64_t last = c->last_active_us();
    if (last <= now && now - last >= kCoolUs && c->may_cool())
      quiet.push_back(c.get());
    else
      next = std::min(next, std::max(last, now) + kCoolUs);
  }
  if (quiet.empty()) return next;
  std::lock_guard<std::mutex> a(arm_mu_);
  // Out of the hot set before it is armed: a doorbell it rings from then on finds it cold,
  // and heat() (behind arm_mu_) puts it back. Armed while still in the set, a doorbell
  // rung before it left would find it hot, and the progress thread would leave it to the
  // pollers, who stop reading it a moment later: unread until it rang again, which on
  // verbs (the doorbell is the completion queue's one event per arming) is never.
  set_hot(quiet, false);
  std::vector<Connection*> stay;
  for (Connection* c : quiet) {
    // Armed, it rings for whatever comes next; if something came already, it stays hot
    // and is read (arm() left it unarmed).
    if (!c->alive() || !c->fabric().arm()) stay.push_back(c);
  }
  const uint32_t pause_us = cool_pause_us_.load(std::memory_order_relaxed);
  if (pause_us != 0 && stay.size() < quiet.size())
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
  if (stay.empty()) return next;
  set_hot(stay, true);
  return std::min(next, now + kCoolUs);
}

void Engine::set_hot(const std::vector<Connection*>& which, bool hot) {
  std::lock_guard<std::mutex> g(conns_mu_);
  auto is_in = [&](const Connection* c) {
    return std::find(which.begin(), which.end(), c) != which.end();
  };
  auto next = std::make_shared<ConnList>();
  if (hot) {
    *next = *hot_;
    for (Connection* c : which) {
      auto it = by_serial_.find(c->serial);
      if (it == by_serial_.end() || c->hot.load(std::memory_order_relaxed)) continue;
      next->push_back(it->second);
      c->hot.store(true, std::memory_order_release);
    }
  } else {
    for (auto& c : *hot_) {
      if (is_in(c.get()))
        c->hot.store(false, std::memory_order_release);
      else
        next->push_back(c);
    }
  }
  hot_ = std::move(next);
}

void Engine::enter_polling() {
  if (pollers_.fetch_add(1, std::memory_order_seq_cst) == 0) disarm_all();
}

void Engine::leave_polling() {
  if (pollers_.fetch_sub(1, std::memory_order_seq_cst) != 1) return;
  // Nobody polls now: ask peers to ring again, then look once more for anything written
  // while they were told not to. A fabric that already held such work stays unarmed
  // (arm() is false), and its peer would ring nobody for what it writes next: until
  // some thread next polls, up to the progress thread's longest sleep. So arm again
  // once that work is read, until every fabric is armed or another thread polls (it
  // arms when it leaves); traffic that keeps coming is left to the progress thread.
  for (int tries = 0;; ++tries) {
    const bool armed = arm_all();
    progress_all();
    if (armed || pollers_.load(std::memory_order_seq_cst) > 0) return;
    if (tries == kArmTries) return wake();
  }
}

bool Engine::begin_lease() {
  if (stop_.load(std::memory_order_acquire)) return false;
  leases_.fetch_add(1, std::memory_order_relaxed);
  enter_polling();
  return true;
}

void Engine::add_loop(std::weak_ptr<Notifier> n) {
  std::lock_guard<std::mutex> g(loops_mu_);
  loops_.erase(std::remove_if(loops_.begin(), loops_.end(),
                              [](const std::weak_ptr<Notifier>& w) { return w.expired(); }),
               loops_.end());
  loops_.push_back(std::move(n));
}

void Engine::end_lease() {
  leases_.fetch_sub(1, std::memory_order_relaxed);
  // After shutdown nobody waits for a doorbell: only the count is given back.
  if (stop_.load(std::memory_order_acquire))
    pollers_.fetch_sub(1, std::memory_order_seq_cst);
  else
    leave_polling();
}

void Engine::progress_loop() {
  epoll_event evs[64];
  uint64_t next_sweep = now_us();
  // When something is due, busy or not: a transfer that keeps this thread hot for longer
  // than the keepalive timeout must not starve the keepalive (a PING the peer's process
  // has answered and this side has read is only counted here), the credits this side
  // owes nor the deadlines. Only then: a periodic look wakes every idle process on the
  // host a few hundred times a second, on CPUs its peers' calls need.
  auto sweep_if_due = [&] {
    const uint64_t t = now_us();
    // Read before it is cleared: the hot loop below asks every turn, and a write each
    // time would take the line from the threads that enter and leave polling.
    if (t < next_sweep && !(sweep_asked_.load(std::memory_order_seq_cst) &&
                            sweep_asked_.exchange(false, std::memory_order_seq_cst)))
      return false;
    // A deadline set from here on asks for another sweep (deadline_set): this one may
    // have looked at its connection's streams already.
    next_sweep_us_.store(std::numeric_limits<uint64_t>::max(), std::memory_order_seq_cst);
    uint64_t next = t + kLongestSleepUs;
    auto all = snapshot();
    for (auto& c : *all) next = std::min(next, c->sweep(t));
    next_sweep = std::max(next, t + 1000);  // epoll's granularity; nothing is that urgent
    next_sweep_us_.store(next_sweep, std::memory_order_seq_cst);
    return true;
  };
  while (!stop_.load(std::memory_order_acquire)) {
    // A lease out means nobody rings this process's doorbells on its holder's word: look
    // in the holder's stead soon, in case it is held up on its way back to polling (one
    // taken during a sleep is left to the waiters: engine/polling_lease.h).
    const bool leased = leases_.load(std::memory_order_relaxed) > 0;
    const uint64_t t = now_us();
    int timeout = t >= next_sweep ? 0 : int((next_sweep - t + 999) / 1000);
    if (leased) timeout = std::min(timeout, kLeaseCheckMs);
    const int n = ::epoll_wait(epoll_.get(), evs, 64, timeout);
    if (n == 0 && timeout > 0) timed_wakeups_.fetch_add(1, std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = evs[i].data.u64;
      if (tag == 0) {
        uint64_t v;
        ssize_t r = ::read(ctl_.get(), &v, sizeof v);
        (void)r;
        continue;
      }
      std::shared_ptr<Connection> c;
      {
        std::lock_guard<std::mutex> g(conns_mu_);
        auto it = by_serial_.find(tag >> 1);
        if (it != by_serial_.end()) c = it->second;
      }
      if (!c) continue;
      if ((tag & 1) || (evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
        c->drain();
        c->fail(kUnavailable, "argrpc: connection to " + c->peer_name() +
                                  " lost (the peer closed it or exited)");
      } else {
        c->fabric().ack_wakeup();
        heat(c.get());  // read below, and by every poller while it stays busy
      }
    }
    if (stop_.load(std::memory_order_acquire)) break;
    if (leased) {
      std::vector<std::shared_ptr<Notifier>> loops;
      {
        std::lock_guard<std::mutex> g(loops_mu_);
        for (auto& w : loops_)
          if (auto n = w.lock()) loops.push_back(std::move(n));
      }
      const uint64_t now = now_us();
      for (auto& n : loops) n->expire_lease(*this, now);
    }
    // Nothing rang, nobody polls and no holder of a lease (before or during the sleep)
    // is on its way back to read it: work found now was announced to nobody.
    const bool unrung = n == 0 && !leased && leases_.load(std::memory_order_relaxed) == 0 &&
                        pollers_.load(std::memory_order_relaxed) == 0;
    cool_and_pay_if_due();
    enter_polling();
    if (progress_all()) {
      if (unrung) missed_doorbells_.fetch_add(1, std::memory_order_relaxed);
      // Stay hot for a while after work, unless another thread is already polling.
      uint64_t idle_since = now_us();
      while (pollers_.load(std::memory_order_relaxed) == 1 &&
             now_us() - idle_since < uint64_t(cfg_.spin_us)) {
        if (progress_all()) idle_since = now_us();
        sweep_if_due();
        // Work that keeps coming keeps this thread here: cool and pay old credit debts
        // as a poller starting to spin would.
        cool_and_pay_if_due();
        sched_yield();
      }
    }
    leave_polling();
    // Off the hot loop: a trim can take a while, and traffic that keeps the thread hot
    // is trimmed on its callers' paths anyway.
    if (sweep_if_due()) heap_bound::settle();
  }
}

}  // namespace argrpc
