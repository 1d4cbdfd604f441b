// The engine's config structs from the dicts argrpc._config builds, with the engine's
// own bounds checks, and the defaults the engine uses when Python passes nothing. Each
// is a loop over the struct's field list in knobs.h (ARGRPC_<STRUCT>_FIELDS), so a new
// knob or limit needs no code here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/bindings.h"
#include "common/knob_check.h"
#include "engine_config.h"

namespace py = pybind11;

namespace argrpc {
namespace bindings {

namespace {

// A knob's value from the dict (its default when absent), checked against its bounds:
// in range, a power of two where the knob says so, or 0 where 0 means off.
template <class T>
void read_knob(const py::dict& d, const char* field, const knobs::Knob& k, T& out) {
  out = get_or<T>(d, field, out);
  const int64_t v = int64_t(out);
  if (k.zero_off && v == 0) return;
  const bool pow2_ok = !k.power_of_two || power_of_two(uint64_t(v));
  if (pow2_ok && in_bounds(k, v)) return;
  std::string extra;
  if (k.power_of_two) extra += std::string(": ") + field + " must be a power of two";
  if (k.zero_off) extra += " or 0 (off)";
  check_knob(k, v, pow2_ok, extra.c_str());
}

#define ARGRPC_READ_KNOB(type, field, constant) read_knob<type>(d, #field, knobs::constant, c.field);
#define ARGRPC_READ_ARG(type, field, constant) c.field = get_or<type>(d, #field, c.field);
#define ARGRPC_READ_FIXED(type, field, constant)
#define ARGRPC_READ(kind, type, field, constant) ARGRPC_READ_##kind(type, field, constant)
#define ARGRPC_DEFAULT(kind, type, field, constant) out[#field] = c.field;

}  // namespace

// read_fields<S>(d): every field of S from the dict, knobs checked.
template <class Struct>
Struct read_fields(const py::dict& d);

#define ARGRPC_READ_FIELDS(Struct, FIELDS)             \
  template <>                                          \
  Struct read_fields<Struct>(const py::dict& d) {      \
    Struct c;                                          \
    FIELDS(ARGRPC_READ)                                \
    return c;                                          \
  }
ARGRPC_CONFIG_STRUCTS(ARGRPC_READ_FIELDS)

EngineConfig engine_config(const py::dict& d) { return read_fields<EngineConfig>(d); }

ConnConfig conn_config(const py::dict& d) {
  ConnConfig c = read_fields<ConnConfig>(d);
  // What holds between two knobs (Python's load() checks the same).
  check_knob(knobs::kAccSize, int64_t(c.acc_size), c.acc_size <= c.ring_size / 4,
             " and at most TF_RDMA_RING_SIZE/4");
  if (c.zero_copy_min == 0) c.zero_copy_min = ~size_t(0);  // off: no message is that big
  return c;
}

VerbsConfig verbs_config(const py::dict& d) { return read_fields<VerbsConfig>(d); }

void add_config(py::module_& m) {
  // What the engine uses when Python passes nothing: tests compare it with the knob table.
  m.def("_config_defaults", [] {
    py::dict structs;
#define ARGRPC_STRUCT_DEFAULTS(Struct, FIELDS) \
  {                                            \
    const Struct c;                            \
    py::dict out;                              \
    FIELDS(ARGRPC_DEFAULT)                     \
    structs[#Struct] = out;                    \
  }
    ARGRPC_CONFIG_STRUCTS(ARGRPC_STRUCT_DEFAULTS)
    return structs;
  });
}

}  // namespace bindings
}  // namespace argrpc
