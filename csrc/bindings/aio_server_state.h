// The fields of argrpc.aio's server and of its server-side call state (the C bases of its
// Server and RpcState, aio_server_state.cc), read and set in C by the server's loop pass
// and the planned unary answer (aio_serve.cc).
#pragma once
#include <Python.h>

namespace argrpc {
namespace bindings {

// Every field an object, never NULL while the state lives: CPython (3.11) specializes an
// attribute read or write of a T_OBJECT_EX member as it does a __slots__ slot's, and
// goes through the generic lookup for any other member kind (T_OBJECT, T_BOOL, integers),
// several times slower on the twenty-odd reads and writes a call makes. So the flags are
// True/False objects and the token an int object.
struct ServerCallState {
  PyObject_HEAD
  PyObject* sc;
  PyObject* method;
  PyObject* server;
  PyObject* loop;
  PyObject* task;
  PyObject* key;
  PyObject* waiters;
  PyObject* abort_exception;
  PyObject* status_code;
  PyObject* py_status_code;
  PyObject* status_details;
  PyObject* trailing_metadata;
  PyObject* compression_algorithm;
  PyObject* callbacks;
  PyObject* invocation_metadata;
  PyObject* token;
  PyObject* client_closed;
  PyObject* metadata_sent;
  PyObject* status_sent;
  PyObject* disable_next_compression;
};

// The fields of argrpc.aio's Server (its C base) that its loop pass (ServerPass,
// aio_serve.cc) reads on every pass with calls: read through the server's attributes, they
// were five lookups a pass. Set by the Python server; each an object, as above.
struct AioServerState {
  PyObject_HEAD
  PyObject* core;      // _core: the engine's Server, or None without the fast path
  PyObject* stage;     // _stage
  PyObject* plans;     // _plans: {method: plan} of the methods answered in C
  PyObject* context;   // _context: what each call's context is copied from
  PyObject* loop;      // _loop
  PyObject* max_send;  // _max_send: an int, -1 for no limit
};

// `o` as an AioServerState, or nullptr when it is not one (no error set).
AioServerState* aio_server_state(PyObject* o);

bool is_server_call_state(PyObject* o);
PyTypeObject* server_call_state_type();
// A new state of `type` (ServerCallState or a subclass: argrpc.aio's RpcState) for a call,
// as ServerCallState(sc, method, key, server, loop) makes it, without the call's
// argument tuple.
PyObject* new_call_state(PyTypeObject* type, PyObject* sc, PyObject* method, PyObject* key,
                         PyObject* server, PyObject* loop);

}  // namespace bindings
}  // namespace argrpc
