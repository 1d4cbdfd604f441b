// The module: each bound object's unit adds it (bindings.h lists them), in this order.
// The units convert arguments, release the GIL around every wait and every copy, and
// turn CoreError into argrpc._core.CoreError. No call-path function raises: calls end
// with a status the facade reads.
#include <pybind11/pybind11.h>

#include <exception>

#include "bindings/bindings.h"
#include "common/error.h"

namespace py = pybind11;
using namespace argrpc;
using namespace argrpc::bindings;

PYBIND11_MODULE(_core, m) {
  m.doc() = "argrpc engine: adaptive eager/rendezvous transport over a fabric (shm, verbs)";
  static py::exception<CoreError> core_error(m, "CoreError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CoreError& e) {
      py::set_error(core_error, e.what());
    }
  });

  add_heap_stats(m);
  add_config(m);
  add_buffers(m);
  add_peer_info(m);
  auto engine = add_engine(m);
  auto connection = add_connection(m);
  auto client_call = add_client_call(m);
  auto server = add_server(m);
  auto server_call = add_server_call(m);
#ifdef ARGRPC_TEST_HOOKS
  add_test_probes(m, connection);
#endif

  // Each fabric's endpoint and the Engine methods that make and attach one; after
  // Connection, which attach returns.
  add_shm(m, engine);
  add_verbs(m, engine);
#ifdef ARGRPC_TEST_HOOKS
  add_sim(m);  // the test fabric (docs/core-api.md, "Test fabric")
  m.attr("test_hooks") = true;
#else
  m.attr("test_hooks") = false;  // setup.py: built without ARGRPC_TEST_HOOKS=1
#endif
  add_log(m);
  add_call_stats(m, connection);
  add_aio(m, engine, connection, client_call, server, server_call);
  add_server_serve(m);
  add_unary_callable(m);
  add_aio_loop_state(m);
  add_aio_call(m);
  add_aio_unary_callable(m);
  add_aio_server_state(m);
  add_aio_serve(m);
  add_floor(m, engine);  // argrpc-bench's reference rows
}
