// LoopBridgeState and ChannelState (aio_loop_state.h): the C bases of argrpc.aio's
// LoopBridge and Channel, and the bridge's register/finished for the client call's start
// and end in C.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "bindings/aio_loop_state.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

extern PyMemberDef bridge_members[];
extern PyMemberDef channel_members[];

PyObject* bridge_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<LoopBridgeState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  none_members<bridge_members>(reinterpret_cast<PyObject*>(self));
  PyObject* callbacks = PyDict_New();
  PyObject* next = PyLong_FromLong(1);
  PyObject* inflight = PyLong_FromLong(0);
  if (callbacks == nullptr || next == nullptr || inflight == nullptr) {
    Py_XDECREF(callbacks);
    Py_XDECREF(next);
    Py_XDECREF(inflight);
    Py_DECREF(self);
    return nullptr;
  }
  Py_SETREF(self->callbacks, callbacks);
  Py_SETREF(self->next, next);
  Py_SETREF(self->inflight, inflight);
  return reinterpret_cast<PyObject*>(self);
}

#define BRIDGE_OBJ(name, field) ARGRPC_OBJECT_MEMBER(LoopBridgeState, name, field)
PyMemberDef bridge_members[] = {
    BRIDGE_OBJ("engine", engine),
    BRIDGE_OBJ("notifier", notifier),
    BRIDGE_OBJ("ready", ready),
    BRIDGE_OBJ("_callbacks", callbacks),
    BRIDGE_OBJ("_next", next),
    BRIDGE_OBJ("_inflight", inflight),
    {nullptr, 0, 0, 0, nullptr},
};
#undef BRIDGE_OBJ

// poll(limit_s=None): the engine driven on the loop's thread until something is posted
// (at most the engine's spin, and `limit_s`), then the callbacks of the tokens posted
// run; True if any token came. A server's every call comes through here, so the tokens
// never become a Python list and the callbacks are looked up and called in C.
PyObject* bridge_poll(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<LoopBridgeState*>(o);
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "poll(limit_s=None) takes at most one argument");
    return nullptr;
  }
  int64_t limit_us = kPollForeverUs;
  if (nargs == 1 && args[0] != Py_None) {
    const double s = PyFloat_AsDouble(args[0]);
    if (s == -1 && PyErr_Occurred()) return nullptr;
    limit_us = s >= 0 ? (s < 1e6 ? static_cast<int64_t>(s * 1e6) : kPollForeverUs) : 0;
  }
  std::vector<uint64_t> tokens;
  try {
    PyNotifier& n = py::cast<PyNotifier&>(py::handle(self->notifier));
    PyEngine& e = py::cast<PyEngine&>(py::handle(self->engine));
    if (n.here.inherited() || e.engine.inherited()) Py_RETURN_FALSE;
    NoGil nogil;
    tokens = n.n->poll(*e.engine, limit_us);
  } catch (...) {
    restore_python_error(std::current_exception());
    return nullptr;
  }
  if (tokens.empty()) Py_RETURN_FALSE;
  // The dict the poll began with, as LoopBridge.run reads it once.
  PyObject* callbacks = Py_NewRef(self->callbacks);
  for (const uint64_t token : tokens) {
    PyObject* key = PyLong_FromUnsignedLongLong(token);
    PyObject* callback = key == nullptr ? nullptr : PyDict_GetItemWithError(callbacks, key);
    Py_XDECREF(key);
    if (callback == nullptr) {
      if (PyErr_Occurred()) {
        Py_DECREF(callbacks);
        return nullptr;
      }
      continue;  // its call ended meanwhile
    }
    Py_INCREF(callback);  // a callback may drop its own entry
    PyObject* result = PyObject_CallNoArgs(callback);
    Py_DECREF(callback);
    if (result == nullptr) {
      Py_DECREF(callbacks);
      return nullptr;
    }
    Py_DECREF(result);
  }
  Py_DECREF(callbacks);
  Py_RETURN_TRUE;
}

PyMethodDef bridge_methods[] = {
    {"poll", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(bridge_poll)),
     METH_FASTCALL,
     "poll(limit_s=None): drive the engine briefly on the loop's thread and run the "
     "callbacks of what changed meanwhile; True if anything did."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject bridge_type = [] {
  PyTypeObject t = fields_type<bridge_members>(
      "argrpc._core.LoopBridgeState",
      "The fields of an argrpc.aio loop's bridge that its calls read and count, and its "
      "poll.",
      sizeof(LoopBridgeState), bridge_new, nullptr);
  t.tp_methods = bridge_methods;
  return t;
}();

PyObject* channel_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<ChannelState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject* zero = PyLong_FromLong(0);
  if (zero == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  self->inflight = zero;
  self->closing = Py_NewRef(Py_False);
  self->fast = Py_NewRef(Py_None);
  self->service_config = Py_NewRef(Py_None);
  return reinterpret_cast<PyObject*>(self);
}

#define CHANNEL_OBJ(name, field) ARGRPC_OBJECT_MEMBER(ChannelState, name, field)
PyMemberDef channel_members[] = {
    CHANNEL_OBJ("inflight", inflight),
    CHANNEL_OBJ("closing", closing),
    CHANNEL_OBJ("_fast", fast),
    CHANNEL_OBJ("_service_config", service_config),
    {nullptr, 0, 0, 0, nullptr},
};
#undef CHANNEL_OBJ

PyTypeObject channel_type = fields_type<channel_members>(
    "argrpc._core.ChannelState",
    "The fields of an argrpc.aio channel that its calls read and count.", sizeof(ChannelState),
    channel_new, nullptr);

}  // namespace

LoopBridgeState* loop_bridge_state(PyObject* o) {
  return PyObject_TypeCheck(o, &bridge_type) ? reinterpret_cast<LoopBridgeState*>(o) : nullptr;
}

ChannelState* channel_state(PyObject* o) {
  return PyObject_TypeCheck(o, &channel_type) ? reinterpret_cast<ChannelState*>(o) : nullptr;
}

int add_to_count(PyObject** field, long delta) {
  const long n = PyLong_AsLong(*field);
  if (n == -1 && PyErr_Occurred()) return -1;
  PyObject* sum = PyLong_FromLong(n + delta);
  if (sum == nullptr) return -1;
  Py_SETREF(*field, sum);
  return 0;
}

int register_callback(LoopBridgeState* bridge, PyObject* callback, unsigned long long* token,
                      PyObject** token_obj) {
  PyObject* next = Py_NewRef(bridge->next);
  *token = PyLong_AsUnsignedLongLong(next);
  if ((*token == static_cast<unsigned long long>(-1) && PyErr_Occurred()) ||
      add_to_count(&bridge->next, 1) < 0 || PyDict_SetItem(bridge->callbacks, next, callback) < 0) {
    Py_DECREF(next);
    return -1;
  }
  *token_obj = next;
  return 0;
}

int finish_token(LoopBridgeState* bridge, PyObject* token) {
  if (PyDict_DelItem(bridge->callbacks, token) < 0) {
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
    PyErr_Clear();  // as finished()'s pop(token, None)
  }
  return add_to_count(&bridge->inflight, -1);
}

void add_aio_loop_state(py::module_& m) {
  if (PyType_Ready(&bridge_type) < 0 || PyType_Ready(&channel_type) < 0)
    throw py::error_already_set();
  m.add_object("LoopBridgeState", py::handle(reinterpret_cast<PyObject*>(&bridge_type)));
  m.add_object("ChannelState", py::handle(reinterpret_cast<PyObject*>(&channel_type)));
}

}  // namespace bindings
}  // namespace argrpc
