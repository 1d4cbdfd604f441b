// libFuzzer target for everything a peer controls in the receive path: batch lengths,
// frame headers, stream ids, metadata counts and string lengths, RTS addresses, keys and
// lengths, FIN ids, window credits. Built with ASan and UBSan by fuzz/run.sh.
//
// One real engine with a server connection and a client connection over the test
// fabric (fabric/sim, no faults planned): everything the peer's bytes reach is the
// engine's own code, and a pair needs no memfds or sockets. Each input is split into
// batches that the client writes raw into the server's receive ring
// (Connection::probe_raw_batch, bypassing the engine's framing), as a hostile peer
// could. The server must either accept the bytes or close the connection (a protocol
// error, or the fabric refusing a READ outside what the client exposed, as a memory
// window would); anything else (a crash, a sanitizer report, a hang) is a finding. A
// closed pair is replaced.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/server.h"
#include "engine/stream.h"
#include "fabric/sim/sim_fabric.h"
#include "pool/pool.h"

using namespace argrpc;

namespace {

struct Pair {
  std::shared_ptr<Server> server;
  std::shared_ptr<Connection> server_conn, client_conn;
};

std::shared_ptr<Engine>& engine() {
  static std::shared_ptr<Engine> e = [] {
    EngineConfig cfg;
    cfg.buf_size = 64 * MiB;
    cfg.spin_us = 0;
    cfg.malloc_tuning = false;
    return std::make_shared<Engine>(cfg);
  }();
  return e;
}

// A block every pair's client exposes before anything else, so it has the first key
// (1) and, as the process's first block, pool offset 0: an RTS that names it (the
// rts_fin seed does) is pulled for real, and the reads, chunking and FIN are fuzzed
// too, not only the refusal of a made-up reference.
constexpr size_t kBaitBytes = 256 * KiB;

const Block& bait() {
  static const Block b = [] {
    Block blk = engine()->pool()->try_alloc(kBaitBytes);
    if (!blk.valid()) std::abort();
    for (size_t i = 0; i < kBaitBytes; ++i) blk.data()[i] = uint8_t(i * 131 + 7);
    return blk;
  }();
  return b;
}

Pair make_pair() {
  auto& eng = engine();
  ConnConfig cfg;
  cfg.ring_size = 256 * KiB;  // small: wrap-around is reached quickly
  cfg.max_recv = 1 * MiB;
  SimPair sim = SimFabric::pair(cfg, cfg, SimPlan());
  sim.a->expose(bait());
  Pair p;
  p.server = std::make_shared<Server>(eng, -1);  // no concurrency limit
  p.server_conn = eng->attach(std::move(sim.b), cfg, p.server, "fuzz-client");
  p.client_conn = eng->attach(std::move(sim.a), cfg, nullptr, "fuzz-server");
  return p;
}

// Calls the batches opened: taken off the accept queue and dropped (as a server whose
// handler returned at once would), so a long run does not pile them up.
void drain(Server& server) {
  while (auto s = server.accept(Deadline::after_seconds(0))) s->conn->abandon(s);
  // The Python server's dispatcher takes these: until then they hold their calls.
  while (server.next_event(Deadline::after_seconds(0)).kind != ServerEvent::Kind::kNone) {
  }
}

void close_pair(Pair& p) {
  p.client_conn->fail(kCancelled, "fuzz: next pair");
  p.server_conn->fail(kCancelled, "fuzz: next pair");
  drain(*p.server);
  p.server->shutdown();
  // Every object of the pair must go now: a cycle would leak fds until make_pair fails.
  std::weak_ptr<Connection> s = p.server_conn, c = p.client_conn;
  p = Pair{};
  // The progress thread may hold a snapshot of the connection list for a moment.
  for (int i = 0; i < 2000 && !(s.expired() && c.expired()); ++i) ::usleep(500);
  if (!s.expired() || !c.expired()) {
    std::fprintf(stderr, "fuzz: a closed %s connection is still referenced after 1 s (leak)\n",
                 s.expired() ? "client" : "server");
    std::abort();
  }
}

Pair& pair() {
  static Pair p = make_pair();
  return p;
}

}  // namespace

// Input: [u16 length][bytes] records, each one raw batch.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Pair& p = pair();
  size_t at = 0;
  while (at + 2 <= size) {
    size_t n = size_t(data[at]) | size_t(data[at + 1]) << 8;
    at += 2;
    if (n > size - at) n = size - at;
    if (n > 0 && !p.client_conn->probe_raw_batch(data + at, n)) break;
    at += n;
    for (int i = 0; i < 4; ++i) p.server_conn->progress();
    drain(*p.server);
    if (!p.server_conn->alive()) break;
  }
  for (int i = 0; i < 4; ++i) p.server_conn->progress();
  drain(*p.server);
  if (!p.server_conn->alive() || !p.client_conn->alive()) {
    close_pair(p);
    p = make_pair();
  }
  return 0;
}
