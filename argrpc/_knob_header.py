"""Renders `csrc/knobs.h`, the engine's view of the knob table in `argrpc/_config.py`.

The C++ engine takes its defaults, bounds and fixed limits from that header, so each is
written once. `python3 -m argrpc._knob_header` rewrites it; the test suite fails when the
committed header differs from what this renders.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from argrpc._config import FIXED, TABLE

HEADER_PATH = Path(__file__).resolve().parent.parent / "csrc" / "knobs.h"

_PROLOGUE = """\
// Generated from the knob table in argrpc/_config.py by `python3 -m argrpc._knob_header`.
// Do not edit: change the table and regenerate (the test suite compares the two).
#pragma once
#include <cstdint>

namespace argrpc::knobs {

// A TF_RDMA_* variable the engine uses: its name (for error messages), default and
// inclusive bounds. Python validates user input against the same bounds.
struct Knob {
  const char* name;
  int64_t def, lo, hi;
};

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
        out.append(f'inline constexpr Knob {_camel(k.field)}{{"{k.name}", {int(k.default)}, '
                   f"{lo}, {hi}}};\n\n")
    out.append("// Fixed limits and timeouts: not settable, each with its reason.\n\n")
    for f in FIXED:
        if not f.engine:
            continue
        ctype = "double" if isinstance(f.value, float) else "int64_t"
        out.append(_comment(f.meaning))
        out.append(f"inline constexpr {ctype} {_camel(f.field)} = {f.value!r};\n\n")
    out.append("}  // namespace argrpc::knobs\n")
    return "".join(out)


def main() -> int:
    HEADER_PATH.write_text(render())
    print(f"wrote {HEADER_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
