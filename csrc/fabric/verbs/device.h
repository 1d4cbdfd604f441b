// RDMA device, port and GID discovery, and the selection rule (TF_RDMA_DEV_NAME,
// TF_RDMA_PORT_NUM, TF_RDMA_GID_INDEX, else the route to the peer, else the first usable).
// Read-only: opens each device only to query it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace argrpc {
namespace verbs {

struct GidInfo {
  int index = 0;
  std::string gid;   // text form; IPv4-mapped ones read "::ffff:a.b.c.d"
  std::string type;  // "RoCEv2" | "RoCEv1" | "IB"
  uint8_t raw[16] = {};
};

struct PortInfo {
  int port = 0;
  std::string state;  // "ACTIVE", "DOWN", ...
  int state_num = 0;  // enum ibv_port_state
  int mtu = 0;        // max MTU, bytes
  int active_mtu = 0; // bytes
  int active_mtu_enum = 0;  // enum ibv_mtu (what a QP's path_mtu takes)
  std::string link_layer;   // "Ethernet" | "InfiniBand"
  int lid = 0;
  std::vector<GidInfo> gids;  // non-zero entries only
};

struct DeviceInfo {
  std::string name;
  std::string node_guid;  // "xxxx:xxxx:xxxx:xxxx"
  std::vector<PortInfo> ports;
};

// Every device verbs sees; [] when libibverbs is missing or there is none. Never throws.
std::vector<DeviceInfo> list_devices();

struct Selection {
  std::string device;
  int port = 0;
  int gid_index = 0;
  std::string gid, gid_type;
  uint8_t gid_raw[16] = {};
  int mtu = 0;       // active MTU, bytes
  int mtu_enum = 0;  // enum ibv_mtu
  std::string link_layer;
  int lid = 0;
  std::string netdev;  // the network interface the GID belongs to ("" for IB, or unknown)
  std::string why;     // how each part was chosen, for `argrpc doctor`
};

// dev_name empty / port 0 / gid_index < 0 mean "choose". `peer` ("" if unknown) is the
// IP address the connection is for: what is left to choose then goes by the kernel's
// route to it, i.e. the RoCE GID that carries this host's source address for that route;
// without such a GID (or a route) the choice is the one without a peer, and `why` says
// so. `gid_type` ("" or a GidInfo::type, e.g. the peer's) is preferred among GIDs.
// Throws CoreError with the reason when a named thing is missing or unusable, when
// nothing is usable, or when `peer` is not an IP address.
Selection select(const std::string& dev_name, int port, int gid_index, const std::string& peer = "",
                 const std::string& gid_type = "");

}  // namespace verbs
}  // namespace argrpc
