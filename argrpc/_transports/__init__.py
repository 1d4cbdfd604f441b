"""The fast transports this build negotiates: one module each, one line each below.

Negotiation (both halves), the channel, `argrpc doctor` and the benchmark iterate
REGISTRY; docs/transports.md says how to add one.
"""

from __future__ import annotations

from typing import Sequence

from argrpc._config import Config
from argrpc._transports.base import (Caller, Connections, Declined, ServerEnv, Transport,
                                     TransportServer, Unavailable)
from argrpc._transports.shm import SHM
from argrpc._transports.verbs import VERBS

__all__ = ["REGISTRY", "Caller", "Connections", "Declined", "ServerEnv", "Transport", "TransportServer",
           "Unavailable", "by_name", "names", "selected"]

# In order of preference: where several are possible (one host), the first wins.
REGISTRY: tuple[Transport, ...] = (
    SHM,
    VERBS,
)


def names() -> tuple[str, ...]:
    return tuple(t.name for t in REGISTRY)


def by_name(name: str, transports: Sequence[Transport] = REGISTRY) -> Transport | None:
    return next((t for t in transports if t.name == name), None)


def selected(cfg: Config, transports: Sequence[Transport] = REGISTRY) -> list[Transport]:
    """The transports TF_RDMA_TRANSPORT lets this process use (auto: all of them)."""
    return [t for t in transports if cfg.transport in ("auto", t.name)]
