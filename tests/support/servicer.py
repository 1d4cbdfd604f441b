"""The Echo servicer run inside the server processes; it obeys EchoRequest's control fields."""
from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

import grpc
import numpy as np

from tests.support import payload, resources

CODES = {c.value[0]: c for c in grpc.StatusCode}
EXCEPTION_TEXT = "handler failed on purpose"
RAW_SERVICE = "argrpc.test.Raw"
RAW_METHOD = f"/{RAW_SERVICE}/Invert"


def encode_metadata(md: Iterable[tuple[str, Any]]) -> list[list[str]]:
    """JSON-safe metadata: binary values as base64 with a "b64:" prefix."""
    out = []
    for key, value in md:
        if isinstance(value, (bytes, bytearray, memoryview)):
            out.append([key, "b64:" + base64.b64encode(bytes(value)).decode()])
        else:
            out.append([key, value])
    return out


class Observations:
    """What handlers saw, per request tag; read back by tests with query="obs:<tag>"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, Any]] = {}

    def record(self, tag: str, **values: Any) -> None:
        with self._lock:
            self._data.setdefault(tag, {}).update(values)

    def get(self, tag: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._data.get(tag, {}))

    def all(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {tag: dict(values) for tag, values in self._data.items()}


class EchoServicer:
    """Implements argrpc.test.Echo; generated add_EchoServicer_to_server only needs the methods."""

    def __init__(self, pb2: ModuleType) -> None:
        self._pb2 = pb2
        self.obs = Observations()

    # -- helpers ---------------------------------------------------------------------
    def _report(self, context: grpc.ServicerContext) -> str:
        return json.dumps({
            "metadata": encode_metadata(context.invocation_metadata()),
            "time_remaining": context.time_remaining(),
            "peer": context.peer(),
            "transport": getattr(context, "transport", "grpc"),
            "transport_peer": getattr(context, "transport_peer", ""),
            "auth": {k: [v.decode() for v in vs] for k, vs in context.auth_context().items()},
        })

    def _control(self, req: Any, context: grpc.ServicerContext, fail: bool = True) -> None:
        """Apply the per-call controls carried by the first request of a call."""
        if req.tag:
            self.obs.record(req.tag, started=True)
        if req.sleep_ms:
            time.sleep(req.sleep_ms / 1000)
        if req.echo_metadata:
            md = [(k, v) for k, v in context.invocation_metadata() if k.startswith("x-")]
            context.send_initial_metadata(md)
            context.set_trailing_metadata(md)
        if fail:
            self._fail(req, context)

    def _fail(self, req: Any, context: grpc.ServicerContext) -> None:
        if req.abort_code:
            context.abort(CODES[req.abort_code], req.abort_details)
        if req.raise_exception:
            raise RuntimeError(EXCEPTION_TEXT)

    def _response(self, req: Any, context: grpc.ServicerContext, index: int = 0) -> Any:
        if req.digest_only:
            return self._pb2.EchoResponse(
                digest=payload.sha256(req.payload), size=len(req.payload), index=index)
        if req.response_size:
            body = payload.make(req.response_seed + index, req.response_size)
        else:
            body = req.payload
        return self._pb2.EchoResponse(
            payload=body, size=len(req.payload), index=index, info=self._report(context))

    def _wait_for_cancel(self, req: Any, context: grpc.ServicerContext) -> None:
        """Block until the client cancels (or the deadline passes); record what was seen."""
        tag = req.tag
        registered = context.add_callback(lambda: self.obs.record(tag, callback_ran=True))
        self.obs.record(tag, started=True, waiting=True, callback_registered=registered)
        limit = time.monotonic() + (req.wait_limit_ms or 30000) / 1000
        while context.is_active() and time.monotonic() < limit:
            time.sleep(0.01)
        self.obs.record(tag, wait_ended=True, is_active_after=context.is_active())

    def _query(self, req: Any) -> Any:
        if req.query.startswith("obs:"):
            info: Any = self.obs.get(req.query[4:])
        elif req.query == "resources":
            info = resources.snapshot()
        else:
            info = {"error": f"unknown query {req.query!r}"}
        return self._pb2.EchoResponse(info=json.dumps(info))

    def _finish_plain(self, req: Any, context: grpc.ServicerContext) -> bool:
        """set_code/set_details path: returns True when the call should end now. Details
        without a code are set on a call that then ends OK."""
        if req.set_code:
            context.set_code(CODES[req.set_code])
            context.set_details(req.set_details)
            return True
        if req.set_details:
            context.set_details(req.set_details)
        return False

    # -- the four arities ------------------------------------------------------------
    def Unary(self, req: Any, context: grpc.ServicerContext) -> Any:
        if req.query:
            return self._query(req)
        self._control(req, context)
        if req.wait_for_cancel:
            self._wait_for_cancel(req, context)
            return self._pb2.EchoResponse()
        if self._finish_plain(req, context):
            return self._pb2.EchoResponse()
        return self._response(req, context)

    def ServerStream(self, req: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._control(req, context, fail=not req.fail_after)
        count = 1 if req.response_count == 0 else max(req.response_count, 0)
        for index in range(count):
            if req.fail_after and index == req.fail_after:
                self._fail(req, context)
            if index and req.sleep_ms:
                time.sleep(req.sleep_ms / 1000)
            yield self._response(req, context, index)
        if req.wait_for_cancel:
            self._wait_for_cancel(req, context)
            return
        self._finish_plain(req, context)

    def ClientStream(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        digest = hashlib.sha256()
        size = count = 0
        first = None
        for req in requests:
            if first is None:
                first = req
                self._control(req, context)
                if req.wait_for_cancel:
                    self._wait_for_cancel(req, context)
                    return self._pb2.EchoResponse()
            digest.update(req.payload)
            size += len(req.payload)
            count += 1
        if first is not None and self._finish_plain(first, context):
            return self._pb2.EchoResponse()
        return self._pb2.EchoResponse(
            digest=digest.digest(), size=size, index=count, info=self._report(context))

    def Bidi(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        first = None
        for req in requests:
            if first is None:
                first = req
                self._control(req, context)
            elif req.sleep_ms:
                time.sleep(req.sleep_ms / 1000)
            count = 1 if req.response_count == 0 else max(req.response_count, 0)
            for index in range(count):
                yield self._response(req, context, index)
            if req.wait_for_cancel:
                self._wait_for_cancel(req, context)
                return
        if first is not None:
            self._finish_plain(first, context)


def raw_handler(buffer_serializer: bool) -> grpc.GenericRpcHandler:
    """A protobuf-free service: the response is the request with every byte inverted.

    With `buffer_serializer` the handler's numpy array goes to the transport as is (argrpc
    accepts any buffer-protocol object); plain grpc needs bytes.
    """

    def invert(request: Any, context: grpc.ServicerContext) -> np.ndarray:
        return np.bitwise_not(np.frombuffer(request, dtype=np.uint8))

    serializer: Callable[[np.ndarray], Any] = (
        (lambda a: a) if buffer_serializer else (lambda a: a.tobytes()))
    return grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Invert": grpc.unary_unary_rpc_method_handler(
            invert, request_deserializer=None, response_serializer=serializer),
    })


HOLD_SERVICE = "argrpc.test.Hold"
HOLD_METHOD = f"/{HOLD_SERVICE}/Digest"


def hold_handler() -> grpc.GenericRpcHandler:
    """A protobuf-free service that keeps the received buffer while it waits.

    The request deserializer returns the buffer it is handed as is (on argrpc's shm path a
    large message is a read-only view of the sender's pool block, so holding it keeps that
    block in use). Controlled by invocation metadata:
      x-hold-ms     keep the request this long (0 if absent) before answering;
      x-hold-tag    ... or until a call with x-release=<the same tag> arrives, if sooner;
      x-release     release every call held under this tag and answer at once.
    The answer is JSON bytes: sha256 hex and size of the request, the buffer's type name,
    whether it was read-only, and whether the hold ended by release.
    """
    lock = threading.Lock()
    releases: dict[str, threading.Event] = {}

    def event(tag: str) -> threading.Event:
        with lock:
            return releases.setdefault(tag, threading.Event())

    def digest(request: Any, context: grpc.ServicerContext) -> bytes:
        md = dict(context.invocation_metadata())
        if "x-release" in md:
            event(md["x-release"]).set()
            return json.dumps({"released": md["x-release"]}).encode()
        hold_s = int(md.get("x-hold-ms", "0")) / 1000
        released = False
        if hold_s and "x-hold-tag" in md:
            released = event(md["x-hold-tag"]).wait(hold_s)
        elif hold_s:
            time.sleep(hold_s)
        view = memoryview(request)
        return json.dumps({
            "sha256": hashlib.sha256(view).hexdigest(),
            "size": view.nbytes,
            "kind": type(request).__name__,
            "readonly": view.readonly,
            "released": released,
        }).encode()

    return grpc.method_handlers_generic_handler(HOLD_SERVICE, {
        "Digest": grpc.unary_unary_rpc_method_handler(
            digest, request_deserializer=lambda buf: buf, response_serializer=None),
    })


NONBLOCKING_SERVICE = "argrpc.test.NonBlocking"


def nonblocking_handler() -> grpc.GenericRpcHandler:
    """A protobuf-free service whose behaviours carry grpc's `experimental_non_blocking`
    flag. grpc calls a response-streaming behaviour with the flag as
    `behavior(request_or_iterator, context, send_response)`: `send_response(msg)` sends a
    message, `send_response(None)` ends the call with the context's status (code,
    details, trailing metadata); the behaviour may return before the call has ended.
    A unary-response behaviour with the flag is called normally.

    Methods (requests and responses are bytes):
      Stream (unary-stream)  answers x-count messages b"<request>:<i>", i = 0.. ;
      Bidi (stream-stream)   answers every request r with b"echo:" + r as it arrives;
      Unary (unary-unary)    answers b"unary:" + request (called the normal way), or
                             b"released" to x-release (see x-hold-tag).
    Controlled by invocation metadata:
      x-thread   "1": the behaviour starts a thread that does the sending and returns at
                 once; otherwise the behaviour sends itself before it returns;
      x-count    Stream: number of messages (default 3);
      x-gap-ms   sleep this long before every message (default 0);
      x-mode     how the call ends after the messages:
                   "ok" (default)  send_response(None);
                   "set_code"      context.set_code(x-code)/set_details(x-details), then
                                   send_response(None) (Unary: return the response);
                   "abort"         context.abort(x-code, x-details); the sender catches
                                   the exception and then calls send_response(None);
                   "raise"         the behaviour raises RuntimeError(EXCEPTION_TEXT)
                                   before sending anything;
                   "never"         never calls send_response(None);
      x-code     status code number for set_code/abort;
      x-details  status details for set_code/abort;
      x-trailer  set as trailing metadata ("x-trailer", value) before the call ends;
      x-hold-tag Stream/Bidi: wait (at most 20 s) before sending anything until a Unary
                 call with x-release=<the same tag> arrives (with x-thread=1 the wait is
                 on the sending thread, so the server's worker is free meanwhile).
    """
    lock = threading.Lock()
    releases: dict[str, threading.Event] = {}

    def event(tag: str) -> threading.Event:
        with lock:
            return releases.setdefault(tag, threading.Event())

    def settings(context: grpc.ServicerContext) -> dict[str, str]:
        return {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}

    def finish(md: dict[str, str], context: grpc.ServicerContext,
               send_response: Callable[[Any], None]) -> None:
        if "x-trailer" in md:
            context.set_trailing_metadata((("x-trailer", md["x-trailer"]),))
        mode = md.get("x-mode", "ok")
        if mode == "never":
            return
        if mode == "set_code":
            context.set_code(CODES[int(md["x-code"])])
            context.set_details(md.get("x-details", ""))
        elif mode == "abort":
            try:
                context.abort(CODES[int(md["x-code"])], md.get("x-details", ""))
            except Exception:  # abort raises to end a blocking handler; here we go on
                pass
        send_response(None)

    def gap(md: dict[str, str]) -> None:
        if int(md.get("x-gap-ms", "0")):
            time.sleep(int(md["x-gap-ms"]) / 1000)

    def start(md: dict[str, str], work: Callable[[], None]) -> None:
        if md.get("x-mode") == "raise":
            raise RuntimeError(EXCEPTION_TEXT)
        if md.get("x-thread") == "1":
            threading.Thread(target=work, daemon=True).start()
        else:
            work()

    def stream(request: bytes, context: grpc.ServicerContext,
               send_response: Callable[[Any], None]) -> None:
        md = settings(context)

        def work() -> None:
            if "x-hold-tag" in md:
                event(md["x-hold-tag"]).wait(20)
            for index in range(int(md.get("x-count", "3"))):
                gap(md)
                send_response(request + b":%d" % index)
            finish(md, context, send_response)

        start(md, work)

    def bidi(requests: Iterator[bytes], context: grpc.ServicerContext,
             send_response: Callable[[Any], None]) -> None:
        md = settings(context)

        def work() -> None:
            if "x-hold-tag" in md:
                event(md["x-hold-tag"]).wait(20)
            for request in requests:
                gap(md)
                send_response(b"echo:" + request)
            finish(md, context, send_response)

        start(md, work)

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        md = settings(context)
        if "x-release" in md:
            event(md["x-release"]).set()
            return b"released"
        if md.get("x-mode") == "raise":
            raise RuntimeError(EXCEPTION_TEXT)
        if "x-trailer" in md:
            context.set_trailing_metadata((("x-trailer", md["x-trailer"]),))
        if md.get("x-mode") == "set_code":
            context.set_code(CODES[int(md["x-code"])])
            context.set_details(md.get("x-details", ""))
        elif md.get("x-mode") == "abort":
            context.abort(CODES[int(md["x-code"])], md.get("x-details", ""))
        return b"unary:" + request

    for behavior in (stream, bidi, unary):
        setattr(behavior, "experimental_non_blocking", True)
    return grpc.method_handlers_generic_handler(NONBLOCKING_SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
    })
