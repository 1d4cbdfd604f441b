#include "fabric/verbs/device.h"

#include <arpa/inet.h>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/error.h"
#include "fabric/verbs/ibv_api.h"

namespace argrpc {
namespace verbs {

namespace {

int mtu_bytes(int e) { return e >= IBV_MTU_256 && e <= IBV_MTU_4096 ? 128 << e : 0; }

std::string state_name(const Api& a, int s) {
  // ibv_port_state_str says "active" (older: "PORT_ACTIVE"); the API promises "ACTIVE".
  std::string t = a.port_state_str(static_cast<ibv_port_state>(s));
  if (t.rfind("PORT_", 0) == 0) t = t.substr(5);
  for (auto& c : t) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return t;
}

std::string guid_text(uint64_t be) {
  uint8_t b[8];
  std::memcpy(b, &be, 8);  // big endian in memory
  char s[24];
  std::snprintf(s, sizeof s, "%02x%02x:%02x%02x:%02x%02x:%02x%02x", b[0], b[1], b[2], b[3], b[4],
                b[5], b[6], b[7]);
  return s;
}

std::string gid_text(const uint8_t raw[16]) {
  char s[INET6_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET6, raw, s, sizeof s);
  return s;
}

bool ipv4_mapped(const uint8_t raw[16]) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(raw, prefix, 12) == 0;
}

// The kernel's text for a GID's type: "IB/RoCE v1" or "RoCE v2". Empty if unreadable.
std::string sysfs_gid_type(const std::string& dev, int port, int index) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) +
                  "/gid_attrs/types/" + std::to_string(index));
  std::string line;
  if (!f || !std::getline(f, line)) return "";
  return line;
}

std::string gid_type(const Api& a, ibv_context* ctx, const std::string& dev, int port, int index,
                     bool ethernet) {
  if (!ethernet) return "IB";
  if (a.query_gid_ex) {
    ibv_gid_entry e{};
    if (a.query_gid_ex(ctx, port, index, &e, 0, sizeof e) == 0) {
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2) return "RoCEv2";
      if (e.gid_type == IBV_GID_TYPE_ROCE_V1) return "RoCEv1";
      return "IB";
    }
  }
  const std::string t = sysfs_gid_type(dev, port, index);
  if (t.find("v2") != std::string::npos) return "RoCEv2";
  return "RoCEv1";
}

struct DeviceList {
  const Api& a;
  ibv_device** list = nullptr;
  int n = 0;
  explicit DeviceList(const Api& api) : a(api) { list = a.get_device_list(&n); }
  ~DeviceList() {
    if (list) a.free_device_list(list);
  }
};

struct Context {
  const Api& a;
  ibv_context* ctx;
  Context(const Api& api, ibv_device* d) : a(api), ctx(api.open_device(d)) {}
  ~Context() {
    if (ctx) a.close_device(ctx);
  }
};

DeviceInfo describe(const Api& a, ibv_device* d) {
  DeviceInfo info;
  info.name = a.get_device_name(d);
  info.node_guid = guid_text(a.get_device_guid(d));
  Context c(a, d);
  if (!c.ctx) return info;
  ibv_device_attr da{};
  if (a.query_device(c.ctx, &da) != 0) return info;
  for (int p = 1; p <= da.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (query_port(c.ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
    PortInfo pi;
    pi.port = p;
    pi.state_num = pa.state;
    pi.state = state_name(a, pa.state);
    pi.mtu = mtu_bytes(pa.max_mtu);
    pi.active_mtu = mtu_bytes(pa.active_mtu);
    pi.active_mtu_enum = pa.active_mtu;
    const bool eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
    pi.link_layer = eth ? "Ethernet" : "InfiniBand";
    pi.lid = pa.lid;
    for (int i = 0; i < pa.gid_tbl_len; ++i) {
      ibv_gid g{};
      if (a.query_gid(c.ctx, static_cast<uint8_t>(p), i, &g) != 0) continue;
      static const uint8_t zero[16] = {};
      if (std::memcmp(g.raw, zero, 16) == 0) continue;  // unused slot
      GidInfo gi;
      gi.index = i;
      std::memcpy(gi.raw, g.raw, 16);
      gi.gid = gid_text(g.raw);
      gi.type = gid_type(a, c.ctx, info.name, p, i, eth);
      pi.gids.push_back(gi);
    }
    info.ports.push_back(std::move(pi));
  }
  return info;
}

std::string port_summary(const DeviceInfo& d) {
  std::string s;
  for (auto& p : d.ports) {
    if (!s.empty()) s += ", ";
    s += d.name + " port " + std::to_string(p.port) + " (" + p.state + ")";
  }
  if (s.empty()) s = d.name + " (no ports readable)";
  return s;
}

const PortInfo* first_active(const DeviceInfo& d) {
  for (auto& p : d.ports)
    if (p.state_num == IBV_PORT_ACTIVE) return &p;
  return nullptr;
}

}  // namespace

std::vector<DeviceInfo> list_devices() {
  std::vector<DeviceInfo> out;
  const Api* a = api();
  if (!a) return out;
  DeviceList dl(*a);
  if (!dl.list) return out;  // e.g. no RDMA in the kernel: "none" is the answer
  for (int i = 0; i < dl.n; ++i) out.push_back(describe(*a, dl.list[i]));
  return out;
}

Selection select(const std::string& dev_name, int port, int gid_index) {
  require();
  const auto devs = list_devices();
  if (devs.empty()) throw CoreError("no RDMA device found (ibv_get_device_list returned none)");
  std::string names;
  for (auto& d : devs) names += (names.empty() ? "" : ", ") + d.name;

  Selection s;
  const DeviceInfo* dev = nullptr;
  if (!dev_name.empty()) {
    for (auto& d : devs)
      if (d.name == dev_name) dev = &d;
    if (!dev)
      throw CoreError("RDMA device " + dev_name + " (TF_RDMA_DEV_NAME) not found; devices: " + names);
    s.why = "device " + dev_name + ": named by TF_RDMA_DEV_NAME";
  } else {
    for (auto& d : devs)
      if (d.name == "mlx5_0" && first_active(d)) dev = &d;
    if (dev) {
      s.why = "device mlx5_0: the default when present";
    } else {
      for (auto& d : devs)
        if (!dev && first_active(d)) dev = &d;
      if (!dev) {
        std::string looked;
        for (auto& d : devs) looked += (looked.empty() ? "" : "; ") + port_summary(d);
        throw CoreError("no active port on any RDMA device; looked at: " + looked);
      }
      s.why = "device " + dev->name + ": the first with an active port (devices: " + names + ")";
    }
  }
  s.device = dev->name;

  const PortInfo* pi = nullptr;
  if (port > 0) {
    for (auto& p : dev->ports)
      if (p.port == port) pi = &p;
    if (!pi)
      throw CoreError("RDMA device " + dev->name + " has no port " + std::to_string(port) +
                      " (TF_RDMA_PORT_NUM); ports: " + port_summary(*dev));
    if (pi->state_num != IBV_PORT_ACTIVE)
      throw CoreError("no active port: " + dev->name + " port " + std::to_string(port) +
                      " (TF_RDMA_PORT_NUM) is " + pi->state);
    s.why += "; port " + std::to_string(port) + ": named by TF_RDMA_PORT_NUM";
  } else {
    pi = first_active(*dev);
    if (!pi) throw CoreError("no active port on " + dev->name + "; looked at: " + port_summary(*dev));
    s.why += "; port " + std::to_string(pi->port) + ": the first active one";
  }
  s.port = pi->port;
  s.mtu = pi->active_mtu;
  s.mtu_enum = pi->active_mtu_enum;
  s.link_layer = pi->link_layer;
  s.lid = pi->lid;

  const GidInfo* g = nullptr;
  const std::string where = dev->name + " port " + std::to_string(pi->port);
  if (gid_index >= 0) {
    for (auto& x : pi->gids)
      if (x.index == gid_index) g = &x;
    if (!g)
      throw CoreError("GID index " + std::to_string(gid_index) + " (TF_RDMA_GID_INDEX) is empty on " +
                      where);
    s.why += "; GID " + std::to_string(gid_index) + ": named by TF_RDMA_GID_INDEX";
  } else {
    // RoCEv2 routes over IP (and through the loopback on Soft-RoCE); an IPv4-mapped
    // GID is the one bound to the interface's IPv4 address, which is what peers reach.
    const char* rule = "";
    for (auto& x : pi->gids)
      if (!g && x.type == "RoCEv2" && ipv4_mapped(x.raw)) g = &x, rule = "RoCEv2 with an IPv4-mapped address";
    for (auto& x : pi->gids)
      if (!g && x.type == "RoCEv2") g = &x, rule = "RoCEv2";
    for (auto& x : pi->gids)
      if (!g && x.type == "RoCEv1") g = &x, rule = "RoCEv1";
    if (!g && pi->link_layer == "InfiniBand") {
      for (auto& x : pi->gids)
        if (!g && x.type == "IB") g = &x, rule = "InfiniBand (LID-routed)";
      if (!g && pi->lid != 0) {
        s.gid_index = 0;
        s.gid_type = "IB";
        s.why += "; GID: none, InfiniBand LID " + std::to_string(pi->lid);
        return s;
      }
    }
    if (!g) throw CoreError("no usable GID on " + where + " (GID table is empty)");
    s.why += "; GID " + std::to_string(g->index) + ": " + rule;
  }
  s.gid_index = g->index;
  s.gid = g->gid;
  s.gid_type = g->type;
  std::memcpy(s.gid_raw, g->raw, 16);
  return s;
}

}  // namespace verbs
}  // namespace argrpc
