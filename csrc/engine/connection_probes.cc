// Connection's side of the test probes (see probes.h): each acts as a hostile peer
// would, through the connection's own locks, so a test sees what a real one would cause.
#include <chrono>
#include <string>
#include <thread>

#include "common/clock.h"
#include "engine/connection.h"

namespace argrpc {

RemoteRef Connection::probe_last_rts(uint64_t* len) { return probes_.enable().last_rts(len); }

bool Connection::probe_raw_batch(const uint8_t* p, size_t len) {
  std::lock_guard<std::mutex> lk(send_mu_);
  if (!alive() || len == 0 || len > fabric_->peer_ring_size() / 2) return false;
  if (!flush_locked()) return false;  // what honest senders queued goes first
  batch_.assign(p, p + len);
  return flush_locked();
}

std::string Connection::probe_read(const RemoteRef& src, size_t len, double timeout) {
  Probes& probes = probes_.enable();
  uint64_t wr;
  {
    // next_wr_ and the fabric's reads belong to the poll lock's holder.
    std::lock_guard<std::mutex> g(poll_mu_);
    if (!alive()) return error();
    wr = next_wr_++;
    uint8_t* dst = probes.start_read(wr, len);
    if (!fabric_->read(dst, src, len, wr)) return "refused locally: outside the peer's pool";
  }
  const Deadline dl = Deadline::after_seconds(timeout);
  while (!dl.expired()) {
    progress();
    if (probes.take_done(wr)) return "";
    if (!alive()) return error();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return "timed out";
}

}  // namespace argrpc
