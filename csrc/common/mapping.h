// RAII owner of an mmap'ed region.
#pragma once
#include <sys/mman.h>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace argrpc {
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* p, size_t n) : p_(static_cast<uint8_t*>(p)), n_(n) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) { reset(); p_ = std::exchange(o.p_, nullptr); n_ = std::exchange(o.n_, 0); }
    return *this;
  }
  ~Mapping() { reset(); }
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  void reset() {
    if (p_) ::munmap(p_, n_);
    p_ = nullptr;
    n_ = 0;
  }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};
}  // namespace argrpc
