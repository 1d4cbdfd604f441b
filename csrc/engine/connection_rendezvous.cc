// Rendezvous: a message too large for a batch stays in the sender's pool, announced by
// an RTS, until the receiver has it and answers FIN. The receiver pulls it with fabric
// READs in chunks, or on a fabric that maps the peer's pool (shm) holds a view of it.
#include <algorithm>
#include <limits>
#include <new>
#include <string>

#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "pool/copier.h"
#include "pool/pool.h"

namespace argrpc {

namespace {
class ViewLease {
 public:
  ViewLease(std::shared_ptr<Connection> conn, uint64_t rdv_id, uint64_t len)
      : conn_(std::move(conn)), rdv_id_(rdv_id), len_(len) {}
  ViewLease(const ViewLease&) = delete;
  ViewLease& operator=(const ViewLease&) = delete;
  ~ViewLease() { conn_->release_view(rdv_id_, len_); }

 private:
  std::shared_ptr<Connection> conn_;
  uint64_t rdv_id_, len_;
};

std::string no_room(AllocStatus st, size_t len, size_t capacity) {
  const std::string cap = std::to_string(capacity);
  if (st == AllocStatus::kTooBig)
    return "argrpc: a " + std::to_string(len) +
           "-byte message is larger than the whole registered pool (TF_RDMA_BUF_SIZE=" + cap + ")";
  if (st == AllocStatus::kTimeout)
    return "argrpc: no room in the registered pool (TF_RDMA_BUF_SIZE=" + cap + ") for a " +
           std::to_string(len) + "-byte message before the deadline";
  return "argrpc: engine is shutting down";
}
}  // namespace

// ------------------------------------------------------------------ sender side

Block Connection::take_block(const std::shared_ptr<Stream>& sp, size_t len, bool* would_block) {
  const std::shared_ptr<Pool>& pool = engine_->pool();
  AllocStatus st = AllocStatus::kTooBig;
  Block block;
  // Until the call has ended with the cause, if it must: see Stream::awaiting_pool.
  struct PoolWait {
    Stream* s = nullptr;
    ~PoolWait() {
      if (s) s->awaiting_pool.store(false, std::memory_order_release);
    }
  } waiting;
  if (!would_block) {
    waiting.s = sp.get();
    sp->awaiting_pool.store(true, std::memory_order_release);
    block = pool->alloc(len, sp->deadline, &st, &dead_);
  } else if (len <= pool->capacity()) {
    block = pool->try_alloc(len);
    if (!block.valid()) {
      *would_block = true;
      return block;
    }
  }
  if (block.valid()) return block;
  if (st == AllocStatus::kAborted) {  // the connection failed meanwhile
    end_failed(sp);
    return block;
  }
  refuse_message(sp, no_room(st, len, pool->capacity()));
  return block;
}

Block Connection::exposable_block(const std::shared_ptr<Stream>& sp, size_t len,
                                  bool* would_block) {
  Block block = take_block(sp, len, would_block);
  if (!block.valid()) return block;
  std::string why;
  if (fabric_->exposable(block, &why)) return block;
  refuse_message(sp, "argrpc: cannot announce a " + std::to_string(len) + "-byte message: " + why);
  return Block();
}

void Connection::refuse_message(const std::shared_ptr<Stream>& sp, const std::string& why) {
  bool unknown_to_peer;  // a client call whose HEADERS have not gone out
  {
    std::lock_guard<std::mutex> g(sp->mu);
    unknown_to_peer = client_ && !sp->headers_sent;
  }
  if (unknown_to_peer) end_stream(sp, kResourceExhausted, why, false, nullptr, false);
  else cancel(sp, kResourceExhausted, why);
}

uint64_t Connection::expose_message(const Outgoing& o, Block block, RemoteRef* ref) {
  if (!engine_->copier().copy(block.data(), o.msg, o.msg_len, &dead_)) return 0;
  fail_point(FailPoint::kCopyIn);
  *ref = fabric_->expose(block);
  std::lock_guard<std::mutex> g(exposed_mu_);
  const uint64_t rdv = next_rdv_++;
  exposed_.emplace(rdv, std::move(block));
  return rdv;
}

bool Connection::withdraw(uint64_t rdv_id) {
  std::lock_guard<std::mutex> g(exposed_mu_);
  auto it = exposed_.find(rdv_id);
  if (it == exposed_.end()) return false;
  fabric_->unexpose(it->second);
  exposed_.erase(it);
  return true;
}

// ---------------------------------------------------------------- receiver side

bool Connection::try_view(const std::shared_ptr<Pull>& p) {
  if (p->len < cfg_.zero_copy_min) return false;
  const uint8_t* v = fabric_->peer_view(p->src, p->len);
  if (!v) return false;
  // Bounded so a reader that keeps views cannot drain the sender's pool.
  const uint64_t held = leased_bytes_.fetch_add(p->len);
  if (held + p->len > fabric_->peer_view_budget()) {
    leased_bytes_.fetch_sub(p->len);
    return false;
  }
  p->dst.view = v;
  TransportCounters::add(counters_.zero_copy_bytes_received, p->len);
  p->dst.lease = std::make_shared<ViewLease>(shared_from_this(), p->rdv_id, p->len);
  if (auto s = p->stream.lock()) {
    std::lock_guard<std::mutex> g(s->mu);
    p->complete = true;
    s->notify_locked();
  }
  return true;
}

void Connection::release_view(uint64_t rdv_id, uint64_t len) {
  leased_bytes_.fetch_sub(len);
  if (!alive()) return;
  queue_fin(rdv_id);
  // Runs wherever the last reference died (often a Python thread): hand the flush to
  // the progress thread rather than wait on ring credits here. It reads only hot
  // connections, and this one may have cooled while the view was held.
  engine_->heat(this);
  engine_->wake();
}

void Connection::start_pull(const std::shared_ptr<Pull>& p) {
  p->dst.is_inline = false;
  p->dst.len = p->len;
  if (try_view(p)) return;
  Block b = engine_->pool()->try_alloc_received(p->len);
  if (b.valid()) {
    p->dst.block = std::move(b);
  } else {
    p->dst.heap.reset(new (std::nothrow) uint8_t[p->len ? p->len : 1]);
    if (!p->dst.heap) {
      queue_fin(p->rdv_id);
      if (auto s = p->stream.lock())
        abort_stream(s, kResourceExhausted,
                     "argrpc: no memory to receive a " + std::to_string(p->len) + "-byte message",
                     kCancelled);
      return;
    }
  }
  std::string why;
  if (p->len && !fabric_->landable(p->dst.data(), p->len, &why)) {
    queue_fin(p->rdv_id);
    if (auto s = p->stream.lock())
      abort_stream(s, kResourceExhausted,
                   "argrpc: cannot receive a " + std::to_string(p->len) + "-byte message: " + why,
                   kCancelled);
    return;
  }
  if (p->len == 0) {
    queue_fin(p->rdv_id);
    if (auto s = p->stream.lock()) {
      std::lock_guard<std::mutex> g(s->mu);
      p->complete = true;
      s->notify_locked();
    }
    return;
  }
  post_reads(p);
}

void Connection::post_reads(const std::shared_ptr<Pull>& p) {
  // A fabric whose reads complete here (shm's copies) rings the engine's own doorbell,
  // which names no connection: the progress thread finds the completions only on a
  // hot one.
  engine_->heat(this);
  while (p->inflight < cfg_.reads_in_flight && p->next_off < p->len) {
    const size_t n = std::min<uint64_t>(cfg_.chunk_size, p->len - p->next_off);
    const uint64_t wr = next_wr_++;
    const uint64_t off = p->next_off;
    reads_[wr] = Read{p, n};
    reads_out_.fetch_add(1, std::memory_order_relaxed);
    ++p->inflight;
    p->next_off += n;
    if (off > std::numeric_limits<uint64_t>::max() - p->src.addr ||
        !fabric_->read(p->dst.data() + off, RemoteRef{p->src.addr + off, p->src.key}, n, wr)) {
      reads_.erase(wr);
      reads_out_.fetch_sub(1, std::memory_order_relaxed);
      protocol_error("RTS announces memory outside the peer's pool");
      return;
    }
  }
}

void Connection::on_read_done(uint64_t wr_id) {
  auto it = reads_.find(wr_id);
  if (it == reads_.end()) {
    if (Probes* probes = probes_.get()) probes->read_done(wr_id);
    return;
  }
  Read rd = std::move(it->second);
  reads_.erase(it);
  reads_out_.fetch_sub(1, std::memory_order_relaxed);
  auto& p = rd.pull;
  --p->inflight;
  p->done += rd.len;
  TransportCounters::add(counters_.rendezvous_bytes_received, rd.len);
  fail_point(FailPoint::kPull);
  if (!alive()) return;
  if (p->next_off < p->len) {
    post_reads(p);
    return;
  }
  if (p->inflight > 0) return;
  queue_fin(p->rdv_id);
  if (auto s = p->stream.lock()) {
    std::lock_guard<std::mutex> g(s->mu);
    if (!p->orphaned) {
      p->complete = true;
      s->notify_locked();
    }
  }
}

void Connection::start_queued_pulls() {
  if (!pullq_queued_.load(std::memory_order_acquire)) return;
  std::vector<std::shared_ptr<Pull>> q;
  {
    std::lock_guard<std::mutex> g(pullq_mu_);
    pullq_queued_.store(false, std::memory_order_relaxed);
    q.swap(pullq_);
  }
  for (auto& p : q) start_pull(p);
}

void Connection::queue_fin(uint64_t rdv_id) {
  std::vector<uint8_t> b;
  Writer(&b).u64(rdv_id);
  queue_ctrl(kFin, 0, b);
}

}  // namespace argrpc
