"""OpenTelemetry metrics for argrpc, registered as grpc's own plugin is.

    import argrpc.observability
    plugin = argrpc.observability.OpenTelemetryPlugin(meter_provider=provider)
    plugin.register_global()          # or: with plugin: ...

records grpc's per-call instruments (``grpc.client.attempt.*``, ``grpc.client.call.duration``,
``grpc.server.call.*``: grpc's names, units, descriptions and labels, in grpc's meter) for
every call argrpc's channels and servers carry, on every transport, and argrpc's own
instruments (``argrpc.*``) labelled by transport. Needs ``opentelemetry-api`` (the
``argrpc[observability]`` extra); calls carried by plain gRPC are recorded by grpc's own
plugin, which this one registers too when ``grpcio-observability`` is installed.
"""

from ._plugin import OpenTelemetryPlugin, OpenTelemetryPluginOption

__all__ = ["OpenTelemetryPlugin", "OpenTelemetryPluginOption"]
