"""The transport registry: the one list negotiation, the channel, doctor and the
benchmark share, and the helpers every transport's server half uses."""
from __future__ import annotations

from typing import Any

import pytest

from argrpc import _config, _transports
from argrpc._bootstrap import client_offer
from argrpc._transports import REGISTRY, Connections, Transport, by_name, names, selected


def test_registry_names_are_unique_and_shared_memory_wins_on_one_host() -> None:
    assert len(set(names())) == len(REGISTRY)
    assert names()[0] == "shm" and REGISTRY[0].same_host_only
    assert all(isinstance(t, Transport) and t.name and t.what for t in REGISTRY)
    assert by_name("verbs") is _transports.verbs.VERBS and by_name("none") is None


def test_config_accepts_exactly_the_registered_transports() -> None:
    assert set(_config.TRANSPORT_CHOICES) == {"auto", "grpc", *names()}


def test_benchmark_transports_come_from_the_registry() -> None:
    import argrpc_bench

    assert argrpc_bench.TRANSPORTS == ("grpc", *names())


@pytest.mark.parametrize("mode", _config.TRANSPORT_CHOICES)
def test_selection_and_client_offer_follow_tf_rdma_transport(mode: str) -> None:
    cfg = _config.Config(transport=mode)
    chosen = [t.name for t in selected(cfg)]
    assert chosen == ([*names()] if mode == "auto" else [n for n in names() if n == mode])
    offered, why_not = client_offer(cfg)
    assert set(offered) | set(why_not) == set(names()) and not set(offered) & set(why_not)
    assert all(why_not[n] == f"TF_RDMA_TRANSPORT={mode}" for n in names() if n not in chosen)


class _Conn:
    def __init__(self, fail: bool = False) -> None:
        self.alive, self.fail = True, fail

    def close(self) -> None:
        self.alive = False
        if self.fail:
            raise RuntimeError("already gone")


def test_connections_drop_the_dead_and_close_all_despite_failures() -> None:
    conns = Connections("test")
    a, b, c = _Conn(), _Conn(fail=True), _Conn()
    for conn in (a, b, c):
        conns.add(conn)
    c.alive = False
    assert conns.live() == [a, b]
    conns.discard(a)
    conns.discard(a)  # already gone: nothing to do
    conns.add(a)
    conns.close_all()
    assert not a.alive and not b.alive and conns.live() == []


def test_listener_closes_every_transports_connections() -> None:
    from argrpc._bootstrap import FastPathListener

    closed: list[str] = []

    class Half(_transports.TransportServer):
        def __init__(self, name: str) -> None:
            self.name = name

        def accept(self, request: Any, response: Any, user_agent: str) -> Any:
            return _transports.Declined("test")

        def connections(self) -> list[Any]:
            return [self.name]

        def close_connections(self) -> None:
            closed.append(f"{self.name} connections")

        def close(self) -> None:
            closed.append(self.name)

    transports = []
    for t in REGISTRY:
        fake = type(t)()
        fake.server = lambda env, name=t.name: Half(name)  # type: ignore[method-assign]
        transports.append(fake)
    lst = FastPathListener("core", _config.Config(), 1, transports=transports)
    assert lst.connections() == list(names())
    lst.close_connections()
    lst.close()
    assert closed == [f"{n} connections" for n in names()] + list(names())
