// A first-in, first-out queue on one vector, for a stream's inbox. A std::deque
// allocates its map and a first node as it is made, two allocations for every stream
// even when nothing comes; this allocates at its first push, and reuses the vector's
// room once it has been emptied.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

namespace argrpc {

template <class T>
class Fifo {
 public:
  using iterator = typename std::vector<T>::iterator;
  using const_iterator = typename std::vector<T>::const_iterator;

  bool empty() const { return head_ == items_.size(); }
  size_t size() const { return items_.size() - head_; }
  T& front() { return items_[head_]; }
  const T& front() const { return items_[head_]; }
  void push_back(T&& v) { items_.push_back(std::move(v)); }
  void pop_front() {
    items_[head_] = T();  // what it held goes now, not when the room is reused
    if (++head_ == items_.size()) {
      clear();
    } else if (head_ >= kCompactAt && head_ * 2 >= items_.size()) {
      // A queue never emptied (a long stream read behind its sender) drops its
      // consumed front now and then: each element moves at most once per halving.
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }
  void clear() {
    items_.clear();
    head_ = 0;
  }
  // [first, last) among the queued ones.
  void erase(iterator first, iterator last) {
    items_.erase(first, last);
    if (empty()) clear();
  }
  iterator begin() { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  const_iterator end() const { return items_.end(); }

 private:
  static constexpr size_t kCompactAt = 32;
  std::vector<T> items_;
  size_t head_ = 0;
};

}  // namespace argrpc
