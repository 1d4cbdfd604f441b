#include "fabric/sim/sim_fabric.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/unique_fd.h"
#include "pool/pool.h"

namespace argrpc {

namespace {

struct Entry {
  Completion c;
  uint32_t hold = 0;  // polls that still pass it over
  // Not a completion: the peer shut down after everything queued before this.
  bool peer_left = false;
  std::string why;    // kError: what error() says once it is delivered
  // A read, carried out when its completion is delivered.
  void* dst = nullptr;
  RemoteRef src;
  size_t len = 0;
};

struct Exposure {
  uint64_t addr;  // what the peer reads it by: its offset in the pool, as on shm
  size_t len;
  const uint8_t* data;
};

UniqueFd make_eventfd() {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid()) throw CoreError(errno_text("eventfd"));
  return fd;
}

void ring_fd(int fd) {
  uint64_t one = 1;
  ssize_t r = ::write(fd, &one, sizeof one);
  (void)r;
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

struct SimSide {
  SimSide(const ConnConfig& cfg, const SimFaults& f, uint64_t seed)
      : ring_size(cfg.ring_size),
        slots(cfg.cq_slots),
        window(cfg.stream_window),
        ring(new uint8_t[cfg.ring_size]()),
        faults(f),
        wake(make_eventfd()),
        gone(make_eventfd()),
        rng(seed) {
    silent.store(f.drop_after_writes == 0);
  }

  const size_t ring_size;
  const uint32_t slots;
  const size_t window;
  const std::unique_ptr<uint8_t[]> ring;
  const SimFaults faults;
  const UniqueFd wake, gone;  // wait_fd(), liveness_fd()

  mutable std::mutex mu;  // the queues and everything the plan decides
  std::deque<Entry> recv;   // batches from the peer
  std::deque<Entry> local;  // this side's reads and failed operations
  uint64_t recvs = 0;  // batches queued here: hold_recv's index
  bool armed = true;
  uint64_t rng;
  SimCounters n;
  std::string broken;  // set by an injected failure: nothing issued later arrives
  std::string error;

  // Reads of this side copy under exp_mu, so unexpose() and shutdown() return only once
  // no read of the block is under way: the engine gives the block back right after.
  mutable std::mutex exp_mu;
  std::unordered_map<uint32_t, Exposure> exposed;  // key -> block
  std::unordered_map<uint64_t, uint32_t> key_of;   // block offset -> key
  uint32_t next_key = 1;
  uint64_t exposures = 0;

  std::atomic<uint64_t> consumed_bytes{0}, consumed_batches{0};
  std::atomic<bool> shut{false};
  std::atomic<bool> left{false};  // shut down while not silent: the peer may learn it
  std::atomic<bool> silent{false};

  uint32_t delay_locked(bool chosen) {
    uint32_t h = faults.delay_polls;
    if (faults.delay_jitter && h) h = static_cast<uint32_t>(splitmix64(&rng) % (uint64_t(h) + 1));
    if (chosen) h += faults.hold_polls;
    if (h) ++n.delayed;
    return h;
  }

  void queue_locked(std::deque<Entry>* q, Entry e) {
    q->push_back(std::move(e));
    // A held entry rings too: only the connections the engine keeps hot are polled, and
    // only polls end a hold. Its connection cannot be armed while it is held (arm()), so
    // it stays hot until the entry is delivered.
    if (armed) {
      armed = false;
      ring_fd(wake.get());
    }
  }

  bool holding_locked() const {
    auto held = [](const Entry& e) { return e.hold != 0; };
    return std::any_of(recv.begin(), recv.end(), held) ||
           std::any_of(local.begin(), local.end(), held);
  }

  bool ready_locked() const {
    if (!recv.empty() && recv.front().hold == 0) return true;
    if (faults.reorder_reads)
      return std::any_of(local.begin(), local.end(), [](const Entry& e) { return e.hold == 0; });
    return !local.empty() && local.front().hold == 0;
  }

  // What becomes of this side's operation `nth` of kind `op`: nothing (it goes on), or
  // it ends here with the value it returns: flushed after an injected failure, or the
  // one the plan fails.
  std::optional<bool> intercept_locked(const char* op, uint64_t nth, uint64_t fail_at,
                                       uint64_t* failed) {
    if (!broken.empty()) {
      ++n.flushed;
      return true;
    }
    if (nth != fail_at) return std::nullopt;
    ++*failed;
    return fail_locked(op, nth);
  }

  bool fail_locked(const char* op, uint64_t nth) {
    std::string why = faults.fail_reason.empty()
                          ? std::string("sim fabric: injected failure of ") + op + " #" + std::to_string(nth)
                          : faults.fail_reason;
    if (faults.fail_refuse) {
      if (error.empty()) error = why;
      return false;
    }
    broken = why;
    Entry e;
    e.c.kind = Completion::kError;
    e.why = std::move(why);
    e.hold = delay_locked(false);
    queue_locked(&local, std::move(e));
    return true;
  }

  // One poll of queue `q` (kept in issue order): held entries are passed over (one poll
  // fewer to go), and up to `room` of the others move to `out`, in order, where
  // nothing overtakes a held entry, or with `shuffle` in a seeded order.
  void take_locked(std::deque<Entry>* q, bool shuffle, size_t room, std::vector<Entry>* out) {
    std::vector<size_t> ready;
    bool blocked = false;
    for (size_t i = 0; i < q->size(); ++i) {
      Entry& e = (*q)[i];
      if (e.hold > 0) {
        --e.hold;
        blocked = true;
      } else if (shuffle || !blocked) {
        ready.push_back(i);
      }
    }
    if (shuffle && ready.size() >= 2) {
      for (size_t i = ready.size() - 1; i > 0; --i)
        std::swap(ready[i], ready[splitmix64(&rng) % (i + 1)]);
      if (std::is_sorted(ready.begin(), ready.end())) std::swap(ready[0], ready[1]);
    }
    if (ready.size() > room) ready.resize(room);
    std::vector<bool> taken(q->size(), false);
    for (size_t i : ready) {
      taken[i] = true;
      // Anything before it not yet taken is overtaken.
      for (size_t j = 0; j < i; ++j) {
        if (!taken[j]) {
          ++n.reordered;
          break;
        }
      }
      out->push_back(std::move((*q)[i]));
    }
    size_t keep = 0;
    for (size_t i = 0; i < q->size(); ++i)
      if (!taken[i]) (*q)[keep++] = std::move((*q)[i]);
    q->resize(keep);
  }
};

SimLink::SimLink(const ConnConfig& a, const ConnConfig& b, const SimPlan& plan)
    : lazy_credits_(plan.lazy_credits), nudge_(plan.nudge) {
  const ConnConfig* cfg[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    if (cfg[i]->ring_size == 0 || cfg[i]->cq_slots == 0)
      throw CoreError("sim fabric: a side needs a ring and completion slots");
    uint64_t seed = plan.seed * 2 + uint64_t(i);
    sides_[i] = std::make_unique<SimSide>(*cfg[i], plan.side[i], splitmix64(&seed));
  }
}

SimLink::~SimLink() = default;

SimCounters SimLink::counters(int side) const {
  const SimSide& s = *sides_[side & 1];
  SimCounters c;
  {
    std::lock_guard<std::mutex> g(s.mu);
    c = s.n;
  }
  std::lock_guard<std::mutex> g(s.exp_mu);
  c.exposed = s.exposures;
  return c;
}

void SimLink::silence(int side) { sides_[side & 1]->silent.store(true); }

SimPair SimFabric::pair(const ConnConfig& a, const ConnConfig& b, const SimPlan& plan) {
  SimPair p;
  p.link = std::make_shared<SimLink>(a, b, plan);
  p.a.reset(new SimFabric(p.link, 0));
  p.b.reset(new SimFabric(p.link, 1));
  return p;
}

SimFabric::SimFabric(std::shared_ptr<SimLink> link, int side) : link_(std::move(link)), side_(side) {}

SimFabric::~SimFabric() { shutdown(); }

SimSide& SimFabric::me() const { return *link_->sides_[side_]; }
SimSide& SimFabric::peer() const { return *link_->sides_[1 - side_]; }
bool SimFabric::lazy_credits() const { return link_->lazy_credits_; }

const uint8_t* SimFabric::ring() const { return me().ring.get(); }
size_t SimFabric::ring_size() const { return me().ring_size; }
size_t SimFabric::peer_ring_size() const { return peer().ring_size; }
uint32_t SimFabric::peer_slots() const { return peer().slots; }
size_t SimFabric::peer_stream_window() const { return peer().window; }
int SimFabric::wait_fd() const { return me().wake.get(); }
int SimFabric::liveness_fd() const { return me().gone.get(); }
// At once, not behind the queued batches as liveness_fd(): its callers wait for ring
// credits that a peer gone for certain will never give back.
bool SimFabric::peer_gone() const { return peer().left.load(); }

bool SimFabric::write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) {
  SimSide& s = me();
  SimSide& p = peer();
  if (s.shut.load()) return false;
  if (len > p.ring_size || remote_off > p.ring_size - len) return false;
  {
    std::lock_guard<std::mutex> g(s.mu);
    const uint64_t nth = ++s.n.writes;
    if (auto r = s.intercept_locked("write_imm", nth, s.faults.fail_write, &s.n.failed_writes))
      return *r;
    if (s.faults.drop_after_writes >= 0 && nth > uint64_t(s.faults.drop_after_writes))
      s.silent.store(true);
    if (s.silent.load() || p.silent.load()) {
      ++s.n.dropped_writes;
      return true;
    }
  }
  // The engine never writes ring space the peer has not given back, so the peer reads
  // none of these bytes before the completion below hands them over.
  std::memcpy(p.ring.get() + remote_off, src, len);
  std::lock_guard<std::mutex> g(p.mu);
  Entry e;
  e.c.kind = Completion::kRecv;
  e.c.len = imm;
  e.hold = p.delay_locked(++p.recvs == p.faults.hold_recv);
  p.queue_locked(&p.recv, std::move(e));
  return true;
}

RemoteRef SimFabric::expose(const Block& b) {
  SimSide& s = me();
  std::lock_guard<std::mutex> g(s.exp_mu);
  ++s.exposures;
  if (s.shut.load()) return RemoteRef{};
  const uint32_t key = s.next_key++;
  if (s.next_key == 0) s.next_key = 1;  // 0 is never a key
  const uint64_t addr = b.offset();
  s.exposed[key] = Exposure{addr, b.size(), b.data()};
  s.key_of[addr] = key;
  return RemoteRef{addr, key};
}

void SimFabric::unexpose(const Block& b) {
  SimSide& s = me();
  std::lock_guard<std::mutex> g(s.exp_mu);
  auto it = s.key_of.find(b.offset());
  if (it == s.key_of.end()) return;
  s.exposed.erase(it->second);
  s.key_of.erase(it);
}

bool SimFabric::read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) {
  SimSide& s = me();
  if (s.shut.load()) return false;
  if (len == 0 || src.addr > std::numeric_limits<uint64_t>::max() - len) return false;
  std::lock_guard<std::mutex> g(s.mu);
  const uint64_t nth = ++s.n.reads;
  if (auto r = s.intercept_locked("read", nth, s.faults.fail_read, &s.n.failed_reads)) return *r;
  Entry e;
  e.c.kind = Completion::kReadDone;
  e.c.wr_id = wr_id;
  e.dst = dst;
  e.src = src;
  e.len = len;
  e.hold = s.delay_locked(nth == s.faults.hold_read);
  s.queue_locked(&s.local, std::move(e));
  return true;
}

void SimFabric::publish_consumed(uint64_t bytes, uint64_t batches) {
  SimSide& s = me();
  if (s.silent.load()) return;
  {
    std::lock_guard<std::mutex> g(s.mu);
    ++s.n.credit_returns;
    s.n.batches_read = batches;
  }
  s.consumed_bytes.store(bytes, std::memory_order_release);
  s.consumed_batches.store(batches, std::memory_order_release);
}

void SimFabric::peer_consumed(uint64_t* bytes, uint64_t* batches) const {
  const SimSide& p = peer();
  *batches = p.consumed_batches.load(std::memory_order_acquire);
  *bytes = p.consumed_bytes.load(std::memory_order_acquire);
}

int SimFabric::poll(Completion* out, int max) {
  SimSide& s = me();
  SimSide& p = peer();
  if (max <= 0 || s.shut.load()) return 0;
  std::vector<Entry> taken;
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.take_locked(&s.recv, false, size_t(max), &taken);
    s.take_locked(&s.local, s.faults.reorder_reads, size_t(max) - taken.size(), &taken);
  }
  int n = 0;
  uint64_t dropped = 0, refused = 0, flushed = 0;
  std::string why;  // the first error of this poll: what follows it is flushed
  for (Entry& e : taken) {
    if (e.peer_left) {
      ring_fd(s.gone.get());
      continue;
    }
    if (e.c.kind == Completion::kReadDone) {
      if (!why.empty()) {
        ++flushed;
        continue;
      }
      if (s.silent.load() || p.silent.load()) {
        ++dropped;
        continue;
      }
      std::lock_guard<std::mutex> g(p.exp_mu);
      auto it = p.exposed.find(e.src.key);
      const Exposure* x = it == p.exposed.end() ? nullptr : &it->second;
      if (x && e.src.addr >= x->addr && e.src.addr - x->addr <= x->len &&
          e.len <= x->len - (e.src.addr - x->addr)) {
        if (s.faults.read_us) ::usleep(s.faults.read_us);
        std::memcpy(e.dst, x->data + (e.src.addr - x->addr), e.len);
      } else {
        // What a memory window does to a READ outside it: a remote access error, and
        // the QP goes to error.
        ++refused;
        e.c = Completion{};
        e.c.kind = Completion::kError;
        e.why = "sim fabric: remote access error: a read of " + std::to_string(e.len) +
                " bytes at " + hex(e.src.addr) + " with key " + std::to_string(e.src.key) +
                " is outside what the peer exposed";
      }
    }
    if (e.c.kind == Completion::kError && why.empty()) why = e.why;
    out[n++] = e.c;
  }
  std::lock_guard<std::mutex> g(s.mu);
  s.n.completions += uint64_t(n);
  s.n.dropped_reads += dropped;
  s.n.refused_reads += refused;
  s.n.flushed += flushed;
  if (!why.empty()) {
    if (s.broken.empty()) s.broken = why;
    if (s.error.empty()) s.error = why;
  }
  return n;
}

bool SimFabric::arm() {
  SimSide& s = me();
  std::lock_guard<std::mutex> g(s.mu);
  // A held entry rings nothing when its hold ends (it ends by polls): it keeps the
  // connection among those the engine polls, as work already there does.
  s.armed = !s.ready_locked() && !s.holding_locked();
  return s.armed;
}

void SimFabric::disarm() {
  SimSide& s = me();
  std::lock_guard<std::mutex> g(s.mu);
  s.armed = false;
}

void SimFabric::ack_wakeup() {
  uint64_t v;
  ssize_t r = ::read(me().wake.get(), &v, sizeof v);
  (void)r;
}

void SimFabric::nudge() {
  if (!link_->nudge_) return;
  SimSide& p = peer();
  std::lock_guard<std::mutex> g(p.mu);
  if (p.armed || !p.ready_locked()) return;
  ++p.n.nudges;
  ring_fd(p.wake.get());
}

void SimFabric::shutdown() {
  SimSide& s = me();
  if (s.shut.exchange(true)) return;
  {
    std::lock_guard<std::mutex> g(s.exp_mu);
    s.exposed.clear();
    s.key_of.clear();
  }
  if (s.silent.load()) return;  // a dead side's end tells nobody
  s.left.store(true);
  // Behind every batch already queued, as a hang-up shows only after what was written
  // before it, so the peer's drain() still reads those.
  SimSide& p = peer();
  std::lock_guard<std::mutex> g(p.mu);
  Entry e;
  e.peer_left = true;
  p.queue_locked(&p.recv, std::move(e));
}

std::string SimFabric::error() const {
  const SimSide& s = me();
  std::lock_guard<std::mutex> g(s.mu);
  return s.error;
}

}  // namespace argrpc
