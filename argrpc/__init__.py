"""argrpc: drop-in shared-memory/RDMA accelerated transport for Python gRPC services.

Swap ``grpc.insecure_channel``/``grpc.secure_channel`` for ``argrpc.insecure_channel``/
``argrpc.secure_channel`` and ``grpc.server`` for ``argrpc.server``; generated stubs and
servicers stay unchanged. Everything else (status codes, ``grpc.RpcError``,
interceptors...) is still imported from ``grpc``.
"""

from . import _grpc_originals  # noqa: F401 - first: grpc's constructors before anyone replaces them
from . import _malloc
from ._channel import Channel, insecure_channel, secure_channel
from ._server import server
from ._version import __version__

_malloc.cap_arenas()  # before the application starts its threads: see _malloc

__all__ = ["Channel", "__version__", "insecure_channel", "secure_channel", "server"]


def __getattr__(name: str) -> object:
    # `argrpc.aio` after a bare `import argrpc`, as `grpc.aio` after `import grpc`; loaded
    # on first use, so a threaded service does not pay for the asyncio front end.
    if name == "aio":
        import importlib
        return importlib.import_module(".aio", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
