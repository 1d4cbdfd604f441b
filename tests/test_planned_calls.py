"""A threaded server's registered unary-unary methods, which argrpc serves in one C
crossing (`_core.serve_planned`) when nothing about the call needs Python: every outcome
side by side with grpc's (status, details, trailing metadata, response, log line), and
each call in a contextvars.Context of its own, as grpc runs it."""
from __future__ import annotations

import contextvars
import logging
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import pytest

from tests.support import inproc

_SEEN: contextvars.ContextVar[str] = contextvars.ContextVar("seen")


def _boom(*args: Any) -> Any:
    raise ValueError("boom")


def _echo(request: Any, context: grpc.ServicerContext) -> Any:
    return request


def _remember(request: bytes, context: grpc.ServicerContext) -> bytes:
    """What an earlier call left in the context, then leaves its own mark."""
    before = _SEEN.get("")
    _SEEN.set(request.decode())
    return before.encode()


def _set_status(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("no such thing")
    return request


def _set_ok_code(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.OK)
    return request


def _trailing(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_trailing_metadata((("x-t", "v"),))
    return request


def _abort(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "go away")


def _initial_then_answer(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.send_initial_metadata((("x-i", "w"),))
    return request


def _text(request: bytes, context: grpc.ServicerContext) -> str:
    return "text"


def _texts(request: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
    yield b"first"
    yield "text"


def _nothing(request: bytes, context: grpc.ServicerContext) -> None:
    return None


def _none(*args: Any) -> None:
    return None


_KEPT: list[grpc.ServicerContext] = []
_CALLED_BACK: list[bytes] = []


def _calls_back(request: bytes, context: grpc.ServicerContext) -> bytes:
    added = context.add_callback(lambda: _CALLED_BACK.append(request))
    return b"added" if added else b"refused"


def _keeps_context(request: bytes, context: grpc.ServicerContext) -> bytes:
    _KEPT.append(context)
    return request


def _uu(behavior: Callable[..., Any], **codecs: Any) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(behavior, **codecs)


METHODS = {
    "echo": _uu(_echo),
    "codecs": _uu(_echo, request_deserializer=bytes.decode, response_serializer=str.encode),
    "raises": _uu(_boom),
    "deser_raises": _uu(_echo, request_deserializer=_boom),
    "deser_none": _uu(_echo, request_deserializer=_none),
    "ser_raises": _uu(_echo, response_serializer=_boom),
    "ser_none": _uu(_echo, response_serializer=_none),
    "status": _uu(_set_status),
    "ok_code": _uu(_set_ok_code),
    "trailing": _uu(_trailing),
    "abort": _uu(_abort),
    "initial": _uu(_initial_then_answer),
    "nothing": _uu(_nothing),
    "remember": _uu(_remember),
    "calls_back": _uu(_calls_back),
    "keeps_context": _uu(_keeps_context),
}


def _served(stack: str, options: Any = ()) -> Any:
    return inproc.threaded(stack, None, server_options=options,
                           registered=("t.Planned", METHODS))


def _outcome(channel: Any, name: str, request: bytes = b"hi") -> tuple[Any, ...]:
    call = channel.unary_unary(f"/t.Planned/{name}", _registered_method=True)
    try:
        response, c = call.with_call(request, timeout=20)
        return ("ok", response, c.code(), c.details(), tuple(c.trailing_metadata() or ()))
    except grpc.RpcError as e:
        return ("error", e.code(), e.details(),
                tuple((k, v) for k, v in (e.trailing_metadata() or ())))


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records
            if r.name.startswith("grpc")]


def test_every_outcome_of_a_planned_call_is_grpcs(caplog: pytest.LogCaptureFixture) -> None:
    """Each method's outcome twice (the second call of a method is the one a warm worker
    serves in C), and the log lines of the failing ones, against grpc's."""
    caplog.set_level(logging.ERROR)
    seen: dict[str, list[Any]] = {}
    for stack in ("grpc", "argrpc"):
        with _served(stack) as channel:
            if stack == "argrpc":
                assert _outcome(channel, "echo") == ("ok", b"hi", grpc.StatusCode.OK, "", ())
                assert channel.transport == "shm"
            results = []
            for name in METHODS:
                if name in ("remember", "calls_back", "keeps_context"):
                    continue
                for _ in range(2):
                    caplog.clear()
                    results.append((name, _outcome(channel, name), _logged(caplog)))
            seen[stack] = results
    for (name, want, want_logs), (_, got, got_logs) in zip(seen["grpc"], seen["argrpc"]):
        assert got == want, name
        # the logger, level and first words of each line (grpc's traceback text differs)
        assert [(n, lv, m.split("\n")[0][:48]) for n, lv, m in got_logs] == \
            [(n, lv, m.split("\n")[0][:48]) for n, lv, m in want_logs], name


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_each_planned_call_runs_in_a_context_of_its_own(stack: str) -> None:
    """What a handler sets in a ContextVar is gone in the next call, as with grpc."""
    with _served(stack) as channel:
        remember = channel.unary_unary("/t.Planned/remember", _registered_method=True)
        assert [remember(b"%d" % i, timeout=20) for i in range(5)] == [b""] * 5


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_planned_calls_callbacks_run_once_it_ends(stack: str) -> None:
    """A callback the handler adds runs once, after the call; a context kept past its
    call refuses a callback, as grpc's does."""
    _KEPT.clear()
    _CALLED_BACK.clear()
    with _served(stack) as channel:
        calls_back = channel.unary_unary("/t.Planned/calls_back", _registered_method=True)
        keeps = channel.unary_unary("/t.Planned/keeps_context", _registered_method=True)
        for i in range(5):
            assert calls_back(b"%d" % i, timeout=20) == b"added"
            assert keeps(b"k", timeout=20) == b"k"
        limit = time.monotonic() + 10  # a bound on a hang: the callbacks run after the answer
        while len(_CALLED_BACK) < 5 and time.monotonic() < limit:
            time.sleep(0.01)
        assert sorted(_CALLED_BACK) == [b"%d" % i for i in range(5)]
        # The client may have its answer before the server marks the call over (grpc's
        # own server does so after its send): asked until refused, within the bound.
        refused = []
        for context in _KEPT:
            while context.add_callback(lambda: None) and time.monotonic() < limit:
                time.sleep(0.01)
            refused.append(not context.add_callback(lambda: None))
        assert refused == [True] * 5
        time.sleep(0.1)
        assert len(_CALLED_BACK) == 5


@pytest.mark.parametrize("stack", ["grpc", "argrpc"])
def test_a_planned_call_over_the_send_limit(stack: str) -> None:
    with _served(stack, [("grpc.max_send_message_length", 8)]) as channel:
        echo = channel.unary_unary("/t.Planned/echo", _registered_method=True)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as e:
                echo(b"x" * 64, timeout=20)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Sent message larger than max (64 vs. 8)" in (e.value.details() or "")


def test_a_warm_workers_planned_call_takes_no_python_frame(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the request is there with the call, the Python way (serve_unary) is not
    asked; a call that stops half-way goes on in carry_on_unary."""
    from argrpc import _handlers

    asked: list[str] = []
    python_way = _handlers.serve_unary
    carry_on = _handlers.carry_on_unary

    def counted(state: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(state.method)
        return python_way(state, *args, **kwargs)

    def carried(state: Any, plan: Any, max_send: int, stage: int, value: Any) -> Any:
        asked.append(f"carry_on {stage}")
        return carry_on(state, plan, max_send, stage, value)

    def until_seen(name: str, code: grpc.StatusCode, mark: str) -> None:
        # The request comes with the call's headers, but on a busy machine a worker may
        # take the call while the engine is still reading the frame behind them: that
        # call waits for its request the Python way. Asked again until one did not.
        for _ in range(50):
            asked.clear()
            assert _outcome(channel, name)[1] == code
            if asked == [mark]:
                return
            assert asked == [f"/t.Planned/{name}"]
        pytest.fail(f"every {name} call took the Python way")

    with _served("argrpc") as channel:
        assert _outcome(channel, "echo")[0] == "ok"
        monkeypatch.setattr(_handlers, "serve_unary", counted)
        monkeypatch.setattr(_handlers, "carry_on_unary", carried)
        in_c = 0
        for _ in range(100):
            before = len(asked)
            assert _outcome(channel, "echo") == ("ok", b"hi", grpc.StatusCode.OK, "", ())
            in_c += len(asked) == before
            if in_c == 20:
                break
        assert in_c == 20
        assert set(asked) <= {"/t.Planned/echo"}
        until_seen("status", grpc.StatusCode.NOT_FOUND, "carry_on 3")
        until_seen("raises", grpc.StatusCode.UNKNOWN, "carry_on 2")


def test_a_response_that_is_no_buffer_fails_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """A handler that answers a str with no response serializer, or a serializer that
    gives one: grpc's server leaves the call until its deadline; argrpc's ends it
    INTERNAL at once (a difference listed in the README), planned or not, unary or
    streamed, says why in its log, and calls the serializer once."""
    caplog.set_level(logging.ERROR)
    serialized: list[Any] = []

    def to_text(response: Any) -> str:
        serialized.append(response)
        return "text"

    by_serializer = grpc.unary_unary_rpc_method_handler(_echo, response_serializer=to_text)
    generic = grpc.method_handlers_generic_handler("t.Generic", {
        "text": _uu(_text), "texts": grpc.unary_stream_rpc_method_handler(_texts),
        "serialized": by_serializer})
    server = inproc.stack_module("argrpc").server(futures.ThreadPoolExecutor(2))
    server.add_registered_method_handlers("t.Planned", {"text": _uu(_text),
                                                        "serialized": by_serializer})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    import argrpc
    channel = argrpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        for path in ("/t.Planned/text", "/t.Planned/text", "/t.Generic/text",
                     "/t.Planned/serialized", "/t.Planned/serialized",
                     "/t.Generic/serialized"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(path)(b"", timeout=20)
            assert (e.value.code(), e.value.details()) == \
                (grpc.StatusCode.INTERNAL, "Failed to serialize response!"), path
        assert channel.transport == "shm"
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for m in channel.unary_stream("/t.Generic/texts")(b"", timeout=20):
                got.append(m)
        assert got == [b"first"]
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "the response is a str, not bytes-like" in caplog.text
        assert "the response_serializer gave a str, not bytes-like" in caplog.text
        assert len(serialized) == 3
    finally:
        channel.close()
        server.stop(None)
