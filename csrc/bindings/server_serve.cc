// A threaded server's planned unary call served in one crossing (argrpc/_server.py,
// _serve): a registered unary-unary method with no interceptors, whose request is there
// when the call is taken and whose handler returns a response with nothing set on the
// call, is the common call of a model or parameter server. In Python its steps were a
// Context.run, serve_unary's frame, two engine calls through pybind11 and the codec and
// end helpers' frames; here they are one C function, which runs the codecs and the
// handler in a fresh contextvars.Context as grpc does.
//
// Every other outcome goes back to the Python server, in the same Context, from where
// this stopped (argrpc/_handlers.py, carry_on_unary): a codec that raised or gave None,
// the handler raising, a status, details or trailing metadata the handler set, a send
// limit, a response that is no buffer. What grpc does there is written once, in Python.
//
// The call's state (_CallState, argrpc/_context.py) has a C base here too, so that this
// reads and sets its fields directly and making it costs no Python frame.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

// Every field an object, never NULL while the state lives (T_OBJECT_EX: Python code reads
// and writes them as it does __slots__ slots).
struct ThreadedCallState {
  PyObject_HEAD
  PyObject* sc;
  PyObject* method;
  PyObject* code;
  PyObject* details;
  PyObject* trailing_metadata;
  PyObject* aborted;
  PyObject* initial_metadata_sent;
  PyObject* finished;
  PyObject* rpc_errors;
  PyObject* callbacks;
  PyObject* detached;
  PyObject* invocation_metadata;
};

PyObject* no_items;  // (): the empty rpc_errors and callbacks every state starts with

extern PyMemberDef threaded_state_members[];

// Made with _CallState's defaults: no code, details or trailing metadata, every flag
// False, no RpcErrors raised and no callbacks yet.
PyObject* threaded_state_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<ThreadedCallState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  none_members<threaded_state_members>(reinterpret_cast<PyObject*>(self));
  for (PyObject** flag :
       {&self->aborted, &self->initial_metadata_sent, &self->finished, &self->detached})
    set_field(flag, Py_False);
  set_field(&self->rpc_errors, no_items);
  set_field(&self->callbacks, no_items);
  return reinterpret_cast<PyObject*>(self);
}

// ThreadedCallState(sc, method): positional, as the server makes it.
int threaded_state_init(PyObject* o, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2 ||
      (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError,
                    "a call state takes two positional arguments: sc, method");
    return -1;
  }
  auto* self = reinterpret_cast<ThreadedCallState*>(o);
  set_field(&self->sc, PyTuple_GET_ITEM(args, 0));
  set_field(&self->method, PyTuple_GET_ITEM(args, 1));
  return 0;
}

#define STATE_OBJ(name, field) ARGRPC_OBJECT_MEMBER(ThreadedCallState, name, field)
PyMemberDef threaded_state_members[] = {
    STATE_OBJ("sc", sc),
    STATE_OBJ("method", method),
    STATE_OBJ("code", code),
    STATE_OBJ("details", details),
    STATE_OBJ("trailing_metadata", trailing_metadata),
    STATE_OBJ("aborted", aborted),
    STATE_OBJ("initial_metadata_sent", initial_metadata_sent),
    STATE_OBJ("finished", finished),
    STATE_OBJ("rpc_errors", rpc_errors),
    STATE_OBJ("callbacks", callbacks),
    STATE_OBJ("detached", detached),
    STATE_OBJ("_invocation_metadata", invocation_metadata),
    {nullptr, 0, 0, 0, nullptr},
};
#undef STATE_OBJ

// The call's callbacks are added and taken in C, each step whole under the GIL (no
// Python code runs inside it): the worker that ends the call, the dispatcher that
// cancels it and a thread the handler gave its context to need no lock between them.
PyObject* threaded_state_add_callback(PyObject* o, PyObject* callback) {
  auto* self = reinterpret_cast<ThreadedCallState*>(o);
  if (self->callbacks == Py_None) Py_RETURN_FALSE;  // taken: the call is over
  if (!PyTuple_Check(self->callbacks)) {
    PyErr_SetString(PyExc_TypeError, "a call state's callbacks are a tuple or None");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(self->callbacks);
  PyObject* grown = PyTuple_New(n + 1);
  if (grown == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i)
    PyTuple_SET_ITEM(grown, i, Py_NewRef(PyTuple_GET_ITEM(self->callbacks, i)));
  PyTuple_SET_ITEM(grown, n, Py_NewRef(callback));
  Py_SETREF(self->callbacks, grown);
  Py_RETURN_TRUE;
}

// The callbacks not yet run (a tuple), None from then on; None if they were taken.
PyObject* threaded_state_take_callbacks(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<ThreadedCallState*>(o);
  PyObject* taken = self->callbacks;
  self->callbacks = Py_NewRef(Py_None);
  return taken;
}

PyMethodDef threaded_state_methods[] = {
    {"add_callback", threaded_state_add_callback, METH_O,
     "Adds a callback run when the call ends; False once it has ended."},
    {"take_callbacks", threaded_state_take_callbacks, METH_NOARGS,
     "The callbacks to run now (a tuple), or None if another taker had them."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject threaded_state_type = [] {
  PyTypeObject t = fields_type<threaded_state_members>(
      "argrpc._core.ThreadedCallState",
      "The fields of one fast-path call on a threaded argrpc server.",
      sizeof(ThreadedCallState), threaded_state_new, threaded_state_init);
  t.tp_methods = threaded_state_methods;
  return t;
}();

// Where serve_planned stopped, for the Python server (carry_on_unary).
enum class Stop : int {
  kRequestFailed = 1,    // (1, exception or None, context): the deserializer raised or gave None
  kRaised = 2,           // (2, exception, context): the handler raised
  kReturned = 3,         // (3, response, context): the end needs Python's checks
  kSerializeFailed = 4,  // (4, exception or None, context): the serializer raised or gave None
  kNotBytes = 5,         // (5, wire form, context): the response's wire form is no buffer
};

// The Exception being raised, taken (a BaseException that is no Exception stays raised:
// nullptr then, as Python's `except Exception` lets it through).
PyObject* taken_exception() {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
  return take_exception();
}

// (stage, value, context), `value` consumed; nullptr (value let go) if value is.
PyObject* stopped(Stop stage, PyObject* value, PyObject* context) {
  if (value == nullptr) return nullptr;
  return Py_BuildValue("(iNO)", static_cast<int>(stage), value, context);
}

// In `context`: the codecs, the handler, and the quiet end. True: served; False: the
// request is not there yet and nothing ran; else (stage, value, context).
PyObject* serve_in(ThreadedCallState* st, PyServerCall& call, PyObject* plan,
                   PyObject* context_type, long long max_send, PyObject* context) {
  PyObject* behavior = PyTuple_GET_ITEM(plan, 0);
  PyObject* deserializer = PyTuple_GET_ITEM(plan, 1);
  PyObject* serializer = PyTuple_GET_ITEM(plan, 2);
  PyObject* request = nullptr;
  try {
    request = try_recv_call(call).release().ptr();
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  if (request == Py_None || request == Py_False) {  // not there (yet): the Python way waits
    Py_DECREF(request);
    Py_RETURN_FALSE;
  }
  if (deserializer != Py_None) {
    PyObject* raw = request;
    request = PyObject_CallOneArg(deserializer, raw);
    Py_DECREF(raw);
    if (request == nullptr) return stopped(Stop::kRequestFailed, taken_exception(), context);
    if (request == Py_None) return stopped(Stop::kRequestFailed, request, context);
  }
  PyObject* servicer_context = PyObject_CallOneArg(context_type, reinterpret_cast<PyObject*>(st));
  if (servicer_context == nullptr) {
    Py_DECREF(request);
    return nullptr;
  }
  PyObject* handler_args[2] = {request, servicer_context};
  PyObject* response = PyObject_Vectorcall(behavior, handler_args, 2, nullptr);
  Py_DECREF(request);
  Py_DECREF(servicer_context);
  if (response == nullptr) return stopped(Stop::kRaised, taken_exception(), context);
  const int trailing = PyObject_IsTrue(st->trailing_metadata);
  if (trailing < 0) {
    Py_DECREF(response);
    return nullptr;
  }
  if (st->finished != Py_False || st->code != Py_None || st->details != Py_None || trailing ||
      max_send >= 0)
    return stopped(Stop::kReturned, response, context);
  // `message` and `response` each hold a reference from here on.
  PyObject* message = Py_NewRef(response);
  if (serializer != Py_None) {
    Py_SETREF(message, PyObject_CallOneArg(serializer, response));
    if (message == nullptr) {
      Py_DECREF(response);
      return stopped(Stop::kSerializeFailed, taken_exception(), context);
    }
    if (message == Py_None) {
      Py_DECREF(response);
      return stopped(Stop::kSerializeFailed, message, context);
    }
  }
  if (!PyObject_CheckBuffer(message)) {
    Py_DECREF(response);
    return stopped(Stop::kNotBytes, message, context);  // Python says what is wrong with it
  }
  Py_DECREF(response);
  try {
    BufferView b(py::reinterpret_steal<py::object>(message));
    set_field(&st->finished, Py_True);
    // Kept through the send of a small answer; let go before any wait (ring credits, a
    // send lock another thread holds).
    GilUntilWait gil(b.size() <= kKeepGilBytes);
    call.s->conn->finish(call.s, 0, std::string(), Metadata(), b.data(), b.size(), true);
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// The served-or-not outcome of serve_in in a fresh contextvars.Context.
PyObject* serve_in_context(ThreadedCallState* st, PyServerCall& call, PyObject* plan,
                           PyObject* context_type, long long max_send) {
  PyObject* context = PyContext_New();
  if (context == nullptr) return nullptr;
  if (PyContext_Enter(context) < 0) {
    Py_DECREF(context);
    return nullptr;
  }
  PyObject* out = serve_in(st, call, plan, context_type, max_send, context);
  if (PyContext_Exit(context) < 0) Py_CLEAR(out);
  Py_DECREF(context);
  return out;
}

// serve_planned(state, plan, context_type, max_send): the call served in a fresh
// contextvars.Context (see serve_in).
PyObject* serve_planned(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyObject_TypeCheck(args[0], &threaded_state_type) ||
      !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 3) {
    PyErr_SetString(PyExc_TypeError,
                    "serve_planned(state, plan, context_type, max_send): a ThreadedCallState "
                    "and a (behavior, deserializer, serializer) tuple");
    return nullptr;
  }
  auto* st = reinterpret_cast<ThreadedCallState*>(args[0]);
  long long max_send = -1;
  PyServerCall* call = planned_call(st->sc, args[3], &max_send, "serve_planned");
  if (call == nullptr) return nullptr;
  return serve_in_context(st, *call, args[1], args[2], max_send);
}

// serve_taken(sc, calls, plans, state_type, context_type, max_send, carry_on): a call
// accept() gave, as the worker's _serve takes it (argrpc/_server.py), for a planned
// method: its state made (state_type, a ThreadedCallState subclass) and registered in
// `calls` by its key, served in one crossing, and, when that answered it, unregistered
// and its callbacks taken (the Python end runs them if the handler added any: True
// then). Anything else goes on in carry_on(state, plan, outcome), outcome as
// serve_planned's or the Exception it raised. None: no plan for the method (the worker's
// _serve takes the call); True: done.
PyObject* serve_taken(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7 || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2]) ||
      !PyType_Check(args[3]) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[3]), &threaded_state_type)) {
    PyErr_SetString(PyExc_TypeError,
                    "serve_taken(sc, calls, plans, state_type, context_type, max_send, "
                    "carry_on): two dicts and a ThreadedCallState subclass");
    return nullptr;
  }
  PyObject* sc = args[0];
  PyObject* calls = args[1];
  long long max_send = -1;
  PyServerCall* call = planned_call(sc, args[5], &max_send, "serve_taken");
  if (call == nullptr) return nullptr;
  if (call->s.inherited() || !call->s.value()) Py_RETURN_NONE;  // the Python way says why
  PyObject* method = nullptr;
  PyObject* key = nullptr;
  try {
    method = method_name(call->s->method).release().ptr();
    key = PyLong_FromVoidPtr(call->s.value().get());
  } catch (...) {
    restore_python_error(std::current_exception());
    Py_XDECREF(method);
    return nullptr;
  }
  if (key == nullptr) {
    Py_DECREF(method);
    return nullptr;
  }
  PyObject* plan = PyDict_GetItemWithError(args[2], method);  // borrowed
  if (plan == nullptr || !PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != 3) {
    Py_DECREF(method);
    Py_DECREF(key);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Py_INCREF(plan);
  auto* type = reinterpret_cast<PyTypeObject*>(args[3]);
  PyObject* state = type->tp_new(type, no_items, nullptr);
  if (state == nullptr) {
    Py_DECREF(method);
    Py_DECREF(key);
    Py_DECREF(plan);
    return nullptr;
  }
  auto* st = reinterpret_cast<ThreadedCallState*>(state);
  set_field(&st->sc, sc);
  Py_SETREF(st->method, method);
  PyObject* out = nullptr;
  if (PyDict_SetItem(calls, key, state) == 0) {
    PyObject* served = serve_in_context(st, *call, plan, args[4], max_send);
    if (served == Py_True && st->callbacks != Py_None && PyTuple_Check(st->callbacks) &&
        PyTuple_GET_SIZE(st->callbacks) == 0) {
      // Answered, and nobody asked to be called back: the end is the registration's.
      Py_DECREF(served);
      Py_SETREF(st->callbacks, Py_NewRef(Py_None));
      if (PyDict_DelItem(calls, key) < 0) PyErr_Clear();  // stop() may have taken it
      out = Py_NewRef(Py_True);
    } else {
      // A bug of ours raised: Python logs it and ends the call (an exception that is no
      // Exception stays raised, as from the Python way).
      if (served == nullptr) served = taken_exception();
      if (served != nullptr) {
        PyObject* carry_args[3] = {state, plan, served};
        out = PyObject_Vectorcall(args[6], carry_args, 3, nullptr);
        Py_DECREF(served);
        if (out != nullptr) Py_SETREF(out, Py_NewRef(Py_True));
      }
    }
  }
  Py_DECREF(key);
  Py_DECREF(plan);
  Py_DECREF(state);
  return out;
}

PyMethodDef planned_functions[] = {
    {"serve_taken", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(serve_taken)),
     METH_FASTCALL,
     "A call accept() gave for a planned method: registered, served in one crossing and "
     "ended (csrc/bindings/server_serve.cc)."},
    {"serve_planned", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(serve_planned)),
     METH_FASTCALL,
     "A threaded server's planned unary call served in one crossing "
     "(csrc/bindings/server_serve.cc)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_server_serve(py::module_& m) {
  no_items = PyTuple_New(0);
  if (no_items == nullptr || PyType_Ready(&threaded_state_type) < 0 ||
      PyModule_AddFunctions(m.ptr(), planned_functions) < 0)
    throw py::error_already_set();
  m.add_object("ThreadedCallState",
               py::handle(reinterpret_cast<PyObject*>(&threaded_state_type)));
}

}  // namespace bindings
}  // namespace argrpc
