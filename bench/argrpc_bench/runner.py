"""Runs one ``RunSpec``: per transport, the server and client (or PS and worker)
processes, and turns what they report into ``Measurement``s.

Every measured process is a fresh ``python -m argrpc_bench.<module>`` with the
environment ``os.environ | spec.env``: a ``--sweep`` value reaches the measured processes
and nothing else, and this (orchestrating) process never changes its own environment.
Children run with the working directory that holds the ``argrpc`` package this process
imported, so they measure the same code even from an uninstalled checkout.

Transports run one after the other (never two stacks on the two cores at once), in the
order given. grpc uses ``grpc.server`` / ``grpc.insecure_channel``; shm and verbs use
``argrpc.server`` / ``argrpc.insecure_channel`` (with ``api="aio"``: ``grpc.aio`` and
``argrpc.aio``, one event loop per process) with TF_RDMA_TRANSPORT set to the measured
transport (on one host argrpc picks shm unless verbs is forced; a spec's own
TF_RDMA_TRANSPORT wins), and every client checks that its channel really is on that
transport, failing with the fallback reason otherwise.

Process hygiene: servers exit when their stdin closes, clients and workers exit when
theirs does, every wait is bounded, and on any error or timeout every process of the
transport (or reference) being measured is killed before the next one starts.

A run never loses its other rows to one transport: when a transport's processes fail (a
child crashes, times out or prints nonsense, a client's channel is not on the measured
transport, a server's TF_RDMA_* is not the spec's, a remote server does not answer), its
rows are skipped with ``failed`` set and ``not measured: <the error's first line>`` in
``note``, the whole error (with the child's last stderr lines) goes to the run's
``log``, and the other transports are measured as usual; the reference rows fail the
same way, alone. One client process measures all of a transport's sizes, so they fail
together. A transport this machine (or the spec's knobs) cannot offer is skipped with
the reason and without ``failed``, as is a floor size beyond the shm ring: those are
not failures. A spec that cannot run at all raises ValueError before any process starts.

Remote servers (``RunSpec.remote``, the CLI's ``--remote``): for latency and bandwidth
under the threaded API, a transport given a ``HOST:PORT`` starts no server here; its
client calls a server already serving there (``argrpc-bench serve`` on the other host).
The client gets no TF_RDMA_TRANSPORT from the runner then: across hosts argrpc must pick
verbs by itself, and the client's transport check fails its rows if it did not. The
remote server's TF_RDMA_* must match the spec's knobs (it reports them; checked as for a
local server), so a ``--sweep`` cannot reach it: start one server per value instead.
"""
from __future__ import annotations

import collections
import json
import math
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

from argrpc import _config, _transports
from argrpc_bench import APIS, BENCHMARKS, FAST_TRANSPORTS, MODES, SCHEMES, TRANSPORTS, loops
from argrpc_bench.results import Measurement

# The folder that holds the argrpc_bench package: bench/ in a checkout.
_BENCH_ROOT = Path(__file__).resolve().parent.parent

ProgressFn = Callable[[str, float], None]
LogFn = Callable[[str], None]

K, M = 1 << 10, 1 << 20
DEFAULT_SIZES: dict[str, list[int]] = {
    "latency": [64, 4 * K, 64 * K, M],
    "bandwidth": [M, 4 * M, 16 * M, 64 * M],
    "ps": [],
}
# Timed seconds per (size, transport) when neither iterations nor duration is given.
DEFAULT_DURATION: dict[str, float] = {"latency": 1.0, "bandwidth": 1.0, "ps": 3.0}
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
REMOTE_PROBE_S = 10.0
# (server, client) module of the point-to-point benchmarks per API.
P2P_MODULES: dict[str, tuple[str, str]] = {
    "threaded": ("argrpc_bench.server", "argrpc_bench.client"),
    "aio": ("argrpc_bench.aio_server", "argrpc_bench.aio_client"),
}
# Pessimistic rates for the time budget of a child (a 2-core machine under load).
_SLOW_BYTES_PER_S = 50e6
_SLOW_CALL_S = 0.005

# Where the imported argrpc package lives: children run from there.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class RunSpec:
    benchmark: str                 # latency | bandwidth | ps
    transports: list[str]          # subset of TRANSPORTS
    mode: str = "raw"              # serialized | raw
    scheme: str = "uniform"
    sizes: list[int] = field(default_factory=list)  # empty: DEFAULT_SIZES[benchmark]
    buffers: int = 1
    warmup: int = 10
    iterations: int | None = None  # or duration; neither: DEFAULT_DURATION[benchmark]
    duration: float | None = None  # seconds per (size, transport), split over repeats
    repeats: int = 1
    workers: int = 2               # ps
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)  # TF_RDMA_* for the measured processes only
    # Extensions beyond the A/B contract (defaults keep it):
    model_bytes: int | None = None  # ps: scale the model's variables to this total (tests)
    threads: int = 8                # server / PS thread-pool size, the same on every stack
    timeout: float | None = None    # per child process; None: estimated from the spec
    api: str = "threaded"           # threaded | aio (latency and bandwidth only)
    loop: str = "asyncio"           # aio: asyncio | uvloop, in both processes
    concurrency: int = 1            # latency: also N calls in flight on one channel
    # transport -> "HOST:PORT" of a server already running (elsewhere): no local server,
    # no forced TF_RDMA_TRANSPORT for that transport's client (latency/bandwidth, threaded)
    remote: dict[str, str] = field(default_factory=dict)
    clients: int = 1                # threaded latency/bandwidth: client processes on one
    #                                 server, timed phases started together (aggregate RPC/s)
    # latency and bandwidth under the threaded API, local servers: also measure the
    # reference rows (argrpc_bench.floor) after the transports, in the same run
    references: bool = False


class BenchError(RuntimeError):
    """A measured process failed, timed out or reported nonsense. ``message`` says what
    happened on one line or a few; ``str()`` adds the ``detail`` after it (the child's
    last stderr lines), which a row's note leaves out."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(f"{message}\n{detail}" if detail else message)
        self.message = message


class TransportError(BenchError):
    """A client's channel was not on the transport being measured (e.g. shm fell back to
    plain gRPC): its numbers would be gRPC's under the wrong name."""


# ---------------------------------------------------------------- transport availability

def _falsy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("false", "0", "no", "off")


def _argrpc_reason() -> str:
    """"" or why argrpc cannot run here."""
    try:
        import argrpc._core  # noqa: F401 - the C++ engine must load
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"argrpc's engine is not importable: {type(exc).__name__}: {exc}"
    return ""


def _child_config(env: Mapping[str, str]) -> _config.Config | None:
    try:
        return _config.load(environ=env)
    except _config.ConfigError:
        return None  # the measured processes report the bad knob themselves, as they fail


def transport_reasons(env: Mapping[str, str]) -> dict[str, str]:
    """Like ``available_transports`` for processes that would get ``env``."""
    out = {"grpc": ""}
    base = _argrpc_reason()
    disabled = ""
    if _falsy(env.get("TF_RDMA_ENABLED")):
        disabled = "TF_RDMA_ENABLED is false for the measured processes"
    elif env.get("TF_RDMA_TRANSPORT", "").strip().lower() == "grpc":
        disabled = "TF_RDMA_TRANSPORT=grpc for the measured processes"
    cfg = None if base or disabled else _child_config(env)
    for t in _transports.REGISTRY:
        out[t.name] = base or disabled or (t.why_unavailable(cfg) if cfg is not None else "")
    return out


def available_transports() -> dict[str, str]:
    """name -> "" if usable here, else the reason it is not."""
    return transport_reasons(os.environ)


# ------------------------------------------------------------------------ processes

class Child:
    """One measured process: ``python -m <module> args`` with stdout/stderr read on
    threads (so a chatty child never blocks on a full pipe), an event queue for the main
    thread, and the last stderr lines kept for error messages."""

    def __init__(self, name: str, module: str, args: Sequence[str],
                 env: Mapping[str, str]) -> None:
        self.name = name
        self.events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=_PACKAGE_ROOT, env=dict(env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1)
        self._threads = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(("out", line.rstrip("\n")))
        self.events.put(("eof", None))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            if line.startswith("PROGRESS "):
                try:
                    done, total = (int(x) for x in line.split()[1:3])
                    self.events.put(("progress", (done, total)))
                    continue
                except ValueError:
                    pass
            self.stderr_tail.append(line)

    def who(self) -> str:
        rc = self.proc.poll()
        return (f"{self.name} (pid {self.proc.pid}"
                + (f", exit code {rc}" if rc is not None else "") + ")")

    def stderr_text(self) -> str:
        tail = "\n".join(self.stderr_tail)
        return f"its stderr ends:\n{tail}" if tail else ""

    def describe(self) -> str:
        text = self.stderr_text()
        return self.who() + (f"; {text}" if text else "")

    def next_line(self, deadline: float, on_progress: Callable[[int, int], None] | None = None,
                  ) -> str:
        """Next stdout line; raises BenchError at EOF or when the deadline passes."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"timed out waiting for {self.who()}",
                                 self.stderr_text())
            try:
                kind, value = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if kind == "out":
                return cast(str, value)
            if kind == "progress":
                if on_progress is not None:
                    on_progress(*value)
                continue
            # EOF: give the stderr reader a moment so the message carries the cause.
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._threads[1].join(timeout=2)
            raise BenchError(f"{self.who()} ended without the expected output",
                             self.stderr_text())

    def expect(self, prefix: str, deadline: float) -> str:
        """The next line starting with ``prefix``; a JSON line instead is a reported
        failure (raised as such), other lines are skipped."""
        while True:
            line = self.next_line(deadline)
            if line.startswith(prefix):
                return line
            if line.startswith("{"):
                fail(self, parse_result(self, line))

    def result(self, deadline: float,
               on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """The child's one JSON result line, checked for ``ok``; the child is reaped."""
        while True:
            line = self.next_line(deadline, on_progress)
            if line.startswith("{"):
                break
        doc = parse_result(self, line)
        if not doc.get("ok"):
            fail(self, doc)
        try:  # it exits by itself after its result; closing stdin first would abort it
            self.proc.wait(timeout=max(1.0, min(STOP_TIMEOUT_S, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
        self.close(deadline)
        return doc

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self, deadline: float | None = None) -> None:
        """Close stdin (the child's signal to finish), wait a bounded time, else kill."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            wait = STOP_TIMEOUT_S if deadline is None else \
                max(1.0, min(STOP_TIMEOUT_S, deadline - time.monotonic()))
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


def parse_result(child: Child, line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise BenchError(f"{child.name} printed a malformed result line {line[:200]!r}: "
                         f"{exc}") from exc
    if not isinstance(doc, dict):
        raise BenchError(f"{child.name} printed a non-object result: {line[:200]!r}")
    return doc


def fail(child: Child, doc: dict[str, Any]) -> None:
    error = str(doc.get("error", "no error given"))
    if doc.get("kind") == "transport":
        raise TransportError(f"{child.name}: {error}", child.describe())
    raise BenchError(f"{child.name} failed: {error}", child.describe())


def spawn(stack: ExitStack, name: str, module: str, args: Sequence[str],
          env: Mapping[str, str]) -> Child:
    child = Child(name, module, args, env)
    stack.callback(child.kill)  # on any exit path: nothing outlives the run
    return child


def start_server(stack: ExitStack, name: str, module: str, args: Sequence[str],
                 env: Mapping[str, str], timeout: float = START_TIMEOUT_S
                 ) -> tuple[Child, int]:
    server = spawn(stack, name, module, args, env)
    line = server.expect("PORT ", time.monotonic() + timeout)
    return server, int(line.split()[1])


# ------------------------------------------------------------------------- helpers

def child_env(spec: RunSpec) -> dict[str, str]:
    """The measured processes' environment: ours plus the spec's knobs (never applied to
    ``os.environ``), and run from a checkout (bench/), argrpc-bench's own package
    importable, so the children run the code this process runs."""
    env = dict(os.environ) | {k: str(v) for k, v in spec.env.items()}
    if (_BENCH_ROOT / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_BENCH_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def transport_env(spec: RunSpec, transport: str) -> dict[str, str]:
    """``child_env`` for one transport's processes. On one host argrpc picks shm unless
    TF_RDMA_TRANSPORT=verbs, so the verbs (and shm) processes get TF_RDMA_TRANSPORT set to
    the transport being measured, unless the spec itself gives the knob (a --sweep value
    wins and the client's transport check reports the mismatch). A client of a remote
    server gets nothing added: the automatic choice is what is being measured there."""
    env = child_env(spec)
    if (transport in FAST_TRANSPORTS and "TF_RDMA_TRANSPORT" not in spec.env
            and transport not in spec.remote):
        env["TF_RDMA_TRANSPORT"] = transport
    return env


def reported_env(spec: RunSpec, transport: str, env: Mapping[str, str]) -> dict[str, str]:
    """A child's reported TF_RDMA_* without the TF_RDMA_TRANSPORT that ``transport_env``
    added (the transport column says it already; kept, it would split --sweep tables into
    one column per transport)."""
    out = dict(env)
    if "TF_RDMA_TRANSPORT" not in spec.env and out.get("TF_RDMA_TRANSPORT") == transport:
        del out["TF_RDMA_TRANSPORT"]
    return out


def stack_of(transport: str) -> str:
    return "grpc" if transport == "grpc" else "argrpc"


def _plan_args(spec: RunSpec) -> list[str]:
    out = ["--warmup", str(spec.warmup), "--repeats", str(spec.repeats)]
    if spec.iterations is not None:
        return out + ["--iterations", str(spec.iterations)]
    return out + ["--duration", str(spec.duration)]


def _per_call_s(spec: RunSpec) -> list[float]:
    """A pessimistic time per call at each of the spec's sizes."""
    return [_SLOW_CALL_S + s / _SLOW_BYTES_PER_S for s in spec.sizes]


def _budget(spec: RunSpec, per_call_s: Sequence[float], calls_per_unit: int = 1) -> float:
    """A generous bound on a child's run time (seconds), from pessimistic rates."""
    if spec.timeout is not None:
        return spec.timeout
    total = START_TIMEOUT_S
    for c in per_call_s:
        total += (spec.warmup + 1) * c * calls_per_unit
        if spec.iterations is not None:
            total += spec.iterations * spec.repeats * c * calls_per_unit
        else:
            assert spec.duration is not None
            total += spec.duration + spec.repeats * c * calls_per_unit
    return total


def check_env(child: str, spec: RunSpec, reported: Mapping[str, str], whose: str) -> None:
    """The measured process must have exactly the knobs the spec gave it."""
    wrong = {k: reported.get(k) for k, v in spec.env.items() if reported.get(k) != str(v)}
    if wrong:
        raise BenchError(f"{child}: the {whose} process has {wrong}, the spec asked for "
                         f"{ {k: spec.env[k] for k in wrong} }")


def _base(spec: RunSpec, transport: str, size: int, buffers: int, **kw: Any) -> Measurement:
    return Measurement(benchmark=spec.benchmark, transport=transport, mode=spec.mode,
                       scheme=spec.scheme, size=size, buffers=buffers,
                       iterations=kw.pop("iterations", spec.iterations or 0),
                       repeats=spec.repeats, api=spec.api, loop=spec.loop,
                       clients=kw.pop("clients", spec.clients), **kw)


def _ps_sizes(spec: RunSpec) -> list[int]:
    from argrpc_bench.ps import variable_sizes

    return variable_sizes(spec.scheme, spec.seed, spec.model_bytes)


def skipped(spec: RunSpec, transport: str, reason: str, failed: bool = False
            ) -> list[Measurement]:
    env = {k: str(v) for k, v in spec.env.items()}
    if spec.benchmark == "ps":
        sizes = _ps_sizes(spec)
        return [_base(spec, transport, 2 * sum(sizes), len(sizes), workers=spec.workers,
                      env=env, note=reason, skipped=True, failed=failed)]
    return [_base(spec, transport, s, spec.buffers, env=env, note=reason, skipped=True,
                  failed=failed) for s in spec.sizes]


def _log_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def not_measured(spec: RunSpec, names: Sequence[str], error: BenchError,
                 log: LogFn | None) -> list[Measurement]:
    """The rows of ``names`` whose processes failed with ``error`` (all of them gone by
    now): skipped and ``failed``, the note naming the cause in one line so that tables
    stay readable, and the whole error to ``log`` so the child's stderr is not lost."""
    (log or _log_stderr)(f"{'/'.join(names)} not measured: {error}")
    first = next((line for line in error.message.splitlines() if line.strip()), "")
    why = f"not measured: {first.strip() or type(error).__name__}"
    return [m for name in names for m in skipped(spec, name, why, failed=True)]


# ------------------------------------------------------------------ point to point

def _concurrent(spec: RunSpec) -> bool:
    """Whether the client also measures calls in flight at once (latency only: threads
    on one channel, or tasks of one loop under asyncio)."""
    return spec.benchmark == "latency" and spec.concurrency > 1


def _client_args(spec: RunSpec, transport: str) -> list[str]:
    return ["--stack", stack_of(transport), "--transport", transport,
            "--benchmark", spec.benchmark, "--mode", spec.mode, "--scheme", spec.scheme,
            "--sizes", ",".join(str(s) for s in spec.sizes), "--buffers", str(spec.buffers),
            "--seed", str(spec.seed), *_plan_args(spec)]


def run_clients(spec: RunSpec, transport: str, progress: Callable[[int, int], None]
                ) -> list[Measurement]:
    """``spec.clients`` client processes on one server, each one call at a time, every
    timed phase started together: aggregate RPC/s over the window from the first
    client's start to the last one's end, latency percentiles over every call."""
    env = transport_env(spec, transport)
    server_module, client_module = P2P_MODULES["threaded"]
    per_call = _per_call_s(spec)
    with ExitStack() as procs:
        server, port = start_server(procs, f"{transport} server", server_module,
                                    ["--stack", stack_of(transport), "--threads",
                                     str(spec.threads)], env)
        args = ["--target", f"127.0.0.1:{port}", *_client_args(spec, transport),
                "--synchronized"]
        clients = [spawn(procs, f"{transport} client {i}", client_module, args, env)
                   for i in range(spec.clients)]
        # every process imports and connects on the same two cores first
        deadline = (time.monotonic() + START_TIMEOUT_S * (1 + spec.clients / 16)
                    + _budget(spec, per_call, calls_per_unit=spec.clients))
        for i in range(len(spec.sizes)):
            for _ in range(spec.repeats):
                for c in clients:
                    c.expect("READY", deadline)
                for c in clients:
                    c.send("GO")
            progress(i + 1, len(spec.sizes))
        docs = [c.result(deadline) for c in clients]
        server.close()
    for c, d in zip(clients, docs):
        check_env(c.name, spec, d["env"], "client")
        check_env(c.name, spec, d["server_env"], "server")
    out = []
    per_call_bytes = 2 if spec.benchmark == "latency" else 1
    for i, size in enumerate(spec.sizes):
        phases = [{"phases": d["results"][i]["phases"],
                   "step_ns": [x for ph in d["results"][i]["phases"] for x in ph["step_ns"]]}
                  for d in docs]
        agg = aggregate_phases(phases, spec.repeats)
        out.append(_base(spec, transport, size, spec.buffers,
                         iterations=min(ph["steps"] for d in phases for ph in d["phases"]),
                         p50_us=agg["p50_us"], p99_us=agg["p99_us"], mean_us=agg["mean_us"],
                         rpcs_per_s=agg["steps_per_s"],
                         gbps=agg["steps_per_s"] * per_call_bytes * size / 1e9,
                         env=reported_env(spec, transport, docs[0]["env"])))
    return out


def run_p2p(spec: RunSpec, transport: str, progress: Callable[[int, int], None]
            ) -> list[Measurement]:
    if spec.clients > 1:
        return run_clients(spec, transport, progress)
    env = transport_env(spec, transport)
    stack = stack_of(transport)
    server_module, client_module = P2P_MODULES[spec.api]
    who = transport if spec.api == "threaded" else f"{transport} {spec.api}"
    server_args = ["--stack", stack]
    client_args = _client_args(spec, transport)
    per_call = _per_call_s(spec)
    if spec.api == "threaded":
        server_args += ["--threads", str(spec.threads)]
    else:
        server_args += ["--loop", spec.loop]
        client_args += ["--loop", spec.loop]
        if spec.loop != "asyncio":
            who += f" on {spec.loop}"
    if _concurrent(spec):
        client_args += ["--concurrency", str(spec.concurrency)]
        per_call += per_call  # a second phase per size, as many calls (plus a warm-up round)
    remote = spec.remote.get(transport)
    if remote:
        who += f" (server {remote})"
    with ExitStack() as procs:
        server = None
        if remote:
            probe_remote(transport, remote)
            target = remote
        else:
            server, port = start_server(procs, f"{who} server", server_module, server_args,
                                        env)
            target = f"127.0.0.1:{port}"
        client = spawn(procs, f"{who} client", client_module, ["--target", target,
                                                                *client_args], env)
        doc = client.result(time.monotonic() + _budget(spec, per_call), progress)
        if server is not None:
            server.close()
    # The child's last PROGRESS line (stderr) may come after its result (stdout): the
    # two are read by different threads, so the run reports its end itself.
    progress(len(spec.sizes), len(spec.sizes))
    check_env(client.name, spec, doc["env"], "client")
    check_env(client.name, spec, doc["server_env"], "server")
    out = []
    for r in doc["results"]:
        out.append(_base(spec, transport, int(r["size"]), int(r["buffers"]),
                         iterations=int(r["iterations"]), p50_us=r["p50_us"],
                         p99_us=r["p99_us"], mean_us=r["mean_us"], gbps=r["gbps"],
                         rpcs_per_s=r["rpcs_per_s"], concurrency=int(r.get("concurrency", 1)),
                         env=reported_env(spec, transport, doc["env"])))
    return out


# ------------------------------------------------------------------ reference rows

def references_of(spec: RunSpec) -> tuple[str, ...]:
    """The reference rows a spec measures (none for ps, asyncio or remote servers:
    a floor on this host says nothing about a round trip to another)."""
    from argrpc_bench.floor import REFERENCES

    if not spec.references or spec.api != "threaded" or spec.remote or spec.clients > 1:
        return ()
    return REFERENCES.get(spec.benchmark, ())


def run_references(spec: RunSpec, reason: str, log: LogFn | None = None
                   ) -> list[Measurement]:
    """The floor (latency) or the memory-copy rates (bandwidth) at the spec's sizes;
    skipped rows saying ``reason`` when argrpc's engine cannot run here, failed ones
    (``not_measured``) when their processes fail."""
    from argrpc_bench.floor import FLOOR

    names = references_of(spec)
    if reason:
        return [m for name in names for m in skipped(spec, name, reason)]
    env = child_env(spec)
    module = "argrpc_bench.floor"
    args = ["--sizes", ",".join(str(s) for s in spec.sizes), "--seed", str(spec.seed),
            *_plan_args(spec)]
    per_call = _per_call_s(spec)
    try:
        with ExitStack() as procs:
            if FLOOR in names:
                server, pid = start_server(procs, "floor server", module, ["serve"], env)
                client = spawn(procs, "floor client", module,
                               ["client", "--target", f"{FLOOR}:{pid}", *args], env)
            else:
                server, client = None, spawn(procs, "memcpy", module, ["copy", *args], env)
            doc = client.result(time.monotonic() + _budget(spec, per_call * len(names)))
            if server is not None:
                server.close()
        check_env(client.name, spec, doc["env"], "reference")
    except BenchError as e:
        return not_measured(spec, names, e, log)
    out = []
    for r in doc["results"]:
        if "skipped" in r:
            out.append(_base(spec, FLOOR, int(r["size"]), spec.buffers, note=r["skipped"],
                             skipped=True, env={k: str(v) for k, v in spec.env.items()}))
            continue
        name = FLOOR if FLOOR in names else f"memcpy-{r['threads']}t"
        out.append(_base(spec, name, int(r["size"]), spec.buffers,
                         iterations=int(r["iterations"]), p50_us=r.get("p50_us"),
                         p99_us=r["p99_us"], mean_us=r["mean_us"], gbps=r["gbps"],
                         rpcs_per_s=r["rpcs_per_s"],
                         env={k: str(v) for k, v in spec.env.items()}))
    return out


# ----------------------------------------------------------------- parameter server

def _percentile_us(sorted_ns: Sequence[int], q: float) -> float:
    idx = min(len(sorted_ns) - 1, max(0, math.ceil(q * len(sorted_ns)) - 1))
    return sorted_ns[idx] / 1e3


def aggregate_phases(docs: Sequence[dict[str, Any]], repeats: int) -> dict[str, float]:
    """steps (or calls)/s over all worker (or client) processes: per timed phase, the
    total over the window from the first process's start to the last one's end; summed
    over phases."""
    steps = 0
    window_ns = 0
    for r in range(repeats):
        phases = [d["phases"][r] for d in docs]
        steps += sum(p["steps"] for p in phases)
        window_ns += max(p["end_ns"] for p in phases) - min(p["start_ns"] for p in phases)
    samples = sorted(s for d in docs for s in d["step_ns"])
    return {"steps_per_s": steps / (window_ns / 1e9),
            "p50_us": _percentile_us(samples, 0.50), "p99_us": _percentile_us(samples, 0.99),
            "mean_us": statistics.fmean(samples) / 1e3}


def run_ps(spec: RunSpec, transport: str, progress: Callable[[int, int], None]
           ) -> list[Measurement]:
    env = transport_env(spec, transport)
    stack = stack_of(transport)
    sizes = _ps_sizes(spec)
    # A step moves the model twice, in 2V RPCs, and the workers share the machine.
    step_s = spec.workers * (2 * len(sizes) * _SLOW_CALL_S + 2 * sum(sizes) / _SLOW_BYTES_PER_S)
    with ExitStack() as procs:
        ps_args = ["serve", "--stack", stack, "--scheme", spec.scheme, "--seed", str(spec.seed),
                   "--threads", str(spec.threads)]
        if spec.model_bytes is not None:
            ps_args += ["--model-bytes", str(spec.model_bytes)]
        ps, port = start_server(procs, f"{transport} ps", "argrpc_bench.ps", ps_args, env)
        workers = [spawn(procs, f"{transport} worker {i}", "argrpc_bench.ps", [
            "worker", "--target", f"127.0.0.1:{port}", "--stack", stack,
            "--transport", transport, "--mode", spec.mode, *_plan_args(spec)], env)
            for i in range(spec.workers)]
        deadline = time.monotonic() + _budget(spec, [step_s])
        for r in range(spec.repeats):
            # Every worker warmed up (or finished the previous phase): start together.
            for w in workers:
                w.expect("READY", deadline)
            for w in workers:
                w.send("GO")
            progress(r, spec.repeats)
        docs = [w.result(deadline) for w in workers]
        progress(spec.repeats, spec.repeats)
        ps.close()
    for w, d in zip(workers, docs):
        check_env(w.name, spec, d["env"], "worker")
        check_env(w.name, spec, d["server_env"], "parameter-server")
    agg = aggregate_phases(docs, spec.repeats)
    size = int(docs[0]["bytes_per_step"])
    return [_base(spec, transport, size, int(docs[0]["variables"]),
                  iterations=min(p["steps"] for d in docs for p in d["phases"]),
                  p50_us=agg["p50_us"], p99_us=agg["p99_us"], mean_us=agg["mean_us"],
                  steps_per_s=agg["steps_per_s"], gbps=agg["steps_per_s"] * size / 1e9,
                  rpcs_per_s=agg["steps_per_s"] * int(docs[0]["rpcs_per_step"]),
                  workers=spec.workers,
                  env=reported_env(spec, transport, docs[0]["env"]))]


# --------------------------------------------------------------------- remote servers

def split_target(target: str) -> tuple[str, int]:
    """"HOST:PORT" or "[v6]:PORT" -> (host, port); ValueError saying what is wrong."""
    host, sep, port_text = target.strip().rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        raise ValueError(f"{target!r} is not HOST:PORT")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{target!r}: an IPv6 host goes in brackets, [::1]:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{target!r}: port {port_text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{target!r}: port {port} is out of range 1..65535")
    return host, port


def probe_remote(transport: str, target: str, timeout: float = REMOTE_PROBE_S) -> None:
    """A TCP connect to the remote server first: "nobody listens there" as such, at once,
    instead of a client that waits for a server until its deadline."""
    host, port = split_target(target)
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
    except OSError as e:
        raise BenchError(f"the remote {transport} server at {target} does not answer: {e} "
                         "(start it there with argrpc-bench serve)") from None


def check_remote(spec: RunSpec) -> None:
    """A spec with remote servers: point to point, threaded API, every transport it
    measures has a well-formed target and no target names a transport it does not."""
    if not spec.remote:
        return
    if spec.benchmark == "ps":
        raise ValueError("remote servers: the ps benchmark starts its parameter server and "
                         "workers itself; remote works for latency and bandwidth")
    if spec.api != "threaded":
        raise ValueError("remote servers: the threaded API only (argrpc-bench serve runs "
                         "the threaded server)")
    unknown = sorted(set(spec.remote) - set(TRANSPORTS))
    if unknown:
        raise ValueError(f"remote server for unknown transport(s) {unknown}")
    missing = [t for t in spec.transports if t not in spec.remote]
    if missing:
        raise ValueError(f"remote servers given, but none for {missing}: every measured "
                         "transport needs one (or measure it locally in another run)")
    unused = sorted(set(spec.remote) - set(spec.transports))
    if unused:
        raise ValueError(f"remote server given for {unused}, which the run does not measure")
    for t, target in spec.remote.items():
        try:
            split_target(target)
        except ValueError as e:
            raise ValueError(f"remote server for {t}: {e}") from None


# ------------------------------------------------------------------------------ run

def normalize(spec: RunSpec) -> RunSpec:
    """Checks the spec and fills the defaults (a copy; the caller's spec is unchanged)."""
    if spec.benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {spec.benchmark!r}")
    if spec.mode not in MODES:
        raise ValueError(f"unknown mode {spec.mode!r}")
    if spec.scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {spec.scheme!r}")
    bad = [t for t in spec.transports if t not in TRANSPORTS]
    if bad or not spec.transports:
        raise ValueError(f"unknown transport(s) {bad or '(none)'}")
    if spec.api not in APIS:
        raise ValueError(f"unknown api {spec.api!r}")
    if spec.api != "threaded" and spec.benchmark == "ps":
        raise ValueError("the ps benchmark has no asyncio variant (api='threaded')")
    if spec.loop != "asyncio" and spec.api != "aio":
        raise ValueError(f"loop={spec.loop!r} is for the asyncio API (api='aio')")
    why = loops.unavailable(spec.loop)
    if why is not None:
        raise ValueError(why)
    if spec.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if spec.clients < 1:
        raise ValueError("clients must be >= 1")
    if spec.clients > 1 and (spec.benchmark == "ps" or spec.api != "threaded" or spec.remote):
        raise ValueError("clients > 1: latency or bandwidth under the threaded API, with a "
                         "local server")
    if spec.iterations is not None and spec.duration is not None:
        raise ValueError("give iterations or duration, not both")
    if spec.buffers < 1 or spec.repeats < 1 or spec.workers < 1 or spec.warmup < 0:
        raise ValueError("buffers, repeats and workers must be >= 1, warmup >= 0")
    if spec.iterations is not None and spec.iterations < 1:
        raise ValueError("iterations must be >= 1")
    if spec.duration is not None and spec.duration <= 0:
        raise ValueError("duration must be > 0")
    check_remote(spec)
    bad_env = [k for k in spec.env if not k.startswith("TF_RDMA_")]
    if bad_env:
        raise ValueError(f"RunSpec.env takes TF_RDMA_* knobs only, got {bad_env}")
    sizes = list(spec.sizes) or list(DEFAULT_SIZES[spec.benchmark])
    if any(s < 0 for s in sizes):
        raise ValueError("sizes must be >= 0")
    duration = spec.duration
    if spec.iterations is None and duration is None:
        duration = DEFAULT_DURATION[spec.benchmark]
    return RunSpec(**{**spec.__dict__, "sizes": sizes, "duration": duration,
                      "env": dict(spec.env), "transports": list(spec.transports),
                      "remote": dict(spec.remote)})


def run(spec: RunSpec, progress: ProgressFn | None = None, log: LogFn | None = None
        ) -> list[Measurement]:
    """Measures ``spec`` on each of its transports, in order, then its reference rows.
    An unavailable transport gives skipped Measurements with the reason in ``note``; one
    whose processes fail (BenchError, or TransportError when an argrpc channel was not on
    the measured transport) gives skipped Measurements with ``failed`` set, the error's
    first line in ``note`` and the whole error to ``log`` (default: stderr), and the run
    goes on. A spec that cannot run at all raises ValueError first."""
    spec = normalize(spec)
    reasons = transport_reasons(child_env(spec))
    live = [t for t in spec.transports if not reasons.get(t)]
    units_per = spec.repeats if spec.benchmark == "ps" else len(spec.sizes)
    total_units = max(1, len(live) * units_per)
    done_units = 0
    out: list[Measurement] = []
    for transport in spec.transports:
        reason = reasons.get(transport, "unknown transport")
        if reason:
            out.extend(skipped(spec, transport, reason))
            continue

        def on_progress(done: int, total: int,
                        t: str = transport if spec.api == "threaded" else
                        f"{spec.api} {transport}") -> None:
            if progress is not None:
                what = (f"{t} {spec.sizes[done - 1]} B" if spec.benchmark != "ps" and done
                        else f"{t} {done}/{total}")
                progress(what, (done_units + done) / total_units)

        on_progress(0, units_per)
        measure = run_ps if spec.benchmark == "ps" else run_p2p
        try:
            out.extend(measure(spec, transport, on_progress))
        except BenchError as e:
            # The measuring function's ExitStack killed this transport's processes as
            # the error left it: the next transport starts with none of them around.
            out.extend(not_measured(spec, [transport], e, log))
        done_units += units_per
    if references_of(spec):
        if progress is not None:
            progress(f"{'/'.join(references_of(spec))}", done_units / total_units)
        out.extend(run_references(spec, reasons.get("shm", "") if "floor" in
                                  references_of(spec) else _argrpc_reason(), log))
    if progress is not None:
        progress("done", 1.0)
    return out
