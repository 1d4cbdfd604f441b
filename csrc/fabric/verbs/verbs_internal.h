// What the verbs_*.cc files share: work-request ids, the credit layout, mapping and
// registration helpers. Kept out of verbs_fabric.h, which the bindings include, so that
// header stays the fabric's interface.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/mapping.h"
#include "fabric/verbs/verbs_fabric.h"

namespace argrpc {
namespace verbs {

// wr_id = tag << 56 | value (the engine's read id for kTagRead).
enum Tag : uint64_t { kTagRecv = 1, kTagEager = 2, kTagCredit = 3, kTagRead = 4, kTagBind = 5 };
constexpr uint64_t tag_id(Tag t, uint64_t v = 0) { return (uint64_t(t) << 56) | v; }
constexpr Tag tag_of(uint64_t id) { return static_cast<Tag>(id >> 56); }
constexpr uint64_t value_of(uint64_t id) { return id & ((uint64_t(1) << 56) - 1); }

// Ring credits: mapped and registered when connecting (verbs_endpoint.cc), written and
// read on the data path (verbs_datapath.cc).
struct Credits {  // the mailbox, written by the peer
  uint64_t consumed_bytes, consumed_batches;
};
constexpr size_t kMboxBytes = 4096;
constexpr size_t kCreditArea = 4096;  // staging tail: credit-write sources
constexpr int kCreditSlots = 8;       // > kCreditInflight: a slot is reused only after it completed
constexpr int kCreditInflight = 4;
constexpr int kBindSlots = 4;             // binds are waited for one at a time
constexpr uint64_t kBindWaitUs = 1000000;  // a window bind that has not completed by then failed

// verbs_register.cc
Mapping map_anon(size_t n, const char* what);
Mr reg(ibv_pd* pd, void* p, size_t n, int access, const char* what);

}  // namespace verbs
}  // namespace argrpc
