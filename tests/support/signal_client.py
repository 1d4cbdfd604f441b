"""Client process for tests/test_signals.py: its main thread blocks in one kind of wait
while the test sends it signals.

    python -m tests.support.signal_client --stack argrpc|grpc --target HOST:PORT
        --stubs DIR --wait unary|future|server_stream|stream_unary|bidi --tag TAG
        [--sleep-ms N] [--wait-limit-ms N]

SIGUSR1 and SIGTERM get a Python handler that records time.monotonic() (CLOCK_MONOTONIC,
system-wide on Linux, so the test compares it with the time it sent the signal) and lets
the wait go on; SIGINT keeps Python's default (KeyboardInterrupt). Two calls, one after
the other, each preceded by "WAITING <phase> <tag> <time>" printed just before the main thread
enters the wait (server_stream: after the first message arrived):

 1. phase "handler", tag TAG-h: the server handler sleeps --sleep-ms before answering.
    Prints "HANDLED <signal> <time>" from the handler as it runs, then
    "RETURNED <json>" once the call returned (or raised).
 2. phase "interrupt", tag TAG-i: the server handler waits until the call is cancelled
    (at most --wait-limit-ms). Prints "INTERRUPTED <time>" when KeyboardInterrupt came
    out of the wait ("NOT_INTERRUPTED <json>" if the call ended first); for the kinds that
    leave a call object (future, server_stream, bidi; the object is kept referenced) it
    then waits for that call to finish and prints "FINAL <json>" with its code/details.
    Then reads one line from stdin and exits 0 (the test first checks what the server
    saw, with this process and its channel still alive).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import grpc

from tests.support import stubs

WAITS = ("unary", "future", "server_stream", "stream_unary", "bidi")
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _on_signal(signum: int, frame: Any) -> None:
    now = time.monotonic()
    _emit(f"HANDLED {signal.Signals(signum).name} {now!r}")


def _waiting(phase: str, tag: str) -> None:
    _emit(f"WAITING {phase} {tag} {time.monotonic()!r}")


def _code(call: Any) -> dict[str, Any]:
    code = call.code()
    return {"code": code.name if code is not None else None, "details": call.details()}


def _handler_phase(stub: Any, pb2: Any, wait: str, tag: str, sleep_ms: int) -> dict[str, Any]:
    """One call whose answer comes after sleep_ms; returns what the call gave back."""
    req = pb2.EchoRequest(payload=b"phase-1", sleep_ms=sleep_ms, tag=tag)
    timeout = 30.0
    if wait == "unary":
        _waiting("handler", tag)
        resp = stub.Unary(req, timeout=timeout)
        return {"payload": resp.payload.decode(), "count": 1}
    if wait == "future":
        fut = stub.Unary.future(req, timeout=timeout)
        _waiting("handler", tag)
        resp = fut.result()
        return {"payload": resp.payload.decode(), "count": 1, **_code(fut)}
    if wait == "server_stream":
        req.response_count = 2
        it = stub.ServerStream(req, timeout=timeout)
        first = next(it)
        _waiting("handler", tag)
        second = next(it)
        rest = list(it)
        return {"payload": second.payload.decode(), "indexes": [first.index, second.index],
                "count": 2 + len(rest), **_code(it)}
    if wait == "stream_unary":
        _waiting("handler", tag)
        resp = stub.ClientStream(iter([req]), timeout=timeout)
        return {"payload": "", "count": resp.index}
    if wait == "bidi":
        it = stub.Bidi(iter([req]), timeout=timeout)
        _waiting("handler", tag)
        first = next(it)
        rest = list(it)
        return {"payload": first.payload.decode(), "count": 1 + len(rest), **_code(it)}
    raise ValueError(wait)


def _interrupt_phase(stub: Any, pb2: Any, wait: str, tag: str, limit_ms: int) -> None:
    req = pb2.EchoRequest(payload=b"phase-2", tag=tag, wait_for_cancel=True,
                          wait_limit_ms=limit_ms)
    timeout = 30.0
    call: Any = None
    try:
        if wait == "unary":
            _waiting("interrupt", tag)
            stub.Unary(req, timeout=timeout)
        elif wait == "future":
            call = stub.Unary.future(req, timeout=timeout)
            _waiting("interrupt", tag)
            call.result()
        elif wait == "server_stream":
            req.response_count = 1
            call = stub.ServerStream(req, timeout=timeout)
            next(call)
            _waiting("interrupt", tag)
            next(call)
        elif wait == "stream_unary":
            _waiting("interrupt", tag)
            stub.ClientStream(iter([req]), timeout=timeout)
        elif wait == "bidi":
            req.response_count = -1  # no response before waiting for the cancel
            call = stub.Bidi(iter([req]), timeout=timeout)
            _waiting("interrupt", tag)
            next(call)
        else:
            raise ValueError(wait)
    except KeyboardInterrupt:
        _emit(f"INTERRUPTED {time.monotonic()!r}")
    except BaseException as exc:  # the call ended before the interrupt
        _emit("NOT_INTERRUPTED " + json.dumps({"error": repr(exc)}))
    else:
        _emit("NOT_INTERRUPTED " + json.dumps({"error": None}))
    if call is not None:
        state = {"done_right_after": call.done()}
        end = time.monotonic() + limit_ms / 1000 + 10
        while not call.done() and time.monotonic() < end:
            time.sleep(0.02)
        state["done"] = call.done()
        if call.done():
            state.update(_code(call))
        _emit("FINAL " + json.dumps(state))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", choices=("argrpc", "grpc"), required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--stubs", required=True)
    p.add_argument("--wait", choices=WAITS, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--sleep-ms", type=int, default=1500)
    p.add_argument("--wait-limit-ms", type=int, default=2000)
    args = p.parse_args(argv)

    pb2, pb2_grpc = stubs.load(args.stubs)
    if args.stack == "argrpc":
        import argrpc
        channel = argrpc.insecure_channel(args.target, options=UNLIMITED)
    else:
        channel = grpc.insecure_channel(args.target, options=UNLIMITED)
    stub = pb2_grpc.EchoStub(channel)
    stub.Unary(pb2.EchoRequest(payload=b"warm-up"), timeout=60, wait_for_ready=True)
    _emit(f"TRANSPORT {getattr(channel, 'transport', 'grpc')}")

    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        result: dict[str, Any] = {"ok": True, **_handler_phase(
            stub, pb2, args.wait, f"{args.tag}-h", args.sleep_ms)}
    except Exception as exc:  # reported to the test, which asserts on it
        result = {"ok": False, "error": repr(exc)}
    result["time"] = time.monotonic()
    _emit("RETURNED " + json.dumps(result))

    _interrupt_phase(stub, pb2, args.wait, f"{args.tag}-i", args.wait_limit_ms)
    sys.stdin.readline()
    _emit("EXITING")
    return 0


if __name__ == "__main__":
    sys.exit(main())
