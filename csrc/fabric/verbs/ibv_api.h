// libibverbs, loaded at run time. The extension never links -libverbs: `import argrpc`
// and the shm/gRPC paths must work on a host without rdma-core, so every exported verbs
// function we use is looked up once with dlopen("libibverbs.so.1") + dlsym into one
// table. The data-path calls (ibv_post_send, ibv_post_recv, ibv_poll_cq,
// ibv_req_notify_cq) are static inline in verbs.h and dispatch through ctx->ops, so
// they work without the table. Names in the table drop the ibv_ prefix because several
// verbs.h names are function-like macros (ibv_reg_mr, ibv_query_port, ...).
#pragma once
#include <infiniband/verbs.h>

#include <string>

namespace argrpc {
namespace verbs {

struct Api {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_get_device_guid) get_device_guid;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_query_device) query_device;
  decltype(&::ibv_query_port) query_port;  // the exported (compat) symbol; see query_port()
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::_ibv_query_gid_ex) query_gid_ex;  // optional (rdma-core >= 32): may be null
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_reg_mr) reg_mr;
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_comp_channel) create_comp_channel;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_get_cq_event) get_cq_event;
  decltype(&::ibv_ack_cq_events) ack_cq_events;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_wc_status_str) wc_status_str;
  decltype(&::ibv_port_state_str) port_state_str;
};

// The table, or nullptr if libibverbs could not be loaded (then status() says why).
// Loaded once, on first use, and never unloaded (providers keep state in it).
const Api* api();
// "" when loaded, else the reason (dlerror() text or the missing symbol).
const std::string& status();
// api() or a CoreError naming status().
const Api& require();

// ibv_query_port() as verbs.h's inline does it: the extended op when the provider has
// one, else the exported compat symbol on a zeroed struct.
int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr);

}  // namespace verbs
}  // namespace argrpc
