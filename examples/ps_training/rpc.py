"""The generated stubs of ps_service.proto, and numpy <-> Tensor conversion.

The stubs are generated with grpcio-tools on first import (and again when the .proto is
newer), into a private directory first and then renamed into place, so the several tasks
a launcher starts at once never import a half-written module.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
from types import ModuleType
from typing import Iterable

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_PROTO = "ps_service.proto"
_MODULES = ("ps_service_pb2.py", "ps_service_pb2_grpc.py")


def _stale() -> bool:
    src = os.path.getmtime(os.path.join(_HERE, _PROTO))
    try:
        return any(os.path.getmtime(os.path.join(_HERE, m)) < src for m in _MODULES)
    except OSError:
        return True


def _generate() -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory(dir=_HERE, prefix=".gen-") as tmp:
        rc = protoc.main(["protoc", f"-I{_HERE}", f"-I{well_known}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", os.path.join(_HERE, _PROTO)])
        if rc != 0:
            raise ImportError(f"grpc_tools.protoc failed (exit {rc}) on {_PROTO}")
        for m in _MODULES:
            os.replace(os.path.join(tmp, m), os.path.join(_HERE, m))


def _load() -> tuple[ModuleType, ModuleType]:
    if _stale():
        _generate()
    # The generated _grpc module imports "ps_service_pb2" as a top-level name.
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    try:
        return importlib.import_module("ps_service_pb2"), importlib.import_module("ps_service_pb2_grpc")
    except Exception as e:
        # Written by a newer protoc than the installed protobuf accepts (its gencode
        # check), e.g. after protobuf was downgraded: write it again with this one's.
        if type(e).__name__ != "VersionError":
            raise
    for name in ("ps_service_pb2", "ps_service_pb2_grpc"):
        sys.modules.pop(name, None)
    _generate()
    importlib.invalidate_caches()
    return importlib.import_module("ps_service_pb2"), importlib.import_module("ps_service_pb2_grpc")


pb, pb_grpc = _load()


def to_tensor(name: str, array: np.ndarray) -> "pb.Tensor":
    a = np.ascontiguousarray(array, dtype=np.float32)
    return pb.Tensor(name=name, shape=a.shape, data=a.tobytes())


def from_tensor(t: "pb.Tensor") -> np.ndarray:
    # frombuffer is read-only and shares the message's bytes; copy so callers may update it.
    return np.frombuffer(t.data, dtype=np.float32).reshape(tuple(t.shape)).copy()


def to_tensors(arrays: dict[str, np.ndarray], names: Iterable[str]) -> list["pb.Tensor"]:
    return [to_tensor(n, arrays[n]) for n in names]
