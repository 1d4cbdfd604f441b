// The verbs fabric's bindings: loader status, device discovery and selection (what
// `argrpc doctor` prints), endpoints and attach. libibverbs is loaded at run time, so
// all of this imports and answers on a host without rdma-core.
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "common/error.h"
#include "fabric/verbs/device.h"
#include "fabric/verbs/ibv_loader.h"
#include "fabric/verbs/verbs_fabric.h"
#include "pool/pool.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace argrpc {
namespace bindings {

namespace {

py::dict selection_dict(const verbs::Selection& s) {
  return py::dict("device"_a = s.device, "port"_a = s.port, "gid_index"_a = s.gid_index, "gid"_a = s.gid,
                  "gid_type"_a = s.gid_type, "mtu"_a = s.mtu, "link_layer"_a = s.link_layer, "lid"_a = s.lid,
                  "netdev"_a = s.netdev, "why"_a = s.why);
}

std::string opt_str(const py::object& o) { return o.is_none() ? "" : o.cast<std::string>(); }

verbs::Selection selection_arg(const py::dict& d) {
  // Re-selected from the names so the raw GID and port facts are current; how they were
  // chosen (e.g. by the route to the peer) is the caller's `why`, not "named".
  const std::string dev = d.contains("device") && !d["device"].is_none() ? d["device"].cast<std::string>() : "";
  const int port = d.contains("port") && !d["port"].is_none() ? d["port"].cast<int>() : 0;
  const int gid = d.contains("gid_index") && !d["gid_index"].is_none() ? d["gid_index"].cast<int>() : -1;
  verbs::Selection s = verbs::select(dev, port, gid);
  if (d.contains("why") && !d["why"].is_none()) s.why = d["why"].cast<std::string>();
  return s;
}

py::list devices_list() {
  py::list out;
  for (auto& dev : verbs::list_devices()) {
    py::list ports;
    for (auto& p : dev.ports) {
      py::list gids;
      for (auto& g : p.gids) gids.append(py::dict("index"_a = g.index, "gid"_a = g.gid, "type"_a = g.type));
      ports.append(py::dict("port"_a = p.port, "state"_a = p.state, "state_num"_a = p.state_num, "mtu"_a = p.mtu,
                            "active_mtu"_a = p.active_mtu, "link_layer"_a = p.link_layer, "lid"_a = p.lid,
                            "gids"_a = gids));
    }
    out.append(py::dict("name"_a = dev.name, "node_guid"_a = dev.node_guid, "ports"_a = ports));
  }
  return out;
}

struct PyVerbsEndpoint : PyEndpoint<verbs::VerbsEndpoint> {
  std::string blob;
};

}  // namespace

void add_verbs(py::module_& m, py::class_<PyEngine>& engine) {
  m.def("verbs_status", [] { return verbs::status(); });
  m.def("verbs_devices", [] { return devices_list(); });
  // Receive-ring bytes this process's verbs endpoints hold (RingShare).
  m.def("verbs_ring_bytes", [] { return verbs::RingShare::in_use(); });
  m.def("verbs_select",
        [](py::object dev, py::object port, py::object gid_index, py::object peer, py::object gid_type) {
          return selection_dict(verbs::select(opt_str(dev), port.is_none() ? 0 : port.cast<int>(),
                                              gid_index.is_none() ? -1 : gid_index.cast<int>(),
                                              opt_str(peer), opt_str(gid_type)));
        },
        py::arg("dev_name") = py::none(), py::arg("port") = py::none(), py::arg("gid_index") = py::none(),
        py::arg("peer") = py::none(), py::arg("gid_type") = py::none());

  py::class_<PyVerbsEndpoint>(m, "VerbsEndpoint")
      .def_property_readonly("blob", [](PyVerbsEndpoint& e) { return py::bytes(e.blob); })
      .def_property_readonly("qps", [](PyVerbsEndpoint& e) { return e.get().qps(); })
      .def_property_readonly("ring_size", [](PyVerbsEndpoint& e) { return e.get().ring_size(); })
      .def_property_readonly("selection", [](PyVerbsEndpoint& e) { return selection_dict(e.get().selection()); });

  engine
      .def("new_verbs_endpoint",
           [](PyEngine& e, py::dict cfg, py::dict select) {
             // One dict carries the connection's and the verbs fabric's knobs
             // (argrpc._config.conn_config).
             PyVerbsEndpoint ep;
             ep.cfg = conn_config(cfg);
             const VerbsConfig v = verbs_config(cfg);
             const verbs::Selection sel = selection_arg(select);
             {
               NoGil nogil;  // registration can take a while
               ep.ep = verbs::VerbsEndpoint::create(ep.cfg, v, sel, e.engine->pool());
             }
             ep.blob = ep.ep->blob();
             return ep;
           },
           py::arg("conn_config"), py::arg("select"))
      .def("attach_verbs",
           [](PyEngine& e, PyVerbsEndpoint& ep, py::bytes peer_blob, py::object server,
              PeerInfo remote) {
             std::shared_ptr<Server> srv = server_arg(server);
             std::unique_ptr<verbs::VerbsEndpoint> local = ep.take();
             const std::string blob = peer_blob;
             std::shared_ptr<Connection> conn;
             {
               NoGil nogil;
               auto fabric = std::make_unique<verbs::VerbsFabric>(std::move(local), blob);
               conn = e.engine->attach(std::move(fabric), ep.cfg, srv, std::move(remote));
             }
             return PyConnection::make(e.engine, conn);
           },
           py::arg("endpoint"), py::arg("peer_blob"), py::arg("server"), py::arg("remote"));
}

}  // namespace bindings
}  // namespace argrpc
