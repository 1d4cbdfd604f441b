// The engine's own check of a value against its knob's bounds (csrc/knobs.h, generated
// from the table Python validates with), for values that reach it without Python's
// validation: a caller of _core, or a peer declaring its ring or window. The message
// names the variable, as Python's does.
#pragma once
#include <cstdint>
#include <string>

#include "common/error.h"
#include "knobs.h"

namespace argrpc {

inline bool in_bounds(const knobs::Knob& k, int64_t v) { return v >= k.lo && v <= k.hi; }

inline std::string bounds_text(const knobs::Knob& k) {
  return "[" + std::to_string(k.lo) + ", " + std::to_string(k.hi) + "]";
}

// Throws CoreError unless lo <= v <= hi; `extra` is what else must hold, for the message.
inline void check_knob(const knobs::Knob& k, int64_t v, bool ok = true, const char* extra = "") {
  if (ok && in_bounds(k, v)) return;
  throw CoreError(std::string(k.name) + "=" + std::to_string(v) + " is invalid: it must be in " +
                  bounds_text(k) + extra);
}

inline bool power_of_two(uint64_t v) { return v && !(v & (v - 1)); }

}  // namespace argrpc
