// What the binding units share. Each bound object has its unit (engine.cc,
// connection.cc, client_call.cc, server.cc, server_call.cc, buffers.cc, ...) exposing an
// add_* function, and module.cc calls them in order; each fabric's unit (shm.cc,
// verbs.cc) binds its endpoint and extends Engine with the methods that make one and
// attach a connection over it, so a fabric's bindings are one unit plus one add_* call.
#pragma once
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <unistd.h>

#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "common/error.h"
#include "common/fork.h"
#include "common/interrupt.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "engine/notifier.h"
#include "engine/server.h"
#include "engine_config.h"

namespace argrpc {
struct ShmPeer;

namespace bindings {

// Releases the GIL for a wait or a copy. A thread that comes back while the
// interpreter is finalizing must not retake the GIL: CPython would pthread_exit() it,
// and that forced unwind through pybind11's noexcept frames (or through a frame still
// holding a Python buffer, which would be released without the GIL) aborts the process.
// Such a thread (a daemon thread still in a call at exit) parks until the process ends.
// Finalizing may begin while the thread already waits for the GIL, after the check:
// CPython then unwinds it from inside PyEval_RestoreThread, without the GIL, and the
// unwind is stopped right here and parks as well.
// The finalizing thread itself (a __del__ or atexit close at shutdown) is the one
// thread that may keep running: it keeps the GIL, since no other thread can take it.
class NoGil {
 public:
  // release false: the GIL stays until let_go() (GilUntilWait).
  explicit NoGil(bool release = true) {
    if (release) let_go();
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  void let_go() {
    if (state_ == nullptr && !_Py_IsFinalizing()) state_ = PyEval_SaveThread();
  }
  ~NoGil() {
    if (state_ == nullptr) return;
    if (_Py_IsFinalizing() && !skip_check_for_test) park();
    try {
      PyEval_RestoreThread(state_);
    } catch (...) {
      // Only CPython's forced unwind lands here (PyEval_RestoreThread is C and throws
      // nothing else). Never leaving the handler, the unwind never reaches a noexcept
      // frame. Not `catch (abi::__forced_unwind&)`: that binds a reference to the
      // exception object a forced unwind does not have (UBSan reports it).
      park();
    }
  }

  // Test-only: go straight to retaking the GIL, as a thread that passed the check just
  // before finalizing began.
  bool skip_check_for_test = false;

 private:
  [[noreturn]] static void park() {
    for (;;) ::pause();
  }
  PyThreadState* state_ = nullptr;
};

// The calls that should return at once (try_recv, try_send, try_finish and the like)
// keep the GIL when they copy at most this many bytes: letting it go and taking it back
// costs more than such a call's work. They let it go only if the engine is about to
// wait after all (for ring credits a slow peer has not returned, or for a send lock
// another thread holds through such a wait), so that the wait holds up no other Python
// thread. Keeping it cannot deadlock: the engine never takes the GIL, so no holder of an
// engine lock waits for it.
constexpr size_t kKeepGilBytes = 64 * 1024;

class GilUntilWait final : public WaitHook {
 public:
  // keep false: let go at once, as NoGil.
  explicit GilUntilWait(bool keep) : prev_(current_wait_hook()), nogil_(!keep) {
    current_wait_hook() = this;
  }
  GilUntilWait(const GilUntilWait&) = delete;
  GilUntilWait& operator=(const GilUntilWait&) = delete;
  ~GilUntilWait() override { current_wait_hook() = prev_; }  // then nogil_ takes it back
  void before_wait() override { nogil_.let_go(); }

 private:
  WaitHook* prev_;
  NoGil nogil_;
};

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
  throw pybind11::error_already_set();
}

// What a Python object holds of the engine: the engine, a call, a received block. A
// forked child inherits it as a copy of the parent's (common/fork.h), so there it is
// never destroyed (that would wait for a progress thread the child lacks, or abandon a
// call or FIN a block through the parent's ring), and inherited() tells its users to
// refuse it.
template <class T>
class ForkLocal {
 public:
  explicit ForkLocal(T v) : v_(std::move(v)) {}
  ForkLocal(const ForkLocal&) = default;
  ForkLocal(ForkLocal&&) = default;
  ~ForkLocal() {
    if (inherited()) keep_forever(std::move(v_));
  }
  // Made before the fork() this process is the child of.
  bool inherited() const { return born_ != fork_generation(); }
  T& value() { return v_; }
  const T& value() const { return v_; }
  operator const T&() const { return v_; }
  // For a pointer-like T.
  auto operator->() const { return v_.operator->(); }
  decltype(auto) operator*() const { return *v_; }

 private:
  T v_;
  uint64_t born_ = fork_generation();
};

struct PyEngine {
  explicit PyEngine(std::shared_ptr<Engine> e) : engine(std::move(e)) {}
  ForkLocal<std::shared_ptr<Engine>> engine;
};

// A handle on a connection. Weak: the engine owns every live connection (until it
// fails or closes), and calls and zero-copy views own what they use, so a failed
// connection's fds and mappings go as soon as its last call or view does, not when
// the channel or listener that made it happens to look again.
// One channel's calls on a connection it may share with other channels (the engine's call
// group): shared by the copies of its handle, forgotten by the connection with the last.
struct CallGroup {
  CallGroup(uint64_t i, std::weak_ptr<Connection> c) : id(i), conn(std::move(c)) {}
  ~CallGroup();
  CallGroup(const CallGroup&) = delete;
  CallGroup& operator=(const CallGroup&) = delete;
  const uint64_t id;
  const std::weak_ptr<Connection> conn;
};

struct PyConnection {
  explicit PyConnection(std::shared_ptr<Engine> e) : engine(std::move(e)) {}
  ForkLocal<std::shared_ptr<Engine>> engine;
  std::weak_ptr<Connection> weak;
  std::shared_ptr<Epitaph> epitaph;  // why it failed, once it is gone
  std::string transport;
  std::string peer;
  std::shared_ptr<CallGroup> group;  // none: the handle's calls are in no group

  uint64_t group_id() const { return group ? group->id : 0; }
  // Another handle on the same connection whose calls form a group of their own.
  PyConnection share() const;

  static PyConnection make(std::shared_ptr<Engine> e, std::shared_ptr<Connection> c) {
    PyConnection pc(std::move(e));
    pc.weak = c;
    pc.epitaph = c->epitaph();
    pc.transport = c->fabric().name();
    pc.peer = c->peer_name();
    return pc;
  }
  // Null once failed or closed, and in a forked child (which then negotiates its own).
  std::shared_ptr<Connection> get() const {
    if (engine.inherited()) return nullptr;
    return weak.lock();
  }
  // For the test probes only: a call never throws for a connection that is gone.
  std::shared_ptr<Connection> need() const {
    auto c = get();
    if (!c) throw CoreError("argrpc: connection is closed");
    return c;
  }
  // The connection a new call starts on, or null: the channel chose this handle while
  // the connection lived, but another thread may fail, close or drop it before the call
  // gets here, and then the engine no longer holds it. The call then ends at birth with
  // gone_end(), as one started on a connection that failed but was still held does.
  std::shared_ptr<Connection> for_call();
  // How a call on this handle ends once its connection is gone: the connection's own
  // end (UNAVAILABLE and why it failed, or CANCELLED when it was closed).
  CallEnd gone_end() const;
  // Test-only fail point "route": the next for_call() fails the connection and waits
  // until nothing holds it any more, as if another thread had dropped it between the
  // channel's choice and this use (test_probes.cc).
  bool fail_before_use = false;
};

// A forked child's copy of the parent's server is the parent's (its locks may have been
// held by a parent thread at fork()): shutting it down or destroying it here would hang
// or act on the parent's state, so it is left alone.
struct PyServer {
  ForkLocal<std::shared_ptr<Engine>> engine;
  ForkLocal<std::shared_ptr<Server>> server;
};

// The server whose calls an attached connection carries (None: a client's connection).
inline std::shared_ptr<Server> server_arg(const pybind11::object& server) {
  return server.is_none() ? nullptr : server.cast<PyServer&>().server.value();
}

// A fabric's local half of a connection, from Engine.new_<fabric>_endpoint until
// Engine.attach_<fabric> takes it.
template <class Endpoint>
struct PyEndpoint {
  std::unique_ptr<Endpoint> ep;
  ConnConfig cfg;
  Endpoint& get() {
    if (!ep) throw CoreError("this endpoint was already attached");
    return *ep;
  }
  std::unique_ptr<Endpoint> take() {
    get();
    return std::move(ep);
  }
};

// A received message handed to Python: a memoryview over it keeps the block alive.
struct RecvBuffer {
  explicit RecvBuffer(Payload p) : payload(std::move(p)) {}
  ForkLocal<Payload> payload;
};

// Holds a Py_buffer for the duration of a send so no bytes copy is made of the object.
// The buffer a message to send is read from, held for the send.
class BufferView {
 public:
  explicit BufferView(const pybind11::object& o) {
    if (PyObject_GetBuffer(o.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) throw pybind11::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_;
};

// The handles Python holds on a call. Dropping an owning one abandons the call
// (cancels it if it still runs).
inline constexpr const char* kInheritedCall =
    "argrpc: this call belongs to the parent process (inherited through fork())";

struct PyClientCall {
  PyClientCall(std::shared_ptr<Engine> e, std::shared_ptr<Stream> st)
      : engine(std::move(e)), s(std::move(st)) {}
  // A call started on a connection already gone: it has no stream and ended at birth.
  PyClientCall(std::shared_ptr<Engine> e, CallEnd end)
      : engine(std::move(e)), s(nullptr), born_ended(std::move(end)) {}
  PyClientCall(const PyClientCall&) = delete;
  std::shared_ptr<Engine> engine;
  ForkLocal<std::shared_ptr<Stream>> s;
  CallEnd born_ended;
  // Nothing to act on (the parent's call in a forked child, or a call ended at birth):
  // every method answers as for a call that ended with end(), without a stream.
  bool inert() const { return s.inherited() || !s.value(); }
  CallEnd end() const {
    return s.inherited() ? CallEnd{kUnavailable, kInheritedCall} : born_ended;
  }
  ~PyClientCall() {
    if (inert() || !s->conn->abandon_needed(s)) return;
    NoGil nogil;
    s->conn->abandon(s);
  }
};

struct PyServerCall {
  PyServerCall(std::shared_ptr<Engine> e, std::shared_ptr<Stream> st, bool owner)
      : engine(std::move(e)), s(std::move(st)), owns(owner) {}
  PyServerCall(const PyServerCall&) = delete;
  std::shared_ptr<Engine> engine;
  ForkLocal<std::shared_ptr<Stream>> s;
  bool owns;  // the accept() handle; next_event() gives a non-owning one for a cancel
  ~PyServerCall() {
    if (!s.value() || s.inherited() || !owns || !s->conn->abandon_needed(s)) return;
    NoGil nogil;
    s->conn->abandon(s);
  }
};

// A call handle's Python object (ServerCall, ClientCall): a plain CPython type holding
// the handle, not a pybind11 class. Every call makes one; as a pybind11 instance its
// making and freeing (the instance registry, the holder) cost as much as the rest of a
// small call's bookkeeping. Its methods are still pybind11 functions: the caster at the
// end of this file hands them the handle.
template <class T>
struct HandleObject {
  PyObject_HEAD
  T* handle;  // owned
};

template <class T>
struct HandleType {
  static inline PyTypeObject* type = nullptr;  // made by add_handle_type
};

template <class T>
T* handle_of(PyObject* o) {
  return Py_TYPE(o) == HandleType<T>::type ? reinterpret_cast<HandleObject<T>*>(o)->handle
                                           : nullptr;
}

// What serving a planned call in one crossing (aio_serve.cc, server_serve.cc) takes from
// its arguments: the state's ServerCall, and the send limit into *max_send; nullptr with
// the error set (`who` names the function) when either is not what it must be.
inline PyServerCall* planned_call(PyObject* sc, PyObject* max_send_obj, long long* max_send,
                                  const char* who) {
  *max_send = PyLong_AsLongLong(max_send_obj);
  if (*max_send == -1 && PyErr_Occurred()) return nullptr;
  PyServerCall* call = handle_of<PyServerCall>(sc);
  if (call == nullptr)
    PyErr_Format(PyExc_TypeError, "%s: the state's sc is not a ServerCall", who);
  return call;
}

// How a blocking unary call ended (Connection.unary, and the threaded unary-unary
// multicallable's call in C): `unsent` when retry_unsent allowed it and nothing left this
// process on a gone connection (the caller routes the call again); else its status,
// metadata and, if one came, its response.
struct UnaryEnd {
  bool unsent = false;
  uint32_t code = 0;
  std::string details;
  Metadata initial, trailing;
  bool got = false;
  Payload response;
};
// Starts, sends and waits out one unary call on `c` without the GIL (a signal handler
// that raises cancels it: pybind11::error_already_set).
UnaryEnd blocking_unary(PyConnection& c, const std::string& method, const Metadata& meta,
                        double timeout, const BufferView& req, bool retry_unsent);

// The object for a handle the engine gave.
template <class T>
pybind11::object wrap_handle(std::unique_ptr<T> h) {
  PyTypeObject* type = HandleType<T>::type;
  PyObject* o = type->tp_alloc(type, 0);
  if (o == nullptr) throw pybind11::error_already_set();
  reinterpret_cast<HandleObject<T>*>(o)->handle = h.release();
  return pybind11::reinterpret_steal<pybind11::object>(o);
}

template <class T>
void handle_dealloc(PyObject* o) {
  PyTypeObject* type = Py_TYPE(o);
  delete reinterpret_cast<HandleObject<T>*>(o)->handle;  // its destructor may end the call
  type->tp_free(o);
  Py_DECREF(type);  // a heap type's instances hold it
}

inline void restore_python_error(std::exception_ptr e);

// A handle type's methods, defined as a pybind11 class_ defines them.
class HandleMethods {
 public:
  explicit HandleMethods(PyTypeObject* type) : type_(reinterpret_cast<PyObject*>(type)) {}
  template <class F, class... Extra>
  HandleMethods& def(const char* name, F&& f, const Extra&... extra) {
    pybind11::cpp_function cf(std::forward<F>(f), pybind11::name(name),
                              pybind11::is_method(type_), extra...);
    type_.attr(name) = cf;
    return *this;
  }
  // A getset descriptor, not a property over a pybind11 function: a server reads a
  // call's key and method on every call, and a property's call through pybind11's
  // dispatcher costs ten times the getter. `name` is a literal; `f` takes the handle.
  template <class F>
  HandleMethods& def_property_readonly(const char* name, F&& f) {
    using Fn = std::decay_t<F>;
    using T = typename GetterOf<decltype(&Fn::operator())>::Handle;
    auto& getter = getters().emplace_back(std::make_unique<Getter>());
    getter->fn = std::make_unique<Fn>(std::forward<F>(f));
    getter->def = {const_cast<char*>(name), &get<T, Fn>, nullptr, nullptr, getter->fn.get()};
    PyObject* descr = PyDescr_NewGetSet(reinterpret_cast<PyTypeObject*>(type_.ptr()),
                                        &getter->def);
    if (descr == nullptr) throw pybind11::error_already_set();
    type_.attr(name) = pybind11::reinterpret_steal<pybind11::object>(descr);
    return *this;
  }

 private:
  template <class M>
  struct GetterOf;
  template <class C, class R, class A>
  struct GetterOf<R (C::*)(A) const> {
    using Handle = std::remove_reference_t<A>;
  };

  // A getter's function and its definition, which its descriptor points to: kept as
  // long as the process (the handle types are never freed before it ends).
  struct Getter {
    std::shared_ptr<void> fn;
    PyGetSetDef def{};
  };
  static std::deque<std::unique_ptr<Getter>>& getters() {
    static std::deque<std::unique_ptr<Getter>> all;
    return all;
  }

  template <class T, class Fn>
  static PyObject* get(PyObject* self, void* fn) {
    T* handle = handle_of<T>(self);
    if (handle == nullptr) {
      PyErr_SetString(PyExc_TypeError, "a call handle's attribute read on another object");
      return nullptr;
    }
    try {
      auto value = (*static_cast<Fn*>(fn))(*handle);
      if constexpr (std::is_base_of_v<pybind11::handle, decltype(value)>) {
        pybind11::object o = std::move(value);
        return o.release().ptr();
      } else {
        return pybind11::cast(std::move(value)).release().ptr();
      }
    } catch (...) {
      restore_python_error(std::current_exception());
      return nullptr;
    }
  }

  pybind11::handle type_;
};

// Makes module attribute `name` the handle type of T: no constructor (only the engine's
// calls make handles), not a base type. `qualified` and `doc` are literals (the type
// keeps the name's pointer).
template <class T>
HandleMethods add_handle_type(pybind11::module_& m, const char* qualified, const char* name,
                              const char* doc) {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void*>(handle_dealloc<T>)},
      {Py_tp_doc, const_cast<char*>(doc)},
      {0, nullptr},
  };
  static PyType_Spec spec = {qualified, sizeof(HandleObject<T>), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  PyObject* type = PyType_FromModuleAndSpec(m.ptr(), &spec, nullptr);
  if (type == nullptr) throw pybind11::error_already_set();
  HandleType<T>::type = reinterpret_cast<PyTypeObject*>(type);
  m.add_object(name, pybind11::handle(type));  // steals the type's reference
  return HandleMethods(HandleType<T>::type);
}

// Text that may come from a peer (a method name, a message quoting one): never fails on
// bytes that are not UTF-8.
inline pybind11::str lenient_str(const std::string& s) {
  return pybind11::reinterpret_steal<pybind11::str>(
      PyUnicode_DecodeUTF8(s.data(), pybind11::ssize_t(s.size()), "replace"));
}

Metadata to_metadata(const pybind11::object& o);
pybind11::list from_metadata(const Metadata& md);
// A server call's method name as a str, the same object for the same name.
pybind11::str method_name(const std::string& method);
// A server call's metadata when it carries only the user-agent (or nothing).
pybind11::tuple user_agent_only(const std::string& ua);
// bytes for an eager message, a memoryview keeping the pool block for a large one.
pybind11::object to_python(Payload&& p);
// A caller's timeout for the engine, whose "none" is negative: a negative or NaN one has
// expired (grpc ends such a call DEADLINE_EXCEEDED at once), never "none".
inline double user_timeout(double t) { return t >= 0 ? t : 0.0; }
// None as the engine's "none", else user_timeout().
double timeout_arg(const pybind11::object& t);
Deadline deadline_arg(const pybind11::object& t);
pybind11::tuple status_tuple(Stream& s);
// The same for a call with nothing to act on (PyClientCall::inert()): (code, details,
// trailing), and as Connection.unary returns an outcome.
pybind11::tuple status_tuple(const CallEnd& e);
pybind11::tuple unary_tuple(const CallEnd& e);

template <class T>
T get_or(const pybind11::dict& d, const char* key, T dflt) {
  return d.contains(key) ? d[key].cast<T>() : dflt;
}

// config.cc: the structs from argrpc._config's dicts, checked against the knobs' bounds.
EngineConfig engine_config(const pybind11::dict& d);
ConnConfig conn_config(const pybind11::dict& d);
VerbsConfig verbs_config(const pybind11::dict& d);
void add_config(pybind11::module_& m);      // config.cc: _config_defaults
void add_heap_stats(pybind11::module_& m);  // heap_stats.cc: _heap_stats
void add_buffers(pybind11::module_& m);     // buffers.cc: RecvBuffer
void add_peer_info(pybind11::module_& m);   // peer_info.cc: PeerInfo
pybind11::class_<PyEngine> add_engine(pybind11::module_& m);              // engine.cc
pybind11::class_<PyConnection> add_connection(pybind11::module_& m);      // connection.cc
HandleMethods add_client_call(pybind11::module_& m);                      // client_call.cc
pybind11::class_<PyServer> add_server(pybind11::module_& m);              // server.cc
HandleMethods add_server_call(pybind11::module_& m);                      // server_call.cc
// test_probes.cc: test-only hooks (_without_gil_for_test, Connection._probe_*)
void add_test_probes(pybind11::module_& m, pybind11::class_<PyConnection>& connection);

void add_shm(pybind11::module_& m, pybind11::class_<PyEngine>& engine);    // shm.cc
// shm.cc: a peer's fabric half as the handshake received it; owns its fds from the start.
ShmPeer shm_peer_arg(const pybind11::dict& peer);
void add_verbs(pybind11::module_& m, pybind11::class_<PyEngine>& engine);  // verbs.cc
void add_sim(pybind11::module_& m);  // sim.cc: test-only, _core._sim_pair
void add_log(pybind11::module_& m);  // log.cc: engine messages for Python's logging
// floor.cc: argrpc-bench's latency floor (a bare shm fabric) and memory-copy rate
void add_floor(pybind11::module_& m, pybind11::class_<PyEngine>& engine);
// call_stats.cc: per-call records for an application's metrics
void add_call_stats(pybind11::module_& m, pybind11::class_<PyConnection>& connection);
// Notifier::poll's limit in microseconds when only the engine's spin bounds it (about
// twelve days: longer than any spin).
inline constexpr int64_t kPollForeverUs = int64_t(1) << 40;

// aio.cc: an event loop's notifier: the engine posts the token of each watched call that
// changed, and the loop, watching the fd, drains them.
struct PyNotifier {
  std::shared_ptr<Notifier> n = std::make_shared<Notifier>();
  ForkLocal<bool> here{true};  // a forked child's copy must not drain the parent's
  PyNotifier() = default;
  PyNotifier(const PyNotifier&) = delete;
  PyNotifier& operator=(const PyNotifier&) = delete;
  // The loop's lease goes with it (the notifier itself may outlive it in a watch).
  ~PyNotifier() {
    if (!here.inherited()) n->end_lease();
  }
};

// aio.cc: what an awaited unary call does before it waits (ClientCall.answer_or_poll).
pybind11::object answer_or_poll(PyClientCall& c, PyNotifier& n, PyEngine& e,
                                pybind11::handle ready, uint64_t own);
// aio.cc: the loop's Notifier and the calls' and server's methods that never wait.
void add_aio(pybind11::module_& m, pybind11::class_<PyEngine>& engine,
             pybind11::class_<PyConnection>& connection,
             HandleMethods& client_call, pybind11::class_<PyServer>& server,
             HandleMethods& server_call);
// A static type's start, for the units that define raw CPython types (aio_call.cc,
// aio_server_state.cc): what PyType_Ready needs before the slots.
inline PyTypeObject static_type(const char* name, const char* doc, Py_ssize_t size,
                                unsigned long flags) {
  PyTypeObject t{};
  Py_SET_REFCNT(reinterpret_cast<PyObject*>(&t), 1);
  t.tp_name = name;
  t.tp_doc = doc;
  t.tp_basicsize = size;
  t.tp_flags = flags;
  return t;
}
// The object fields of a raw type (the aio ones above) that are exactly its T_OBJECT_EX
// members, `Members` its tp_members table: its GC slots walk that one list.
// A field of a raw type set to `value`, the old one let go.
inline void set_field(PyObject** field, PyObject* value) {
  Py_INCREF(value);
  Py_XSETREF(*field, value);
}
// An attribute's name made once, for the process's life: interned, as a type's
// attribute cache wants it (a name made afresh from a C string misses it and searches
// the class's whole MRO).
inline PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw pybind11::error_already_set();
  return s;
}
inline PyObject** member_field(PyObject* o, const PyMemberDef* m) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + m->offset);
}
template <const PyMemberDef* Members>
int traverse_members(PyObject* o, visitproc visit, void* arg) {
  for (const PyMemberDef* m = Members; m->name != nullptr; ++m)
    if (m->type == T_OBJECT_EX) Py_VISIT(*member_field(o, m));
  return 0;
}
template <const PyMemberDef* Members>
int clear_members(PyObject* o) {
  for (const PyMemberDef* m = Members; m->name != nullptr; ++m)
    if (m->type == T_OBJECT_EX) Py_CLEAR(*member_field(o, m));
  return 0;
}
template <const PyMemberDef* Members>
void dealloc_members(PyObject* o) {
  PyObject_GC_UnTrack(o);
  clear_members<Members>(o);
  Py_TYPE(o)->tp_free(o);
}
// Each of them None (a new object's defaults, before what its tp_new sets otherwise).
template <const PyMemberDef* Members>
void none_members(PyObject* o) {
  for (const PyMemberDef* m = Members; m->name != nullptr; ++m)
    if (m->type == T_OBJECT_EX) Py_XSETREF(*member_field(o, m), Py_NewRef(Py_None));
}

// A fields type's tp_new when every field starts as None.
template <const PyMemberDef* Members>
PyObject* none_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self != nullptr) none_members<Members>(self);
  return self;
}

// The Python exception being raised, taken (the error cleared), normalized and with its
// traceback set on it, as an except clause would see it; nullptr if none is.
inline PyObject* take_exception() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

// A C++ exception caught in a raw CPython function (catch (...)), set as the Python
// error it stands for: pybind11's own as it is, any other as RuntimeError.
inline void restore_python_error(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (pybind11::error_already_set& err) {
    err.restore();
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
}

// A keyword argument's name is `name` (interned: the same object, unless the caller
// built the key).
inline bool is_keyword(PyObject* key, PyObject* name) {
  return key == name || (PyUnicode_Check(key) && PyUnicode_Compare(key, name) == 0);
}

// A multicallable's tp_call after its short way gave `answer`: that answer or its error,
// else (nullptr, no error) self.<general>(*args, **kwargs), the Python way.
inline PyObject* or_general(PyObject* self, PyObject* answer, PyObject* general_name,
                            PyObject* args, PyObject* kwargs) {
  if (answer != nullptr || PyErr_Occurred()) return answer;
  PyObject* general = PyObject_GetAttr(self, general_name);
  if (general == nullptr) return nullptr;
  answer = PyObject_Call(general, args, kwargs);
  Py_DECREF(general);
  return answer;
}

// A T_OBJECT_EX member of struct `type`: never NULL while the object lives, which CPython
// (3.11) reads and writes as a __slots__ slot; any other member kind (T_OBJECT, T_BOOL,
// integers) takes the generic attribute lookup, several times slower.
#define ARGRPC_OBJECT_MEMBER(type, name, field) \
  { const_cast<char*>(name), T_OBJECT_EX, offsetof(type, field), 0, nullptr }

// A subclassable GC type of such fields, its GC slots and members from `Members`.
template <const PyMemberDef* Members>
PyTypeObject fields_type(const char* name, const char* doc, Py_ssize_t size, newfunc make,
                         initproc init) {
  PyTypeObject t = static_type(name, doc, size,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC);
  t.tp_new = make;
  t.tp_init = init;
  t.tp_dealloc = dealloc_members<Members>;
  t.tp_traverse = traverse_members<Members>;
  t.tp_clear = clear_members<Members>;
  t.tp_members = const_cast<PyMemberDef*>(Members);
  return t;
}

// aio_call.cc: CallState and UnaryCallState, the C part of argrpc.aio's call objects.
void add_aio_call(pybind11::module_& m);
// server_serve.cc: ThreadedCallState (the C base of the threaded server's call state)
// and serve_planned, its planned unary call served in one crossing.
void add_server_serve(pybind11::module_& m);
// aio_loop_state.cc: LoopBridgeState and ChannelState, the C bases of argrpc.aio's loop
// bridge and channel.
void add_aio_loop_state(pybind11::module_& m);
// aio_unary_callable.cc: UnaryCallableState, argrpc.aio's unary-unary multicallable
// called in C.
void add_aio_unary_callable(pybind11::module_& m);
// unary_callable.cc: MultiCallableState, the C base of the threaded API's
// multicallables; a unary-unary one is called in C.
void add_unary_callable(pybind11::module_& m);
// aio_server_state.cc: ServerCallState and AioServerState, the fields of argrpc.aio's
// server-side call state and of its server.
void add_aio_server_state(pybind11::module_& m);
// aio_serve.cc: answer_unary, a planned unary method's call answered in one crossing, and
// ServerPass, an asyncio server's loop callback.
void add_aio_serve(pybind11::module_& m);
// aio.cc: a server call's next message (None: not yet, False: none will come) and its
// end without waiting (SendResult as an int: 1 sent, 0 the call ended, -1 no room yet;
// `quiet`: the end this causes is not posted to the call's watch).
// aio.cc: a unary call started, watched and its request sent with its headers and
// half-close in one step (Connection.start_unary_watched): (ClientCall, sent) with sent
// as try_send's, or None when retry_unsent and nothing was sent on a gone connection.
pybind11::object start_unary(PyConnection& c, const std::string& method, const Metadata& md,
                             double timeout, PyNotifier& n, uint64_t token,
                             const BufferView& request, bool retry_unsent);
pybind11::object try_recv_call(PyServerCall& c);
int try_finish_call(PyServerCall& c, uint32_t code, const std::string& details,
                    const Metadata& md, const pybind11::object& message, bool quiet);

}  // namespace bindings
}  // namespace argrpc

// pybind11 functions take a call handle (as PyServerCall& or PyClientCall&) from its raw
// type above; one is never converted back: wrap_handle makes the objects.
namespace pybind11 {
namespace detail {
template <class T>
class handle_caster {
 public:
  template <typename U>
  using cast_op_type = T&;
  bool load(handle src, bool) {
    value_ = argrpc::bindings::handle_of<T>(src.ptr());
    return value_ != nullptr;
  }
  explicit operator T&() { return *value_; }

 private:
  T* value_ = nullptr;
};
template <>
class type_caster<argrpc::bindings::PyServerCall>
    : public handle_caster<argrpc::bindings::PyServerCall> {
 public:
  static constexpr auto name = const_name("ServerCall");
};
template <>
class type_caster<argrpc::bindings::PyClientCall>
    : public handle_caster<argrpc::bindings::PyClientCall> {
 public:
  static constexpr auto name = const_name("ClientCall");
};
}  // namespace detail
}  // namespace pybind11
