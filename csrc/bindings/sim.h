// The test fabric's binding: _core._sim_pair() and _core._SimLink (docs/core-api.md,
// "Test fabric"). Its connections must be the module's own Engine, Server and
// Connection objects, so that calls, unary and the server's accept work on them
// unchanged; their wrapper types are private to the unit that binds them, so that unit
// instantiates add_sim with them and hands over its conn_config parser, and sim.cc
// reaches them only through the four functions of SimBridge.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <utility>

#include "tunables.h"

namespace argrpc {

class Connection;
class Engine;
class Server;

struct SimBridge {
  std::function<std::shared_ptr<Engine>(const pybind11::handle&)> engine;  // of a _core.Engine
  std::function<std::shared_ptr<Server>(const pybind11::handle&)> server;  // of a _core.Server
  std::function<ConnConfig(const pybind11::dict&)> conn_config;
  // A _core.Connection handle on `c`.
  std::function<pybind11::object(std::shared_ptr<Engine>, std::shared_ptr<Connection>)> connection;
};

void add_sim(pybind11::module_& m, SimBridge bridge);  // sim.cc

// After Engine, Server and Connection are bound.
template <class PyEngineT, class PyServerT, class PyConnectionT>
void add_sim(pybind11::module_& m, ConnConfig (*conn_config)(const pybind11::dict&)) {
  SimBridge b;
  b.engine = [](const pybind11::handle& h) -> std::shared_ptr<Engine> {
    return h.cast<PyEngineT&>().engine;
  };
  b.server = [](const pybind11::handle& h) -> std::shared_ptr<Server> {
    return h.cast<PyServerT&>().server;
  };
  b.conn_config = conn_config;
  b.connection = [](std::shared_ptr<Engine> e, std::shared_ptr<Connection> c) {
    return pybind11::cast(PyConnectionT::make(std::move(e), std::move(c)));
  };
  add_sim(m, std::move(b));
}

}  // namespace argrpc
