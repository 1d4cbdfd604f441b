"""argrpc's own instruments, labelled by transport.

The engine keeps its counters always (relaxed atomics: connections, bytes by path, pool,
keepalive failures); these observable instruments read them when a reader collects, so
they cost nothing between collections. Fallbacks are counted as channels settle, through
the facade's hook (``argrpc._metrics_hooks``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from .. import _metrics_hooks
from .._engine import peek_engine
from .._version import __version__

__all__ = ["TransportInstruments"]

TRANSPORT, PATH, DIRECTION, REASON = "argrpc.transport", "argrpc.path", "argrpc.direction", \
    "argrpc.reason"
GRPC_TRANSPORT = "grpc"
_SENT, _RECEIVED = "_bytes_sent", "_bytes_received"


class TransportInstruments:
    def __init__(self, provider: MeterProvider, before_collect: Callable[[], None]) -> None:
        self._before_collect = before_collect
        self.active = True
        meter = provider.get_meter("argrpc", __version__)
        self.fallbacks = meter.create_counter(
            "argrpc.fallbacks", unit="{channel}",
            description="Channels that settled on plain gRPC, by the reason's class")
        self.dropped = meter.create_counter(
            "argrpc.metrics.dropped_records", unit="{record}",
            description="Call records the engine dropped because nobody took them in time "
                        "(those calls are missing from the grpc.* instruments)")
        meter.create_observable_up_down_counter(
            "argrpc.connections.open", [self._connections], unit="{connection}",
            description="Fast-path connections open, by transport; grpc: argrpc channels "
                        "whose calls go over plain gRPC")
        meter.create_observable_counter(
            "argrpc.transport.bytes", [self._bytes], unit="By",
            description="Message bytes moved by the fast path, by transport, path (eager: "
                        "inline in batches; rendezvous: pulled in chunks into the pool; "
                        "zero_copy: handed over as views without a copy) and direction")
        meter.create_observable_gauge(
            "argrpc.pool.in_use", [self._pool("in_use")], unit="By",
            description="Bytes of the pinned buffer pool in use (TF_RDMA_BUF_SIZE)")
        meter.create_observable_gauge(
            "argrpc.pool.capacity", [self._pool("capacity")], unit="By",
            description="Bytes of the pinned buffer pool")
        meter.create_observable_counter(
            "argrpc.pool.waits", [self._pool("waits")], unit="{wait}",
            description="Allocations that waited for room in the pool (back-pressure)")
        meter.create_observable_counter(
            "argrpc.keepalive.failures", [self._keepalive], unit="{connection}",
            description="Connections failed because the peer left a keepalive PING "
                        "unanswered")

    # ------------------------------------------------------------------ sync
    def fallback(self, kind: str) -> None:
        if self.active:
            self.fallbacks.add(1, {REASON: kind})

    def records_dropped(self, n: int) -> None:
        if self.active:
            self.dropped.add(n)

    # ------------------------------------------------------------------ observed
    def _stats(self) -> Optional[dict[str, dict[str, int]]]:
        engine = peek_engine() if self.active else None
        if engine is None:
            return None
        stats: dict[str, dict[str, int]] = engine.transport_stats()
        return stats

    def _connections(self, options: CallbackOptions) -> Iterable[Observation]:
        if not self.active:
            return []
        # The first callback of a collection: calls that ended before it are recorded in
        # this collection, not the next one.
        self._before_collect()
        stats = self._stats() or {}
        out = [Observation(s.get("connections_open", 0), {TRANSPORT: t})
               for t, s in sorted(stats.items())]
        on_grpc = sum(1 for channel in _metrics_hooks.channels() if channel._on_grpc)
        out.append(Observation(on_grpc, {TRANSPORT: GRPC_TRANSPORT}))
        return out

    def _bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for transport, stats in sorted((self._stats() or {}).items()):
            for key, value in sorted(stats.items()):
                for suffix, direction in ((_SENT, "sent"), (_RECEIVED, "received")):
                    if key.endswith(suffix):
                        out.append(Observation(value, {TRANSPORT: transport,
                                                       PATH: key[:-len(suffix)],
                                                       DIRECTION: direction}))
        return out

    def _keepalive(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.get("keepalive_failures", 0), {TRANSPORT: t})
                for t, s in sorted((self._stats() or {}).items())]

    def _pool(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            engine = peek_engine() if self.active else None
            if engine is None:
                return []
            value: Any = engine.pool_stats().get(key, 0)
            return [Observation(int(value))]
        return observe
