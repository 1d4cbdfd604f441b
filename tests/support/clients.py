"""Client-side helpers shared by the tests: channels per stack, transport checks, polling."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import grpc

from tests.support.procs import ServerProcess

UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
UNLIMITED_SERVER_ARGS = ("--max-recv", "-1", "--max-send", "-1")
PAIRS = [("argrpc", "argrpc"), ("grpc", "argrpc"), ("argrpc", "grpc"), ("grpc", "grpc")]
SHM_AND_REFERENCE = [("argrpc", "argrpc"), ("grpc", "grpc")]


def deadline(size: int = 0) -> float:
    """Per-RPC timeout: generous for localhost, short enough that a hang fails quickly."""
    return 20.0 + size / (2 << 20)


def pair_id(pair: tuple[str, str]) -> str:
    """Test id, unambiguous under -k: e.g. client_grpc-server_argrpc."""
    return f"client_{pair[0]}-server_{pair[1]}"


def make_channel(stack: str, target: str, options: Sequence[tuple[str, Any]] | None = None
                 ) -> grpc.Channel:
    if stack == "argrpc":
        import argrpc
        return argrpc.insecure_channel(target, options=list(options or []))
    return grpc.insecure_channel(target, options=list(options or []))


def check_transport(channel: Any, client_stack: str, server_stack: str) -> None:
    """An argrpc channel must use shm against an argrpc server and say why it fell back
    against a plain grpc server. Call after at least one RPC (negotiation may be lazy)."""
    if client_stack != "argrpc":
        return
    assert isinstance(channel, grpc.Channel)
    if server_stack == "argrpc":
        assert channel.transport == "shm", (
            f"argrpc->argrpc should be the shm fast path, got transport="
            f"{channel.transport!r} fallback_reason={getattr(channel, 'fallback_reason', None)!r}")
    else:
        assert channel.transport == "grpc"
        assert channel.fallback_reason, "fallback to plain gRPC must carry a reason"


def new_tag() -> str:
    return uuid.uuid4().hex


@dataclass
class Client:
    stack: str
    server: ServerProcess
    channel: Any
    stub: Any
    pb2: ModuleType
    closers: list[Callable[[], None]] = field(default_factory=list)

    def req(self, **fields: Any) -> Any:
        return self.pb2.EchoRequest(**fields)

    def query(self, query: str, timeout: float = 30.0) -> Any:
        return json.loads(self.stub.Unary(self.req(query=query), timeout=timeout).info)

    def observations(self, tag: str) -> dict[str, Any]:
        return self.query(f"obs:{tag}")

    def wait_obs(self, tag: str, predicate: Callable[[dict[str, Any]], bool],
                 timeout: float = 30.0) -> dict[str, Any]:
        """Poll the server's observations for `tag` until `predicate` holds."""
        end = time.monotonic() + timeout
        obs = self.observations(tag)
        while not predicate(obs) and time.monotonic() < end:
            time.sleep(0.05)
            obs = self.observations(tag)
        return obs

    def close(self) -> None:
        self.channel.close()


def open_client(stack: str, server: ServerProcess, pb2: ModuleType, pb2_grpc: ModuleType,
                options: Sequence[tuple[str, Any]] | None = None,
                check: bool = True) -> Client:
    channel = make_channel(stack, server.target, options)
    client = Client(stack, server, channel, pb2_grpc.EchoStub(channel), pb2)
    if check:
        # One real call first: negotiation may happen lazily on the first RPC.
        client.stub.Unary(client.req(payload=b"warm-up"), timeout=60, wait_for_ready=True)
        check_transport(channel, stack, server.stack)
    return client


def md_pairs(md: Any, prefix: str = "x-") -> list[tuple[str, Any]]:
    """Metadata as plain (key, value) tuples, only keys starting with `prefix`."""
    return [(k, v) for k, v in (md or ()) if k.startswith(prefix)]
