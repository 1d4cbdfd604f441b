"""Fixtures for the argrpc conformance suite.

Every behaviour test runs over four (client stack, server stack) pairs, ids
"client_<stack>-server_<stack>": argrpc/argrpc (shared-memory fast path), grpc/argrpc
(plain grpc client against an argrpc server), argrpc/grpc (fallback) and grpc/grpc (the
reference: the same assertions must hold for plain grpcio). Select one with e.g.
`-k client_grpc-server_grpc`. Servers run in their own processes.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Sequence

import pytest

from tests.support import stubs as stubgen
from tests.support.clients import (PAIRS, UNLIMITED, UNLIMITED_SERVER_ARGS, Client,
                                   open_client, pair_id)
from tests.support.procs import REPO_ROOT, ServerProcess


def pytest_sessionstart(session: pytest.Session) -> None:
    """ARGRPC_INSTALLED_TEST=1 (scripts/test_installed.sh): the suite runs against an
    installed argrpc, so it must not be importing one from the tree the tests are in."""
    if os.environ.get("ARGRPC_INSTALLED_TEST") != "1":
        return
    import argrpc

    where = Path(argrpc.__file__).resolve()
    if REPO_ROOT.resolve() in where.parents or "site-packages" not in where.parts:
        raise pytest.UsageError(f"ARGRPC_INSTALLED_TEST=1 but argrpc is imported from {where}, "
                                "not from an installed package")


@pytest.fixture(scope="session")
def stubs_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(stubgen.generate(tmp_path_factory.mktemp("echo_stubs")))


@pytest.fixture(scope="session")
def pb(stubs_dir: str) -> SimpleNamespace:
    pb2, pb2_grpc = stubgen.load(stubs_dir)
    return SimpleNamespace(pb2=pb2, pb2_grpc=pb2_grpc)


class ServerPool:
    """Server processes shared across tests, keyed by (stack, args, env); restarted if dead."""

    def __init__(self, stubs_dir: str) -> None:
        self._stubs_dir = stubs_dir
        self._servers: dict[Any, ServerProcess] = {}

    def get(self, stack: str, args: Sequence[str] = (),
            env: Mapping[str, str] | None = None) -> ServerProcess:
        key = (stack, tuple(args), tuple(sorted((env or {}).items())))
        server = self._servers.get(key)
        if server is None or not server.alive():
            if server is not None:
                server.kill()
            server = ServerProcess(stack, self._stubs_dir, args, env)
            self._servers[key] = server
        return server

    def close(self) -> None:
        for server in self._servers.values():
            server.kill()
        self._servers.clear()


@pytest.fixture(scope="session")
def servers(stubs_dir: str) -> Iterator[ServerPool]:
    pool = ServerPool(stubs_dir)
    yield pool
    pool.close()


@pytest.fixture
def spawn(stubs_dir: str) -> Iterator[Callable[..., ServerProcess]]:
    """Start a server process owned by one test (killed at teardown)."""
    started: list[ServerProcess] = []

    def _spawn(stack: str, args: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(stack, stubs_dir, args, env)
        started.append(server)
        return server

    yield _spawn
    for server in started:
        server.kill()


@pytest.fixture
def connect(pb: SimpleNamespace) -> Iterator[Callable[..., Client]]:
    """Open clients (channel + stub) that are closed at teardown."""
    opened: list[Client] = []

    def _connect(stack: str, server: ServerProcess,
                 options: Sequence[tuple[str, Any]] | None = None,
                 check: bool = True) -> Client:
        client = open_client(stack, server, pb.pb2, pb.pb2_grpc, options, check)
        opened.append(client)
        return client

    yield _connect
    for client in opened:
        client.close()


@pytest.fixture(params=PAIRS, ids=pair_id)
def pair(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


@pytest.fixture
def client(pair: tuple[str, str], servers: ServerPool,
           connect: Callable[..., Client]) -> Client:
    """A checked client of `pair`'s client stack against a shared unlimited-size server."""
    client_stack, server_stack = pair
    return connect(client_stack, servers.get(server_stack, UNLIMITED_SERVER_ARGS), UNLIMITED)
