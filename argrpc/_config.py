"""argrpc configuration: TF_RDMA_* knobs from the environment and per-channel options.

Every knob is read from the environment when `load()` runs (so tests may change it per
process) and may be overridden per channel/server by a gRPC-style option whose key is
the same TF_RDMA_* name. Process-wide knobs (the pool size and the spin time belong to
the one engine of the process) are accepted only from the environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Literal, Mapping

__all__ = [
    "Config",
    "ConfigError",
    "ENGINE_ARGS",
    "ENGINE_STRUCTS",
    "EngineArg",
    "FIXED",
    "LIMITS",
    "KNOBS",
    "Knob",
    "TABLE",
    "fmt_size",
    "knob",
    "PREFIX",
    "conn_config",
    "engine_config",
    "knob_table_markdown",
    "limits_table_markdown",
    "load",
    "max_receive_length",
    "max_send_length",
    "compression_disabled",
    "parse_size",
    "split_options",
]

PREFIX = "TF_RDMA_"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# grpc's own defaults (grpc core: GRPC_DEFAULT_MAX_RECV_MESSAGE_LENGTH = 4 MiB, send
# unlimited); -1 means unlimited.
GRPC_DEFAULT_MAX_RECV = 4 * MiB
GRPC_DEFAULT_MAX_SEND = -1
_MAX_RECV_KEY = "grpc.max_receive_message_length"
_MAX_SEND_KEY = "grpc.max_send_message_length"


class ConfigError(ValueError):
    """A TF_RDMA_* value is invalid; the message names the variable, the value and what is accepted."""


# --------------------------------------------------------------------------- parsing

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": KiB, "m": MiB, "g": GiB}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_BOOL_ACCEPTED = "true/false/1/0/yes/no/on/off"


def fmt_size(n: int) -> str:
    """4194304 -> '4M': the shortest exact K/M/G form (binary units), as the knobs accept."""
    for unit, mult in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    """'4M' -> 4194304. K/M/G are binary (KiB/MiB/GiB), case-insensitive; raises ValueError."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) * _SIZE_MULT[m.group(2).lower()]


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


# ----------------------------------------------------------------------- the knob table

Kind = Literal["bool", "choice", "name", "int", "size"]
Scope = Literal["process", "connection"]


@dataclasses.dataclass(frozen=True)
class Knob:
    """One TF_RDMA_* variable: everything argrpc and its engine know about it.

    Declared once, as the metadata of its `Config` field. The README table, the
    validation and its messages, and the engine's header `csrc/knobs.h` (defaults, bounds
    and the fields of the config struct named by `engine`) are all generated from these
    records.
    """

    name: str
    kind: Kind
    default: Any
    meaning: str
    lo: int = 0
    hi: int = 0
    scope: Scope = "connection"   # "process": one engine per process, environment only
    engine: str = ""              # the C++ config struct that carries it; "": Python only
    auto: str = ""                # `auto` is accepted (None: argrpc picks) and picks this
    choices: tuple[str, ...] = ()
    what: str = ""                # what an int or a name is ("port number")
    power_of_two: bool = False
    zero_off: bool = False        # 0 is accepted too and means off
    also: str = ""                # a limit that depends on another knob, checked by load()
    default_text: str = ""        # when the default is decided at run time
    ctype: str = ""               # C++ type of the engine's field ("": from the kind)
    field: str = ""               # the Config field (set from the dataclass)

    @property
    def cxx_type(self) -> str:
        """The C++ type of the field in the engine's config struct."""
        return self.ctype or {"bool": "bool", "size": "size_t"}.get(self.kind, "int")

    @property
    def process_wide(self) -> bool:
        return self.scope == "process"

    def accepted(self) -> str:
        """What the value may be, as error messages say it."""
        if self.kind == "bool":
            return _BOOL_ACCEPTED
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "name":
            return _article(self.what)
        if self.kind == "int":
            text = f"{_article(self.what or 'integer')} from {self.lo} to {self.hi}"
        else:
            text = (f"a size in bytes or with a K/M/G suffix (KiB/MiB/GiB) from "
                    f"{fmt_size(self.lo)} to {fmt_size(self.hi)}")
            if self.power_of_two:
                text += ", a power of two"
        if self.also:
            text += ", " + self.also
        return ("auto or " if self.auto else "") + ("0 (off) or " if self.zero_off else "") + text

    def accepted_short(self) -> str:
        """What the value may be, as the README table says it."""
        if self.kind in ("bool", "name"):
            return self.accepted()
        if self.kind == "choice":
            return ", ".join(self.choices)
        fmt = fmt_size if self.kind == "size" else str
        text = f"{fmt(self.lo)}..{fmt(self.hi)}"
        if self.power_of_two:
            text += ", power of two"
        if self.also:
            text += ", " + self.also
        return ("auto, " if self.auto else "") + ("0 (off) or " if self.zero_off else "") + text

    def default_shown(self) -> str:
        if self.default_text:
            return self.default_text
        if self.auto and self.default is None:
            return "auto: " + self.auto
        if self.kind == "bool":
            return "true" if self.default else "false"
        if self.kind == "size":
            return fmt_size(self.default)
        return str(self.default)

    def parse(self, value: Any) -> Any:
        """The typed value of `value` (a string from the environment, or an option's
        value); raises ValueError whose text is `accepted()`."""
        if self.kind == "bool":
            return self._parse_bool(value)
        text = _text(value)
        if self.kind == "choice":
            if text is None or text.strip().lower() not in self.choices:
                raise ValueError(self.accepted())
            return text.strip().lower()
        if self.kind == "name":
            if text is None or not text.strip():
                raise ValueError(self.accepted())
            return text.strip()
        if self.auto and text is not None and text.strip().lower() == "auto":
            return None
        n = self._parse_number(value, text)
        if self.zero_off and n == 0:
            return 0
        if not self.lo <= n <= self.hi or (self.power_of_two and n & (n - 1)):
            raise ValueError(self.accepted())
        return n

    def _parse_bool(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        low = (_text(value) or "").strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(self.accepted())

    def _parse_number(self, value: Any, text: str | None) -> int:
        if isinstance(value, bool):
            raise ValueError(self.accepted())
        if isinstance(value, int):
            return value
        if text is None:
            raise ValueError(self.accepted())
        if self.kind == "size":
            try:
                return parse_size(text)
            except ValueError:
                raise ValueError(self.accepted()) from None
        if not re.fullmatch(r"\d+", text.strip()):
            raise ValueError(self.accepted())
        return int(text.strip())


def _article(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _knob(name: str, kind: Kind, default: Any, meaning: str, **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={
        "knob": Knob(name=name, kind=kind, default=default, meaning=meaning, **kw)})


TRANSPORT_CHOICES = ("auto", "verbs", "shm", "grpc")


@dataclasses.dataclass(frozen=True)
class Config:
    """The TF_RDMA_* knobs of one channel or server: each field declares its knob."""

    enabled: bool = _knob(
        "TF_RDMA_ENABLED", "bool", True,
        "`false`: every channel and server is plain gRPC.")
    transport: str = _knob(
        "TF_RDMA_TRANSPORT", "choice", "auto",
        "Which fast path to use: `auto` (shared memory on one host, RDMA verbs across hosts "
        "when both ends have a usable device, else gRPC), `verbs` or `shm` (required: calls "
        "fail UNAVAILABLE instead of falling back) or `grpc` (none).", choices=TRANSPORT_CHOICES)
    dev_name: str | None = _knob(
        "TF_RDMA_DEV_NAME", "name", None,
        "RDMA device the verbs fabric uses; a named device that is missing or has no ACTIVE "
        "port is an error, not a fallback.",
        what="non-empty RDMA device name such as mlx5_0",
        default_text="the device whose GID carries this host's address on the route to the "
                     "peer; without one, `mlx5_0` if present, else the first device with an "
                     "ACTIVE port")
    port_num: int | None = _knob(
        "TF_RDMA_PORT_NUM", "int", None,
        "Port number on the RDMA device (verbs only); a named port that is not ACTIVE is an "
        "error.",
        lo=1, hi=255, auto="the device's first ACTIVE port", what="port number")
    gid_index: int | None = _knob(
        "TF_RDMA_GID_INDEX", "int", None,
        "GID table index used as the source address of the verbs queue pairs.",
        lo=0, hi=65535, what="GID table index",
        auto="the RoCE GID holding this host's address on the route to the peer; without "
             "one, RoCEv2 with an IPv4-mapped address, else RoCEv2, else RoCEv1, else "
             "InfiniBand (LID)")
    qps: int = _knob(
        "TF_RDMA_QPS", "int", 1,
        "RC queue pairs per verbs connection, over which rendezvous reads are spread; raise "
        "it where one queue pair does not fill the link.",
        lo=1, hi=16, engine="VerbsConfig")
    qp_timeout: int = _knob(
        "TF_RDMA_QP_TIMEOUT", "int", 18,
        "Verbs local ACK timeout exponent: a queue pair waits 4.096 µs × 2^value for an "
        "acknowledgement before it retries (18: 1.07 s). Lower it only where peers ack "
        "promptly.",
        lo=1, hi=31, engine="VerbsConfig")
    qp_retry: int = _knob(
        "TF_RDMA_QP_RETRY", "int", 6,
        "Verbs transport and RNR retries before a send fails (7: RNR retries never end); "
        "with the timeout it bounds how long a dead peer's connection takes to fail.",
        lo=0, hi=7, engine="VerbsConfig")
    cq_depth: int = _knob(
        "TF_RDMA_CQ_DEPTH", "int", 8192,
        "Completion queue entries per verbs connection, shared by its receive slots and its "
        "queue pairs' send queues (capped at the device's max_cqe).",
        lo=256, hi=4194304, engine="VerbsConfig")
    chunk_size: int = _knob(
        "TF_RDMA_CHUNK_SIZE", "size", 4 * MiB,
        "Rendezvous chunk size in bytes: large messages are pulled in chunks of this size.",
        lo=64 * KiB, hi=1 * GiB, engine="ConnConfig")
    acc_size: int = _knob(
        "TF_RDMA_ACC_SIZE", "size", 8 * KiB,
        "Eager (coalescing) limit in bytes: smaller messages are batched into one write, "
        "larger ones go rendezvous.",
        lo=1 * KiB, hi=1 * MiB, also="at most TF_RDMA_RING_SIZE/4", engine="ConnConfig")
    buf_size: int = _knob(
        "TF_RDMA_BUF_SIZE", "size", 1 * GiB,
        "Size in bytes of the process's registered, pre-faulted buffer pool; process-wide: "
        "environment only.",
        lo=64 * MiB, hi=64 * GiB, scope="process", engine="EngineConfig")
    ring_size: int = _knob(
        "TF_RDMA_RING_SIZE", "size", 1 * MiB,
        "Receive ring size in bytes, per connection and direction.",
        lo=64 * KiB, hi=256 * MiB, power_of_two=True, engine="ConnConfig")
    spin_us: int = _knob(
        "TF_RDMA_SPIN_US", "int", 50,
        "Microseconds a waiting thread spins (yielding) before it blocks; process-wide: "
        "environment only.",
        lo=0, hi=100000, what="integer number of microseconds", scope="process",
        engine="EngineConfig")
    reads_in_flight: int = _knob(
        "TF_RDMA_READS_IN_FLIGHT", "int", 4,
        "Rendezvous chunks pulled concurrently per message.",
        lo=1, hi=64, engine="ConnConfig")
    stream_window: int = _knob(
        "TF_RDMA_STREAM_WINDOW", "size", 1 * MiB,
        "Eager bytes one stream may have unread at the receiver (flow control).",
        lo=64 * KiB, hi=1 * GiB, engine="ConnConfig")
    keepalive_timeout_ms: int = _knob(
        "TF_RDMA_KEEPALIVE_TIMEOUT_MS", "int", 10000,
        "Milliseconds a PING may go unanswered before the connection and its calls fail "
        "(UNAVAILABLE); raise it for peers whose handlers hold the GIL or whose CPUs are "
        "starved for longer.",
        lo=1000, hi=3_600_000, what="integer number of milliseconds", engine="ConnConfig",
        ctype="uint32_t")
    zero_copy_min: int = _knob(
        "TF_RDMA_ZERO_COPY_MIN", "size", 1 * MiB,
        "Shm only: a received message of at least this many bytes is handed to the "
        "deserializer as a read-only view of the sender's pool block instead of a copy.",
        lo=4 * KiB, hi=64 * GiB, zero_off=True, engine="ConnConfig")
    over_tls: bool = _knob(
        "TF_RDMA_OVER_TLS", "bool", False,
        "`true`: allow the fast path for `secure_channel`/`add_secure_port` (the "
        "shared-memory data path is not encrypted).")
    malloc_tuning: bool = _knob(
        "TF_RDMA_MALLOC_TUNING", "bool", True,
        "`true`: tune glibc malloc to keep freed heap memory for reuse (see the malloc_* "
        "limits), so protobuf's multi-MiB buffers do not page-fault on every message; "
        "process-wide: environment only.",
        scope="process", engine="EngineConfig")


def _table() -> tuple[Knob, ...]:
    return tuple(dataclasses.replace(f.metadata["knob"], field=f.name)
                 for f in dataclasses.fields(Config))


TABLE: tuple[Knob, ...] = _table()
_BY_NAME: dict[str, Knob] = {k.name: k for k in TABLE}

# (name, default_text, meaning): what the README table is generated and checked from.
KNOBS: list[tuple[str, str, str]] = [(k.name, k.default_shown(), k.meaning) for k in TABLE]


def knob(name: str) -> Knob:
    """The knob called `name` (TF_RDMA_...); KeyError if there is none."""
    return _BY_NAME[name]


def knob_table_markdown() -> str:
    """The README's knob table (Markdown), one row per TF_RDMA_* variable."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for k in TABLE:
        rows.append(f"| `{k.name}` | {k.default_shown()} | {k.accepted_short()} | {k.meaning} |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------ fixed values

@dataclasses.dataclass(frozen=True)
class Fixed:
    """A limit or timeout argrpc does not let users set, declared with its reason."""

    value: int | float
    meaning: str
    engine: bool = False   # the C++ engine uses it (generated into csrc/knobs.h)
    struct: str = ""       # the engine's config struct that carries it as a field, if any
    ctype: str = ""        # that field's C++ type
    field: str = ""


def _fixed(value: int | float, meaning: str, engine: bool = False, struct: str = "",
           ctype: str = "") -> Any:
    assert bool(struct) == bool(ctype) and (engine or not struct), meaning
    return dataclasses.field(default=value, metadata={
        "fixed": Fixed(value=value, meaning=meaning, engine=engine, struct=struct,
                       ctype=ctype)})


@dataclasses.dataclass(frozen=True)
class Limits:
    """Every fixed limit and timeout of argrpc, Python's and the engine's (`LIMITS`)."""

    negotiation_timeout_s: float = _fixed(
        5.0, "a channel's negotiation (the Negotiate call plus the fabric's handshake) "
        "when the call that triggers it has no shorter deadline")
    renegotiate_interval_s: float = _fixed(
        1.0, "how soon a channel whose fast path failed or was refused for a retryable "
        "reason asks again")
    handshake_io_timeout_s: float = _fixed(
        5.0, "each read or write of the shared-memory handshake on its unix socket")
    handshake_secret_ttl_s: float = _fixed(
        30.0, "how long a secret granted by Negotiate may wait for its handshake")
    server_poll_s: float = _fixed(
        0.25, "longest sleep of a server's dispatcher and workers between checks of "
        "stop() and the pool")
    spare_worker_idle_s: float = _fixed(
        0.05, "an idle server worker beyond the first gives its pool thread back after this")
    last_worker_idle_s: float = _fixed(
        1.0, "the last idle server worker gives its pool thread back after this")
    transparent_retries: int = _fixed(
        3, "a call that ended UNAVAILABLE before it left the process (its connection failed "
        "between the channel's choice and the call's start) starts again where the channel "
        "routes it next, up to this many times (gRFC A6's transparent retries; "
        "grpc.enable_retries=0 turns them off)")
    call_thread_idle_s: float = _fixed(
        10.0, "a client's thread that runs done-callbacks of fast-path calls exits after "
        "this long with none to watch")
    credit_stall_seconds: float = _fixed(
        10.0, "a sender waiting this long for ring credits from a peer that does answer "
        "keepalives fails the connection (the peer stopped reading)", engine=True)
    keepalive_ms: int = _fixed(
        1000, "a connection with calls in flight that heard nothing from its peer for "
        "this long sends a PING", engine=True,
        struct="ConnConfig", ctype="uint32_t")
    idle_keepalive_ms: int = _fixed(
        2000, "the same for an idle connection on a fabric without a liveness fd (verbs), "
        "so a peer that died between calls is found before the next call", engine=True,
        struct="ConnConfig", ctype="uint32_t")
    interrupt_poll_ms: int = _fixed(
        50, "a sleeping wait on the main thread runs Python's signal handlers this often",
        engine=True)
    cq_slots: int = _fixed(
        1024, "eager batches a connection may have in flight before the receiver "
        "consumes them", engine=True,
        struct="ConnConfig", ctype="uint32_t")
    credit_owe_fraction: int = _fixed(
        8, "verbs: ring credits a reader may owe, as a fraction of its ring and of its "
        "receive slots, before it returns them (each return is an RDMA write and an ACK of "
        "its own, so a call returns none and costs one batch and its ACK each way)",
        engine=True)
    credit_owe_ms: int = _fixed(
        5, "verbs: credits owed this long are returned, however few, by the next thread "
        "that starts to poll (when none does, by the progress thread within "
        "longest_sleep_ms)", engine=True)
    call_records_max: int = _fixed(
        65536, "metrics: call records the engine keeps for the OpenTelemetry plugin between "
        "two takes; beyond it they are counted as dropped (argrpc.metrics.dropped_records)",
        engine=True)
    metrics_drain_s: float = _fixed(
        0.1, "metrics: how often the OpenTelemetry plugin records the engine's call "
        "records (and before every collection)")
    sweep_ms: int = _fixed(
        5, "how soon a keepalive verdict held back by a busy poll lock is tried again",
        engine=True)
    longest_sleep_ms: int = _fixed(
        100, "the progress thread's longest sleep: otherwise it sweeps a shared-memory "
        "connection only when a deadline or keepalive is due, so an idle process does not "
        "wake hundreds of times a second", engine=True)
    lease_check_ms: int = _fixed(
        1, "a server worker that has just answered a call counts as polling until it is back "
        "in accept(), so the peer's next request rings no doorbell; a worker held up on that "
        "way (preempted, waiting for the GIL) holds the process's messages back about this "
        "long at most: the progress thread, finding such a worker on its way as it goes to "
        "sleep, sleeps this long instead, and a thread that has waited this long on a call "
        "looks itself and rings the peer even if the peer says it polls (an asyncio "
        "client's calls have no such thread: for them, longest_sleep_ms). An asyncio loop "
        "that found work counts as polling the same way until it polls again; the progress "
        "thread ends that once the loop has not come back for this long", engine=True)
    spin_poll_us: int = _fixed(
        2, "a waiting thread that spins polls for up to this long between two yields of its "
        "CPU (a yield is a system call, and what arrives during one is seen only after it), "
        "as long as its last yield came back within yield_shared_us: otherwise another "
        "thread wants that CPU, perhaps the one it waits for, and it yields at every turn",
        engine=True)
    yield_shared_us: int = _fixed(
        1, "a yield that takes this long or longer ran another thread on the CPU meanwhile "
        "if the kernel switched the thread out (its involuntary context switches, read only "
        "then; see spin_poll_us): one that ran nothing returns within half a microsecond, "
        "unless the hypervisor took the vCPU away, which a VM on a busy host sees hundreds "
        "of times a second and which is no other thread wanting the CPU",
        engine=True)
    share_nap_after: int = _fixed(
        16, "a waiting thread whose yields ran another thread this many times in a row naps "
        "once (a timer sleep of some tens of microseconds): two threads that wait for each "
        "other from one CPU while another CPU idles hand that CPU back and forth at every "
        "message, and the kernel leaves them so for tens of milliseconds, as neither ever "
        "sleeps; waking from the nap, the thread is placed on an idle CPU if there is one",
        engine=True)
    arm_tries: int = _fixed(
        4, "rounds in which the last thread to stop polling reads what came in before it "
        "could ask the peers to ring again, and asks again, before it leaves the rest to the "
        "progress thread (a fabric that already holds work cannot be armed)", engine=True)
    cool_ms: int = _fixed(
        5, "a connection neither heard from nor called on for this long is left to its "
        "doorbell: armed, and no longer read by every polling thread, so a poll pass costs "
        "what the busy connections cost, not every connection of the process (dropped by "
        "the next thread that starts to poll, or by the progress thread's next pass: not on "
        "a timer of its own, which would take a CPU from the threads that poll)", engine=True)
    poll_hold_ms: int = _fixed(
        5, "longest stretch one thread reads a connection while completions keep coming "
        "(a long pull on a slow fabric) before it lets go, so the sweep and PING answers "
        "are not held back", engine=True)
    verbs_ring_budget: int = _fixed(
        64 * MiB, "verbs: receive-ring bytes a process registers (pins) across its "
        "connections before new connections get smaller rings, halved down to 64K (and no "
        "lower than four times TF_RDMA_ACC_SIZE); a connection uses the smaller of its two "
        "sides' rings both ways, so a server with many clients pins little per connection",
        engine=True)
    pull_ahead: int = _fixed(
        2, "large messages pulled ahead of the reader per stream", engine=True,
        struct="ConnConfig", ctype="int")
    slab_size: int = _fixed(
        16 * MiB, "the buffer pool's first growth step (pre-faulted); later steps double",
        engine=True,
        struct="EngineConfig", ctype="size_t")
    parallel_copy_min: int = _fixed(
        2 * MiB, "copies at least this big use two threads", engine=True,
        struct="EngineConfig", ctype="size_t")
    malloc_mmap_threshold: int = _fixed(
        32 * MiB, "glibc M_MMAP_THRESHOLD under TF_RDMA_MALLOC_TUNING (glibc's maximum)",
        engine=True,
        struct="EngineConfig", ctype="size_t")
    malloc_trim_threshold: int = _fixed(
        384 * MiB, "glibc M_TRIM_THRESHOLD under TF_RDMA_MALLOC_TUNING: a free top of the "
        "heap above it goes back at once; at 64 MiB a protobuf client frees 256 MiB there "
        "between calls (upb's 128 MiB encode block and two 64 MiB messages)", engine=True,
        struct="EngineConfig", ctype="size_t")
    malloc_mmap_max: int = _fixed(
        0, "glibc M_MMAP_MAX under TF_RDMA_MALLOC_TUNING: no block is a mapping of its own, "
        "so blocks above the 32M threshold (a 64 MiB protobuf message's buffers) are reused "
        "from the heap instead of mapped and page-faulted afresh for every message; what the "
        "heap keeps is bounded by malloc_retain_max", engine=True,
        struct="EngineConfig", ctype="int")
    malloc_arena_max: int = _fixed(
        1, "glibc M_ARENA_MAX under TF_RDMA_MALLOC_TUNING (set when argrpc is imported, "
        "again when the fast path starts): threads that first allocate after that share "
        "the main heap instead of per-thread ones, which map anything near 64M afresh "
        "every time", engine=True,
        struct="EngineConfig", ctype="int")
    malloc_retain_max: int = _fixed(
        384 * MiB, "under TF_RDMA_MALLOC_TUNING, freed heap memory kept for reuse: when a "
        "message of at least malloc_mmap_threshold is sent or received and the heap holds "
        "more than this free, argrpc gives all of it back (glibc malloc_trim(0)); again 0.1, 1 and 10 s after such messages stop. A message "
        "above a quarter of this gives all free memory back at those checks, whatever the "
        "amount (its buffers could not be kept anyway)", engine=True,
        struct="EngineConfig", ctype="size_t")


LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class EngineArg:
    """A field of an engine config struct that is neither a knob nor fixed: Python passes
    it from the channel's or server's grpc options."""

    struct: str
    field: str
    ctype: str
    default: int
    meaning: str


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("ConnConfig", "max_recv", "int64_t", GRPC_DEFAULT_MAX_RECV,
              "grpc.max_receive_message_length (-1: unlimited)"),
)
# The engine's config structs (csrc/engine_config.h), whose fields csrc/knobs.h lists.
ENGINE_STRUCTS = ("EngineConfig", "ConnConfig", "VerbsConfig")
FIXED: tuple[Fixed, ...] = tuple(dataclasses.replace(f.metadata["fixed"], field=f.name)
                                 for f in dataclasses.fields(Limits))


def _fixed_shown(f: Fixed) -> str:
    if f.field.endswith("_s") or f.field.endswith("_seconds"):
        return f"{f.value:g} s"
    if f.field.endswith("_ms"):
        return f"{f.value} ms"
    if f.field.endswith("_us"):
        return f"{f.value} µs"
    if isinstance(f.value, int) and f.value >= MiB:
        return fmt_size(f.value)
    return str(f.value)


def limits_table_markdown() -> str:
    """The README's table of fixed limits and timeouts (Markdown)."""
    rows = ["| limit | value | meaning |", "|---|---|---|"]
    for f in FIXED:
        rows.append(f"| `{f.field}` | {_fixed_shown(f)} | {f.meaning} |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- options

def _iter_options(options: Any) -> Iterable[tuple[str, Any]]:
    if options is None:
        return ()
    if isinstance(options, Mapping):
        return list(options.items())
    out = []
    for item in options:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"options must be (key, value) pairs, got {item!r}")
        out.append((item[0], item[1]))
    return out


def _is_argrpc_key(key: Any) -> bool:
    return isinstance(key, str) and key.upper().startswith(PREFIX)


def split_options(options: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Split gRPC-style options into (grpc_options, argrpc_options).

    TF_RDMA_* keys never reach grpc (grpc would ignore them, but they would also change
    the channel-args identity and defeat subchannel sharing).
    """
    if isinstance(options, Mapping) and options:
        # grpc iterates what it is given: a mapping's keys are no (key, value) pairs, and
        # grpc refuses them with a ValueError when the channel or server is made.
        raise ConfigError(f"options must be a sequence of (key, value) pairs, not a "
                          f"{type(options).__name__}")
    grpc_opts: list[tuple[str, Any]] = []
    ours: list[tuple[str, Any]] = []
    for key, value in _iter_options(options):
        (ours if _is_argrpc_key(key) else grpc_opts).append((key, value))
    return grpc_opts, ours


def load(options: Any = None, environ: Mapping[str, str] | None = None) -> Config:
    """Build a Config from the environment, overridden by TF_RDMA_* options.

    `options` may hold grpc keys too (they are ignored here). Raises ConfigError.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for k in TABLE:
        raw = env.get(k.name)
        if raw is None or raw == "":
            continue  # `VAR=` in a shell or container spec conventionally means unset
        values[k.field] = _parse_one(k, raw, "environment variable")
    for key, value in _iter_options(options):
        if not _is_argrpc_key(key):
            continue
        opt = _BY_NAME.get(key.upper())
        if opt is None:
            raise ConfigError(
                f"unknown option {key!r}: argrpc options are "
                + ", ".join(k.name for k in TABLE))
        if opt.process_wide:
            raise ConfigError(
                f"{opt.name} is process-wide (one engine per process): set it in the "
                f"environment, not as a channel/server option (got option value {value!r})")
        values[opt.field] = _parse_one(opt, value, "option")
    cfg = Config(**values)
    if cfg.acc_size > cfg.ring_size // 4:
        raise ConfigError(
            f"TF_RDMA_ACC_SIZE={fmt_size(cfg.acc_size)} is invalid: accepted is "
            f"{knob('TF_RDMA_ACC_SIZE').accepted()} (TF_RDMA_RING_SIZE is "
            f"{fmt_size(cfg.ring_size)}, so at most {fmt_size(cfg.ring_size // 4)})")
    return cfg


def _parse_one(k: Knob, raw: Any, source: str) -> Any:
    try:
        return k.parse(raw)
    except ValueError as e:
        raise ConfigError(f"{k.name}={raw!r} ({source}) is invalid: accepted is {e}") from None


# --------------------------------------------------------------------------- derived

def _grpc_int_option(grpc_options: Any, key: str, default: int) -> int:
    value = default
    # grpc applies channel args in order, so the last occurrence wins.
    for k, v in _iter_options(grpc_options):
        if k == key:
            try:
                value = int(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{key}={v!r} is invalid: accepted is an integer (-1 = unlimited)") from None
    return -1 if value < 0 else value


def max_receive_length(grpc_options: Any) -> int:
    """grpc.max_receive_message_length (default 4 MiB; -1 = unlimited)."""
    return _grpc_int_option(grpc_options, _MAX_RECV_KEY, GRPC_DEFAULT_MAX_RECV)


_COMPRESSION_KEY = "grpc.compression_enabled_algorithms_bitset"
# grpc.Compression values are the bit numbers: Deflate 1, Gzip 2 (no compression is
# always enabled).
_COMPRESSION_BITS = 0b110


def compression_disabled(grpc_options: Any) -> int:
    """The compression algorithms a server refuses (bit `grpc.Compression.value`), from
    grpc.compression_enabled_algorithms_bitset; 0 when it accepts all, as by default. A
    value that is not an integer grpc ignores, and so does argrpc."""
    enabled = _COMPRESSION_BITS
    for k, v in _iter_options(grpc_options):
        if k == _COMPRESSION_KEY and isinstance(v, int):
            enabled = v
    return _COMPRESSION_BITS & ~enabled


def max_send_length(grpc_options: Any) -> int:
    """grpc.max_send_message_length (default -1 = unlimited)."""
    return _grpc_int_option(grpc_options, _MAX_SEND_KEY, GRPC_DEFAULT_MAX_SEND)


def _struct_values(cfg: Config, struct: str) -> dict[str, int]:
    return {k.field: int(getattr(cfg, k.field)) for k in TABLE if k.engine == struct}


def engine_config(cfg: Config) -> dict[str, int]:
    """Config dict for `_core.Engine(...)` (process-wide knobs only)."""
    return _struct_values(cfg, "EngineConfig")


def conn_config(cfg: Config, max_recv: int) -> dict[str, int]:
    """Config dict for `Engine.new_shm_endpoint(...)`/`new_verbs_endpoint(...)`: the
    per-connection knobs, the verbs ones included (the shm fabric has no use for them)."""
    out = _struct_values(cfg, "ConnConfig")
    out.update(_struct_values(cfg, "VerbsConfig"))
    out["max_recv"] = -1 if max_recv is None or max_recv < 0 else int(max_recv)
    return out
