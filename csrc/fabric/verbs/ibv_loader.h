// libibverbs, loaded at run time. The extension never links -libverbs and is compiled
// without rdma-core's headers (ibv_types.h declares what it uses): `import argrpc` and the
// shm/gRPC paths must work on a host without rdma-core, so every exported verbs function
// we use is looked up once with dlopen("libibverbs.so.1") + dlsym into one table (its
// names drop the ibv_ prefix). The data-path calls are not exported: libibverbs defines
// them inline, as calls through the provider's ops in the context, and so do we, below.
#pragma once
#include <cerrno>
#include <string>

#include "fabric/verbs/ibv_types.h"

namespace argrpc {
namespace verbs {

struct Api {
  ibv_get_device_list_fn get_device_list;
  ibv_free_device_list_fn free_device_list;
  ibv_get_device_name_fn get_device_name;
  ibv_get_device_guid_fn get_device_guid;
  ibv_open_device_fn open_device;
  ibv_close_device_fn close_device;
  ibv_query_device_fn query_device;
  ibv_query_port_fn query_port;  // the exported (compat) symbol; see query_port()
  ibv_query_gid_fn query_gid;
  ibv_query_gid_ex_fn query_gid_ex;  // optional (rdma-core >= 32): may be null
  ibv_alloc_pd_fn alloc_pd;
  ibv_dealloc_pd_fn dealloc_pd;
  ibv_reg_mr_fn reg_mr;
  ibv_dereg_mr_fn dereg_mr;
  ibv_create_comp_channel_fn create_comp_channel;
  ibv_destroy_comp_channel_fn destroy_comp_channel;
  ibv_create_cq_fn create_cq;
  ibv_destroy_cq_fn destroy_cq;
  ibv_get_cq_event_fn get_cq_event;
  ibv_ack_cq_events_fn ack_cq_events;
  ibv_create_qp_fn create_qp;
  ibv_modify_qp_fn modify_qp;
  ibv_destroy_qp_fn destroy_qp;
  ibv_wc_status_str_fn wc_status_str;
  ibv_port_state_str_fn port_state_str;
};

// The table, or nullptr if libibverbs could not be loaded (then status() says why).
// Loaded once, on first use, and never unloaded (providers keep state in it).
const Api* api();
// "" when loaded, else the reason (dlerror() text or the missing symbol).
const std::string& status();
// api() or a CoreError naming status().
const Api& require();

// ibv_query_port(): the extended op when the provider has one, else the exported compat
// symbol on a zeroed struct.
int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr);

// ------------------------------------------------------------------------ data path
// Return values as libibverbs documents them: an errno value (post, bind, notify), the
// number of completions or < 0 (poll), nullptr with errno set (alloc).

inline int ibv_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  return qp->context->ops.post_send(qp, wr, bad_wr);
}

inline int ibv_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  return qp->context->ops.post_recv(qp, wr, bad_wr);
}

inline int ibv_poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc) {
  return cq->context->ops.poll_cq(cq, num_entries, wc);
}

inline int ibv_req_notify_cq(ibv_cq* cq, int solicited_only) {
  return cq->context->ops.req_notify_cq(cq, solicited_only);
}

// Memory windows are optional: a provider without them has no alloc_mw op.
inline ibv_mw* ibv_alloc_mw(ibv_pd* pd, ibv_mw_type type) {
  if (!pd->context->ops.alloc_mw) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  return pd->context->ops.alloc_mw(pd, type);
}

inline int ibv_dealloc_mw(ibv_mw* mw) { return mw->context->ops.dealloc_mw(mw); }

// The checks libibverbs makes before handing a bind to the provider: type 1 windows
// only, no range without a region, and window and region in one protection domain.
inline int ibv_bind_mw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* mw_bind) {
  const ibv_mw_bind_info& b = mw_bind->bind_info;
  if (mw->type != IBV_MW_TYPE_1) return EINVAL;
  if (!b.mr && (b.addr || b.length)) return EINVAL;
  if (b.mr && mw->pd != b.mr->pd) return EPERM;
  return mw->context->ops.bind_mw(qp, mw, mw_bind);
}

}  // namespace verbs
}  // namespace argrpc
