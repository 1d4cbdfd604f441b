// The engine's config structs. Each field is declared once, in argrpc/_config.py (a
// knob, a fixed limit, or a value Python passes from grpc's options); the generated
// knobs.h lists each struct's fields with their types and constants
// (ARGRPC_<STRUCT>_FIELDS), and the structs here, the reading from Python's dicts and
// the engine's bounds checks (bindings/config.cc), and _core._config_defaults are loops
// over those lists. The Python layer validates user input against the same bounds; the
// C++ side also checks what would be unsafe (a hostile peer's values, a device's limits).
#pragma once
#include <cstddef>
#include <cstdint>

#include "knobs.h"

namespace argrpc {

constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

namespace knobs {
// A field's default: its knob's default, or its constant's value.
template <class T>
constexpr T default_of(const Knob& k) {
  return T(k.def);
}
template <class T>
constexpr T default_of(int64_t v) {
  return T(v);
}
}  // namespace knobs

#define ARGRPC_CONFIG_FIELD(kind, type, field, constant) \
  type field = knobs::default_of<type>(knobs::constant);

// The process's engine: its pool (buf_size caps it, slab_size is its first growth step),
// how long waits spin, when copies go parallel, and malloc tuning: protobuf builds a
// fresh buffer per message, and with glibc's defaults each multi-MiB one is new,
// page-faulting memory (docs/design.md, "Bulk bytes"), so freed memory is kept instead.
struct EngineConfig {
  ARGRPC_ENGINE_CONFIG_FIELDS(ARGRPC_CONFIG_FIELD)
};

// One connection, whatever its fabric. With calls in flight (or pool blocks the peer may
// still read), a connection that heard nothing for keepalive_ms sends a PING: on a
// fabric without a liveness fd (verbs) the write to a dead peer fails, and so do the
// calls, instead of waiting for their deadlines. Idle ones do the same after
// idle_keepalive_ms (0: never). On fabrics that can map the sender's pool (shm),
// messages at least zero_copy_min big are handed to the reader as a view of the sender's
// block instead of copied (bindings/config.cc makes 0, off, the largest size).
struct ConnConfig {
  ARGRPC_CONN_CONFIG_FIELDS(ARGRPC_CONFIG_FIELD)
};

// The verbs fabric (csrc/fabric/verbs). QP 0 carries eager batches and credits; READs
// go round-robin over all qps. The receive slots (cq_slots) and the send queues share
// cq_depth. Device/port/GID selection is not here: it comes from TF_RDMA_DEV_NAME /
// TF_RDMA_PORT_NUM / TF_RDMA_GID_INDEX through verbs_select().
struct VerbsConfig {
  ARGRPC_VERBS_CONFIG_FIELDS(ARGRPC_CONFIG_FIELD)
};

#undef ARGRPC_CONFIG_FIELD

}  // namespace argrpc
