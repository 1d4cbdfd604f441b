"""The send limit of an asyncio channel (`grpc.max_send_message_length`, and a method's
`maxRequestMessageBytes` from the service config) on the fast path, every arity: what a
call over the limit raises, where, and how it ends, recorded on grpc.aio and on
argrpc.aio; the records must be equal."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from tests.support import inproc

HANG_S = 30
LIMITS = {
    "option": [("grpc.max_send_message_length", 1000)],
    "config": [("grpc.service_config", json.dumps({"methodConfig": [
        {"name": [{"service": "s"}], "maxRequestMessageBytes": 1000}]}))],
}


async def _total(request_iterator: Any, context: Any) -> bytes:
    n = 0
    async for request in request_iterator:
        n += len(request)
    return str(n).encode()


async def _total_stream(request_iterator: Any, context: Any) -> Any:
    yield await _total(request_iterator, context)


async def _echo(request: bytes, context: Any) -> bytes:
    return request


async def _echo_stream(request: bytes, context: Any) -> Any:
    yield request


HANDLERS = grpc.method_handlers_generic_handler("s", {
    "UU": grpc.unary_unary_rpc_method_handler(_echo),
    "US": grpc.unary_stream_rpc_method_handler(_echo_stream),
    "SU": grpc.stream_unary_rpc_method_handler(_total),
    "SS": grpc.stream_stream_rpc_method_handler(_total_stream)})


def _end(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return type(e).__name__


async def _written(out: list[str], label: str, call: Any, request: bytes) -> None:
    """A call whose requests go by write(): where the one over the limit fails, and how
    the call ends."""
    try:
        await call.write(b"x")
        await call.write(request)
        await call.done_writing()
        out.append(f"{label} write: ok")
    except BaseException as e:  # noqa: BLE001 - recorded
        out.append(f"{label} write: {_end(e)}")
    try:
        got = await call if isinstance(call, grpc.aio.StreamUnaryCall) else \
            [r async for r in call]
        out.append(f"{label}: {got!r}")
    except BaseException as e:  # noqa: BLE001
        out.append(f"{label}: {_end(e)}")
    out.append(f"{label} code: {(await call.code()).name}")


async def _record(stack: str, options: Any) -> list[str]:
    out = []
    async with inproc.asyncio_pair(stack, HANDLERS, channel_options=options) as ch:
        for size in (10, 1200):
            request = b"x" * size
            try:
                out.append(f"UU {size}: {len(await ch.unary_unary('/s/UU')(request, timeout=HANG_S))}")
            except BaseException as e:  # noqa: BLE001 - recorded
                out.append(f"UU {size}: {_end(e)}")
            try:
                got = [len(r) async for r in ch.unary_stream("/s/US")(request, timeout=HANG_S)]
                out.append(f"US {size}: {got}")
            except BaseException as e:  # noqa: BLE001
                out.append(f"US {size}: {_end(e)}")
            try:
                got = await ch.stream_unary("/s/SU")(iter([b"x", request]), timeout=HANG_S)
                out.append(f"SU {size}: {got!r}")
            except BaseException as e:  # noqa: BLE001
                out.append(f"SU {size}: {_end(e)}")
            try:
                got = [r async for r in ch.stream_stream("/s/SS")(iter([b"x", request]),
                                                                  timeout=HANG_S)]
                out.append(f"SS iterator {size}: {got}")
            except BaseException as e:  # noqa: BLE001
                out.append(f"SS iterator {size}: {_end(e)}")
            await _written(out, f"SU {size}", ch.stream_unary("/s/SU")(timeout=HANG_S), request)
            await _written(out, f"SS {size}", ch.stream_stream("/s/SS")(timeout=HANG_S), request)
        if stack == "argrpc":
            assert inproc.transport_of(ch) == "shm"
    return out


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_send_limit_ends_calls_as_grpc_aio_does(limit: str) -> None:
    grpc_record = asyncio.run(_record("grpc", LIMITS[limit]))
    argrpc_record = asyncio.run(_record("argrpc", LIMITS[limit]))
    assert argrpc_record == grpc_record
    assert any("Sent message larger than max (1200 vs. 1000)" in r for r in grpc_record)
