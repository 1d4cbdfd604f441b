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
#include <pybind11/pybind11.h>

#include <string>

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
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
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
  const long long max_send = PyLong_AsLongLong(args[4]);
  if (max_send == -1 && PyErr_Occurred()) return nullptr;
  PyServerCall* call = nullptr;
  try {
    call = &py::cast<PyServerCall&>(py::handle(st->sc));
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  PyObject* context = args[2];
  if (PyContext_Enter(context) < 0) return nullptr;
  PyObject* out = first_step(st, *call, args[1], args[3], max_send);
  if (PyContext_Exit(context) < 0) Py_CLEAR(out);
  return out;
}

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
}

}  // namespace bindings
}  // namespace argrpc
