// argrpc's declarations of the verbs ABI (csrc/fabric/verbs/ibv_types.h) against
// rdma-core's <infiniband/verbs.h>: sizes, alignments, field offsets and types, enum
// values and types, the function types argrpc looks up and the data-path dispatches it
// defines. Almost all of it is static_asserts, so a mismatch fails the compilation and
// the message names the declaration; main() checks the one value C++ cannot compare at
// compile time. Run by scripts/check_verbs_abi.sh (and tests/test_verbs_abi.py).
#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <utility>

#include "fabric/verbs/ibv_types.h"
#include "fabric/verbs/ibv_loader.h"

namespace ours = argrpc::verbs;

namespace {

// Theirs<T>: T with each of our types replaced by rdma-core's, through pointers, arrays,
// const and function types, so whole field and function types compare with is_same.
template <class T> struct Map { using type = T; };
template <class T> using Theirs = typename Map<T>::type;
template <class T> struct Map<T*> { using type = Theirs<T>*; };
template <class T> struct Map<const T> { using type = const Theirs<T>; };
template <class T, size_t N> struct Map<T[N]> { using type = Theirs<T>[N]; };
template <class R, class... A> struct Map<R(A...)> { using type = Theirs<R>(Theirs<A>...); };

#define SAME_TYPE(name) \
  template <> struct Map<ours::name> { using type = ::name; };
SAME_TYPE(ibv_device)
SAME_TYPE(ibv_srq)
SAME_TYPE(ibv_ah)
SAME_TYPE(_compat_ibv_port_attr)
SAME_TYPE(ibv_context)
SAME_TYPE(ibv_context_ops)
SAME_TYPE(ibv_pd)
SAME_TYPE(ibv_mr)
SAME_TYPE(ibv_mw)
SAME_TYPE(ibv_cq)
SAME_TYPE(ibv_qp)
SAME_TYPE(ibv_comp_channel)
SAME_TYPE(ibv_gid)
SAME_TYPE(ibv_gid_entry)
SAME_TYPE(ibv_device_attr)
SAME_TYPE(ibv_port_attr)
SAME_TYPE(ibv_sge)
SAME_TYPE(ibv_mw_bind_info)
SAME_TYPE(ibv_send_wr)
SAME_TYPE(ibv_recv_wr)
SAME_TYPE(ibv_mw_bind)
SAME_TYPE(ibv_wc)
SAME_TYPE(ibv_qp_cap)
SAME_TYPE(ibv_qp_init_attr)
SAME_TYPE(ibv_global_route)
SAME_TYPE(ibv_ah_attr)
SAME_TYPE(ibv_qp_attr)
SAME_TYPE(verbs_context)
SAME_TYPE(ibv_mtu)
SAME_TYPE(ibv_port_state)
SAME_TYPE(ibv_gid_type)
SAME_TYPE(ibv_atomic_cap)
SAME_TYPE(ibv_mig_state)
SAME_TYPE(ibv_device_cap_flags)
SAME_TYPE(ibv_access_flags)
SAME_TYPE(ibv_mw_type)
SAME_TYPE(ibv_qp_type)
SAME_TYPE(ibv_qp_state)
SAME_TYPE(ibv_qp_attr_mask)
SAME_TYPE(ibv_wr_opcode)
SAME_TYPE(ibv_send_flags)
SAME_TYPE(ibv_wc_status)
SAME_TYPE(ibv_wc_opcode)
SAME_TYPE(ibv_wc_flags)
#undef SAME_TYPE

template <class S> S& obj();  // for decltype only

}  // namespace

// ---------------------------------------------------------------------- structs

// An exact struct: the same size and alignment.
#define EXACT(S)                                                               \
  static_assert(sizeof(ours::S) == sizeof(::S), #S ": sizeof differs");        \
  static_assert(alignof(ours::S) == alignof(::S), #S ": alignof differs");     \
  static_assert(std::is_standard_layout<ours::S>::value, #S ": not standard layout");

// A prefix: never larger, the same alignment (what it leaves out is checked by offset).
#define PREFIX(S)                                                              \
  static_assert(sizeof(ours::S) <= sizeof(::S), #S ": prefix larger than the struct"); \
  static_assert(alignof(ours::S) == alignof(::S), #S ": alignof differs");

// A field (a member path: `wr.rdma.rkey` too): the same offset, size and type.
#define FIELD(S, f)                                                            \
  static_assert(offsetof(ours::S, f) == offsetof(::S, f), #S "." #f ": offset differs"); \
  static_assert(sizeof(obj<ours::S>().f) == sizeof(obj<::S>().f), #S "." #f ": size differs"); \
  static_assert(std::is_same<Theirs<decltype(obj<ours::S>().f)>, decltype(obj<::S>().f)>::value, \
                #S "." #f ": type differs");

EXACT(ibv_gid)
FIELD(ibv_gid, raw)
FIELD(ibv_gid, global.subnet_prefix)
FIELD(ibv_gid, global.interface_id)

EXACT(ibv_gid_entry)
FIELD(ibv_gid_entry, gid)
FIELD(ibv_gid_entry, gid_index)
FIELD(ibv_gid_entry, port_num)
FIELD(ibv_gid_entry, gid_type)
FIELD(ibv_gid_entry, ndev_ifindex)

EXACT(ibv_device_attr)
FIELD(ibv_device_attr, fw_ver)
FIELD(ibv_device_attr, node_guid)
FIELD(ibv_device_attr, sys_image_guid)
FIELD(ibv_device_attr, max_mr_size)
FIELD(ibv_device_attr, page_size_cap)
FIELD(ibv_device_attr, vendor_id)
FIELD(ibv_device_attr, vendor_part_id)
FIELD(ibv_device_attr, hw_ver)
FIELD(ibv_device_attr, max_qp)
FIELD(ibv_device_attr, max_qp_wr)
FIELD(ibv_device_attr, device_cap_flags)
FIELD(ibv_device_attr, max_sge)
FIELD(ibv_device_attr, max_sge_rd)
FIELD(ibv_device_attr, max_cq)
FIELD(ibv_device_attr, max_cqe)
FIELD(ibv_device_attr, max_mr)
FIELD(ibv_device_attr, max_pd)
FIELD(ibv_device_attr, max_qp_rd_atom)
FIELD(ibv_device_attr, max_ee_rd_atom)
FIELD(ibv_device_attr, max_res_rd_atom)
FIELD(ibv_device_attr, max_qp_init_rd_atom)
FIELD(ibv_device_attr, max_ee_init_rd_atom)
FIELD(ibv_device_attr, atomic_cap)
FIELD(ibv_device_attr, max_ee)
FIELD(ibv_device_attr, max_rdd)
FIELD(ibv_device_attr, max_mw)
FIELD(ibv_device_attr, max_raw_ipv6_qp)
FIELD(ibv_device_attr, max_raw_ethy_qp)
FIELD(ibv_device_attr, max_mcast_grp)
FIELD(ibv_device_attr, max_mcast_qp_attach)
FIELD(ibv_device_attr, max_total_mcast_qp_attach)
FIELD(ibv_device_attr, max_ah)
FIELD(ibv_device_attr, max_fmr)
FIELD(ibv_device_attr, max_map_per_fmr)
FIELD(ibv_device_attr, max_srq)
FIELD(ibv_device_attr, max_srq_wr)
FIELD(ibv_device_attr, max_srq_sge)
FIELD(ibv_device_attr, max_pkeys)
FIELD(ibv_device_attr, local_ca_ack_delay)
FIELD(ibv_device_attr, phys_port_cnt)

EXACT(ibv_port_attr)
FIELD(ibv_port_attr, state)
FIELD(ibv_port_attr, max_mtu)
FIELD(ibv_port_attr, active_mtu)
FIELD(ibv_port_attr, gid_tbl_len)
FIELD(ibv_port_attr, port_cap_flags)
FIELD(ibv_port_attr, max_msg_sz)
FIELD(ibv_port_attr, bad_pkey_cntr)
FIELD(ibv_port_attr, qkey_viol_cntr)
FIELD(ibv_port_attr, pkey_tbl_len)
FIELD(ibv_port_attr, lid)
FIELD(ibv_port_attr, sm_lid)
FIELD(ibv_port_attr, lmc)
FIELD(ibv_port_attr, max_vl_num)
FIELD(ibv_port_attr, sm_sl)
FIELD(ibv_port_attr, subnet_timeout)
FIELD(ibv_port_attr, init_type_reply)
FIELD(ibv_port_attr, active_width)
FIELD(ibv_port_attr, active_speed)
FIELD(ibv_port_attr, phys_state)
FIELD(ibv_port_attr, link_layer)
FIELD(ibv_port_attr, flags)
FIELD(ibv_port_attr, port_cap_flags2)

EXACT(ibv_sge)
FIELD(ibv_sge, addr)
FIELD(ibv_sge, length)
FIELD(ibv_sge, lkey)

EXACT(ibv_mw_bind_info)
FIELD(ibv_mw_bind_info, mr)
FIELD(ibv_mw_bind_info, addr)
FIELD(ibv_mw_bind_info, length)
FIELD(ibv_mw_bind_info, mw_access_flags)

EXACT(ibv_send_wr)
FIELD(ibv_send_wr, wr_id)
FIELD(ibv_send_wr, next)
FIELD(ibv_send_wr, sg_list)
FIELD(ibv_send_wr, num_sge)
FIELD(ibv_send_wr, opcode)
FIELD(ibv_send_wr, send_flags)
FIELD(ibv_send_wr, imm_data)
FIELD(ibv_send_wr, invalidate_rkey)
FIELD(ibv_send_wr, wr.rdma.remote_addr)
FIELD(ibv_send_wr, wr.rdma.rkey)
FIELD(ibv_send_wr, wr.atomic.remote_addr)
FIELD(ibv_send_wr, wr.atomic.compare_add)
FIELD(ibv_send_wr, wr.atomic.swap)
FIELD(ibv_send_wr, wr.atomic.rkey)
FIELD(ibv_send_wr, wr.ud.ah)
FIELD(ibv_send_wr, wr.ud.remote_qpn)
FIELD(ibv_send_wr, wr.ud.remote_qkey)
FIELD(ibv_send_wr, qp_type.xrc.remote_srqn)
FIELD(ibv_send_wr, bind_mw.mw)
FIELD(ibv_send_wr, bind_mw.rkey)
FIELD(ibv_send_wr, bind_mw.bind_info)
FIELD(ibv_send_wr, tso.hdr)
FIELD(ibv_send_wr, tso.hdr_sz)
FIELD(ibv_send_wr, tso.mss)
static_assert(sizeof(ours::ibv_send_wr::wr) == sizeof(::ibv_send_wr::wr), "ibv_send_wr.wr: size differs");
static_assert(sizeof(ours::ibv_send_wr::qp_type) == sizeof(::ibv_send_wr::qp_type),
              "ibv_send_wr.qp_type: size differs");

EXACT(ibv_recv_wr)
FIELD(ibv_recv_wr, wr_id)
FIELD(ibv_recv_wr, next)
FIELD(ibv_recv_wr, sg_list)
FIELD(ibv_recv_wr, num_sge)

EXACT(ibv_mw_bind)
FIELD(ibv_mw_bind, wr_id)
FIELD(ibv_mw_bind, send_flags)
FIELD(ibv_mw_bind, bind_info)

EXACT(ibv_wc)
FIELD(ibv_wc, wr_id)
FIELD(ibv_wc, status)
FIELD(ibv_wc, opcode)
FIELD(ibv_wc, vendor_err)
FIELD(ibv_wc, byte_len)
FIELD(ibv_wc, imm_data)
FIELD(ibv_wc, invalidated_rkey)
FIELD(ibv_wc, qp_num)
FIELD(ibv_wc, src_qp)
FIELD(ibv_wc, wc_flags)
FIELD(ibv_wc, pkey_index)
FIELD(ibv_wc, slid)
FIELD(ibv_wc, sl)
FIELD(ibv_wc, dlid_path_bits)

EXACT(ibv_qp_cap)
FIELD(ibv_qp_cap, max_send_wr)
FIELD(ibv_qp_cap, max_recv_wr)
FIELD(ibv_qp_cap, max_send_sge)
FIELD(ibv_qp_cap, max_recv_sge)
FIELD(ibv_qp_cap, max_inline_data)

EXACT(ibv_qp_init_attr)
FIELD(ibv_qp_init_attr, qp_context)
FIELD(ibv_qp_init_attr, send_cq)
FIELD(ibv_qp_init_attr, recv_cq)
FIELD(ibv_qp_init_attr, srq)
FIELD(ibv_qp_init_attr, cap)
FIELD(ibv_qp_init_attr, qp_type)
FIELD(ibv_qp_init_attr, sq_sig_all)

EXACT(ibv_global_route)
FIELD(ibv_global_route, dgid)
FIELD(ibv_global_route, flow_label)
FIELD(ibv_global_route, sgid_index)
FIELD(ibv_global_route, hop_limit)
FIELD(ibv_global_route, traffic_class)

EXACT(ibv_ah_attr)
FIELD(ibv_ah_attr, grh)
FIELD(ibv_ah_attr, dlid)
FIELD(ibv_ah_attr, sl)
FIELD(ibv_ah_attr, src_path_bits)
FIELD(ibv_ah_attr, static_rate)
FIELD(ibv_ah_attr, is_global)
FIELD(ibv_ah_attr, port_num)

EXACT(ibv_qp_attr)
FIELD(ibv_qp_attr, qp_state)
FIELD(ibv_qp_attr, cur_qp_state)
FIELD(ibv_qp_attr, path_mtu)
FIELD(ibv_qp_attr, path_mig_state)
FIELD(ibv_qp_attr, qkey)
FIELD(ibv_qp_attr, rq_psn)
FIELD(ibv_qp_attr, sq_psn)
FIELD(ibv_qp_attr, dest_qp_num)
FIELD(ibv_qp_attr, qp_access_flags)
FIELD(ibv_qp_attr, cap)
FIELD(ibv_qp_attr, ah_attr)
FIELD(ibv_qp_attr, alt_ah_attr)
FIELD(ibv_qp_attr, pkey_index)
FIELD(ibv_qp_attr, alt_pkey_index)
FIELD(ibv_qp_attr, en_sqd_async_notify)
FIELD(ibv_qp_attr, sq_draining)
FIELD(ibv_qp_attr, max_rd_atomic)
FIELD(ibv_qp_attr, max_dest_rd_atomic)
FIELD(ibv_qp_attr, min_rnr_timer)
FIELD(ibv_qp_attr, port_num)
FIELD(ibv_qp_attr, timeout)
FIELD(ibv_qp_attr, retry_cnt)
FIELD(ibv_qp_attr, rnr_retry)
FIELD(ibv_qp_attr, alt_port_num)
FIELD(ibv_qp_attr, alt_timeout)
FIELD(ibv_qp_attr, rate_limit)

EXACT(ibv_pd)
FIELD(ibv_pd, context)
FIELD(ibv_pd, handle)

EXACT(ibv_mr)
FIELD(ibv_mr, context)
FIELD(ibv_mr, pd)
FIELD(ibv_mr, addr)
FIELD(ibv_mr, length)
FIELD(ibv_mr, handle)
FIELD(ibv_mr, lkey)
FIELD(ibv_mr, rkey)

EXACT(ibv_mw)
FIELD(ibv_mw, context)
FIELD(ibv_mw, pd)
FIELD(ibv_mw, rkey)
FIELD(ibv_mw, handle)
FIELD(ibv_mw, type)

EXACT(ibv_comp_channel)
FIELD(ibv_comp_channel, context)
FIELD(ibv_comp_channel, fd)
FIELD(ibv_comp_channel, refcnt)

PREFIX(ibv_cq)
FIELD(ibv_cq, context)
FIELD(ibv_cq, channel)
FIELD(ibv_cq, cq_context)
FIELD(ibv_cq, handle)
FIELD(ibv_cq, cqe)

PREFIX(ibv_qp)
FIELD(ibv_qp, context)
FIELD(ibv_qp, qp_context)
FIELD(ibv_qp, pd)
FIELD(ibv_qp, send_cq)
FIELD(ibv_qp, recv_cq)
FIELD(ibv_qp, srq)
FIELD(ibv_qp, handle)
FIELD(ibv_qp, qp_num)
FIELD(ibv_qp, state)
FIELD(ibv_qp, qp_type)

EXACT(ibv_context_ops)
FIELD(ibv_context_ops, alloc_mw)
FIELD(ibv_context_ops, bind_mw)
FIELD(ibv_context_ops, dealloc_mw)
FIELD(ibv_context_ops, poll_cq)
FIELD(ibv_context_ops, req_notify_cq)
FIELD(ibv_context_ops, post_send)
FIELD(ibv_context_ops, post_recv)

EXACT(ibv_context)
FIELD(ibv_context, device)
FIELD(ibv_context, ops)
FIELD(ibv_context, cmd_fd)
FIELD(ibv_context, async_fd)
FIELD(ibv_context, num_comp_vectors)
FIELD(ibv_context, mutex)
FIELD(ibv_context, abi_compat)

// Ours starts at query_port: offsets count from there, and the size is what lies from
// query_port to the end (what libibverbs compares sz with).
#define TAIL_FIELD(f)                                                          \
  static_assert(offsetof(ours::verbs_context, f) ==                            \
                    offsetof(::verbs_context, f) - offsetof(::verbs_context, query_port), \
                "verbs_context." #f ": distance from query_port differs");     \
  static_assert(std::is_same<Theirs<decltype(obj<ours::verbs_context>().f)>,   \
                             decltype(obj<::verbs_context>().f)>::value,       \
                "verbs_context." #f ": type differs");
static_assert(offsetof(ours::verbs_context, query_port) == 0, "verbs_context: must start at query_port");
static_assert(sizeof(ours::verbs_context) == sizeof(::verbs_context) - offsetof(::verbs_context, query_port),
              "verbs_context: size from query_port to the end differs");
static_assert(alignof(ours::verbs_context) == alignof(::verbs_context), "verbs_context: alignof differs");
TAIL_FIELD(query_port)
TAIL_FIELD(sz)
TAIL_FIELD(context)

// ------------------------------------------------------------- enums, constants

// An enum type: size, alignment and the type its values promote to.
#define ENUM_TYPE(E)                                                           \
  static_assert(sizeof(ours::E) == sizeof(::E), #E ": sizeof differs");        \
  static_assert(alignof(ours::E) == alignof(::E), #E ": alignof differs");     \
  static_assert(std::is_same<decltype(+obj<ours::E>()), decltype(+obj<::E>())>::value, \
                #E ": promotes to another type");
ENUM_TYPE(ibv_mtu)
ENUM_TYPE(ibv_port_state)
ENUM_TYPE(ibv_gid_type)
ENUM_TYPE(ibv_atomic_cap)
ENUM_TYPE(ibv_mig_state)
ENUM_TYPE(ibv_device_cap_flags)
ENUM_TYPE(ibv_access_flags)
ENUM_TYPE(ibv_mw_type)
ENUM_TYPE(ibv_qp_type)
ENUM_TYPE(ibv_qp_state)
ENUM_TYPE(ibv_qp_attr_mask)
ENUM_TYPE(ibv_wr_opcode)
ENUM_TYPE(ibv_send_flags)
ENUM_TYPE(ibv_wc_status)
ENUM_TYPE(ibv_wc_opcode)
ENUM_TYPE(ibv_wc_flags)

// A value of a named enum: the same value, and it belongs to the same enum.
#define VALUE(v)                                                               \
  static_assert(static_cast<long long>(ours::v) == static_cast<long long>(::v), #v ": value differs"); \
  static_assert(std::is_same<Theirs<decltype(ours::v)>, decltype(::v)>::value, #v ": in another enum");
// A value of an anonymous enum: the value only.
#define CONSTANT(v)                                                            \
  static_assert(static_cast<long long>(ours::v) == static_cast<long long>(::v), #v ": value differs");

VALUE(IBV_MTU_256)
VALUE(IBV_MTU_512)
VALUE(IBV_MTU_1024)
VALUE(IBV_MTU_2048)
VALUE(IBV_MTU_4096)
VALUE(IBV_PORT_ACTIVE)
CONSTANT(IBV_LINK_LAYER_ETHERNET)
VALUE(IBV_GID_TYPE_ROCE_V1)
VALUE(IBV_GID_TYPE_ROCE_V2)
VALUE(IBV_DEVICE_MEM_WINDOW)
VALUE(IBV_ACCESS_LOCAL_WRITE)
VALUE(IBV_ACCESS_REMOTE_WRITE)
VALUE(IBV_ACCESS_REMOTE_READ)
VALUE(IBV_ACCESS_MW_BIND)
VALUE(IBV_MW_TYPE_1)
VALUE(IBV_QPT_RC)
VALUE(IBV_QPS_INIT)
VALUE(IBV_QPS_RTR)
VALUE(IBV_QPS_RTS)
VALUE(IBV_QPS_ERR)
VALUE(IBV_QP_STATE)
VALUE(IBV_QP_ACCESS_FLAGS)
VALUE(IBV_QP_PKEY_INDEX)
VALUE(IBV_QP_PORT)
VALUE(IBV_QP_AV)
VALUE(IBV_QP_PATH_MTU)
VALUE(IBV_QP_TIMEOUT)
VALUE(IBV_QP_RETRY_CNT)
VALUE(IBV_QP_RNR_RETRY)
VALUE(IBV_QP_RQ_PSN)
VALUE(IBV_QP_MAX_QP_RD_ATOMIC)
VALUE(IBV_QP_MIN_RNR_TIMER)
VALUE(IBV_QP_SQ_PSN)
VALUE(IBV_QP_MAX_DEST_RD_ATOMIC)
VALUE(IBV_QP_DEST_QPN)
VALUE(IBV_WR_RDMA_WRITE)
VALUE(IBV_WR_RDMA_WRITE_WITH_IMM)
VALUE(IBV_WR_RDMA_READ)
VALUE(IBV_SEND_SIGNALED)
VALUE(IBV_SEND_INLINE)
VALUE(IBV_WC_SUCCESS)
VALUE(IBV_WC_RECV_RDMA_WITH_IMM)
VALUE(IBV_WC_WITH_IMM)

// ------------------------------------------------------------------- functions

// An exported function argrpc looks up: its pointer type, ours mapped to theirs.
#define EXPORTED(alias, fn)                                                    \
  static_assert(std::is_same<Theirs<ours::alias>, decltype(&::fn)>::value, #fn ": type differs");
EXPORTED(ibv_get_device_list_fn, ibv_get_device_list)
EXPORTED(ibv_free_device_list_fn, ibv_free_device_list)
EXPORTED(ibv_get_device_name_fn, ibv_get_device_name)
EXPORTED(ibv_get_device_guid_fn, ibv_get_device_guid)
EXPORTED(ibv_open_device_fn, ibv_open_device)
EXPORTED(ibv_close_device_fn, ibv_close_device)
EXPORTED(ibv_query_device_fn, ibv_query_device)
EXPORTED(ibv_query_port_fn, ibv_query_port)  // the exported symbol, not the macro
EXPORTED(ibv_query_gid_fn, ibv_query_gid)
EXPORTED(ibv_query_gid_ex_fn, _ibv_query_gid_ex)
EXPORTED(ibv_alloc_pd_fn, ibv_alloc_pd)
EXPORTED(ibv_dealloc_pd_fn, ibv_dealloc_pd)
EXPORTED(ibv_reg_mr_fn, ibv_reg_mr)  // likewise
EXPORTED(ibv_dereg_mr_fn, ibv_dereg_mr)
EXPORTED(ibv_create_comp_channel_fn, ibv_create_comp_channel)
EXPORTED(ibv_destroy_comp_channel_fn, ibv_destroy_comp_channel)
EXPORTED(ibv_create_cq_fn, ibv_create_cq)
EXPORTED(ibv_destroy_cq_fn, ibv_destroy_cq)
EXPORTED(ibv_get_cq_event_fn, ibv_get_cq_event)
EXPORTED(ibv_ack_cq_events_fn, ibv_ack_cq_events)
EXPORTED(ibv_create_qp_fn, ibv_create_qp)
EXPORTED(ibv_modify_qp_fn, ibv_modify_qp)
EXPORTED(ibv_destroy_qp_fn, ibv_destroy_qp)
EXPORTED(ibv_wc_status_str_fn, ibv_wc_status_str)
EXPORTED(ibv_port_state_str_fn, ibv_port_state_str)

// A call verbs.h defines inline and ibv_loader.h defines again: the same signature.
#define INLINE(ours_fn, fn)                                                    \
  static_assert(std::is_same<Theirs<decltype(&ours::ours_fn)>, decltype(&::fn)>::value, \
                #fn ": signature differs");
INLINE(ibv_post_send, ibv_post_send)
INLINE(ibv_post_recv, ibv_post_recv)
INLINE(ibv_poll_cq, ibv_poll_cq)
INLINE(ibv_req_notify_cq, ibv_req_notify_cq)
INLINE(ibv_alloc_mw, ibv_alloc_mw)
INLINE(ibv_dealloc_mw, ibv_dealloc_mw)
INLINE(ibv_bind_mw, ibv_bind_mw)
INLINE(query_port, ___ibv_query_port)  // what verbs.h's ibv_query_port() expands to

int main() {
  if (reinterpret_cast<void*>(ours::kVerbsAbiExtended) != __VERBS_ABI_IS_EXTENDED) {
    std::fprintf(stderr, "kVerbsAbiExtended differs from __VERBS_ABI_IS_EXTENDED\n");
    return 1;
  }
  return 0;
}
