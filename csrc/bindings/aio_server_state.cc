// The C part of argrpc.aio's server-side call state (RpcState, argrpc/aio/_context.py).
// An asyncio server makes one per fast-path call, on its loop's thread, before the
// handler runs: as a Python __init__ its twenty field stores were a frame of their own on
// every call's critical path. Here the fields are C members, set to their defaults as
// the object is allocated; the constructor stores only what the call brings. Every
// method stays in Python.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <initializer_list>

#include "bindings/aio_server_state.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

#define SERVER_STATE_FIELDS(X)                                                            \
  X(sc) X(method) X(server) X(loop) X(task) X(key) X(waiters) X(abort_exception)        \
  X(status_code) X(py_status_code) X(status_details) X(trailing_metadata)               \
  X(compression_algorithm) X(callbacks) X(invocation_metadata) X(token) X(client_closed) \
  X(metadata_sent) X(status_sent) X(disable_next_compression)

// The defaults a new state shares (immutable), made once at import.
PyObject* zero_code;
PyObject* no_details;
PyObject* no_metadata;

int server_state_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ServerCallState*>(o);
#define VISIT(f) Py_VISIT(self->f);
  SERVER_STATE_FIELDS(VISIT)
#undef VISIT
  return 0;
}

int server_state_clear(PyObject* o) {
  auto* self = reinterpret_cast<ServerCallState*>(o);
#define CLEAR(f) Py_CLEAR(self->f);
  SERVER_STATE_FIELDS(CLEAR)
#undef CLEAR
  return 0;
}

void server_state_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  server_state_clear(o);
  Py_TYPE(o)->tp_free(o);
}

// Allocated with grpc.aio's RPCState defaults: status OK, no details, no trailing
// metadata, empty waiter and callback lists (the lists are the call's own).
void set_field(PyObject** field, PyObject* value) {
  Py_INCREF(value);
  Py_XSETREF(*field, value);
}

PyObject* server_state_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<ServerCallState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->waiters = PyList_New(0);
  self->callbacks = PyList_New(0);
  if (self->waiters == nullptr || self->callbacks == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  set_field(&self->status_code, zero_code);
  set_field(&self->status_details, no_details);
  set_field(&self->trailing_metadata, no_metadata);
  set_field(&self->token, zero_code);
  for (PyObject** flag : {&self->client_closed, &self->metadata_sent, &self->status_sent,
                          &self->disable_next_compression})
    set_field(flag, Py_False);
  for (PyObject** none : {&self->sc, &self->method, &self->server, &self->loop, &self->task,
                          &self->key, &self->abort_exception, &self->py_status_code,
                          &self->compression_algorithm, &self->invocation_metadata})
    set_field(none, Py_None);
  return reinterpret_cast<PyObject*>(self);
}

// ServerCallState(sc, method, key, server, loop): positional, as argrpc.aio makes it (an
// argument parser would cost as much as the rest of the construction).
int server_state_init(PyObject* o, PyObject* args, PyObject* kwargs) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 5 ||
      (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError,
                    "ServerCallState takes five positional arguments: sc, method, key, server, "
                    "loop");
    return -1;
  }
  auto* self = reinterpret_cast<ServerCallState*>(o);
  set_field(&self->sc, PyTuple_GET_ITEM(args, 0));
  set_field(&self->method, PyTuple_GET_ITEM(args, 1));
  set_field(&self->key, PyTuple_GET_ITEM(args, 2));
  set_field(&self->server, PyTuple_GET_ITEM(args, 3));
  set_field(&self->loop, PyTuple_GET_ITEM(args, 4));
  return 0;
}

#define STATE_OBJ(name, field) \
  {const_cast<char*>(name), T_OBJECT_EX, offsetof(ServerCallState, field), 0, nullptr}
PyMemberDef server_state_members[] = {
    STATE_OBJ("sc", sc),
    STATE_OBJ("method", method),
    STATE_OBJ("server", server),
    STATE_OBJ("loop", loop),
    STATE_OBJ("task", task),
    STATE_OBJ("key", key),
    STATE_OBJ("_waiters", waiters),
    STATE_OBJ("abort_exception", abort_exception),
    STATE_OBJ("status_code", status_code),
    STATE_OBJ("py_status_code", py_status_code),
    STATE_OBJ("status_details", status_details),
    STATE_OBJ("trailing_metadata", trailing_metadata),
    STATE_OBJ("compression_algorithm", compression_algorithm),
    STATE_OBJ("callbacks", callbacks),
    STATE_OBJ("_invocation_metadata", invocation_metadata),
    STATE_OBJ("token", token),
    STATE_OBJ("client_closed", client_closed),
    STATE_OBJ("metadata_sent", metadata_sent),
    STATE_OBJ("status_sent", status_sent),
    STATE_OBJ("disable_next_compression", disable_next_compression),
    {nullptr, 0, 0, 0, nullptr},
};
#undef STATE_OBJ

PyTypeObject server_state_type = [] {
  PyTypeObject t = static_type("argrpc._core.ServerCallState",
                               "The fields of one fast-path call on an argrpc.aio server's loop.",
                               sizeof(ServerCallState),
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC);
  t.tp_new = server_state_new;
  t.tp_init = server_state_init;
  t.tp_dealloc = server_state_dealloc;
  t.tp_traverse = server_state_traverse;
  t.tp_clear = server_state_clear;
  t.tp_members = server_state_members;
  return t;
}();

}  // namespace

bool is_server_call_state(PyObject* o) { return PyObject_TypeCheck(o, &server_state_type); }

void add_aio_server_state(py::module_& m) {
  zero_code = PyLong_FromLong(0);
  no_details = PyUnicode_InternFromString("");
  no_metadata = PyTuple_New(0);
  if (zero_code == nullptr || no_details == nullptr || no_metadata == nullptr ||
      PyType_Ready(&server_state_type) < 0)
    throw py::error_already_set();
  m.add_object("ServerCallState", py::handle(reinterpret_cast<PyObject*>(&server_state_type)));
}

}  // namespace bindings
}  // namespace argrpc
