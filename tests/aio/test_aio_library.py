"""An existing asyncio gRPC server library, unchanged, on argrpc.aio.

fastgrpc2 (a FastAPI-like framework: pydantic models in and out, dependency injection,
health, interceptors) builds its server itself with ``grpc.aio.server(options=...,
compression=..., interceptors=..., maximum_concurrent_rpcs=...)`` and its clients with
``grpc.aio.insecure_channel``. Swapping just those calls for argrpc.aio's (what a user
does with ``grpc.aio.server = argrpc.aio.server`` before the library starts its app)
must leave everything it does working: its own client then talks to it over shared
memory, and a plain grpc.aio client (the library's client before the swap) over gRPC,
with the same answers, statuses and details.
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Any, AsyncIterator

import grpc
import pytest

import argrpc.aio

fastgrpc2 = pytest.importorskip("fastgrpc2", reason="fastgrpc2 is not installed "
                                "(scripts/setup.sh installs it)")
from pydantic import BaseModel  # noqa: E402 - fastgrpc2 brings pydantic
from fastgrpc2.testing import TestClient  # noqa: E402

MiB = 1 << 20


class Blob(BaseModel):
    name: str
    data: bytes


class Digest(BaseModel):
    name: str
    size: int
    sha256: str


class Count(BaseModel):
    n: int
    size: int = 0


def make_app() -> Any:
    store = fastgrpc2.GrpcService("Store", package="argrpc.test")

    @store.unary("Put")
    async def put(req: Blob, ctx: fastgrpc2.Context) -> Digest:
        if not req.name:  # a status with rich details (binary trailing metadata)
            raise fastgrpc2.GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "a blob needs a name", [
                fastgrpc2.BadRequest(field_violations=[
                    fastgrpc2.FieldViolation(field="name", description="empty")])])
        return Digest(name=req.name, size=len(req.data), sha256=hashlib.sha256(req.data).hexdigest())

    @store.unary_stream("Chunks")
    async def chunks(req: Count, ctx: fastgrpc2.Context) -> AsyncIterator[Blob]:
        for i in range(req.n):
            yield Blob(name=str(i), data=bytes([i % 256]) * req.size)

    @store.stream_stream("Echo")
    async def echo(reqs: AsyncIterator[Blob], ctx: fastgrpc2.Context) -> AsyncIterator[Digest]:
        async for b in reqs:
            yield Digest(name=b.name, size=len(b.data), sha256=hashlib.sha256(b.data).hexdigest())

    app = fastgrpc2.GrpcApp(tls=fastgrpc2.Insecure(), max_send_bytes=256 * MiB,
                            max_recv_bytes=256 * MiB)
    app.include_service(store)
    return app


class StoreClient(fastgrpc2.GrpcClient):
    package = "argrpc.test"
    service = "Store"
    put = fastgrpc2.GrpcClient.unary("Put", Blob, Digest)
    chunks = fastgrpc2.GrpcClient.unary_stream("Chunks", Count, Blob)
    echo = fastgrpc2.GrpcClient.stream_stream("Echo", Blob, Digest)


async def _exercise(client: Any) -> list:
    """What the library's own client sees; comparable across the two runs."""
    out: list = []
    for size in (0, 100, 3 * MiB):
        data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        d = await client.put(Blob(name=f"b{size}", data=data), timeout=30)
        out.append((d.name, d.size, d.sha256 == hashlib.sha256(data).hexdigest()))
    try:
        await client.put(Blob(name="", data=b"z"), timeout=30)
        out.append("no error")
    except fastgrpc2.GrpcError as e:
        out.append((e.code, e.message, [d.model_dump() for d in e.details]))
    out.append([(b.name, len(b.data)) async for b in client.chunks(Count(n=3, size=70_000),
                                                                    timeout=30)])

    async def blobs() -> AsyncIterator[Blob]:
        for i in range(4):
            yield Blob(name=f"e{i}", data=b"y" * (i * 40_000))

    out.append([(d.name, d.size) async for d in client.echo(blobs(), timeout=30)])
    return out


async def _run(swap: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, str]:
    with monkeypatch.context() as m:
        if swap:
            m.setattr(grpc.aio, "server", argrpc.aio.server)
            m.setattr(grpc.aio, "insecure_channel", argrpc.aio.insecure_channel)
        app = make_app()
        async with TestClient(app) as tc:
            client = tc.client(StoreClient)
            seen = await _exercise(client)
            channel = tc.channel._channel  # type: ignore[union-attr]
            transport = getattr(channel, "transport", "grpc.aio")
            server_kind = type(app._server).__module__
    return seen + [server_kind], transport


def test_fastgrpc2_runs_unchanged_on_argrpc_aio(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, ref_transport = asyncio.run(_run(False, monkeypatch))
    swapped, transport = asyncio.run(_run(True, monkeypatch))
    assert ref_transport == "grpc.aio"
    assert transport == "shm", "the library's own client did not reach the fast path"
    assert reference[-1].startswith("grpc.aio") and swapped[-1] == "argrpc.aio._server"
    assert swapped[:-1] == reference[:-1]
    assert reference[3] == (grpc.StatusCode.INVALID_ARGUMENT, "a blob needs a name", [
        {"field_violations": [{"field": "name", "description": "empty"}]}])


def test_plain_grpc_aio_client_against_the_swapped_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's server on argrpc.aio, its client left on grpc.aio: plain gRPC on the
    server's port, the same answers."""
    async def body() -> list:
        with monkeypatch.context() as m:
            m.setattr(grpc.aio, "server", argrpc.aio.server)
            app = make_app()
            async with TestClient(app) as tc:
                assert isinstance(app._server, argrpc.aio.Server)
                assert not hasattr(tc.channel._channel, "transport")  # type: ignore[union-attr]
                return await _exercise(tc.client(StoreClient))

    reference, _ = asyncio.run(_run(False, monkeypatch))
    assert asyncio.run(body()) == reference[:-1]
