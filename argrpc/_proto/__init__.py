"""Generated bootstrap messages (from protos/argrpc_bootstrap.proto).

`pip install .` generates `argrpc_bootstrap_pb2.py` here. In a source checkout where it
was not generated yet, or is older than the .proto (an edit since the last build), it is
generated on first import with grpc_tools (the same command setup.py runs), so tests work
straight from the tree.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["HostIdentity", "NegotiateRequest", "NegotiateResponse", "ShmOffer", "VerbsEndpoint",
           "PROTO_NAME"]

PROTO_NAME = "argrpc_bootstrap.proto"
_HERE = os.path.dirname(os.path.abspath(__file__))
_PROTOS_DIR = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "protos")


def _generate() -> None:
    source = os.path.join(_PROTOS_DIR, PROTO_NAME)
    if not os.path.exists(source):
        raise ImportError(
            f"argrpc/_proto/argrpc_bootstrap_pb2.py is missing and {source} does not exist: "
            "reinstall argrpc (`pip install .` generates it)")
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError(
            "argrpc/_proto/argrpc_bootstrap_pb2.py is missing; generate it with "
            f"`python -m grpc_tools.protoc -Iprotos --python_out=argrpc/_proto protos/{PROTO_NAME}` "
            f"(grpcio-tools is not installed: {e})") from e
    rc = protoc.main(["protoc", f"-I{_PROTOS_DIR}", f"--python_out={_HERE}", source])
    if rc != 0:
        raise ImportError(f"grpc_tools.protoc failed (exit {rc}) generating from {source}")


def _stale() -> bool:
    """True in a source checkout whose .proto changed after the module was generated."""
    generated = os.path.join(_HERE, "argrpc_bootstrap_pb2.py")
    source = os.path.join(_PROTOS_DIR, PROTO_NAME)
    try:
        return os.path.getmtime(source) > os.path.getmtime(generated)
    except OSError:  # installed package (no protos/) or not generated yet
        return False


def _load() -> ModuleType:
    if _stale():
        try:
            _generate()
        except ImportError:
            pass  # no grpc_tools here: use what was generated (the build regenerates it)
    try:
        return importlib.import_module(".argrpc_bootstrap_pb2", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.argrpc_bootstrap_pb2":
            raise
    _generate()
    importlib.invalidate_caches()
    return importlib.import_module(".argrpc_bootstrap_pb2", __name__)


_pb2 = _load()
HostIdentity = _pb2.HostIdentity
NegotiateRequest = _pb2.NegotiateRequest
NegotiateResponse = _pb2.NegotiateResponse
ShmOffer = _pb2.ShmOffer
VerbsEndpoint = _pb2.VerbsEndpoint
