"""Many concurrent calls of mixed sizes and arities on one channel."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tests.support import payload
from tests.support.clients import Client
from tests.support.payload import ACC_SIZE, CHUNK_SIZE, MiB

SIZES = [0, 1, 64, 1000, ACC_SIZE - 1, ACC_SIZE + 1, 100_000, MiB, CHUNK_SIZE + 1, 6 * MiB]


def _unary(client: Client, i: int) -> None:
    size = SIZES[i % len(SIZES)]
    body = payload.make(i, size)
    resp = client.stub.Unary(client.req(payload=body), timeout=60)
    assert resp.payload == body, f"call {i} ({size} B) corrupted"


def _server_stream(client: Client, i: int) -> None:
    size = SIZES[(i * 3) % len(SIZES)]
    got = list(client.stub.ServerStream(
        client.req(response_count=3, response_size=size, response_seed=i * 10), timeout=60))
    expected = [payload.make(i * 10 + k, size) if size else b"" for k in range(3)]
    assert [r.payload for r in got] == expected, f"call {i} ({size} B) corrupted"


def _client_stream(client: Client, i: int) -> None:
    bodies = [payload.make(i + k, SIZES[(i + k) % len(SIZES)]) for k in range(3)]
    resp = client.stub.ClientStream(iter(client.req(payload=b) for b in bodies), timeout=60)
    assert resp.digest == payload.sha256(b"".join(bodies)), f"call {i} corrupted"


def _bidi(client: Client, i: int) -> None:
    bodies = [payload.make(i + k, SIZES[(i + 2 * k) % len(SIZES)]) for k in range(3)]
    got = list(client.stub.Bidi(iter(client.req(payload=b) for b in bodies), timeout=60))
    assert [r.payload for r in got] == bodies, f"call {i} corrupted"


KINDS: list[Callable[[Client, int], None]] = [_unary, _unary, _server_stream, _unary,
                                              _client_stream, _unary, _bidi, _unary]


def test_64_concurrent_mixed_calls_from_8_threads(client: Client) -> None:
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(KINDS[i % len(KINDS)], client, i) for i in range(64)]
        errors = [f.exception(timeout=120) for f in futures]
    failed = [(i, repr(e)) for i, e in enumerate(errors) if e is not None]
    assert not failed, failed
    # the connection is still healthy afterwards
    assert client.stub.Unary(client.req(payload=b"after"), timeout=20).payload == b"after"


def test_64_concurrent_unary_futures(client: Client) -> None:
    """Futures issued from one thread, completed out of order by the server."""
    bodies = [payload.make(i, SIZES[i % len(SIZES)]) for i in range(64)]
    futs = [client.stub.Unary.future(client.req(payload=b, sleep_ms=(63 - i) % 5 * 20),
                                     timeout=60) for i, b in enumerate(bodies)]
    for i, (fut, body) in enumerate(zip(futs, bodies)):
        assert fut.result(timeout=120).payload == body, f"future {i} corrupted"
