"""grpc's experimental non-blocking server handlers, on every pair.

grpc (grpc/_server.py, _stream_response_in_pool) calls a response-streaming behaviour
that has the attribute `experimental_non_blocking = True` as
`behavior(request_or_iterator, context, send_response)`: `send_response(msg)` sends a
message, `send_response(None)` ends the call with the context's code, details and
trailing metadata, and the behaviour may return (freeing its worker) long before that,
leaving a thread of its own to send. A unary-response behaviour with the flag is called
the normal way. The service is tests.support.servicer.nonblocking_handler; the expected
outcomes below are what grpc<->grpc gives.
"""
from __future__ import annotations

import queue
import time
from concurrent import futures
from typing import Any, Iterator

import grpc
import pytest

from tests.support.clients import Client, new_tag
from tests.support.servicer import EXCEPTION_TEXT, NONBLOCKING_SERVICE

DEADLINE_S = 10.0  # every call: a hang fails the test after this
STREAM = f"/{NONBLOCKING_SERVICE}/Stream"
BIDI = f"/{NONBLOCKING_SERVICE}/Bidi"
UNARY = f"/{NONBLOCKING_SERVICE}/Unary"
CODE = grpc.StatusCode.FAILED_PRECONDITION
DETAILS = "non-blocking handler's own words"
SENDERS = {"thread": "1", "behaviour": "0"}
BIDI_REQUESTS = [b"a", b"bb", b"ccc", b"dddd"]


def _md(sender: str, mode: str = "ok", **extra: str) -> list[tuple[str, str]]:
    md = [("x-thread", SENDERS[sender]), ("x-mode", mode), ("x-trailer", "tv-" + mode),
          ("x-code", str(CODE.value[0])), ("x-details", DETAILS)]
    return md + [(f"x-{k.replace('_', '-')}", v) for k, v in extra.items()]


def _trailer(call: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in (call.trailing_metadata() or ()) if k.startswith("x-")]


def _drain(call: Any) -> tuple[list[bytes], grpc.RpcError | None]:
    """Messages of a response stream, and the error that ended it (None if OK)."""
    got: list[bytes] = []
    try:
        for message in call:
            got.append(message)
    except grpc.RpcError as err:
        return got, err
    return got, None


def _start(client: Client, method: str, md: list[tuple[str, str]],
           timeout: float = DEADLINE_S) -> tuple[Any, list[bytes]]:
    """Start a Stream or Bidi call; returns the call and the messages it should give."""
    if method == "Stream":
        call = client.channel.unary_stream(STREAM)(b"req", metadata=md, timeout=timeout)
        count = int(dict(md).get("x-count", "3"))
        return call, [b"req:%d" % i for i in range(count)]
    call = client.channel.stream_stream(BIDI)(iter(BIDI_REQUESTS), metadata=md,
                                              timeout=timeout)
    return call, [b"echo:" + r for r in BIDI_REQUESTS]


@pytest.mark.parametrize("sender", list(SENDERS))
@pytest.mark.parametrize("method", ["Stream", "Bidi"])
def test_messages_in_order_then_ok(method: str, sender: str, client: Client) -> None:
    """With a thread sending (gaps between messages, the behaviour long returned) or the
    behaviour itself: every message in order, then OK with the trailing metadata set."""
    call, want = _start(client, method, _md(sender, count="5", gap_ms="20"))
    got, err = _drain(call)
    assert err is None, (err.code(), err.details())
    assert got == want
    assert call.code() == grpc.StatusCode.OK
    assert call.details() == ""
    assert _trailer(call) == [("x-trailer", "tv-ok")]


@pytest.mark.parametrize("mode", ["set_code", "abort"])
@pytest.mark.parametrize("sender", list(SENDERS))
@pytest.mark.parametrize("method", ["Stream", "Bidi"])
def test_status_set_before_the_end(method: str, sender: str, mode: str,
                                   client: Client) -> None:
    """context.set_code/set_details, or context.abort (its exception caught by the
    sender), then send_response(None): grpc ends the call with that code and details
    after every message, trailing metadata kept."""
    call, want = _start(client, method, _md(sender, mode))
    got, err = _drain(call)
    assert got == want
    assert err is not None, "the call ended OK"
    assert (err.code(), err.details()) == (CODE, DETAILS)
    assert _trailer(err) == [("x-trailer", "tv-" + mode)]


@pytest.mark.parametrize("method", ["Stream", "Bidi"])
def test_behaviour_that_raises_is_unknown(method: str, client: Client) -> None:
    call, _ = _start(client, method, _md("thread", "raise"))
    got, err = _drain(call)
    assert got == []
    assert err is not None, "the call ended OK"
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details() == f"Exception calling application: {EXCEPTION_TEXT}"


@pytest.mark.parametrize("method", ["Stream", "Bidi"])
def test_call_not_ended_without_send_response_none(method: str, client: Client) -> None:
    """The behaviour (and its thread) return without send_response(None): the call is
    not over when they return; the client gets its messages, then DEADLINE_EXCEEDED."""
    start = time.monotonic()
    call, want = _start(client, method, _md("thread", "never"), timeout=1.5)
    got, err = _drain(call)
    elapsed = time.monotonic() - start
    assert got == want
    assert err is not None, "the call ended OK"
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (err.code(), err.details())
    assert 1.0 < elapsed < DEADLINE_S, elapsed


def test_bidi_ping_pong_from_a_thread(client: Client) -> None:
    """Each request is sent only after the previous answer arrived; the sending thread
    reads the request iterator after the behaviour returned."""
    answers: queue.Queue[bytes] = queue.Queue()

    def requests() -> Iterator[bytes]:
        for index, request in enumerate(BIDI_REQUESTS):
            if index:
                answers.get(timeout=DEADLINE_S)
            yield request

    call = client.channel.stream_stream(BIDI)(requests(), metadata=_md("thread"),
                                              timeout=DEADLINE_S)
    got: list[bytes] = []
    for message in call:
        got.append(message)
        answers.put(message)
    assert got == [b"echo:" + r for r in BIDI_REQUESTS]
    assert call.code() == grpc.StatusCode.OK
    assert _trailer(call) == [("x-trailer", "tv-ok")]


@pytest.mark.parametrize("mode", ["ok", "set_code", "abort", "raise"])
def test_unary_behaviour_with_the_flag_is_called_normally(mode: str,
                                                          client: Client) -> None:
    method = client.channel.unary_unary(UNARY)
    md = _md("behaviour", mode)
    if mode == "ok":
        response, call = method.with_call(b"q", metadata=md, timeout=DEADLINE_S)
        assert response == b"unary:q"
        assert (call.code(), call.details()) == (grpc.StatusCode.OK, "")
        assert _trailer(call) == [("x-trailer", "tv-ok")]
        return
    with pytest.raises(grpc.RpcError) as info:
        method.with_call(b"q", metadata=md, timeout=DEADLINE_S)
    err = info.value
    if mode == "raise":
        assert err.code() == grpc.StatusCode.UNKNOWN
        assert err.details() == f"Exception calling application: {EXCEPTION_TEXT}"
    else:
        assert (err.code(), err.details()) == (CODE, DETAILS)
        assert _trailer(err) == [("x-trailer", "tv-" + mode)]


HELD_CALLS = 10  # more than the shared test server's 8 workers


def test_returned_behaviours_do_not_hold_workers(client: Client) -> None:
    """HELD_CALLS streams whose sending threads wait for a release, more than the server
    has workers: the behaviours returned, so a worker is still free to run the Unary
    call that releases them, and every stream then completes."""
    tag = new_tag()
    calls = []
    for index in range(HELD_CALLS):
        method = "Stream" if index % 2 else "Bidi"
        calls.append(_start(client, method, _md("thread", hold_tag=tag)))
    with futures.ThreadPoolExecutor(HELD_CALLS) as pool:
        drained = [pool.submit(_drain, call) for call, _ in calls]
        time.sleep(0.5)  # the held calls reach the server and their behaviours return
        assert not any(d.done() for d in drained), "a held call ended before the release"
        released = client.channel.unary_unary(UNARY)(
            b"", metadata=[("x-release", tag)], timeout=DEADLINE_S)
        assert released == b"released"
        for (call, want), done in zip(calls, drained):
            got, err = done.result(timeout=DEADLINE_S + 5)
            assert err is None, (err.code(), err.details())
            assert got == want
