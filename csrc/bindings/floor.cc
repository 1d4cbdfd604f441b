// The benchmark's reference measurements: the latency floor (a bare shm fabric driven
// from Python, csrc/bench/floor_link.h) and the machine's memory-copy rate. Not part of
// argrpc's API: argrpc-bench measures them beside the transports in the same run.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bench/copy_rate.h"
#include "bench/floor_link.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "common/unique_fd.h"
#include "fabric/shm/shm_fabric.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

using PyShmEndpoint = PyEndpoint<ShmEndpoint>;

// A writable buffer the floor copies a received message into.
class WritableView {
 public:
  explicit WritableView(const py::object& o) {
    if (PyObject_GetBuffer(o.ptr(), &view_, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
      throw py::error_already_set();
  }
  ~WritableView() { PyBuffer_Release(&view_); }
  WritableView(const WritableView&) = delete;
  WritableView& operator=(const WritableView&) = delete;
  void* data() const { return view_.buf; }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_;
};

struct PyFloorLink {
  ForkLocal<std::shared_ptr<FloorLink>> link;
  FloorLink& need() const {
    if (link.inherited()) throw CoreError("floor link: made before this process forked");
    return *link.value();
  }
};

}  // namespace

void add_floor(py::module_& m, py::class_<PyEngine>& engine) {
  py::class_<PyFloorLink>(m, "_FloorLink")
      .def_property_readonly("max_message", [](PyFloorLink& l) { return l.need().max_message(); })
      .def("send",
           [](PyFloorLink& l, py::object message, double timeout) {
             FloorLink& link = l.need();
             BufferView v(message);
             NoGil nogil;
             link.send(v.data(), v.size(), timeout);
           },
           py::arg("message"), py::arg("timeout") = 10.0)
      .def("recv_into",
           [](PyFloorLink& l, py::object buffer, double timeout) {
             FloorLink& link = l.need();
             WritableView v(buffer);
             NoGil nogil;
             return link.recv_into(v.data(), v.size(), timeout);
           },
           py::arg("buffer"), py::arg("timeout") = 10.0);

  engine.def(
      "_attach_floor",
      [](PyEngine& e, PyShmEndpoint& ep, py::dict peer, int sock_fd, int spin_us) {
        UniqueFd sock(sock_fd);
        auto fabric = std::make_unique<ShmFabric>(ep.take(), shm_peer_arg(peer), std::move(sock),
                                                  e.engine->pool(), &e.engine->copier(),
                                                  -1);
        return PyFloorLink{ForkLocal<std::shared_ptr<FloorLink>>(
            std::make_shared<FloorLink>(std::move(fabric), spin_us))};
      },
      py::arg("endpoint"), py::arg("peer"), py::arg("sock_fd"), py::arg("spin_us"));

  m.def(
      "_copy_rate",
      [](size_t size, int threads, double seconds, size_t min_copies) {
        CopyRate r;
        {
          NoGil nogil;
          r = measure_copy_rate(size, threads, seconds, min_copies);
        }
        py::dict d;
        d["gbps"] = r.gbps;
        d["mean_us"] = r.mean_us;
        d["p99_us"] = r.p99_us;
        d["copies"] = r.copies;
        return d;
      },
      py::arg("size"), py::arg("threads"), py::arg("seconds"), py::arg("min_copies") = 3);
}

}  // namespace bindings
}  // namespace argrpc
