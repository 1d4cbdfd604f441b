"""A server and a channel of one stack in this process, for side-by-side checks against
grpc: the same scenario runs on grpc (or grpc.aio) and on argrpc (or argrpc.aio), and
argrpc's channel takes shared memory to its own server."""
from __future__ import annotations

import contextlib
from concurrent import futures
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

import grpc


def stack_module(stack: str) -> Any:
    """grpc or argrpc: the module whose factories the scenario uses."""
    if stack == "grpc":
        return grpc
    import argrpc
    return argrpc


def transport_of(channel: Any) -> str:
    """What carries the channel's calls: argrpc's channel says, grpc's is gRPC."""
    return str(getattr(channel, "transport", "grpc"))


def _listen(server: Any, address: str, credentials: Any) -> int:
    if credentials is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, credentials))


def _target(address: str, port: int) -> str:
    return address if address.startswith("unix:") else f"{address.rsplit(':', 1)[0]}:{port}"


def _channel(factories: Any, target: str, credentials: Any, options: Sequence[Any],
             compression: Any) -> Any:
    if credentials is None:
        return factories.insecure_channel(target, options=options, compression=compression)
    return factories.secure_channel(target, credentials, options=options,
                                    compression=compression)


@contextlib.contextmanager
def threaded(stack: str, handlers: Any, *, address: str = "127.0.0.1:0",
             server_options: Sequence[Any] = (), channel_options: Sequence[Any] = (),
             server_credentials: Any = None, channel_credentials: Any = None,
             compression: Optional[grpc.Compression] = None,
             registered: Optional[tuple[str, dict[str, Any]]] = None) -> Iterator[Any]:
    """A threaded server serving `handlers` (a generic handler, or None) and the methods
    of `registered` (service name, method handlers), and a channel to it."""
    mod = stack_module(stack)
    server = mod.server(futures.ThreadPoolExecutor(2), options=list(server_options))
    if handlers is not None:
        server.add_generic_rpc_handlers((handlers,))
    if registered is not None:
        server.add_registered_method_handlers(*registered)
    port = _listen(server, address, server_credentials)
    server.start()
    channel = _channel(mod, _target(address, port), channel_credentials, list(channel_options),
                       compression)
    try:
        yield channel
    finally:
        channel.close()
        server.stop(None)


@contextlib.asynccontextmanager
async def asyncio_server(stack: str, handlers: Any, *, address: str = "127.0.0.1:0",
                         server_options: Sequence[Any] = (),
                         server_credentials: Any = None) -> AsyncIterator[str]:
    """An asyncio server (grpc.aio or argrpc.aio) serving `handlers`; yields its target."""
    server = stack_module(stack).aio.server(options=list(server_options))
    server.add_generic_rpc_handlers((handlers,))
    port = _listen(server, address, server_credentials)
    await server.start()
    try:
        yield _target(address, port)
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def asyncio_pair(stack: str, handlers: Any, *, address: str = "127.0.0.1:0",
                       server_options: Sequence[Any] = (), channel_options: Sequence[Any] = (),
                       server_credentials: Any = None, channel_credentials: Any = None,
                       compression: Optional[grpc.Compression] = None) -> AsyncIterator[Any]:
    """The threaded pair's twin with the asyncio API."""
    async with asyncio_server(stack, handlers, address=address, server_options=server_options,
                              server_credentials=server_credentials) as target:
        channel = _channel(stack_module(stack).aio, target, channel_credentials,
                           list(channel_options), compression)
        try:
            yield channel
        finally:
            await channel.close()
