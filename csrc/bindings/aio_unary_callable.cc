// argrpc.aio's unary-unary multicallable called in C: the C base of
// UnaryUnaryMultiCallable (argrpc/aio/_channel.py) holds the fields its __call__ reads,
// and its tp_call makes the common call (no metadata, credentials, compression,
// interceptors or method config; on the channel's loop, over a live fast connection)
// without a Python frame. A Python __call__ cost its caller a keyword dict, the frame and
// its fast-path checks: about 4,000 instructions, as much as the engine's start and send.
//
// Every other call, and one the fast connection turns away unsent, goes to the Python
// class's _call_general (grpc.aio's __call__ as argrpc writes it) with the caller's own
// arguments, so what grpc.aio does there (argument errors included) is written once.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include "bindings/aio_call.h"
#include "bindings/aio_loop_state.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

struct UnaryCallableState {
  PyObject_HEAD
  PyObject* channel;
  PyObject* method;
  PyObject* serializer;
  PyObject* deserializer;
  PyObject* intercepted;       // the channel's interceptors of this kind (a tuple)
  PyObject* mc;                // the method's service config, or None
  PyObject* max_send;          // an int, -1: no limit
  PyObject* loop;              // the loop of its first fast-path call, or None
  PyObject* loop_bridge;       // that loop's bridge
  PyObject* loop_says_thread;  // True: the loop keeps its thread's id in _thread_id
};

struct CallableNames {
  PyObject* timeout;
  PyObject* metadata;
  PyObject* credentials;
  PyObject* wait_for_ready;
  PyObject* compression;
  PyObject* thread_id;
  PyObject* unsent_retries;
  PyObject* call_type;
  PyObject* unsent;
  PyObject* serialize_failed;
  PyObject* call_general;
  PyObject* get_running_loop;  // asyncio._get_running_loop
  PyObject* empty_bytes;
} callable_names;

// The class attribute `name` of the multicallable's class (borrowed); TypeError if none.
PyObject* class_part(PyObject* o, PyObject* name) {
  PyObject* part = _PyType_Lookup(Py_TYPE(o), name);
  if (part == nullptr)
    PyErr_Format(PyExc_TypeError, "%s has no %U", Py_TYPE(o)->tp_name, name);
  return part;
}

// True when the call runs on the loop the multicallable's fast-path calls take.
int on_its_loop(UnaryCallableState* self) {
  if (self->loop_says_thread == Py_True) {
    PyObject* id = PyObject_GetAttr(self->loop, callable_names.thread_id);
    if (id == nullptr) return -1;
    int same = 0;
    if (id != Py_None) {
      const unsigned long ident = PyLong_AsUnsignedLong(id);
      same = !(ident == static_cast<unsigned long>(-1) && PyErr_Occurred()) &&
             ident == PyThread_get_thread_ident();
    }
    Py_DECREF(id);
    return PyErr_Occurred() ? -1 : same;
  }
  PyObject* running = PyObject_CallNoArgs(callable_names.get_running_loop);
  if (running == nullptr) return -1;
  const int same = running == self->loop;
  Py_DECREF(running);
  return same;
}

// The request's payload, as grpc.aio sends it: a serializer that raises is logged and an
// empty message goes out, as for one that returns None.
PyObject* payload(UnaryCallableState* self, PyObject* request) {
  if (self->serializer == Py_None) return Py_NewRef(request);
  PyObject* message = PyObject_CallOneArg(self->serializer, request);
  if (message == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;  // KeyboardInterrupt...
    PyObject* value = take_exception();
    PyObject* log = PyObject_GetAttr(reinterpret_cast<PyObject*>(self),
                                     callable_names.serialize_failed);
    PyObject* r = log != nullptr && value != nullptr ? PyObject_CallOneArg(log, value) : nullptr;
    Py_XDECREF(log);
    Py_XDECREF(value);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
    return Py_NewRef(callable_names.empty_bytes);
  }
  if (message == Py_None) {
    Py_DECREF(message);
    return Py_NewRef(callable_names.empty_bytes);
  }
  return message;
}

// The common call; nullptr with no error set: the general way takes it.
PyObject* short_call(UnaryCallableState* self, PyObject* args, PyObject* kwargs) {
  const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  if (nargs > 1) return nullptr;
  PyObject* request = nargs == 1 ? PyTuple_GET_ITEM(args, 0) : Py_None;
  PyObject* timeout = Py_None;
  if (kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (is_keyword(key, callable_names.timeout)) {
        timeout = value;
      } else if (is_keyword(key, callable_names.metadata)) {
        if (PyObject_IsTrue(value) != 0) return nullptr;  // metadata (or its error)
      } else if (is_keyword(key, callable_names.credentials) ||
                 is_keyword(key, callable_names.compression)) {
        if (value != Py_None) return nullptr;
      } else if (!is_keyword(key, callable_names.wait_for_ready)) {
        return nullptr;  // not grpc.aio's (the general way says so), or `request=`
      }
    }
  }
  // A timeout that is no number fails where the call is awaited, as in grpc.aio.
  if (timeout != Py_None && !PyFloat_Check(timeout) && !PyLong_Check(timeout)) return nullptr;
  if (self->mc != Py_None || self->loop == Py_None ||
      !(PyTuple_CheckExact(self->intercepted) && PyTuple_GET_SIZE(self->intercepted) == 0))
    return nullptr;
  const long long max_send = PyLong_AsLongLong(self->max_send);
  if (PyErr_Occurred()) PyErr_Clear();
  if (max_send != -1) return nullptr;  // a send limit (or no int): the general way
  ChannelState* channel = channel_state(self->channel);
  if (channel == nullptr || channel->fast == Py_None) return nullptr;
  const int here = on_its_loop(self);
  if (here <= 0) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* call_type = class_part(reinterpret_cast<PyObject*>(self), callable_names.call_type);
  if (call_type == nullptr) return nullptr;
  if (!PyType_Check(call_type)) {
    PyErr_SetString(PyExc_TypeError, "_call_type is not a class");
    return nullptr;
  }
  PyObject* retries = PyObject_GetAttr(channel->service_config, callable_names.unsent_retries);
  if (retries == nullptr) return nullptr;
  const int retry_unsent = PyObject_IsTrue(retries);
  Py_DECREF(retries);
  if (retry_unsent < 0) return nullptr;
  PyObject* message = payload(self, request);
  if (message == nullptr) return nullptr;
  PyObject* fast = Py_NewRef(channel->fast);
  PyObject* call = make_unary(reinterpret_cast<PyTypeObject*>(call_type), self->channel,
                              self->loop_bridge, fast, self->method, timeout, message,
                              self->deserializer, retry_unsent != 0);
  if (call == Py_NotImplemented) {
    // Not a buffer: the Python constructor reports it, as grpc.aio does.
    Py_DECREF(call);
    PyObject* md = PyList_New(0);
    call = md == nullptr ? nullptr
                         : PyObject_CallFunctionObjArgs(
                               call_type, self->channel, self->loop_bridge, fast, self->method,
                               md, timeout, message, self->deserializer,
                               retry_unsent ? Py_True : Py_False, nullptr);
    Py_XDECREF(md);
  }
  Py_DECREF(fast);
  Py_DECREF(message);
  if (call == nullptr) {
    PyObject* unsent = class_part(reinterpret_cast<PyObject*>(self), callable_names.unsent);
    if (unsent == nullptr || !PyErr_ExceptionMatches(unsent)) return nullptr;
    PyErr_Clear();  // never left the process: routed again, as any call
    return nullptr;
  }
  if (call == Py_None) {
    Py_DECREF(call);
    return nullptr;
  }
  return call;
}

PyObject* callable_call(PyObject* o, PyObject* args, PyObject* kwargs) {
  return or_general(o, short_call(reinterpret_cast<UnaryCallableState*>(o), args, kwargs),
                    callable_names.call_general, args, kwargs);
}

#define CALLABLE_OBJ(name, field) ARGRPC_OBJECT_MEMBER(UnaryCallableState, name, field)
PyMemberDef callable_members[] = {
    CALLABLE_OBJ("_channel", channel),
    CALLABLE_OBJ("_method", method),
    CALLABLE_OBJ("_serializer", serializer),
    CALLABLE_OBJ("_deserializer", deserializer),
    CALLABLE_OBJ("_intercepted", intercepted),
    CALLABLE_OBJ("_mc", mc),
    CALLABLE_OBJ("_max_send", max_send),
    CALLABLE_OBJ("_loop", loop),
    CALLABLE_OBJ("_loop_bridge", loop_bridge),
    CALLABLE_OBJ("_loop_says_thread", loop_says_thread),
    {nullptr, 0, 0, 0, nullptr},
};
#undef CALLABLE_OBJ

PyTypeObject callable_type = [] {
  PyTypeObject t = fields_type<callable_members>(
      "argrpc._core.UnaryCallableState",
      "The fields of an argrpc.aio unary-unary multicallable, called in C.",
      sizeof(UnaryCallableState), none_new<callable_members>, nullptr);
  t.tp_call = callable_call;
  return t;
}();

}  // namespace

void add_aio_unary_callable(py::module_& m) {
  struct {
    PyObject** slot;
    const char* text;
  } const names_made[] = {
      {&callable_names.timeout, "timeout"},
      {&callable_names.metadata, "metadata"},
      {&callable_names.credentials, "credentials"},
      {&callable_names.wait_for_ready, "wait_for_ready"},
      {&callable_names.compression, "compression"},
      {&callable_names.thread_id, "_thread_id"},
      {&callable_names.unsent_retries, "unsent_retries"},
      {&callable_names.call_type, "_call_type"},
      {&callable_names.unsent, "_unsent"},
      {&callable_names.serialize_failed, "_serialize_failed"},
      {&callable_names.call_general, "_call_general"},
  };
  for (const auto& n : names_made) *n.slot = interned(n.text);
  callable_names.get_running_loop =
      py::object(py::module_::import("asyncio").attr("_get_running_loop")).release().ptr();
  callable_names.empty_bytes = PyBytes_FromStringAndSize(nullptr, 0);
  if (callable_names.empty_bytes == nullptr || PyType_Ready(&callable_type) < 0)
    throw py::error_already_set();
  m.add_object("UnaryCallableState", py::handle(reinterpret_cast<PyObject*>(&callable_type)));
}

}  // namespace bindings
}  // namespace argrpc
