// What an asyncio event loop uses: a Notifier whose fd the loop watches, and the calls'
// and the server's methods that never wait (the loop must not block in the engine).
// A watched call posts its token to the notifier on every change of its state; the
// loop then asks it with these try_* methods. Sends that would wait for window or pool
// room say so instead, and the loop tries again when the call's watch fires (window)
// or a little later (pool room).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bindings/bindings.h"
#include "common/status.h"
#include "engine/notifier.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

void watch_stream(const std::shared_ptr<Stream>& s, PyNotifier& n, uint64_t token) {
  auto w = std::make_shared<Watch>(n.n, token);
  std::lock_guard<std::mutex> g(s->mu);
  s->watch = w;
  // Whoever waits on the call asks it before waiting, so what came before the watch
  // is seen without a post; an end is posted, because a call's end is also acted on
  // by nobody waiting (a handler cancelled under it, done callbacks). A post of
  // anything else would cost every new call an eventfd write and a pass of the loop.
  if (s->ended) w->fire();
}

// A call whose connection is gone before it started (PyConnection::for_call): its end
// is posted like any call's.
py::object ended_at_birth(PyConnection& c, PyNotifier& n, uint64_t token) {
  std::make_shared<Watch>(n.n, token)->fire();
  return wrap_handle(std::make_unique<PyClientCall>(c.engine, c.gone_end()));
}

int send_result(SendResult r) {
  switch (r) {
    case SendResult::kSent: return 1;
    case SendResult::kWouldBlock: return -1;
    case SendResult::kEnded: break;
  }
  return 0;
}

// The next message, None while none is ready, False once none will come.
py::object try_recv(const std::shared_ptr<Stream>& s) {
  Payload p;
  int r;
  {
    // What it takes is already here: the copy, if any, is to_python's, with the GIL.
    GilUntilWait gil(true);
    r = s->conn->try_recv(s, &p);
  }
  if (r > 0) return to_python(std::move(p));
  return r == 0 ? py::object(py::none()) : py::object(py::bool_(false));
}

int try_send(const std::shared_ptr<Stream>& s, const py::object& msg, bool half_close,
             bool give_up = false) {
  BufferView b(msg);
  GilUntilWait gil(!give_up && b.size() <= kKeepGilBytes);
  // give_up: the call's deadline has passed while the send waited; the blocking send
  // ends the call as it would for a thread (no pool room: RESOURCE_EXHAUSTED naming
  // TF_RDMA_BUF_SIZE), without waiting, since the deadline is over.
  if (give_up) return s->conn->send(s, b.data(), b.size(), half_close) ? 1 : 0;
  return send_result(s->conn->try_send(s, b.data(), b.size(), half_close));
}

// A unary call's outcome once it ended: (code, details, initial, trailing, response or
// None), as Connection.unary returns it; None while it runs.
py::object try_unary(PyClientCall& c) {
  if (c.inert()) return unary_tuple(c.end());
  Stream& s = *c.s;
  {
    // Ended, and its response (if any) is whole: a large one may still be pulled after
    // the trailers came.
    std::lock_guard<std::mutex> g(s.mu);
    if (!s.ended || (!s.inbox.empty() && !s.inbox.front().ready())) return py::none();
  }
  Payload p;
  int got;
  {
    GilUntilWait gil(true);  // as try_recv's
    got = s.conn->try_recv(c.s, &p);
  }
  py::object response = got > 0 ? to_python(std::move(p)) : py::none();
  std::lock_guard<std::mutex> g(s.mu);
  return py::make_tuple(s.code, py::str(s.details), from_metadata(s.initial_md),
                        from_metadata(s.trailing_md), response);
}

}  // namespace

py::object start_unary(PyConnection& c, const std::string& method, const Metadata& md,
                       double timeout, PyNotifier& n, uint64_t token, const BufferView& request,
                       bool retry_unsent) {
  auto conn = c.for_call();
  if (!conn) {
    if (retry_unsent && c.gone_end().code == kUnavailable) return py::none();
    return py::make_tuple(ended_at_birth(c, n, token), send_result(SendResult::kEnded));
  }
  std::shared_ptr<Stream> s;
  SendResult r;
  {
    GilUntilWait gil(request.size() <= kKeepGilBytes);
    s = conn->start_call(method, md, timeout, false, c.group_id());
    {
      std::lock_guard<std::mutex> g(s->mu);
      s->watch = std::make_shared<Watch>(n.n, token);
      if (s->ended) s->watch->fire();  // born on a dead connection
    }
    r = conn->try_send(s, request.data(), request.size(), true);
    // Its token may have been posted: the caller ignores a token it let go of.
    if (r == SendResult::kEnded && retry_unsent && conn->never_sent(s)) s.reset();
  }
  if (!s) return py::none();
  return py::make_tuple(wrap_handle(std::make_unique<PyClientCall>(c.engine, s)),
                        send_result(r));
}

py::object try_recv_call(PyServerCall& c) { return try_recv(c.s); }

int try_finish_call(PyServerCall& c, uint32_t code, const std::string& details,
                    const Metadata& md, const py::object& message, bool quiet) {
  std::optional<BufferView> b;
  if (!message.is_none()) b.emplace(message);
  GilUntilWait gil(!b || b->size() <= kKeepGilBytes);
  // quiet: the caller lets go of the call once this is sent, so the end this send causes
  // is not posted (a post nobody reads costs the loop a pass).
  std::shared_ptr<Watch> w;
  if (quiet) {
    std::lock_guard<std::mutex> g(c.s->mu);
    w = std::move(c.s->watch);
  }
  const SendResult r = c.s->conn->try_finish(c.s, code, details, md, b ? b->data() : nullptr,
                                             b ? b->size() : 0, b.has_value());
  if (w && r != SendResult::kSent) {
    // Still the caller's to watch; a change meanwhile went unposted: post once.
    std::lock_guard<std::mutex> g(c.s->mu);
    c.s->watch = w;
    w->fire();
  }
  return send_result(r);
}

// What an awaited unary call does before it waits, in one crossing: its outcome
// if it has one; else, when the loop has nothing ready to run (`ready`, asyncio's
// deque of ready callbacks, is empty), a poll on the loop's thread
// (Notifier::poll), and its outcome again if only its own token came. Returns
// the outcome, the other tokens posted meanwhile (the caller runs their callbacks,
// then asks again), or None: wait for the call's watch. `own` is the call's token
// when nothing but the awaiting task waits on the call (its callback would only
// end it, which the caller does with the outcome), else 0.
py::object answer_or_poll(PyClientCall& c, PyNotifier& n, PyEngine& e, py::handle ready,
                          uint64_t own) {
  for (;;) {
    py::object outcome = try_unary(c);
    if (!outcome.is_none()) return outcome;
    if (ready.is_none() || PyObject_Length(ready.ptr()) != 0) {
      PyErr_Clear();  // a `ready` without a length (not asyncio's deque): no poll
      return outcome;
    }
    if (n.here.inherited() || e.engine.inherited()) return outcome;
    std::vector<uint64_t> tokens;
    {
      NoGil nogil;
      tokens = n.n->poll(*e.engine, kPollForeverUs);
    }
    if (tokens.empty()) return outcome;
    if (own != 0) tokens.erase(std::remove(tokens.begin(), tokens.end(), own), tokens.end());
    if (!tokens.empty()) return py::cast(tokens);
  }
}

void add_aio(py::module_& m, py::class_<PyEngine>& engine, py::class_<PyConnection>& connection,
             HandleMethods& client_call, py::class_<PyServer>& server,
             HandleMethods& server_call) {
  py::class_<PyNotifier>(m, "Notifier")
      .def(py::init<>())
      .def_property_readonly("fd", [](PyNotifier& n) { return n.n->fd(); })
      .def_property_readonly("pending", [](PyNotifier& n) { return n.n->pending(); })
      .def("drain", [](PyNotifier& n) {
        if (n.here.inherited()) return std::vector<uint64_t>();
        return n.n->drain();
      })
      // The calling thread (the loop's) checks `pending` before it sleeps: posts it
      // makes itself write no eventfd.
      .def("look_before_sleeping", [](PyNotifier& n) {
        n.n->set_looker(std::this_thread::get_id());
      })
      // Drives the engine for up to min(spin_us, limit_us) while nothing is posted, then
      // drains: the tokens posted.
      .def("poll", [](PyNotifier& n, PyEngine& e, int64_t limit_us) {
        if (n.here.inherited() || e.engine.inherited()) return std::vector<uint64_t>();
        NoGil nogil;
        return n.n->poll(*e.engine, limit_us);
      }, py::arg("engine"), py::arg("limit_us"))
      // The loop is about to sleep, or is done: it no longer counts as polling.
      .def("end_lease", [](PyNotifier& n) {
        if (n.here.inherited() || !n.n->leased()) return;
        NoGil nogil;
        n.n->end_lease();
      });

  connection.def(
      "start_watched",
      [](PyConnection& c, const std::string& method, py::object md, py::object timeout,
         PyNotifier& n, uint64_t token, bool send_headers_now, bool retry_unsent) -> py::object {
        Metadata meta = to_metadata(md);
        const double t = timeout_arg(timeout);
        auto conn = c.for_call();
        if (!conn) {
          if (retry_unsent && c.gone_end().code == kUnavailable) return py::none();
          return ended_at_birth(c, n, token);
        }
        std::shared_ptr<Stream> s;
        {
          NoGil nogil;
          s = conn->start_call(method, meta, t, send_headers_now, c.group_id());
          // Unwatched yet: nothing was told of it.
          if (retry_unsent && conn->never_sent(s)) s.reset();
        }
        if (!s) return py::none();
        watch_stream(s, n, token);
        return wrap_handle(std::make_unique<PyClientCall>(c.engine, s));
      },
      py::arg("method"), py::arg("metadata"), py::arg("timeout"), py::arg("notifier"),
      py::arg("token"), py::arg("send_headers_now") = true, py::arg("retry_unsent") = false);

  // A unary call in one step: started, watched and its request sent with its headers
  // and half-close, or queued to be (the result says which, as try_send's). A request
  // that is not a buffer raises TypeError before anything starts.
  connection.def(
      "start_unary_watched",
      [](PyConnection& c, const std::string& method, py::object md, py::object timeout,
         PyNotifier& n, uint64_t token, py::object request, bool retry_unsent) -> py::object {
        BufferView b(request);
        return start_unary(c, method, to_metadata(md), timeout_arg(timeout), n, token, b,
                           retry_unsent);
      },
      py::arg("method"), py::arg("metadata"), py::arg("timeout"), py::arg("notifier"),
      py::arg("token"), py::arg("request"), py::arg("retry_unsent") = false);

  client_call
      .def("try_send", [](PyClientCall& c, py::object msg, bool half_close, bool give_up) {
        if (c.inert()) return 0;
        return try_send(c.s, msg, half_close, give_up);
      }, py::arg("message"), py::arg("half_close") = false, py::arg("give_up") = false)
      .def("try_recv", [](PyClientCall& c) -> py::object {
        if (c.inert()) return py::bool_(false);
        return try_recv(c.s);
      })
      // Ended, and nothing it received is still being pulled: no change will come. A
      // call can end (its trailers arrive) while its last large message is still
      // pulled, and its reader needs that completion's post; done() alone would let
      // the loop stop listening too early.
      .def("settled", [](PyClientCall& c) {
        if (c.inert()) return true;
        std::lock_guard<std::mutex> g(c.s->mu);
        if (!c.s->ended) return false;
        for (const auto& in : c.s->inbox)
          if (!in.ready()) return false;
        return true;
      })
      // The initial metadata, None while it has not come, False if the call ended without.
      .def("try_initial_metadata", [](PyClientCall& c) -> py::object {
        if (c.inert()) return py::bool_(false);
        std::lock_guard<std::mutex> g(c.s->mu);
        if (c.s->have_initial_md) return from_metadata(c.s->initial_md);
        return c.s->ended ? py::object(py::bool_(false)) : py::object(py::none());
      })
      .def("try_status", [](PyClientCall& c) -> py::object {
        if (c.inert()) return status_tuple(c.end());
        {
          std::lock_guard<std::mutex> g(c.s->mu);
          if (!c.s->ended) return py::none();
        }
        return status_tuple(*c.s);
      })
      .def("try_unary", &try_unary)
      .def("answer_or_poll", &answer_or_poll, py::arg("notifier"), py::arg("engine"),
           py::arg("ready"), py::arg("own"));

  server.def("watch", [](PyServer& s, PyNotifier& n, uint64_t token) {
    s.server->set_watch(std::make_shared<Watch>(n.n, token));
  }, py::arg("notifier"), py::arg("token"));
  server_call
      .def("watch", [](PyServerCall& c, PyNotifier& n, uint64_t token) {
        watch_stream(c.s, n, token);
      }, py::arg("notifier"), py::arg("token"))
      .def("try_recv", [](PyServerCall& c) -> py::object { return try_recv(c.s); })
      .def("try_send", [](PyServerCall& c, py::object msg) { return try_send(c.s, msg, false); },
           py::arg("message"))
      .def("try_finish",
           [](PyServerCall& c, uint32_t code, const std::string& details, py::object trailing,
              py::object message, bool quiet) {
             return try_finish_call(c, code, details, to_metadata(trailing), message, quiet);
           },
           py::arg("code"), py::arg("details"), py::arg("trailing_md"),
           py::arg("message") = py::none(), py::arg("quiet") = false);
  (void)engine;
}

}  // namespace bindings
}  // namespace argrpc
