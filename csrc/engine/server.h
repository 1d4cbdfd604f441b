// The server side of the engine: calls arriving on every connection attached to this
// server wait here for a worker. Workers are the user's thread-pool threads looping in
// accept(); one of them at a time spins (polling the fabric), the others sleep, so a
// new call is picked up by an already-running thread with no hand-off.
#pragma once
#include <atomic>
#include <condition_variable>
#include <string>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common/clock.h"

namespace argrpc {

class Engine;
class Stream;

class Server {
 public:
  explicit Server(std::shared_ptr<Engine> engine);

  std::shared_ptr<Stream> accept(const Deadline& dl);
  void wakeup(int n);
  std::shared_ptr<Stream> next_cancelled(const Deadline& dl);
  void shutdown();
  bool is_shutdown();
  void cancel_all(uint32_t code, const std::string& details);
  int active();

  // From connections.
  bool enqueue(const std::shared_ptr<Stream>& s);
  void report_cancelled(const std::shared_ptr<Stream>& s);
  void remove_active(const Stream* s);

 private:
  std::shared_ptr<Engine> engine_;
  std::mutex mu_;
  std::condition_variable cv_, cancelled_cv_;
  std::deque<std::shared_ptr<Stream>> pending_, cancelled_;
  std::unordered_map<const Stream*, std::weak_ptr<Stream>> active_;
  std::atomic<size_t> pending_count_{0};
  std::atomic<int> wakeup_count_{0};
  int sleepers_ = 0, wakeups_ = 0;
  bool spinner_ = false, shutdown_ = false;
};

}  // namespace argrpc
