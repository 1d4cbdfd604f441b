"""server.stop(grace): in-flight calls get the grace, then are cancelled; new calls refused.

What the client sees for a call cut off by stop() is grpc's: UNAVAILABLE "Cancelling all
calls" (grpc-core's cancel_all_calls), while the handler sees is_active() turn false and
its add_callback callbacks run.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import grpc
import pytest

from tests.support.clients import UNLIMITED, UNLIMITED_SERVER_ARGS, Client, new_tag


CUT_OFF = (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")


def _assert_handler_saw_cancel(report: dict[str, Any], tag: str) -> None:
    obs = report["observations"].get(tag, {})
    assert obs.get("wait_ended") and obs.get("is_active_after") is False, obs
    assert obs.get("callback_ran"), f"add_callback callback did not run: {obs}"


def _started(obs: dict[str, Any]) -> bool:
    return bool(obs.get("started"))


def _waiting(obs: dict[str, Any]) -> bool:
    return bool(obs.get("waiting"))


def _stop_in_background(server: Any, grace: float | None) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(server.stop(grace)), daemon=True)
    thread.start()
    return thread, result


def test_stop_grace_finishes_short_cancels_long(pair: tuple[str, str],
                                                spawn: Callable[..., Any],
                                                connect: Callable[..., Client]) -> None:
    server = spawn(pair[1], UNLIMITED_SERVER_ARGS)
    client = connect(pair[0], server, UNLIMITED)
    short_tag, long_tag = new_tag(), new_tag()
    short = client.stub.Unary.future(
        client.req(tag=short_tag, sleep_ms=1500, payload=b"short"), timeout=30)
    long = client.stub.Unary.future(
        client.req(tag=long_tag, wait_for_cancel=True, wait_limit_ms=60000), timeout=30)
    stream = client.stub.ServerStream(
        client.req(response_count=1000, sleep_ms=100, payload=b"s"), timeout=30)
    next(stream)
    assert _started(client.wait_obs(short_tag, _started))
    assert _waiting(client.wait_obs(long_tag, _waiting))

    thread, result = _stop_in_background(server, 4.0)
    assert short.result(timeout=20).payload == b"short", "in-flight call must finish in grace"
    exc = long.exception(timeout=30)
    assert exc is not None, "call outliving the grace must end"
    assert (exc.code(), exc.details()) == CUT_OFF, (exc.code(), exc.details())
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert (info.value.code(), info.value.details()) == CUT_OFF
    thread.join(60)
    assert result == [True]

    # a stopped server takes no new calls
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Unary(client.req(payload=b"late"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    _assert_handler_saw_cancel(server.finish(), long_tag)


def test_stop_without_grace_cancels_at_once(pair: tuple[str, str], spawn: Callable[..., Any],
                                            connect: Callable[..., Client]) -> None:
    server = spawn(pair[1], UNLIMITED_SERVER_ARGS)
    client = connect(pair[0], server, UNLIMITED)
    tag = new_tag()
    fut = client.stub.Unary.future(
        client.req(tag=tag, wait_for_cancel=True, wait_limit_ms=60000), timeout=30)
    assert _waiting(client.wait_obs(tag, _waiting))
    assert server.stop(None) is True
    exc = fut.exception(timeout=20)
    assert exc is not None and (exc.code(), exc.details()) == CUT_OFF, exc
    _assert_handler_saw_cancel(server.finish(), tag)


def test_idle_stop_and_exit_report(pair: tuple[str, str], spawn: Callable[..., Any],
                                   connect: Callable[..., Client]) -> None:
    """After stop the worker pool shuts down (argrpc's worker loops must end too)."""
    server = spawn(pair[1], UNLIMITED_SERVER_ARGS)
    client = connect(pair[0], server, UNLIMITED)
    assert client.stub.Unary(client.req(payload=b"x"), timeout=20).payload == b"x"
    client.close()
    assert server.stop(1.0) is True
    report = server.finish()
    assert report["stop_ok"] is True
    assert report["executor_shutdown_ok"] is True, "executor threads did not end after stop"
