#include "bench/floor_link.h"

#include <poll.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/clock.h"
#include "common/error.h"
#include "common/spin.h"

namespace argrpc {

namespace {
// A sleeping wait wakes this often to look at the peer and the deadline.
constexpr int kSleepSliceMs = 100;

[[noreturn]] void gone(const Fabric& f, const char* during) {
  const std::string why = f.error();
  throw CoreError(std::string("floor link: the peer is gone during ") + during +
                  (why.empty() ? "" : ": " + why));
}
}  // namespace

FloorLink::FloorLink(std::unique_ptr<Fabric> fabric, int spin_us)
    : fabric_(std::move(fabric)), spin_us_(spin_us) {}

FloorLink::~FloorLink() { fabric_->shutdown(); }

size_t FloorLink::max_message() const { return fabric_->peer_ring_size(); }

bool FloorLink::poll_once() {
  Completion c[8];
  const int n = fabric_->poll(c, 8);
  for (int i = 0; i < n; ++i) {
    if (c[i].kind == Completion::kError) gone(*fabric_, "a poll");
    if (c[i].kind != Completion::kRecv) continue;
    if (pending_) throw CoreError("floor link: the peer sent a message before its answer");
    pending_ = true;
    pending_len_ = c[i].len;
  }
  return pending_;
}

void FloorLink::block(int timeout_ms) {
  if (!fabric_->arm()) return;  // something arrived between the last poll and arming
  pollfd fds[2] = {{fabric_->wait_fd(), POLLIN, 0}, {fabric_->liveness_fd(), POLLRDHUP, 0}};
  const int nfds = fds[1].fd >= 0 ? 2 : 1;
  ::poll(fds, nfds, timeout_ms);
  if (fds[0].revents & POLLIN) fabric_->ack_wakeup();
  fabric_->disarm();
}

void FloorLink::send(const void* data, size_t len, double timeout_s) {
  if (len > max_message())
    throw CoreError("floor link: a " + std::to_string(len) + " B message does not fit the " +
                    std::to_string(max_message()) + " B ring");
  const Deadline dl = Deadline::after_seconds(timeout_s);
  // In a ping-pong the answer comes after the peer read our message, so this holds at
  // once; it is checked so that misuse cannot overwrite an unread message.
  for (;;) {
    uint64_t bytes = 0, batches = 0;
    fabric_->peer_consumed(&bytes, &batches);
    if (batches == sent_) break;
    if (fabric_->peer_gone()) gone(*fabric_, "a send");
    if (dl.expired()) throw CoreError("floor link: the peer did not read the last message in time");
    sched_yield();
  }
  const auto n = static_cast<uint32_t>(len);
  if (!fabric_->write_imm(data, n, 0, n)) gone(*fabric_, "a send");
  ++sent_;
}

size_t FloorLink::recv_into(void* dst, size_t cap, double timeout_s) {
  const Deadline dl = Deadline::after_seconds(timeout_s);
  if (!poll_once()) {
    spin_until(spin_us_, dl, [&] { return pending_; }, [&] { poll_once(); });
    while (!pending_) {
      if (fabric_->peer_gone()) gone(*fabric_, "a receive");
      if (dl.expired()) throw CoreError("floor link: no message before the timeout");
      const double left_ms = dl.remaining_seconds() * 1e3;
      block(static_cast<int>(std::clamp(left_ms, 1.0, double(kSleepSliceMs))));
      poll_once();
    }
  }
  const size_t len = pending_len_;
  if (len > cap)
    throw CoreError("floor link: a " + std::to_string(len) + " B message does not fit a " +
                    std::to_string(cap) + " B buffer");
  if (len > fabric_->ring_size()) throw CoreError("floor link: the peer announced a message beyond the ring");
  std::memcpy(dst, fabric_->ring(), len);
  pending_ = false;
  consumed_bytes_ += len;
  ++consumed_batches_;
  fabric_->publish_consumed(consumed_bytes_, consumed_batches_);
  return len;
}

}  // namespace argrpc
