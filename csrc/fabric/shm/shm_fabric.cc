#include "fabric/shm/shm_fabric.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstring>

#include "common/error.h"
#include "common/knob_check.h"
#include "pool/copier.h"
#include "pool/pool.h"

namespace argrpc {

namespace {
constexpr uint64_t kMagic = 0x31767473616d6873ULL;  // "shmastv1"
constexpr uint32_t kVersion = 3;  // 2: the doorbell is the socket; 3: a batch may restart the ring
constexpr size_t kHeaderBytes = 4096;
}  // namespace

// Lives at offset 0 of each side's segment. The peer maps it read-write, so the owner
// reads nothing from it but cq_head (bounded before use); everything else the owner
// needs it keeps in its own memory.
struct ShmHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t cq_slots;
  uint64_t ring_size;
  uint64_t stream_window;
  uint64_t cq_offset;
  uint64_t ring_offset;
  alignas(64) std::atomic<uint64_t> cq_head;          // written by the peer
  alignas(64) std::atomic<uint64_t> consumed_bytes;   // written by the owner
  std::atomic<uint64_t> consumed_batches;
  alignas(64) std::atomic<uint32_t> armed;            // owner sleeps: ring the doorbell
};
static_assert(sizeof(ShmHeader) <= kHeaderBytes, "header must fit its page");

static size_t segment_bytes(size_t ring, uint32_t slots) {
  return kHeaderBytes + round_up(size_t(slots) * sizeof(uint32_t), kPageSize) + ring;
}

static UniqueFd sealed_memfd(const char* name, size_t size) {
  UniqueFd fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) throw CoreError(errno_text("memfd_create(ring)"));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0)
    throw CoreError(errno_text("ftruncate(ring)"));
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    throw CoreError(errno_text("sealing the ring memfd"));
  return fd;
}

// A peer-supplied memfd must be sealed against shrinking (else it could SIGBUS us) and
// exactly as big as declared.
static void check_peer_memfd(int fd, size_t expect, const char* what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw CoreError(errno_text(std::string("fstat(peer ") + what + ")"));
  if (!S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != expect)
    throw CoreError(std::string("peer ") + what + " has size " + std::to_string(st.st_size) +
                    ", declared " + std::to_string(expect));
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    throw CoreError(std::string("peer ") + what + " is not a memfd sealed against shrinking");
}

// The peer's doorbell: one byte on the connection's socket. Never blocks: a full socket
// buffer means wake-ups are pending already.
static void ring_peer(int sock) {
  const char one = 1;
  ssize_t r = ::send(sock, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  (void)r;
}

// This process's progress thread's eventfd (a full counter means a wake-up is pending).
static void ring_eventfd(int event_fd) {
  uint64_t one = 1;
  ssize_t r = ::write(event_fd, &one, sizeof one);
  (void)r;
}

std::unique_ptr<ShmEndpoint> ShmEndpoint::create(const ConnConfig& cfg) {
  auto ep = std::unique_ptr<ShmEndpoint>(new ShmEndpoint());
  ep->ring_size_ = cfg.ring_size;
  ep->slots_ = cfg.cq_slots;
  const size_t bytes = segment_bytes(cfg.ring_size, cfg.cq_slots);
  ep->seg_fd_ = sealed_memfd("argrpc-ring", bytes);
  // Not populated: the peer faults a ring page in when it first writes there, so an idle
  // connection costs the pages it used, not the whole ring (the header page is touched
  // here).
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ep->seg_fd_.get(), 0);
  if (p == MAP_FAILED) throw CoreError(errno_text("mmap(ring)"));
  ep->seg_ = Mapping(p, bytes);
  auto* h = new (p) ShmHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->cq_slots = cfg.cq_slots;
  h->ring_size = cfg.ring_size;
  h->stream_window = cfg.stream_window;
  h->cq_offset = kHeaderBytes;
  h->ring_offset = bytes - cfg.ring_size;
  h->armed.store(1);
  return ep;
}

ShmFabric::ShmFabric(std::unique_ptr<ShmEndpoint> local, ShmPeer peer, UniqueFd sock,
                     std::shared_ptr<Pool> pool, Copier* copier, int own_wake_fd)
    : local_(std::move(local)),
      local_hdr_(reinterpret_cast<ShmHeader*>(local_->seg_.data())),
      sock_(std::move(sock)),
      own_wake_fd_(own_wake_fd),
      pool_(std::move(pool)),
      copier_(copier) {
  if (!in_bounds(knobs::kRingSize, int64_t(peer.ring_size)) || !power_of_two(peer.ring_size))
    throw CoreError("peer ring size " + std::to_string(peer.ring_size) + " is not a power of two in " +
                    bounds_text(knobs::kRingSize));
  struct stat st;
  if (::fstat(peer.ring_fd.get(), &st) != 0) throw CoreError(errno_text("fstat(peer ring)"));
  const size_t seg_bytes = static_cast<size_t>(st.st_size);
  check_peer_memfd(peer.ring_fd.get(), seg_bytes, "ring segment");
  if (seg_bytes < kHeaderBytes + peer.ring_size) throw CoreError("peer ring segment too small");
  void* p = ::mmap(nullptr, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, peer.ring_fd.get(), 0);
  if (p == MAP_FAILED) throw CoreError(errno_text("mmap(peer ring)"));
  peer_seg_ = Mapping(p, seg_bytes);
  peer_hdr_ = reinterpret_cast<ShmHeader*>(p);
  // Copy the layout out once and check it against the mapping; later edits by the
  // peer to these fields are never read.
  const ShmHeader& h = *peer_hdr_;
  const uint64_t slots = h.cq_slots, ring = h.ring_size, cq_off = h.cq_offset,
                 ring_off = h.ring_offset, window = h.stream_window;
  if (h.magic != kMagic || h.version != kVersion) throw CoreError("peer ring has a wrong magic/version");
  if (ring != peer.ring_size) throw CoreError("peer ring size differs from the handshake");
  if (slots < 16 || slots > (1u << 20)) throw CoreError("peer completion queue size out of range");
  if (cq_off < sizeof(ShmHeader) || cq_off + slots * 4 > ring_off || ring_off + ring > seg_bytes)
    throw CoreError("peer ring layout is outside its segment");
  if (!in_bounds(knobs::kStreamWindow, int64_t(window)))
    throw CoreError("peer stream window " + std::to_string(window) + " is outside " +
                    bounds_text(knobs::kStreamWindow));
  peer_ring_ = peer_seg_.data() + ring_off;
  peer_cq_ = reinterpret_cast<uint32_t*>(peer_seg_.data() + cq_off);
  peer_ring_size_ = ring;
  peer_slots_ = static_cast<uint32_t>(slots);
  peer_window_ = window;
  sent_batches_ = peer_hdr_->cq_head.load(std::memory_order_acquire);
  if (sent_batches_ != 0) throw CoreError("peer ring is not fresh");

  check_peer_memfd(peer.pool_fd.get(), peer.pool_size, "pool");
  // Read-only: the peer's pool is the source of rendezvous reads, never a target.
  void* pp = ::mmap(nullptr, peer.pool_size, PROT_READ, MAP_SHARED | MAP_NORESERVE,
                    peer.pool_fd.get(), 0);
  if (pp == MAP_FAILED) throw CoreError(errno_text("mmap(peer pool)"));
  peer_pool_ = Mapping(pp, peer.pool_size);
  // The peer has its copy (sent in the handshake) and both are mapped: the descriptors
  // would only count against the fd limit from here on.
  local_->seg_fd_.reset();
}

ShmFabric::~ShmFabric() { shutdown(); }

const uint8_t* ShmFabric::ring() const {
  return local_->seg_.data() + (local_->seg_.size() - local_->ring_size_);
}

bool ShmFabric::write_imm(const void* src, uint32_t len, size_t remote_off, uint32_t imm) {
  if (shut_.load(std::memory_order_relaxed)) return false;
  if (remote_off + len > peer_ring_size_) return false;
  std::memcpy(peer_ring_ + remote_off, src, len);
  peer_cq_[sent_batches_ % peer_slots_] = imm;
  ++sent_batches_;
  // seq_cst store then seq_cst load of `armed`: pairs with arm() (store armed, load
  // head) so either we see the owner asleep or the owner sees our batch.
  peer_hdr_->cq_head.store(sent_batches_, std::memory_order_seq_cst);
  if (peer_hdr_->armed.load(std::memory_order_seq_cst) &&
      peer_hdr_->armed.exchange(0, std::memory_order_seq_cst)) {
    ring_peer(sock_.get());
  }
  return true;
}

RemoteRef ShmFabric::expose(const Block& b) {
  return RemoteRef{static_cast<uint64_t>(b.offset()), 0};
}

bool ShmFabric::read(void* dst, const RemoteRef& src, size_t len, uint64_t wr_id) {
  if (src.key != 0 || src.addr > peer_pool_.size() || len > peer_pool_.size() - src.addr)
    return false;
  copier_->copy(dst, peer_pool_.data() + src.addr, len);
  {
    std::lock_guard<std::mutex> g(local_mu_);
    local_done_.push_back(wr_id);
  }
  local_pending_.store(true, std::memory_order_seq_cst);
  ring_own_doorbell_if_armed();
  return true;
}

const uint8_t* ShmFabric::peer_view(const RemoteRef& src, size_t len) const {
  if (src.key != 0 || src.addr > peer_pool_.size() || len > peer_pool_.size() - src.addr)
    return nullptr;
  return peer_pool_.data() + src.addr;
}

void ShmFabric::ring_own_doorbell_if_armed() {
  if (own_wake_fd_ >= 0 && local_hdr_->armed.load(std::memory_order_seq_cst) &&
      local_hdr_->armed.exchange(0, std::memory_order_seq_cst)) {
    ring_eventfd(own_wake_fd_);
  }
}

void ShmFabric::nudge() {
  if (shut_.load(std::memory_order_relaxed)) return;
  // Asleep (armed): the write that is unread rang it. Everything read: nothing held back.
  if (peer_hdr_->armed.load(std::memory_order_seq_cst)) return;
  if (peer_hdr_->consumed_batches.load(std::memory_order_acquire) ==
      peer_hdr_->cq_head.load(std::memory_order_seq_cst))
    return;
  ring_peer(sock_.get());
}

void ShmFabric::publish_consumed(uint64_t bytes, uint64_t batches) {
  local_hdr_->consumed_bytes.store(bytes, std::memory_order_release);
  local_hdr_->consumed_batches.store(batches, std::memory_order_release);
}

void ShmFabric::peer_consumed(uint64_t* bytes, uint64_t* batches) const {
  *batches = peer_hdr_->consumed_batches.load(std::memory_order_acquire);
  *bytes = peer_hdr_->consumed_bytes.load(std::memory_order_acquire);
}

int ShmFabric::poll(Completion* out, int max) {
  int n = 0;
  if (local_pending_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(local_mu_);
    size_t i = 0;
    for (; i < local_done_.size() && n < max; ++i) {
      out[n].kind = Completion::kReadDone;
      out[n].wr_id = local_done_[i];
      out[n].len = 0;
      ++n;
    }
    local_done_.erase(local_done_.begin(), local_done_.begin() + static_cast<long>(i));
    local_pending_.store(!local_done_.empty(), std::memory_order_release);
  }
  const uint64_t head = local_hdr_->cq_head.load(std::memory_order_acquire);
  if (head - cq_tail_ > local_->slots_) {
    if (error_.empty()) error_ = "peer overran the completion queue";
    out[n].kind = Completion::kError;
    return n + 1 <= max ? n + 1 : n;
  }
  const uint32_t* cq = reinterpret_cast<const uint32_t*>(local_->seg_.data() + kHeaderBytes);
  while (cq_tail_ != head && n < max) {
    out[n].kind = Completion::kRecv;
    out[n].len = cq[cq_tail_ % local_->slots_];
    out[n].wr_id = 0;
    ++cq_tail_;
    ++n;
  }
  return n;
}

bool ShmFabric::arm() {
  local_hdr_->armed.store(1, std::memory_order_seq_cst);
  if (local_hdr_->cq_head.load(std::memory_order_seq_cst) != cq_tail_ ||
      local_pending_.load(std::memory_order_seq_cst)) {
    local_hdr_->armed.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void ShmFabric::disarm() { local_hdr_->armed.store(0, std::memory_order_relaxed); }

void ShmFabric::ack_wakeup() {
  // Every doorbell byte the peer sent: each meant "look", once is enough. A bounded
  // drain: a peer that keeps ringing cannot hold this thread here.
  char bytes[256];
  for (int i = 0; i < 16; ++i)
    if (::recv(sock_.get(), bytes, sizeof bytes, MSG_DONTWAIT) < ssize_t(sizeof bytes)) break;
}

void ShmFabric::shutdown() {
  if (shut_.exchange(true)) return;
  if (sock_.valid()) ::shutdown(sock_.get(), SHUT_RDWR);
}

bool ShmFabric::peer_gone() const {
  if (!sock_.valid()) return true;
  pollfd p{sock_.get(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

std::string ShmFabric::error() const { return error_; }

}  // namespace argrpc
