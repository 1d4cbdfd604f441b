"""``OpenTelemetryPlugin``: grpc_observability's plugin, for every transport argrpc uses."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Optional

import grpc
from opentelemetry.metrics import MeterProvider

from .. import _metrics_hooks
from .._engine import EngineUnavailable, core_module

__all__ = ["OpenTelemetryPlugin", "OpenTelemetryPluginOption"]

_LOGGER = logging.getLogger("argrpc")

try:
    from grpc_observability import OpenTelemetryPlugin as _GrpcPlugin
    from grpc_observability._open_telemetry_plugin import OpenTelemetryPluginOption
except ImportError:  # calls carried by plain gRPC then go unrecorded (said at register)
    _GrpcPlugin = None

    class OpenTelemetryPluginOption:  # type: ignore[no-redef]
        """grpc_observability's plugin option (label injectors for gRPC-carried calls)."""

_lock = threading.Lock()
_registered: Optional["_Running"] = None


class _Running:
    """What one registered plugin runs (the facade's metrics sink); stopped by
    deregister_global."""

    def __init__(self, plugin: "OpenTelemetryPlugin") -> None:
        self.recorder: Any = None
        self.instruments: Any = None
        self.grpc_plugin: Any = None
        provider = plugin.meter_provider
        if provider is not None:
            self._start_fast_path(plugin, provider)
        self._start_grpc(plugin)

    def _start_fast_path(self, plugin: "OpenTelemetryPlugin", provider: MeterProvider) -> None:
        from ._call_metrics import CallRecorder
        from ._transport import TransportInstruments

        try:
            core = core_module()
        except EngineUnavailable:
            core = None  # every call goes over plain gRPC: grpc's plugin records them
        self.recorder = CallRecorder(provider, core, plugin.target_attribute_filter,
                                     plugin.generic_method_attribute_filter,
                                     _metrics_hooks.registered_client_methods,
                                     _metrics_hooks.registered_server_methods)
        self.instruments = TransportInstruments(provider, self.recorder.drain)
        self.recorder.on_dropped = self.instruments.records_dropped
        self.recorder.start()
        _metrics_hooks.set_sink(self)

    def _start_grpc(self, plugin: "OpenTelemetryPlugin") -> None:
        if _GrpcPlugin is None:
            _LOGGER.warning("argrpc: calls carried by plain gRPC are not recorded: "
                            "grpcio-observability is not installed")
            return
        grpc_plugin = _GrpcPlugin(
            plugin_options=plugin.plugin_options, meter_provider=plugin.meter_provider,
            target_attribute_filter=plugin.target_attribute_filter,
            generic_method_attribute_filter=plugin.generic_method_attribute_filter)
        try:
            grpc_plugin.register_global()
        except RuntimeError as e:  # the application registered grpc's own already
            _LOGGER.info("argrpc: grpc's own plugin stays as registered (%s)", e)
            return
        self.grpc_plugin = grpc_plugin

    # -- the facade's hooks (argrpc._metrics_hooks.Sink)
    def fallback(self, kind: str) -> None:
        self.instruments.fallback(kind)

    def grpc_call_ended(self, method: str, target: str, code: grpc.StatusCode,
                        duration: float) -> None:
        self.recorder.grpc_call_ended(method, target, code, duration)

    def stop(self) -> None:
        _metrics_hooks.set_sink(None)
        if self.instruments is not None:
            self.instruments.active = False
        if self.recorder is not None:
            self.recorder.stop()
        if self.grpc_plugin is not None:
            self.grpc_plugin.deregister_global()


class OpenTelemetryPlugin:
    """Records grpc's per-call metrics and argrpc's own for argrpc's channels and servers.

    The same constructor as ``grpc_observability.OpenTelemetryPlugin``; register it with
    ``register_global()`` or as a context manager. Calls on the fast path (shared memory,
    RDMA verbs) are recorded from the engine; calls carried by plain gRPC (a fallback, a
    plain-gRPC peer) by grpc's own plugin, which this registers with the same options
    when ``grpcio-observability`` is installed.
    """

    def __init__(self, *, plugin_options: Optional[Iterable[OpenTelemetryPluginOption]] = None,
                 meter_provider: Optional[MeterProvider] = None,
                 target_attribute_filter: Optional[Callable[[str], bool]] = None,
                 generic_method_attribute_filter: Optional[Callable[[str], bool]] = None
                 ) -> None:
        self.plugin_options = list(plugin_options or [])
        self.meter_provider = meter_provider
        self.target_attribute_filter: Callable[[str], bool] = (
            target_attribute_filter or (lambda _target: True))
        self.generic_method_attribute_filter: Callable[[str], bool] = (
            generic_method_attribute_filter or (lambda _method: False))

    def register_global(self) -> None:
        """Start recording for every channel and server of this process.

        Raises:
            RuntimeError: If a global plugin was already registered.
        """
        global _registered
        with _lock:
            if _registered is not None:
                raise RuntimeError("An argrpc OpenTelemetry plugin was already registered")
            _registered = _Running(self)

    def deregister_global(self) -> None:
        """Stop recording; what ended before this is recorded.

        Raises:
            RuntimeError: If no global plugin was registered.
        """
        global _registered
        with _lock:
            if _registered is None:
                raise RuntimeError("No argrpc OpenTelemetry plugin is registered")
            running, _registered = _registered, None
        running.stop()

    def __enter__(self) -> "OpenTelemetryPlugin":
        self.register_global()
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.deregister_global()
