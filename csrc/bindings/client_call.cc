// ClientCall: a streaming call the client started on a Connection.
#include <pybind11/pybind11.h>

#include <mutex>
#include <string>

#include "bindings/bindings.h"
#include "common/status.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

HandleMethods add_client_call(py::module_& m) {
  // A call object the child inherited through fork() is the parent's: every method
  // answers as for a call that ended UNAVAILABLE, without touching it (its locks may be
  // held by a thread that does not exist here). A call ended at birth answers the same
  // way, with its own end.
  HandleMethods client_call = add_handle_type<PyClientCall>(
      m, "argrpc._core.ClientCall", "ClientCall",
      "One call a channel started: its sends, its replies and its end.");
  client_call
      .def("send", [](PyClientCall& c, py::object msg) {
        if (c.inert()) return false;
        BufferView b(msg);
        return interruptible(c.s, false, [&] { return c.s->conn->send(c.s, b.data(), b.size(), false); });
      })
      .def("half_close", [](PyClientCall& c) {
        if (c.inert()) return false;
        NoGil nogil;
        return c.s->conn->half_close(c.s);
      })
      .def("recv", [](PyClientCall& c) -> py::object {
        if (c.inert()) return py::none();
        Payload p;
        const bool got = interruptible(c.s, false, [&] { return c.s->conn->recv(c.s, &p); });
        return got ? to_python(std::move(p)) : py::none();
      })
      .def("initial_metadata", [](PyClientCall& c) -> py::object {
        if (c.inert()) return py::none();
        const bool have = interruptible(c.s, false, [&] { return c.s->conn->wait_initial_metadata(c.s); });
        std::lock_guard<std::mutex> g(c.s->mu);
        if (!have) return py::none();
        return from_metadata(c.s->initial_md);
      })
      .def("status", [](PyClientCall& c, py::object timeout) -> py::object {
        if (c.inert()) return status_tuple(c.end());
        const Deadline dl = deadline_arg(timeout);
        const bool ended = interruptible(c.s, false, [&] { return c.s->conn->wait_end(c.s, dl); });
        if (!ended) return py::none();
        return status_tuple(*c.s);
      }, py::arg("timeout") = py::none())
      .def("done", [](PyClientCall& c) {
        if (c.inert()) return true;
        std::lock_guard<std::mutex> g(c.s->mu);
        return c.s->ended;
      })
      .def("cancel", [](PyClientCall& c, uint32_t code, std::string details) {
        if (c.inert()) return false;
        NoGil nogil;
        return c.s->conn->cancel(c.s, code, details);
      }, py::arg("code") = uint32_t(kCancelled), py::arg("details") = "Cancelled");
  return client_call;
}

}  // namespace bindings
}  // namespace argrpc
