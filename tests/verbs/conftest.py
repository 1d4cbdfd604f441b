"""Fixtures for the verbs tests: each one skips with the reason when what it needs is
missing (pyverbs-tests style), so on a host without RDMA the group reports why, and in
the Soft-RoCE guest (`softroce/guest.sh python3 -m pytest -q
tests/verbs`) it runs for real."""
from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

GUEST_HINT = ("run it in the Soft-RoCE guest: softroce/guest.sh "
              "python3 -m pytest -q tests/verbs")
_DEBIAN_DIST = "/usr/lib/python3/dist-packages"


def _import_pyverbs() -> tuple[ModuleType | None, str]:
    # Debian's python3-pyverbs lives in the system dist-packages; appended (not
    # prepended) so it cannot shadow this interpreter's own packages.
    if os.path.isdir(_DEBIAN_DIST) and _DEBIAN_DIST not in sys.path:
        sys.path.append(_DEBIAN_DIST)
    try:
        import pyverbs.device  # noqa: F401
        import pyverbs.enums  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken build: skip with it
        return None, (f"pyverbs is not importable ({type(e).__name__}: {e}); install Debian's "
                      "python3-pyverbs (softroce/prepare.sh does)")
    import pyverbs
    return pyverbs, ""


@pytest.fixture(scope="session")
def pyverbs() -> ModuleType:
    mod, why = _import_pyverbs()
    if mod is None:
        pytest.skip(why)
    return mod


@pytest.fixture(scope="session")
def pyverbs_devices(pyverbs: ModuleType) -> list[Any]:
    """pyverbs' device list; skips when this host has no RDMA device."""
    import pyverbs.device as d

    try:
        devices = d.get_device_list()
    except Exception as e:  # noqa: BLE001 - PyverbsRDMAError on a host without RDMA
        pytest.skip(f"no RDMA device here (pyverbs: {e}); {GUEST_HINT}")
    if not devices:
        pytest.skip(f"no RDMA device here (pyverbs lists none); {GUEST_HINT}")
    return devices


@pytest.fixture(scope="session")
def core_verbs() -> ModuleType:
    """argrpc._core with its verbs functions and libibverbs loaded; else skip with why."""
    try:
        from argrpc import _core
    except ImportError as e:
        pytest.skip(f"argrpc._core is not importable: {e}")
    if not hasattr(_core, "verbs_devices"):
        pytest.skip("this build of argrpc._core has no verbs fabric")
    status = _core.verbs_status()
    if status:
        pytest.skip(f"libibverbs is not loadable: {status}")
    return _core


@pytest.fixture(scope="session")
def rdma(core_verbs: ModuleType) -> SimpleNamespace:
    """A usable device as argrpc sees it (default selection), else skip with the reason."""
    devices = core_verbs.verbs_devices()
    if not devices:
        pytest.skip(f"no RDMA device here (argrpc._core.verbs_devices() is empty); {GUEST_HINT}")
    try:
        sel = core_verbs.verbs_select(None, None, None)
    except Exception as e:  # noqa: BLE001 - CoreError: no active port / usable GID
        pytest.skip(f"no usable RDMA port: {e}")
    return SimpleNamespace(core=core_verbs, devices=devices, select=sel)
