"""What argrpc's metrics (``argrpc.observability``) need from the channels and servers.

Nothing here imports OpenTelemetry, and while no plugin is registered the facade's only
costs are a set insertion per registered method and a weak reference per channel, both
paid once at set-up, never per call. Per-call numbers come from the engine's call
records (``_core.set_call_stats``), which are off until a plugin turns them on.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any, Callable, Optional, Protocol

import grpc

__all__ = ["Sink", "channels", "fallback", "register_client_method", "register_server_method",
           "registered_client_methods", "registered_server_methods", "set_sink", "sink",
           "timed_grpc_call", "track_channel", "watch_aio_call"]


class Sink(Protocol):
    """The registered plugin's side of the hooks."""

    def fallback(self, kind: str) -> None: ...

    def grpc_call_ended(self, method: str, target: str, code: grpc.StatusCode,
                        duration: float) -> None: ...


_lock = threading.Lock()
_sink: Optional[Sink] = None
# Method paths without the leading "/" ("pkg.Service/Method"), as grpc's plugin labels
# them: a client's come from generated stubs (`_registered_method=True`), a server's from
# add_registered_method_handlers. Any other method is labelled "other", as grpc does.
registered_client_methods: set[str] = set()
registered_server_methods: set[str] = set()
_channels: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_client_method(method: str | bytes, registered: Optional[bool]) -> None:
    if registered:
        name = method.decode("ascii") if isinstance(method, bytes) else method
        registered_client_methods.add(name.lstrip("/"))


def register_server_method(service: str, method: str) -> None:
    registered_server_methods.add(f"{service}/{method}")


def track_channel(channel: Any) -> None:
    """A channel (threaded or asyncio) whose transport the metrics may report."""
    with _lock:
        _channels.add(channel)


def channels() -> list[Any]:
    with _lock:
        return list(_channels)


def set_sink(new: Optional[Sink]) -> None:
    global _sink
    _sink = new


def sink() -> Optional[Sink]:
    return _sink


def fallback(kind: str) -> None:
    """A channel settled on plain gRPC for the reason `kind`."""
    current = _sink
    if current is not None:
        current.fallback(kind)


# Calls carried by plain gRPC: grpc's own plugin records their attempts, but grpc-python
# does not record grpc.client.call.duration; these time it around grpc's call.

def timed_grpc_call(current: Sink, method: str, target: str, fn: Callable[..., Any],
                    *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a grpc multicallable, blocking or not), timed until the
    call ends."""
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        current.grpc_call_ended(method, target, code, time.perf_counter() - start)
        raise
    if isinstance(result, grpc.Future) and isinstance(result, grpc.Call):
        def ended(call: Any) -> None:
            current.grpc_call_ended(method, target, call.code(), time.perf_counter() - start)
        result.add_done_callback(ended)
    else:  # a blocking call's response (or with_call's pair): it ended well
        current.grpc_call_ended(method, target, grpc.StatusCode.OK, time.perf_counter() - start)
    return result


def watch_aio_call(current: Sink, method: str, target: str, call: Any) -> None:
    """Time a ``grpc.aio`` call until it ends."""
    start = time.perf_counter()

    async def record(done: Any) -> None:
        current.grpc_call_ended(method, target, await done.code(), time.perf_counter() - start)

    def ended(done: Any) -> None:
        asyncio.ensure_future(record(done))

    call.add_done_callback(ended)
