// The shm fabric's bindings: its endpoint, whose fds the facade sends to the peer over
// the authenticated Unix socket, and attach with the peer's fds and that socket.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "common/error.h"
#include "common/unique_fd.h"
#include "fabric/shm/shm_fabric.h"
#include "pool/pool.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {
using PyShmEndpoint = PyEndpoint<ShmEndpoint>;
}  // namespace

ShmPeer shm_peer_arg(const py::dict& peer) {
  ShmPeer p;
  p.ring_fd = UniqueFd(peer["ring_fd"].cast<int>());
  p.pool_fd = UniqueFd(peer["pool_fd"].cast<int>());
  p.ring_size = peer["ring_size"].cast<size_t>();
  p.pool_size = peer["pool_size"].cast<size_t>();
  return p;
}

void add_shm(py::module_& m, py::class_<PyEngine>& engine) {
  py::class_<PyShmEndpoint>(m, "ShmEndpoint")
      .def_property_readonly("ring_fd", [](PyShmEndpoint& e) { return e.get().ring_fd(); })
      .def_property_readonly("ring_size", [](PyShmEndpoint& e) { return e.get().ring_size(); });

  engine
      .def("new_shm_endpoint", [](PyEngine&, py::dict cfg) {
        PyShmEndpoint ep;
        ep.cfg = conn_config(cfg);
        // A memfd and a mapping: a server's other threads and a client's bootstrap RPC
        // go on meanwhile.
        NoGil nogil;
        ep.ep = ShmEndpoint::create(ep.cfg);
        return ep;
      })
      .def("attach_shm",
           [](PyEngine& e, PyShmEndpoint& ep, py::dict peer, int sock_fd, py::object server,
              PeerInfo remote) {
             // Take ownership of every fd first so each one is closed on any failure.
             UniqueFd sock(sock_fd);
             ShmPeer p = shm_peer_arg(peer);
             std::shared_ptr<Server> srv = server_arg(server);
             auto fabric = std::make_unique<ShmFabric>(ep.take(), std::move(p), std::move(sock),
                                                       e.engine->pool(), &e.engine->copier(),
                                                       e.engine->wake_fd());
             auto conn = e.engine->attach(std::move(fabric), ep.cfg, srv, std::move(remote));
             return PyConnection::make(e.engine, conn);
           },
           py::arg("endpoint"), py::arg("peer"), py::arg("sock_fd"), py::arg("server"),
           py::arg("remote"));
}

}  // namespace bindings
}  // namespace argrpc
