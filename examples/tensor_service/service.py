"""An asyncio tensor service: named numpy arrays stored and fetched by ``async def``
handlers, the way feature and embedding stores are written against ``grpc.aio``.

Messages are the arrays' own bytes (no protobuf copy): the request serializer hands the
array's buffer to the channel, the tensor's dtype and shape travel as metadata, and the
receiver wraps what arrives with ``numpy.frombuffer`` (on argrpc's fast path a large
message arrives as a view of the pool, not a copy). The same code runs on ``grpc.aio``
and ``argrpc.aio``: ``--stack`` picks the module.

    python -m examples.tensor_service.service --compare          # grpc.aio vs argrpc.aio
    python -m examples.tensor_service.service --stack argrpc --tensors 16 --mib 16
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import sys
import time
from typing import Any

import numpy as np

_SERVICE = "tensors.TensorStore"
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _aio(stack: str) -> Any:
    return importlib.import_module("argrpc.aio" if stack == "argrpc" else "grpc.aio")


def _meta(md: Any) -> dict[str, str]:
    return {k: v for k, v in md if not k.endswith("-bin") and k.startswith("x-")}


def _payload(stack: str) -> Any:
    """An array's bytes as the stack sends them: argrpc takes the buffer itself, plain
    grpc only `bytes` (one copy)."""
    if stack == "argrpc":
        return lambda a: memoryview(a).cast("B")
    return lambda a: a.tobytes()


class TensorStore:
    """Put(array bytes, metadata name/dtype/shape) -> digest; Get(name) -> array bytes."""

    def __init__(self, stack: str) -> None:
        self._tensors: dict[str, tuple[np.ndarray, str]] = {}
        self._payload = _payload(stack)

    async def put(self, request: memoryview, context: Any) -> bytes:
        md = _meta(context.invocation_metadata())
        shape = tuple(int(d) for d in md["x-shape"].split(",") if d)
        array = np.frombuffer(request, dtype=md["x-dtype"]).reshape(shape).copy()
        digest = hashlib.sha256(array.tobytes()).hexdigest()
        self._tensors[md["x-name"]] = (array, digest)
        return digest.encode()

    async def get(self, request: bytes, context: Any) -> memoryview:
        name = request.decode()
        if name not in self._tensors:
            await context.abort(_grpc().StatusCode.NOT_FOUND, f"no tensor {name!r}")
        array, _ = self._tensors[name]
        await context.send_initial_metadata((("x-dtype", array.dtype.str),
                                             ("x-shape", ",".join(map(str, array.shape)))))
        return self._payload(array)

    async def names(self, request: bytes, context: Any) -> Any:
        for name in sorted(self._tensors):
            yield name.encode()


def _grpc() -> Any:
    import grpc
    return grpc


def handlers(store: TensorStore) -> Any:
    grpc = _grpc()
    return grpc.method_handlers_generic_handler(_SERVICE, {
        "Put": grpc.unary_unary_rpc_method_handler(store.put, request_deserializer=memoryview),
        "Get": grpc.unary_unary_rpc_method_handler(store.get),
        "Names": grpc.unary_stream_rpc_method_handler(store.names),
    })


async def serve(stack: str, port: int = 0, ready: "asyncio.Queue[int] | None" = None,
                stop: "asyncio.Event | None" = None) -> None:
    server = _aio(stack).server(options=_UNLIMITED)
    server.add_generic_rpc_handlers((handlers(TensorStore(stack)),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    if ready is not None:
        ready.put_nowait(bound)
    if stop is not None:
        await stop.wait()
        await server.stop(1.0)
    else:
        await server.wait_for_termination()


async def client(stack: str, target: str, tensors: int, mib: int) -> dict[str, Any]:
    """Stores `tensors` arrays of `mib` MiB, fetches them back, checks every byte."""
    aio = _aio(stack)
    async with aio.insecure_channel(target, options=_UNLIMITED) as channel:
        put = channel.unary_unary(f"/{_SERVICE}/Put",
                                  request_serializer=_payload(stack))
        get = channel.unary_unary(f"/{_SERVICE}/Get")
        names = channel.unary_stream(f"/{_SERVICE}/Names")
        rng = np.random.default_rng(7)
        arrays = {f"layer{i}": rng.standard_normal((mib << 20) // 4, dtype=np.float32)
                  for i in range(tensors)}
        await put(arrays["layer0"], metadata=(("x-name", "warmup"), ("x-dtype", "<f4"),
                                              ("x-shape", str(arrays["layer0"].size))))
        start = time.perf_counter()
        digests = await asyncio.gather(*[
            put(a, timeout=60, metadata=(("x-name", n), ("x-dtype", a.dtype.str),
                                          ("x-shape", ",".join(map(str, a.shape)))))
            for n, a in arrays.items()])
        put_s = time.perf_counter() - start
        for (name, array), digest in zip(arrays.items(), digests):
            if bytes(digest).decode() != hashlib.sha256(array.tobytes()).hexdigest():
                raise SystemExit(f"{name}: the server stored different bytes")
        start = time.perf_counter()
        calls = [get(n.encode(), timeout=60) for n in arrays]
        fetched = await asyncio.gather(*calls)
        get_s = time.perf_counter() - start
        for call, (name, array), raw in zip(calls, arrays.items(), fetched):
            md = _meta(await call.initial_metadata())
            back = np.frombuffer(raw, dtype=md["x-dtype"]).reshape(
                tuple(int(d) for d in md["x-shape"].split(",")))
            if not np.array_equal(back, array):
                raise SystemExit(f"{name}: fetched bytes differ")
        listed = [bytes(n).decode() async for n in names(b"")]
        total = tensors * mib
        return {"stack": stack, "transport": getattr(channel, "transport", "grpc"),
                "tensors": tensors, "mib_each": mib, "names": len(listed),
                "put_MiB_s": round(total / put_s, 1), "get_MiB_s": round(total / get_s, 1)}


async def run_pair(stack: str, tensors: int, mib: int) -> dict[str, Any]:
    ready: asyncio.Queue[int] = asyncio.Queue()
    stop = asyncio.Event()
    server = asyncio.create_task(serve(stack, 0, ready, stop))
    port = await ready.get()
    try:
        return await client(stack, f"127.0.0.1:{port}", tensors, mib)
    finally:
        stop.set()
        await server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stack", choices=("grpc", "argrpc"), default="argrpc")
    p.add_argument("--compare", action="store_true", help="run grpc.aio, then argrpc.aio")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--mib", type=int, default=16, help="size of each tensor in MiB")
    a = p.parse_args(argv)
    for stack in (("grpc", "argrpc") if a.compare else (a.stack,)):
        print(json.dumps(asyncio.run(run_pair(stack, a.tensors, a.mib))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
