// Connection: a handle on one connection, whatever its fabric, and the calls started on
// it (a blocking unary call, or a ClientCall).
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "bindings/bindings.h"
#include "common/status.h"
#include "engine/connection.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

std::shared_ptr<Connection> PyConnection::for_call() {
  if (fail_before_use) {
    fail_before_use = false;
    if (auto conn = get()) {
      NoGil nogil;
      conn->fail(kUnavailable, "argrpc: connection failed at a test fail point");
      conn.reset();
      // The progress thread may still hold the engine's old list of connections for
      // the rest of its pass; the interleaving wanted is the one where nothing does.
      const Deadline limit = Deadline::after_seconds(5);
      while (!weak.expired() && !limit.expired())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return get();
}

CallEnd PyConnection::gone_end() const {
  if (engine.inherited()) return CallEnd{kUnavailable, kInheritedCall};
  std::lock_guard<std::mutex> g(epitaph->mu);
  // Gone without fail() (the engine shut down): no reason was recorded.
  if (epitaph->why.empty()) return CallEnd{kUnavailable, "argrpc: connection is closed"};
  return CallEnd{epitaph->code ? epitaph->code : uint32_t(kUnavailable), epitaph->why};
}

UnaryEnd blocking_unary(PyConnection& c, const std::string& method, const Metadata& meta,
                        double timeout, const BufferView& req, bool retry_unsent) {
  UnaryEnd e;
  auto conn = c.for_call();
  if (!conn) {
    CallEnd end = c.gone_end();
    e.unsent = retry_unsent && end.code == kUnavailable;
    e.code = end.code;
    e.details = std::move(end.details);
    return e;
  }
  std::shared_ptr<Stream> s;
  interruptible(s, true, [&] {
    s = conn->start_call(method, meta, timeout, false, c.group_id());
    if (conn->send(s, req.data(), req.size(), true)) e.got = conn->recv(s, &e.response);
    return conn->wait_end(s, Deadline::never());
  });
  if (retry_unsent && !e.got && conn->never_sent(s)) {
    e.unsent = true;
    return e;
  }
  std::lock_guard<std::mutex> g(s->mu);
  e.code = s->code;
  e.details = s->details;
  e.initial = s->initial_md;
  e.trailing = s->trailing_md;
  return e;
}

CallGroup::~CallGroup() {
  auto c = conn.lock();
  if (c && !c->inherited()) c->forget_group(id);
}

PyConnection PyConnection::share() const {
  static std::atomic<uint64_t> next_group{1};
  PyConnection pc(*this);
  pc.fail_before_use = false;
  pc.group = std::make_shared<CallGroup>(next_group.fetch_add(1), weak);
  return pc;
}

py::class_<PyConnection> add_connection(py::module_& m) {
  py::class_<PyConnection> connection(m, "Connection");
  connection
      .def_property_readonly("transport", [](PyConnection& c) { return c.transport; })
      .def_property_readonly("alive", [](PyConnection& c) {
        auto conn = c.get();
        return conn && conn->alive();
      })
      .def_property_readonly("error", [](PyConnection& c) {
        if (c.engine.inherited())
          return std::string("argrpc: the connection belongs to the parent process (inherited "
                             "through fork()); this process negotiates its own");
        const std::string why = c.epitaph->text();
        // Empty while alive; a connection gone without a reason was destroyed by close.
        return why.empty() && !c.get() ? std::string("argrpc: connection is closed") : why;
      })
      .def_property_readonly("peer", [](PyConnection& c) { return c.peer; })
      // The receive ring its batches use (0 once gone).
      .def_property_readonly("ring_size", [](PyConnection& c) -> size_t {
        auto conn = c.get();
        return conn ? conn->fabric().ring_size() : 0;
      })
      .def("close", [](PyConnection& c) {
        auto conn = c.get();
        if (!conn) return;
        NoGil nogil;
        conn->close("Channel closed!");
      })
      // A channel's own handle on a connection other channels may share; its calls form
      // a group that end_own() ends (CANCELLED `why`), leaving the connection and the
      // other handles' calls alone.
      .def("share", &PyConnection::share)
      .def_property_readonly("group", &PyConnection::group_id)
      .def("end_own", [](PyConnection& c, const std::string& why) {
        auto conn = c.get();
        if (!conn || !c.group) return;
        NoGil nogil;
        conn->end_group(c.group->id, why);
      }, py::arg("why") = "Channel closed!")
      // retry_unsent: None instead of the UNAVAILABLE end of a call that never left this
      // process (PyConnection::unsent), which the caller starts again elsewhere.
      .def("unary",
           [](PyConnection& c, const std::string& method, py::object md, py::object timeout,
              py::object request, bool retry_unsent) -> py::object {
             BufferView req(request);
             UnaryEnd e = blocking_unary(c, method, to_metadata(md), timeout_arg(timeout), req,
                                         retry_unsent);
             if (e.unsent) return py::none();
             py::object response = e.got ? to_python(std::move(e.response)) : py::none();
             return py::make_tuple(e.code, lenient_str(e.details), from_metadata(e.initial),
                                   from_metadata(e.trailing), response);
           },
           py::arg("method"), py::arg("metadata"), py::arg("timeout"), py::arg("request"),
           py::arg("retry_unsent") = false)
      .def("start_call",
           [](PyConnection& c, const std::string& method, py::object md, py::object timeout,
              bool retry_unsent) -> py::object {
             Metadata meta = to_metadata(md);
             const double t = timeout_arg(timeout);
             auto conn = c.for_call();
             if (!conn) {
               CallEnd end = c.gone_end();
               if (retry_unsent && end.code == kUnavailable) return py::none();
               return wrap_handle(std::make_unique<PyClientCall>(c.engine, std::move(end)));
             }
             std::shared_ptr<Stream> s;
             {
               NoGil nogil;
               s = conn->start_call(method, meta, t, true, c.group_id());
               if (retry_unsent && conn->never_sent(s)) s.reset();
             }
             if (!s) return py::none();
             return wrap_handle(std::make_unique<PyClientCall>(c.engine, s));
           },
           py::arg("method"), py::arg("metadata"), py::arg("timeout"),
           py::arg("retry_unsent") = false);
  return connection;
}

}  // namespace bindings
}  // namespace argrpc
