#include "fabric/verbs/ibv_loader.h"

#include <dlfcn.h>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.h"

namespace argrpc {
namespace verbs {

namespace {

struct Loaded {
  Api api{};
  bool ok = false;
  std::string status;
};

template <class F>
bool sym(void* h, const char* name, F* out, std::string* why) {
  void* p = ::dlsym(h, name);
  if (!p) {
    if (why) *why = std::string("libibverbs.so.1 has no symbol ") + name;
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

Loaded load() {
  Loaded l;
  // ARGRPC_VERBS_LIBRARY exists for tests (point it at a missing file to see the
  // no-rdma-core path on a host that has it).
  const char* lib = std::getenv("ARGRPC_VERBS_LIBRARY");
  if (!lib || !*lib) lib = "libibverbs.so.1";
  // RTLD_GLOBAL: the provider plugins libibverbs dlopens resolve symbols against it.
  void* h = ::dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    const char* e = ::dlerror();
    l.status = std::string("cannot load ") + lib + ": " + (e ? e : "unknown error") +
               " (install rdma-core / libibverbs1)";
    return l;
  }
  Api& a = l.api;
  std::string why;
  bool ok = sym(h, "ibv_get_device_list", &a.get_device_list, &why) &&
            sym(h, "ibv_free_device_list", &a.free_device_list, &why) &&
            sym(h, "ibv_get_device_name", &a.get_device_name, &why) &&
            sym(h, "ibv_get_device_guid", &a.get_device_guid, &why) &&
            sym(h, "ibv_open_device", &a.open_device, &why) &&
            sym(h, "ibv_close_device", &a.close_device, &why) &&
            sym(h, "ibv_query_device", &a.query_device, &why) &&
            sym(h, "ibv_query_port", &a.query_port, &why) &&
            sym(h, "ibv_query_gid", &a.query_gid, &why) &&
            sym(h, "ibv_alloc_pd", &a.alloc_pd, &why) &&
            sym(h, "ibv_dealloc_pd", &a.dealloc_pd, &why) &&
            sym(h, "ibv_reg_mr", &a.reg_mr, &why) &&
            sym(h, "ibv_dereg_mr", &a.dereg_mr, &why) &&
            sym(h, "ibv_create_comp_channel", &a.create_comp_channel, &why) &&
            sym(h, "ibv_destroy_comp_channel", &a.destroy_comp_channel, &why) &&
            sym(h, "ibv_create_cq", &a.create_cq, &why) &&
            sym(h, "ibv_destroy_cq", &a.destroy_cq, &why) &&
            sym(h, "ibv_get_cq_event", &a.get_cq_event, &why) &&
            sym(h, "ibv_ack_cq_events", &a.ack_cq_events, &why) &&
            sym(h, "ibv_create_qp", &a.create_qp, &why) &&
            sym(h, "ibv_modify_qp", &a.modify_qp, &why) &&
            sym(h, "ibv_destroy_qp", &a.destroy_qp, &why) &&
            sym(h, "ibv_wc_status_str", &a.wc_status_str, &why) &&
            sym(h, "ibv_port_state_str", &a.port_state_str, &why);
  if (!ok) {
    l.status = why;
    return l;
  }
  // Optional: older rdma-core lacks it and GID types then come from sysfs.
  if (!sym(h, "_ibv_query_gid_ex", &a.query_gid_ex, nullptr)) a.query_gid_ex = nullptr;
  l.ok = true;
  return l;
}

// The verbs_context around ctx if libibverbs embedded ctx in one and that one reaches
// back to query_port (older libraries have a shorter one, without it).
const verbs_context* extended_query_port(ibv_context* ctx) {
  if (ctx->abi_compat != reinterpret_cast<void*>(kVerbsAbiExtended)) return nullptr;
  const auto* v = reinterpret_cast<const verbs_context*>(reinterpret_cast<const uint8_t*>(ctx) -
                                                         offsetof(verbs_context, context));
  if (v->sz < sizeof(verbs_context) - offsetof(verbs_context, query_port) || !v->query_port) return nullptr;
  return v;
}

const Loaded& loaded() {
  static const Loaded l = load();  // thread-safe once
  return l;
}

}  // namespace

const Api* api() { return loaded().ok ? &loaded().api : nullptr; }

const std::string& status() { return loaded().status; }

const Api& require() {
  if (!api()) throw CoreError("RDMA verbs unavailable: " + status());
  return *api();
}

int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  if (const verbs_context* v = extended_query_port(ctx)) return v->query_port(ctx, port, attr, sizeof(*attr));
  std::memset(attr, 0, sizeof(*attr));
  return require().query_port(ctx, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

}  // namespace verbs
}  // namespace argrpc
