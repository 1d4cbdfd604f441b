// The threaded API's unary-unary multicallable called in C: the C base of its
// multicallables (argrpc/_client_calls.py, _MultiCallable) holds the fields their calls
// read, and its tp_call, which only UnaryUnary keeps (the other kinds define __call__),
// makes the common blocking call (no metadata, credentials, compression or method config,
// no send limit, over a live fast connection) without a Python frame. The Python
// __call__ and its _blocking step cost a small call about 7,000 instructions: two
// frames, a property read through pybind11, the arguments' conversion into Connection.
// unary and the five-tuple it returned.
//
// Every other call goes to the class's _call_general (the Python __call__) with the
// caller's own arguments, and one the fast connection turned away unsent to _unsent_again
// (routed again, as the Python call does it); a status other than OK and a codec that
// raised are turned into grpc's errors by the class's Python helpers, so what grpc does
// there is written once.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

// A named namespace, not an anonymous one: the bindings are one translation unit, and
// aio_unary_callable.cc's helpers have the same names.
namespace blocking_callable {

struct MultiCallableState {
  PyObject_HEAD
  PyObject* channel;
  PyObject* method;
  PyObject* ser;
  PyObject* deser;
  PyObject* grpc;
  PyObject* max_send;  // an int, -1: no limit
  PyObject* raw_send;  // True: the request goes to the engine as it is
  PyObject* registered;
  PyObject* mc;  // the method's service config, or None
};

struct Names {
  PyObject* timeout;
  PyObject* metadata;
  PyObject* credentials;
  PyObject* wait_for_ready;
  PyObject* compression;
  PyObject* fast;
  PyObject* service_config;
  PyObject* unsent_retries;
  PyObject* call_general;
  PyObject* unsent_again;
  PyObject* status_error;
  PyObject* codec_error;
  PyObject* serializing;
  PyObject* deserializing;
} names;

// self.<helper>(*args): one of the class's Python steps.
PyObject* call_helper(PyObject* self, PyObject* name, std::initializer_list<PyObject*> args) {
  PyObject* helper = PyObject_GetAttr(self, name);
  if (helper == nullptr) return nullptr;
  PyObject* argv[6];
  size_t n = 0;
  for (PyObject* a : args) argv[n++] = a;
  PyObject* r = PyObject_Vectorcall(helper, argv, n, nullptr);
  Py_DECREF(helper);
  return r;
}

// Raises the error the class's helper makes, self._codec_error(what, exc), for a user
// codec that raised (logged as grpc does; an exception other than Exception stays raised)
// or, with no error set, gave None.
PyObject* codec_failed(PyObject* self, PyObject* what) {
  PyObject* exc = Py_NewRef(Py_None);
  if (PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    Py_SETREF(exc, take_exception());
    if (exc == nullptr) return nullptr;
  }
  PyObject* error = call_helper(self, names.codec_error, {what, exc});
  Py_DECREF(exc);
  if (error != nullptr) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error)), error);
    Py_DECREF(error);
  }
  return nullptr;
}

// The caller's (request, timeout, wait_for_ready) when the call is the common one; false
// (no error set) when it takes the general way.
bool common_arguments(PyObject* args, PyObject* kwargs, PyObject** request, PyObject** timeout,
                      PyObject** wait_for_ready) {
  const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  if (nargs < 1 || nargs > 2) return false;
  *request = PyTuple_GET_ITEM(args, 0);
  *timeout = nargs == 2 ? PyTuple_GET_ITEM(args, 1) : Py_None;
  *wait_for_ready = Py_None;
  if (kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (is_keyword(key, names.timeout) && nargs == 1) {
        *timeout = value;
      } else if (is_keyword(key, names.metadata)) {
        // Metadata goes the general way, as does a value whose truth raises.
        const int any = PyObject_IsTrue(value);
        if (any != 0) {
          if (any < 0) PyErr_Clear();
          return false;
        }
      } else if (is_keyword(key, names.credentials) || is_keyword(key, names.compression)) {
        if (value != Py_None) return false;
      } else if (is_keyword(key, names.wait_for_ready)) {
        *wait_for_ready = value;
      } else {
        return false;  // not grpc's (the general way says so), or a timeout given twice
      }
    }
  }
  // A timeout that is no number: the general way, as it always did.
  return *timeout == Py_None || PyFloat_Check(*timeout) || PyLong_Check(*timeout);
}

// The common call; nullptr with no error set: the general way takes it.
PyObject* short_call(MultiCallableState* self, PyObject* args, PyObject* kwargs) {
  PyObject* o = reinterpret_cast<PyObject*>(self);
  PyObject *request, *timeout_obj, *wait_for_ready;
  if (!common_arguments(args, kwargs, &request, &timeout_obj, &wait_for_ready)) return nullptr;
  if (self->mc != Py_None || !PyLong_Check(self->max_send)) return nullptr;
  const long long max_send = PyLong_AsLongLong(self->max_send);
  if (max_send != -1) {
    PyErr_Clear();
    return nullptr;  // a send limit: the general way
  }
  PyObject* fast = PyObject_GetAttr(self->channel, names.fast);
  if (fast == nullptr) return nullptr;
  py::object hold_fast = py::reinterpret_steal<py::object>(fast);
  if (fast == Py_None) return nullptr;
  PyConnection* conn = nullptr;
  try {
    conn = &py::cast<PyConnection&>(hold_fast);
    auto live = conn->get();
    if (!live || !live->alive()) return nullptr;  // routed by the general way
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  PyObject* config = PyObject_GetAttr(self->channel, names.service_config);
  if (config == nullptr) return nullptr;
  PyObject* retries = PyObject_GetAttr(config, names.unsent_retries);
  Py_DECREF(config);
  if (retries == nullptr) return nullptr;
  const long tries = PyLong_AsLong(retries);
  Py_DECREF(retries);
  if (tries == -1 && PyErr_Occurred()) return nullptr;
  const bool retry_unsent = tries > 0;
  double timeout = -1;  // the engine's "none"
  if (timeout_obj != Py_None) {
    timeout = PyFloat_AsDouble(timeout_obj);
    if (timeout == -1 && PyErr_Occurred()) return nullptr;
    timeout = user_timeout(timeout);
  }
  Py_ssize_t n = 0;
  const char* method = PyUnicode_AsUTF8AndSize(self->method, &n);
  if (method == nullptr) return nullptr;
  PyObject* message;
  if (self->raw_send == Py_True || self->ser == Py_None) {
    message = Py_NewRef(request);
  } else {
    message = PyObject_CallOneArg(self->ser, request);
    if (message == nullptr) return codec_failed(o, names.serializing);
    if (message == Py_None) {
      Py_DECREF(message);
      return codec_failed(o, names.serializing);
    }
  }
  py::object hold_message = py::reinterpret_steal<py::object>(message);
  UnaryEnd end;
  try {
    BufferView req(hold_message);
    end = blocking_unary(*conn, std::string(method, static_cast<size_t>(n)), Metadata(),
                         timeout, req, retry_unsent);
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  if (end.unsent) {
    // Never left the process: routed again where the channel routes now.
    return call_helper(o, names.unsent_again,
                       {request, timeout_obj, wait_for_ready});
  }
  try {
    if (end.code != 0) {
      py::object details = lenient_str(end.details);
      py::object initial = from_metadata(end.initial);
      py::object trailing = from_metadata(end.trailing);
      py::object code = py::int_(end.code);
      PyObject* error = call_helper(o, names.status_error,
                                    {self->channel, code.ptr(), details.ptr(), initial.ptr(),
                                     trailing.ptr()});
      if (error != nullptr) {
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error)), error);
        Py_DECREF(error);
      }
      return nullptr;
    }
    if (!end.got) Py_RETURN_NONE;
    py::object response = to_python(std::move(end.response));
    if (self->deser == Py_None) return response.release().ptr();
    PyObject* answer = PyObject_CallOneArg(self->deser, response.ptr());
    if (answer == nullptr) return codec_failed(o, names.deserializing);
    if (answer == Py_None) {
      Py_DECREF(answer);
      return codec_failed(o, names.deserializing);
    }
    return answer;
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* state_call(PyObject* o, PyObject* args, PyObject* kwargs) {
  return or_general(o, short_call(reinterpret_cast<MultiCallableState*>(o), args, kwargs),
                    names.call_general, args, kwargs);
}

#define STATE_OBJ(name, field) ARGRPC_OBJECT_MEMBER(MultiCallableState, name, field)
PyMemberDef members[] = {
    STATE_OBJ("_channel", channel),
    STATE_OBJ("_method", method),
    STATE_OBJ("_ser", ser),
    STATE_OBJ("_deser", deser),
    STATE_OBJ("_grpc", grpc),
    STATE_OBJ("_max_send", max_send),
    STATE_OBJ("_raw_send", raw_send),
    STATE_OBJ("_registered", registered),
    STATE_OBJ("_mc", mc),
    {nullptr, 0, 0, 0, nullptr},
};
#undef STATE_OBJ

PyTypeObject state_type = [] {
  PyTypeObject t = fields_type<members>(
      "argrpc._core.MultiCallableState",
      "The fields of a threaded argrpc multicallable; a unary-unary one is called in C.",
      sizeof(MultiCallableState), none_new<members>, nullptr);
  t.tp_call = state_call;
  return t;
}();

}  // namespace blocking_callable

void add_unary_callable(py::module_& m) {
  namespace bc = blocking_callable;
  struct {
    PyObject** slot;
    const char* text;
  } const names_made[] = {
      {&bc::names.timeout, "timeout"},
      {&bc::names.metadata, "metadata"},
      {&bc::names.credentials, "credentials"},
      {&bc::names.wait_for_ready, "wait_for_ready"},
      {&bc::names.compression, "compression"},
      {&bc::names.fast, "_fast"},
      {&bc::names.service_config, "_service_config"},
      {&bc::names.unsent_retries, "unsent_retries"},
      {&bc::names.call_general, "_call_general"},
      {&bc::names.unsent_again, "_unsent_again"},
      {&bc::names.status_error, "_status_error"},
      {&bc::names.codec_error, "_codec_error"},
      {&bc::names.serializing, "serializing"},
      {&bc::names.deserializing, "deserializing"},
  };
  for (const auto& n : names_made) *n.slot = interned(n.text);
  if (PyType_Ready(&bc::state_type) < 0) throw py::error_already_set();
  m.add_object("MultiCallableState", py::handle(reinterpret_cast<PyObject*>(&bc::state_type)));
}

}  // namespace bindings
}  // namespace argrpc
