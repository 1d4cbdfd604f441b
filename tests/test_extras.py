"""Each extra covers what its entry point imports: the third-party imports of an area
(read with ast, so nothing is imported) must each be provided by the base dependencies or
by that area's extra. A new import without its requirement fails here, not on a user's
machine with a ModuleNotFoundError (or, for the plots, a quiet "plots skipped")."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.procs import PACKAGE_ROOT, REPO_ROOT

FIRST_PARTY = {"argrpc", "argrpc_bench", "tests", "bench", "examples"}
# Modules generated at run time from a .proto next to the code that loads them.
GENERATED = re.compile(r".*_pb2(_grpc)?$")

# top-level module -> the distribution that provides it
DISTRIBUTION = {
    "grpc": "grpcio",
    "grpc_tools": "grpcio-tools",
    "google": "protobuf",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "pytest": "pytest",
    "pytest_benchmark": "pytest-benchmark",
    "cryptography": "cryptography",
    "uvloop": "uvloop",
    "fastgrpc2": "fastgrpc2",
    "flwr": "flwr",
    "kserve": "kserve",
    "pydantic": "pydantic",
    "yaml": "PyYAML",
    "jsonschema": "jsonschema",
    "pybind11": "pybind11",
    "grpc_observability": "grpcio-observability",
    "prometheus_client": "prometheus-client",
    "nixl_cu12": "nixl-cu12",
    # namespace packages: the distribution goes by subpackage (the longest key that names
    # a prefix of the import)
    "opentelemetry.metrics": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.prometheus": "opentelemetry-exporter-prometheus",
}
NAMESPACES = {"opentelemetry"}

# Imports an area may leave to its user, each with the reason.
OPTIONAL = {
    # rdma-core's bindings (Debian's python3-pyverbs), not on PyPI; tests/verbs skips
    # with the reason without them, and CI's RDMA guest has them
    ("test", "pyverbs"),
    # grpc's own plugin, for the calls plain gRPC carries; without it the plugin says so
    # once (each grpcio-observability release requires one grpcio exactly)
    ("observability", "grpc_observability"),
    ("bench", "grpc_observability"),
    ("examples", "grpc_observability"),
    # argrpc-bench peers: a peer that is not installed is a skipped row saying how to get
    # it (NIXL, ucxx, PyTorch RPC; NIXL's wheel requires torch, which its row does not use)
    ("bench", "nixl_cu12"),
    ("test", "nixl_cu12"),
    ("bench", "ucxx"),
    ("test", "ucxx"),
    ("bench", "torch"),
    ("test", "torch"),
    # argrpc-bench --loop uvloop (and bench/loop_pairs.py's uvloop ends): refused with
    # the install hint without it; asyncio's own loop is the default
    ("bench", "uvloop"),
}

# Requirements that no import shows: pytest plugins configured by name.
NOT_IMPORTED = {
    "test": {"pytest-timeout"},  # pytest.ini: timeout = ...
    "bench": {"pytest-benchmark"},  # bench/'s `benchmark` fixture
}

# The code each extra's users run. "base" is argrpc itself, for the plain dependencies;
# "bench" is argrpc-bench, its own distribution (bench/pyproject.toml), which argrpc's
# bench extra names.
AREAS: dict[str, list[str]] = {
    "base": ["argrpc"],
    "observability": ["argrpc/observability"],
    # argrpc-bench measures the plugin's cost too
    "bench": ["bench/argrpc_bench", "argrpc/observability", "bench"],
    "examples": ["examples", "argrpc/observability"],
    # the tests also run argrpc-bench, the examples, the plugin and bench/across_hosts.py
    "test": ["tests", "bench/argrpc_bench", "argrpc/observability", "examples",
             "bench/across_hosts.py"],
}
# the OpenTelemetry plugin: its extra's
EXCLUDED_FROM_BASE = ("argrpc/observability",)


def _root(entry: str) -> Path:
    """argrpc's own files where the argrpc under test is (site-packages for the installed
    wheel), the rest from the repository."""
    return PACKAGE_ROOT if entry.split("/")[0] == "argrpc" else REPO_ROOT


def _rel(f: Path) -> str:
    root = PACKAGE_ROOT if PACKAGE_ROOT in f.parents else REPO_ROOT
    return f.relative_to(root).as_posix()


def _files(area: str) -> Iterator[Path]:
    for entry in AREAS[area]:
        path = _root(entry) / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            rel = _rel(f)
            if area == "base" and rel.startswith(tuple(e + "/" for e in EXCLUDED_FROM_BASE)):
                continue
            if GENERATED.match(f.stem):
                continue
            yield f


def _literal_arg(call: ast.Call) -> str | None:
    """The module named by importorskip("x") / import_module("x") / find_spec("x")."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in {"importorskip", "import_module", "find_spec"} or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:`, which only type checkers import."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imported_modules(source: str) -> set[str]:
    """Top-level names of the absolute imports in `source` that run, string-named ones
    included."""
    names: set[str] = set()
    for node in _run_time_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call):
            literal = _literal_arg(node)
            if literal and not literal.startswith("."):  # ".x": relative, first-party
                names.add(literal)
    return {_module_key(n) for n in names}


def _module_key(name: str) -> str:
    """The top-level module, or for a namespace package the DISTRIBUTION key naming it."""
    top = name.split(".")[0]
    if top not in NAMESPACES:
        return top
    for key in sorted(DISTRIBUTION, key=len, reverse=True):
        if name == key or name.startswith(key + "."):
            return key
    return name


def third_party(area: str) -> dict[str, list[str]]:
    """{top-level module: files importing it} for the area's third-party imports."""
    found: dict[str, list[str]] = {}
    for f in _files(area):
        for mod in imported_modules(f.read_text()):
            if mod in sys.stdlib_module_names or mod in FIRST_PARTY or GENERATED.match(mod):
                continue
            found.setdefault(mod, []).append(_rel(f))
    return found


def _name(requirement: str) -> str:
    """'grpcio-tools>=1.60' -> 'grpcio-tools', normalized as packaging does."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _project(root: Path = REPO_ROOT) -> Any:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def _extra(area: str) -> set[str]:
    """What the area's users get beyond argrpc's dependencies: argrpc-bench's own
    dependencies for the bench, the extra of that name otherwise."""
    if area == "bench":
        return {_name(r) for r in _project(REPO_ROOT / "bench")["dependencies"]} - {"argrpc"}
    return {_name(r) for r in _project()["optional-dependencies"][area]}


def provided(area: str) -> set[str]:
    names = {_name(r) for r in _project()["dependencies"]}
    if area != "base":
        names |= _extra(area)
    return names


def test_scan_sees_imports() -> None:
    # the scan itself: every form of import the areas use
    source = ("import numpy.linalg\nfrom google.protobuf import message\nfrom . import x\n"
              "import os\nyaml = pytest.importorskip('yaml')\n"
              "importlib.import_module('echo_pb2')\nimportlib.import_module('.x', 'p')\n"
              "if TYPE_CHECKING:\n    import typing_extensions\nelse:\n    import json\n"
              "def f():\n    if typing.TYPE_CHECKING:\n        import numpy.typing\n"
              "    import sklearn\n")
    assert imported_modules(source) == {"numpy", "google", "os", "yaml", "echo_pb2", "json",
                                        "sklearn"}
    assert set(third_party("bench")) >= {"numpy", "matplotlib"}
    assert "sklearn" in third_party("examples")


@pytest.mark.parametrize("area", sorted(AREAS))
def test_area_imports_are_provided(area: str) -> None:
    have = provided(area)
    missing = []
    for mod, files in sorted(third_party(area).items()):
        if (area, mod) in OPTIONAL:
            continue
        dist = DISTRIBUTION.get(mod)
        if dist is None:
            missing.append(f"{mod} (imported by {files[0]}): add it to DISTRIBUTION here "
                           "and its distribution to the extra")
        elif _name(dist) not in have:
            where = "dependencies" if area == "base" else f"[{area}]"
            missing.append(f"{dist} for {mod} (imported by {files[0]}): add it to {where}")
    for dist in NOT_IMPORTED.get(area, set()):
        if _name(dist) not in have:
            missing.append(f"{dist}: add it to [{area}]")
    assert missing == []


def test_extras_name_only_used_distributions() -> None:
    # the other direction: an extra naming what nothing imports is stale
    for area in ("bench", "examples", "observability", "test"):
        used = {_name(DISTRIBUTION[m]) for m in third_party(area) if m in DISTRIBUTION}
        used |= {_name(d) for d in NOT_IMPORTED.get(area, set())}
        named = _extra(area) - {"argrpc-bench"}
        assert named - used == set(), area


def test_the_bench_extra_is_argrpc_bench() -> None:
    # the runtime distribution ships no benchmark: its bench extra is the tool's own
    # distribution, and the tests (which run argrpc-bench) need it too
    extras = _project()["optional-dependencies"]
    assert [_name(r) for r in extras["bench"]] == ["argrpc-bench"]
    assert "argrpc-bench" in {_name(r) for r in extras["test"]}
    assert _project(REPO_ROOT / "bench")["name"] == "argrpc-bench"


def test_distribution_map_matches_installed() -> None:
    # where a module is installed, the map must name a distribution that provides it
    installed = importlib.metadata.packages_distributions()
    checked = 0
    for mod, dist in DISTRIBUTION.items():
        if mod in installed:
            assert _name(dist) in {_name(d) for d in installed[mod]}, mod
            checked += 1
    assert checked >= 3  # grpc, google and pytest are always here
