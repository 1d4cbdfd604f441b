"""The service config (`grpc.service_config`, gRFC A2 and A6) on the fast path: a method's
config found by method, then service, then default; its timeout, waitForReady and message
limits; its retryPolicy (retryable codes, at most 5 attempts, backoff, the server's
pushback, `grpc-previous-rpc-attempts`, throttling, `grpc.enable_retries=0`). Each
scenario runs on grpc too and must end the same way, except where grpcio departs from the
spec (listed in the README): it ends a call with a methodConfig timeout at once, and its
retry backoff is the exponential value with a little jitter, not a uniform draw below it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import pytest

import argrpc
import argrpc.aio
from argrpc._client.service_config import ServiceConfig
from tests.support import inproc
from tests.support.load import busy_cores

HANG_S = 30  # a bound on a hang, for a loaded machine
STACKS = ["grpc", "argrpc"]
POLICY = {"maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
          "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
# For a call cancelled while it retries. The backoff is drawn below its bound (A6), so
# short bounds could let every attempt end before the cancel on a machine that stalls
# the test; these take seconds of draws.
SLOW_POLICY = dict(POLICY, maxAttempts=5, initialBackoff="1s", maxBackoff="2s")


def _hold(context: Any) -> None:
    """Until the call ends (a bound on a hang)."""
    held = time.monotonic() + HANG_S
    while context.is_active() and time.monotonic() < held:
        time.sleep(0.01)


class Service:
    """Handlers that fail on request: "fail N" fails the first N attempts of each call
    UNAVAILABLE, "pushback MS" fails with that pushback, "hold" answers once the call
    ended; every attempt's `grpc-previous-rpc-attempts` is recorded."""

    def __init__(self) -> None:
        self.previous: list[Any] = []
        self.lock = threading.Lock()

    def flaky(self, request: bytes, context: Any) -> bytes:
        previous = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        with self.lock:
            self.previous.append(previous)
        word, _, arg = request.decode().partition(" ")
        if word == "fail" and int(previous or 0) < int(arg):
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        if word == "pushback":
            context.set_trailing_metadata((("grpc-retry-pushback-ms", arg),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "pushed back")
        if word == "code":
            context.abort(grpc.StatusCode.INTERNAL, "not retryable")
        if word == "sleep":
            time.sleep(float(arg))
        if word == "hold":
            _hold(context)
        if word == "big":
            return b"y" * int(arg)
        return f"ok after {previous or 0}".encode()

    def handlers(self) -> Any:
        return grpc.method_handlers_generic_handler(
            "pkg.S", {"Flaky": grpc.unary_unary_rpc_method_handler(self.flaky),
                      "Other": grpc.unary_unary_rpc_method_handler(self.flaky)})


@pytest.fixture(params=STACKS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Service, int]]:
    stack = request.param
    service = Service()
    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([service.handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield stack, service, port
    server.stop(None)


@contextlib.contextmanager
def _argrpc_server(*handlers: Any, workers: int = 8) -> Iterator[int]:
    """A threaded argrpc server with `handlers`, its port for the block."""
    server = argrpc.server(futures.ThreadPoolExecutor(workers))
    server.add_generic_rpc_handlers(list(handlers))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def _channel(stack: str, port: int, config: dict[str, Any], *extra: Any) -> Any:
    return inproc.stack_module(stack).insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.service_config", json.dumps(config)), *extra])


def _ends(call: Any, request: bytes) -> tuple[str, str]:
    try:
        return "OK", call(request, timeout=HANG_S).decode()
    except grpc.RpcError as e:
        return e.code().name, e.details()


async def _first_attempt(seen: list[Any]) -> None:
    """Until the server has recorded an attempt (a bound on a hang)."""
    waited = time.monotonic() + HANG_S
    while not seen and time.monotonic() < waited:
        await asyncio.sleep(0.005)


def _retrying(policy: dict[str, Any] = POLICY, **more: Any) -> dict[str, Any]:
    return {"methodConfig": [{"name": [{"service": "pkg.S"}], "retryPolicy": policy}], **more}


def test_retries_until_an_attempt_succeeds(served: Any) -> None:
    stack, service, port = served
    with _channel(stack, port, _retrying()) as ch:
        flaky = ch.unary_unary("/pkg.S/Flaky")
        assert [_ends(flaky, b"fail 2") for _ in range(6)] == [("OK", "ok after 2")] * 6
        assert service.previous[:3] == [None, "1", "2"]
        # with_call goes the same way, and its call reports the final attempt's end.
        response, call = flaky.with_call(b"fail 1", timeout=HANG_S)
        assert response == b"ok after 1" and call.code() == grpc.StatusCode.OK
        if stack == "argrpc":
            assert ch.transport == "shm"


def test_attempts_are_capped_at_five_and_codes_must_be_retryable(served: Any) -> None:
    stack, service, port = served
    with _channel(stack, port, _retrying(dict(POLICY, maxAttempts=9))) as ch:
        flaky = ch.unary_unary("/pkg.S/Flaky")
        assert _ends(flaky, b"fail 99") == ("UNAVAILABLE", "not yet")
        assert service.previous == [None, "1", "2", "3", "4"]
        service.previous.clear()
        assert _ends(flaky, b"code") == ("INTERNAL", "not retryable")
        assert service.previous == [None]


@pytest.mark.parametrize("pushback, attempts, waited", [("-1", 1, 0.0), ("300", 2, 0.3)])
def test_the_servers_pushback_decides(served: Any, pushback: str, attempts: int,
                                      waited: float) -> None:
    stack, service, port = served
    with _channel(stack, port, _retrying(dict(POLICY, maxAttempts=2))) as ch:
        start = time.monotonic()
        assert _ends(ch.unary_unary("/pkg.S/Flaky"), f"pushback {pushback}".encode())[0] == \
            "UNAVAILABLE"
        assert len(service.previous) == attempts
        assert time.monotonic() - start >= waited


def test_throttling_stops_retries_while_tokens_are_low(served: Any) -> None:
    stack, service, port = served
    config = _retrying(dict(POLICY, maxAttempts=3),
                       retryThrottling={"maxTokens": 10, "tokenRatio": 0.1})
    # A target of its own: grpc keeps the tokens per server name, process-wide.
    with inproc.stack_module(stack).insecure_channel(
            f"localhost:{port}", options=[("grpc.service_config", json.dumps(config))]) as ch:
        flaky = ch.unary_unary("/pkg.S/Flaky")
        per_call = []
        for _ in range(3):
            before = len(service.previous)
            _ends(flaky, b"fail 99")
            per_call.append(len(service.previous) - before)
        assert per_call == [3, 2, 1]


def test_enable_retries_zero_turns_retries_off(served: Any) -> None:
    stack, service, port = served
    with _channel(stack, port, _retrying(), ("grpc.enable_retries", 0)) as ch:
        assert _ends(ch.unary_unary("/pkg.S/Flaky"), b"fail 1") == ("UNAVAILABLE", "not yet")
        assert service.previous == [None]


def test_message_limits_of_the_method(served: Any) -> None:
    stack, _, port = served
    config = {"methodConfig": [{"name": [{"service": "pkg.S", "method": "Flaky"}],
                                "maxRequestMessageBytes": 1000,
                                "maxResponseMessageBytes": 1500}]}
    with _channel(stack, port, config) as ch:
        flaky, other = ch.unary_unary("/pkg.S/Flaky"), ch.unary_unary("/pkg.S/Other")
        assert _ends(flaky, b"big 10")[0] == "OK"
        assert _ends(flaky, b"x" * 1200) == (
            "RESOURCE_EXHAUSTED", "CLIENT: Sent message larger than max (1200 vs. 1000)")
        assert _ends(flaky, b"big 2000") == (
            "RESOURCE_EXHAUSTED",
            "Stream removed (CLIENT: Received message larger than max (2000 vs. 1500))")
        assert _ends(other, b"big 2000")[0] == "OK"  # another method: no limit


def test_timeout_bounds_the_call_as_the_spec_says(served: Any) -> None:
    stack, _, port = served
    # Seconds, not less: a call that must end OK within it may meet a stalled machine.
    config = {"methodConfig": [{"name": [{"service": "pkg.S", "method": "Flaky"}],
                                "timeout": "2s"}]}
    for enabled in ("true", "false"):  # argrpc: the fast path, then plain gRPC
        with _channel(stack, port, config, ("TF_RDMA_ENABLED", enabled)) as ch:
            flaky = ch.unary_unary("/pkg.S/Flaky")
            start = time.monotonic()
            assert _ends(flaky, b"hold")[0] == "DEADLINE_EXCEEDED"
            took = time.monotonic() - start
            if stack == "grpc":
                continue  # grpcio ends it at once, whatever the timeout (README)
            assert took >= 1.99
            assert _ends(flaky, b"sleep 0.05")[0] == "OK"
            # The call's own timeout wins when it is earlier.
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                flaky(b"hold", timeout=0.1)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 1.9
            assert _ends(ch.unary_unary("/pkg.S/Other"), b"sleep 0.5")[0] == "OK"
        if stack == "grpc":
            break


@pytest.mark.parametrize("stack", STACKS)
def test_wait_for_ready_from_the_config(stack: str) -> None:
    """A call to a server not up yet waits for it when the method's config says so."""
    with socket.socket() as probe:  # a free port (a grpc server's would stay claimed)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {"methodConfig": [{"name": [{"service": "pkg.S"}], "waitForReady": True}]}
    service = Service()
    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([service.handlers()])

    def start_later() -> None:
        time.sleep(0.5)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()

    starter = threading.Thread(target=start_later)
    with _channel(stack, port, config) as ch:
        starter.start()
        try:
            assert _ends(ch.unary_unary("/pkg.S/Flaky"), b"")[0] == "OK"
        finally:
            starter.join()
            server.stop(None)


def test_the_most_specific_method_config_applies() -> None:
    config = ServiceConfig([("grpc.service_config", json.dumps({"methodConfig": [
        {"name": [{}], "timeout": "3s"},
        {"name": [{"service": "pkg.S"}], "timeout": "2s"},
        {"name": [{"service": "pkg.S", "method": "M"}], "timeout": "1s",
         "retryPolicy": POLICY},
    ]}))])
    assert config.method("/pkg.S/M").timeout_s == 1.0
    assert config.method("/pkg.S/N").timeout_s == 2.0
    assert config.method("/pkg.T/M").timeout_s == 3.0
    assert config.method("/pkg.S/M").retry is not None
    assert config.method("/pkg.S/M").timeout(0.5) == 0.5
    none = ServiceConfig([])
    assert not none.method("/pkg.S/M")


@pytest.mark.parametrize("stack", STACKS)
def test_aio_timeout_from_the_config(stack: str) -> None:
    aio = argrpc.aio if stack == "argrpc" else grpc.aio

    async def main() -> None:
        async def slow(request: bytes, context: Any) -> bytes:
            await asyncio.sleep(float(request))
            return b"ok"

        server = aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "pkg.S", {"Slow": grpc.unary_unary_rpc_method_handler(slow)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        config = {"methodConfig": [{"name": [{"service": "pkg.S"}], "timeout": "2s"}]}
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(config))]) as ch:
                slow_call = ch.unary_unary("/pkg.S/Slow")
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    await slow_call(b"%d" % HANG_S, timeout=HANG_S)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if stack == "argrpc":
                    assert time.monotonic() - start >= 1.99
                    assert await slow_call(b"0.05", timeout=HANG_S) == b"ok"
                    assert ch.transport == "shm"
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("stack", STACKS)
def test_aio_retries_until_an_attempt_succeeds(stack: str) -> None:
    aio = argrpc.aio if stack == "argrpc" else grpc.aio
    service = Service()

    async def flaky(request: bytes, context: Any) -> bytes:
        previous = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        service.previous.append(previous)
        if int(previous or 0) < int(request or b"0"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return f"ok after {previous or 0}".encode()

    async def main() -> None:
        server = aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "pkg.S", {"Flaky": grpc.unary_unary_rpc_method_handler(flaky)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying()))]) as ch:
                call = ch.unary_unary("/pkg.S/Flaky")
                for _ in range(4):
                    assert await call(b"2", timeout=HANG_S) == b"ok after 2"
                assert service.previous[:3] == [None, "1", "2"]
                with pytest.raises(grpc.RpcError) as e:
                    await call(b"9", timeout=HANG_S)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                if stack == "argrpc":
                    assert ch.transport == "shm"
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying(SLOW_POLICY)))]) as ch:
                # A call cancelled while it retries ends CANCELLED, as grpc.aio's does.
                service.previous.clear()
                slow = ch.unary_unary("/pkg.S/Flaky")(b"9", timeout=HANG_S)
                await _first_attempt(service.previous)
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow
        finally:
            await server.stop(None)

    asyncio.run(main())


def _hedging(**policy: Any) -> dict[str, Any]:
    return {"methodConfig": [{"name": [{"service": "pkg.S"}], "hedgingPolicy": {
        "maxAttempts": 3, "hedgingDelay": "0.2s", "nonFatalStatusCodes": ["UNAVAILABLE"],
        **policy}}]}


# Hedges run on real time: a scenario that expects exactly the attempts its statuses or
# its silent first attempt cause must not let a stalled machine's late answer send one
# more on the timer. One slow attempt and one hedge, no more:
ONE_HEDGE = _hedging(maxAttempts=2)
# Attempts that only statuses send (a delay no test waits for):
STATUS_HEDGES = _hedging(hedgingDelay="30s")


def test_hedging_sends_another_attempt_after_the_delay() -> None:
    """gRFC A6 hedging (grpcio 1.85 ignores hedgingPolicy: README): a slow first attempt
    is overtaken by the second, sent hedgingDelay later with grpc-previous-rpc-attempts,
    and the slow one is cancelled."""
    service = Service()
    cancelled = threading.Event()

    def slow_then_fast(request: bytes, context: Any) -> bytes:
        previous = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        service.previous.append(previous)
        if previous is None:  # the first attempt waits for its cancellation
            context.add_callback(cancelled.set)
            while context.is_active():
                time.sleep(0.01)
            return b"first"
        return f"hedged after {previous}".encode()

    server = argrpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pkg.S", {"Slow": grpc.unary_unary_rpc_method_handler(slow_then_fast),
                  "Flaky": grpc.unary_unary_rpc_method_handler(service.flaky)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with _channel("argrpc", port, ONE_HEDGE) as ch:
            start = time.monotonic()
            response, call = ch.unary_unary("/pkg.S/Slow").with_call(b"", timeout=HANG_S)
            took = time.monotonic() - start
            assert response == b"hedged after 1" and call.code() == grpc.StatusCode.OK
            assert 0.19 <= took < HANG_S
            assert cancelled.wait(HANG_S), "the overtaken attempt was not cancelled"
            assert ch.transport == "shm"
        with _channel("argrpc", port, STATUS_HEDGES) as ch:
            # A fatal status ends the call at once; non-fatal ones let the next attempt go
            # at once, until maxAttempts.
            flaky = ch.unary_unary("/pkg.S/Flaky")
            service.previous.clear()
            assert _ends(flaky, b"code") == ("INTERNAL", "not retryable")
            assert service.previous == [None]
            service.previous.clear()
            assert _ends(flaky, b"fail 99") == ("UNAVAILABLE", "not yet")
            assert sorted(service.previous, key=str) == ["1", "2", None]
            service.previous.clear()
            assert _ends(flaky, b"fail 1") == ("OK", "ok after 1")
    finally:
        server.stop(None)


def test_aio_hedging_sends_another_attempt_after_the_delay() -> None:
    previous: list[Any] = []
    cancelled = asyncio.Event()

    async def slow_then_fast(request: bytes, context: Any) -> bytes:
        seen = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        previous.append(seen)
        if seen is None:
            try:
                await asyncio.sleep(HANG_S)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return f"hedged after {seen}".encode()

    async def main() -> None:
        server = argrpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "pkg.S", {"Slow": grpc.unary_unary_rpc_method_handler(slow_then_fast)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with argrpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(ONE_HEDGE))]) as ch:
                start = time.monotonic()
                call = ch.unary_unary("/pkg.S/Slow")(b"", timeout=HANG_S)
                assert await call == b"hedged after 1"
                assert await call.code() == grpc.StatusCode.OK
                assert 0.19 <= time.monotonic() - start < HANG_S
                await asyncio.wait_for(cancelled.wait(), HANG_S)  # the overtaken attempt
                assert previous == [None, "1"]
                assert ch.transport == "shm"
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_future_retries_and_cancels_as_grpc_does(served: Any) -> None:
    stack, service, port = served
    policy = dict(POLICY, initialBackoff="0.2s", maxBackoff="0.5s")
    with _channel(stack, port, _retrying(policy)) as ch:
        flaky = ch.unary_unary("/pkg.S/Flaky")
        f = flaky.future(b"fail 2", timeout=HANG_S)
        assert f.result(timeout=HANG_S) == b"ok after 2" and f.code() == grpc.StatusCode.OK
        assert service.previous == [None, "1", "2"], service.previous
        f = flaky.future(b"fail 99", timeout=HANG_S)
        assert f.exception(timeout=HANG_S).code() == grpc.StatusCode.UNAVAILABLE
    # Cancelled while it retries: CANCELLED as grpc words it, no attempt after.
    with _channel(stack, port, _retrying(SLOW_POLICY)) as ch:
        flaky = ch.unary_unary("/pkg.S/Flaky")
        service.previous.clear()
        f = flaky.future(b"fail 99", timeout=HANG_S)
        waited = time.monotonic() + HANG_S
        while not service.previous and time.monotonic() < waited:
            time.sleep(0.005)
        assert f.cancel() and f.cancelled()
        made = len(service.previous)
        assert (f.code(), f.details()) == (grpc.StatusCode.CANCELLED,
                                           "Locally cancelled by application!")
        with pytest.raises(grpc.FutureCancelledError):
            f.result(timeout=HANG_S)
        time.sleep(1.5)  # past the first backoff's bound
        assert len(service.previous) == made
        done = threading.Event()
        f = flaky.future(b"fail 1", timeout=HANG_S)
        f.add_done_callback(lambda _f: done.set())
        assert done.wait(HANG_S) and f.result() == b"ok after 1"
        if stack == "argrpc":
            assert ch.transport == "shm"


def test_future_is_hedged() -> None:
    service = Service()
    server = argrpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([service.handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with _channel("argrpc", port, _hedging(hedgingDelay="0.05s")) as ch:
            f = ch.unary_unary("/pkg.S/Flaky").future(b"fail 2", timeout=HANG_S)
            assert f.result(timeout=HANG_S) == b"ok after 2"
            assert sorted(service.previous, key=str) == ["1", "2", None]
    finally:
        server.stop(None)


@pytest.mark.parametrize("stack", STACKS)
def test_response_limit_of_the_method_on_streams_and_futures(stack: str) -> None:
    def stream(request: bytes, context: Any) -> Any:
        yield b"a" * 10
        yield b"b" * 2000
        yield b"c"

    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pkg.S", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Big": grpc.unary_unary_rpc_method_handler(lambda r, c: b"y" * 2000)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    config = {"methodConfig": [{"name": [{"service": "pkg.S"}],
                                "maxResponseMessageBytes": 1500}]}
    too_large = ("RESOURCE_EXHAUSTED",
                 "Stream removed (CLIENT: Received message larger than max (2000 vs. 1500))")
    try:
        with _channel(stack, port, config) as ch:
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for message in ch.unary_stream("/pkg.S/Stream")(b"", timeout=HANG_S):
                    got.append(len(message))
            assert got == [10] and (e.value.code().name, e.value.details()) == too_large
            f = ch.unary_unary("/pkg.S/Big").future(b"", timeout=HANG_S)
            error = f.exception(timeout=HANG_S)
            assert (error.code().name, error.details()) == too_large
    finally:
        server.stop(None)


@pytest.mark.parametrize("stack", STACKS)
def test_a_response_stream_is_retried_until_its_first_message(stack: str) -> None:
    previous: list[Any] = []

    def stream(request: bytes, context: Any) -> Any:
        seen = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        previous.append(seen)
        word, _, arg = request.decode().partition(" ")
        if word == "fail" and int(seen or 0) < int(arg):
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        yield f"first {seen or 0}".encode()
        if word == "late":  # after a message the call is committed: not retried
            context.abort(grpc.StatusCode.UNAVAILABLE, "after a message")
        yield b"second"

    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "pkg.S", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def run(request: bytes) -> tuple[str, list[bytes], list[Any]]:
        previous.clear()
        got: list[bytes] = []
        try:
            for message in ch.unary_stream("/pkg.S/Stream")(request, timeout=HANG_S):
                got.append(message)
            return "OK", got, list(previous)
        except grpc.RpcError as e:
            return e.code().name, got, list(previous)

    try:
        with _channel(stack, port, _retrying()) as ch:
            assert run(b"fail 2") == ("OK", [b"first 2", b"second"], [None, "1", "2"])
            assert run(b"fail 9") == ("UNAVAILABLE", [], [None, "1", "2", "3"])
            assert run(b"late 0") == ("UNAVAILABLE", [b"first 0"], [None])
            if stack == "argrpc":
                assert ch.transport == "shm"
    finally:
        server.stop(None)


@pytest.mark.parametrize("stack", STACKS)
def test_aio_response_stream_is_retried_until_its_first_message(stack: str) -> None:
    aio = argrpc.aio if stack == "argrpc" else grpc.aio
    previous: list[Any] = []

    async def stream(request: bytes, context: Any) -> Any:
        seen = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        previous.append(seen)
        word, _, arg = request.decode().partition(" ")
        if word == "fail" and int(seen or 0) < int(arg):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        yield f"first {seen or 0}".encode()
        if word == "late":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "after a message")
        yield b"second"

    async def main() -> None:
        server = aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "pkg.S", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

        async def run(ch: Any, request: bytes) -> tuple[str, list[bytes], list[Any]]:
            previous.clear()
            got: list[bytes] = []
            try:
                async for message in ch.unary_stream("/pkg.S/Stream")(request, timeout=HANG_S):
                    got.append(message)
                return "OK", got, list(previous)
            except grpc.RpcError as e:
                return e.code().name, got, list(previous)

        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying()))]) as ch:
                assert await run(ch, b"fail 2") == ("OK", [b"first 2", b"second"],
                                                    [None, "1", "2"])
                assert await run(ch, b"fail 9") == ("UNAVAILABLE", [], [None, "1", "2", "3"])
                assert await run(ch, b"late 0") == ("UNAVAILABLE", [b"first 0"], [None])
                call = ch.unary_stream("/pkg.S/Stream")(b"fail 1", timeout=HANG_S)
                assert await call.read() == b"first 1" and await call.read() == b"second"
                assert await call.read() is grpc.aio.EOF
                if stack == "argrpc":
                    assert ch.transport == "shm"
        finally:
            await server.stop(None)

    asyncio.run(main())


class _Streams:
    """Request-stream handlers: the first request says how the call goes ("fail N": the
    first N attempts fail UNAVAILABLE, after reading every request; "late": a response
    first, then UNAVAILABLE); every attempt's requests and its
    `grpc-previous-rpc-attempts` are recorded."""

    def __init__(self) -> None:
        self.attempts: list[tuple[Any, list[bytes]]] = []

    def _attempt(self, context: Any) -> Any:
        return dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")

    def collect(self, requests: Any, context: Any) -> bytes:
        seen = self._attempt(context)
        got = list(requests)
        self.attempts.append((seen, got))
        word, _, arg = got[0].decode().partition(" ")
        if word == "fail" and int(seen or 0) < int(arg):
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return b"|".join(got) + f" after {seen or 0}".encode()

    def echo(self, requests: Any, context: Any) -> Any:
        seen = self._attempt(context)
        got: list[bytes] = []
        self.attempts.append((seen, got))
        for request in requests:
            got.append(request)
            word, _, arg = got[0].decode().partition(" ")
            if word == "fail" and int(seen or 0) < int(arg):
                context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
            yield request
            if word == "late":
                context.abort(grpc.StatusCode.UNAVAILABLE, "after a message")

    def handlers(self) -> Any:
        return grpc.method_handlers_generic_handler("pkg.S", {
            "Collect": grpc.stream_unary_rpc_method_handler(self.collect),
            "Echo": grpc.stream_stream_rpc_method_handler(self.echo)})


@pytest.mark.parametrize("stack", STACKS)
def test_request_streams_are_retried_with_their_requests_replayed(stack: str) -> None:
    """A client stream or bidi call under a retry policy: a retry sends every request the
    call sent so far again, in order, then the rest; requests beyond
    grpc.per_rpc_retry_buffer_size commit the call (not retried); a bidi call is
    committed by its first response, as grpcio does."""
    service = _Streams()
    server = inproc.stack_module(stack).server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers([service.handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def requests(first: bytes, n: int, size: int = 3) -> Iterator[bytes]:
        yield first
        for i in range(n):
            time.sleep(0.002)  # some arrive while an attempt already runs
            yield b"%d" % i * size

    def ends(call: Callable[[], Any]) -> tuple[str, Any, list[Any]]:
        service.attempts.clear()
        try:
            result = call()
            return "OK", result, [a for a, _ in service.attempts]
        except grpc.RpcError as e:
            return e.code().name, None, [a for a, _ in service.attempts]

    body = b"fail 2|000|111|222|333"
    try:
        with _channel(stack, port, _retrying()) as ch:
            collect = ch.stream_unary("/pkg.S/Collect")
            assert ends(lambda: collect(requests(b"fail 2", 4), timeout=HANG_S)) == \
                ("OK", body + b" after 2", [None, "1", "2"])
            # Every attempt got every request, in order.
            assert all(b"|".join(got) == body for _, got in service.attempts)
            assert ends(lambda: collect.with_call(requests(b"fail 1", 4),
                                                  timeout=HANG_S)[0]) == \
                ("OK", b"fail 1|000|111|222|333 after 1", [None, "1"])
            assert ends(lambda: collect.future(requests(b"fail 3", 2),
                                               timeout=HANG_S).result()) == \
                ("OK", b"fail 3|000|111 after 3", [None, "1", "2", "3"])
            assert ends(lambda: collect(requests(b"fail 9", 1), timeout=HANG_S))[::2] == \
                ("UNAVAILABLE", [None, "1", "2", "3"])
            echo = ch.stream_stream("/pkg.S/Echo")
            assert ends(lambda: list(echo(requests(b"fail 1", 2), timeout=HANG_S))) == \
                ("OK", [b"fail 1", b"000", b"111"], [None, "1"])
            assert ends(lambda: list(echo(requests(b"late", 2), timeout=HANG_S)))[::2] == \
                ("UNAVAILABLE", [None])
            if stack == "argrpc":
                assert ch.transport == "shm"
        small = ("grpc.per_rpc_retry_buffer_size", 1024)
        with _channel(stack, port, _retrying(), small) as ch:
            collect = ch.stream_unary("/pkg.S/Collect")
            assert ends(lambda: collect(requests(b"fail 1", 4), timeout=HANG_S)) == \
                ("OK", b"fail 1|000|111|222|333 after 1", [None, "1"])
            # 4 × 400 bytes do not fit: the call is committed to its first attempt.
            assert ends(lambda: collect(requests(b"fail 1", 4, 400), timeout=HANG_S))[::2] == \
                ("UNAVAILABLE", [None])
    finally:
        server.stop(None)


@pytest.mark.parametrize("stack", STACKS)
def test_aio_response_limit_of_the_method(stack: str) -> None:
    """A method's maxResponseMessageBytes on argrpc.aio, every arity that reads a
    response: the call ends RESOURCE_EXHAUSTED with grpc.aio's words; what came before
    the big message was read."""
    aio = inproc.stack_module(stack).aio

    async def stream(request: bytes, context: Any) -> Any:
        yield b"a" * 10
        yield b"b" * 2000
        yield b"c"

    async def big(request: Any, context: Any) -> bytes:
        if not isinstance(request, bytes):
            async for _ in request:
                pass
        return b"y" * 2000

    async def bidi(requests: Any, context: Any) -> Any:
        async for r in requests:
            yield r

    config = {"methodConfig": [{"name": [{"service": "pkg.S"}],
                                "maxResponseMessageBytes": 1500}]}

    async def main() -> list[Any]:
        server = aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pkg.S", {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Big": grpc.unary_unary_rpc_method_handler(big),
            "BigFromStream": grpc.stream_unary_rpc_method_handler(big),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ends: list[Any] = []
        try:
            async with aio.insecure_channel(
                    f"127.0.0.1:{port}",
                    options=[("grpc.service_config", json.dumps(config))]) as ch:
                got: list[int] = []
                call = ch.unary_stream("/pkg.S/Stream")(b"", timeout=HANG_S)
                try:
                    async for message in call:
                        got.append(len(message))
                except grpc.aio.AioRpcError as e:
                    ends.append((got, e.code().name, e.details()))
                ends.append(((await call.code()).name, await call.details()))
                for method, arg in (("/pkg.S/Big", b""),
                                    ("/pkg.S/BigFromStream", iter([b"x"]))):
                    mc = ch.unary_unary(method) if method == "/pkg.S/Big" else \
                        ch.stream_unary(method)
                    call = mc(arg, timeout=HANG_S)
                    try:
                        await call
                    except grpc.aio.AioRpcError as e:
                        ends.append((e.code().name, e.details()))
                    ends.append(((await call.code()).name, await call.details()))
                got = []
                call = ch.stream_stream("/pkg.S/Bidi")(iter([b"s", b"L" * 2000, b"t"]),
                                                       timeout=HANG_S)
                try:
                    async for message in call:
                        got.append(len(message))
                except grpc.aio.AioRpcError as e:
                    ends.append((got, e.code().name, e.details()))
                if stack == "argrpc":
                    assert ch.transport == "shm"
        finally:
            await server.stop(None)
        return ends

    too_large = ("RESOURCE_EXHAUSTED",
                 "Stream removed (CLIENT: Received message larger than max (2000 vs. 1500))")
    assert asyncio.run(main()) == [([10], *too_large), too_large, too_large, too_large,
                                   too_large, too_large, ([1], *too_large)]


class _AioStreams(_Streams):
    """_Streams' handlers for an asyncio server."""

    def _begin(self, context: Any) -> tuple[Any, list[bytes]]:
        seen, got = self._attempt(context), list[bytes]()
        self.attempts.append((seen, got))
        return seen, got

    @staticmethod
    def _fails(seen: Any, got: list[bytes]) -> bool:
        word, _, arg = got[0].decode().partition(" ")
        return word == "fail" and int(seen or 0) < int(arg)

    async def collect(self, requests: Any, context: Any) -> bytes:  # type: ignore[override]
        seen, got = self._begin(context)
        async for request in requests:
            got.append(request)
        if self._fails(seen, got):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return b"|".join(got) + f" after {seen or 0}".encode()

    async def echo(self, requests: Any, context: Any) -> Any:
        seen, got = self._begin(context)
        async for request in requests:
            got.append(request)
            if self._fails(seen, got):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
            yield request
            if got[0] == b"late":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "after a message")


@pytest.mark.parametrize("stack", STACKS)
def test_aio_request_streams_are_retried_with_their_requests_replayed(stack: str) -> None:
    """The threaded test above on argrpc.aio, with request iterators and with
    write()/done_writing() (and read() for bidi)."""
    aio = inproc.stack_module(stack).aio
    service = _AioStreams()

    async def requests(first: bytes, n: int, size: int = 3) -> Any:
        yield first
        for i in range(n):
            await asyncio.sleep(0.002)  # some arrive while an attempt already runs
            yield b"%d" % i * size

    async def ends(call: Callable[[], Any]) -> tuple[str, Any, list[Any]]:
        service.attempts.clear()
        try:
            result = await call()
            return "OK", result, [a for a, _ in service.attempts]
        except grpc.RpcError as e:
            return e.code().name, None, [a for a, _ in service.attempts]

    async def main() -> None:
        server = aio.server()
        server.add_generic_rpc_handlers([service.handlers()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        body = b"fail 2|000|111|222|333"
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying()))]) as ch:
                collect = ch.stream_unary("/pkg.S/Collect")
                assert await ends(lambda: collect(requests(b"fail 2", 4), timeout=HANG_S)) \
                    == ("OK", body + b" after 2", [None, "1", "2"])
                assert all(b"|".join(got) == body for _, got in service.attempts)

                async def written() -> Any:
                    call = collect(timeout=HANG_S)
                    await call.write(b"fail 1")
                    for i in range(3):
                        await asyncio.sleep(0.002)
                        await call.write(b"%d" % i)
                    await call.done_writing()
                    with pytest.raises(asyncio.InvalidStateError):
                        await call.write(b"late")
                    return await call

                assert await ends(written) == ("OK", b"fail 1|0|1|2 after 1", [None, "1"])
                assert (await ends(lambda: collect(requests(b"fail 9", 1),
                                                   timeout=HANG_S)))[::2] == \
                    ("UNAVAILABLE", [None, "1", "2", "3"])
                echo = ch.stream_stream("/pkg.S/Echo")

                async def listed(call: Any) -> list[bytes]:
                    return [message async for message in call]

                assert await ends(lambda: listed(echo(requests(b"fail 1", 2),
                                                      timeout=HANG_S))) == \
                    ("OK", [b"fail 1", b"000", b"111"], [None, "1"])

                async def talked() -> Any:
                    call = echo(timeout=HANG_S)
                    got = []
                    for request in (b"fail 1", b"a", b"b"):
                        await call.write(request)
                        got.append(await call.read())
                    await call.done_writing()
                    assert await call.read() is grpc.aio.EOF
                    return got, (await call.code()).name

                assert await ends(talked) == \
                    ("OK", ([b"fail 1", b"a", b"b"], "OK"), [None, "1"])
                late = (await ends(lambda: listed(echo(requests(b"late", 2),
                                                        timeout=HANG_S))))[::2]
                # grpc.aio lets a request write that fails after the server's status
                # replace that status with INTERNAL ("Internal error from Core") when the
                # loop sees the failed write last; argrpc keeps the server's status, as
                # grpc's threaded API and HTTP/2 (a response kept across RST_STREAM) do.
                assert late in ([("UNAVAILABLE", [None])] if stack == "argrpc" else
                                [("UNAVAILABLE", [None]), ("INTERNAL", [None])])
                if stack == "argrpc":
                    assert ch.transport == "shm"
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying(SLOW_POLICY)))]) as ch:
                # A call cancelled while it retries ends CANCELLED.
                service.attempts.clear()
                slow = ch.stream_unary("/pkg.S/Collect")(requests(b"fail 9", 1),
                                                         timeout=HANG_S)
                await _first_attempt(service.attempts)
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow
                assert slow.cancelled()
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(_retrying())),
                    ("grpc.per_rpc_retry_buffer_size", 1024)]) as ch:
                collect = ch.stream_unary("/pkg.S/Collect")
                assert await ends(lambda: collect(requests(b"fail 1", 4), timeout=HANG_S)) \
                    == ("OK", b"fail 1|000|111|222|333 after 1", [None, "1"])
                # 4 × 400 bytes do not fit: the call is committed to its first attempt.
                assert (await ends(lambda: collect(requests(b"fail 1", 4, 400),
                                                   timeout=HANG_S)))[::2] == \
                    ("UNAVAILABLE", [None])
        finally:
            await server.stop(None)

    asyncio.run(main())


class _HedgedStreams:
    """Stream handlers for hedging: "Collect", "Echo" and "Stream" keep their first
    attempt silent until it is cancelled (it records every request it read), later
    attempts answer at once; "Quick" answers each attempt's first request at once and
    the rest after HOLD_S, longer than QUICK_HEDGE's delay."""

    HOLD_S = 1.5
    # The first response must come within the delay, on a machine that may stall.
    QUICK_HEDGE = _hedging(hedgingDelay="1s")

    def __init__(self) -> None:
        self.attempts: list[tuple[Any, list[bytes]]] = []
        self.cancelled = threading.Event()

    def _attempt(self, context: Any) -> tuple[Any, list[bytes]]:
        seen = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts")
        got: list[bytes] = []
        self.attempts.append((seen, got))
        return seen, got

    def _silent(self, context: Any) -> None:
        context.add_callback(self.cancelled.set)
        _hold(context)

    def collect(self, requests: Any, context: Any) -> bytes:
        seen, got = self._attempt(context)
        got.extend(requests)
        if seen is None:
            self._silent(context)
        return b"|".join(got) + f" after {seen or 0}".encode()

    def echo(self, requests: Any, context: Any) -> Any:
        seen, got = self._attempt(context)
        if seen is None:
            got.extend(requests)
            self._silent(context)
            return
        for request in requests:
            got.append(request)
            yield request

    def quick(self, requests: Any, context: Any) -> Any:
        _, got = self._attempt(context)
        for request in requests:
            got.append(request)
            if len(got) > 1:
                time.sleep(self.HOLD_S)
            yield request

    def stream(self, request: bytes, context: Any) -> Any:
        seen, _ = self._attempt(context)
        if seen is None:
            self._silent(context)
            return
        yield f"first {seen}".encode()
        yield b"second"

    def handlers(self) -> Any:
        return grpc.method_handlers_generic_handler("pkg.S", {
            "Collect": grpc.stream_unary_rpc_method_handler(self.collect),
            "Echo": grpc.stream_stream_rpc_method_handler(self.echo),
            "Quick": grpc.stream_stream_rpc_method_handler(self.quick),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream)})


def test_streams_are_hedged() -> None:
    """gRFC A6 hedging of every streaming arity (grpcio ignores hedgingPolicy: README):
    a silent first attempt is overtaken hedgingDelay later by a second that got every
    request the call sent, in order; the first is cancelled. An attempt whose response
    began is the call's: no attempt follows it."""
    service = _HedgedStreams()

    def requests(n: int) -> Iterator[bytes]:
        for i in range(n):
            time.sleep(0.002)
            yield b"%d" % i

    def run(call: Callable[[], Any]) -> tuple[Any, list[Any]]:
        service.attempts.clear()
        service.cancelled.clear()
        result = call()
        return result, sorted(service.attempts, key=lambda a: str(a[0]))

    with _argrpc_server(service.handlers()) as port, \
            _channel("argrpc", port, ONE_HEDGE) as ch, \
            _channel("argrpc", port, service.QUICK_HEDGE) as quick_ch:
        collect = ch.stream_unary("/pkg.S/Collect")
        assert run(lambda: collect(requests(3), timeout=HANG_S)) == \
            (b"0|1|2 after 1", [("1", [b"0", b"1", b"2"]), (None, [b"0", b"1", b"2"])])
        assert service.cancelled.wait(HANG_S)
        future = collect.future(requests(2), timeout=HANG_S)
        assert future.result() == b"0|1 after 1"
        echo = ch.stream_stream("/pkg.S/Echo")
        assert run(lambda: list(echo(requests(3), timeout=HANG_S))) == \
            ([b"0", b"1", b"2"], [("1", [b"0", b"1", b"2"]), (None, [b"0", b"1", b"2"])])
        assert service.cancelled.wait(HANG_S)
        stream = ch.unary_stream("/pkg.S/Stream")
        assert run(lambda: list(stream(b"", timeout=HANG_S)))[0] == \
            [b"first 1", b"second"]
        quick = quick_ch.stream_stream("/pkg.S/Quick")
        assert run(lambda: list(quick(iter([b"a", b"b"]), timeout=HANG_S))) == \
            ([b"a", b"b"], [(None, [b"a", b"b"])])
        assert ch.transport == quick_ch.transport == "shm"


def test_aio_streams_are_hedged() -> None:
    """test_streams_are_hedged on argrpc.aio, iterators and write()/read()."""
    service = _HedgedStreams()

    async def requests(n: int) -> Any:
        for i in range(n):
            await asyncio.sleep(0.002)
            yield b"%d" % i

    async def run(call: Callable[[], Any]) -> tuple[Any, list[Any]]:
        service.attempts.clear()
        service.cancelled.clear()
        result = await call()
        return result, sorted(service.attempts, key=lambda a: str(a[0]))

    async def listed(call: Any) -> list[bytes]:
        return [message async for message in call]

    async def main(port: int) -> None:
        async with argrpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.service_config", json.dumps(ONE_HEDGE))]) as ch, \
                argrpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                    ("grpc.service_config", json.dumps(service.QUICK_HEDGE))]) as quick_ch:
            collect = ch.stream_unary("/pkg.S/Collect")
            assert await run(lambda: collect(requests(3), timeout=HANG_S)) == \
                (b"0|1|2 after 1", [("1", [b"0", b"1", b"2"]), (None, [b"0", b"1", b"2"])])
            assert service.cancelled.wait(HANG_S)

            async def written() -> Any:
                call = collect(timeout=HANG_S)
                for request in (b"x", b"y"):
                    await call.write(request)
                await call.done_writing()
                return await call

            assert (await run(written))[0] == b"x|y after 1"
            echo = ch.stream_stream("/pkg.S/Echo")
            assert await run(lambda: listed(echo(requests(3), timeout=HANG_S))) == \
                ([b"0", b"1", b"2"], [("1", [b"0", b"1", b"2"]), (None, [b"0", b"1", b"2"])])
            stream = ch.unary_stream("/pkg.S/Stream")
            assert (await run(lambda: listed(stream(b"", timeout=HANG_S))))[0] == \
                [b"first 1", b"second"]
            quick = quick_ch.stream_stream("/pkg.S/Quick")

            async def talked() -> Any:
                call = quick(timeout=HANG_S)
                got = []
                for request in (b"a", b"b"):
                    await call.write(request)
                    got.append(await call.read())
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                return got

            assert await run(talked) == ([b"a", b"b"], [(None, [b"a", b"b"])])
            assert ch.transport == quick_ch.transport == "shm"

    with _argrpc_server(service.handlers()) as port:
        asyncio.run(main(port))


@pytest.mark.parametrize("load", ["quiet", "busy"])
def test_policy_streams_cancelled_at_random_moments(load: str) -> None:
    """Retried and hedged request-stream calls of both APIs cancelled at random moments
    (between attempts, while a new attempt gets the requests sent so far, while one is
    silent): each ends CANCELLED or with its own end, none hangs, and no attempt
    outlives its call (argrpc.aio's channel counts none in flight; no attempts thread
    is left)."""
    service, flaky = _HedgedStreams(), _Streams()
    handlers = (service.handlers(), grpc.method_handlers_generic_handler(
        "pkg.R", {"Collect": grpc.stream_unary_rpc_method_handler(flaky.collect)}))
    config = {"methodConfig": [
        {"name": [{"service": "pkg.S"}], "hedgingPolicy": {
            "maxAttempts": 3, "hedgingDelay": "0.01s", "nonFatalStatusCodes": ["UNAVAILABLE"]}},
        {"name": [{"service": "pkg.R"}], "retryPolicy": {**POLICY, "maxAttempts": 5}}]}
    rng = random.Random()
    ends = {"OK", "CANCELLED", "UNAVAILABLE"}

    def requests(n: int) -> Iterator[bytes]:
        yield b"fail 9"
        for i in range(n):
            time.sleep(rng.uniform(0, 0.003))
            yield b"%d" % i

    async def aio_calls(port: int) -> int:
        async with argrpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.service_config", json.dumps(config))]) as ch:
            methods = [ch.stream_unary("/pkg.S/Collect"), ch.stream_stream("/pkg.S/Echo"),
                       ch.stream_unary("/pkg.R/Collect")]

            async def one(i: int) -> str:
                call = methods[i % 3]((r for r in [b"fail 9", b"a", b"b"]), timeout=HANG_S)
                await asyncio.sleep(rng.uniform(0, 0.03))
                call.cancel()
                try:
                    await asyncio.wait_for(call.code(), HANG_S)
                except asyncio.CancelledError:
                    return "CANCELLED"
                code: grpc.StatusCode = await call.code()
                return code.name

            got = await asyncio.gather(*(one(i) for i in range(24)))
            assert set(got) <= ends, got
            deadline = time.monotonic() + HANG_S
            while ch.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert ch.inflight == 0, "an attempt outlived its call"
            return len(got)

    def threaded_calls(port: int) -> int:
        with _channel("argrpc", port, config) as ch:
            methods = [ch.stream_unary("/pkg.S/Collect").future,
                       ch.stream_stream("/pkg.S/Echo"), ch.stream_unary("/pkg.R/Collect").future]
            calls = []
            for i in range(24):
                call = methods[i % 3](requests(3), timeout=HANG_S)
                time.sleep(rng.uniform(0, 0.03))
                call.cancel()
                calls.append(call)
            for call in calls:
                deadline = time.monotonic() + HANG_S
                while not call.done() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert call.done(), "a cancelled call did not end"
                assert call.code().name in ends
            return len(calls)

    with busy_cores(2) if load == "busy" else contextlib.nullcontext(), \
            _argrpc_server(*handlers, workers=16) as port:
        assert asyncio.run(aio_calls(port)) == 24
        assert threaded_calls(port) == 24
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and any(
                t.name == "argrpc-attempts" for t in threading.enumerate()):
            time.sleep(0.01)
        assert not [t for t in threading.enumerate() if t.name == "argrpc-attempts"]
