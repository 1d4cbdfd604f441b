"""One version: argrpc/_version.py. The package attribute, both console scripts'
``--version`` and the build metadata (pyproject's dynamic version) all read it; argrpc-bench,
a distribution of its own, is released with argrpc and carries the same number."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import argrpc
from tests.support.procs import PACKAGE_ROOT, REPO_ROOT, child_env

VERSION_FILE = PACKAGE_ROOT / "argrpc" / "_version.py"


def _literal_version(path: Path = VERSION_FILE) -> str:
    """The version as setuptools reads it: the literal assigned in _version.py."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] \
                == ["__version__"]:
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"no literal __version__ in {path}")


def test_package_attribute_is_the_version_file() -> None:
    assert argrpc.__version__ == _literal_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", argrpc.__version__), argrpc.__version__


def test_pyproject_reads_the_version_file() -> None:
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"], "a static version would be a second source"
    assert "version" in meta["project"]["dynamic"]
    dynamic = meta["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "argrpc._version.__version__"}


def test_argrpc_bench_is_released_with_argrpc() -> None:
    bench = REPO_ROOT / "bench"
    assert _literal_version(bench / "argrpc_bench" / "_version.py") == _literal_version()
    meta = tomllib.loads((bench / "pyproject.toml").read_text())
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "argrpc_bench._version.__version__"}


@pytest.mark.parametrize("module, prog", [("argrpc", "argrpc"),
                                          ("argrpc_bench", "argrpc-bench")])
def test_cli_version(module: str, prog: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO_ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{prog} {_literal_version()}\n"
    assert out.stderr == ""
