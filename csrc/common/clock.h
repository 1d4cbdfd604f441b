// Deadlines on the monotonic clock. A default Deadline never expires.
#pragma once
#include <chrono>
#include <cstdint>
#include <limits>

namespace argrpc {
using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  Deadline() : at_(Clock::time_point::max()) {}
  static Deadline never() { return Deadline(); }
  static Deadline after_seconds(double s) {
    Deadline d;
    if (!(s >= 0)) s = 0;  // NaN too: grpc ends such a call at once
    if (s < 1e9) d.at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(s));
    return d;
  }
  bool infinite() const { return at_ == Clock::time_point::max(); }
  bool expired() const { return !infinite() && Clock::now() >= at_; }
  double remaining_seconds() const {
    if (infinite()) return std::numeric_limits<double>::infinity();
    return std::chrono::duration<double>(at_ - Clock::now()).count();
  }
  Clock::time_point at() const { return at_; }
  // On now_us()'s scale, rounded up (a wake-up at this time finds it expired);
  // UINT64_MAX if it never expires.
  uint64_t at_us() const {
    if (infinite()) return std::numeric_limits<uint64_t>::max();
    return std::chrono::ceil<std::chrono::microseconds>(at_.time_since_epoch()).count();
  }
  Deadline earlier(const Deadline& o) const { return o.at_ < at_ ? o : *this; }

 private:
  Clock::time_point at_;
};

inline uint64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             Clock::now().time_since_epoch()).count();
}
}  // namespace argrpc
