"""What a failure of the user's code leaves in the logs, side by side with grpc: the same
logger (grpc's own names), level and words, on both APIs; and nothing printed by a process
that never configured logging, as with grpc (its package logger has a NullHandler)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from typing import Any, Awaitable, Callable

import grpc
import pytest

from tests.support import inproc


def _boom(*args: Any) -> Any:
    raise ValueError("boom")


def _failing_responses(request: bytes, context: Any) -> Any:
    yield b"x"
    raise ValueError("boom")


def _failing_requests() -> Any:
    yield b"x"
    raise ValueError("boom")


def _echo(request: Any, context: Any = None) -> Any:
    return request


def _with_failing_callback(request: bytes, context: Any) -> bytes:
    context.add_callback(_boom)
    return request


THREADED = grpc.method_handlers_generic_handler("t", {
    "raise": grpc.unary_unary_rpc_method_handler(_boom),
    "iter": grpc.unary_stream_rpc_method_handler(_failing_responses),
    "deser": grpc.unary_unary_rpc_method_handler(_echo, request_deserializer=_boom),
    "ser": grpc.unary_unary_rpc_method_handler(_echo, response_serializer=_boom),
    "cb": grpc.unary_unary_rpc_method_handler(_with_failing_callback),
    "echo": grpc.unary_unary_rpc_method_handler(_echo),
    "cs": grpc.stream_unary_rpc_method_handler(lambda it, c: b"".join(it))})

# grpc 1.85's answer for each failure: (logger, level, how the message begins)
THREADED_LOGS = {
    "handler raises": ("grpc._server", "ERROR", "Exception calling application: boom"),
    "response iterator raises": ("grpc._server", "ERROR", "Exception iterating responses: boom"),
    "request deserializer raises": ("grpc._common", "ERROR", "Exception deserializing message!"),
    "response serializer raises": ("grpc._common", "ERROR", "Exception serializing message!"),
    "context callback raises": ("grpc._server", "ERROR", "Exception calling callback!"),
    "request iterator raises": ("grpc._channel", "ERROR", "Exception iterating requests!"),
    "client serializer raises": ("grpc._common", "ERROR", "Exception serializing message!"),
    "client deserializer raises": ("grpc._common", "ERROR", "Exception deserializing message!"),
}


def _threaded_calls(channel: Any) -> dict[str, Callable[[], Any]]:
    return {
        "handler raises": lambda: channel.unary_unary("/t/raise")(b"", timeout=20),
        "response iterator raises": lambda: list(channel.unary_stream("/t/iter")(b"", timeout=20)),
        "request deserializer raises": lambda: channel.unary_unary("/t/deser")(b"", timeout=20),
        "response serializer raises": lambda: channel.unary_unary("/t/ser")(b"", timeout=20),
        "context callback raises": lambda: channel.unary_unary("/t/cb")(b"", timeout=20),
        "request iterator raises": lambda: channel.stream_unary("/t/cs")(_failing_requests(),
                                                                          timeout=20),
        "client serializer raises": lambda: channel.unary_unary(
            "/t/echo", request_serializer=_boom)(b"", timeout=20),
        "client deserializer raises": lambda: channel.unary_unary(
            "/t/echo", response_deserializer=_boom)(b"", timeout=20),
    }


def _seen(caplog: pytest.LogCaptureFixture, since: int) -> list[tuple[str, str, str]]:
    # argrpc's own lines (its transports) and grpc.aio's loop debug lines are not the user's.
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records[since:]
            if not r.name.startswith("argrpc") and r.levelno >= logging.INFO]


def _wait_for(caplog: pytest.LogCaptureFixture, since: int) -> list[tuple[str, str, str]]:
    """The failure's log line (a server logs it on its own thread, maybe after the call
    ended on the client)."""
    import time
    deadline = time.monotonic() + 20
    while not _seen(caplog, since) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _seen(caplog, since)


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_threaded_user_code_failures_are_logged_as_grpc_logs_them(
        stack: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with inproc.threaded(stack, THREADED) as channel:
        channel.unary_unary("/t/echo")(b"", timeout=20)
        assert inproc.transport_of(channel) == ("shm" if stack == "argrpc" else "grpc")
        for case, call in _threaded_calls(channel).items():
            since = len(caplog.records)
            try:
                call()
            except grpc.RpcError:
                pass  # a callback's failure fails no call
            seen = _wait_for(caplog, since)
            name, level, begins = THREADED_LOGS[case]
            assert [(n, lv) for n, lv, _ in seen] == [(name, level)], (case, seen)
            assert seen[0][2].startswith(begins), (case, seen)


async def _async_raise(request: bytes, context: Any) -> bytes:
    raise ValueError("boom")


async def _async_failing_responses(request: bytes, context: Any) -> Any:
    yield b"x"
    raise ValueError("boom")


async def _async_with_failing_callback(request: bytes, context: Any) -> bytes:
    context.add_done_callback(_boom)
    return request


async def _async_echo(request: bytes, context: Any) -> bytes:
    return request


ASYNC = grpc.method_handlers_generic_handler("t", {
    "raise": grpc.unary_unary_rpc_method_handler(_async_raise),
    "iter": grpc.unary_stream_rpc_method_handler(_async_failing_responses),
    "cb": grpc.unary_unary_rpc_method_handler(_async_with_failing_callback),
    "echo": grpc.unary_unary_rpc_method_handler(_async_echo)})

ASYNC_LOGS = {
    "handler raises": ("grpc._cython.cygrpc", "ERROR", "Unexpected [ValueError] raised by servicer"),
    "response iterator raises": ("grpc._cython.cygrpc", "ERROR",
                                 "Unexpected [ValueError] raised by servicer"),
    "context callback raises": ("grpc._cython.cygrpc", "ERROR", "Error in callback for method"),
    "client serializer raises": ("grpc._common", "ERROR", "Exception serializing message!"),
    "client deserializer raises": ("grpc._common", "ERROR", "Exception deserializing message!"),
}


def _async_calls(channel: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def read_all() -> Any:
        return [m async for m in channel.unary_stream("/t/iter")(b"", timeout=20)]

    return {
        "handler raises": lambda: channel.unary_unary("/t/raise")(b"", timeout=20),
        "response iterator raises": read_all,
        "context callback raises": lambda: channel.unary_unary("/t/cb")(b"", timeout=20),
        "client serializer raises": lambda: channel.unary_unary(
            "/t/echo", request_serializer=_boom)(b"", timeout=20),
        "client deserializer raises": lambda: channel.unary_unary(
            "/t/echo", response_deserializer=_boom)(b"", timeout=20),
    }


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_asyncio_user_code_failures_are_logged_as_grpc_aio_logs_them(
        stack: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def body() -> None:
        async with inproc.asyncio_pair(stack, ASYNC) as channel:
            await channel.unary_unary("/t/echo")(b"", timeout=20)
            for case, call in _async_calls(channel).items():
                since = len(caplog.records)
                try:
                    await call()
                except grpc.RpcError:
                    pass  # neither a callback's nor a deserializer's failure fails the call
                for _ in range(2000):
                    if _seen(caplog, since):
                        break
                    await asyncio.sleep(0.01)
                seen = _seen(caplog, since)
                name, level, begins = ASYNC_LOGS[case]
                assert [(n, lv) for n, lv, _ in seen] == [(name, level)], (case, seen)
                assert seen[0][2].startswith(begins), (case, seen)
            # A done callback added to a finished call runs at once and raises to its caller.
            done = channel.unary_unary("/t/echo")(b"", timeout=20)
            await done
            with pytest.raises(ValueError, match="boom"):
                done.add_done_callback(_boom)

    asyncio.run(body())


UNCONFIGURED = textwrap.dedent("""
    import sys, grpc
    from concurrent import futures
    import argrpc
    mod = argrpc if sys.argv[1] == "argrpc" else grpc
    def boom(request, context):
        raise ValueError("boom")
    server = mod.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(boom)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with mod.insecure_channel(f"127.0.0.1:{port}") as channel:
        for _ in range(2):
            try:
                channel.unary_unary("/t/U")(b"", timeout=20)
            except grpc.RpcError as e:
                print(e.code().name)
    server.stop(None)
""")


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_process_without_logging_set_up_prints_no_user_traceback(stack: str) -> None:
    out = subprocess.run([sys.executable, "-c", UNCONFIGURED, stack], capture_output=True,
                         text=True, timeout=120, env={"GRPC_VERBOSITY": "NONE",
                                                      **__import__("os").environ})
    assert out.stdout.split() == ["UNKNOWN", "UNKNOWN"], out
    assert "Traceback" not in out.stderr and "boom" not in out.stderr, out.stderr
