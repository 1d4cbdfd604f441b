// The C part of argrpc.aio's fast-path call objects (argrpc/aio/_call.py). A unary
// call made and awaited from a coroutine costs its loop only a few engine operations,
// so the Python frames of its state, its end and its await were a large part of an
// asyncio round trip (docs/benchmarks.md). Here: CallState, the fields every call has (C members, so a call needs no
// instance dict) and its end (_on_end); UnaryCallState, the await of a call with one
// response, which asks the engine in one crossing and finishes an OK call without a
// Python frame. The rare outcomes (an error status, a cancelled or refused call, a
// response over the method's limit) go to the Python class's _settle, the collected
// unfinished call to its _collected: what grpc.aio says there is written once, in Python.
//
// Raw CPython types rather than pybind11 classes: a pybind11 method's dispatch costs as
// much as the work here, an await needs the am_send slot (a result without raising
// StopIteration), and the types are subclassed by Python classes with ABC bases.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <string>

#include "bindings/aio_call.h"
#include "bindings/aio_loop_state.h"
#include "bindings/bindings.h"

namespace py = pybind11;

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject* Py_NewRef(PyObject* o) {
  Py_INCREF(o);
  return o;
}
#endif

namespace argrpc {
namespace bindings {

namespace {

struct CallState {
  PyObject_HEAD
  PyObject* channel;
  PyObject* bridge;
  PyObject* core;
  PyObject* deadline;
  PyObject* deserializer;
  PyObject* waiters;
  PyObject* done_callbacks;
  PyObject* send_error;
  PyObject* status;
  PyObject* imd;
  PyObject* sender;
  PyObject* request_poller;
  PyObject* peeked;
  PyObject* result;
  unsigned long long token;
  long long max_send;
  long long max_response;
  char ended;
  char locally_cancelled;
  char have_result;
};

// Interned names and the objects the await needs, made once at import.
struct Names {
  PyObject* next;
  PyObject* callbacks;
  PyObject* on_change;
  PyObject* bridge_inflight;
  PyObject* send_later;
  PyObject* finished;
  PyObject* inflight;
  PyObject* closing;
  PyObject* call_ended;
  PyObject* run_callback;
  PyObject* future;
  PyObject* blocking;
  PyObject* run;
  PyObject* notifier;
  PyObject* engine;
  PyObject* ready;
  PyObject* settle;
  PyObject* collected;
  PyObject* deserialize_error;
  PyObject* done;
  PyObject* set_result;
  PyObject* cancel;
  PyObject* settled;
  PyObject* cancelled_error;  // asyncio.CancelledError
};
Names names;
PyObject* one;        // 1 and -1, for the counts kept in Python objects
PyObject* minus_one;
PyObject* no_args;    // (), for a type's tp_new

bool is_none(PyObject* o) { return o == nullptr || o == Py_None; }

// obj.<name> += delta (a count kept in a Python object's int attribute).
int add_to(PyObject* obj, PyObject* name, PyObject* delta) {
  PyObject* n = PyObject_GetAttr(obj, name);
  if (n == nullptr) return -1;
  PyObject* sum = PyNumber_Add(n, delta);
  Py_DECREF(n);
  if (sum == nullptr) return -1;
  const int r = PyObject_SetAttr(obj, name, sum);
  Py_DECREF(sum);
  return r;
}

extern PyMemberDef call_members[];

PyObject* call_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<CallState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->max_send = -1;
  self->max_response = -1;
  none_members<call_members>(reinterpret_cast<PyObject*>(self));  // not NULL: see call_members
  return reinterpret_cast<PyObject*>(self);
}

// A call collected before it ended (dropped by its caller and no longer held by its
// loop): the Python class cancels it and lets its loop and channel go of it.
void call_finalize(PyObject* o) {
  auto* self = reinterpret_cast<CallState*>(o);
  if (self->ended) return;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* r = PyObject_CallMethodNoArgs(o, names.collected);
  if (r == nullptr)
    PyErr_Clear();  // interpreter shutdown: nothing left to tell
  else
    Py_DECREF(r);
  PyErr_Restore(type, value, tb);
}

// _on_end: the call ended. Its loop's bridge lets go of it (a unary call is held there
// until it ends), its channel counts it out, and its done callbacks run.
// Set up by the Python class's constructor; a bare CallState has none of it.
bool set_up(CallState* self) {
  if (!is_none(self->bridge) && !is_none(self->channel) && !is_none(self->core)) return true;
  PyErr_SetString(PyExc_RuntimeError,
                  "argrpc: this call object was not made by an argrpc.aio channel");
  return false;
}

// Every task waiting for the call's next change (_future) woken: on every change
// (_on_change) and at the end.
int wake_waiters(CallState* self) {
  if (is_none(self->waiters)) return 0;
  PyObject* waiters = self->waiters;
  self->waiters = Py_NewRef(Py_None);
  PyObject* seq = PySequence_Fast(waiters, "waiters");
  Py_DECREF(waiters);
  if (seq == nullptr) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* fut = PySequence_Fast_GET_ITEM(seq, i);
    PyObject* done = PyObject_CallMethodNoArgs(fut, names.done);
    int woken = done == nullptr ? -1 : PyObject_IsTrue(done);  // 1: done already
    Py_XDECREF(done);
    if (woken == 0) {
      PyObject* r = PyObject_CallMethodOneArg(fut, names.set_result, Py_None);
      woken = r == nullptr ? -1 : 1;
      Py_XDECREF(r);
    }
    if (woken < 0) {
      Py_DECREF(seq);
      return -1;
    }
  }
  Py_DECREF(seq);
  return 0;
}

int on_end(CallState* self) {
  if (!set_up(self)) return -1;
  self->ended = 1;
  // An awaiter that found the call ended took its outcome before the loop read the end's
  // post, which comes to nobody once the token is let go of below: whoever else waits
  // for the call's next change is woken here, or never.
  if (wake_waiters(self) < 0) return -1;
  PyObject* token = PyLong_FromUnsignedLongLong(self->token);
  if (token == nullptr) return -1;
  LoopBridgeState* bridge = loop_bridge_state(self->bridge);
  PyObject* r = bridge != nullptr
                    ? (finish_token(bridge, token) < 0 ? nullptr : Py_NewRef(Py_None))
                    : PyObject_CallMethodOneArg(self->bridge, names.finished, token);
  Py_DECREF(token);
  if (r == nullptr) return -1;
  Py_DECREF(r);
  PyObject* channel = self->channel;
  ChannelState* counted = channel_state(channel);
  int is_closing;
  if (counted != nullptr) {
    if (add_to_count(&counted->inflight, -1) < 0) return -1;
    is_closing = PyObject_IsTrue(counted->closing);
  } else {
    if (add_to(channel, names.inflight, minus_one) < 0) return -1;
    PyObject* closing = PyObject_GetAttr(channel, names.closing);
    if (closing == nullptr) return -1;
    is_closing = PyObject_IsTrue(closing);
    Py_DECREF(closing);
  }
  if (is_closing < 0) return -1;
  if (is_closing) {
    r = PyObject_CallMethodNoArgs(channel, names.call_ended);
    if (r == nullptr) return -1;
    Py_DECREF(r);
  }
  PyObject* callbacks = self->done_callbacks;
  if (!is_none(callbacks)) {
    self->done_callbacks = Py_NewRef(Py_None);
    PyObject* seq = PySequence_Fast(callbacks, "done callbacks");
    Py_DECREF(callbacks);
    if (seq == nullptr) return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      r = PyObject_CallMethodOneArg(reinterpret_cast<PyObject*>(self), names.run_callback,
                                    PySequence_Fast_GET_ITEM(seq, i));
      if (r == nullptr) {
        Py_DECREF(seq);
        return -1;
      }
      Py_DECREF(r);
    }
    Py_DECREF(seq);
  }
  return 0;
}

PyObject* call_on_end(PyObject* o, PyObject*) {
  if (on_end(reinterpret_cast<CallState*>(o)) < 0) return nullptr;
  Py_RETURN_NONE;
}

// _on_change: the call's token callback. The tasks waiting for a change are woken; a
// call whose engine side has settled ends here unless an awaiter ended it first.
PyObject* call_on_change(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<CallState*>(o);
  if (wake_waiters(self) < 0) return nullptr;
  if (!self->ended && !is_none(self->core)) {
    PyObject* settled = PyObject_CallMethodNoArgs(self->core, names.settled);
    const int is_settled = settled == nullptr ? -1 : PyObject_IsTrue(settled);
    Py_XDECREF(settled);
    if (is_settled < 0 || (is_settled && on_end(self) < 0)) return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef call_methods[] = {
    {"_on_end", call_on_end, METH_NOARGS,
     "The call ended: its loop and channel let go of it; its done callbacks run."},
    {"_on_change", call_on_change, METH_NOARGS,
     "The call changed: its waiting tasks wake; a settled call ends."},
    {nullptr, nullptr, 0, nullptr},
};

// Fields hold None rather than NULL, so that they can be T_OBJECT_EX members (bindings.h):
// the Python constructor sets six of them on every call.
#define OBJ_MEMBER(name, field) ARGRPC_OBJECT_MEMBER(CallState, name, field)
PyMemberDef call_members[] = {
    OBJ_MEMBER("_channel", channel),
    OBJ_MEMBER("_bridge", bridge),
    OBJ_MEMBER("_core", core),
    OBJ_MEMBER("_deadline", deadline),
    OBJ_MEMBER("_deserializer", deserializer),
    OBJ_MEMBER("_waiters", waiters),
    OBJ_MEMBER("_done_callbacks", done_callbacks),
    OBJ_MEMBER("_send_error", send_error),
    OBJ_MEMBER("_status", status),
    OBJ_MEMBER("_imd", imd),
    OBJ_MEMBER("_sender", sender),
    OBJ_MEMBER("_request_poller", request_poller),
    OBJ_MEMBER("_peeked", peeked),
    OBJ_MEMBER("_result", result),
    {const_cast<char*>("_token"), T_ULONGLONG, offsetof(CallState, token), 0, nullptr},
    {const_cast<char*>("max_send"), T_LONGLONG, offsetof(CallState, max_send), 0, nullptr},
    {const_cast<char*>("max_response"), T_LONGLONG, offsetof(CallState, max_response), 0,
     nullptr},
    {const_cast<char*>("_ended"), T_BOOL, offsetof(CallState, ended), 0, nullptr},
    {const_cast<char*>("_locally_cancelled"), T_BOOL, offsetof(CallState, locally_cancelled),
     0, nullptr},
    {const_cast<char*>("_have_result"), T_BOOL, offsetof(CallState, have_result), 0, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};
#undef OBJ_MEMBER

constexpr unsigned long kCallFlags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;

PyTypeObject call_state_type = [] {
  // A subclass's dealloc (every instance is one) runs the finalizer before the type's.
  PyTypeObject t = fields_type<call_members>(
      "argrpc._core.CallState", "The fields and the end every argrpc.aio fast-path call has.",
      sizeof(CallState), call_new, nullptr);
  t.tp_finalize = call_finalize;
  t.tp_methods = call_methods;
  return t;
}();

// ---------------------------------------------------------------- the await

enum class Step { kReturn, kNext, kError };

// The engine's answer for the call: its outcome tuple, a list of other calls' tokens, or
// None (wait). `own`: see answer_or_poll.
PyObject* ask(CallState* self, uint64_t own) {
  PyObject* bridge = self->bridge;
  PyObject *notifier, *engine, *ready;
  if (LoopBridgeState* fields = loop_bridge_state(bridge)) {
    notifier = Py_NewRef(fields->notifier);
    engine = Py_NewRef(fields->engine);
    ready = Py_NewRef(fields->ready);
  } else {
    notifier = PyObject_GetAttr(bridge, names.notifier);
    engine = notifier ? PyObject_GetAttr(bridge, names.engine) : nullptr;
    ready = engine ? PyObject_GetAttr(bridge, names.ready) : nullptr;
  }
  PyObject* out = nullptr;
  PyClientCall* call = handle_of<PyClientCall>(self->core);
  if (ready != nullptr && call == nullptr)
    PyErr_SetString(PyExc_TypeError, "the call's core is not a ClientCall");
  else if (ready != nullptr) {
    try {
      out = answer_or_poll(*call,
                           py::cast<PyNotifier&>(py::handle(notifier)),
                           py::cast<PyEngine&>(py::handle(engine)), py::handle(ready), own)
                .release()
                .ptr();
    } catch (...) {
      restore_python_error(std::current_exception());
    }
  }
  Py_XDECREF(notifier);
  Py_XDECREF(engine);
  Py_XDECREF(ready);
  return out;
}

// The end of the await with the call's outcome (code, details, initial metadata,
// trailing metadata, response or None). Consumes `outcome`.
Step settle(CallState* self, PyObject* outcome, PyObject** result) {
  PyObject* me = reinterpret_cast<PyObject*>(self);
  const long code = PyLong_AsLong(PyTuple_GET_ITEM(outcome, 0));
  if (code == -1 && PyErr_Occurred()) {
    Py_DECREF(outcome);
    return Step::kError;
  }
  if (code != 0 || self->locally_cancelled || !is_none(self->send_error) ||
      self->max_response >= 0) {
    *result = PyObject_CallMethodOneArg(me, names.settle, outcome);
    Py_DECREF(outcome);
    return *result ? Step::kReturn : Step::kError;
  }
  if (!self->ended && on_end(self) < 0) {
    Py_DECREF(outcome);
    return Step::kError;
  }
  PyObject* response = PyTuple_GET_ITEM(outcome, 4);
  PyObject* value;
  if (response == Py_None || is_none(self->deserializer)) {
    value = Py_NewRef(response);
  } else {
    value = PyObject_CallOneArg(self->deserializer, response);
    // As grpc.aio: a deserializer that raises is logged, and the application gets None.
    if (value == nullptr && PyErr_ExceptionMatches(PyExc_Exception)) {
      PyObject *type, *exc, *tb;
      PyErr_Fetch(&type, &exc, &tb);
      PyErr_NormalizeException(&type, &exc, &tb);
      if (tb != nullptr) PyException_SetTraceback(exc, tb);
      PyObject* r = PyObject_CallMethodOneArg(me, names.deserialize_error, exc);
      Py_XDECREF(type);
      Py_XDECREF(exc);
      Py_XDECREF(tb);
      if (r == nullptr) {
        Py_DECREF(outcome);
        return Step::kError;
      }
      Py_DECREF(r);
      value = Py_NewRef(Py_None);
    }
  }
  Py_DECREF(outcome);
  if (value == nullptr) return Step::kError;
  Py_XSETREF(self->result, Py_NewRef(value));
  self->have_result = 1;
  *result = value;
  return Step::kReturn;
}

Step unary_step(PyObject* o, PyObject** result) {
  auto* self = reinterpret_cast<CallState*>(o);
  *result = nullptr;
  if (self->have_result) {
    *result = Py_NewRef(self->result ? self->result : Py_None);
    return Step::kReturn;
  }
  if (!set_up(self)) return Step::kError;
  for (;;) {
    // Only the awaiting task waits: the call's own post would only end it, which the
    // outcome does here.
    const uint64_t own = is_none(self->waiters) ? self->token : 0;
    PyObject* outcome = ask(self, own);
    if (outcome == nullptr) return Step::kError;
    if (outcome == Py_None) {
      Py_DECREF(outcome);
      PyObject* fut = PyObject_CallMethodNoArgs(o, names.future);
      if (fut == nullptr) return Step::kError;
      // What a future's own __await__ sets before it yields itself to the task.
      if (PyObject_SetAttr(fut, names.blocking, Py_True) < 0) {
        Py_DECREF(fut);
        return Step::kError;
      }
      *result = fut;
      return Step::kNext;
    }
    if (PyList_CheckExact(outcome)) {  // other calls' changes, seen by the poll
      PyObject* r = PyObject_CallMethodOneArg(self->bridge, names.run, outcome);
      Py_DECREF(outcome);
      if (r == nullptr) return Step::kError;
      Py_DECREF(r);
      continue;
    }
    if (!PyTuple_CheckExact(outcome) || PyTuple_GET_SIZE(outcome) != 5) {
      Py_DECREF(outcome);
      PyErr_SetString(PyExc_SystemError, "argrpc: a unary call's outcome is malformed");
      return Step::kError;
    }
    return settle(self, outcome, result);
  }
}

// The await's iterator: the call's own, not the call, which is awaitable but not
// iterable (as grpc.aio's). Holds only the call, so it needs no part in the collector.
struct Awaiter {
  PyObject_HEAD
  PyObject* call;
};

void awaiter_dealloc(PyObject* o) {
  Py_XDECREF(reinterpret_cast<Awaiter*>(o)->call);
  Py_TYPE(o)->tp_free(o);
}

PyObject* call_of(PyObject* o) { return reinterpret_cast<Awaiter*>(o)->call; }

#if PY_VERSION_HEX >= 0x030A0000
PySendResult awaiter_send(PyObject* o, PyObject*, PyObject** result) {
  switch (unary_step(call_of(o), result)) {
    case Step::kReturn: return PYGEN_RETURN;
    case Step::kNext: return PYGEN_NEXT;
    case Step::kError: break;
  }
  return PYGEN_ERROR;
}
#endif

// For whoever drives the await without am_send (a tracer, Python before 3.10).
PyObject* awaiter_next(PyObject* o) {
  PyObject* result;
  switch (unary_step(call_of(o), &result)) {
    case Step::kNext: return result;
    case Step::kError: return nullptr;
    case Step::kReturn: break;
  }
  if (result != Py_None) {
    PyObject* stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    if (stop != nullptr) {
      PyErr_SetObject(PyExc_StopIteration, stop);
      Py_DECREF(stop);
    }
  }
  Py_DECREF(result);
  return nullptr;  // with no exception set: StopIteration(None)
}

// What the awaiting coroutine is thrown (its task's cancellation) comes here while it
// waits on the call's future: a cancelled await cancels the call, as grpc.aio's does;
// the exception goes on either way.
PyObject* awaiter_throw(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 3) {
    PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
    return nullptr;
  }
  PyObject* call = call_of(o);
  PyObject* typ = args[0];
  PyObject* val = nargs > 1 ? args[1] : nullptr;
  PyObject* tb = nargs > 2 && args[2] != Py_None ? args[2] : nullptr;
  const int cancelled = PyExceptionInstance_Check(typ)
                            ? PyObject_IsInstance(typ, names.cancelled_error)
                            : (PyType_Check(typ) ? PyObject_IsSubclass(typ, names.cancelled_error)
                                                 : 0);
  if (cancelled < 0) return nullptr;
  if (cancelled) {
    PyObject* done = PyObject_CallMethodNoArgs(call, names.done);
    if (done == nullptr) return nullptr;
    const int is_done = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (is_done < 0) return nullptr;
    if (!is_done) {
      PyObject* r = PyObject_CallMethodNoArgs(call, names.cancel);
      if (r == nullptr) return nullptr;
      Py_DECREF(r);
    }
  }
  if (PyExceptionInstance_Check(typ)) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(typ)), typ);
  } else if (PyExceptionClass_Check(typ)) {
    PyErr_SetObject(typ, val ? val : Py_None);
  } else {
    PyErr_SetString(PyExc_TypeError, "exceptions must derive from BaseException");
    return nullptr;
  }
  if (tb != nullptr) {
    PyObject *t, *v, *old_tb;
    PyErr_Fetch(&t, &v, &old_tb);
    PyErr_NormalizeException(&t, &v, &old_tb);
    Py_XDECREF(old_tb);
    PyErr_Restore(t, v, Py_NewRef(tb));
  }
  return nullptr;
}

PyMethodDef awaiter_methods[] = {
    {"throw", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(awaiter_throw)),
     METH_FASTCALL, "What the awaiting coroutine is thrown while it waits on the call."},
    {nullptr, nullptr, 0, nullptr},
};

PyAsyncMethods awaiter_async = [] {
  PyAsyncMethods a{};
#if PY_VERSION_HEX >= 0x030A0000
  a.am_send = awaiter_send;
#endif
  return a;
}();

PyTypeObject awaiter_type = [] {
  PyTypeObject t = static_type("argrpc._core.UnaryAwait", "The iterator of a unary call's await.",
                               sizeof(Awaiter), Py_TPFLAGS_DEFAULT);
  t.tp_dealloc = awaiter_dealloc;
  t.tp_as_async = &awaiter_async;
  t.tp_iter = PyObject_SelfIter;
  t.tp_iternext = awaiter_next;
  t.tp_methods = awaiter_methods;
  return t;
}();

PyObject* unary_await(PyObject* o) {
  auto* a = PyObject_New(Awaiter, &awaiter_type);
  if (a == nullptr) return nullptr;
  a->call = Py_NewRef(o);
  return reinterpret_cast<PyObject*>(a);
}

PyAsyncMethods unary_async = [] {
  PyAsyncMethods a{};
  a.am_await = unary_await;
  return a;
}();

PyTypeObject unary_state_type = [] {
  PyTypeObject t = static_type("argrpc._core.UnaryCallState",
                               "CallState awaited for its one response.", sizeof(CallState),
                               kCallFlags);
  t.tp_base = &call_state_type;
  t.tp_traverse = traverse_members<call_members>;
  t.tp_clear = clear_members<call_members>;
  t.tp_as_async = &unary_async;
  return t;
}();

// ------------------------------------------------------------- the start

// The bridge's register() for `call`: its `_on_change` under the next token, which
// goes to *token (the bridge's own int in *token_obj).
int register_call(PyObject* bridge, PyObject* call, uint64_t* token, PyObject** token_obj) {
  if (LoopBridgeState* fields = loop_bridge_state(bridge)) {
    PyObject* on_change = PyObject_GetAttr(call, names.on_change);
    if (on_change == nullptr) return -1;
    unsigned long long t = 0;
    const int r = register_callback(fields, on_change, &t, token_obj);
    Py_DECREF(on_change);
    *token = t;
    return r;
  }
  PyObject* next = PyObject_GetAttr(bridge, names.next);
  if (next == nullptr) return -1;
  *token = PyLong_AsUnsignedLongLong(next);
  PyObject* callbacks = nullptr;
  PyObject* on_change = nullptr;
  int r = -1;
  if (!PyErr_Occurred() && add_to(bridge, names.next, one) == 0 &&
      (callbacks = PyObject_GetAttr(bridge, names.callbacks)) != nullptr &&
      (on_change = PyObject_GetAttr(call, names.on_change)) != nullptr)
    r = PyObject_SetItem(callbacks, next, on_change);
  Py_XDECREF(callbacks);
  Py_XDECREF(on_change);
  if (r < 0) {
    Py_DECREF(next);
    return -1;
  }
  *token_obj = next;
  return 0;
}

// The wall clock, as time.time() reads it: a call's deadline is kept on it.
double wall_seconds() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

}  // namespace

// What UnaryUnaryCall(channel, bridge, conn, method, [], timeout, request, deserializer,
// retry_unsent) makes, without its Python constructors: the call object, its token
// registered with the bridge, the call started and its request sent with its headers (or
// left to _send_later when the stream has no room yet), counted in flight by the bridge
// and the channel. None: nothing was sent on a gone connection, because it was found dead
// before the call started or retry_unsent allows another route (the caller routes the
// call again); NotImplemented: the request is no buffer, which the Python constructor
// reports as grpc.aio does.
PyObject* make_unary(PyTypeObject* type, PyObject* channel, PyObject* bridge, PyObject* conn_obj,
                     PyObject* method_obj, PyObject* timeout_obj, PyObject* request,
                     PyObject* deserializer, bool retry_unsent) {
  PyConnection* conn = nullptr;
  try {
    conn = &py::cast<PyConnection&>(py::handle(conn_obj));
    auto live = conn->get();
    // Found dead since the channel chose it: routed again, whatever retry_unsent says
    // (nothing was sent).
    if (!live || !live->alive()) Py_RETURN_NONE;
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  if (!PyObject_CheckBuffer(request)) Py_RETURN_NOTIMPLEMENTED;
  double timeout = -1;
  if (timeout_obj != Py_None) {
    timeout = PyFloat_AsDouble(timeout_obj);
    if (timeout == -1 && PyErr_Occurred()) return nullptr;
    timeout = user_timeout(timeout);
  }
  PyObject* o = type->tp_new(type, no_args, nullptr);
  if (o == nullptr) return nullptr;
  auto* self = reinterpret_cast<CallState*>(o);
  uint64_t token = 0;
  PyObject* token_obj = nullptr;
  if (register_call(bridge, o, &token, &token_obj) < 0) {
    Py_DECREF(o);
    return nullptr;
  }
  py::object started;
  try {
    Py_ssize_t n = 0;
    const char* method = PyUnicode_AsUTF8AndSize(method_obj, &n);
    if (method == nullptr) throw py::error_already_set();
    LoopBridgeState* fields = loop_bridge_state(bridge);
    PyObject* notifier = fields != nullptr ? Py_NewRef(fields->notifier)
                                           : PyObject_GetAttr(bridge, names.notifier);
    if (notifier == nullptr) throw py::error_already_set();
    py::object hold = py::reinterpret_steal<py::object>(notifier);
    BufferView b(py::reinterpret_borrow<py::object>(request));
    started = start_unary(*conn,
                          std::string(method, static_cast<size_t>(n)), Metadata(), timeout,
                          py::cast<PyNotifier&>(hold), token, b, retry_unsent);
  } catch (...) {
    restore_python_error(std::current_exception());
  }
  if (!started || started.is_none()) {
    // Not started: the bridge lets go of its token, as the Python constructor does.
    PyObject* callbacks = PyObject_GetAttr(bridge, names.callbacks);
    PyObject *type_e, *value_e, *tb_e;
    PyErr_Fetch(&type_e, &value_e, &tb_e);
    if (callbacks == nullptr || PyObject_DelItem(callbacks, token_obj) < 0) PyErr_Clear();
    PyErr_Restore(type_e, value_e, tb_e);
    Py_XDECREF(callbacks);
    Py_DECREF(token_obj);
    Py_DECREF(o);
    if (!started) return nullptr;
    Py_RETURN_NONE;
  }
  Py_DECREF(token_obj);
  PyObject* core = PyTuple_GET_ITEM(started.ptr(), 0);
  const long sent = PyLong_AsLong(PyTuple_GET_ITEM(started.ptr(), 1));
  set_field(&self->channel, channel);
  set_field(&self->bridge, bridge);
  set_field(&self->core, core);
  self->token = token;
  set_field(&self->deserializer, deserializer);
  if (timeout_obj != Py_None) {  // as FastCall's constructor: time.time() + timeout
    PyObject* deadline = PyFloat_FromDouble(wall_seconds() + timeout);
    if (deadline == nullptr) {
      Py_DECREF(o);
      return nullptr;
    }
    Py_SETREF(self->deadline, deadline);
  }
  // FastCall's constructor: the bridge's started() and the channel's count.
  LoopBridgeState* bridge_fields = loop_bridge_state(bridge);
  ChannelState* channel_fields = channel_state(channel);
  if ((bridge_fields != nullptr ? add_to_count(&bridge_fields->inflight, 1)
                                : add_to(bridge, names.bridge_inflight, one)) < 0 ||
      (channel_fields != nullptr ? add_to_count(&channel_fields->inflight, 1)
                                 : add_to(channel, names.inflight, one)) < 0) {
    Py_DECREF(o);
    return nullptr;
  }
  if (sent < 0) {
    PyObject* r = PyObject_CallMethodOneArg(o, names.send_later, request);
    if (r == nullptr) {
      Py_DECREF(o);
      return nullptr;
    }
    Py_DECREF(r);
  }
  return o;
}

namespace {

// make_unary_call(cls, channel, bridge, conn, method, timeout, request, deserializer,
// retry_unsent): make_unary's arguments checked.
PyObject* make_unary_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9 || !PyType_Check(args[0]) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[0]), &unary_state_type) ||
      !PyUnicode_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "make_unary_call(cls, channel, bridge, conn, method, timeout, request, "
                    "deserializer, retry_unsent): cls a UnaryCallState type, method a str");
    return nullptr;
  }
  const int retry_unsent = PyObject_IsTrue(args[8]);
  if (retry_unsent < 0) return nullptr;
  return make_unary(reinterpret_cast<PyTypeObject*>(args[0]), args[1], args[2], args[3],
                    args[4], args[5], args[6], args[7], retry_unsent != 0);
}

PyMethodDef start_functions[] = {
    {"make_unary_call",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(make_unary_call)),
     METH_FASTCALL,
     "An argrpc.aio unary call made and started in one crossing "
     "(csrc/bindings/aio_call.cc)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_aio_call(py::module_& m) {
  struct {
    PyObject** slot;
    const char* text;
  } const names_made[] = {
      {&names.finished, "finished"},     {&names.inflight, "inflight"},
      {&names.closing, "closing"},       {&names.call_ended, "call_ended"},
      {&names.run_callback, "_run_callback"}, {&names.future, "_future"},
      {&names.blocking, "_asyncio_future_blocking"}, {&names.run, "run"},
      {&names.notifier, "notifier"},     {&names.engine, "engine"},
      {&names.ready, "ready"},           {&names.settle, "_settle"},
      {&names.collected, "_collected"},  {&names.deserialize_error, "_deserialize_error"},
      {&names.done, "done"},             {&names.cancel, "cancel"},
      {&names.set_result, "set_result"}, {&names.settled, "settled"},
      {&names.next, "_next"},            {&names.callbacks, "_callbacks"},
      {&names.on_change, "_on_change"},  {&names.bridge_inflight, "_inflight"},
      {&names.send_later, "_send_later"},
  };
  for (const auto& n : names_made) *n.slot = interned(n.text);
  one = PyLong_FromLong(1);
  minus_one = PyLong_FromLong(-1);
  no_args = PyTuple_New(0);
  if (one == nullptr || minus_one == nullptr || no_args == nullptr)
    throw py::error_already_set();
  if (PyModule_AddFunctions(m.ptr(), start_functions) < 0) throw py::error_already_set();
  names.cancelled_error =
      py::object(py::module_::import("asyncio").attr("CancelledError")).release().ptr();
  if (PyType_Ready(&call_state_type) < 0 || PyType_Ready(&unary_state_type) < 0 ||
      PyType_Ready(&awaiter_type) < 0)
    throw py::error_already_set();
  m.add_object("CallState", py::handle(reinterpret_cast<PyObject*>(&call_state_type)));
  m.add_object("UnaryCallState", py::handle(reinterpret_cast<PyObject*>(&unary_state_type)));
}

}  // namespace bindings
}  // namespace argrpc
