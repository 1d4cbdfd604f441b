#include "engine/probes.h"

namespace argrpc {

void Probes::record_rts(const RemoteRef& src, uint64_t len) {
  std::lock_guard<std::mutex> g(mu_);
  last_rts_ = src;
  last_rts_len_ = len;
}

RemoteRef Probes::last_rts(uint64_t* len) {
  std::lock_guard<std::mutex> g(mu_);
  *len = last_rts_len_;
  return last_rts_;
}

uint8_t* Probes::start_read(uint64_t wr_id, size_t len) {
  std::lock_guard<std::mutex> g(mu_);
  bufs_.emplace_back(new uint8_t[len ? len : 1]);
  reads_.insert(wr_id);
  return bufs_.back().get();
}

void Probes::read_done(uint64_t wr_id) {
  std::lock_guard<std::mutex> g(mu_);
  if (reads_.erase(wr_id)) done_.insert(wr_id);
}

bool Probes::take_done(uint64_t wr_id) {
  std::lock_guard<std::mutex> g(mu_);
  return done_.erase(wr_id) > 0;
}

Probes& ProbeSlot::enable() {
  if (Probes* p = get()) return *p;
  auto fresh = std::make_unique<Probes>();
  Probes* seen = nullptr;
  if (ptr_.compare_exchange_strong(seen, fresh.get(), std::memory_order_acq_rel))
    return *fresh.release();
  return *seen;  // another thread made them first
}

}  // namespace argrpc
