"""Shared memory between two processes of one host.

The client offers it with nothing prepared: the server answers with its handshake
socket's name and a one-time secret, and the connection is made over that socket
(`shm_handshake`) after the bootstrap RPC.
"""

from __future__ import annotations

import _thread
import logging
import os
import threading
import time
from typing import Any

from argrpc import _proto
from argrpc._config import Config, conn_config
from argrpc._engine import get_engine
from argrpc._fd_limit import exhausted_text, near_limit_reason
from argrpc._host import target_is_local
from argrpc._transports.base import Caller, Declined, ServerEnv, Transport, TransportServer, Unavailable
from argrpc._transports.shm_handshake import (IO_TIMEOUT, SECRET_LEN, SECRET_TTL, HandshakeError,
                                              SecretStore, ShmAcceptor, client_handshake)

__all__ = ["SHM", "Shm", "ShmServer"]

log = logging.getLogger("argrpc")

_MAX_SOCKET_NAME = 100  # bytes; an abstract sun_path holds 107 after its leading NUL


class Shm(Transport):
    name = "shm"
    what = "shared memory"
    same_host_only = True

    def __init__(self, secret_ttl: float = SECRET_TTL) -> None:
        self._secret_ttl = secret_ttl  # tests shorten it

    def why_unavailable(self, cfg: Config) -> str:
        return ""

    def offer(self, request: Any, cfg: Config, max_recv: int,
              target: str = "") -> _Prepared | None:
        request.transports.append(self.name)
        if target and target_is_local(target):
            return _Prepared(cfg, max_recv)
        return None

    def attach(self, offer: _Prepared | None, response: Any, cfg: Config, max_recv: int) -> Any:
        shm = response.shm
        if (len(shm.secret) != SECRET_LEN or not shm.socket_name.startswith("argrpc/")
                or len(shm.socket_name.encode()) > _MAX_SOCKET_NAME or "\0" in shm.socket_name):
            raise Unavailable("server sent a malformed shm offer")
        deadline = time.monotonic() + IO_TIMEOUT
        prepared = offer if offer is not None else _Prepared(cfg, max_recv, background=False)
        # Errors surface after the RPC on purpose: "server is plain gRPC" is the more
        # useful reason when both apply. An unused secret just expires on the server.
        engine, endpoint = prepared.result(deadline)
        try:
            return client_handshake(shm.socket_name, shm.server_pid, shm.secret, engine,
                                    conn_config(cfg, max_recv),
                                    timeout=max(0.0, deadline - time.monotonic()),
                                    endpoint=endpoint)
        except HandshakeError as e:
            raise Unavailable(f"shm handshake failed: {e}") from None
        except (OSError, RuntimeError) as e:  # CoreError: a limit, most likely; a fallback
            raise Unavailable(f"shm handshake failed: {exhausted_text(e)}") from None
        except Exception as e:
            log.warning("argrpc: shm handshake failed unexpectedly", exc_info=True)
            raise Unavailable(f"shm handshake failed: {e}") from None

    def describe(self, request: Any) -> str:
        return f"offering shm to pid {request.host.pid} on {request.host.hostname or '?'}"

    def server(self, env: ServerEnv) -> ShmServer:
        return ShmServer(env, self._secret_ttl)


class _Prepared:
    """The client's engine and shm endpoint (its receive ring), made while the bootstrap
    RPC is in flight when the target is on this host: a fresh process's engine and ring
    cost about as much as that RPC, and neither depends on the answer. The main thread
    waits in grpc without the GIL meanwhile. Against a server that then declines, the
    endpoint is dropped and the engine stays, idle, for the process's later channels."""

    def __init__(self, cfg: Config, max_recv: int, background: bool = True) -> None:
        self._cfg = cfg
        self._max_recv = max_recv
        self._done = threading.Event()
        self._engine: Any = None
        self._endpoint: Any = None
        self._error: Unavailable | None = None
        if background:
            # Not threading.Thread: its start() waits for the new thread to run, and on
            # a busy machine that hand-off of the GIL cost the caller up to a millisecond
            # before its RPC. This thread only needs to finish before attach().
            _thread.start_new_thread(self._run, ())
        else:
            self._run()

    def _run(self) -> None:
        try:
            try:
                self._engine = get_engine(self._cfg)
            except Exception as e:  # EngineUnavailable or CoreError
                self._error = Unavailable(str(e))
                return
            try:
                self._endpoint = self._engine.new_shm_endpoint(
                    conn_config(self._cfg, self._max_recv))
            except Exception as e:  # CoreError: still a fallback, not a crash
                why = exhausted_text(e)
                log.warning("argrpc: creating the shm endpoint failed: %s", why)
                self._error = Unavailable(f"shm handshake failed: {why}")
        finally:
            self._done.set()

    def result(self, deadline: float) -> tuple[Any, Any]:
        """(engine, endpoint); raises Unavailable."""
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise Unavailable("shm handshake failed: creating the engine timed out")
        if self._error is not None:
            raise self._error
        return self._engine, self._endpoint


class ShmServer(TransportServer):
    """Issues secrets and runs the handshake socket, opened on the first offer."""

    def __init__(self, env: ServerEnv, secret_ttl: float) -> None:
        self._env = env
        self._secrets = SecretStore(ttl=secret_ttl)
        self._lock = threading.Lock()
        self._acceptor: ShmAcceptor | None = None
        self._closed = False

    @property
    def socket_name(self) -> str | None:
        """The abstract socket name (no leading NUL) once the first offer opened it."""
        acceptor = self._acceptor
        return acceptor.name if acceptor is not None else None

    def accept(self, request: Any, response: Any, caller: Caller) -> Declined | None:
        if near_limit := near_limit_reason():
            return Declined(f"server: {near_limit}")
        try:
            acceptor = self._ensure_acceptor()
        except OSError as e:
            return Declined(f"server cannot open its shm socket: {e}", final=True)
        if acceptor is None:
            return Declined("server is shutting down", final=True)
        secret = self._secrets.issue(request.host.pid, caller)
        response.shm.CopyFrom(_proto.ShmOffer(socket_name=acceptor.name, secret=secret,
                                              server_pid=os.getpid()))
        return None

    def connections(self) -> list[Any]:
        acceptor = self._acceptor
        return acceptor.connections() if acceptor is not None else []

    def close_connections(self) -> None:
        acceptor = self._acceptor
        if acceptor is not None:
            acceptor.close_connections()

    def close(self) -> None:
        # The acceptor is kept: close_connections() still needs its list of connections.
        with self._lock:
            if self._closed:
                return
            self._closed = True
            acceptor = self._acceptor
        if acceptor is not None:
            acceptor.close()

    def _ensure_acceptor(self) -> ShmAcceptor | None:
        with self._lock:
            if self._closed:
                return None
            if self._acceptor is None:
                self._acceptor = ShmAcceptor(self._secrets, self._env)
            return self._acceptor


SHM = Shm()
