"""The RpcError the shm path raises, shaped like grpc's ``_InactiveRpcError``.

It is a ``grpc.RpcError`` and also a finished ``grpc.Call`` and ``grpc.Future`` (grpc's
interceptor machinery relies on that: a continuation returns the error as the outcome).
It is also an iterator that raises itself, so a streaming call that failed before it
started can be handed back where an iterator-Call is expected, as grpc does.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional, Sequence

import grpc

from . import _grpc_log
from ._bases import FutureBase
from ._metadata import from_core

__all__ = ["CODE_BY_INT", "RpcError", "_RpcError", "code_from_int", "status_error"]

CODE_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}

_OK_FORMAT = '<{} of RPC that terminated with:\n\tstatus = {}\n\tdetails = "{}"\n>'
_NON_OK_FORMAT = (
    '<{} of RPC that terminated with:\n\tstatus = {}\n\tdetails = "{}"\n'
    '\tdebug_error_string = "{}"\n>'
)


def received_too_large(n: int, limit: int) -> str:
    """grpc's words for a response over the method's maxResponseMessageBytes (grpc and
    grpc.aio say the same)."""
    return f"Stream removed (CLIENT: Received message larger than max ({n} vs. {limit}))"


def code_from_int(code: int, details: str) -> tuple[grpc.StatusCode, str]:
    """Map an engine status integer to grpc's enum; unknown values become UNKNOWN like grpc."""
    status = CODE_BY_INT.get(code)
    if status is None:
        return grpc.StatusCode.UNKNOWN, f'Server sent unknown code {code} and details "{details}"'
    return status, details


def rpc_state_string(class_name: str, code: Optional[grpc.StatusCode], details: Optional[str],
                     debug: Optional[str]) -> str:
    if code is None:
        return f"<{class_name} object>"
    if code is grpc.StatusCode.OK:
        return _OK_FORMAT.format(class_name, code, details)
    return _NON_OK_FORMAT.format(class_name, code, details, debug)


USER_CODE_FAILED = object()


def user_codec(fn: Callable[[Any], Any], value: Any, what: str) -> Any:
    """`fn(value)` for a user's (de)serializer, or USER_CODE_FAILED after logging its
    exception as grpc does (`what`: "serializing" or "deserializing"), and when it gave
    None, which grpc reads as a failure too (with no log line). Callers raise or finish
    with their status outside any except block, so no user traceback chains on."""
    try:
        out = fn(value)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is a status
        codec_failed(what, exc)
        return USER_CODE_FAILED
    return USER_CODE_FAILED if out is None else out


def codec_failed(what: str, exc: BaseException) -> None:
    """grpc's log line for a user's (de)serializer that raised `exc`."""
    _grpc_log.CODEC.error("Exception %s message!", what, exc_info=exc)


class DoneFuture(FutureBase):
    """What every finished call answers as a ``grpc.Future`` and ``grpc.RpcContext``:
    nothing to cancel, no callbacks to add, done. Subclasses give the outcome
    (``result``, ``exception``, ``traceback``, ``time_remaining``)."""

    __slots__ = ()

    def is_active(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[Any], None], timeout: Optional[float] = None) -> None:
        fn(self)


class _RpcError(grpc.RpcError, DoneFuture, grpc.Call):
    """A terminated RPC (non-OK status). Immutable once built."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        initial_metadata: Sequence[Any] = (),
        trailing_metadata: Sequence[Any] = (),
        debug_error_string: Optional[str] = None,
    ) -> None:
        super().__init__()
        self._code = code
        self._details = details
        self._initial_metadata = tuple(initial_metadata)
        self._trailing_metadata = tuple(trailing_metadata)
        self._debug_error_string = debug_error_string

    # grpc.Call
    def initial_metadata(self) -> tuple[Any, ...]:
        return self._initial_metadata

    def trailing_metadata(self) -> tuple[Any, ...]:
        return self._trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def debug_error_string(self) -> Optional[str]:
        return self._debug_error_string

    # None: no deadline, as grpc's errors answer (its stubs say float)
    def time_remaining(self) -> Optional[float]:  # type: ignore[override]
        return None

    def result(self, timeout: Optional[float] = None) -> Any:
        raise self

    def exception(self, timeout: Optional[float] = None) -> Optional[Exception]:
        return self

    def traceback(self, timeout: Optional[float] = None) -> Optional[types.TracebackType]:
        try:
            raise self
        except grpc.RpcError:
            return sys.exc_info()[2]

    # iterator form (a streaming call that failed up front)
    def __iter__(self) -> "_RpcError":
        return self

    def __next__(self) -> Any:
        raise self

    def next(self) -> Any:
        raise self

    def __repr__(self) -> str:
        return rpc_state_string("_InactiveRpcError", self._code, self._details,
                                self._debug_error_string)

    __str__ = __repr__


RpcError = _RpcError


def status_error(code: int, details: str, initial_md: Any = None,
                 trailing_md: Any = None) -> _RpcError:
    """Build the error for a non-OK status coming from the engine (metadata in core form)."""
    status, details = code_from_int(code, details)
    return _RpcError(status, details, from_core(initial_md), from_core(trailing_md),
                     f"{status.name}:{details}")


def local_error(code: grpc.StatusCode, details: str,
                debug_error_string: Optional[str] = None) -> _RpcError:
    """An error decided in this process before/without the peer (serializer, limits...)."""
    return _RpcError(code, details, (), (), debug_error_string)
