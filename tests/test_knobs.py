"""Each knob and fixed limit is declared once (argrpc/_config.py): the engine's header is
generated from that table (the constants and each config struct's field list, from which
the structs, their reading from Python and their defaults are loops), and no other file
names a TF_RDMA_* variable the table lacks."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from argrpc import _config, _knob_header

ROOT = Path(__file__).resolve().parent.parent
# Files a user or the engine reads; tests name unknown variables on purpose.
_SCANNED = ("argrpc", "csrc", "docs", "examples", "scripts", "bench", "fuzz", "README.md")


def test_engine_header_is_generated_from_the_table() -> None:
    # The repository's header (an installed argrpc has no csrc/ beside it; in a checkout
    # this is _knob_header.HEADER_PATH).
    assert (ROOT / "csrc" / "knobs.h").read_text() == _knob_header.render(), (
        "csrc/knobs.h is stale: run python3 -m argrpc._knob_header")


def test_every_engine_knob_and_limit_is_in_the_header() -> None:
    text = _knob_header.render()
    for k in _config.TABLE:
        assert (f'"{k.name}"' in text) == bool(k.engine), k.name
    for f in _config.FIXED:
        assert (f" = {f.value!r};" in text) or not f.engine, f.field


def test_each_config_struct_is_its_generated_field_list() -> None:
    text = _knob_header.render()
    for struct in _config.ENGINE_STRUCTS:
        fields = _knob_header.struct_fields(struct)
        macro = f"#define {_knob_header._macro(struct)}(X)"
        assert macro in text, struct
        for kind, ctype, field, const in fields:
            assert f"X({kind}, {ctype}, {field}, {const})" in text
            assert f" {const}" in text.split(macro)[0], const  # the constant is declared
    # every engine knob, struct-carried limit and argument is a field of a known struct
    for k in _config.TABLE:
        assert not k.engine or k.engine in _config.ENGINE_STRUCTS, k.name
    for f in _config.FIXED:
        assert not f.struct or (f.engine and f.struct in _config.ENGINE_STRUCTS), f.field
    for a in _config.ENGINE_ARGS:
        assert a.struct in _config.ENGINE_STRUCTS, a.field
    # and the structs declare no field by hand: each body is its list
    header = (ROOT / "csrc" / "engine_config.h").read_text()
    for struct in _config.ENGINE_STRUCTS:
        body = re.search(r"struct %s \{(.*?)\};" % struct, header, re.S)
        assert body, struct
        assert body.group(1).strip() == f"{_knob_header._macro(struct)}(ARGRPC_CONFIG_FIELD)"


def test_no_file_names_a_variable_the_table_lacks() -> None:
    known = {k.name for k in _config.TABLE}
    files = subprocess.run(["git", "ls-files", *_SCANNED], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    unknown: dict[str, str] = {}
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".so"):
            continue
        for var in re.findall(r"TF_RDMA_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            if var not in known:
                unknown.setdefault(var, name)
    assert not unknown, f"TF_RDMA_* names with no knob behind them: {unknown}"


def test_bounds_are_consistent() -> None:
    for k in _config.TABLE:
        if k.kind in ("int", "size"):
            assert k.lo <= k.hi, k.name
            if k.default is not None:
                assert k.lo <= k.default <= k.hi or (k.zero_off and k.default == 0), k.name
                k.parse(str(k.default))  # the default is itself an accepted value


def test_the_engine_defaults_are_the_tables() -> None:
    from argrpc import _core

    bound = _core._config_defaults()
    for k in _config.TABLE:
        if k.engine:
            assert bound[k.engine][k.field] == k.default, k.name
    for f in _config.FIXED:
        if f.struct:
            assert bound[f.struct][f.field] == f.value, f.field
    for a in _config.ENGINE_ARGS:
        assert bound[a.struct][a.field] == a.default, a.field
    # each struct has exactly the fields its list declares
    for struct in _config.ENGINE_STRUCTS:
        assert set(bound[struct]) == {f for _, _, f, _ in _knob_header.struct_fields(struct)}
    # every field the engine reads from Python has its knob, and every engine knob a field
    passed = set(_config.engine_config(_config.Config())) | set(
        _config.conn_config(_config.Config(), -1)) - {"max_recv"}
    engine_fields = {k.field for k in _config.TABLE if k.engine}
    assert passed == engine_fields
    assert engine_fields <= {name for struct in bound.values() for name in struct}


def test_the_engine_checks_the_same_bounds() -> None:
    from argrpc import _core

    engine = _core.Engine({"buf_size": 64 << 20})
    try:
        for key, knob_name, bad in [("chunk_size", "TF_RDMA_CHUNK_SIZE", 32 * 1024),
                                    ("stream_window", "TF_RDMA_STREAM_WINDOW", 4 * 1024),
                                    ("reads_in_flight", "TF_RDMA_READS_IN_FLIGHT", 65)]:
            k = _config.knob(knob_name)
            assert not k.lo <= bad <= k.hi
            try:
                engine.new_shm_endpoint({key: bad})
            except _core.CoreError as e:
                assert knob_name in str(e) and f"[{k.lo}, {k.hi}]" in str(e), str(e)
            else:
                raise AssertionError(f"{key}={bad} was accepted")
    finally:
        engine.shutdown()


def test_the_engine_checks_every_knob_it_reads() -> None:
    from argrpc import _core

    engine = _core.Engine({"buf_size": 64 << 20})
    try:
        # The verbs knobs are read and checked before any device is looked for.
        for key, knob_name, bad in [("qps", "TF_RDMA_QPS", 17),
                                    ("qp_timeout", "TF_RDMA_QP_TIMEOUT", 0),
                                    ("qp_retry", "TF_RDMA_QP_RETRY", 8),
                                    ("cq_depth", "TF_RDMA_CQ_DEPTH", 255)]:
            try:
                engine.new_verbs_endpoint({key: bad}, {})
            except _core.CoreError as e:
                assert knob_name in str(e), str(e)
            else:
                raise AssertionError(f"{key}={bad} was accepted")
        # What the table declares beyond the bounds: a power of two, 0 meaning off.
        try:
            engine.new_shm_endpoint({"ring_size": 3 << 20})
        except _core.CoreError as e:
            assert "TF_RDMA_RING_SIZE" in str(e) and "power of two" in str(e), str(e)
        else:
            raise AssertionError("a ring size that is no power of two was accepted")
        engine.new_shm_endpoint({"zero_copy_min": 0})
    finally:
        engine.shutdown()
