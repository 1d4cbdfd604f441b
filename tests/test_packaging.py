"""What a wheel carries: every package under argrpc/ is listed for setuptools (one left
out is silently missing from the wheel), and the PEP 561 marker plus the engine's stub
are there and declared as package data. Run against the installed wheel
(scripts/test_installed.sh), the same checks read what the wheel put in site-packages."""
from __future__ import annotations

import tomllib
from typing import Any

from tests.support.procs import PACKAGE_ROOT, REPO_ROOT

ARGRPC = PACKAGE_ROOT / "argrpc"


def _setuptools() -> Any:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed() -> None:
    on_disk = {".".join(init.parent.relative_to(PACKAGE_ROOT).parts)
               for init in ARGRPC.rglob("__init__.py")}
    assert {"argrpc", "argrpc.aio"} <= on_disk
    assert sorted(_setuptools()["packages"]) == sorted(on_disk)


def test_the_runtime_ships_no_benchmark() -> None:
    # argrpc-bench is a distribution of its own (bench/): nothing of it in argrpc's wheel
    assert not (ARGRPC / "benchtool").exists()
    assert "argrpc-bench" not in tomllib.loads(
        (REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_no_module_outside_a_package() -> None:
    # a .py in a directory without __init__.py would not be in the wheel at all
    stray = [str(p.relative_to(PACKAGE_ROOT)) for p in ARGRPC.rglob("*.py")
             if not (p.parent / "__init__.py").exists()]
    assert stray == []


def test_typing_files_ship() -> None:
    assert (ARGRPC / "py.typed").is_file()
    assert (ARGRPC / "_core.pyi").is_file()
    assert set(_setuptools()["package-data"]["argrpc"]) >= {"py.typed", "_core.pyi"}
