// The module: the engine, connections, calls and the server, whatever the fabric; each
// fabric's endpoint and attach are its own unit (bindings.h). Converts arguments,
// releases the GIL around every wait and every copy, and turns CoreError into
// argrpc._core.CoreError. No call-path function raises: calls end with a status the
// facade reads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "bindings/bindings.h"
#include "common/error.h"
#include "common/fork.h"
#include "common/heap_bound.h"
#include "common/knob_check.h"
#include "common/interrupt.h"
#include "common/status.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/polling_lease.h"
#include "engine/server.h"
#include "pool/pool.h"
#include "tunables.h"

namespace py = pybind11;
using namespace argrpc;
using namespace argrpc::bindings;

namespace {

// Python's signal handlers run while the main thread waits in a call, as grpc runs them:
// once the wait sleeps, it takes the GIL every kInterruptPoll to run them. A handler that
// raises (Ctrl-C's KeyboardInterrupt) ends the wait, and its exception reaches the caller.
class SignalCheck final : public WaitInterrupt {
 public:
  bool interrupted() override {
    if (_Py_IsFinalizing()) return false;
    const PyGILState_STATE g = PyGILState_Ensure();
    const bool raised = PyErr_CheckSignals() != 0;  // the exception stays set
    PyGILState_Release(g);
    return raised;
  }
};

// Runs `wait` without the GIL, interruptible by signal handlers on the main thread (the
// only one Python runs them on). On interruption `s` is cancelled when `cancel` is set:
// the call was the caller's alone (a blocking unary call); a call object the caller
// still holds is cancelled when it is dropped, as grpc's is.
// `s` may be set by `wait` itself (a call it starts): the GIL is taken back once, at
// the end, since a thread that takes it back while the interpreter finalizes is ended
// by CPython, which pybind11's frames do not survive.
template <class Wait>
auto interruptible(const std::shared_ptr<Stream>& s, bool cancel, Wait&& wait) -> decltype(wait()) {
  SignalCheck check;
  const bool main = _PyOS_IsMainThread() != 0;
  try {
    NoGil nogil;
    InterruptScope scope(main ? &check : nullptr);
    return wait();
  } catch (const Interrupted&) {
  }
  if (cancel && s) {
    NoGil nogil;
    s->conn->cancel(s, kCancelled, "Cancelled");
  }
  throw py::error_already_set();
}

// A received large message. Exposes its bytes through the buffer protocol; the pool
// block goes back to the pool when the last view of it is gone.
EngineConfig engine_config(const py::dict& d) {
  EngineConfig c;
  c.buf_size = get_or<size_t>(d, "buf_size", c.buf_size);
  c.spin_us = get_or<int>(d, "spin_us", c.spin_us);
  c.malloc_tuning = get_or<int>(d, "malloc_tuning", c.malloc_tuning) != 0;
  c.slab_size = get_or<size_t>(d, "slab_size", c.slab_size);
  c.parallel_copy_min = get_or<size_t>(d, "parallel_copy_min", c.parallel_copy_min);
  check_knob(knobs::kBufSize, int64_t(c.buf_size));
  check_knob(knobs::kSpinUs, c.spin_us);
  return c;
}


}  // namespace

namespace argrpc {
namespace bindings {

Metadata to_metadata(const py::object& o) {
  Metadata md;
  if (o.is_none()) return md;
  for (auto item : o) {
    auto t = py::reinterpret_borrow<py::tuple>(item);
    if (t.size() != 2) throw py::value_error("metadata entries must be (key, value) pairs");
    md.emplace_back(t[0].cast<std::string>(), t[1].cast<std::string>());
  }
  return md;
}

py::list from_metadata(const Metadata& md) {
  py::list l;
  for (auto& kv : md) l.append(py::make_tuple(py::str(kv.first), py::bytes(kv.second)));
  return l;
}

py::tuple user_agent_only(const std::string& ua) {
  if (ua.empty()) return py::tuple();
  // Most calls carry no metadata of their own, so their metadata is the same one-entry
  // tuple every time: built once per user-agent (the facade's conversion of it is then
  // a cache hit). Under the GIL; never freed, as the interpreter may be gone at exit.
  static std::string* last_ua = new std::string();
  static py::object* last = new py::object();
  if (!*last || *last_ua != ua) {
    *last = py::make_tuple(py::make_tuple(py::str("user-agent"), py::bytes(ua)));
    *last_ua = ua;
  }
  return py::reinterpret_borrow<py::tuple>(*last);
}

py::object to_python(Payload&& p) {
  if (p.is_inline) return py::bytes(p.inline_bytes.data(), p.inline_bytes.size());
  return py::memoryview(py::cast(std::make_unique<RecvBuffer>(std::move(p))));
}

double timeout_arg(const py::object& t) { return t.is_none() ? -1.0 : t.cast<double>(); }

Deadline deadline_arg(const py::object& t) {
  return t.is_none() ? Deadline::never() : Deadline::after_seconds(t.cast<double>());
}

py::tuple status_tuple(Stream& s) {
  std::lock_guard<std::mutex> g(s.mu);
  return py::make_tuple(s.code, py::str(s.details), from_metadata(s.trailing_md));
}

py::tuple status_tuple(const CallEnd& e) {
  return py::make_tuple(e.code, lenient_str(e.details), py::list());
}

py::tuple unary_tuple(const CallEnd& e) {
  return py::make_tuple(e.code, lenient_str(e.details), py::list(), py::list(), py::none());
}

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

ConnConfig conn_config(const py::dict& d) {
  ConnConfig c;
  c.ring_size = get_or<size_t>(d, "ring_size", c.ring_size);
  c.acc_size = get_or<size_t>(d, "acc_size", c.acc_size);
  c.chunk_size = get_or<size_t>(d, "chunk_size", c.chunk_size);
  c.reads_in_flight = get_or<int>(d, "reads_in_flight", c.reads_in_flight);
  c.stream_window = get_or<size_t>(d, "stream_window", c.stream_window);
  c.max_recv = get_or<int64_t>(d, "max_recv", c.max_recv);
  c.zero_copy_min = get_or<size_t>(d, "zero_copy_min", c.zero_copy_min);
  c.keepalive_timeout_ms = get_or<uint32_t>(d, "keepalive_timeout_ms", c.keepalive_timeout_ms);
  check_knob(knobs::kRingSize, int64_t(c.ring_size), power_of_two(c.ring_size),
             ": ring_size must be a power of two");
  check_knob(knobs::kAccSize, int64_t(c.acc_size), c.acc_size <= c.ring_size / 4,
             " and at most TF_RDMA_RING_SIZE/4");
  check_knob(knobs::kChunkSize, int64_t(c.chunk_size));
  check_knob(knobs::kReadsInFlight, c.reads_in_flight);
  check_knob(knobs::kStreamWindow, int64_t(c.stream_window));
  check_knob(knobs::kKeepaliveTimeoutMs, int64_t(c.keepalive_timeout_ms));
  if (c.zero_copy_min == 0)
    c.zero_copy_min = ~size_t(0);  // off: no message is that big
  else
    check_knob(knobs::kZeroCopyMin, int64_t(c.zero_copy_min), true, " or 0 (off)");
  return c;
}

}  // namespace bindings
}  // namespace argrpc

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

PYBIND11_MODULE(_core, m) {
  m.doc() = "argrpc engine: adaptive eager/rendezvous transport over a fabric (shm, verbs)";
  static py::exception<CoreError> core_error(m, "CoreError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CoreError& e) {
      py::set_error(core_error, e.what());
    }
  });

  // Test-only: hold no GIL for `ms`, then take it back without first checking whether
  // the interpreter began finalizing meanwhile (the race NoGil must survive at exit).
  m.def("_without_gil_for_test", [](int ms) {
    NoGil nogil;
    nogil.skip_check_for_test = true;
    ::usleep(static_cast<useconds_t>(ms) * 1000);
  });

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

  // What the engine uses when Python passes nothing: tests compare it with the knob table.
  m.def("_config_defaults", [] {
    const EngineConfig e;
    const ConnConfig c;
    const VerbsConfig v;
    py::dict engine, conn, verbs;
    engine["buf_size"] = e.buf_size;
    engine["spin_us"] = e.spin_us;
    engine["malloc_tuning"] = e.malloc_tuning;
    engine["slab_size"] = e.slab_size;
    engine["parallel_copy_min"] = e.parallel_copy_min;
    engine["malloc_mmap_threshold"] = e.malloc_mmap_threshold;
    engine["malloc_trim_threshold"] = e.malloc_trim_threshold;
    engine["malloc_retain_max"] = e.malloc_retain_max;
    conn["ring_size"] = c.ring_size;
    conn["acc_size"] = c.acc_size;
    conn["chunk_size"] = c.chunk_size;
    conn["reads_in_flight"] = c.reads_in_flight;
    conn["stream_window"] = c.stream_window;
    conn["zero_copy_min"] = c.zero_copy_min;
    conn["cq_slots"] = c.cq_slots;
    conn["pull_ahead"] = c.pull_ahead;
    conn["keepalive_ms"] = c.keepalive_ms;
    conn["idle_keepalive_ms"] = c.idle_keepalive_ms;
    conn["keepalive_timeout_ms"] = c.keepalive_timeout_ms;
    verbs["qps"] = v.qps;
    verbs["qp_timeout"] = v.qp_timeout;
    verbs["qp_retry"] = v.qp_retry;
    verbs["cq_depth"] = v.cq_depth;
    py::dict out;
    out["EngineConfig"] = engine;
    out["ConnConfig"] = conn;
    out["VerbsConfig"] = verbs;
    return out;
  });

  py::class_<RecvBuffer>(m, "RecvBuffer", py::buffer_protocol())
      .def_buffer([](RecvBuffer& b) {
        Payload& p = b.payload.value();
        return py::buffer_info(p.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.len)}, {1}, true);
      })
      .def("__len__", [](RecvBuffer& b) { return b.payload.value().len; });

  py::class_<PeerInfo>(m, "PeerInfo")
      .def(py::init([](std::string name, std::string address, std::string user_agent,
                       std::vector<std::pair<std::string, py::bytes>> auth,
                       std::string identity_key) {
             PeerInfo p(std::move(name));
             p.address = std::move(address);
             p.user_agent = std::move(user_agent);
             for (auto& kv : auth) p.auth.emplace_back(kv.first, std::string(kv.second));
             p.identity_key = std::move(identity_key);
             return p;
           }),
           py::arg("name"), py::arg("address") = "", py::arg("user_agent") = "",
           py::arg("auth") = std::vector<std::pair<std::string, py::bytes>>(),
           py::arg("identity_key") = "")
      .def(py::init<std::string>(), py::arg("name"))
      .def_readonly("name", &PeerInfo::name)
      .def_readonly("address", &PeerInfo::address)
      .def_readonly("user_agent", &PeerInfo::user_agent);
  py::implicitly_convertible<py::str, PeerInfo>();

  py::class_<PyEngine> engine(m, "Engine");
  engine
      .def(py::init([](py::dict cfg) {
             EngineConfig c = engine_config(cfg);
             NoGil nogil;  // the memfd and the threads it starts need no Python
             return PyEngine(std::make_shared<Engine>(c));
           }),
           py::arg("config"))
      .def_property_readonly("pool_fd", [](PyEngine& e) { return e.engine->pool()->fd(); })
      .def_property_readonly("pool_size", [](PyEngine& e) { return e.engine->pool()->capacity(); })
      // Server workers counted as polling on their way back to accept()
      // (engine/polling_lease.h).
      .def_property_readonly("polling_leases", [](PyEngine& e) { return e.engine->leases_out(); })
      .def_property_readonly("missed_doorbells", [](PyEngine& e) { return e.engine->missed_doorbells(); })
      .def("pool_stats", [](PyEngine& e) {
        auto s = e.engine->pool()->stats();
        py::dict d;
        d["capacity"] = s.capacity;
        d["grown"] = s.grown;
        d["in_use"] = s.in_use;
        d["received"] = s.received;
        d["waiters"] = s.waiters;
        d["waits"] = s.waits;
        return d;
      })
      // Per transport that has had a connection on this engine (engine/transport_stats.h
      // says what each path counts).
      .def("transport_stats", [](PyEngine& e) {
        py::dict out;
        for (const auto& kv : e.engine->transport_stats().snapshot()) {
          const TransportSnapshot& s = kv.second;
          py::dict d;
          d["connections_open"] = s.connections_open;
          d["eager_bytes_sent"] = s.eager_bytes_sent;
          d["eager_bytes_received"] = s.eager_bytes_received;
          d["rendezvous_bytes_sent"] = s.rendezvous_bytes_sent;
          d["rendezvous_bytes_received"] = s.rendezvous_bytes_received;
          d["zero_copy_bytes_received"] = s.zero_copy_bytes_received;
          d["keepalive_failures"] = s.keepalive_failures;
          out[py::str(kv.first)] = d;
        }
        return out;
      })
      .def_property_readonly("connection_count", [](PyEngine& e) { return e.engine->connection_count(); })
      .def_property_readonly("hot_connection_count", [](PyEngine& e) { return e.engine->hot_count(); })
      .def("shutdown", [](PyEngine& e) {
        NoGil nogil;
        e.engine->shutdown();
      });

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
      // Remote-access probes for tests/verbs; not part of the facade. A connection
      // records for them only once one was called: _probe_enable() before the traffic.
      .def("_probe_enable", [](PyConnection& c) { c.need()->probe_enable(); })
      .def("_probe_last_rts", [](PyConnection& c) {
        uint64_t len = 0;
        const RemoteRef r = c.need()->probe_last_rts(&len);
        return py::make_tuple(r.addr, r.key, len);
      })
      .def("_probe_read", [](PyConnection& c, uint64_t addr, uint32_t key, size_t len,
                             double timeout) {
        auto conn = c.need();
        NoGil nogil;
        return conn->probe_read(RemoteRef{addr, key}, len, timeout);
      }, py::arg("addr"), py::arg("key"), py::arg("length"), py::arg("timeout"))
      .def("_probe_raw_batch", [](PyConnection& c, py::bytes data) {
        auto conn = c.need();
        std::string b = data;
        NoGil nogil;
        return conn->probe_raw_batch(reinterpret_cast<const uint8_t*>(b.data()), b.size());
      }, py::arg("data"))
      .def("_probe_fail_at", [](PyConnection& c, const std::string& point) {
        static const std::pair<const char*, FailPoint> kPoints[] = {
            {"submit", FailPoint::kSubmit}, {"copy_in", FailPoint::kCopyIn},
            {"register", FailPoint::kRegister}, {"flush", FailPoint::kFlush},
            {"pull", FailPoint::kPull}, {"finished", FailPoint::kFinished}};
        if (point == "route") {  // the handle's, not the connection's: see for_call()
          c.need();
          c.fail_before_use = true;
          return;
        }
        for (const auto& p : kPoints) {
          if (point == p.first) {
            c.need()->probe_fail_at(p.second);
            return;
          }
        }
        throw py::value_error("unknown fail point '" + point +
                              "' (route, submit, copy_in, register, flush, pull, finished)");
      }, py::arg("point"))
      // retry_unsent: None instead of the UNAVAILABLE end of a call that never left this
      // process (PyConnection::unsent), which the caller starts again elsewhere.
      .def("unary",
           [](PyConnection& c, const std::string& method, py::object md, py::object timeout,
              py::object request, bool retry_unsent) -> py::object {
             Metadata meta = to_metadata(md);
             const double t = timeout_arg(timeout);
             BufferView req(request);
             auto conn = c.for_call();
             if (!conn) {
               CallEnd end = c.gone_end();
               if (retry_unsent && end.code == kUnavailable) return py::none();
               return unary_tuple(end);
             }
             std::shared_ptr<Stream> s;
             Payload resp;
             bool got = false;
             interruptible(s, true, [&] {
               s = conn->start_call(method, meta, t, false, c.group_id());
               if (conn->send(s, req.data(), req.size(), true)) got = conn->recv(s, &resp);
               return conn->wait_end(s, Deadline::never());
             });
             if (retry_unsent && !got && conn->never_sent(s)) return py::none();
             py::object response = got ? to_python(std::move(resp)) : py::none();
             Metadata initial, trailing;
             uint32_t code;
             std::string details;
             {
               std::lock_guard<std::mutex> g(s->mu);
               code = s->code;
               details = s->details;
               initial = s->initial_md;
               trailing = s->trailing_md;
             }
             return py::make_tuple(code, py::str(details), from_metadata(initial),
                                   from_metadata(trailing), response);
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
               return py::cast(std::make_unique<PyClientCall>(c.engine, std::move(end)));
             }
             std::shared_ptr<Stream> s;
             {
               NoGil nogil;
               s = conn->start_call(method, meta, t, true, c.group_id());
               if (retry_unsent && conn->never_sent(s)) s.reset();
             }
             if (!s) return py::none();
             return py::cast(std::make_unique<PyClientCall>(c.engine, s));
           },
           py::arg("method"), py::arg("metadata"), py::arg("timeout"),
           py::arg("retry_unsent") = false);

  // A call object the child inherited through fork() is the parent's: every method
  // answers as for a call that ended UNAVAILABLE, without touching it (its locks may be
  // held by a thread that does not exist here). A call ended at birth answers the same
  // way, with its own end.
  py::class_<PyClientCall> client_call(m, "ClientCall");
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
        return py::cast(std::make_unique<PyServerCall>(s.engine, st, true));
      }, py::arg("timeout") = py::none())
      .def("wakeup", [](PyServer& s, int n) { s.server->wakeup(n); }, py::arg("n") = 1)
      // The calling worker is no longer on its way back to accept() (engine/polling_lease.h).
      .def("drop_polling_lease", [](PyServer&) { polling_lease::drop(); })
      .def("worker_started", [](PyServer& s) { s.server->worker_started(); })
      .def_property_readonly("idle_workers", [](PyServer& s) { return s.server->idle_workers(); })
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
            return py::make_tuple("cancelled", std::make_unique<PyServerCall>(s.engine, ev.stream, false), 0);
          case ServerEvent::Kind::kOverLimit:
            return py::make_tuple("over_limit", std::make_unique<PyServerCall>(s.engine, ev.stream, true), 0);
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

  py::class_<PyServerCall> server_call(m, "ServerCall");
  server_call
      .def_property_readonly("id", [](PyServerCall& c) { return c.s->id; })
      // Identity of the call across handles (accept() and next_event()).
      .def_property_readonly("key", [](PyServerCall& c) { return reinterpret_cast<uintptr_t>(c.s.value().get()); })
      .def_property_readonly("method", [](PyServerCall& c) { return c.s->method; })
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

  // Each fabric's endpoint and the Engine methods that make and attach one; after
  // Connection, which attach returns.
  add_shm(m, engine);
  add_verbs(m, engine);
  add_sim(m);  // the test fabric (docs/core-api.md, "Test fabric")
  add_log(m);
  add_call_stats(m, connection);
  add_aio(m, engine, connection, client_call, server, server_call);
  add_floor(m, engine);  // argrpc-bench's reference rows
}
