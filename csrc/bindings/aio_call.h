// The start of an argrpc.aio unary call in C (aio_call.cc), for the multicallable that
// makes it (aio_unary_callable.cc).
#pragma once
#include <Python.h>

namespace argrpc {
namespace bindings {

// A new UnaryUnaryCall (`type`, a UnaryCallState subclass) made and started on `conn_obj`
// (a Connection); None: nothing sent, route the call again; NotImplemented: the request
// is no buffer (the Python constructor reports it).
PyObject* make_unary(PyTypeObject* type, PyObject* channel, PyObject* bridge, PyObject* conn_obj,
                     PyObject* method_obj, PyObject* timeout_obj, PyObject* request,
                     PyObject* deserializer, bool retry_unsent);

}  // namespace bindings
}  // namespace argrpc
