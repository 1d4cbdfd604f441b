// What malloc tuning's bound on the freed heap did in this process.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "common/heap_bound.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_heap_stats(py::module_& m) {
  // What malloc tuning's bound on the freed heap did in this process (tests, diagnosis).
  m.def("_heap_stats", [] {
    const heap_bound::Stats st = heap_bound::stats();
    py::dict d;
    d["checks"] = st.checks;
    d["settles"] = st.settles;
    d["trims"] = st.trims;
    d["trim_ns"] = st.trim_ns;
    d["free_before"] = st.free_before;
    return d;
  });
}

}  // namespace bindings
}  // namespace argrpc
