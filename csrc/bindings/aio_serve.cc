// A planned unary method's call answered in one crossing (argrpc.aio's server,
// _start_call): a registered unary-unary `async def` method with no interceptors, whose
// request is there when the call comes and whose handler answers without waiting, is the
// common call of a model or parameter server. In Python its steps were a coroutine
// (serve), a context switch into the call's context, two engine calls through pybind11
// and the frames of the quiet end (_end_unary, raise_for_termination); here they are one
// C function, which runs the handler's first step in the call's context as a task would.
//
// Every other outcome goes back to the Python server, which goes on from where this
// stopped (serve() with `started`): no request yet, the handler raising or waiting, an
// awaitable that is not a coroutine, a status, details or trailing metadata the handler
// set, an abort, a send limit, a response the serializer must see as text, no room to
// send the end yet. What grpc.aio does there is written once, in Python.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings/aio_server_state.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

// What answer_unary hands to the Python server (argrpc/aio/_server_handlers.py, serve).
enum Started : int {
  kRaised = 0,    // (0, exception): raised before the answer; serve() handles it
  kWaits = 1,     // (1, coroutine, yielded): the handler waits; carried on from there
  kAwait = 2,     // (2, awaitable): the behaviour gave an awaitable that is no coroutine
  kReturned = 3,  // (3, response): the handler answered; the Python end sends it
  kSend = 4,      // (4, message): the status is marked sent; the end waits for room
};

// The exception being raised, as (kRaised, exception) with its traceback; clears it.
PyObject* raised() {
  PyObject* value = take_exception();
  if (value == nullptr) return nullptr;
  return Py_BuildValue("(iN)", kRaised, value);
}

bool is_zero(PyObject* o) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  return PyLong_AsLongLongAndOverflow(o, &overflow) == 0 && overflow == 0;
}

// The handler answered `response` (a new reference, consumed): the end, at once when
// nothing about the call asks for more than an OK status with the state's details.
PyObject* end_quietly(ServerCallState* st, PyServerCall& call, PyObject* response,
                      PyObject* serializer, long long max_send) {
  const int no_trailing = PyObject_Not(st->trailing_metadata);
  if (no_trailing < 0) {
    Py_DECREF(response);
    return raised();
  }
  if (st->abort_exception != Py_None || st->status_sent != Py_False ||
      !is_zero(st->status_code) || max_send >= 0 || !no_trailing ||
      !PyUnicode_CheckExact(st->status_details) || PyUnicode_Check(response) ||
      (serializer == Py_None && !PyBytes_CheckExact(response)))
    return Py_BuildValue("(iN)", kReturned, response);
  PyObject* message = response;
  if (serializer != Py_None) {
    message = PyObject_CallOneArg(serializer, response);
    Py_DECREF(response);
    if (message == nullptr) return raised();
    // As argrpc/aio/_context.py's serialize: None is an empty message, anything else
    // that is no buffer the handler's error, raised before the status is marked sent.
    if (message == Py_None) {
      Py_SETREF(message, PyBytes_FromStringAndSize(nullptr, 0));
      if (message == nullptr) return raised();
    } else if (!PyBytes_CheckExact(message) && !PyObject_CheckBuffer(message)) {
      PyErr_Format(PyExc_TypeError, "Expected bytes, got %s", Py_TYPE(message)->tp_name);
      Py_DECREF(message);
      return raised();
    }
  }
  Py_ssize_t n = 0;
  const char* details = PyUnicode_AsUTF8AndSize(st->status_details, &n);
  if (details == nullptr) {
    Py_DECREF(message);
    return raised();
  }
  set_field(&st->metadata_sent, Py_True);
  set_field(&st->status_sent, Py_True);
  int sent = -1;
  try {
    sent = try_finish_call(call, 0, std::string(details, static_cast<size_t>(n)), Metadata(),
                           py::reinterpret_borrow<py::object>(message), true);
  } catch (...) {
    restore_python_error(std::current_exception());
    Py_DECREF(message);
    return raised();
  }
  if (sent < 0) return Py_BuildValue("(iN)", kSend, message);
  Py_DECREF(message);
  Py_RETURN_TRUE;
}

// In the call's context: the request, the handler's first step, and its end.
PyObject* first_step(ServerCallState* st, PyServerCall& call, PyObject* plan,
                     PyObject* context_type, long long max_send) {
  PyObject* behavior = PyTuple_GET_ITEM(plan, 0);
  PyObject* deserializer = PyTuple_GET_ITEM(plan, 1);
  PyObject* serializer = PyTuple_GET_ITEM(plan, 2);
  PyObject* request = nullptr;
  try {
    request = try_recv_call(call).release().ptr();
  } catch (...) {
    restore_python_error(std::current_exception());
    return raised();
  }
  if (request == Py_None || request == Py_False) {  // not there yet: serve() waits for it
    Py_DECREF(request);
    Py_RETURN_FALSE;
  }
  if (deserializer != Py_None) {
    PyObject* raw = request;
    request = PyObject_CallOneArg(deserializer, raw);
    Py_DECREF(raw);
    if (request == nullptr) return raised();
  }
  PyObject* context_args[3] = {reinterpret_cast<PyObject*>(st), Py_None, Py_None};
  PyObject* context = PyObject_Vectorcall(context_type, context_args, 3, nullptr);
  if (context == nullptr) {
    Py_DECREF(request);
    return raised();
  }
  PyObject* handler_args[2] = {request, context};
  PyObject* coro = PyObject_Vectorcall(behavior, handler_args, 2, nullptr);
  Py_DECREF(request);
  Py_DECREF(context);
  if (coro == nullptr) return raised();
  if (!PyCoro_CheckExact(coro)) return Py_BuildValue("(iN)", kAwait, coro);
  PyObject* value = nullptr;
  const PySendResult r = PyIter_Send(coro, Py_None, &value);
  if (r == PYGEN_NEXT) return Py_BuildValue("(iNN)", kWaits, coro, value);
  Py_DECREF(coro);
  if (r == PYGEN_ERROR) return raised();
  return end_quietly(st, call, value, serializer, max_send);
}

// Every call and event the server has waiting, without waiting (so with the GIL: the
// deadline has passed).
void take_waiting(PyServer& s, std::vector<std::shared_ptr<Stream>>* calls,
                  std::vector<ServerEvent>* events) {
  const Deadline now = Deadline::after_seconds(0);
  while (auto st = s.server->accept(now)) calls->push_back(std::move(st));
  for (;;) {
    ServerEvent ev = s.server->next_event(now);
    if (ev.kind == ServerEvent::Kind::kNone) break;
    if (ev.kind != ServerEvent::Kind::kStarved) events->push_back(std::move(ev));
  }
}

bool empty_list(PyObject* o) { return PyList_CheckExact(o) && PyList_GET_SIZE(o) == 0; }

// server.<name>(*args), its result dropped; raises error_already_set if it raised.
void call_method(PyObject* server, PyObject* name, std::initializer_list<PyObject*> args) {
  PyObject* stack[6] = {server};
  size_t n = 1;
  for (PyObject* a : args) stack[n++] = a;
  PyObject* r = PyObject_VectorcallMethod(name, stack, n, nullptr);
  if (r == nullptr) throw py::error_already_set();
  Py_DECREF(r);
}

// first_step in `context`, as a task runs a coroutine's step.
PyObject* answer_in(ServerCallState* st, PyServerCall& call, PyObject* plan, PyObject* context,
                    PyObject* context_type, long long max_send) {
  if (PyContext_Enter(context) < 0) return nullptr;
  PyObject* out = first_step(st, call, plan, context_type, max_send);
  if (PyContext_Exit(context) < 0) Py_CLEAR(out);
  return out;
}

// answer_unary(state, plan, context, context_type, max_send): True once the call is
// answered; False if its request is not there yet (nothing was run); else the tuple
// (Started, ...) the Python server goes on from.
PyObject* answer_unary(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !is_server_call_state(args[0]) || !PyTuple_Check(args[1]) ||
      PyTuple_GET_SIZE(args[1]) != 3 || !PyContext_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError,
                    "answer_unary(state, plan, context, context_type, max_send): a "
                    "ServerCallState, a (behavior, deserializer, serializer) tuple and a "
                    "contextvars.Context");
    return nullptr;
  }
  auto* st = reinterpret_cast<ServerCallState*>(args[0]);
  long long max_send = -1;
  PyServerCall* call = planned_call(st->sc, args[4], &max_send, "answer_unary");
  if (call == nullptr) return nullptr;
  return answer_in(st, *call, args[1], args[2], args[3], max_send);
}

// An asyncio server's loop callback, called by its bridge's poll (LoopBridgeState) when
// the server's watch fires: what the Python server did for each call and event a pass
// took (Server._start_call, _carry_on, _on_event in argrpc/aio/_server.py), with a
// planned method's call answered here to the end when nothing about it needs Python:
// answered at once, nobody waiting on it or called back by it, and its state held by
// nothing else (the handler kept no context). A C object rather than a Python closure,
// so the bridge's poll reaches the pass without a frame; it holds the server weakly (a
// server nobody holds may be collected while the loop's bridge lives on) and the
// server's fields are read off its C base.
struct ServerPass {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* server_ref;    // a weak reference to the argrpc.aio Server (an AioServerState)
  PyObject* state_type;    // the call state's type (RpcState)
  PyObject* context_type;  // the handler's context's type (ServicerContext)
  PyObject* started;       // the stage in which calls are answered here
};

PyObject* serve_pass(ServerPass* self, PyObject* srv, AioServerState* fields) {
  auto* state_type = reinterpret_cast<PyTypeObject*>(self->state_type);
  PyObject* context_type = self->context_type;
  // Each call held by its handle from the start: one this pass does not reach (a
  // handler's error ended it) is abandoned, as a dropped handle's always is.
  std::vector<std::unique_ptr<PyServerCall>> calls;
  std::vector<std::pair<bool, std::unique_ptr<PyServerCall>>> changes;  // (over limit, call)
  try {
    PyServer& core = py::cast<PyServer&>(py::handle(fields->core));
    std::vector<std::shared_ptr<Stream>> streams;
    std::vector<ServerEvent> events;
    take_waiting(core, &streams, &events);
    for (auto& st : streams) calls.push_back(std::make_unique<PyServerCall>(core.engine, st, true));
    for (auto& ev : events) {
      // A cancellation's is a second, non-owning handle on a call a task owns.
      const bool over_limit = ev.kind == ServerEvent::Kind::kOverLimit;
      changes.emplace_back(over_limit,
                           std::make_unique<PyServerCall>(core.engine, ev.stream, over_limit));
    }
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  try {
    // What a pass's planned calls share, held for the pass (a handler may set them).
    py::object plans, context, loop;
    long long max_send = -1;
    bool planned = false;
    if (!calls.empty() && fields->stage == self->started) {
      plans = py::reinterpret_borrow<py::object>(fields->plans);
      planned = PyDict_CheckExact(plans.ptr()) && PyContext_CheckExact(fields->context);
      if (planned) {
        context = py::reinterpret_borrow<py::object>(fields->context);
        loop = py::reinterpret_borrow<py::object>(fields->loop);
        max_send = PyLong_AsLongLong(fields->max_send);
        if (max_send == -1 && PyErr_Occurred()) throw py::error_already_set();
      }
    }
    for (auto& c : calls) {
      py::str method = method_name(c->s->method);
      py::int_ key(reinterpret_cast<uintptr_t>(c->s.value().get()));
      PyServerCall* call = c.get();  // owned by sc from here on
      py::object sc = wrap_handle(std::move(c));
      PyObject* plan = planned ? PyDict_GetItemWithError(plans.ptr(), method.ptr()) : nullptr;
      // Held: the handler may change the dict.
      py::object plan_ref = py::reinterpret_borrow<py::object>(plan);
      if (plan == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        static PyObject* const start_call = interned("_start_call");
        call_method(srv, start_call, {sc.ptr(), method.ptr(), key.ptr(), Py_False});
        continue;
      }
      py::object state = py::reinterpret_steal<py::object>(
          new_call_state(state_type, sc.ptr(), method.ptr(), key.ptr(), srv, loop.ptr()));
      if (!state) throw py::error_already_set();
      py::object call_context = py::reinterpret_steal<py::object>(PyContext_Copy(context.ptr()));
      if (!call_context) throw py::error_already_set();
      auto* state_fields = reinterpret_cast<ServerCallState*>(state.ptr());
      py::object started = py::reinterpret_steal<py::object>(
          answer_in(state_fields, *call, plan, call_context.ptr(), context_type, max_send));
      if (!started) throw py::error_already_set();
      sc = py::object();  // the state's reference is the one left
      if (started.ptr() == Py_True && empty_list(state_fields->waiters) &&
          empty_list(state_fields->callbacks) && Py_REFCNT(state.ptr()) == 1)
        continue;  // done; the state goes, its engine handle with it
      // Passed as a Python caller passes it (no argument tuple): _carry_on counts on the
      // references a state answered at once has there.
      static PyObject* const carry_on = interned("_carry_on");
      call_method(srv, carry_on,
                  {state.ptr(), plan, call_context.ptr(), started.ptr(), Py_False});
    }
    static PyObject* const on_event = interned("_on_event");
    static PyObject* const kinds[2] = {interned("cancelled"), interned("over_limit")};
    for (auto& [over_limit, c] : changes)
      call_method(srv, on_event, {kinds[over_limit], wrap_handle(std::move(c)).ptr()});
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* pass_call(PyObject* o, PyObject* const*, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "a server's pass takes no arguments");
    return nullptr;
  }
  auto* self = reinterpret_cast<ServerPass*>(o);
  PyObject* srv = PyWeakref_GetObject(self->server_ref);  // borrowed; None once it is gone
  if (srv == nullptr) return nullptr;
  if (srv == Py_None) Py_RETURN_NONE;
  AioServerState* fields = aio_server_state(srv);
  if (fields == nullptr) {
    PyErr_SetString(PyExc_TypeError, "a server's pass serves an AioServerState");
    return nullptr;
  }
  Py_INCREF(srv);  // the pass's handlers may drop every other reference
  PyObject* out = serve_pass(self, srv, fields);
  Py_DECREF(srv);
  return out;
}

// ServerPass(server_ref, state_type, context_type, started)
PyObject* pass_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 4 ||
      (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) ||
      !PyWeakref_CheckRef(PyTuple_GET_ITEM(args, 0)) || !PyType_Check(PyTuple_GET_ITEM(args, 1)) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(args, 1)),
                        server_call_state_type())) {
    PyErr_SetString(PyExc_TypeError,
                    "ServerPass(server_ref, state_type, context_type, started): a weak "
                    "reference to the asyncio server, a ServerCallState type, the "
                    "ServicerContext type and the stage that lets calls be answered here");
    return nullptr;
  }
  auto* self = reinterpret_cast<ServerPass*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = pass_call;
  self->server_ref = Py_NewRef(PyTuple_GET_ITEM(args, 0));
  self->state_type = Py_NewRef(PyTuple_GET_ITEM(args, 1));
  self->context_type = Py_NewRef(PyTuple_GET_ITEM(args, 2));
  self->started = Py_NewRef(PyTuple_GET_ITEM(args, 3));
  return reinterpret_cast<PyObject*>(self);
}

// Read-only: the pass counts on what it was made with.
#define PASS_OBJ(name, field) \
  { const_cast<char*>(name), T_OBJECT_EX, offsetof(ServerPass, field), READONLY, nullptr }
PyMemberDef pass_members[] = {
    PASS_OBJ("server_ref", server_ref),
    PASS_OBJ("state_type", state_type),
    PASS_OBJ("context_type", context_type),
    PASS_OBJ("started", started),
    {nullptr, 0, 0, 0, nullptr},
};
#undef PASS_OBJ

PyTypeObject server_pass_type = [] {
  PyTypeObject t = static_type(
      "argrpc._core.ServerPass",
      "An argrpc.aio server's loop callback: every call and event its engine half has "
      "waiting, started (csrc/bindings/aio_serve.cc).",
      sizeof(ServerPass), Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL);
  t.tp_new = pass_new;
  t.tp_dealloc = dealloc_members<pass_members>;
  t.tp_traverse = traverse_members<pass_members>;
  t.tp_clear = clear_members<pass_members>;
  t.tp_members = pass_members;
  t.tp_vectorcall_offset = offsetof(ServerPass, vectorcall);
  t.tp_call = PyVectorcall_Call;
  return t;
}();

PyMethodDef serve_functions[] = {
    {"answer_unary", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(answer_unary)),
     METH_FASTCALL,
     "A planned unary method's call answered in one crossing, or where the Python server "
     "goes on from (csrc/bindings/aio_serve.cc)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_aio_serve(py::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), serve_functions) < 0) throw py::error_already_set();
  if (PyType_Ready(&server_pass_type) < 0) throw py::error_already_set();
  m.add_object("ServerPass", py::handle(reinterpret_cast<PyObject*>(&server_pass_type)));
}

}  // namespace bindings
}  // namespace argrpc
