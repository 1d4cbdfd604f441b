#include "fabric/verbs/device.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>

#include "common/error.h"
#include "common/unique_fd.h"
#include "fabric/verbs/ibv_loader.h"

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

// One of a GID's attributes in sysfs (gid_attrs/<attr>/<index>): "types" reads "IB/RoCE
// v1" or "RoCE v2", "ndevs" the network interface of a RoCE GID. Empty if unreadable (IB
// ports have no ndev, old kernels neither).
std::string sysfs_gid_attr(const std::string& dev, int port, int index, const char* attr) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/" +
                  attr + "/" + std::to_string(index));
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
  const std::string t = sysfs_gid_attr(dev, port, index, "types");
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

// The peer as the kernel routes to it. An IPv4-mapped IPv6 address (a dual-stack
// socket's view of an IPv4 client, or a RoCEv2 GID) is routed as the IPv4 address.
struct Peer {
  sockaddr_storage sa{};
  socklen_t len = 0;
  bool ipv4 = false;
  std::string text;
};

std::string address_text(const sockaddr_storage& sa) {
  char s[INET6_ADDRSTRLEN] = {0};
  if (sa.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(sa).sin_addr, s, sizeof s);
  else
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(sa).sin6_addr, s, sizeof s);
  return s;
}

Peer parse_peer(const std::string& text) {
  std::string t = text;
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;  // an address only: selection never waits for DNS
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  // Port 9 (discard): connect() needs one; nothing is ever sent to it.
  if (t.empty() || ::getaddrinfo(t.c_str(), "9", &hints, &res) != 0 || !res)
    throw CoreError("peer '" + text + "' is not an IP address");
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(res, ::freeaddrinfo);
  Peer p;
  std::memcpy(&p.sa, res->ai_addr, res->ai_addrlen);
  p.len = res->ai_addrlen;
  if (p.sa.ss_family == AF_INET6) {
    const auto& s6 = reinterpret_cast<const sockaddr_in6&>(p.sa);
    if (ipv4_mapped(s6.sin6_addr.s6_addr)) {
      sockaddr_in s4{};
      s4.sin_family = AF_INET;
      s4.sin_port = s6.sin6_port;
      std::memcpy(&s4.sin_addr, s6.sin6_addr.s6_addr + 12, 4);
      p.sa = sockaddr_storage{};
      std::memcpy(&p.sa, &s4, sizeof s4);
      p.len = sizeof s4;
    }
  }
  p.ipv4 = p.sa.ss_family == AF_INET;
  p.text = address_text(p.sa);
  return p;
}

struct Route {
  std::string source;   // this host's address on the route to the peer
  uint8_t gid[16] = {};  // how a GID that carries it reads
  std::string error;     // why there is none
};

// connect() on a UDP socket makes the kernel look the route up and pick the source
// address (getsockname() reads it) without sending a packet.
Route route_to(const Peer& p) {
  Route r;
  UniqueFd fd(::socket(p.sa.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    r.error = errno_text("socket");
    return r;
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&p.sa), p.len) != 0) {
    r.error = std::strerror(errno);
    return r;
  }
  sockaddr_storage me{};
  socklen_t len = sizeof me;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&me), &len) != 0) {
    r.error = errno_text("getsockname");
    return r;
  }
  if (me.ss_family == AF_INET) {
    r.gid[10] = r.gid[11] = 0xff;
    std::memcpy(r.gid + 12, &reinterpret_cast<const sockaddr_in&>(me).sin_addr, 4);
  } else {
    std::memcpy(r.gid, &reinterpret_cast<const sockaddr_in6&>(me).sin6_addr, 16);
  }
  r.source = address_text(me);
  return r;
}

// Lower is better: the type the peer has (when known), then RoCEv2 (routed over IP),
// RoCEv1, IB.
int type_rank(const std::string& type, const std::string& want) {
  int r = type == "RoCEv2" ? 0 : type == "RoCEv1" ? 1 : 2;
  if (!want.empty() && type != want) r += 10;
  return r;
}

// A port's GID when nothing names one and no GID carries the route's address. RoCEv2
// routes over IP (and through the loopback on Soft-RoCE); an IPv4-mapped GID is the one
// bound to the interface's IPv4 address, which is what peers reach; a known peer's
// address family and GID type go first, since the two ends' GIDs must agree in both.
const GidInfo* default_gid(const PortInfo& p, const Peer* peer, const std::string& want,
                           std::string* rule) {
  const bool v4 = peer ? peer->ipv4 : true;
  const GidInfo* best = nullptr;
  int best_rank = 0;
  for (auto& x : p.gids) {
    const int r = type_rank(x.type, want) * 2 + (ipv4_mapped(x.raw) == v4 ? 0 : 1);
    if (!best || r < best_rank) best = &x, best_rank = r;
  }
  if (!best) return nullptr;
  if (best->type == "IB") {
    *rule = "InfiniBand (LID-routed)";
  } else {
    *rule = best->type + (ipv4_mapped(best->raw) ? " with an IPv4-mapped address" : " with an IPv6 address");
    if (peer) *rule += ", the address family of " + peer->text;
  }
  if (!want.empty() && best->type == want && type_rank(want, "") != 0) *rule += ", the peer's GID type";
  return best;
}

void fill_port(Selection& s, const PortInfo& p) {
  s.port = p.port;
  s.mtu = p.active_mtu;
  s.mtu_enum = p.active_mtu_enum;
  s.link_layer = p.link_layer;
  s.lid = p.lid;
}

void fill_gid(Selection& s, const GidInfo& g) {
  s.gid_index = g.index;
  s.gid = g.gid;
  s.gid_type = g.type;
  std::memcpy(s.gid_raw, g.raw, 16);
  if (s.link_layer == "Ethernet") s.netdev = sysfs_gid_attr(s.device, s.port, g.index, "ndevs");
}

struct RouteChoice {
  const DeviceInfo* dev = nullptr;
  const PortInfo* port = nullptr;
  const GidInfo* gid = nullptr;
  std::string note;  // why there is none
};

// The active RoCE port and GID that carry the route's source address, within what the
// overrides leave open. IB ports are LID-routed: their GIDs carry no IP address.
RouteChoice by_route(const std::vector<DeviceInfo>& devs, const std::string& dev_name, int port,
                     const Peer& peer, const std::string& want) {
  RouteChoice c;
  const Route r = route_to(peer);
  if (!r.error.empty()) {
    c.note = "no route to " + peer.text + " (" + r.error + ")";
    return c;
  }
  std::string inactive;
  int best_rank = 0;
  for (auto& d : devs) {
    if (!dev_name.empty() && d.name != dev_name) continue;
    for (auto& p : d.ports) {
      if ((port > 0 && p.port != port) || p.link_layer != "Ethernet") continue;
      for (auto& g : p.gids) {
        if (std::memcmp(g.raw, r.gid, 16) != 0) continue;
        if (p.state_num != IBV_PORT_ACTIVE) {
          inactive += "; " + d.name + " port " + std::to_string(p.port) + " GID " + std::to_string(g.index) +
                      " has it but the port is " + p.state;
          continue;
        }
        const int rank = type_rank(g.type, want);
        if (!c.gid || rank < best_rank) c.dev = &d, c.port = &p, c.gid = &g, best_rank = rank;
      }
    }
  }
  if (c.gid) return c;
  std::string where = "no active RoCE port";
  if (!dev_name.empty()) where += " of " + dev_name;
  if (port > 0) where += " numbered " + std::to_string(port);
  c.note = where + " has a GID with " + r.source + ", this host's address on the route to " + peer.text +
           inactive;
  return c;
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

Selection select(const std::string& dev_name, int port, int gid_index, const std::string& peer,
                 const std::string& gid_type) {
  require();
  std::optional<Peer> pr;
  if (!peer.empty()) pr = parse_peer(peer);
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
  }

  // A named GID index leaves nothing for the route to decide.
  std::string route_note;
  if (pr && gid_index < 0) {
    const RouteChoice rc = by_route(devs, dev_name, port, *pr, gid_type);
    if (rc.gid) {
      s.device = rc.dev->name;
      fill_port(s, *rc.port);
      fill_gid(s, *rc.gid);
      std::string lead;
      if (!dev_name.empty())
        s.why = "device " + s.device + ": named by TF_RDMA_DEV_NAME; ";
      else
        lead = "device " + s.device + ", ";
      if (port > 0)
        s.why += "port " + std::to_string(s.port) + ": named by TF_RDMA_PORT_NUM; ";
      else
        lead += "port " + std::to_string(s.port) + ", ";
      s.why += lead + "GID " + std::to_string(s.gid_index) + ": " + s.gid_type + " " + s.gid +
               (s.netdev.empty() ? "" : " (" + s.netdev + ")") + ", this host's address on the route to " +
               pr->text;
      return s;
    }
    route_note = rc.note + ", so ";
  }

  if (dev) {
    s.why = route_note + "device " + dev_name + ": named by TF_RDMA_DEV_NAME";
  } else {
    for (auto& d : devs)
      if (d.name == "mlx5_0" && first_active(d)) dev = &d;
    if (dev) {
      s.why = route_note + "device mlx5_0: the default when present";
    } else {
      for (auto& d : devs)
        if (!dev && first_active(d)) dev = &d;
      if (!dev) {
        std::string looked;
        for (auto& d : devs) looked += (looked.empty() ? "" : "; ") + port_summary(d);
        throw CoreError("no active port on any RDMA device; looked at: " + looked);
      }
      s.why = route_note + "device " + dev->name + ": the first with an active port (devices: " + names + ")";
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
  fill_port(s, *pi);

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
    std::string rule;
    g = default_gid(*pi, pr ? &*pr : nullptr, gid_type, &rule);
    if (!g && pi->link_layer == "InfiniBand" && pi->lid != 0) {
      s.gid_index = 0;
      s.gid_type = "IB";
      s.why += "; GID: none, InfiniBand LID " + std::to_string(pi->lid);
      return s;
    }
    if (!g) throw CoreError("no usable GID on " + where + " (GID table is empty)");
    s.why += "; GID " + std::to_string(g->index) + ": " + rule;
  }
  fill_gid(s, *g);
  return s;
}

}  // namespace verbs
}  // namespace argrpc
