#include "engine/polling_lease.h"

#include <memory>

#include "common/fork.h"
#include "engine/engine.h"
#include "engine/server.h"

namespace argrpc::polling_lease {

namespace {

struct ThreadLease {
  // Owned: the thread may outlive every other handle on the engine.
  std::shared_ptr<Engine> held;
  std::shared_ptr<Server> server;
  uint64_t held_generation = 0;
  const Stream* serving_stream = nullptr;

  void release() {
    if (!held) return;
    std::shared_ptr<Engine> e = std::move(held);
    std::shared_ptr<Server> sv = std::move(server);
    // A forked child's copy of the parent's engine is never touched (common/fork.h).
    if (held_generation != fork_generation()) {
      keep_forever(std::move(sv));
      return keep_forever(std::move(e));
    }
    e->end_lease();
    if (sv) sv->lease_returned();
  }
  ~ThreadLease() { release(); }
};

thread_local ThreadLease t_lease;

}  // namespace

void serving(const Stream* s) {
  t_lease.release();
  t_lease.serving_stream = s;
}

void finishing(Engine* engine, const std::shared_ptr<Server>& server, const Stream* s) {
  if (t_lease.serving_stream != s) return;
  t_lease.serving_stream = nullptr;
  if (t_lease.held.get() == engine) return;
  t_lease.release();
  if (!engine->begin_lease()) return;
  t_lease.held = engine->shared_from_this();
  t_lease.held_generation = fork_generation();
  if (server) {
    server->lease_taken();
    t_lease.server = server;
  }
}

bool held() { return t_lease.held != nullptr; }

void drop() {
  t_lease.serving_stream = nullptr;
  t_lease.release();
}

}  // namespace argrpc::polling_lease
