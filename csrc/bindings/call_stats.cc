// Per-call records for an application's metrics (common/call_stats.h): switched on and
// off process-wide, taken by a Python thread of the application's (an OpenTelemetry
// plugin's), labelled per client connection.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/call_stats.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_call_stats(py::module_& m, py::class_<PyConnection>& connection) {
  m.def("set_call_stats", [](bool on) { set_call_stats(on); }, py::arg("on"));
  // ([(kind, method, target, code, duration_s, sent_bytes, rcvd_bytes, transport)],
  //  dropped since the last take)
  m.def("_take_call_stats", [](int timeout_ms) {
    uint64_t dropped = 0;
    std::vector<CallRecord> got;
    {
      NoGil nogil;
      got = take_call_stats(timeout_ms, &dropped);
    }
    py::list records;
    const py::str no_target("");
    // A server's method name is what its peer sent.
    for (auto& r : got)
      records.append(py::make_tuple(static_cast<int>(r.kind), lenient_str(r.method),
                                    r.target ? lenient_str(*r.target) : no_target, r.code,
                                    r.duration_s, r.sent_bytes, r.rcvd_bytes, py::str(r.transport)));
    return py::make_tuple(records, dropped);
  }, py::arg("timeout_ms"));
  // Test-only: records kept between two takes (65536 unless a test lowers it).
  m.def("_call_stats_bound_for_test", [](size_t bound) { return set_call_stats_bound(bound); },
        py::arg("bound"));

  connection.def("set_stats_target", [](PyConnection& c, std::string target) {
    // A closed connection starts no more calls: nothing to label.
    if (auto conn = c.get()) conn->set_stats_target(std::move(target));
  }, py::arg("target"));
}

}  // namespace bindings
}  // namespace argrpc
