"""The ``grpc.service_config`` option's method configs (gRFC A2) and retry rules (gRFC A6),
read once per channel and applied by both front ends to fast-path calls.

A method's config is the first entry naming its service and method, else its service,
else the default entry (a name with neither). ``timeout`` bounds the call (the earlier of
it and the call's own), ``waitForReady`` is the call's unless the call says,
``maxRequestMessageBytes``/``maxResponseMessageBytes`` lower the channel's limits, and
``retryPolicy`` retries a failed attempt (see ``Retries``).

grpcio ends a call with a methodConfig ``timeout`` at once with DEADLINE_EXCEEDED, whatever
its length; argrpc follows the spec on both paths: ``for_grpc`` hands grpc's channels the
config without timeouts, and argrpc passes each call's effective timeout itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import threading
import time
from typing import Any, Optional

import grpc

from .._grpc_payloads import nbytes
from .._config import LIMITS

__all__ = ["Attempts", "HedgingPolicy", "MethodConfig", "RetryPolicy", "ServiceConfig",
           "Hedge", "Throttle", "for_grpc", "throttle_for"]

_LOGGER = logging.getLogger("argrpc")
_KEY = "grpc.service_config"
_ENABLE_RETRIES_KEY = "grpc.enable_retries"
_BUFFER_KEY = "grpc.per_rpc_retry_buffer_size"
_MAX_ATTEMPTS = 5  # gRFC A6: larger values are treated as 5
_DEFAULT_BUFFER = 256 * 1024
_DURATION = re.compile(r"^\s*(\d+(?:\.\d{0,9})?)s\s*$")
_CODES = {c.name: c.value[0] for c in grpc.StatusCode}


def _duration(value: Any) -> Optional[float]:
    if isinstance(value, str) and (m := _DURATION.match(value)):
        return float(m.group(1))
    return None


def _codes(values: Any) -> frozenset[int]:
    out = set()
    for v in values if isinstance(values, list) else ():
        if isinstance(v, str) and v.upper() in _CODES:
            out.add(_CODES[v.upper()])
        elif isinstance(v, int) and 0 < v < 17:
            out.add(v)
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    multiplier: float
    codes: frozenset[int]  # retryable status codes (numbers)

    @classmethod
    def parse(cls, raw: Any) -> Optional["RetryPolicy"]:
        if not isinstance(raw, dict):
            return None
        attempts = raw.get("maxAttempts")
        initial = _duration(raw.get("initialBackoff"))
        most = _duration(raw.get("maxBackoff"))
        multiplier = raw.get("backoffMultiplier")
        codes = _codes(raw.get("retryableStatusCodes"))
        if not (isinstance(attempts, int) and attempts > 1 and initial and most and
                isinstance(multiplier, (int, float)) and multiplier > 0 and codes):
            _LOGGER.warning("argrpc: ignoring an invalid retryPolicy in grpc.service_config: %s",
                            raw)
            return None
        return cls(min(attempts, _MAX_ATTEMPTS), initial, most, float(multiplier), codes)

    def backoff(self, retry: int) -> float:
        """The randomized delay before retry number `retry` (1 for the first), gRFC A6."""
        ceiling = min(self.initial_backoff_s * self.multiplier ** (retry - 1),
                      self.max_backoff_s)
        return random.uniform(0.0, ceiling)


@dataclasses.dataclass(frozen=True)
class HedgingPolicy:
    max_attempts: int
    delay_s: float           # between one attempt's start and the next's
    non_fatal: frozenset[int]  # statuses after which the other attempts go on

    @classmethod
    def parse(cls, raw: Any) -> Optional["HedgingPolicy"]:
        if not isinstance(raw, dict):
            return None
        attempts = raw.get("maxAttempts")
        delay = _duration(raw.get("hedgingDelay", "0s"))
        if not (isinstance(attempts, int) and attempts > 1 and delay is not None):
            _LOGGER.warning("argrpc: ignoring an invalid hedgingPolicy in "
                            "grpc.service_config: %s", raw)
            return None
        return cls(min(attempts, _MAX_ATTEMPTS), delay, _codes(raw.get("nonFatalStatusCodes")))


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    timeout_s: Optional[float] = None
    wait_for_ready: Optional[bool] = None
    max_request: Optional[int] = None
    max_response: Optional[int] = None
    retry: Optional[RetryPolicy] = None
    hedging: Optional[HedgingPolicy] = None  # never with retry (gRFC A6)

    def __bool__(self) -> bool:
        """Whether the method has any config at all."""
        return self != _EMPTY

    def timeout(self, call_timeout: Optional[float]) -> Optional[float]:
        if self.timeout_s is None:
            return call_timeout
        return self.timeout_s if call_timeout is None else min(call_timeout, self.timeout_s)

    def call_options(self, timeout: Optional[float], wait_for_ready: Optional[bool]
                     ) -> tuple[Optional[float], Optional[bool]]:
        """A call's timeout and wait_for_ready under this config: the earlier timeout,
        and the config's wait_for_ready where the call gave none."""
        return (self.timeout(timeout),
                self.wait_for_ready if wait_for_ready is None else wait_for_ready)


_NONE = _EMPTY = MethodConfig()


class Throttle:
    """retryThrottling (gRFC A6): a failure with a retryable status takes a token, a
    success gives back ``tokenRatio``; retries stop while tokens are at or below half."""

    def __init__(self, max_tokens: float, ratio: float) -> None:
        self._max = max_tokens
        self._ratio = ratio
        self._tokens = max_tokens
        self._lock = threading.Lock()

    def failed(self) -> bool:
        """Records a retryable failure; whether a retry may follow."""
        with self._lock:
            self._tokens = max(0.0, self._tokens - 1)
            return self._tokens > self._max / 2

    def succeeded(self) -> None:
        with self._lock:
            self._tokens = min(self._max, self._tokens + self._ratio)


class ServiceConfig:
    def __init__(self, grpc_options: Any) -> None:
        raw: Any = {}
        self.retries_enabled = True
        self.buffer_limit = _DEFAULT_BUFFER
        for key, value in tuple(grpc_options or ()):
            if key == _KEY:
                try:
                    raw = json.loads(value)
                except (TypeError, ValueError):
                    raw = {}
            elif key == _ENABLE_RETRIES_KEY:
                self.retries_enabled = bool(value)
            elif key == _BUFFER_KEY and isinstance(value, int):
                self.buffer_limit = value
        # How often a call that never left the process starts again (0: never).
        self.unsent_retries = LIMITS.transparent_retries if self.retries_enabled else 0
        self._exact: dict[tuple[str, str], MethodConfig] = {}
        self._service: dict[str, MethodConfig] = {}
        self._default = _NONE
        for entry in raw.get("methodConfig", ()) if isinstance(raw, dict) else ():
            if isinstance(entry, dict):
                self._add(entry)
        self.throttle: Optional[Throttle] = None
        throttling = raw.get("retryThrottling") if isinstance(raw, dict) else None
        if isinstance(throttling, dict):
            tokens, ratio = throttling.get("maxTokens"), throttling.get("tokenRatio")
            if isinstance(tokens, (int, float)) and isinstance(ratio, (int, float)) and \
                    0 < tokens <= 1000 and ratio > 0:
                self.throttle = Throttle(float(tokens), round(float(ratio), 3))

    def _add(self, entry: dict[str, Any]) -> None:
        wfr = entry.get("waitForReady")
        max_req, max_resp = entry.get("maxRequestMessageBytes"), entry.get(
            "maxResponseMessageBytes")
        config = MethodConfig(
            timeout_s=_duration(entry.get("timeout")),
            wait_for_ready=wfr if isinstance(wfr, bool) else None,
            max_request=int(max_req) if isinstance(max_req, (int, str)) else None,
            max_response=int(max_resp) if isinstance(max_resp, (int, str)) else None,
            retry=RetryPolicy.parse(entry["retryPolicy"]) if "retryPolicy" in entry else None,
            hedging=HedgingPolicy.parse(entry["hedgingPolicy"])
            if "hedgingPolicy" in entry and "retryPolicy" not in entry else None)
        for name in entry.get("name", ()):
            if not isinstance(name, dict):
                continue
            service, method = name.get("service", ""), name.get("method", "")
            if not service:
                self._default = config
            elif not method:
                self._service.setdefault(service, config)
            else:
                self._exact.setdefault((service, method), config)

    def buffers(self, payload: Any) -> bool:
        """Whether a request fits grpc.per_rpc_retry_buffer_size, so its call may be
        retried (a request that is no buffer fails on its own)."""
        try:
            return nbytes(payload) <= self.buffer_limit
        except TypeError:
            return False

    def method(self, full_method: str) -> MethodConfig:
        """The config for "/package.Service/Method"."""
        service, _, method = full_method.lstrip("/").partition("/")
        found = self._exact.get((service, method)) or self._service.get(service) or \
            self._default
        if (found.retry is not None or found.hedging is not None) and not self.retries_enabled:
            found = dataclasses.replace(found, retry=None, hedging=None)
        return found


def for_grpc(grpc_options: Any) -> Any:
    """The options for grpc's own channels: the service config without methodConfig
    timeouts (argrpc passes each call's effective timeout)."""
    options = list(grpc_options or ())
    for i, (key, value) in enumerate(options):
        if key != _KEY:
            continue
        try:
            raw = json.loads(value)
        except (TypeError, ValueError):
            return options
        changed = False
        for entry in raw.get("methodConfig", ()) if isinstance(raw, dict) else ():
            if isinstance(entry, dict) and "timeout" in entry:
                del entry["timeout"]
                changed = True
        if changed:
            options[i] = (key, json.dumps(raw))
    return options


_PUSHBACK_KEY = "grpc-retry-pushback-ms"
_PREVIOUS_KEY = "grpc-previous-rpc-attempts"
_THROTTLES: dict[tuple[str, float, float], Throttle] = {}
_THROTTLES_LOCK = threading.Lock()


def throttle_for(target: str, config: ServiceConfig) -> Optional[Throttle]:
    """The target's throttle, shared by the process's channels to it (grpc keeps one per
    server name)."""
    own = config.throttle
    if own is None:
        return None
    key = (target, own._max, own._ratio)
    with _THROTTLES_LOCK:
        return _THROTTLES.setdefault(key, own)


def _pushback(trailing_metadata: Any) -> Optional[float]:
    """The server's pushback in seconds; None when it sent none; -1.0 when it sent one
    that forbids retrying (negative or not a number)."""
    for key, value in trailing_metadata or ():
        if key == _PUSHBACK_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            return int(text) / 1000.0 if text.isdigit() else -1.0
    return None


class Attempts:
    """One call's attempts under a retry policy (gRFC A6). After each attempt ends,
    ``after`` says how long to wait before the next one, or None when the call ends with
    that attempt's status: it succeeded, its status is not retryable, the call was
    committed (the server sent response headers or a message), the attempts or the throttle's
    tokens are used up, the server's pushback forbids it, or the wait would pass the
    call's deadline."""

    def __init__(self, policy: RetryPolicy, throttle: Optional[Throttle],
                 deadline: Optional[float]) -> None:
        self._policy = policy
        self._throttle = throttle
        self._deadline = deadline
        self.done = 1  # attempts made so far
        self._backoff_retry = 1  # which backoff step the next wait takes

    def after(self, code: int, committed: bool, trailing_metadata: Any,
              now: float) -> Optional[float]:
        throttle = self._throttle
        if code == 0:
            if throttle is not None:
                throttle.succeeded()
            return None
        if code not in self._policy.codes:
            return None
        if throttle is not None and not throttle.failed():
            return None
        if committed or self.done >= self._policy.max_attempts:
            return None
        pushback = _pushback(trailing_metadata)
        if pushback is not None and pushback < 0:
            return None
        if pushback is None:
            delay = self._policy.backoff(self._backoff_retry)
            self._backoff_retry += 1
        else:  # the server's word; the backoff starts over after it
            delay, self._backoff_retry = pushback, 1
        if self._deadline is not None and now + delay >= self._deadline:
            return None
        self.done += 1
        return delay

    def metadata(self, metadata: list[Any]) -> list[Any]:
        """An attempt's metadata: a retry tells the server how many came before it."""
        if self.done == 1:
            return metadata
        return [*metadata, (_PREVIOUS_KEY, str(self.done - 1))]


def hedge_delay(policy: HedgingPolicy, throttle: Optional[Throttle], code: int,
                trailing_metadata: Any) -> Optional[float]:
    """After a hedged attempt ended with `code`: how soon the next may start (at once,
    or after the server's pushback), or None when no more may (gRFC A6: a fatal status
    or a forbidding pushback ends the hedging; so does the throttle)."""
    if code == 0 or code not in policy.non_fatal:
        return None
    if throttle is not None and not throttle.failed():
        return None
    pushback = _pushback(trailing_metadata)
    if pushback is not None and pushback < 0:
        return None
    return 0.0 if pushback is None else pushback


def response_began(core: Any, streaming: bool) -> tuple[bool, Any]:
    """Whether an attempt's response began (gRFC A6 commits it then): a message of a
    response stream, or headers that carry metadata; `core` is its engine call. The
    message read to tell comes back second, for the attempt's reader."""
    if streaming:
        first = core.try_recv()
        if first is not None and first is not False:
            return True, first
    return bool(core.try_initial_metadata()), None


class Hedge:
    """One call's hedged attempts (gRFC A6), for both front ends, which start and watch the
    attempts themselves: when the next one is due, what its metadata adds, and whether an
    attempt that ended is the call's end."""

    def __init__(self, policy: HedgingPolicy, throttle: Optional[Throttle],
                 deadline: Optional[float]) -> None:
        self._policy = policy
        self._throttle = throttle
        self._deadline = deadline
        self._started = self._ended = 0
        self._more = True  # no fatal end or forbidding pushback yet
        self._next_at = time.monotonic()
        self._attempts: list[Any] = []  # the front end's call objects
        self._judged: set[int] = set()
        self.last: Any = None  # the attempt that ended last

    def add(self, call: Any) -> None:
        self._attempts.append(call)

    def newly_ended(self) -> list[Any]:
        """The attempts that ended since the last look (each is then given to
        ended_with)."""
        out = []
        for i, call in enumerate(self._attempts):
            if i not in self._judged and call.done():
                self._judged.add(i)
                self.last = call
                out.append(call)
        return out

    def running(self) -> list[Any]:
        """The attempts not seen ended yet."""
        return [call for i, call in enumerate(self._attempts) if i not in self._judged]

    def commit(self, call: Any) -> None:
        """`call`'s response began (headers with metadata, or a message): it is the
        call's, and no attempt starts after it (gRFC A6)."""
        self.last = call
        self._more = False

    def not_started(self) -> bool:
        """The attempt due could not start (its request stream outgrew the retry buffer,
        or it had nowhere to go): True when that ends the call, none running; else no
        attempt starts after the running ones, which decide."""
        if not self.running():
            return True
        self._started -= 1
        self._more = False
        return False

    def cancel_rest(self, cancel: Any = None) -> None:
        """Cancels every attempt still running (all but the call's), with `cancel(call)`
        when given (an engine call takes a status), else `call.cancel()`."""
        for call in self._attempts:
            if call is not self.last and not call.done():
                cancel(call) if cancel is not None else call.cancel()

    def start_now(self, now: float) -> bool:
        """Whether an attempt is due now (counted as started when it is)."""
        if self._more and self._started < self._policy.max_attempts and now >= self._next_at:
            self._started += 1
            self._next_at = now + self._policy.delay_s
            return True
        return False

    def left(self, now: float) -> Optional[float]:
        """The call's time left, for the attempt starting now."""
        return None if self._deadline is None else max(0.0, self._deadline - now)

    def previous(self) -> Optional[tuple[str, str]]:
        """The metadata that tells the server how many attempts came before this one."""
        return None if self._started <= 1 else (_PREVIOUS_KEY, str(self._started - 1))

    def ended_with(self, code: int, trailing_metadata: Any) -> bool:
        """An attempt ended: True when its end is the call's (OK, a fatal status, or the
        last attempt that can be made)."""
        self._ended += 1
        delay = hedge_delay(self._policy, self._throttle, code, trailing_metadata)
        if delay is None:
            if code == 0 or code not in self._policy.non_fatal:
                return True
            self._more = False
        else:
            self._next_at = min(self._next_at, time.monotonic() + delay)
        return self._ended == self._started and (
            not self._more or self._started >= self._policy.max_attempts)

    def wait_s(self, now: float) -> Optional[float]:
        """How long to wait for an attempt to end before the next is due (None: until
        one ends)."""
        if self._more and self._started < self._policy.max_attempts:
            return max(0.0, self._next_at - now)
        return None
