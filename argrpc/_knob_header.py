"""Renders `csrc/knobs.h`, the engine's view of the knob table in `argrpc/_config.py`.

The C++ engine takes its defaults, bounds and fixed limits from that header, and the
list of each config struct's fields (`ARGRPC_<STRUCT>_FIELDS`, an X-macro), from which
`csrc/engine_config.h` declares the structs and `csrc/bindings/config.cc` reads them
from Python's dicts, checks them and reports their defaults: a knob is one entry in the
table. `python3 -m argrpc._knob_header` rewrites the header; the test suite fails when
the committed header differs from what this renders.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from argrpc._config import ENGINE_ARGS, ENGINE_STRUCTS, FIXED, TABLE

HEADER_PATH = Path(__file__).resolve().parent.parent / "csrc" / "knobs.h"

_PROLOGUE = """\
// Generated from the knob table in argrpc/_config.py by `python3 -m argrpc._knob_header`.
// Do not edit: change the table and regenerate (the test suite compares the two).
#pragma once
#include <cstdint>

namespace argrpc::knobs {

// A TF_RDMA_* variable the engine uses: its name (for error messages), default and
// inclusive bounds, whether it must be a power of two and whether 0 means off. Python
// validates user input against the same bounds.
struct Knob {
  const char* name;
  int64_t def, lo, hi;
  bool power_of_two, zero_off;
};

"""


def _macro(struct: str) -> str:
    """EngineConfig -> ARGRPC_ENGINE_CONFIG_FIELDS."""
    words = [w.upper() for w in re.findall(r"[A-Z][a-z0-9]*", struct)]
    return "ARGRPC_" + "_".join(words) + "_FIELDS"


def struct_fields(struct: str) -> list[tuple[str, str, str, str]]:
    """(kind, C++ type, field, constant) of each field of an engine config struct, in
    declaration order: knobs (KNOB), fixed limits (FIXED), then values Python passes from
    grpc's options (ARG)."""
    out = [("KNOB", k.cxx_type, k.field, _camel(k.field)) for k in TABLE if k.engine == struct]
    out += [("FIXED", f.ctype, f.field, _camel(f.field)) for f in FIXED if f.struct == struct]
    out += [("ARG", a.ctype, a.field, _camel(a.field)) for a in ENGINE_ARGS if a.struct == struct]
    return out


_FIELDS_DOC = """\
// Each config struct's fields (csrc/engine_config.h) as X(kind, type, field, constant):
// KNOB, a knob Python passes and the engine checks against the knob's bounds; FIXED, a
// fixed limit Python does not pass; ARG, a value Python passes from grpc's options (its
// constant is the default).

"""


def _camel(field: str) -> str:
    return "k" + "".join(part.capitalize() for part in field.split("_"))


def _comment(text: str) -> str:
    return textwrap.fill(text, 90, initial_indent="// ", subsequent_indent="// ") + "\n"


def render() -> str:
    out = [_PROLOGUE]
    for k in TABLE:
        if not k.engine:
            continue
        out.append(_comment(f"{k.engine}::{k.field}: {k.meaning}"))
        lo, hi = (0, 1) if k.kind == "bool" else (k.lo, k.hi)
        flags = f"{str(k.power_of_two).lower()}, {str(k.zero_off).lower()}"
        out.append(f'inline constexpr Knob {_camel(k.field)}{{"{k.name}", {int(k.default)}, '
                   f"{lo}, {hi}, {flags}}};\n\n")
    out.append("// Fixed limits and timeouts: not settable, each with its reason.\n\n")
    for f in FIXED:
        if not f.engine:
            continue
        ctype = "double" if isinstance(f.value, float) else "int64_t"
        out.append(_comment(f.meaning))
        out.append(f"inline constexpr {ctype} {_camel(f.field)} = {f.value!r};\n\n")
    out.append("// Values Python passes from grpc's options: their defaults.\n\n")
    for a in ENGINE_ARGS:
        out.append(_comment(f"{a.struct}::{a.field}: {a.meaning}"))
        out.append(f"inline constexpr {a.ctype} {_camel(a.field)} = {a.default!r};\n\n")
    out.append("}  // namespace argrpc::knobs\n\n")
    out.append(_FIELDS_DOC)
    for struct in ENGINE_STRUCTS:
        rows = [f"#define {_macro(struct)}(X)"]
        rows += [f"  X({kind}, {ctype}, {field}, {const})" for kind, ctype, field, const
                 in struct_fields(struct)]
        out.append(" \\\n".join(rows) + "\n\n")
    out.append("// The config structs, as X(struct, its field list).\n")
    rows = ["#define ARGRPC_CONFIG_STRUCTS(X)"]
    rows += [f"  X({struct}, {_macro(struct)})" for struct in ENGINE_STRUCTS]
    out.append(" \\\n".join(rows) + "\n")
    return "".join(out)


def main() -> int:
    HEADER_PATH.write_text(render())
    print(f"wrote {HEADER_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
