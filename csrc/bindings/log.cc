// Engine messages for Python's logging (common/log.h): argrpc/_log.py takes them on a
// thread of its own and hands them to the "argrpc.engine" logger.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/log.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_log(py::module_& m) {
  m.def("_take_log", [](int timeout_ms) {
    uint64_t dropped = 0;
    std::vector<LogEntry> got;
    {
      NoGil nogil;
      got = take_log(timeout_ms, &dropped);
    }
    py::list entries;
    // Texts may quote what a peer sent.
    for (auto& e : got) entries.append(py::make_tuple(e.level, lenient_str(e.text)));
    return py::make_tuple(entries, dropped);
  }, py::arg("timeout_ms"));
  // Test-only: a message as the engine would log it, from the calling thread.
  m.def("_log_for_test", [](int level, const std::string& text) {
    log_message(static_cast<LogLevel>(level), text);
  });
}

}  // namespace bindings
}  // namespace argrpc
