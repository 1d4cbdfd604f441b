// ServerCall: one call a server worker accepted, its request metadata and peer, and
// its replies.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "bindings/bindings.h"
#include "common/status.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

// grpc's auth_context(): each property's values, in the order they were given.
py::dict auth_dict(const PeerInfo& peer) {
  py::dict out;
  for (auto& kv : peer.auth) {
    py::str key(kv.first);
    if (!out.contains(key)) out[key] = py::list();
    out[key].cast<py::list>().append(py::bytes(kv.second));
  }
  return out;
}

}  // namespace

HandleMethods add_server_call(py::module_& m) {
  HandleMethods server_call = add_handle_type<PyServerCall>(
      m, "argrpc._core.ServerCall", "ServerCall",
      "One call a server took: its request metadata and peer, and its replies.");
  server_call
      .def_property_readonly("id", [](PyServerCall& c) { return c.s->id; })
      // Identity of the call across handles (accept() and next_event()).
      .def_property_readonly("key", [](PyServerCall& c) { return reinterpret_cast<uintptr_t>(c.s.value().get()); })
      .def_property_readonly("method", [](PyServerCall& c) { return method_name(c.s->method); })
      .def_property_readonly("metadata", [](PyServerCall& c) -> py::tuple {
        // grpc lists the client's user-agent first; over the fast path it is the one the
        // client's channel sent when it negotiated.
        const std::string& ua = c.s->conn->peer().user_agent;
        if (c.s->request_md.empty()) return user_agent_only(ua);
        py::list md = from_metadata(c.s->request_md);
        if (!ua.empty()) md.insert(0, py::make_tuple(py::str("user-agent"), py::bytes(ua)));
        return py::tuple(md);
      })
      // grpc's form of the client's address, from the call that negotiated the connection.
      .def_property_readonly("peer", [](PyServerCall& c) { return c.s->conn->peer().grpc_address(); })
      .def_property_readonly("peer_name", [](PyServerCall& c) { return c.s->conn->peer_name(); })
      .def_property_readonly("transport", [](PyServerCall& c) { return std::string(c.s->conn->fabric().name()); })
      .def_property_readonly("auth", [](PyServerCall& c) { return auth_dict(c.s->conn->peer()); })
      .def_property_readonly("identity_key", [](PyServerCall& c) -> py::object {
        const std::string& k = c.s->conn->peer().identity_key;
        return k.empty() ? py::object(py::none()) : py::object(py::str(k));
      })
      .def("time_remaining", [](PyServerCall& c) -> py::object {
        if (c.s->deadline.infinite()) return py::none();
        return py::float_(std::max(0.0, c.s->deadline.remaining_seconds()));
      })
      .def("recv", [](PyServerCall& c) -> py::object {
        Payload p;
        bool got;
        {
          NoGil nogil;
          got = c.s->conn->recv(c.s, &p);
        }
        return got ? to_python(std::move(p)) : py::none();
      })
      .def("send_initial_metadata", [](PyServerCall& c, py::object md) {
        Metadata meta = to_metadata(md);
        NoGil nogil;
        return c.s->conn->send_initial_metadata(c.s, meta);
      })
      .def("send", [](PyServerCall& c, py::object msg) {
        BufferView b(msg);
        NoGil nogil;
        return c.s->conn->send(c.s, b.data(), b.size(), false);
      })
      .def("finish",
           [](PyServerCall& c, uint32_t code, std::string details, py::object trailing,
              py::object message) {
             Metadata md = to_metadata(trailing);
             std::unique_ptr<BufferView> b;
             if (!message.is_none()) b = std::make_unique<BufferView>(message);
             NoGil nogil;
             return c.s->conn->finish(c.s, code, details, md, b ? b->data() : nullptr,
                                      b ? b->size() : 0, b != nullptr);
           },
           py::arg("code"), py::arg("details"), py::arg("trailing_md"), py::arg("message") = py::none())
      .def("is_active", [](PyServerCall& c) {
        std::lock_guard<std::mutex> g(c.s->mu);
        return !c.s->ended && !c.s->deadline.expired();
      })
      .def("cancel", [](PyServerCall& c) {
        NoGil nogil;
        c.s->conn->cancel(c.s, kCancelled, "Cancelled");
      })
      .def_property_readonly("cancelled", [](PyServerCall& c) {
        std::lock_guard<std::mutex> g(c.s->mu);
        return c.s->cancelled;
      });
  return server_call;
}

}  // namespace bindings
}  // namespace argrpc
