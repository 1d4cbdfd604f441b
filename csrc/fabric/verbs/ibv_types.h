// The part of libibverbs' ABI that argrpc uses, declared here so that the extension
// compiles without rdma-core's headers (libibverbs itself is loaded at run time:
// ibv_loader.h). Written from the ABI libibverbs 1.1 documents and keeps stable; the names
// are libibverbs' own, so its documentation reads for them, but they live in
// argrpc::verbs and never meet rdma-core's in one scope. tests/abi/verbs_abi_check.cc
// compares every size, offset, field type, enum value and function type below with
// rdma-core's <infiniband/verbs.h> (scripts/check_verbs_abi.sh, tests/test_verbs_abi.py).
//
// Three kinds of declaration:
//   * exact: argrpc allocates these or hands libibverbs their size; every field is
//     declared, in order, with libibverbs' types;
//   * prefix (ibv_qp, ibv_cq): only libibverbs allocates them and argrpc reads fields
//     near their start; the rest (locks, counters) is left out, so never take sizeof;
//   * opaque (ibv_device, ibv_srq, ibv_ah, _compat_ibv_port_attr): pointers only.
// Enums get a fixed `int` type: C leaves theirs to the compiler, which gives these the
// size of int and promotes them to int; a fixed int keeps both and makes every value
// the library may return valid, not only the few argrpc names.
#pragma once
#include <pthread.h>

#include <cstddef>
#include <cstdint>

namespace argrpc {
namespace verbs {

using be32 = uint32_t;            // __be32: network byte order
using be64 = unsigned long long;  // __be64: Linux's __u64, unsigned long long on every architecture

struct ibv_device;
struct ibv_srq;
struct ibv_ah;
struct _compat_ibv_port_attr;  // what the exported ibv_query_port takes (see query_port)
struct ibv_context;
struct ibv_pd;
struct ibv_mr;
struct ibv_mw;
struct ibv_cq;
struct ibv_qp;

// ------------------------------------------------------------------ enums and constants

enum ibv_mtu : int { IBV_MTU_256 = 1, IBV_MTU_512 = 2, IBV_MTU_1024 = 3, IBV_MTU_2048 = 4, IBV_MTU_4096 = 5 };
enum ibv_port_state : int { IBV_PORT_ACTIVE = 4 };
enum : int { IBV_LINK_LAYER_ETHERNET = 2 };  // ibv_port_attr::link_layer
enum ibv_gid_type : int { IBV_GID_TYPE_ROCE_V1 = 1, IBV_GID_TYPE_ROCE_V2 = 2 };  // ibv_gid_entry::gid_type
// Field types only: argrpc names none of their values.
enum ibv_atomic_cap : int {};
enum ibv_mig_state : int {};
enum ibv_device_cap_flags : int { IBV_DEVICE_MEM_WINDOW = 1 << 17 };
enum ibv_access_flags : int {
  IBV_ACCESS_LOCAL_WRITE = 1 << 0,
  IBV_ACCESS_REMOTE_WRITE = 1 << 1,
  IBV_ACCESS_REMOTE_READ = 1 << 2,
  IBV_ACCESS_MW_BIND = 1 << 4,
};
enum ibv_mw_type : int { IBV_MW_TYPE_1 = 1 };
enum ibv_qp_type : int { IBV_QPT_RC = 2 };
enum ibv_qp_state : int { IBV_QPS_INIT = 1, IBV_QPS_RTR = 2, IBV_QPS_RTS = 3, IBV_QPS_ERR = 6 };
enum ibv_qp_attr_mask : int {
  IBV_QP_STATE = 1 << 0,
  IBV_QP_ACCESS_FLAGS = 1 << 3,
  IBV_QP_PKEY_INDEX = 1 << 4,
  IBV_QP_PORT = 1 << 5,
  IBV_QP_AV = 1 << 7,
  IBV_QP_PATH_MTU = 1 << 8,
  IBV_QP_TIMEOUT = 1 << 9,
  IBV_QP_RETRY_CNT = 1 << 10,
  IBV_QP_RNR_RETRY = 1 << 11,
  IBV_QP_RQ_PSN = 1 << 12,
  IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
  IBV_QP_MIN_RNR_TIMER = 1 << 15,
  IBV_QP_SQ_PSN = 1 << 16,
  IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
  IBV_QP_DEST_QPN = 1 << 20,
};
enum ibv_wr_opcode : int { IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_WRITE_WITH_IMM = 1, IBV_WR_RDMA_READ = 4 };
enum ibv_send_flags : int { IBV_SEND_SIGNALED = 1 << 1, IBV_SEND_INLINE = 1 << 3 };
enum ibv_wc_status : int { IBV_WC_SUCCESS = 0 };
// Receive opcodes have bit 7 set; this is the one after IBV_WC_RECV.
enum ibv_wc_opcode : int { IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1 };
enum ibv_wc_flags : int { IBV_WC_WITH_IMM = 1 << 1 };

// A context that libibverbs embeds in a verbs_context has abi_compat set to this.
constexpr uintptr_t kVerbsAbiExtended = UINTPTR_MAX;

// ------------------------------------------------------------------------- devices

union ibv_gid {
  uint8_t raw[16];
  struct {
    be64 subnet_prefix;
    be64 interface_id;
  } global;
};

struct ibv_gid_entry {  // exact: _ibv_query_gid_ex is given its size
  ibv_gid gid;
  uint32_t gid_index;
  uint32_t port_num;
  uint32_t gid_type;  // ibv_gid_type
  uint32_t ndev_ifindex;
};

struct ibv_device_attr {  // exact: ibv_query_device fills all of it
  char fw_ver[64];
  be64 node_guid;
  be64 sys_image_guid;
  uint64_t max_mr_size;
  uint64_t page_size_cap;
  uint32_t vendor_id;
  uint32_t vendor_part_id;
  uint32_t hw_ver;
  int max_qp;
  int max_qp_wr;
  unsigned int device_cap_flags;  // ibv_device_cap_flags
  int max_sge;
  int max_sge_rd;
  int max_cq;
  int max_cqe;
  int max_mr;
  int max_pd;
  int max_qp_rd_atom;
  int max_ee_rd_atom;
  int max_res_rd_atom;
  int max_qp_init_rd_atom;
  int max_ee_init_rd_atom;
  ibv_atomic_cap atomic_cap;
  int max_ee;
  int max_rdd;
  int max_mw;
  int max_raw_ipv6_qp;
  int max_raw_ethy_qp;
  int max_mcast_grp;
  int max_mcast_qp_attach;
  int max_total_mcast_qp_attach;
  int max_ah;
  int max_fmr;
  int max_map_per_fmr;
  int max_srq;
  int max_srq_wr;
  int max_srq_sge;
  uint16_t max_pkeys;
  uint8_t local_ca_ack_delay;
  uint8_t phys_port_cnt;
};

struct ibv_port_attr {  // exact: the extended query_port is given its size
  ibv_port_state state;
  ibv_mtu max_mtu;
  ibv_mtu active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
};

// -------------------------------------------------------- work requests, completions

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_mw_bind_info {
  ibv_mr* mr;
  uint64_t addr;
  uint64_t length;
  unsigned int mw_access_flags;  // ibv_access_flags
};

// Exact, unions included: the provider reads the whole request, whatever its opcode.
struct ibv_send_wr {
  uint64_t wr_id;
  ibv_send_wr* next;
  ibv_sge* sg_list;
  int num_sge;
  ibv_wr_opcode opcode;
  unsigned int send_flags;  // ibv_send_flags
  union {
    be32 imm_data;
    uint32_t invalidate_rkey;
  };
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
    struct {
      ibv_ah* ah;
      uint32_t remote_qpn;
      uint32_t remote_qkey;
    } ud;
  } wr;
  union {
    struct {
      uint32_t remote_srqn;
    } xrc;
  } qp_type;
  union {
    struct {
      ibv_mw* mw;
      uint32_t rkey;
      ibv_mw_bind_info bind_info;
    } bind_mw;
    struct {
      void* hdr;
      uint16_t hdr_sz;
      uint16_t mss;
    } tso;
  };
};

struct ibv_recv_wr {
  uint64_t wr_id;
  ibv_recv_wr* next;
  ibv_sge* sg_list;
  int num_sge;
};

struct ibv_mw_bind {
  uint64_t wr_id;
  unsigned int send_flags;  // ibv_send_flags
  ibv_mw_bind_info bind_info;
};

struct ibv_wc {  // exact: ibv_poll_cq writes arrays of them
  uint64_t wr_id;
  ibv_wc_status status;
  ibv_wc_opcode opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  union {
    be32 imm_data;
    uint32_t invalidated_rkey;
  };
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;  // ibv_wc_flags
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

// ------------------------------------------------------------------- queue pairs

struct ibv_qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct ibv_qp_init_attr {
  void* qp_context;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  ibv_qp_cap cap;
  ibv_qp_type qp_type;
  int sq_sig_all;
};

struct ibv_global_route {
  ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ibv_ah_attr {
  ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct ibv_qp_attr {  // exact: ibv_modify_qp reads what the mask names, anywhere in it
  ibv_qp_state qp_state;
  ibv_qp_state cur_qp_state;
  ibv_mtu path_mtu;
  ibv_mig_state path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;  // ibv_access_flags
  ibv_qp_cap cap;
  ibv_ah_attr ah_attr;
  ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

// ------------------------------------------------- objects libibverbs allocates

struct ibv_pd {
  ibv_context* context;
  uint32_t handle;
};

struct ibv_mr {
  ibv_context* context;
  ibv_pd* pd;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_mw {
  ibv_context* context;
  ibv_pd* pd;
  uint32_t rkey;
  uint32_t handle;
  ibv_mw_type type;
};

struct ibv_comp_channel {
  ibv_context* context;
  int fd;
  int refcnt;
};

struct ibv_cq {  // prefix
  ibv_context* context;
  ibv_comp_channel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
};

struct ibv_qp {  // prefix
  ibv_context* context;
  void* qp_context;
  ibv_pd* pd;
  ibv_cq* send_cq;
  ibv_cq* recv_cq;
  ibv_srq* srq;
  uint32_t handle;
  uint32_t qp_num;
  ibv_qp_state state;
  ibv_qp_type qp_type;
};

// The provider's data-path entry points (ibv_loader.h dispatches through them). Exact in
// size, since ibv_context embeds it; the slots argrpc never calls are placeholders.
struct ibv_context_ops {
  void (*unused_0_6[7])();
  ibv_mw* (*alloc_mw)(ibv_pd* pd, ibv_mw_type type);
  int (*bind_mw)(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* mw_bind);
  int (*dealloc_mw)(ibv_mw* mw);
  void (*unused_10)();
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);
  int (*req_notify_cq)(ibv_cq* cq, int solicited_only);
  void (*unused_13_24[12])();
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  void (*unused_27_31[5])();
};

struct ibv_context {  // exact: it ends verbs_context, whose size matters
  ibv_device* device;
  ibv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;  // kVerbsAbiExtended when embedded in a verbs_context
};

// The extended context that surrounds an ibv_context, declared from query_port to its
// end. It grows at its start (new ops go before the older ones), so the distance from
// each op to the ibv_context is fixed once the op exists; `sz` is the whole struct's
// size in the libibverbs that made it, so an op is there when sz reaches back to it.
struct verbs_context {
  int (*query_port)(ibv_context* context, uint8_t port_num, ibv_port_attr* port_attr, size_t port_attr_len);
  void (*unused_ops[37])();
  uint64_t unused_placeholder;
  size_t sz;
  ibv_context context;  // last
};

// ----------------------------------------------- exported functions (dlsym'ed)

using ibv_get_device_list_fn = ibv_device** (*)(int* num_devices);
using ibv_free_device_list_fn = void (*)(ibv_device** list);
using ibv_get_device_name_fn = const char* (*)(ibv_device* device);
using ibv_get_device_guid_fn = be64 (*)(ibv_device* device);
using ibv_open_device_fn = ibv_context* (*)(ibv_device* device);
using ibv_close_device_fn = int (*)(ibv_context* context);
using ibv_query_device_fn = int (*)(ibv_context* context, ibv_device_attr* device_attr);
using ibv_query_port_fn = int (*)(ibv_context* context, uint8_t port_num, _compat_ibv_port_attr* port_attr);
using ibv_query_gid_fn = int (*)(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid);
using ibv_query_gid_ex_fn = int (*)(ibv_context* context, uint32_t port_num, uint32_t gid_index,
                                    ibv_gid_entry* entry, uint32_t flags, size_t entry_size);  // _ibv_query_gid_ex
using ibv_alloc_pd_fn = ibv_pd* (*)(ibv_context* context);
using ibv_dealloc_pd_fn = int (*)(ibv_pd* pd);
using ibv_reg_mr_fn = ibv_mr* (*)(ibv_pd* pd, void* addr, size_t length, int access);
using ibv_dereg_mr_fn = int (*)(ibv_mr* mr);
using ibv_create_comp_channel_fn = ibv_comp_channel* (*)(ibv_context* context);
using ibv_destroy_comp_channel_fn = int (*)(ibv_comp_channel* channel);
using ibv_create_cq_fn = ibv_cq* (*)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                                     int comp_vector);
using ibv_destroy_cq_fn = int (*)(ibv_cq* cq);
using ibv_get_cq_event_fn = int (*)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
using ibv_ack_cq_events_fn = void (*)(ibv_cq* cq, unsigned int nevents);
using ibv_create_qp_fn = ibv_qp* (*)(ibv_pd* pd, ibv_qp_init_attr* qp_init_attr);
using ibv_modify_qp_fn = int (*)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
using ibv_destroy_qp_fn = int (*)(ibv_qp* qp);
using ibv_wc_status_str_fn = const char* (*)(ibv_wc_status status);
using ibv_port_state_str_fn = const char* (*)(ibv_port_state port_state);

}  // namespace verbs
}  // namespace argrpc
