// Test-only hooks: the GIL race at exit, and a connection's remote-access probes and
// fail points (tests/verbs, the fail-point tests); not part of the facade.
#include <pybind11/pybind11.h>

#include <unistd.h>

#include <string>
#include <utility>

#include "bindings/bindings.h"
#include "common/spin.h"
#include "engine/connection.h"
#include "engine/probes.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_test_probes(py::module_& m, py::class_<PyConnection>& connection) {
  // Test-only: hold no GIL for `ms`, then take it back without first checking whether
  // the interpreter began finalizing meanwhile (the race NoGil must survive at exit).
  m.def("_without_gil_for_test", [](int ms) {
    NoGil nogil;
    nogil.skip_check_for_test = true;
    ::usleep(static_cast<useconds_t>(ms) * 1000);
  });

  // Test-only: how many of `n` yields that each took `took_us`, on this thread, read as
  // a CPU shared with another thread (note_yield, common/spin.h). No yield is made, so
  // the kernel switched the thread out only if it preempted it meanwhile.
  m.def("_slow_yields_read_as_shared_for_test", [](int n, uint64_t took_us) {
    int shared = 0;
    for (int i = 0; i < n; ++i) {
      note_yield(0, took_us);
      shared += t_cpu_shared ? 1 : 0;
    }
    return shared;
  });

  // Test-only: cool() holds still after it armed a quiet connection (Engine).
  m.def("_pause_cooling_for_test", [](PyEngine& e, uint32_t us) {
    e.engine->pause_cooling_for_test(us);
  });

  connection
      // Remote-access probes for tests/verbs; not part of the facade. A connection
      // records for them only once one was called: _probe_enable() before the traffic.
      .def("_probe_enable", [](PyConnection& c) { c.need()->probe_enable(); })
      .def("_probe_last_rts", [](PyConnection& c) {
        uint64_t len = 0;
        const RemoteRef r = c.need()->probe_last_rts(&len);
        return py::make_tuple(r.addr, r.key, len);
      })
      .def("_probe_read", [](PyConnection& c, uint64_t addr, uint32_t key, size_t len,
                             double timeout) {
        auto conn = c.need();
        NoGil nogil;
        return conn->probe_read(RemoteRef{addr, key}, len, timeout);
      }, py::arg("addr"), py::arg("key"), py::arg("length"), py::arg("timeout"))
      .def("_probe_raw_batch", [](PyConnection& c, py::bytes data) {
        auto conn = c.need();
        std::string b = data;
        NoGil nogil;
        return conn->probe_raw_batch(reinterpret_cast<const uint8_t*>(b.data()), b.size());
      }, py::arg("data"))
      .def("_probe_fail_at", [](PyConnection& c, const std::string& point) {
        static const std::pair<const char*, FailPoint> kPoints[] = {
            {"submit", FailPoint::kSubmit}, {"copy_in", FailPoint::kCopyIn},
            {"register", FailPoint::kRegister}, {"flush", FailPoint::kFlush},
            {"pull", FailPoint::kPull}, {"finished", FailPoint::kFinished}};
        if (point == "route") {  // the handle's, not the connection's: see for_call()
          c.need();
          c.fail_before_use = true;
          return;
        }
        for (const auto& p : kPoints) {
          if (point == p.first) {
            c.need()->probe_fail_at(p.second);
            return;
          }
        }
        throw py::value_error("unknown fail point '" + point +
                              "' (route, submit, copy_in, register, flush, pull, finished)");
      }, py::arg("point"));
}

}  // namespace bindings
}  // namespace argrpc
