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
from typing import Any, Callable, Iterable, Mapping

__all__ = [
    "Config",
    "ConfigError",
    "KNOBS",
    "PREFIX",
    "conn_config",
    "engine_config",
    "knob_table_markdown",
    "load",
    "max_receive_length",
    "max_send_length",
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


@dataclasses.dataclass(frozen=True)
class Config:
    enabled: bool = True
    transport: str = "auto"
    dev_name: str | None = None
    port_num: int | None = None      # None: the device's first ACTIVE port
    gid_index: int | None = None     # None: chosen automatically (see verbs_select)
    qps: int = 2
    chunk_size: int = 4 * MiB
    acc_size: int = 8 * KiB
    buf_size: int = 1 * GiB
    ring_size: int = 1 * MiB
    spin_us: int = 50
    reads_in_flight: int = 4
    stream_window: int = 1 * MiB
    zero_copy_min: int = 1 * MiB
    over_tls: bool = False
    malloc_tuning: bool = True


# --------------------------------------------------------------------------- parsing

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": KiB, "m": MiB, "g": GiB}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _fmt_size(n: int) -> str:
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


@dataclasses.dataclass(frozen=True)
class _Knob:
    name: str
    field: str
    default_text: str
    accepted: str
    meaning: str
    parse: Callable[[Any], Any]  # raises ValueError with no variable name; load() adds it
    process_wide: bool = False


def _bad(accepted: str) -> ValueError:
    return ValueError(accepted)


def _bool_parser(accepted: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, (str, bytes)):
            text = value.decode() if isinstance(value, bytes) else value
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
        raise _bad(accepted)

    return parse


def _size_parser(lo: int, hi: int, accepted: str, power_of_two: bool = False,
                 zero_or_min: int = 0) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise _bad(accepted)
        if isinstance(value, int):
            n = value
        elif isinstance(value, (str, bytes)):
            try:
                n = parse_size(value.decode() if isinstance(value, bytes) else value)
            except ValueError:
                raise _bad(accepted) from None
        else:
            raise _bad(accepted)
        if not lo <= n <= hi or (power_of_two and n & (n - 1)) or 0 < n < zero_or_min:
            raise _bad(accepted)
        return n

    return parse


def _int_parser(lo: int, hi: int, accepted: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise _bad(accepted)
        if isinstance(value, int):
            n = value
        elif isinstance(value, (str, bytes)):
            text = (value.decode() if isinstance(value, bytes) else value).strip()
            if not re.fullmatch(r"\d+", text):
                raise _bad(accepted)
            n = int(text)
        else:
            raise _bad(accepted)
        if not lo <= n <= hi:
            raise _bad(accepted)
        return n

    return parse


TRANSPORTS = ("auto", "verbs", "shm", "grpc")
_TRANSPORT_ACCEPTED = "one of " + ", ".join(TRANSPORTS)


def _parse_transport(value: Any) -> str:
    if not isinstance(value, (str, bytes)):
        raise _bad(_TRANSPORT_ACCEPTED)
    low = (value.decode() if isinstance(value, bytes) else value).strip().lower()
    if low not in TRANSPORTS:
        raise _bad(_TRANSPORT_ACCEPTED)
    return low


def _auto_or_int(lo: int, hi: int, accepted: str) -> Callable[[Any], int | None]:
    """An integer in [lo, hi], or `auto` (None: argrpc chooses)."""
    parse_int = _int_parser(lo, hi, accepted)

    def parse(value: Any) -> int | None:
        if isinstance(value, (str, bytes)):
            text = value.decode() if isinstance(value, bytes) else value
            if text.strip().lower() == "auto":
                return None
        return parse_int(value)

    return parse


_DEV_ACCEPTED = "a non-empty RDMA device name such as mlx5_0"


def _parse_dev(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, str) or not value.strip():
        raise _bad(_DEV_ACCEPTED)
    return value.strip()


def _size_accepted(lo: int, hi: int, extra: str = "") -> str:
    return (f"a size in bytes or with a K/M/G suffix (KiB/MiB/GiB) from "
            f"{_fmt_size(lo)} to {_fmt_size(hi)}{extra}")


_BOOL_ACCEPTED = "true/false/1/0/yes/no/on/off"
_CHUNK_ACC = _size_accepted(64 * KiB, 1 * GiB)
_ACC_ACC = _size_accepted(1 * KiB, 1 * MiB, ", at most TF_RDMA_RING_SIZE/4")
_BUF_ACC = _size_accepted(64 * MiB, 64 * GiB)
_RING_ACC = _size_accepted(64 * KiB, 256 * MiB, ", a power of two")
_SPIN_ACC = "an integer number of microseconds from 0 to 100000"
_READS_ACC = "an integer from 1 to 64"
_WINDOW_ACC = _size_accepted(64 * KiB, 1 * GiB)
_ZC_ACC = "0 (off) or " + _size_accepted(4 * KiB, 64 * GiB)
_PORT_ACC = "auto or a port number from 1 to 255"
_GID_ACC = "auto or a GID table index from 0 to 65535"
_QPS_ACC = "an integer from 1 to 16"

_KNOBS: tuple[_Knob, ...] = (
    _Knob("TF_RDMA_ENABLED", "enabled", "true", _BOOL_ACCEPTED,
          "`false`: every channel and server is plain gRPC",
          _bool_parser(_BOOL_ACCEPTED)),
    _Knob("TF_RDMA_TRANSPORT", "transport", "auto", "auto, verbs, shm, grpc",
          "`auto`: shared memory on one host, RDMA verbs across hosts when both ends have "
          "a usable device, else gRPC; `verbs`/`shm`: require that transport, also on one "
          "host (calls fail UNAVAILABLE with the reason instead of falling back); `grpc`: "
          "never use a fast path. `argrpc doctor --target HOST:PORT` tells which one a "
          "channel gets and why",
          _parse_transport),
    _Knob("TF_RDMA_DEV_NAME", "dev_name", "`mlx5_0` if present, else the first device with "
          "an ACTIVE port", _DEV_ACCEPTED,
          "RDMA device used by the verbs fabric; a named device that is missing or has no "
          "ACTIVE port is an error, not a fallback", _parse_dev),
    _Knob("TF_RDMA_PORT_NUM", "port_num", "auto: the device's first ACTIVE port", "auto, 1..255",
          "port of the RDMA device (verbs only); a named port that is not ACTIVE is an error",
          _auto_or_int(1, 255, _PORT_ACC)),
    _Knob("TF_RDMA_GID_INDEX", "gid_index", "auto: RoCEv2 with an IPv4-mapped address, else "
          "RoCEv2, else RoCEv1, else InfiniBand (LID)", "auto, 0..65535",
          "GID table index used as the source address of the verbs queue pairs",
          _auto_or_int(0, 65535, _GID_ACC)),
    _Knob("TF_RDMA_QPS", "qps", "2", "1..16",
          "RC queue pairs per verbs connection: rendezvous reads are spread over them "
          "(1, 2 and 4 measured equal on Soft-RoCE: docs/benchmarks.md; 2 keeps the "
          "spreading in use at half the queue pairs of 4)",
          _int_parser(1, 16, _QPS_ACC)),
    _Knob("TF_RDMA_CHUNK_SIZE", "chunk_size", "4M", "64K..1G",
          "rendezvous chunk size: large messages are pulled in chunks of this size",
          _size_parser(64 * KiB, 1 * GiB, _CHUNK_ACC)),
    _Knob("TF_RDMA_ACC_SIZE", "acc_size", "8K", "1K..1M, ≤ TF_RDMA_RING_SIZE/4",
          "eager/coalescing size: smaller messages are batched into one write, larger "
          "ones go rendezvous",
          _size_parser(1 * KiB, 1 * MiB, _ACC_ACC)),
    _Knob("TF_RDMA_BUF_SIZE", "buf_size", "1G", "64M..64G (any size, not only whole GiB)",
          "registered, pre-faulted buffer pool of the process; process-wide: environment "
          "only",
          _size_parser(64 * MiB, 64 * GiB, _BUF_ACC), process_wide=True),
    _Knob("TF_RDMA_RING_SIZE", "ring_size", "1M", "64K..256M, power of two",
          "receive ring per connection and direction", _size_parser(
              64 * KiB, 256 * MiB, _RING_ACC, power_of_two=True)),
    _Knob("TF_RDMA_SPIN_US", "spin_us", "50", "0..100000",
          "how long a waiting thread spins (yielding) before it blocks; process-wide: "
          "environment only",
          _int_parser(0, 100000, _SPIN_ACC), process_wide=True),
    _Knob("TF_RDMA_READS_IN_FLIGHT", "reads_in_flight", "4", "1..64",
          "rendezvous chunks pulled concurrently per message",
          _int_parser(1, 64, _READS_ACC)),
    _Knob("TF_RDMA_STREAM_WINDOW", "stream_window", "1M", "64K..1G",
          "eager bytes one stream may have unread at the receiver (flow control)",
          _size_parser(64 * KiB, 1 * GiB, _WINDOW_ACC)),
    _Knob("TF_RDMA_ZERO_COPY_MIN", "zero_copy_min", "1M", "0 (off) or 4K..64G",
          "shm only: a received message at least this big is handed to the deserializer "
          "as a read-only view of the sender's pool block (one copy fewer); the sender's "
          "block returns when the view is released. At most 1/4 of the sender's pool is "
          "lent per connection, beyond that messages are copied",
          _size_parser(0, 64 * GiB, _ZC_ACC, zero_or_min=4 * KiB)),
    _Knob("TF_RDMA_OVER_TLS", "over_tls", "false", _BOOL_ACCEPTED,
          "`true`: allow the fast path for `secure_channel`/`add_secure_port` (the "
          "shared-memory data path is not encrypted)",
          _bool_parser(_BOOL_ACCEPTED)),
    _Knob("TF_RDMA_MALLOC_TUNING", "malloc_tuning", "true", _BOOL_ACCEPTED,
          "`true`: when the fast path starts, keep freed heap memory for reuse (glibc "
          "`M_MMAP_THRESHOLD`=32M, `M_TRIM_THRESHOLD`=256M) so protobuf's fresh multi-MiB "
          "buffers do not page-fault on every message; `false`: leave malloc alone; "
          "process-wide: environment only",
          _bool_parser(_BOOL_ACCEPTED), process_wide=True),
)

_BY_NAME: dict[str, _Knob] = {k.name: k for k in _KNOBS}

# (name, default_text, meaning): what the README table is generated and checked from.
KNOBS: list[tuple[str, str, str]] = [(k.name, k.default_text, k.meaning) for k in _KNOBS]


def knob_table_markdown() -> str:
    """The README's knob table (Markdown), one row per TF_RDMA_* variable."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for k in _KNOBS:
        rows.append(f"| `{k.name}` | {k.default_text} | {k.accepted} | {k.meaning} |")
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
    for knob in _KNOBS:
        raw = env.get(knob.name)
        if raw is None or raw == "":
            continue  # `VAR=` in a shell or container spec conventionally means unset
        values[knob.field] = _parse_one(knob, raw, "environment variable")
    for key, value in _iter_options(options):
        if not _is_argrpc_key(key):
            continue
        knob = _BY_NAME.get(key.upper())
        if knob is None:
            raise ConfigError(
                f"unknown option {key!r}: argrpc options are "
                + ", ".join(k.name for k in _KNOBS))
        if knob.process_wide:
            raise ConfigError(
                f"{knob.name} is process-wide (one engine per process): set it in the "
                f"environment, not as a channel/server option (got option value {value!r})")
        values[knob.field] = _parse_one(knob, value, "option")
    cfg = Config(**values)
    if cfg.acc_size > cfg.ring_size // 4:
        raise ConfigError(
            f"TF_RDMA_ACC_SIZE={_fmt_size(cfg.acc_size)} is invalid: accepted is "
            f"{_ACC_ACC} (TF_RDMA_RING_SIZE is {_fmt_size(cfg.ring_size)}, so at most "
            f"{_fmt_size(cfg.ring_size // 4)})")
    return cfg


def _parse_one(knob: _Knob, raw: Any, source: str) -> Any:
    try:
        return knob.parse(raw)
    except ValueError as e:
        raise ConfigError(f"{knob.name}={raw!r} ({source}) is invalid: accepted is {e}") from None


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


def max_send_length(grpc_options: Any) -> int:
    """grpc.max_send_message_length (default -1 = unlimited)."""
    return _grpc_int_option(grpc_options, _MAX_SEND_KEY, GRPC_DEFAULT_MAX_SEND)


def engine_config(cfg: Config) -> dict[str, int]:
    """Config dict for `_core.Engine(...)` (process-wide knobs only)."""
    return {"buf_size": cfg.buf_size, "spin_us": cfg.spin_us,
            "malloc_tuning": int(cfg.malloc_tuning)}


def conn_config(cfg: Config, max_recv: int) -> dict[str, int]:
    """Config dict for `Engine.new_shm_endpoint(...)`/`new_verbs_endpoint(...)` (per-connection knobs)."""
    return {
        "ring_size": cfg.ring_size,
        "acc_size": cfg.acc_size,
        "chunk_size": cfg.chunk_size,
        "reads_in_flight": cfg.reads_in_flight,
        "stream_window": cfg.stream_window,
        "zero_copy_min": cfg.zero_copy_min,
        "max_recv": -1 if max_recv is None or max_recv < 0 else int(max_recv),
    }
