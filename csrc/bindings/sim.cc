// Test-only: two connections of one engine over the in-process test fabric, the server
// end attached to a _core.Server, with a fault plan; and the link, to read what the
// fabric injected and to silence a side while calls run. Names start with "_": the
// facade never uses them.
#include <string>

#include "bindings/bindings.h"

#include "common/error.h"
#include "engine/engine.h"
#include "fabric/sim/sim_fabric.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

constexpr const char* kSides[2] = {"client", "server"};

struct PySimLink {
  std::shared_ptr<SimLink> link;
};

int side_arg(const std::string& side) {
  for (int i = 0; i < 2; ++i)
    if (side == kSides[i]) return i;
  throw py::value_error("side must be 'client' or 'server', not '" + side + "'");
}

// Takes `key` out of `d`, so that what is left once every known key is taken is a
// misspelt fault that would otherwise silently not be injected.
template <class T>
T take(py::dict& d, const char* key, T dflt) {
  if (!d.contains(key)) return dflt;
  T v = d[key].cast<T>();
  PyDict_DelItemString(d.ptr(), key);
  return v;
}

void refuse_rest(const py::dict& d, const std::string& what) {
  if (d.empty()) return;
  std::string keys;
  for (auto kv : d) keys += (keys.empty() ? "" : ", ") + py::str(kv.first).cast<std::string>();
  throw py::value_error("unknown " + what + ": " + keys);
}

py::dict copy_of(const py::handle& d) {
  py::dict out;
  for (auto kv : py::reinterpret_borrow<py::dict>(d)) out[kv.first] = kv.second;
  return out;
}

SimFaults faults_arg(py::dict d, const char* side) {
  SimFaults f;
  f.delay_polls = take<uint32_t>(d, "delay_polls", f.delay_polls);
  f.delay_jitter = take<bool>(d, "delay_jitter", f.delay_jitter);
  f.hold_recv = take<uint64_t>(d, "hold_recv", f.hold_recv);
  f.hold_read = take<uint64_t>(d, "hold_read", f.hold_read);
  f.hold_polls = take<uint32_t>(d, "hold_polls", f.hold_polls);
  f.reorder_reads = take<bool>(d, "reorder_reads", f.reorder_reads);
  f.read_us = take<uint32_t>(d, "read_us", f.read_us);
  f.fail_write = take<uint64_t>(d, "fail_write", f.fail_write);
  f.fail_read = take<uint64_t>(d, "fail_read", f.fail_read);
  const std::string mode = take<std::string>(d, "fail_mode", "error");
  if (mode != "error" && mode != "refuse")
    throw py::value_error("fail_mode must be 'error' or 'refuse', not '" + mode + "'");
  f.fail_refuse = mode == "refuse";
  f.fail_reason = take<std::string>(d, "fail_reason", f.fail_reason);
  f.drop_after_writes = take<int64_t>(d, "drop_after_writes", f.drop_after_writes);
  refuse_rest(d, std::string("sim fault for the ") + side);
  return f;
}

SimPlan plan_arg(const py::dict& plan) {
  py::dict d = copy_of(plan);
  SimPlan p;
  p.seed = take<uint64_t>(d, "seed", p.seed);
  p.lazy_credits = take<bool>(d, "lazy_credits", p.lazy_credits);
  p.nudge = take<bool>(d, "nudge", p.nudge);
  for (int i = 0; i < 2; ++i)
    if (d.contains(kSides[i])) p.side[i] = faults_arg(copy_of(take<py::dict>(d, kSides[i], py::dict())), kSides[i]);
  refuse_rest(d, "sim plan key (seed, lazy_credits, nudge, client, server)");
  return p;
}

py::dict counters_dict(const SimCounters& c) {
  py::dict d;
  d["writes"] = c.writes;
  d["reads"] = c.reads;
  d["completions"] = c.completions;
  d["delayed"] = c.delayed;
  d["reordered"] = c.reordered;
  d["failed_writes"] = c.failed_writes;
  d["failed_reads"] = c.failed_reads;
  d["flushed"] = c.flushed;
  d["dropped_writes"] = c.dropped_writes;
  d["dropped_reads"] = c.dropped_reads;
  d["refused_reads"] = c.refused_reads;
  d["exposed"] = c.exposed;
  d["credit_returns"] = c.credit_returns;
  d["batches_read"] = c.batches_read;
  d["nudges"] = c.nudges;
  return d;
}

}  // namespace

void add_sim(py::module_& m) {
  py::class_<PySimLink>(m, "_SimLink")
      .def("counters", [](PySimLink& l) {
        py::dict d;
        for (int i = 0; i < 2; ++i) d[kSides[i]] = counters_dict(l.link->counters(i));
        return d;
      })
      .def("drop", [](PySimLink& l, const std::string& side) { l.link->silence(side_arg(side)); },
           py::arg("side"));

  m.def("_sim_pair",
        [](PyEngine& engine, py::object server, py::dict plan, py::dict conn_dict,
           py::object server_engine) {
          const std::shared_ptr<Engine> eng = engine.engine;
          // The served side may live in an engine of its own, as a peer process would:
          // its progress thread then never stands in for the client's.
          const std::shared_ptr<Engine> srv_eng =
              server_engine.is_none() ? eng : std::shared_ptr<Engine>(server_engine.cast<PyEngine&>().engine);
          if (server.is_none()) throw py::value_error("_sim_pair needs the Server its calls go to");
          const std::shared_ptr<Server> srv = server_arg(server);
          ConnConfig cfg = conn_config(conn_dict);
          // Not knobs of the facade (its keepalive is fixed), but a test of a dead peer
          // would otherwise wait the default 10 s for it.
          py::dict rest = copy_of(conn_dict);
          cfg.keepalive_ms = take<uint32_t>(rest, "keepalive_ms", cfg.keepalive_ms);
          cfg.keepalive_timeout_ms = take<uint32_t>(rest, "keepalive_timeout_ms", cfg.keepalive_timeout_ms);
          if (cfg.keepalive_ms == 0 || cfg.keepalive_timeout_ms == 0)
            throw CoreError("keepalive_ms and keepalive_timeout_ms must be > 0");
          SimPair pair = SimFabric::pair(cfg, cfg, plan_arg(plan));
          auto client = eng->attach(std::move(pair.a), cfg, nullptr, PeerInfo("sim:server"));
          auto served = srv_eng->attach(std::move(pair.b), cfg, srv, PeerInfo("sim:client"));
          return py::make_tuple(PyConnection::make(eng, client), PyConnection::make(srv_eng, served),
                                PySimLink{pair.link});
        },
        py::arg("engine"), py::arg("server"), py::arg("plan") = py::dict(),
        py::arg("conn_config") = py::dict(), py::arg("server_engine") = py::none());
}

}  // namespace bindings
}  // namespace argrpc
