"""Host A's side of the two-host tests: a handle on host B and a client calling it."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from tests.pair import CTRL_DIR, PORT, SERVER_ENV
from tests.support.clients import UNLIMITED, Client, make_channel

PAIR_HINT = ("run on two Soft-RoCE guests: softroce/pair.sh --b-ready "
             f"{CTRL_DIR}/ready -- python3 -m tests.pair.host_b -- python3 -m pytest -q tests/pair")


class HostB:
    """Sends commands to tests.pair.host_b through the shared directory."""

    def __init__(self, ctrl: Path, addr: str) -> None:
        self.ctrl = ctrl
        self.addr = addr
        self.target = f"{addr}:{PORT}"
        self._n = 0

    def send(self, *words: str) -> None:
        """Posts a command without waiting for its answer (see wait)."""
        tmp = self.ctrl / f".cmd-{self._n}"
        tmp.write_text(" ".join(words))
        tmp.rename(self.ctrl / f"cmd-{self._n}")
        self._n += 1

    def wait(self, timeout: float = 180.0) -> dict[str, Any]:
        """The answer to the last command sent."""
        ack = self.ctrl / f"ack-{self._n - 1}"
        end = time.monotonic() + timeout
        while not ack.exists():
            if time.monotonic() > end:
                raise TimeoutError(f"host B did not answer command {self._n - 1} in {timeout}s")
            time.sleep(0.05)
        time.sleep(0.05)  # written in one go, but give a slow 9p mount a moment
        answer: dict[str, Any] = json.loads(ack.read_text())
        assert "error" not in answer, answer
        return answer

    def do(self, *words: str, timeout: float = 180.0) -> dict[str, Any]:
        self.send(*words)
        return self.wait(timeout)


@pytest.fixture(scope="session")
def host_b() -> HostB:
    if os.environ.get("RXE_ROLE") != "a" or not os.environ.get("RXE_PEER_ADDR"):
        pytest.skip(f"not host A of a two-host pair; {PAIR_HINT}")
    ctrl = Path(CTRL_DIR)
    if not (ctrl / "ready").exists():
        pytest.skip(f"host B is not serving ({ctrl / 'ready'} missing); {PAIR_HINT}")
    os.environ.update(SERVER_ENV)  # this process's engine: the same pool size as B's
    return HostB(ctrl, os.environ["RXE_PEER_ADDR"])


def open_remote(host_b: HostB, pb: SimpleNamespace, own: bool = False) -> Client:
    """An argrpc channel to B, after one call that waits for B to serve. `own`: a
    connection of its own, not the one this process's other channels to B share."""
    options = UNLIMITED + ([("grpc.use_local_subchannel_pool", 1)] if own else [])
    channel = make_channel("argrpc", host_b.target, options)
    client = Client("argrpc", host_b, channel, pb.pb2_grpc.EchoStub(channel), pb.pb2)  # type: ignore[arg-type]
    client.stub.Unary(client.req(payload=b"warm-up"), timeout=180, wait_for_ready=True)
    return client


@pytest.fixture(scope="module")
def remote(host_b: HostB, pb: SimpleNamespace) -> Iterator[Client]:
    client = open_remote(host_b, pb)
    try:
        yield client
    finally:
        client.close()
