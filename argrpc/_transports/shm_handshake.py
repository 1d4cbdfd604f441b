"""The shared-memory handshake on an abstract Unix socket.

After the bootstrap RPC said "shm", the client connects to the server's abstract socket
and both sides swap their ring and pool memfds (SCM_RIGHTS). Abstract sockets have no
file permissions, so anyone in the network namespace can connect: what keeps other
processes out is (1) the one-time secret, only ever sent over the bootstrap RPC and
bound to the pid the client claimed, and (2) SO_PEERCRED, which the kernel fills in and
a peer cannot forge: the server checks uid and pid, the client checks the server's.

Frames on the socket: 2-byte tag + 4-byte big-endian length + payload; fds ride on the
frame's first bytes.
  client -> server  HI  secret(32) + JSON {"v", "ring_size", "pool_size"}  fds [ring, pool]
  server -> client  OK  JSON {...same keys...}                           fds [ring, pool]
                 or NO  reason (UTF-8), then close
  server -> client  AT  ""  once the server's engine attached the connection (or NO reason)
The client attaches only after AT, so a server-side attach failure is a clean fallback
to gRPC instead of a connection that dies on its first call.
After AT the socket belongs to both engines: a byte on it is a doorbell, its hang-up tells
each side the other died. No doorbell byte can precede AT: an engine rings only after
writing into the peer's ring, and the server's writes nothing before the client's first call.
"""

from __future__ import annotations

import array
import json
import logging
import os
import secrets as _secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

from argrpc._config import LIMITS
from argrpc._fd_limit import exhausted_text, near_limit_reason
from argrpc._transports.base import Caller, Connections, ServerEnv

__all__ = [
    "HandshakeError",
    "IO_TIMEOUT",
    "SECRET_LEN",
    "SECRET_TTL",
    "SecretStore",
    "ShmAcceptor",
    "client_handshake",
    "close_fds",
    "peer_credentials",
    "recv_frame",
    "send_frame",
]

log = logging.getLogger("argrpc")

SECRET_LEN = 32
SECRET_TTL = LIMITS.handshake_secret_ttl_s
IO_TIMEOUT = LIMITS.handshake_io_timeout_s
HANDSHAKE_VERSION = 3  # 3: a batch may restart the ring (csrc/engine/frame.h)
_HEADER = struct.Struct("!2sI")
_MAX_PAYLOAD = 64 * 1024
_N_FDS = 2
# Bounds so a hostile client spamming Negotiate or connect() cannot exhaust memory/threads.
_MAX_OUTSTANDING_SECRETS = 4096
_MAX_HANDSHAKE_THREADS = 16
_SLOT_POLL_S = 0.2  # how soon the accept loop, waiting for a free slot, sees close()
_ACCEPT_WARNING_INTERVAL_S = 10.0  # a failing accept() is logged at most this often
_UCRED = struct.Struct("3i")


class HandshakeError(Exception):
    """The handshake failed; str(e) is a reason fit for `channel.fallback_reason`."""


# --------------------------------------------------------------------------- secrets

class Grant(NamedTuple):
    """What a secret was issued for: the pid the client claimed, and the client as grpc
    saw its negotiating call (presented with every fast-path call)."""
    pid: int
    caller: Caller = Caller()


class SecretStore:
    """One-time secrets, each bound to the pid the client claimed and valid for `ttl` s."""

    def __init__(self, ttl: float = SECRET_TTL, clock: Callable[[], float] = time.monotonic,
                 capacity: int = _MAX_OUTSTANDING_SECRETS) -> None:
        self._ttl = ttl
        self._clock = clock
        self._capacity = capacity
        self._lock = threading.Lock()
        self._items: dict[bytes, tuple[Grant, float]] = {}  # secret -> (grant, expiry); insertion order

    def issue(self, pid: int, caller: Caller = Caller()) -> bytes:
        secret = os.urandom(SECRET_LEN)
        now = self._clock()
        with self._lock:
            self._purge(now)
            while len(self._items) >= self._capacity:  # drop the oldest
                del self._items[next(iter(self._items))]
            self._items[secret] = (Grant(pid, caller), now + self._ttl)
        return secret

    def consume(self, secret: bytes) -> Grant:
        """Return what the secret was issued for; it can never be used again.

        Raises HandshakeError if unknown, already used or expired."""
        now = self._clock()
        with self._lock:
            item = self._items.pop(bytes(secret), None)
            self._purge(now)
        if item is None:
            raise HandshakeError("unknown or already used handshake secret")
        grant, expiry = item
        if now > expiry:
            raise HandshakeError(f"handshake secret expired (valid for {self._ttl:g} s)")
        return grant

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _purge(self, now: float) -> None:
        for key in [k for k, (_, exp) in self._items.items() if exp < now]:
            del self._items[key]


# --------------------------------------------------------------------------- sockets

def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer as the kernel recorded it at connect()/socketpair()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeError("handshake timed out")
    return left


def send_frame(sock: socket.socket, tag: bytes, payload: bytes, fds: Iterable[int] = (),
               deadline: float | None = None) -> None:
    """Send one frame; `fds` are duplicated into the peer (ours stay open)."""
    if deadline is None:
        deadline = time.monotonic() + IO_TIMEOUT
    data = _HEADER.pack(tag, len(payload)) + payload
    fd_list = list(fds)
    try:
        sock.settimeout(_remaining(deadline))
        if fd_list:
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", fd_list).tobytes())])
        else:
            sent = sock.send(data)
        while sent < len(data):  # the fds went with the first byte
            sock.settimeout(_remaining(deadline))
            sent += sock.send(data[sent:])
    except socket.timeout:
        raise HandshakeError("handshake timed out sending") from None
    except OSError as e:
        raise HandshakeError(f"handshake send failed: {e}") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float, max_fds: int,
                fds: list[int]) -> bytes:
    buf = bytearray()
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while len(buf) < n:
        sock.settimeout(_remaining(deadline))
        try:
            data, anc, msg_flags, _ = sock.recvmsg(
                n - len(buf), socket.CMSG_SPACE(max(max_fds, 1) * 4), flags)
        except socket.timeout:
            raise HandshakeError("handshake timed out waiting for the peer") from None
        except OSError as e:
            raise HandshakeError(f"handshake receive failed: {e}") from None
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                fds.extend(got)  # recorded before any check so every path can close them
        if len(fds) > max_fds:
            raise HandshakeError("peer sent more file descriptors than expected")
        if msg_flags & socket.MSG_CTRUNC:  # the kernel could not hand them all over
            near_limit = near_limit_reason()
            raise HandshakeError(f"could not receive the peer's file descriptors: {near_limit}"
                                 if near_limit else "peer sent more file descriptors than "
                                 "expected")
        if not data:
            raise HandshakeError("peer closed the connection during the handshake")
        buf += data
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float, max_fds: int,
               fds: list[int]) -> tuple[bytes, bytes]:
    """Receive one frame -> (tag, payload); received fds are appended to `fds` (the caller
    owns them even when this raises)."""
    tag, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline, max_fds, fds))
    if length > _MAX_PAYLOAD:
        raise HandshakeError(f"handshake frame too large ({length} bytes)")
    payload = _recv_exact(sock, length, deadline, max_fds, fds) if length else b""
    return tag, payload


def _hello_json(ring_size: int, pool_size: int) -> bytes:
    return json.dumps({"v": HANDSHAKE_VERSION, "ring_size": ring_size,
                       "pool_size": pool_size}).encode()


def _parse_peer(meta: bytes, fds: list[int]) -> dict[str, int]:
    """Validate the peer's JSON and fds into the dict `Engine.attach_shm` expects."""
    if len(fds) != _N_FDS:
        raise HandshakeError(f"peer sent {len(fds)} file descriptors, expected {_N_FDS}")
    try:
        info = json.loads(meta.decode())
    except (UnicodeDecodeError, ValueError):
        raise HandshakeError("peer sent malformed handshake data") from None
    if not isinstance(info, dict):
        raise HandshakeError("peer sent malformed handshake data")
    if info.get("v") != HANDSHAKE_VERSION:
        raise HandshakeError(f"peer speaks shm handshake version {info.get('v')!r}, this "
                             f"process {HANDSHAKE_VERSION} (a different argrpc release)")
    sizes = {}
    for key in ("ring_size", "pool_size"):
        value = info.get(key)
        if type(value) is not int or value <= 0:
            raise HandshakeError(f"peer sent an invalid {key}: {value!r}")
        sizes[key] = value
    return {"ring_fd": fds[0], "pool_fd": fds[1], **sizes}


def _local_fds(engine: Any, endpoint: Any) -> list[int]:
    return [endpoint.ring_fd, engine.pool_fd]


def _send_nowait(sock: socket.socket, tag: bytes, payload: bytes) -> bool:
    """Best-effort small frame without changing the socket's blocking mode (a few bytes
    into an idle Unix socket's buffer never block)."""
    payload = payload[:_MAX_PAYLOAD]
    data = _HEADER.pack(tag, len(payload)) + payload
    try:
        return sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) == len(data)
    except OSError:
        return False


# --------------------------------------------------------------------------- client

def client_handshake(socket_name: str, server_pid: int, secret: bytes, engine: Any,
                     conn_cfg: dict[str, int], timeout: float = IO_TIMEOUT,
                     endpoint: Any = None) -> Any:
    """Connect to the server's abstract socket, swap fds, return the attached Connection.
    `endpoint`: one `engine` made from `conn_cfg` beforehand (else it is made here).

    Raises HandshakeError (with a readable reason) on any failure; fds it received are
    closed on every failure path.
    """
    deadline = time.monotonic() + timeout
    if endpoint is None:
        endpoint = engine.new_shm_endpoint(conn_cfg)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    try:
        sock.settimeout(_remaining(deadline))
        try:
            sock.connect("\0" + socket_name)
        except OSError as e:
            raise HandshakeError(f"cannot connect to the server's shm socket: {e}") from None
        pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            raise HandshakeError(f"shm socket is owned by uid {uid}, not ours ({os.getuid()})")
        if pid != server_pid:
            raise HandshakeError(
                f"shm socket peer is pid {pid}, but the server said pid {server_pid} "
                "(different PID namespace?)")
        send_frame(sock, b"HI", bytes(secret) + _hello_json(endpoint.ring_size, engine.pool_size),
                   _local_fds(engine, endpoint), deadline)
        tag, payload = recv_frame(sock, deadline, _N_FDS, fds)
        if tag == b"NO":
            raise HandshakeError("server refused the shm handshake: "
                                 + payload.decode("utf-8", "replace"))
        if tag != b"OK":
            raise HandshakeError(f"unexpected handshake reply {tag!r}")
        peer = _parse_peer(payload, fds)
        extra: list[int] = []
        try:
            tag, payload = recv_frame(sock, deadline, 0, extra)
        finally:
            close_fds(extra)
        if tag == b"NO":
            raise HandshakeError("server could not attach the shm connection: "
                                 + payload.decode("utf-8", "replace"))
        if tag != b"AT":
            raise HandshakeError(f"unexpected handshake reply {tag!r}")
        sock.settimeout(None)  # hand the engine a blocking fd, as it was created
        sock_fd = sock.detach()
        fds = []  # from here on the engine owns the peer fds and the socket
        try:
            return engine.attach_shm(endpoint, peer, sock_fd, None, f"shm:pid={pid}")
        except Exception as e:  # CoreError: the engine has closed what it was given
            raise HandshakeError(f"attaching the shm connection failed: {e}") from None
    finally:
        close_fds(fds)
        if sock.fileno() >= 0:
            sock.close()


# --------------------------------------------------------------------------- server

class ShmAcceptor:
    """The server's abstract Unix socket: accepts handshakes for secrets it issued.

    `env.engine_factory()` returns the `_core.Engine` (it may raise: the client then gets
    "NO" + the reason); accepted connections are attached to `env.core_server`.
    """

    def __init__(self, secrets: SecretStore, env: ServerEnv,
                 io_timeout: float = IO_TIMEOUT) -> None:
        self._secrets = secrets
        self._env = env
        self._io_timeout = io_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._last_accept_warning = float("-inf")
        self._slots = threading.BoundedSemaphore(_MAX_HANDSHAKE_THREADS)
        self._active: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._connections = Connections("shm")
        self.name = f"argrpc/{os.getpid()}/{_secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="argrpc-shm-accept",
                                        daemon=True)
        self._thread.start()
        log.debug("argrpc: shm handshake socket @%s listening", self.name)

    # -- public

    def connections(self) -> list[Any]:
        """Connections attached so far that are still alive."""
        return self._connections.live()

    def close_connections(self) -> None:
        self._connections.close_all()

    def close(self) -> None:
        """Stop accepting and abort handshakes in progress (attached connections stay)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            active = list(self._active)
            workers = list(self._workers)
        try:
            # Wakes the thread blocked in accept() (Linux returns EINVAL to it).
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for s in active:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        for t in workers:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        self._sock.close()

    # -- internals

    def _accept_loop(self) -> None:
        while True:
            # A slot first: beyond the bound, clients wait in the listen backlog (their
            # handshake has a deadline) rather than being refused into plain gRPC, which
            # a burst of processes connecting at once otherwise got.
            while not self._slots.acquire(timeout=_SLOT_POLL_S):
                if self._closed:
                    return
            try:
                conn_sock, _ = self._sock.accept()
            except OSError as e:
                self._slots.release()
                if self._closed:
                    return
                # EMFILE and friends: back off instead of spinning, keep serving.
                self._accept_failed(e)
                time.sleep(0.05)
                continue
            if self._closed:
                self._slots.release()
                conn_sock.close()
                return
            worker = threading.Thread(target=self._serve, args=(conn_sock,),
                                      name="argrpc-shm-handshake", daemon=True)
            with self._lock:
                self._active.add(conn_sock)
                self._workers.add(worker)
            worker.start()

    def _accept_failed(self, error: OSError) -> None:
        """Logs a failed accept() once per burst (the loop backs off and goes on)."""
        now = time.monotonic()
        if now - self._last_accept_warning >= _ACCEPT_WARNING_INTERVAL_S:
            self._last_accept_warning = now
            log.warning("argrpc: shm socket accept failed: %s; clients fall back to gRPC "
                        "meanwhile", exhausted_text(error))

    def _serve(self, sock: socket.socket) -> None:
        try:
            self._handshake(sock)
        finally:
            with self._lock:
                self._active.discard(sock)
                self._workers.discard(threading.current_thread())
            self._slots.release()

    def _handshake(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + self._io_timeout
        fds: list[int] = []
        pid = -1
        try:
            pid, uid, _ = peer_credentials(sock)
            tag, payload = recv_frame(sock, deadline, _N_FDS, fds)
            if tag != b"HI" or len(payload) < SECRET_LEN:
                raise HandshakeError("malformed handshake hello")
            # Consumed before any other check: a secret gets exactly one attempt.
            grant = self._secrets.consume(payload[:SECRET_LEN])
            if uid != os.getuid():
                raise HandshakeError(f"peer uid {uid} is not the server's uid {os.getuid()}")
            if pid != grant.pid:
                raise HandshakeError(
                    f"peer pid {pid} is not the pid the secret was issued to ({grant.pid})")
            peer = _parse_peer(payload[SECRET_LEN:], fds)
            try:
                engine = self._env.engine_factory()
                endpoint = engine.new_shm_endpoint(self._env.conn_cfg)
            except Exception as e:
                raise HandshakeError(f"server cannot create a shm endpoint: {e}") from None
            send_frame(sock, b"OK", _hello_json(endpoint.ring_size, engine.pool_size),
                       _local_fds(engine, endpoint), deadline)
        except Exception as e:
            close_fds(fds)
            if isinstance(e, HandshakeError):
                log.info("argrpc: refused shm handshake from pid %d: %s", pid, e)
            else:
                log.warning("argrpc: shm handshake from pid %d failed", pid, exc_info=True)
            _send_nowait(sock, b"NO", str(e).encode())
            sock.close()
            return
        # The engine takes the socket (as a blocking fd, as it was created); a dup stays
        # here only to send the final AT/NO without touching the shared file flags.
        sock.settimeout(None)
        reply = sock.dup()
        sock_fd = sock.detach()
        fds = []
        try:
            try:
                conn = engine.attach_shm(endpoint, peer, sock_fd, self._env.core_server,
                                         grant.caller.remote(f"shm:pid={pid}"))
            except Exception as e:  # CoreError: the engine has closed what it was given
                log.warning("argrpc: attaching shm connection from pid %d failed: %s", pid, e)
                _send_nowait(reply, b"NO", str(e).encode())
                return
            self._connections.add(conn)  # listed before the client can know it is attached
            if not _send_nowait(reply, b"AT", b""):
                log.info("argrpc: shm client pid %d vanished before the handshake ended", pid)
                self._connections.discard(conn)
                conn.close()
                return
        finally:
            reply.close()
        log.info("argrpc: shm connection from pid %d attached", pid)
