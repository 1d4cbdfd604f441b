"""Generate the test proto's Python stubs with grpcio-tools at test time."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

PROTO_DIR = Path(__file__).resolve().parent.parent / "protos"


def generate(out_dir: str | os.PathLike[str]) -> Path:
    import grpc_tools
    from grpc_tools import protoc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO_DIR / "echo.proto"),
    ])
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}")
    return out


def load(out_dir: str | os.PathLike[str]) -> tuple[ModuleType, ModuleType]:
    """Import (echo_pb2, echo_pb2_grpc) from a directory made by `generate`."""
    path = str(out_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("echo_pb2"), importlib.import_module("echo_pb2_grpc")
