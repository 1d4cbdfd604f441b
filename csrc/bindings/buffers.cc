// A received large message: its bytes through the buffer protocol; the pool block goes
// back to the pool when the last view of it is gone.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_buffers(py::module_& m) {
  py::class_<RecvBuffer>(m, "RecvBuffer", py::buffer_protocol())
      .def_buffer([](RecvBuffer& b) {
        Payload& p = b.payload.value();
        return py::buffer_info(p.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.len)}, {1}, true);
      })
      .def("__len__", [](RecvBuffer& b) { return b.payload.value().len; });
}

}  // namespace bindings
}  // namespace argrpc
