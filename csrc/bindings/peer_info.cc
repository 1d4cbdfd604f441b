// PeerInfo: who is on the other end of a connection, as the facade learnt it when it
// negotiated (name, grpc's address form, user-agent, auth properties).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "engine/peer_info.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

void add_peer_info(py::module_& m) {
  py::class_<PeerInfo>(m, "PeerInfo")
      .def(py::init([](std::string name, std::string address, std::string user_agent,
                       std::vector<std::pair<std::string, py::bytes>> auth,
                       std::string identity_key) {
             PeerInfo p(std::move(name));
             p.address = std::move(address);
             p.user_agent = std::move(user_agent);
             for (auto& kv : auth) p.auth.emplace_back(kv.first, std::string(kv.second));
             p.identity_key = std::move(identity_key);
             return p;
           }),
           py::arg("name"), py::arg("address") = "", py::arg("user_agent") = "",
           py::arg("auth") = std::vector<std::pair<std::string, py::bytes>>(),
           py::arg("identity_key") = "")
      .def(py::init<std::string>(), py::arg("name"))
      .def_readonly("name", &PeerInfo::name)
      .def_readonly("address", &PeerInfo::address)
      .def_readonly("user_agent", &PeerInfo::user_agent);
  py::implicitly_convertible<py::str, PeerInfo>();
}

}  // namespace bindings
}  // namespace argrpc
