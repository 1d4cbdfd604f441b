"""The server's thread pool, maximum_concurrent_rpcs and interceptors, as grpc has them.

Each test runs a server of one stack and a client of the other in this process, on every
pair (the grpc<->grpc reference included). argrpc<->argrpc goes over shared memory: the
fast path must give the user's executor exactly what grpc gives it.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import grpc
import pytest

import argrpc
from tests.support.clients import PAIRS, pair_id

OVER_LIMIT = "Concurrent RPC limit exceeded!"


def _stack(name: str) -> Any:
    return argrpc if name == "argrpc" else grpc


class Tally:
    """What the handlers saw: how many ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0

    def handler(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(float(request or b"0"))
        finally:
            with self.lock:
                self.active -= 1
        return b"ok"


class CountingExecutor(cf.Executor):
    """An Executor that is not a ThreadPoolExecutor (no private sizes to read)."""

    def __init__(self, threads: int) -> None:
        self._inner = cf.ThreadPoolExecutor(threads)
        self.submits = 0

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        self.submits += 1
        return self._inner.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._inner.shutdown(wait, cancel_futures=cancel_futures)


@contextlib.contextmanager
def serving(pair: tuple[str, str], pool: cf.Executor, *, limit: Optional[int] = None,
            interceptors: Sequence[grpc.ServerInterceptor] = (),
            handler: Optional[Callable] = None) -> Iterator[Callable[[], Any]]:
    """Yields a factory of fresh channels to a running server of pair[1]'s stack (of
    pair[0]'s stack unless told another)."""
    tally_handler = handler or Tally().handler
    server = _stack(pair[1]).server(pool, interceptors=interceptors,
                                    maximum_concurrent_rpcs=limit)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t", {"U": grpc.unary_unary_rpc_method_handler(tally_handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channels: list[Any] = []

    def channel(stack: Optional[str] = None) -> Any:
        ch = _stack(stack or pair[0]).insecure_channel(f"127.0.0.1:{port}")
        channels.append(ch)
        return ch

    try:
        yield channel
    finally:
        for ch in channels:
            ch.close()
        server.stop(None)


def fast(pair: tuple[str, str]) -> bool:
    return pair == ("argrpc", "argrpc")


def call_all(stub: Callable, payloads: Sequence[bytes], timeout: float = 30) -> list[Any]:
    """Sends every payload at once (one thread each); the code or RpcError of each."""
    out: list[Any] = [None] * len(payloads)

    def one(i: int) -> None:
        try:
            stub(payloads[i], timeout=timeout)
            out[i] = (grpc.StatusCode.OK, "")
        except grpc.RpcError as e:
            out[i] = (e.code(), e.details())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


pairs = pytest.mark.parametrize("pair", PAIRS, ids=[pair_id(p) for p in PAIRS])


@pairs
def test_start_takes_no_thread_of_the_pool(pair: tuple[str, str]) -> None:
    pool = CountingExecutor(4)
    with serving(pair, pool) as channel:
        time.sleep(0.3)
        assert pool.submits == 0, "the server took pool threads before any call"
        ch = channel()
        assert ch.unary_unary("/t/U")(b"0", timeout=20) == b"ok"
        assert pool.submits >= 1
        if fast(pair):
            assert ch.transport == "shm"
    pool.shutdown()


@pairs
def test_every_thread_of_the_pool_runs_a_handler(pair: tuple[str, str]) -> None:
    """A pool of 25 runs 25 handlers at once (not a count read from its private state)."""
    tally = Tally()
    pool = cf.ThreadPoolExecutor(25)
    with serving(pair, pool, handler=tally.handler) as channel:
        stub = channel().unary_unary("/t/U")
        stub(b"0", timeout=20)
        results = call_all(stub, [b"1.0"] * 30)
    assert [r[0] for r in results] == [grpc.StatusCode.OK] * 30
    assert tally.peak == 25, tally.peak
    pool.shutdown()


@pairs
def test_any_executor_bounds_the_handlers(pair: tuple[str, str]) -> None:
    tally = Tally()
    pool = CountingExecutor(3)
    with serving(pair, pool, handler=tally.handler) as channel:
        stub = channel().unary_unary("/t/U")
        results = call_all(stub, [b"0.3"] * 8)
    assert [r[0] for r in results] == [grpc.StatusCode.OK] * 8
    assert tally.peak == 3, tally.peak
    pool.shutdown()


@pairs
def test_calls_over_the_limit_are_refused(pair: tuple[str, str]) -> None:
    """Pool 25, limit 25, 30 slow calls at once: 25 OK and 5 RESOURCE_EXHAUSTED."""
    pool = cf.ThreadPoolExecutor(25)
    with serving(pair, pool, limit=25) as channel:
        ch = channel()
        stub = ch.unary_unary("/t/U")
        stub(b"0", timeout=20)
        # Long enough that all 30 arrive before any ends, on a machine that stalls.
        results = call_all(stub, [b"3"] * 30)
        codes = [r[0] for r in results]
        assert codes.count(grpc.StatusCode.OK) == 25, results
        refused = [r for r in results if r[0] is not grpc.StatusCode.OK]
        assert refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED, OVER_LIMIT)] * 5, refused
        if fast(pair):
            assert ch.transport == "shm"
        # The places come back: the limit is a count of calls in flight.
        assert stub(b"0", timeout=20) == b"ok"
    pool.shutdown()


@pairs
def test_a_refused_call_to_an_unknown_method_is_unimplemented(pair: tuple[str, str]) -> None:
    """grpc looks the handler up first: UNIMPLEMENTED wins over RESOURCE_EXHAUSTED."""
    pool = cf.ThreadPoolExecutor(4)
    with serving(pair, pool, limit=1) as channel:
        ch = channel()
        stub = ch.unary_unary("/t/U")
        stub(b"0", timeout=20)
        busy = stub.future(b"3", timeout=20)  # holds the place through a stall
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as over:
            stub(b"0", timeout=20)
        with pytest.raises(grpc.RpcError) as unknown:
            ch.unary_unary("/t/Nope")(b"0", timeout=20)
        assert busy.result() == b"ok"
    assert over.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
    pool.shutdown()


@pairs
def test_negotiation_is_not_counted_against_the_limit(pair: tuple[str, str]) -> None:
    """With the only place taken, a new channel's first call is refused as a call (not
    as a failed negotiation), and the channel still opens its fast path."""
    pool = cf.ThreadPoolExecutor(4)
    with serving(pair, pool, limit=1) as channel:
        busy = channel().unary_unary("/t/U").future(b"3", timeout=20)  # as above
        time.sleep(0.5)
        late = channel()
        with pytest.raises(grpc.RpcError) as over:
            late.unary_unary("/t/U")(b"0", timeout=20)
        assert (over.value.code(), over.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, OVER_LIMIT)
        if fast(pair):
            assert late.transport == "shm", late.fallback_reason
        assert busy.result() == b"ok"
        assert late.unary_unary("/t/U")(b"0", timeout=20) == b"ok"
    pool.shutdown()


class Recorder(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        self.methods.append(details.method)
        return continuation(details)


@pairs
def test_interceptors_see_only_the_users_calls(pair: tuple[str, str]) -> None:
    """An argrpc server keeps its negotiation from the user's interceptors. A plain grpc
    server cannot: an argrpc client asks it once per channel whether it speaks argrpc,
    and its interceptors see that question (answered UNIMPLEMENTED; README, "Differences
    from grpc")."""
    recorder = Recorder()
    pool = cf.ThreadPoolExecutor(4)
    with serving(pair, pool, interceptors=[recorder]) as channel:
        ch = channel()
        stub = ch.unary_unary("/t/U")
        stub(b"0", timeout=20)
        stub(b"0", timeout=20)
        if fast(pair):
            assert ch.transport == "shm"
    asked = ["/argrpc.v1.Bootstrap/Negotiate"] if pair == ("argrpc", "grpc") else []
    assert recorder.methods == asked + ["/t/U", "/t/U"]
    pool.shutdown()


class RequireToken(grpc.ServerInterceptor):
    """An auth interceptor: calls without the token are refused."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if ("authorization", "Bearer good") in (details.invocation_metadata or ()):
            return continuation(details)

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")

        return grpc.unary_unary_rpc_method_handler(deny)


@pairs
def test_an_auth_interceptor_guards_every_call(pair: tuple[str, str]) -> None:
    """Authorization applies per call on the fast path as on gRPC: the fast path opens
    (negotiation is argrpc's, not the service's), and every call on it meets the
    interceptor with its metadata before any handler runs."""
    pool = cf.ThreadPoolExecutor(4)
    with serving(pair, pool, interceptors=[RequireToken()]) as channel:
        ch = channel()
        stub = ch.unary_unary("/t/U")
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as denied:
                stub(b"0", timeout=20)
            assert (denied.value.code(), denied.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, "no token")
            assert stub(b"0", timeout=20, metadata=[("authorization", "Bearer good")]) == b"ok"
        if fast(pair):
            assert ch.transport == "shm"
    pool.shutdown()


@pairs
def test_the_pool_is_given_back_between_calls(pair: tuple[str, str]) -> None:
    """A pool of one thread shared with the application: its own work runs between
    calls (an idle server gives the thread back within about a second)."""
    pool = cf.ThreadPoolExecutor(1)
    with serving(pair, pool) as channel:
        stub = channel().unary_unary("/t/U")
        for _ in range(2):
            assert stub(b"0", timeout=20) == b"ok"
            assert pool.submit(lambda: "mine").result(timeout=5) == "mine"
    pool.shutdown()


@pairs
def test_the_grpc_port_is_served_while_fast_path_calls_keep_the_pool_busy(
        pair: tuple[str, str]) -> None:
    """Calls that keep every thread of the pool busy without a pause must not starve the
    calls that arrive on the gRPC port (a plain gRPC client's, a new channel's
    negotiation): grpc queues them in the pool behind the calls before them, so they
    run within a few calls' time. The calls are timed out generously: a starved call
    would wait for the load to end, which only comes after them."""
    pool = cf.ThreadPoolExecutor(2)
    stop = threading.Event()
    failures: list[BaseException] = []

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(0.002)
        return b"ok"

    with serving(pair, pool, handler=handler) as channel:
        busy = channel()
        stub = busy.unary_unary("/t/U")
        stub(b"", timeout=20)

        def load() -> None:
            try:
                while not stop.is_set():
                    stub(b"", timeout=20)
            except BaseException as e:  # reported by the test
                failures.append(e)

        loaders = [threading.Thread(target=load, daemon=True) for _ in range(6)]
        for t in loaders:
            t.start()
        try:
            time.sleep(0.3)  # every pool thread taken by the load
            plain = channel("grpc")
            assert plain.unary_unary("/t/U")(b"", timeout=20) == b"ok"
            fresh = channel()
            assert fresh.unary_unary("/t/U")(b"", timeout=20) == b"ok"
            if fast(pair):
                assert fresh.transport == "shm"
            assert not failures, failures
        finally:
            stop.set()
            for t in loaders:
                t.join(30)
    assert not failures, failures
    pool.shutdown()
