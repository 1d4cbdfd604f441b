// Server: the engine's side of a server, which its workers accept calls from, and its
// admission and cancellation of pending calls.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "engine/polling_lease.h"
#include "engine/server.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

py::class_<PyServer> add_server(py::module_& m) {
  py::class_<PyServer> server(m, "Server");
  server
      .def(py::init([](PyEngine& e, py::dict cfg) {
             const int limit = cfg.contains("max_concurrent") ? cfg["max_concurrent"].cast<int>() : -1;
             return PyServer{e.engine, ForkLocal<std::shared_ptr<Server>>(
                                           std::make_shared<Server>(e.engine, limit))};
           }),
           py::arg("engine"), py::arg("config") = py::dict())
      .def("accept", [](PyServer& s, py::object timeout) -> py::object {
        std::shared_ptr<Stream> st;
        const Deadline dl = deadline_arg(timeout);
        {
          NoGil nogil;
          st = s.server->accept(dl);
        }
        if (!st) return py::none();
        return wrap_handle(std::make_unique<PyServerCall>(s.engine, st, true));
      }, py::arg("timeout") = py::none())
      .def("wakeup", [](PyServer& s, int n) { s.server->wakeup(n); }, py::arg("n") = 1)
      // The calling worker is no longer on its way back to accept() (engine/polling_lease.h).
      .def("drop_polling_lease", [](PyServer&) { polling_lease::drop(); })
      .def("worker_started", [](PyServer& s) { s.server->worker_started(); })
      .def_property_readonly("idle_workers", [](PyServer& s) { return s.server->idle_workers(); })
      .def_property_readonly("queued", [](PyServer& s) { return s.server->queued(); })
      // ("cancelled", call, 0) | ("over_limit", call, 0) | ("starved", None, n) |
      // ("none", None, 0) on timeout or shutdown.
      .def("next_event", [](PyServer& s, py::object timeout) -> py::tuple {
        ServerEvent ev;
        const Deadline dl = deadline_arg(timeout);
        {
          NoGil nogil;
          ev = s.server->next_event(dl);
        }
        switch (ev.kind) {
          case ServerEvent::Kind::kCancelled:
            // A second handle on a call a worker owns: dropping it must not abandon it.
            return py::make_tuple(
                "cancelled", wrap_handle(std::make_unique<PyServerCall>(s.engine, ev.stream, false)), 0);
          case ServerEvent::Kind::kOverLimit:
            return py::make_tuple(
                "over_limit", wrap_handle(std::make_unique<PyServerCall>(s.engine, ev.stream, true)), 0);
          case ServerEvent::Kind::kStarved:
            return py::make_tuple("starved", py::none(), ev.workers);
          case ServerEvent::Kind::kNone:
            break;
        }
        return py::make_tuple("none", py::none(), 0);
      }, py::arg("timeout") = py::none())
      .def("admit", [](PyServer& s) { return s.server->admit(); })
      .def("release", [](PyServer& s) { s.server->release(); })
      .def("cancel_pending", [](PyServer& s, uint32_t code, std::string details) {
        if (s.server.inherited()) return;
        NoGil nogil;
        s.server->cancel_pending(code, details);
      })
      .def("shutdown", [](PyServer& s) {
        if (!s.server.inherited()) s.server->shutdown();
      })
      .def("cancel_all", [](PyServer& s, uint32_t code, std::string details) {
        if (s.server.inherited()) return;
        NoGil nogil;
        s.server->cancel_all(code, details);
      })
      .def_property_readonly("active_calls", [](PyServer& s) { return s.server->active(); });
  return server;
}

}  // namespace bindings
}  // namespace argrpc
