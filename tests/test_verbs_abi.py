"""The verbs ABI argrpc declares itself (csrc/fabric/verbs/ibv_types.h): the declarations
match rdma-core's <infiniband/verbs.h> (scripts/check_verbs_abi.sh), the check fails on a
wrong one and covers every one, and the extension compiles with no rdma-core header."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.procs import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "check_verbs_abi.sh"
CHECK = REPO_ROOT / "tests" / "abi" / "verbs_abi_check.cc"
CSRC = REPO_ROOT / "csrc"
TYPES_H = CSRC / "fabric" / "verbs" / "ibv_types.h"
LOADER_H = CSRC / "fabric" / "verbs" / "ibv_loader.h"
CXX = shlex.split(os.environ.get("CXX", "g++"))


def need_compiler() -> None:
    # The installed-wheel run (scripts/test_installed.sh) has no compiler on PATH, on
    # purpose; CI runs these in the editable run and scripts/check_verbs_abi.sh as well.
    if shutil.which(CXX[0]) is None:
        pytest.skip(f"no C++ compiler ({CXX[0]}) on PATH: the check and the header-free "
                    "build compile")


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess[str]:
    """The check against the rdma-core headers the compiler finds; skips without any
    (scripts/setup.sh installs them, so the suite runs it wherever it was set up)."""
    need_compiler()
    r = run_check()
    if r.returncode == 2:
        pytest.skip(f"no rdma-core headers to compare with: {r.stderr.strip()}")
    return r


def test_declarations_match_rdma_core(checked: subprocess.CompletedProcess[str]) -> None:
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert re.search(r"ibv_types\.h matches \S+/infiniband/verbs\.h", checked.stdout), checked.stdout


# One wrong declaration each, as an edit of the real header: (what, text, wrong text,
# what the check must say).
PERTURBATIONS = [
    ("two fields swapped", "  uint32_t rq_psn;\n  uint32_t sq_psn;\n",
     "  uint32_t sq_psn;\n  uint32_t rq_psn;\n", "ibv_qp_attr.rq_psn: offset differs"),
    ("a field's type", "  uint32_t vendor_err;\n", "  uint16_t vendor_err;\n",
     "ibv_wc.vendor_err: type differs"),
    ("an enum value", "IBV_QPS_RTR = 2,", "IBV_QPS_RTR = 3,", "IBV_QPS_RTR: value differs"),
    ("a placeholder slot too few", "void (*unused_13_24[12])();", "void (*unused_13_24[11])();",
     "ibv_context_ops.post_send: offset differs"),
    ("verbs_context one op longer", "void (*unused_ops[37])();", "void (*unused_ops[38])();",
     "verbs_context.sz: distance from query_port differs"),
    ("a function's parameter type", "ibv_qp_attr* attr, int attr_mask);",
     "ibv_qp_attr* attr, unsigned int attr_mask);", "ibv_modify_qp: type differs"),
]


@pytest.mark.parametrize("what,text,wrong,message", PERTURBATIONS, ids=[p[0] for p in PERTURBATIONS])
def test_check_fails_on_a_wrong_declaration(checked: subprocess.CompletedProcess[str], tmp_path: Path,
                                            what: str, text: str, wrong: str, message: str) -> None:
    header = TYPES_H.read_text()
    assert header.count(text) == 1, f"ibv_types.h changed: update this test's {what!r}"
    copy = tmp_path / "fabric" / "verbs" / "ibv_types.h"
    copy.parent.mkdir(parents=True)
    copy.write_text(header.replace(text, wrong))
    # -I puts the copy before csrc's, for the checker and for ibv_loader.h alike.
    r = run_check(f"-I{tmp_path}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert message in r.stderr, r.stderr[-4000:]


# --------------------------------------------------------------- every declaration checked


def _without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _block(text: str, open_at: int) -> str:
    """The text inside the braces that open at text[open_at]."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    raise AssertionError("unbalanced braces in ibv_types.h")


def _fields(body: str, prefix: str = "") -> list[str]:
    """Member paths of a struct or union body, down to the leaves: a named nested
    aggregate gives `name.leaf`, an anonymous one its leaves as they are."""
    decls, depth, start = [], 0, 0
    for i, c in enumerate(body):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if c == ";" and depth == 0:
            decls.append(body[start:i].strip())
            start = i + 1
    out: list[str] = []
    for d in decls:
        if "{" in d:
            name = d[d.rindex("}") + 1:].strip()
            out += _fields(_block(d, d.index("{")), f"{prefix}{name}." if name else prefix)
        else:
            m = re.search(r"\(\*\s*(\w+)", d) or re.search(r"(\w+)\s*(?:\[[^\]]*\])?$", d)
            assert m, f"cannot read the declaration {d!r}"
            out.append(prefix + m.group(1))
    return out


def expected_checks() -> set[str]:
    """The checker line each declaration in ibv_types.h (and dispatch in ibv_loader.h) needs."""
    abi = _without_comments(TYPES_H.read_text())
    want: set[str] = set()
    for m in re.finditer(r"^struct (\w+);", abi, re.M):  # opaque
        want.add(f"SAME_TYPE({m.group(1)})")
    for m in re.finditer(r"^(?:struct|union) (\w+) \{", abi, re.M):
        name = m.group(1)
        want.add(f"SAME_TYPE({name})")
        for f in _fields(_block(abi, m.end() - 1)):
            if f.split(".")[-1].startswith("unused"):
                continue  # placeholders: pinned by the size and the fields around them
            want.add(f"TAIL_FIELD({f})" if name == "verbs_context" else f"FIELD({name}, {f})")
    for m in re.finditer(r"^enum (\w+ )?: int \{", abi, re.M):
        name = (m.group(1) or "").strip()
        if name:
            want |= {f"SAME_TYPE({name})", f"ENUM_TYPE({name})"}
        for v in re.findall(r"(\w+) =", _block(abi, m.end() - 1)):
            want.add(f"VALUE({v})" if name else f"CONSTANT({v})")
    for m in re.finditer(r"^using (\w+_fn) = ", abi, re.M):
        want.add(f"EXPORTED({m.group(1)},")
    for m in re.finditer(r"^inline [\w*]+\s*\*?\s*(\w+)\(", LOADER_H.read_text(), re.M):
        want.add(f"INLINE({m.group(1)},")
    return want


def test_every_declaration_is_checked() -> None:
    want = expected_checks()
    # Not vacuous: the parse found the structs, fields, values and functions.
    assert {"FIELD(ibv_send_wr, wr.rdma.rkey)", "FIELD(ibv_wc, imm_data)", "TAIL_FIELD(sz)",
            "VALUE(IBV_WR_RDMA_READ)", "CONSTANT(IBV_LINK_LAYER_ETHERNET)",
            "EXPORTED(ibv_query_gid_ex_fn,", "INLINE(ibv_bind_mw,", "SAME_TYPE(ibv_device)"} <= want
    assert len(want) > 250, len(want)
    lines = [ln.strip() for ln in CHECK.read_text().splitlines()]
    missing = sorted(w for w in want if not any(ln.startswith(w) for ln in lines))
    assert not missing, f"declared in ibv_types.h/ibv_loader.h but not checked in {CHECK.name}: {missing}"
    structs = re.findall(r"^(?:struct|union) (\w+) \{", _without_comments(TYPES_H.read_text()), re.M)
    # Each struct says whether it is exact or a prefix (verbs_context has its own).
    unsized = [s for s in structs if s != "verbs_context"
               and f"EXACT({s})" not in lines and f"PREFIX({s})" not in lines]
    assert not unsized, f"no EXACT/PREFIX size check for {unsized}"


# ------------------------------------------------------------ no rdma-core header needed


def test_extension_compiles_without_rdma_core_headers(tmp_path: Path) -> None:
    need_compiler()
    import pybind11

    # Every rdma-core header name, shadowed by one that stops the compiler.
    stubs = tmp_path / "infiniband"
    stubs.mkdir()
    names = {"verbs.h", "verbs_api.h", "arch.h", "ib_user_ioctl_verbs.h"}
    names |= {p.name for p in Path("/usr/include/infiniband").glob("*.h")}
    for n in names:
        (stubs / n).write_text(f"#error \"rdma-core's <infiniband/{n}> was included\"\n")
    flags = [*CXX, "-std=c++17", f"-I{tmp_path}", f"-I{CSRC}", f"-I{pybind11.get_include()}",
             f"-I{sysconfig.get_paths()['include']}"]

    def cc(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*flags, *args], input=stdin, capture_output=True, text=True,
                              timeout=300, cwd=REPO_ROOT)

    # The stubs do shadow the real headers (else nothing below would prove anything).
    probe = cc("-x", "c++", "-fsyntax-only", "-", stdin="#include <infiniband/verbs.h>\n")
    assert probe.returncode != 0 and "rdma-core's <infiniband/verbs.h> was included" in probe.stderr

    sources = sorted(CSRC.rglob("*.cc"))
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        # No unit includes an rdma-core header: the preprocessor would stop at its #error.
        deps = list(pool.map(lambda s: cc("-M", str(s)), sources))
        failed = {str(s.relative_to(REPO_ROOT)): r.stderr[-2000:] for s, r in zip(sources, deps) if r.returncode}
        assert not failed, failed
        # The units that use the verbs declarations compile against them alone.
        verbs_units = [s for s, r in zip(sources, deps) if "fabric/verbs/ibv_types.h" in r.stdout]
        expected = {*CSRC.glob("fabric/verbs/*.cc"), CSRC / "bindings" / "verbs.cc"}
        assert expected <= set(verbs_units), sorted(str(s) for s in expected - set(verbs_units))
        compiled = list(pool.map(lambda s: cc("-fsyntax-only", str(s)), verbs_units))
    failed = {str(s.relative_to(REPO_ROOT)): r.stderr[-2000:] for s, r in zip(verbs_units, compiled) if r.returncode}
    assert not failed, failed
