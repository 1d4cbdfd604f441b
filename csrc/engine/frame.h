// The v1 wire format. A batch is what one write-with-immediate carries: frames back to
// back, each a 16-byte header plus payload padded to 8 bytes. Everything read from the
// peer goes through Reader, which never reads past its end; a frame that does not
// parse closes the connection.
#pragma once
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace argrpc {

enum FrameType : uint8_t {
  kHeaders = 1,    // c->s: timeout, method, metadata; s->c: initial metadata
  kMessage = 2,    // inline (eager) message bytes
  kRts = 3,        // rendezvous: rdv id, length, remote address, key
  kFin = 4,        // rendezvous done: the sender may free the block
  kHalfClose = 5,  // client sends no more messages
  kTrailers = 6,   // status, details, trailing metadata; ends the stream
  kRst = 7,        // abort the stream with a status
  kWindow = 8,     // stream flow control: the reader consumed N eager bytes
  kPing = 9,       // keepalive: no payload; answered by a PING flagged kPingAck
};

// PING flags. An answer is needed because a write to a dead peer does not always fail
// (Soft-RoCE sometimes never exhausts its retries) and a hung peer's NIC still ACKs.
constexpr uint8_t kPingAck = 1;

constexpr size_t kFrameHeader = 16;

// A batch's immediate: its length, a multiple of 8, with flags in the three low bits.
// kBatchRestart: the batch starts at the ring's start, the rest of the ring skipped. A
// sender whose peer has read everything starts again there, so that a call's messages
// keep to the ring's first pages: warm in both caches, and on shared memory the rest of
// the ring is never faulted in (an idle connection holds a page or two, and no call
// pays a page fault once the first pages are in).
constexpr uint32_t kBatchRestart = 1;
constexpr uint32_t kBatchFlags = 7;

constexpr size_t kMaxMetadataEntries = 4096;

using Metadata = std::vector<std::pair<std::string, std::string>>;

inline size_t pad8(size_t n) { return (n + 7) & ~size_t(7); }

struct FrameHead {
  uint8_t type;
  uint8_t flags;
  uint16_t reserved;
  uint32_t len;
  uint64_t stream;
};
static_assert(sizeof(FrameHead) == kFrameHeader, "frame header is 16 bytes");

// Where a writer puts its bytes: at the end of a vector, which grows for each field, or
// into room already made for a whole frame (the send path knows a frame's length before
// it writes it, and grows its batch once).
class AppendTo {
 public:
  AppendTo(std::vector<uint8_t>* out) : out_(out) {}  // NOLINT: Writer(&bytes) reads well
  void put(const void* p, size_t n) {
    if (!n) return;
    const size_t at = out_->size();
    out_->resize(at + n);
    std::memcpy(out_->data() + at, p, n);
  }

 private:
  std::vector<uint8_t>* out_;
};

class WriteAt {
 public:
  WriteAt(uint8_t* at, size_t room) : at_(at), end_(at + room) {}
  void put(const void* p, size_t n) {
    assert(n <= size_t(end_ - at_) && "a frame's fields outgrew the length it declared");
    std::memcpy(at_, p, n);
    at_ += n;
  }

 private:
  uint8_t* at_;
  uint8_t* end_;
};

// Little-endian fields (all supported targets are little-endian).
template <class Out>
class BasicWriter {
 public:
  explicit BasicWriter(Out out) : out_(out) {}
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void i64(int64_t v) { raw(&v, 8); }
  void str(const std::string& s) { u32(static_cast<uint32_t>(s.size())); raw(s.data(), s.size()); }
  void metadata(const Metadata& md) {
    u32(static_cast<uint32_t>(md.size()));
    for (auto& kv : md) { str(kv.first); str(kv.second); }
  }
  void raw(const void* p, size_t n) { out_.put(p, n); }

 private:
  Out out_;
};
using Writer = BasicWriter<AppendTo>;
using FrameWriter = BasicWriter<WriteAt>;

inline size_t str_size(const std::string& s) { return 4 + s.size(); }
inline size_t metadata_size(const Metadata& md) {
  size_t n = 4;
  for (auto& kv : md) n += str_size(kv.first) + str_size(kv.second);
  return n;
}

// An empty metadata list, where a frame must carry one.
inline const Metadata kNoMetadata;

// The body of TRAILERS (with `md`) or RST (md == nullptr: an RST has none): its size,
// written in place, or as a vector of its own.
inline size_t status_body_size(const std::string& details, const Metadata* md) {
  return 4 + str_size(details) + (md ? metadata_size(*md) : 0);
}
template <class W>
void write_status_body(W& w, uint32_t code, const std::string& details, const Metadata* md) {
  w.u32(code);
  w.str(details);
  if (md) w.metadata(*md);
}
inline std::vector<uint8_t> status_body(uint32_t code, const std::string& details,
                                        const Metadata* md) {
  std::vector<uint8_t> b;
  b.reserve(status_body_size(details, md));
  Writer w(&b);
  write_status_body(w, code, details, md);
  return b;
}

// Bounds-checked cursor over peer bytes. After any failed read ok() is false and every
// later read returns zero values.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool ok() const { return ok_; }
  bool done() const { return off_ == n_; }
  uint32_t u32() { uint32_t v = 0; raw(&v, 4); return v; }
  uint64_t u64() { uint64_t v = 0; raw(&v, 8); return v; }
  int64_t i64() { int64_t v = 0; raw(&v, 8); return v; }
  bool str(std::string* s) {
    uint32_t len = u32();
    if (!ok_ || len > n_ - off_) return fail();
    s->assign(reinterpret_cast<const char*>(p_ + off_), len);
    off_ += len;
    return true;
  }
  bool metadata(Metadata* md) {
    uint32_t count = u32();
    if (!ok_ || count > kMaxMetadataEntries || count > (n_ - off_) / 8) return fail();
    md->resize(count);
    for (auto& kv : *md)
      if (!str(&kv.first) || !str(&kv.second)) return false;
    return true;
  }

 private:
  bool fail() { ok_ = false; return false; }
  void raw(void* v, size_t k) {
    if (!ok_ || k > n_ - off_) { fail(); return; }
    std::memcpy(v, p_ + off_, k);
    off_ += k;
  }
  const uint8_t* p_;
  size_t n_, off_ = 0;
  bool ok_ = true;
};

struct RtsBody {
  uint64_t rdv_id, length, addr;
  uint32_t key;
};

}  // namespace argrpc
