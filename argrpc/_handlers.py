"""Run one `grpc.RpcMethodHandler` of any arity against a `_core.ServerCall`.

Statuses and details strings follow `grpc._server` exactly, so a client cannot tell from
the outcome whether the call went over gRPC or the fast path. Runs in the worker thread
that accepted the call: no handoff.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, cast

import grpc

from . import _grpc_log, _metadata, _status
from ._context import _CallState, _ServicerContext
from ._errors import USER_CODE_FAILED, codec_failed, user_codec
from ._grpc_payloads import is_buffer

_LOGGER = _grpc_log.SERVER
_ARGRPC_LOG = logging.getLogger(__name__)  # argrpc's own words, under its own name



# Sentinel: "no request; the call was already ended (or is dead)".
_NO_REQUEST = object()
_NO_METADATA: list[Any] = []  # never changed: the engine copies what it is given


def code_int(code: Any) -> int:
    """grpc maps anything that is not a StatusCode to UNKNOWN."""
    if isinstance(code, grpc.StatusCode):
        return code.value[0]
    return _status.UNKNOWN


def _finish(state: _CallState, code: int, details: str, message: Any = None) -> None:
    if state.finished:
        return
    state.finished = True
    md = state.trailing_metadata
    trailing: list[Any] = []
    if md:
        try:
            trailing = _metadata.to_core(md)
        except (ValueError, TypeError) as exc:
            # grpc's core refuses the status batch; its client sees this.
            _LOGGER.error("invalid trailing metadata: %s", exc)
            code, details, message = _status.INTERNAL, _status.INVALID_METADATA, None
    state.sc.finish(code, details, trailing, message)


def _finish_with_state(state: _CallState, default_code: int, default_details: str) -> None:
    """grpc's `_abort`: a code/details the application set win over the defaults."""
    code = default_code if state.code is None else code_int(state.code)
    details = default_details if state.details is None else state.details
    _finish(state, code, details)


def _finish_ok(state: _CallState, message: Any) -> None:
    code = _status.OK if state.code is None else code_int(state.code)
    details = "" if state.details is None else state.details
    # A response next to an error status is discarded by every client: don't ship it.
    _finish(state, code, details, message if code == _status.OK else None)


def _on_exception(state: _CallState, exc: BaseException, what: str) -> None:
    if state.aborted:
        _finish_with_state(state, _status.UNKNOWN, "RPC Aborted")
        return
    if exc in state.rpc_errors:
        # We raised it because the call died; there is nobody to report to.
        state.finished = True
        return
    try:
        details = "{}: {}".format(what, exc)
    except Exception:  # an exception whose __str__ raises
        details = "Calling application raised unprintable Exception!"
    _LOGGER.error(details, exc_info=exc)  # also outside the except block that caught it
    _finish_with_state(state, _status.UNKNOWN, details)


def _deserialize(state: _CallState, raw: Any, deserializer: Optional[Callable[..., Any]]) -> Any:
    if deserializer is None:
        return raw
    request = user_codec(deserializer, raw, "deserializing")
    if request is None or request is USER_CODE_FAILED:
        # grpc treats a None result like a failure too.
        _finish(state, _status.INTERNAL, "Exception deserializing request!")
        return _NO_REQUEST
    return request


def _serialize(state: _CallState, response: Any, serializer: Optional[Callable[..., Any]],
               max_send: int) -> Any:
    """Returns the wire form (bytes or any buffer: passed on as is), or None on failure
    (the call is then finished)."""
    serialized = (response if serializer is None
                  else user_codec(serializer, response, "serializing"))
    if serialized is None or serialized is USER_CODE_FAILED:
        _finish_with_state(state, _status.INTERNAL, "Failed to serialize response!")
        return None
    if type(serialized) is not bytes and not is_buffer(serialized):
        _not_bytes(state, serialized, serializer)
        return None
    if max_send >= 0:
        size = len(serialized) if type(serialized) is bytes else memoryview(serialized).nbytes
        if size > max_send:
            # grpc's exact text, "SERVER: " prefix included.
            _finish(state, _status.RESOURCE_EXHAUSTED,
                    "SERVER: Sent message larger than max ({} vs. {})".format(size, max_send))
            return None
    return serialized


def _not_bytes(state: _CallState, serialized: Any, serializer: Optional[Callable[..., Any]]) -> None:
    """Ends the call whose wire form is no buffer. grpc's server leaves such a call until
    its deadline (its send raises in the handler's thread); the client is told at once."""
    if serializer is None:
        _ARGRPC_LOG.error("%s: the response is a %s, not bytes-like: no response_serializer?",
                          state.method, type(serialized).__name__)
    else:
        _ARGRPC_LOG.error("%s: the response_serializer gave a %s, not bytes-like",
                          state.method, type(serialized).__name__)
    _finish_with_state(state, _status.INTERNAL, "Failed to serialize response!")


def _unary_request(state: _CallState, deserializer: Optional[Callable[..., Any]]) -> Any:
    raw = state.sc.recv()
    if raw is None:
        return _no_request(state)
    return _deserialize(state, raw, deserializer)


def _no_request(state: _CallState) -> Any:
    """A unary call's request did not come: ends the call as grpc would."""
    sc = state.sc
    if sc.cancelled or not sc.is_active():
        state.finished = True
        return _NO_REQUEST
    _finish(state, _status.UNIMPLEMENTED,
            '"{}" requires exactly one request message.'.format(state.method))
    return _NO_REQUEST


class _RequestIterator:
    """What a request-streaming handler iterates: pulls `sc.recv()` until None."""

    __slots__ = ("_state", "_deserializer")

    def __init__(self, state: _CallState, deserializer: Optional[Callable[..., Any]]) -> None:
        self._state = state
        self._deserializer = deserializer

    def __iter__(self) -> "_RequestIterator":
        return self

    def __next__(self) -> Any:
        state = self._state
        if state.finished:
            raise StopIteration()
        raw = state.sc.recv()
        if raw is None:
            if state.sc.cancelled:
                state.raise_rpc_error()
            raise StopIteration()
        request = _deserialize(state, raw, self._deserializer)
        if request is _NO_REQUEST:
            raise StopIteration()
        return request

    next = __next__


def _call(state: _CallState, behavior: Callable[..., Any], argument: Any,
          context: _ServicerContext) -> tuple[Any, bool]:
    try:
        return behavior(argument, context), True
    except Exception as exc:
        _on_exception(state, exc, _status.EXCEPTION_CALLING)
        return None, False


def _respond_unary(state: _CallState, response: Any, serializer: Optional[Callable[..., Any]],
                   max_send: int) -> None:
    if state.finished:
        return
    serialized = _serialize(state, response, serializer, max_send)
    if serialized is not None:
        # One batch: initial metadata (if not sent) + message + status.
        _finish_ok(state, serialized)


def _respond_stream(state: _CallState, responses: Iterator[Any],
                    serializer: Optional[Callable[..., Any]], max_send: int) -> None:
    while not state.finished:
        try:
            response = next(responses)
        except StopIteration:
            break
        except Exception as exc:
            _on_exception(state, exc, "Exception iterating responses")
            return
        if not _send_one(state, response, serializer, max_send):
            return
    _finish_ok(state, None)


def _send_one(state: _CallState, response: Any, serializer: Optional[Callable[..., Any]],
              max_send: int) -> bool:
    """Sends one streamed response; False once nothing more can go out."""
    serialized = _serialize(state, response, serializer, max_send)
    if serialized is None:
        return False
    state.initial_metadata_sent = True
    if not state.sc.send(serialized):
        # Client gone (cancel, deadline, connection loss): stop producing.
        state.finished = True
        return False
    return True


def _run_non_blocking(state: _CallState, behavior: Callable[..., Any], argument: Any,
                      context: _ServicerContext, serializer: Optional[Callable[..., Any]],
                      max_send: int, on_end: Callable[[_CallState], None]) -> bool:
    """grpc's experimental non-blocking response-streaming handler: it is given a
    `send_response` to call, from any thread, with each response and then with None
    (the status). True when the call goes on after the behaviour returned."""
    lock = threading.Lock()  # send_response may be called from several threads

    def send_response(response: Any) -> None:
        with lock:
            if state.finished:
                return
            if response is None:
                _finish_ok(state, None)
            elif _send_one(state, response, serializer, max_send):
                return
        on_end(state)

    try:
        behavior(argument, context, send_response)
    except Exception as exc:
        with lock:
            _on_exception(state, exc, _status.EXCEPTION_CALLING)
    return not state.finished


class UnaryPlan(NamedTuple):
    """What serving a unary-unary method takes, read off its handler once: the behaviour,
    the request's deserializer, the response's serializer."""
    behavior: Callable[..., Any]
    deserializer: Optional[Callable[..., Any]]
    serializer: Optional[Callable[..., Any]]


def unary_plan(handler: grpc.RpcMethodHandler[Any, Any]) -> Optional[UnaryPlan]:
    """The plan of a unary-unary handler served in the worker that accepted its call;
    None for every other kind, and for a method with its own pool."""
    if handler.request_streaming or handler.response_streaming:
        return None
    behavior = handler.unary_unary
    if isinstance(getattr(behavior, "experimental_thread_pool", None),
                  concurrent.futures.ThreadPoolExecutor):
        return None
    # ignore: a handler without the behaviour fails when called, as the application's error
    return UnaryPlan(behavior, handler.request_deserializer,  # type: ignore[arg-type]
                     handler.response_serializer)


def serve_unary(state: _CallState, plan: UnaryPlan, max_send: int,
                context: Optional[_ServicerContext] = None) -> None:
    """Serves a unary-unary call to its end in as few Python calls as its common outcome
    needs (each costs about as much as the transport's share of a small call); every
    other outcome takes the same helpers as the other kinds. `context`: the one the
    call's interceptors saw, if any was made already."""
    sc = state.sc
    request = sc.recv()
    if request is None:
        request = _no_request(state)
    elif plan.deserializer is not None:
        request = _deserialize(state, request, plan.deserializer)
    if request is _NO_REQUEST:
        return
    try:
        response = plan.behavior(request, context if context is not None
                                 else _ServicerContext(state))
    except Exception as exc:
        _on_exception(state, exc, _status.EXCEPTION_CALLING)
        return
    _answer_unary(state, response, plan.serializer, max_send)


def _answer_unary(state: _CallState, response: Any, serializer: Optional[Callable[..., Any]],
                  max_send: int) -> None:
    if (state.finished or state.code is not None or state.details is not None
            or state.trailing_metadata):
        _respond_unary(state, response, serializer, max_send)
        return
    serialized = _serialize(state, response, serializer, max_send)
    if serialized is not None:
        state.finished = True
        state.sc.finish(_status.OK, "", _NO_METADATA, serialized)


# Where _core.serve_planned stopped (csrc/bindings/server_serve.cc, Stop).
REQUEST_FAILED = 1  # the deserializer raised (value: its exception) or gave None
RAISED = 2  # the handler raised (value: its exception)
RETURNED = 3  # the handler answered (value: the response); the end needs the checks here
SERIALIZE_FAILED = 4  # the serializer raised (value: its exception) or gave None
NOT_BYTES = 5  # the response's wire form is no buffer (value: that form)


def carry_on_unary(state: _CallState, plan: UnaryPlan, max_send: int, stage: int,
                   value: Any) -> None:
    """serve_unary from where _core.serve_planned stopped, in the same Context."""
    if stage == REQUEST_FAILED:
        if value is not None:
            codec_failed("deserializing", value)
        _finish(state, _status.INTERNAL, "Exception deserializing request!")
    elif stage == RAISED:
        _on_exception(state, value, _status.EXCEPTION_CALLING)
    elif stage == SERIALIZE_FAILED:
        if value is not None:
            codec_failed("serializing", value)
        _finish_with_state(state, _status.INTERNAL, "Failed to serialize response!")
    elif stage == NOT_BYTES:
        _not_bytes(state, value, plan.serializer)
    else:
        _answer_unary(state, value, plan.serializer, max_send)


def run(state: _CallState, context: _ServicerContext, handler: grpc.RpcMethodHandler[Any, Any],
        max_send: int, on_end: Callable[[_CallState], None]) -> bool:
    """Serve the call to its end (status sent, or the call found dead), or, for a
    non-blocking handler, until its behaviour returns: True then when the call goes on,
    and `on_end` is called once it ends."""
    if not handler.request_streaming and not handler.response_streaming:
        # ignore: a handler without the behaviour fails when called, as the app's error
        serve_unary(state, UnaryPlan(handler.unary_unary,  # type: ignore[arg-type]
                                     handler.request_deserializer,
                                     handler.response_serializer), max_send, context)
        return False
    deserializer = handler.request_deserializer
    serializer = handler.response_serializer
    # the handler's kind says which behaviour it has; a None one fails in _call as the
    # application's error, as with grpc
    if handler.request_streaming:
        argument: Any = _RequestIterator(state, deserializer)
        behavior = cast("Callable[..., Any]", handler.stream_stream if handler.response_streaming
                        else handler.stream_unary)
    else:
        argument = _unary_request(state, deserializer)
        if argument is _NO_REQUEST:
            return False
        behavior = cast("Callable[..., Any]", handler.unary_stream if handler.response_streaming
                        else handler.unary_unary)
    if handler.response_streaming and getattr(behavior, "experimental_non_blocking", False):
        return _run_non_blocking(state, behavior, argument, context, serializer, max_send,
                                 on_end)
    result, proceed = _call(state, behavior, argument, context)
    if not proceed:
        return False
    if handler.response_streaming:
        _respond_stream(state, result, serializer, max_send)
    else:
        _respond_unary(state, result, serializer, max_send)
    return False
