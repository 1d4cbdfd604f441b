// The C part of argrpc.aio's server-side call state (RpcState, argrpc/aio/_context.py).
// An asyncio server makes one per fast-path call, on its loop's thread, before the
// handler runs: as a Python __init__ its twenty field stores were a frame of their own on
// every call's critical path. Here the fields are C members, set to their defaults as
// the object is allocated; the constructor stores only what the call brings. Every
// method stays in Python. Beside it, the fields of the server itself that its loop pass
// reads (AioServerState).
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

// The defaults a new state shares (immutable), made once at import.
PyObject* zero_code;
PyObject* no_details;
PyObject* no_metadata;

extern PyMemberDef server_state_members[];

// A tp_init's arguments are exactly `n` positional ones; else TypeError `message`. (An
// argument parser would cost as much as the rest of the construction.)
bool positional(PyObject* args, PyObject* kwargs, Py_ssize_t n, const char* message) {
  if (PyTuple_Check(args) && PyTuple_GET_SIZE(args) == n &&
      (kwargs == nullptr || PyDict_GET_SIZE(kwargs) == 0))
    return true;
  PyErr_SetString(PyExc_TypeError, message);
  return false;
}

// Allocated with grpc.aio's RPCState defaults: status OK, no details, no trailing
// metadata, empty waiter and callback lists (the lists are the call's own).
PyObject* server_state_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<ServerCallState*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  none_members<server_state_members>(reinterpret_cast<PyObject*>(self));
  PyObject* waiters = PyList_New(0);
  PyObject* callbacks = PyList_New(0);
  if (waiters == nullptr || callbacks == nullptr) {
    Py_XDECREF(waiters);
    Py_XDECREF(callbacks);
    Py_DECREF(self);
    return nullptr;
  }
  Py_SETREF(self->waiters, waiters);
  Py_SETREF(self->callbacks, callbacks);
  set_field(&self->status_code, zero_code);
  set_field(&self->status_details, no_details);
  set_field(&self->trailing_metadata, no_metadata);
  set_field(&self->token, zero_code);
  for (PyObject** flag : {&self->client_closed, &self->metadata_sent, &self->status_sent,
                          &self->disable_next_compression})
    set_field(flag, Py_False);
  return reinterpret_cast<PyObject*>(self);
}

// What a call brings to its state; the rest keeps server_state_new's defaults.
void set_call(ServerCallState* self, PyObject* sc, PyObject* method, PyObject* key,
              PyObject* server, PyObject* loop) {
  set_field(&self->sc, sc);
  set_field(&self->method, method);
  set_field(&self->key, key);
  set_field(&self->server, server);
  set_field(&self->loop, loop);
}

// ServerCallState(sc, method, key, server, loop): positional, as argrpc.aio makes it.
int server_state_init(PyObject* o, PyObject* args, PyObject* kwargs) {
  if (!positional(args, kwargs, 5,
                  "ServerCallState takes five positional arguments: sc, method, key, server, "
                  "loop"))
    return -1;
  set_call(reinterpret_cast<ServerCallState*>(o), PyTuple_GET_ITEM(args, 0),
           PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2), PyTuple_GET_ITEM(args, 3),
           PyTuple_GET_ITEM(args, 4));
  return 0;
}

#define STATE_OBJ(name, field) ARGRPC_OBJECT_MEMBER(ServerCallState, name, field)
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

PyTypeObject server_state_type = fields_type<server_state_members>(
    "argrpc._core.ServerCallState", "The fields of one fast-path call on an argrpc.aio server's loop.",
    sizeof(ServerCallState), server_state_new, server_state_init);

// The fields of the ServicerContext an `async def` handler gets (argrpc/aio/_context.py),
// made for every call before its handler runs: as a Python __init__, a frame of four
// stores on each call's critical path.
struct ServicerContextFields {
  PyObject_HEAD
  PyObject* state;
  PyObject* request_deserializer;
  PyObject* response_serializer;
  PyObject* loop;
};

// ServicerContextFields(state, request_deserializer, response_serializer): positional;
// the loop is the state's.
int context_init(PyObject* o, PyObject* args, PyObject* kwargs) {
  if (!positional(args, kwargs, 3,
                  "a servicer context takes three positional arguments: state, "
                  "request_deserializer, response_serializer"))
    return -1;
  auto* self = reinterpret_cast<ServicerContextFields*>(o);
  PyObject* state = PyTuple_GET_ITEM(args, 0);
  PyObject* loop = PyObject_TypeCheck(state, &server_state_type)
                       ? Py_NewRef(reinterpret_cast<ServerCallState*>(state)->loop)
                       : PyObject_GetAttrString(state, "loop");
  if (loop == nullptr) return -1;
  set_field(&self->state, state);
  set_field(&self->request_deserializer, PyTuple_GET_ITEM(args, 1));
  set_field(&self->response_serializer, PyTuple_GET_ITEM(args, 2));
  Py_SETREF(self->loop, loop);
  return 0;
}

#define CONTEXT_OBJ(name, field) ARGRPC_OBJECT_MEMBER(ServicerContextFields, name, field)
PyMemberDef context_members[] = {
    CONTEXT_OBJ("_state", state),
    CONTEXT_OBJ("_request_deserializer", request_deserializer),
    CONTEXT_OBJ("_response_serializer", response_serializer),
    CONTEXT_OBJ("_loop", loop),
    {nullptr, 0, 0, 0, nullptr},
};
#undef CONTEXT_OBJ

PyTypeObject context_fields_type = fields_type<context_members>(
    "argrpc._core.ServicerContextFields",
    "The fields of an argrpc.aio fast-path call's servicer context.", sizeof(ServicerContextFields),
    none_new<context_members>, context_init);

#define SERVER_OBJ(name, field) ARGRPC_OBJECT_MEMBER(AioServerState, name, field)
PyMemberDef aio_server_members[] = {
    SERVER_OBJ("_core", core),
    SERVER_OBJ("_stage", stage),
    SERVER_OBJ("_plans", plans),
    SERVER_OBJ("_context", context),
    SERVER_OBJ("_loop", loop),
    SERVER_OBJ("_max_send", max_send),
    {nullptr, 0, 0, 0, nullptr},
};
#undef SERVER_OBJ

PyTypeObject aio_server_type = fields_type<aio_server_members>(
    "argrpc._core.AioServerState",
    "The fields of an argrpc.aio server that its loop pass reads in C.", sizeof(AioServerState),
    none_new<aio_server_members>, nullptr);

}  // namespace

AioServerState* aio_server_state(PyObject* o) {
  return PyObject_TypeCheck(o, &aio_server_type) ? reinterpret_cast<AioServerState*>(o) : nullptr;
}

bool is_server_call_state(PyObject* o) { return PyObject_TypeCheck(o, &server_state_type); }

PyTypeObject* server_call_state_type() { return &server_state_type; }

PyObject* new_call_state(PyTypeObject* type, PyObject* sc, PyObject* method, PyObject* key,
                         PyObject* server, PyObject* loop) {
  PyObject* o = server_state_new(type, nullptr, nullptr);
  if (o == nullptr) return nullptr;
  set_call(reinterpret_cast<ServerCallState*>(o), sc, method, key, server, loop);
  return o;
}

void add_aio_server_state(py::module_& m) {
  zero_code = PyLong_FromLong(0);
  no_details = PyUnicode_InternFromString("");
  no_metadata = PyTuple_New(0);
  if (zero_code == nullptr || no_details == nullptr || no_metadata == nullptr ||
      PyType_Ready(&server_state_type) < 0)
    throw py::error_already_set();
  m.add_object("ServerCallState", py::handle(reinterpret_cast<PyObject*>(&server_state_type)));
  if (PyType_Ready(&context_fields_type) < 0) throw py::error_already_set();
  m.add_object("ServicerContextFields",
               py::handle(reinterpret_cast<PyObject*>(&context_fields_type)));
  if (PyType_Ready(&aio_server_type) < 0) throw py::error_already_set();
  m.add_object("AioServerState", py::handle(reinterpret_cast<PyObject*>(&aio_server_type)));
}

}  // namespace bindings
}  // namespace argrpc
