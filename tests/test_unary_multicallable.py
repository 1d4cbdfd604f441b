"""The threaded API's unary-unary multicallable, which argrpc calls in C
(`_core.MultiCallableState`) when the call needs nothing of Python: what a caller may pass
it, what it answers and how it fails, side by side with grpc's, on every call (a
multicallable's later calls take the short way), and the short way itself."""
from __future__ import annotations

import logging
from typing import Any, Callable

import grpc
import pytest

from tests.support import inproc


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _metadata(request: bytes, context: grpc.ServicerContext) -> bytes:
    return repr(sorted((k, v) for k, v in context.invocation_metadata()
                       if k.startswith("x-"))).encode()


def _status(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_trailing_metadata((("x-t", "v"), ("x-t-bin", b"\x00\xff")))
    context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: \u00e9")


def _boom(value: Any) -> Any:
    raise ValueError("boom")


def _none(value: Any) -> None:
    return None


METHODS = {
    "echo": grpc.unary_unary_rpc_method_handler(_echo),
    "metadata": grpc.unary_unary_rpc_method_handler(_metadata),
    "status": grpc.unary_unary_rpc_method_handler(_status),
}


def _served(stack: str) -> Any:
    return inproc.threaded(stack, None, registered=("t.Multi", METHODS))


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except grpc.RpcError as e:
        return ("rpc", e.code(), e.details(), tuple(e.trailing_metadata() or ()))
    except Exception as e:  # noqa: BLE001 - the very thing compared
        return ("raised", type(e).__name__)


def _outcomes(channel: Any) -> list[tuple[Any, ...]]:
    echo = channel.unary_unary("/t.Multi/echo")
    metadata = channel.unary_unary("/t.Multi/metadata")
    status = channel.unary_unary("/t.Multi/status")
    ser_raises = channel.unary_unary("/t.Multi/echo", request_serializer=_boom)
    deser_raises = channel.unary_unary("/t.Multi/echo", response_deserializer=_boom)
    deser_none = channel.unary_unary("/t.Multi/echo", response_deserializer=_none)
    ser_none = channel.unary_unary("/t.Multi/echo", request_serializer=_none)
    codecs = channel.unary_unary("/t.Multi/echo", request_serializer=str.encode,
                                 response_deserializer=bytes.decode)
    out = []
    for _ in range(3):
        out += [
            _outcome(lambda: echo(b"a")),
            _outcome(lambda: echo(b"b", 10)),
            _outcome(lambda: echo(request=b"c", timeout=10)),
            _outcome(lambda: echo(b"d", timeout=10, metadata=None, credentials=None,
                                  wait_for_ready=True, compression=None)),
            _outcome(lambda: echo(b"e", metadata=())),
            _outcome(lambda: echo(b"", timeout=10)),
            _outcome(lambda: echo(b"f", timeout=-1)),
            _outcome(lambda: echo(b"f", timeout=-0.5)),
            _outcome(lambda: echo(b"f", timeout=float("nan"))),
            _outcome(lambda: metadata(b"", timeout=10, metadata=(("x-k", "v"),))),
            _outcome(lambda: status(b"", timeout=10)),
            _outcome(lambda: ser_raises(b"g", timeout=10)),
            _outcome(lambda: deser_raises(b"h", timeout=10)),
            _outcome(lambda: deser_none(b"i", timeout=10)),
            _outcome(lambda: ser_none(b"i", timeout=10)),
            _outcome(lambda: ser_none.future(b"i", timeout=10).result()),
            _outcome(lambda: deser_none.future(b"i", timeout=10).result()),
            _outcome(lambda: list(channel.unary_stream("/t.Multi/echo",
                                                       response_deserializer=_none)(b"s"))),
            _outcome(lambda: codecs("j\u00e9", timeout=10)),
            _outcome(lambda: echo(b"k", 10, timeout=10)),
            _outcome(lambda: echo(b"l", deadline=3)),
            _outcome(lambda: echo()),
        ]
    return out


def test_a_unary_multicallable_answers_as_grpcs(caplog: pytest.LogCaptureFixture) -> None:
    """Every argument form and outcome (a status with details and trailing metadata,
    codecs that raise or give None, an expired or NaN timeout, argument errors) as grpc gives
    them, three times each, with grpc's log lines for the codecs that raised."""
    caplog.set_level(logging.ERROR)
    logged = {}
    outcomes = {}
    for stack in ("grpc", "argrpc"):
        caplog.clear()
        with _served(stack) as channel:
            outcomes[stack] = _outcomes(channel)
            if stack == "argrpc":
                assert channel.transport == "shm"
        logged[stack] = sorted(r.getMessage() for r in caplog.records
                               if r.name.startswith("grpc"))
    for want, got in zip(outcomes["grpc"], outcomes["argrpc"]):
        assert got == want
    assert outcomes["argrpc"][0] == ("ok", b"a")
    assert outcomes["argrpc"][10][:3] == ("rpc", grpc.StatusCode.NOT_FOUND,
                                          "no such thing: \u00e9")
    assert logged["argrpc"] == logged["grpc"]
    assert logged["argrpc"].count("Exception serializing message!") == 3


def test_the_common_unary_call_takes_no_python_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common call is made in C: the class's _call_general, the Python way, is not
    asked; a call with metadata or a send limit is, and answers the same."""
    from argrpc import _client_calls

    general = _client_calls.UnaryUnary._call_general
    asked: list[Any] = []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(args)
        return general(self, *args, **kwargs)

    with _served("argrpc") as channel:
        echo = channel.unary_unary("/t.Multi/echo")
        assert echo(b"w", timeout=30) == b"w"  # its first call may take the long way
        monkeypatch.setattr(_client_calls.UnaryUnary, "_call_general", counted)
        for i in range(5):
            assert echo(b"%d" % i, timeout=30) == b"%d" % i
        assert echo(b"x") == b"x"
        assert asked == []
        assert echo(b"m", timeout=30, metadata=(("x-k", "v"),)) == b"m"
        assert asked == [(b"m",)]
        assert channel.transport == "shm"
