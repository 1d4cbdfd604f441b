// The fields argrpc.aio's client calls read and count on every call: their loop's bridge
// (LoopBridge, argrpc/aio/_loop.py) and their channel (argrpc/aio/_channel.py). Each is
// the C base of its Python class, so the call's start and end (aio_call.cc) read the
// fields and change the counts directly instead of through a dozen attribute lookups by
// name (about 200 instructions each) and a Python method. Every method stays in Python.
#pragma once
#include <Python.h>

namespace argrpc {
namespace bindings {

// Every field an object, never NULL while the object lives (T_OBJECT_EX, which Python
// code reads as fast as a __slots__ slot); the counts are int objects.
struct LoopBridgeState {
  PyObject_HEAD
  PyObject* engine;
  PyObject* notifier;
  PyObject* ready;      // asyncio's ready deque, or None
  PyObject* callbacks;  // token -> the callback run after each change
  PyObject* next;       // the next token
  PyObject* inflight;   // calls not ended, servers taking calls
};

struct ChannelState {
  PyObject_HEAD
  PyObject* inflight;        // fast-path calls not ended (close(grace) waits for them)
  PyObject* closing;         // True once close() began
  PyObject* fast;            // the fast connection its calls take, or None
  PyObject* service_config;  // its ServiceConfig
};

// `o` as a LoopBridgeState / ChannelState, or nullptr when it is not one (no error set).
LoopBridgeState* loop_bridge_state(PyObject* o);
ChannelState* channel_state(PyObject* o);
// Adds `delta` to the int object in `*field`; -1 with an error set if it is no int.
int add_to_count(PyObject** field, long delta);
// The bridge's register() for `callback`: its token into *token, and as an int object
// (new reference) into *token_obj.
int register_callback(LoopBridgeState* bridge, PyObject* callback, unsigned long long* token,
                      PyObject** token_obj);
// The bridge's finished(token): the callback goes, the count goes down.
int finish_token(LoopBridgeState* bridge, PyObject* token);

}  // namespace bindings
}  // namespace argrpc
