"""grpc's per-call instruments, fed from the engine's call records.

The engine queues one record when a call starts and one when it ends, on either side,
whatever the transport (shared memory, verbs); a thread of this process takes them every
``DRAIN_INTERVAL_S`` and before every metrics collection, so a reader always sees the calls
that ended before it collected, and the call path itself never runs OpenTelemetry code.
Instruments are created in grpc's meter ("grpc-python", grpc's version) with grpc's names,
units and descriptions, so when grpc's own plugin records the calls plain gRPC carries
into the same ``MeterProvider``, both land in the same metric streams.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter as Tally
from typing import Any, Callable, Optional

import grpc
from opentelemetry.metrics import Counter, Histogram, MeterProvider

from .._config import LIMITS

__all__ = ["DRAIN_INTERVAL_S", "CallRecorder"]

DRAIN_INTERVAL_S = LIMITS.metrics_drain_s
GRPC_METER = "grpc-python"
METHOD, TARGET, STATUS = "grpc.method", "grpc.target", "grpc.status"
OTHER = "other"

# The engine's record kinds.
CLIENT_STARTED, CLIENT_ENDED, SERVER_STARTED, SERVER_ENDED = 0, 1, 2, 3

_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_LOGGER = logging.getLogger("argrpc")

Record = tuple[int, str, str, int, float, int, int, str]


# (attribute, a counter (else a histogram), grpc's name, unit and description)
_INSTRUMENTS = (
    ("attempt_started", True, "grpc.client.attempt.started", "{attempt}",
     "Number of client call attempts started"),
    ("attempt_duration", False, "grpc.client.attempt.duration", "s",
     "End-to-end time taken to complete a client call attempt"),
    ("call_duration", False, "grpc.client.call.duration", "s",
     "End-to-end time taken to complete a call from client's perspective"),
    ("attempt_sent", False, "grpc.client.attempt.sent_total_compressed_message_size", "By",
     "Compressed message bytes sent per client call attempt"),
    ("attempt_rcvd", False, "grpc.client.attempt.rcvd_total_compressed_message_size", "By",
     "Compressed message bytes received per call attempt"),
    ("server_started", True, "grpc.server.call.started", "{call}",
     "Number of server calls started"),
    ("server_duration", False, "grpc.server.call.duration", "s",
     "End-to-end time taken to complete a call from server transport's perspective"),
    ("server_sent", False, "grpc.server.call.sent_total_compressed_message_size", "By",
     "Compressed message bytes sent per server call"),
    ("server_rcvd", False, "grpc.server.call.rcvd_total_compressed_message_size", "By",
     "Compressed message bytes received per server call"),
)


class CallRecorder:
    """Records the engine's call records on grpc's instruments."""

    attempt_started: Counter
    attempt_duration: Histogram
    call_duration: Histogram
    attempt_sent: Histogram
    attempt_rcvd: Histogram
    server_started: Counter
    server_duration: Histogram
    server_sent: Histogram
    server_rcvd: Histogram

    def __init__(self, provider: MeterProvider, core: Optional[Any],
                 target_filter: Callable[[str], bool],
                 generic_method_filter: Callable[[str], bool],
                 client_methods: set[str], server_methods: set[str]) -> None:
        self._core = core
        self._target_filter = target_filter
        self._generic_filter = generic_method_filter
        self._client_methods = client_methods
        self._server_methods = server_methods
        meter = provider.get_meter(GRPC_METER, grpc.__version__)
        for attr, counter, name, unit, description in _INSTRUMENTS:
            create = meter.create_counter if counter else meter.create_histogram
            setattr(self, attr, create(name, unit=unit, description=description))
        self.on_dropped: Optional[Callable[[int], None]] = None
        self.active = True
        self._lock = threading.Lock()
        # Labels per (side, method, target): the filters are the user's code, asked once;
        # and with the status, per (side, method, target, code), built once.
        self._labels: dict[tuple[bool, str, str], dict[str, str]] = {}
        self._ended: dict[tuple[bool, str, str, str], dict[str, str]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        if self._core is None:
            return  # no engine: every call goes over plain gRPC
        self._core.set_call_stats(True)
        self._start_thread()
        # A forked child records its own calls (the engine gives it an empty queue and
        # keeps recording on); it needs its own thread to take them.
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="argrpc-metrics", daemon=True)
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.active:
            self._start_thread()

    def stop(self) -> None:
        self.active = False
        if self._core is None:
            return
        self._core.set_call_stats(False)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.drain()  # what ended before the plugin went away still counts

    def _run(self) -> None:
        while not self._stop.wait(DRAIN_INTERVAL_S):
            try:
                self.drain()
            except Exception:  # noqa: BLE001 - a failing exporter must not end the thread
                _LOGGER.exception("argrpc: recording call metrics failed")

    # ------------------------------------------------------------------ recording
    def drain(self) -> None:
        """Record every call record the engine has queued."""
        if self._core is None:
            return
        with self._lock:
            records, dropped = self._core._take_call_stats(0)
            if dropped and self.on_dropped is not None:
                self.on_dropped(dropped)
            if records:
                self._record(records)

    def _attributes(self, server: bool, method: str, target: str) -> dict[str, str]:
        key = (server, method, target)
        labels = self._labels.get(key)
        if labels is None:
            name = method.lstrip("/")
            registered = self._server_methods if server else self._client_methods
            if name not in registered and not self._generic_filter(name):
                name = OTHER
            labels = {METHOD: name}
            if not server:
                labels[TARGET] = target if self._target_filter(target) else OTHER
            self._labels[key] = labels
        return labels

    def _ended_attributes(self, server: bool, method: str, target: str,
                          status: str) -> dict[str, str]:
        key = (server, method, target, status)
        labels = self._ended.get(key)
        if labels is None:
            labels = {**self._attributes(server, method, target), STATUS: status}
            self._ended[key] = labels
        return labels

    def grpc_call_ended(self, method: str, target: str, code: grpc.StatusCode,
                        duration: float) -> None:
        """A call carried by plain gRPC ended: its call duration (grpc's own plugin records
        its attempt)."""
        if not self.active:
            return
        self.call_duration.record(duration, self._ended_attributes(False, method, target,
                                                                   code.name))

    def _record(self, records: list[Record]) -> None:
        started: Tally[tuple[bool, str, str]] = Tally()
        for kind, method, target, code, duration, sent, rcvd, _transport in records:
            server = kind >= SERVER_STARTED
            if kind in (CLIENT_STARTED, SERVER_STARTED):
                started[(server, method, target)] += 1
                continue
            attributes = self._ended_attributes(server, method, target,
                                                _STATUS_NAMES.get(code, "UNKNOWN"))
            if server:
                self.server_duration.record(duration, attributes)
                self.server_sent.record(sent, attributes)
                self.server_rcvd.record(rcvd, attributes)
            else:
                self.attempt_duration.record(duration, attributes)
                self.call_duration.record(duration, attributes)
                self.attempt_sent.record(sent, attributes)
                self.attempt_rcvd.record(rcvd, attributes)
        for (server, method, target), n in started.items():
            counter = self.server_started if server else self.attempt_started
            counter.add(n, self._attributes(server, method, target))
