"""Chaos: a peer dies, hangs or hangs up at a random moment of a loop of calls.

    argrpc-bench chaos [--trials N] [--seed S] [--load [half|all]] [--faults kill,...]
                       [--only I] [--json PATH]
    python -m argrpc_bench.chaos --role server|caller|witness ...   (the peer processes)

Each trial is one scenario: who fails (the server or a client), how (``kill``: SIGKILL;
``stop``: SIGSTOP, a hung peer; ``hangup``: the peer shuts its shared-memory socket but
keeps running and keeps the memory mapped), the arity and the message size (0 B, one
eager message, just over TF_RDMA_ACC_SIZE, several TF_RDMA_CHUNK_SIZE chunks, 256 MiB).
A caller process loops calls of that kind; once it has timed a few, the fault comes at a
moment drawn uniformly over one call period, so over many trials it lands before the
request is sent, during the copy-in, mid-pull, while the response is written and between
calls in proportion to how long each lasts.

What each trial checks, on the survivor:

* server failed: the caller's in-flight call ends UNAVAILABLE (DEADLINE_EXCEEDED only if
  its 60 s deadline came first) within the bound (``--bound``; 2 s on shared memory, the
  keepalive for a stopped peer, the keepalive plus the QP's retry time over verbs),
  counted from the fault, or from the failed call's start when it began after the fault
  (the call under way may still complete whole: the server had written its answer);
  anything but a ``grpc.RpcError`` is a wrong end; then
  its engine holds no connection and no pool block, and it has no more fds (none of the
  kinds a connection uses) and no more threads than before.
* client failed: the server's handlers of that client's calls all return within the
  bound; its connection count, pool blocks in use, fds and threads come back to what
  they were; and another client (the witness) keeps getting byte-exact answers
  (compared in full) throughout.

A trial is fully determined by ``--seed`` and its index: ``--only I`` replays trial I,
and every failure prints the command that does. The trials cycle through every
scenario in a seeded order; with ``--load half`` every other round runs with both cores
kept busy by two spinning processes (``--load all``: every trial).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import hashlib
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import grpc

from argrpc._config import knob
from argrpc_bench import FAST_TRANSPORTS
from argrpc_bench import server as bench_server

K, M = 1 << 10, 1 << 20
SERVICE = "argrpc_bench.Chaos"
ARITIES = ("unary", "server_stream", "client_stream", "bidi")
VICTIMS = ("server", "client")
FAULTS = ("kill", "stop", "hangup")
SIZE_NAMES = ("0B", "eager", "over_acc", "chunks", "256M")
STREAM_MESSAGES = 2      # messages each way per streaming call
CALIBRATION_CALLS = 3    # calls timed before the fault is scheduled
CALL_TIMEOUT_S = 60.0
SHM_BOUND_S = 2.0
# A stopped or silent peer: a PING after 1 s of silence (keepalive_ms), unanswered for
# 10 s (keepalive_timeout_ms), noticed by the 5 ms sweep; plus scheduling on a busy box.
KEEPALIVE_BOUND_S = 1.0 + 10.0 + 1.0
# Over verbs a dead peer may only show through the keepalive; a QP's retries add
# TF_RDMA_QP_RETRY+1 tries of 4.096 us * 2^TF_RDMA_QP_TIMEOUT (7 x 1.07 s at the defaults).
VERBS_BOUND_S = KEEPALIVE_BOUND_S + (knob("TF_RDMA_QP_RETRY").default + 1) * 4.096e-6 * \
    2 ** knob("TF_RDMA_QP_TIMEOUT").default
SETTLE_S = 10.0          # resources are back within this after the calls ended
HANG_S = 45.0            # no end by then: a hang (stacks are dumped)
WITNESS_SIZES = (0, 1000, 8 * K + 1, 4 * M + 1)
BIG_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def sizes() -> dict[str, int]:
    """The sizes at argrpc's boundaries, from the configured knobs."""
    from argrpc._config import load

    cfg = load()
    return {"0B": 0, "eager": 1000, "over_acc": cfg.acc_size + 1,
            "chunks": 3 * cfg.chunk_size + 1, "256M": 256 * M}


def method(arity: str) -> str:
    return f"/{SERVICE}/{''.join(w.title() for w in arity.split('_'))}"


WITNESS_METHOD = f"/{SERVICE}/Witness"


# -------------------------------------------------------------------- resources

def _unix_inodes(connected_only: bool = False) -> set[str]:
    """Inodes of the Unix sockets in this namespace (with connected_only, not the
    listening ones: flag __SO_ACCEPTCON)."""
    with open("/proc/net/unix") as f:
        next(f)
        rows = [line.split() for line in f]
    return {r[6] for r in rows if not (connected_only and int(r[3], 16) & 0x10000)}


def _fd_kind(target: str, unix: set[str]) -> str:
    if target.startswith("/memfd:"):
        return "memfd"
    if target.startswith("anon_inode:"):
        return target[len("anon_inode:"):].strip("[]")
    if target.startswith("socket:"):
        return "unix" if target[8:-1] in unix else "socket"
    return "pipe" if target.startswith("pipe:") else "file"


def snapshot(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """fds (by kind), threads, and the engine's connections and pool blocks in use, once
    garbage that only a collection frees is gone (grpc's own objects form cycles).
    `threads` counts Python threads (argrpc's own: call consumers, watchers; the engine's
    native threads are fixed per process) outside the server's thread pool, which grows
    up to its size as calls need it and keeps its threads (`pool_threads`, reported);
    grpc's core keeps a pool of native threads that grows and shrinks by itself, so OS
    threads are only reported (`os_threads`)."""
    gc.collect()
    kinds: Counter[str] = Counter()
    unix = _unix_inodes()
    for name in os.listdir("/proc/self/fd"):
        try:
            kinds[_fd_kind(os.readlink(f"/proc/self/fd/{name}"), unix)] += 1
        except OSError:
            pass  # listdir's own fd, closed by now
    from argrpc import _engine

    engine = _engine.peek_engine()
    return {"fds": sum(kinds.values()), "fd_kinds": dict(kinds),
            "threads": sum(1 for t in threading.enumerate()
                           if not t.name.startswith(SERVER_POOL_PREFIX)),
            "pool_threads": sum(1 for t in threading.enumerate()
                                if t.name.startswith(SERVER_POOL_PREFIX)),
            "os_threads": len(os.listdir("/proc/self/task")),
            "connections": engine.connection_count if engine else 0,
            "in_use": int(engine.pool_stats()["in_use"]) if engine else 0, **(extra or {})}


# The servers' thread pools (ThreadPoolExecutor's thread_name_prefix).
SERVER_POOL_PREFIX = "chaos-server-pool"

# The fd kind an argrpc shm connection holds: its Unix socket (also its doorbell; the
# rings' memfds are closed once mapped). A dead connection must give it back, and no
# memfd or eventfd may be left either.
CONNECTION_FD_KINDS = ("unix",)
WATCHED_FD_KINDS = ("memfd", "eventfd", "unix")


def leaks(base: dict[str, Any], now: dict[str, Any], keys: Sequence[str] = ()) -> list[str]:
    """What `now` holds beyond `base`: connections, pool bytes, fds (total and per
    connection kind), threads, and any `keys` that must be equal."""
    out = []
    for key in ("connections", "in_use", "fds", "threads", *keys):
        if now[key] > base[key] or (key in keys and now[key] != base[key]):
            out.append(f"{key} {base[key]} -> {now[key]}")
    for kind in WATCHED_FD_KINDS:
        a, b = base["fd_kinds"].get(kind, 0), now["fd_kinds"].get(kind, 0)
        if b > a:
            out.append(f"{kind} fds {a} -> {b}")
    return out


# ------------------------------------------------------------------- the server

class _Activity:
    """Handlers of the looped (not the witness's) calls running now, and when the last
    one returned: the server's side of "every call on the survivor ended"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.last_end = 0.0

    def __call__(self, fn: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
        def enter() -> None:
            with self._lock:
                self.active += 1

        def leave() -> None:
            with self._lock:
                self.active -= 1
                self.last_end = time.monotonic()

        if streaming:
            def gen(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                enter()
                try:
                    yield from fn(request, context)
                finally:
                    leave()
            return gen

        def plain(request: Any, context: grpc.ServicerContext) -> Any:
            enter()
            try:
                return fn(request, context)
            finally:
                leave()
        return plain


def _handlers(activity: _Activity) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        return request

    def server_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        for _ in range(STREAM_MESSAGES):
            yield request

    def client_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return b"".join(hashlib.sha256(r).digest() for r in requests)

    def bidi(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        yield from requests

    return {
        "Unary": grpc.unary_unary_rpc_method_handler(activity(unary, False)),
        "ServerStream": grpc.unary_stream_rpc_method_handler(activity(server_stream, True)),
        "ClientStream": grpc.stream_unary_rpc_method_handler(activity(client_stream, False)),
        "Bidi": grpc.stream_stream_rpc_method_handler(activity(bidi, True)),
        "Witness": grpc.unary_unary_rpc_method_handler(unary),
    }


def _shm_sockets() -> list[int]:
    """This process's Unix sockets that carry an argrpc connection's liveness (every
    Unix socket of a chaos peer is one: gRPC here listens and connects over TCP)."""
    unix = _unix_inodes(connected_only=True)
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in unix:
            fds.append(int(name))
    return fds


def _install_hangup() -> threading.Event:
    """SIGUSR2: shut down every argrpc socket of this process, as a peer that drops its
    connections but lives on (memory still mapped) would. Handled on the main thread,
    which only waits, so it runs at once whatever the calls are doing."""
    done = threading.Event()

    def hang_up(signum: int, frame: Any) -> None:
        import socket

        for fd in _shm_sockets():
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        done.set()

    signal.signal(signal.SIGUSR2, hang_up)
    return done


def reap(proc: subprocess.Popen[Any], log: Any) -> None:
    """Kill `proc` (a stopped one too: SIGCONT first), wait for it, close its pipes and
    its log file."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream:
                stream.close()
        except OSError:
            pass
    log.close()


def serve() -> int:
    """The server role: PORT n, then ``res`` on stdin answers RES <json>; EOF stops."""
    from concurrent import futures

    import argrpc

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _install_hangup()
    activity = _Activity()
    server = argrpc.server(futures.ThreadPoolExecutor(max_workers=8,
                                                      thread_name_prefix=SERVER_POOL_PREFIX),
                           options=BIG_OPTIONS)

    def resources() -> str:
        with activity._lock:
            act = {"active": activity.active, "last_end": activity.last_end}
        return "RES " + json.dumps(snapshot(act))

    return bench_server.serve(
        server, (grpc.method_handlers_generic_handler(SERVICE, _handlers(activity)),),
        {"res": resources}, grace=0.5)


# ------------------------------------------------------------------- the callers

def _payload(size: int, seed: int) -> bytes:
    """`size` bytes no two trials share: a random 1 MiB block, repeated."""
    block = random.Random(seed).randbytes(min(size, M))
    return (block * (size // M + 1))[:size] if size > M else block


def _same(got: Any, want: bytes) -> bool:
    import numpy as np

    a = np.frombuffer(got, dtype=np.uint8)
    return a.size == len(want) and bool(np.array_equal(a, np.frombuffer(want, dtype=np.uint8)))


class Corrupt(Exception):
    """An answer with other bytes (or another count) than the call sent."""


class _Loop:
    """One kind of call, repeated: each checks every byte (client stream: the digests)."""

    def __init__(self, channel: grpc.Channel, arity: str, body: bytes) -> None:
        factory: dict[str, Callable[[str], Any]] = {
            "unary": channel.unary_unary, "server_stream": channel.unary_stream,
            "client_stream": channel.stream_unary, "bidi": channel.stream_stream}
        self._call = factory[arity](method(arity))
        self.arity, self.body = arity, body
        self._digests = hashlib.sha256(body).digest() * STREAM_MESSAGES

    def once(self) -> None:
        body, t = self.body, CALL_TIMEOUT_S
        if self.arity == "unary":
            got = [self._call(body, timeout=t)]
        elif self.arity == "server_stream":
            got = list(self._call(body, timeout=t))
        elif self.arity == "client_stream":
            answer = self._call(iter([body] * STREAM_MESSAGES), timeout=t)
            if bytes(answer) != self._digests:
                raise Corrupt("client stream: the server saw other bytes")
            return
        else:
            got = list(self._call(iter([body] * STREAM_MESSAGES), timeout=t))
        want = 1 if self.arity == "unary" else STREAM_MESSAGES
        if len(got) != want or not all(_same(g, body) for g in got):
            raise Corrupt(f"{self.arity}: {len(got)} answers, not {want} exact ones")


def _channel(target: str) -> grpc.Channel:
    import argrpc
    from argrpc import _config, _engine

    _engine.get_engine(_config.load())  # the engine's own fds exist before the baseline
    return argrpc.insecure_channel(target, options=BIG_OPTIONS)


def caller(target: str, arity: str, size: int, seed: int, survivor: bool) -> int:
    """The caller role. READY <transport>; after CALIBRATION_CALLS calls CALLS <period>;
    a survivor then prints END <json> for the first failed call and SETTLED <json> once
    its resources are back (or SETTLE_S passed). A victim loops until it is killed, or
    after a hang-up stops calling and waits."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    hung_up = _install_hangup()
    channel = _channel(target)
    pre = snapshot()
    unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method("unary"))
    warm = unary(b"w", timeout=CALL_TIMEOUT_S, wait_for_ready=True)
    if bytes(warm) != b"w":
        raise Corrupt("the warm-up call came back changed")
    print(f"READY {getattr(channel, 'transport', 'grpc')}", flush=True)
    loop = _Loop(channel, arity, _payload(size, seed))
    loop.once()
    base = snapshot()
    # A peer that hangs up between calls and lives on is simply reconnected to: the
    # survivor's sign that it noticed is then that its first connection is gone.
    first_conn = getattr(channel, "_fast", None)
    result: dict[str, Any] = {}

    def run() -> None:
        first = time.monotonic()
        n, prev_end = 0, first
        while not hung_up.is_set():
            start = time.monotonic()
            dead_before = first_conn is not None and not first_conn.alive
            try:
                loop.once()
            except grpc.RpcError as e:
                result.update(code=e.code().name, details=e.details() or "", start=start,
                              end=time.monotonic(), prev_end=prev_end)
                return
            except Corrupt as e:
                result.update(code="CORRUPT", details=str(e), start=start,
                              end=time.monotonic(), prev_end=prev_end)
                return
            except Exception as e:  # noqa: BLE001 - what grpc's users would not catch
                result.update(code=f"EXCEPTION {type(e).__name__}", details=str(e),
                              start=start, end=time.monotonic(), prev_end=prev_end)
                return
            n, prev_end = n + 1, time.monotonic()
            if dead_before and first_conn is not None:  # yet this call went through
                # ...on a new connection: nothing waited on the old one past `start`.
                result.update(code="RECONNECTED", details=first_conn.error, start=start,
                              end=start, prev_end=prev_end)
                return
            if n == CALIBRATION_CALLS:
                print(f"CALLS {(prev_end - first) / n:.6f}", flush=True)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    # The main thread only waits, so signal handlers (the hang-up) run at once.
    while worker.is_alive():
        worker.join(0.05)
    if not survivor:
        while True:  # a victim that hung up stays alive, its memory still mapped
            time.sleep(3600)
    print("END " + json.dumps(result), flush=True)
    # pre: before the channel existed, so no connection fd may remain; base: after the
    # warm-up, the most fds and threads grpc's own channel may keep. Reconnected: the
    # new connection may hold what the first one did, no more.
    limit = base if result.get("code") == "RECONNECTED" else {
        **base, "connections": 0, "in_use": 0, "fd_kinds": pre["fd_kinds"]}
    end = time.monotonic() + SETTLE_S
    while True:
        now = snapshot()
        problems = leaks(limit, now)
        if not problems or time.monotonic() > end:
            break
        time.sleep(0.02)
    print("SETTLED " + json.dumps({"took": time.monotonic() - result["end"],
                                   "problems": problems, "now": now, "base": base}),
          flush=True)
    channel.close()
    return 0


class _Witness:
    def __init__(self, target: str) -> None:
        self.channel = _channel(target)
        self.call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(
            WITNESS_METHOD)
        self.bodies = [_payload(s, 7 + s) for s in WITNESS_SIZES]
        self.ok = 0
        self.errors: list[str] = []
        self.running = threading.Event()
        self.idle = threading.Event()

    def run(self) -> None:
        i = 0
        while True:
            if not self.running.is_set():
                self.idle.set()
                self.running.wait()
                self.idle.clear()
            body = self.bodies[i % len(self.bodies)]
            i += 1
            try:
                got = self.call(body, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
                same = _same(got, body)
                # A large answer is a view of the server's pool block on shm: let it go
                # before pausing, or the server's baseline would count it.
                del got
                if same:
                    self.ok += 1
                else:
                    self.errors.append(f"{len(body)} B: wrong bytes back")
            except grpc.RpcError as e:
                self.errors.append(f"{len(body)} B: {e.code().name}: {e.details()}")


def witness(target: str) -> int:
    """The witness role: another client of the server, calling all along. Commands:
    ``pause`` (PAUSED once its call in flight is done), ``run``, ``stat`` (WSTAT <json>)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    w = _Witness(target)
    threading.Thread(target=w.run, daemon=True).start()
    print(f"READY {getattr(w.channel, 'transport', 'grpc')}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "pause":
            w.running.clear()
            w.idle.wait()
            print("PAUSED", flush=True)
        elif cmd == "run":
            w.running.set()
        elif cmd == "stat":
            print("WSTAT " + json.dumps({"ok": w.ok, "errors": w.errors[:5],
                                         "error_count": len(w.errors)}), flush=True)
    return 0


# -------------------------------------------------------------- the orchestrator

class Peer:
    """A chaos peer process; stdout lines are queued, stderr goes to a file."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log: str) -> None:
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "argrpc_bench.chaos", *args], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str | None:
        """The payload of the next line starting with `prefix`; None at EOF or timeout."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.lines.put(None)
                return None
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        return None

    def ask(self, command: str, prefix: str, timeout: float = 30.0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        text = self.expect(prefix, timeout)
        return json.loads(text) if text else None

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stacks(self) -> str:
        """Python stacks of every thread (faulthandler on SIGUSR1), and native ones when
        py-spy is installed."""
        self.signal(signal.SIGUSR1)
        time.sleep(0.5)
        out = self.log_tail(80)
        try:
            spy = subprocess.run(["py-spy", "dump", "--native", "--pid", str(self.proc.pid)],
                                 capture_output=True, text=True, timeout=30)
            out += "\n--- py-spy --native ---\n" + spy.stdout[-6000:]
        except (OSError, subprocess.TimeoutExpired):
            pass
        return out

    def log_tail(self, n: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                return "\n".join(f.read().splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        reap(self.proc, self._log)


@dataclass
class Scenario:
    victim: str   # "server" | "client"
    fault: str    # "kill" | "stop" | "hangup"
    arity: str
    size: str     # a SIZE_NAMES entry

    @property
    def name(self) -> str:
        return f"{self.victim}/{self.fault}/{self.arity}/{self.size}"


@dataclass
class Trial:
    index: int
    scenario: Scenario
    loaded: bool
    fault_after_s: float = 0.0   # into a call period (drawn uniformly over it)
    period_s: float = 0.0
    outcome: str = ""            # "ok" or what went wrong
    code: str = ""
    details: str = ""
    # How long the survivor waited on the dead peer: server victims, from the fault (or
    # from the failed call's start, when it began after the fault) to that call's end;
    # client victims, from the fault to the last of its handlers' returns.
    end_s: float | None = None
    start_s: float | None = None      # server victims: fault -> the failed call's start
    completed_s: float | None = None  # fault -> the call under way completed whole, if it did
    settle_s: float | None = None
    phase: str = ""              # server victims: "in call 0.42" or "between calls"
    problems: list[str] = field(default_factory=list)
    stacks: str = ""


@dataclass
class ChaosConfig:
    trials: int = 40
    seed: int = 0
    load: str = "none"           # none | half | all
    faults: tuple[str, ...] = ("kill",)
    victims: tuple[str, ...] = VICTIMS
    arities: tuple[str, ...] = ARITIES
    sizes: tuple[str, ...] = SIZE_NAMES
    only: int | None = None
    transport: str = "auto"      # TF_RDMA_TRANSPORT for the peers
    bound: float | None = None   # default: by transport and fault
    workdir: str = "/tmp"


def scenarios(cfg: ChaosConfig) -> list[Scenario]:
    """Every combination, in the seed's order, the victims taking turns (so that any
    two consecutive trials fail both a server and a client)."""
    rng = random.Random(f"chaos-order:{cfg.seed}")
    per_victim = []
    for v in cfg.victims:
        group = [Scenario(v, f, a, s) for f in cfg.faults for a in cfg.arities
                 for s in cfg.sizes]
        rng.shuffle(group)
        per_victim.append(group)
    return [g[i] for i in range(len(per_victim[0])) for g in per_victim]


def plan(cfg: ChaosConfig) -> list[Trial]:
    order = scenarios(cfg)
    trials = []
    for i in range(cfg.trials):
        rnd, k = divmod(i, len(order))
        # Pairs of trials (a server and a client victim) alternate, and so do rounds.
        loaded = cfg.load == "all" or (cfg.load == "half" and (rnd + k // 2) % 2 == 1)
        trials.append(Trial(i, order[k], loaded))
    if cfg.only is not None:
        trials = [t for t in trials if t.index == cfg.only]
    return trials


def bound_for(cfg: ChaosConfig, fault: str) -> float:
    if cfg.bound is not None:
        return cfg.bound
    if fault == "stop":
        return KEEPALIVE_BOUND_S
    return VERBS_BOUND_S if cfg.transport == "verbs" else SHM_BOUND_S


class Load:
    """Two processes spinning on the CPU, on while loaded trials run."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def set(self, on: bool) -> None:
        if on and not self._procs:
            self._procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           for _ in range(2)]
        elif not on:
            self.stop()

    def stop(self) -> None:
        for p in self._procs:
            p.kill()
            p.wait()
        self._procs = []


class Orchestrator:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.env = dict(os.environ)
        if cfg.transport != "auto":
            self.env["TF_RDMA_TRANSPORT"] = cfg.transport
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.sizes = sizes()
        self.load = Load()
        self._n = 0
        # client victims share one long-lived server and its witness
        self.server: Peer | None = None
        self.witness: Peer | None = None
        self.target = ""

    def _peer(self, role: str, *args: str) -> Peer:
        self._n += 1
        log = os.path.join(self.cfg.workdir, f"chaos-{os.getpid()}-{self._n}-{role}.log")
        return Peer(["--role", role, *args], self.env, log)

    def _start_server(self) -> tuple[Peer, str]:
        server = self._peer("server")
        port = server.expect("PORT", 60)
        if port is None:
            why = server.log_tail()  # before kill(), which closes the log
            server.kill()
            raise RuntimeError(f"chaos server did not start:\n{why}")
        return server, f"127.0.0.1:{port}"

    def _caller(self, target: str, t: Trial, survivor: bool) -> tuple[Peer, float]:
        """A caller looping the trial's calls, on the fast path; and its call period."""
        s = t.scenario
        caller = self._peer("caller", "--target", target, "--arity", s.arity,
                            "--size", str(self.sizes[s.size]),
                            "--seed", str(self.cfg.seed * 100003 + t.index),
                            *(["--survivor"] if survivor else []))
        try:
            self._ready(caller, "the caller")
            period = caller.expect("CALLS", 300)
            if period is None:
                raise RuntimeError(f"the caller never completed its calibration calls:\n"
                                   f"{caller.log_tail()}")
        except BaseException:
            caller.kill()
            raise
        return caller, float(period)

    def _ready(self, peer: Peer, what: str) -> None:
        transport = peer.expect("READY", 120)
        want = FAST_TRANSPORTS if self.cfg.transport == "auto" else (self.cfg.transport,)
        if transport not in want:
            raise RuntimeError(f"{what} is not on {'/'.join(want)} but {transport!r}:\n"
                               f"{peer.log_tail()}")

    def _fault(self, peer: Peer, t: Trial, period: float) -> float:
        """Waits a uniform moment of one call period, applies the fault; its time."""
        t.period_s = period
        t.fault_after_s = random.Random(f"chaos-moment:{self.cfg.seed}:{t.index}").uniform(
            0.0, period)
        time.sleep(t.fault_after_s)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hangup": signal.SIGUSR2}
        at = time.monotonic()
        peer.signal(sig[t.scenario.fault])
        return at

    # -- the server fails; the caller survives ------------------------------------
    def _server_victim(self, t: Trial, bound: float) -> None:
        server, target = self._start_server()
        try:
            caller, period = self._caller(target, t, survivor=True)
        except BaseException:
            server.kill()
            raise
        try:
            at = self._fault(server, t, period)
            end = caller.expect("END", HANG_S)
            if end is None:
                t.outcome, t.stacks = "hang", caller.stacks()
                return
            e = json.loads(end)
            t.code, t.details = e.get("code", ""), e.get("details", "")
            # A call under way at the kill may still complete whole (the server had
            # written its answer, which the caller's mapping keeps) and the caller then
            # checks every byte: seconds at 256 MiB on a busy host that nobody spends
            # waiting on the dead server. The call that fails is bounded from when it
            # met the dead server: the kill, or its own start if it began after.
            t.end_s = e["end"] - max(at, e["start"])
            t.start_s = e["start"] - at
            if e["prev_end"] > at:
                t.completed_s = e["prev_end"] - at
            if e["start"] < at:  # the failed call was under way
                t.phase = f"in call {min(1.0, (at - e['start']) / max(period, 1e-9)):.2f}"
            elif e["prev_end"] > at:  # the call under way still completed, whole
                t.phase = "in call, completed"
            else:
                t.phase = "between calls"
            settled = caller.expect("SETTLED", SETTLE_S + 30)
            if settled is None:
                t.outcome, t.stacks = "hang (settling)", caller.stacks()
                return
            s = json.loads(settled)
            t.settle_s, t.problems = s["took"], s["problems"]
            t.outcome = self._judge(t, bound)
        finally:
            caller.kill()
            server.kill()

    # -- a client fails; the server (and the witness) survive ----------------------
    def _shared_server(self) -> tuple[Peer, Peer, str]:
        if self.server is None or not self.server.alive() or self.witness is None \
                or not self.witness.alive():
            self._drop_shared()
            self.server, target = self._start_server()
            self.witness = self._peer("witness", "--target", target)
            self._ready(self.witness, "the witness")
            self.witness.tell("run")
            self.target = target
        assert self.witness is not None
        return self.server, self.witness, self.target

    def _drop_shared(self) -> None:
        for p in (self.witness, self.server):
            if p is not None:
                p.kill()
        self.server = self.witness = None

    def _quiet_res(self, server: Peer, witness: Peer) -> dict[str, Any]:
        """The server's resources with the witness paused (its own call finished)."""
        witness.ask("pause", "PAUSED")
        try:
            res: dict[str, Any] = server.ask("res", "RES")
            return res
        finally:
            witness.tell("run")

    def _client_victim(self, t: Trial, bound: float) -> None:
        server, witness, target = self._shared_server()
        base = self._quiet_res(server, witness)
        before = witness.ask("stat", "WSTAT")
        caller, period = self._caller(target, t, survivor=False)
        try:
            at = self._fault(caller, t, period)
            # Every handler of the victim's calls returns, and a dead victim's connection
            # goes...
            # A stopped one's connection may stay while idle, as grpc's would, but not
            # hold a pool block past the keepalive: it is killed after.
            fault = t.scenario.fault
            give_up = at + HANG_S
            while True:
                res = (self._quiet_res(server, witness) if fault == "stop"
                       else server.ask("res", "RES"))
                if res is None:
                    t.outcome = "server died"
                    t.details = server.log_tail()
                    return
                if res["active"] == 0 and (
                        (fault == "kill" and res["connections"] <= base["connections"])
                        or (fault == "stop" and res["in_use"] <= base["in_use"])
                        or fault == "hangup"):
                    break
                if time.monotonic() > give_up:
                    t.outcome, t.stacks = "hang", server.stacks()
                    t.problems = [f"{res['active']} handlers still running, "
                                  f"{res['connections']} connections"]
                    return
                time.sleep(0.02)
            t.end_s = (time.monotonic() if fault == "stop" else max(res["last_end"], at)) - at
            # A stopped or hung-up victim is still a process with a channel (its idle
            # connection, its grpc socket): not the server's to free until it exits.
            caller.kill()
            # ...and the server's resources come back.
            settle_end = time.monotonic() + SETTLE_S
            while True:
                now = self._quiet_res(server, witness)
                t.problems = leaks(base, now)
                if not t.problems or time.monotonic() > settle_end:
                    break
                time.sleep(0.05)
            t.settle_s = time.monotonic() - at
            after = witness.ask("stat", "WSTAT")
            if after["error_count"] > before["error_count"]:
                t.problems.append(f"the witness saw errors: {after['errors']}")
            if after["ok"] <= before["ok"]:
                t.problems.append("the witness made no call during the trial")
            t.code = "CANCELLED (server side)"
            t.outcome = self._judge(t, bound)
        finally:
            caller.kill()

    @staticmethod
    def _judge(t: Trial, bound: float) -> str:
        ends = ("UNAVAILABLE", "DEADLINE_EXCEEDED") + (
            ("RECONNECTED",) if t.scenario.fault == "hangup" else ())
        if t.scenario.victim == "server" and t.code not in ends:
            return f"wrong end: {t.code}"
        if t.end_s is not None and t.end_s > bound:
            return f"late ({t.end_s:.2f} s > {bound:g} s)"
        return "leak" if t.problems else "ok"

    def run_trial(self, t: Trial) -> Trial:
        self.load.set(t.loaded)
        bound = bound_for(self.cfg, t.scenario.fault)
        try:
            if t.scenario.victim == "server":
                self._server_victim(t, bound)
            else:
                self._client_victim(t, bound)
        except (RuntimeError, OSError, ValueError, KeyError, TypeError) as e:
            t.outcome, t.details = "setup failed", str(e)
        return t

    def close(self) -> None:
        self._drop_shared()
        self.load.stop()


def run(cfg: ChaosConfig, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    trials = plan(cfg)
    orch = Orchestrator(cfg)
    done: list[Trial] = []
    t0 = time.monotonic()
    try:
        for t in trials:
            orch.run_trial(t)
            done.append(t)
            mark = "" if t.outcome == "ok" else f"  <-- {t.outcome}: {t.details or t.problems}"
            say(f"[{len(done)}/{len(trials)}] #{t.index} {t.scenario.name}"
                f"{' (load)' if t.loaded else ''}: {t.code or '-'} "
                f"{'' if t.end_s is None else f'{t.end_s:.3f} s'} {t.phase}{mark}")
            if t.outcome != "ok":
                say(f"    replay: {replay_command(cfg, t.index)}")
    finally:
        orch.close()
    return {"config": {**asdict(cfg), "faults": list(cfg.faults)},
            "bound_s": {f: bound_for(cfg, f) for f in cfg.faults},
            "seconds": time.monotonic() - t0, "sizes": orch.sizes,
            "trials": [{**asdict(t), "scenario": t.scenario.name} for t in done],
            "ok": all(t.outcome == "ok" for t in done) and len(done) == len(trials)}


def replay_command(cfg: ChaosConfig, index: int) -> str:
    parts = ["argrpc-bench chaos", f"--seed {cfg.seed}", f"--trials {cfg.trials}",
             f"--only {index}", f"--faults {','.join(cfg.faults)}"]
    if cfg.load != "none":
        parts.append(f"--load {cfg.load}")
    if cfg.transport != "auto":
        parts.append(f"--transport {cfg.transport}")
    for name, default in (("victims", VICTIMS), ("arities", ARITIES), ("sizes", SIZE_NAMES)):
        value = getattr(cfg, name)
        if tuple(value) != default:
            parts.append(f"--{name} {','.join(value)}")
    return " ".join(parts)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def report(doc: dict[str, Any]) -> str:
    """A table per scenario: trials (quiet/loaded), outcomes, how long the survivor waited
    on the dead peer (p50/p99/max), leaks; then the failures with their replay commands."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for t in doc["trials"]:
        rows.setdefault(t["scenario"], []).append(t)
    lines = ["| scenario | trials (quiet+load) | outcomes | waited p50 / p99 / max | "
             "settled max | leaks |", "|---|---|---|---|---|---|"]
    for name in sorted(rows):
        ts = rows[name]
        ends = [t["end_s"] for t in ts if t["end_s"] is not None]
        settles = [t["settle_s"] for t in ts if t["settle_s"] is not None]
        codes = Counter(t["code"] or t["outcome"] for t in ts)
        loaded = sum(t["loaded"] for t in ts)
        timing = (f"{statistics.median(ends):.3f} / {_pct(ends, 0.99):.3f} / {max(ends):.3f} s"
                  if ends else "-")
        lines.append(
            f"| {name} | {len(ts)} ({len(ts) - loaded}+{loaded}) | "
            f"{', '.join(f'{c} {n}' for c, n in sorted(codes.items()))} | {timing} | "
            f"{max(settles):.2f} s | {sum(t['outcome'] == 'leak' for t in ts)} |"
            if settles else
            f"| {name} | {len(ts)} ({len(ts) - loaded}+{loaded}) | "
            f"{', '.join(f'{c} {n}' for c, n in sorted(codes.items()))} | {timing} | - | "
            f"{sum(t['outcome'] == 'leak' for t in ts)} |")
    trials = doc["trials"]
    ends = [t["end_s"] for t in trials if t["end_s"] is not None]
    bad = [t for t in trials if t["outcome"] != "ok"]
    out = "\n".join(lines) + "\n\n"
    out += (f"{len(trials)} trials ({sum(t['loaded'] for t in trials)} under load) in "
            f"{doc['seconds']:.0f} s; waited on the dead peer, over all: ")
    out += (f"p50 {statistics.median(ends):.3f} s, p99 {_pct(ends, 0.99):.3f} s, "
            f"max {max(ends):.3f} s" if ends else "-")
    out += f"; bound {', '.join(f'{f} {b:g} s' for f, b in doc['bound_s'].items())}\n"
    phases = Counter(t["phase"] if not t["phase"].startswith("in call ") else "in call, failed"
                     for t in trials if t["phase"])
    out += "fault landed (server victims): " + ", ".join(
        f"{p} {n}" for p, n in sorted(phases.items())) + "\n"
    # The two promises apart: a call under way when its server died ends within the bound;
    # one started after fails as a grpc call to a dead server does.
    for label, pick in (("under way at the fault, failed", lambda ph: ph.startswith("in call ")),
                        ("started after the fault", lambda ph: ph in ("in call, completed",
                                                                      "between calls"))):
        waits = [t["end_s"] for t in trials if t["end_s"] is not None and pick(t["phase"])]
        if waits:
            out += (f"calls {label}: {len(waits)}, waited p50 {statistics.median(waits):.3f} s, "
                    f"p99 {_pct(waits, 0.99):.3f} s, max {max(waits):.3f} s\n")
    hangs = sum(t["outcome"].startswith("hang") for t in trials)
    leaks_n = sum(t["outcome"] == "leak" for t in trials)
    out += f"hangs: {hangs}, leaks: {leaks_n}, other failures: {len(bad) - hangs - leaks_n}\n"
    c = doc["config"]
    cfg = ChaosConfig(**{**c, **{k: tuple(c[k]) for k in ("faults", "victims", "arities",
                                                          "sizes")}})
    for t in bad:
        out += (f"FAILED #{t['index']} {t['scenario']}{' (load)' if t['loaded'] else ''}: "
                f"{t['outcome']} {t['code']} {t['details'][:300]} {t['problems']}\n")
        out += f"    replay: {replay_command(cfg, t['index'])}\n"
        if t["stacks"]:
            out += "    stacks:\n" + "\n".join("      " + s for s in t["stacks"].splitlines()[-40:]) + "\n"
    out += ("PASS" if doc["ok"] else "FAIL") + "\n"
    return out


# ------------------------------------------------------------------------- main

def _role_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.chaos")
    p.add_argument("--role", choices=("server", "caller", "witness"), required=True)
    p.add_argument("--target")
    p.add_argument("--arity", choices=ARITIES)
    p.add_argument("--size", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--survivor", action="store_true")
    a = p.parse_args(list(argv))
    if a.role == "server":
        return serve()
    if a.role == "witness":
        return witness(a.target)
    return caller(a.target, a.arity, a.size, a.seed, a.survivor)


if __name__ == "__main__":
    sys.exit(_role_main(sys.argv[1:]))
