// Engine: the process's engine (its pool and progress thread), its statistics and
// shutdown. Each fabric's unit adds the methods that make an endpoint and attach a
// connection over it.
#include <pybind11/pybind11.h>

#include <memory>

#include "bindings/bindings.h"
#include "engine/engine.h"
#include "pool/pool.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

py::class_<PyEngine> add_engine(py::module_& m) {
  py::class_<PyEngine> engine(m, "Engine");
  engine
      .def(py::init([](py::dict cfg) {
             EngineConfig c = engine_config(cfg);
             NoGil nogil;  // the memfd and the threads it starts need no Python
             return PyEngine(std::make_shared<Engine>(c));
           }),
           py::arg("config"))
      .def_property_readonly("pool_fd", [](PyEngine& e) { return e.engine->pool()->fd(); })
      .def_property_readonly("pool_size", [](PyEngine& e) { return e.engine->pool()->capacity(); })
      // Server workers counted as polling on their way back to accept()
      // (engine/polling_lease.h).
      .def_property_readonly("polling_leases", [](PyEngine& e) { return e.engine->leases_out(); })
      .def_property_readonly("missed_doorbells", [](PyEngine& e) { return e.engine->missed_doorbells(); })
      .def_property_readonly("timed_wakeups", [](PyEngine& e) { return e.engine->timed_wakeups(); })
      .def("pool_stats", [](PyEngine& e) {
        auto s = e.engine->pool()->stats();
        py::dict d;
        d["capacity"] = s.capacity;
        d["grown"] = s.grown;
        d["in_use"] = s.in_use;
        d["received"] = s.received;
        d["waiters"] = s.waiters;
        d["waits"] = s.waits;
        return d;
      })
      // Per transport that has had a connection on this engine (engine/transport_stats.h
      // says what each path counts).
      .def("transport_stats", [](PyEngine& e) {
        py::dict out;
        for (const auto& kv : e.engine->transport_stats().snapshot()) {
          const TransportSnapshot& s = kv.second;
          py::dict d;
          d["connections_open"] = s.connections_open;
          d["eager_bytes_sent"] = s.eager_bytes_sent;
          d["eager_bytes_received"] = s.eager_bytes_received;
          d["rendezvous_bytes_sent"] = s.rendezvous_bytes_sent;
          d["rendezvous_bytes_received"] = s.rendezvous_bytes_received;
          d["zero_copy_bytes_received"] = s.zero_copy_bytes_received;
          d["keepalive_failures"] = s.keepalive_failures;
          out[py::str(kv.first)] = d;
        }
        return out;
      })
      .def_property_readonly("connection_count", [](PyEngine& e) { return e.engine->connection_count(); })
      .def_property_readonly("hot_connection_count", [](PyEngine& e) { return e.engine->hot_count(); })
      .def("shutdown", [](PyEngine& e) {
        NoGil nogil;
        e.engine->shutdown();
      });
  return engine;
}

}  // namespace bindings
}  // namespace argrpc
