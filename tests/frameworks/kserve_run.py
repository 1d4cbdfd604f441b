"""One process of a KServe deployment (kserve's own ModelServer and its
InferenceGRPCClient, the v2 inference protocol over gRPC), with grpc.aio's factories
swapped for argrpc.aio's or left alone:

    python -m tests.frameworks.kserve_run server STACK GRPC_PORT HTTP_PORT
    python -m tests.frameworks.kserve_run client STACK GRPC_PORT [ROUNDS]

The model doubles an FP32 tensor; an input named "bad" raises kserve's InvalidInput, one
named "slow" sleeps. The client prints one JSON line: each case's answer digest or status,
and the seconds each tensor size took per call (ROUNDS calls each)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from typing import Any

import grpc
import numpy as np
from grpc import aio

SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
TOO_LARGE = 16 << 20  # kserve's server accepts 8 MiB messages


def swap(stack: str) -> None:
    """The documented swap, before kserve makes its server or channel."""
    if stack == "argrpc":
        import argrpc.aio

        aio.server = argrpc.aio.server  # type: ignore[assignment]
        aio.insecure_channel = argrpc.aio.insecure_channel  # type: ignore[assignment]
        logging.getLogger("argrpc").setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("argrpc-log %(message)s"))
        logging.getLogger("argrpc").addHandler(handler)


def serve(grpc_port: int, http_port: int) -> None:
    import kserve
    from kserve.errors import InvalidInput
    from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

    class Doubler(kserve.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__("doubler")
            self.ready = True

        async def predict(self, payload: InferRequest, headers: Any = None,
                          response_headers: Any = None) -> InferResponse:
            tensor = payload.inputs[0]
            if tensor.name == "bad":
                raise InvalidInput("the input named bad is refused")
            if tensor.name == "slow":
                await asyncio.sleep(5)
            x = tensor.as_numpy()
            out = InferOutput(name="y", shape=list(x.shape), datatype="FP32")
            out.set_data_from_numpy(x * 2, binary_data=True)
            return InferResponse(response_id=payload.id or "", model_name=self.name,
                                 infer_outputs=[out])

    kserve.ModelServer(grpc_port=grpc_port, http_port=http_port, enable_grpc=True,
                       workers=1).start([Doubler()])


async def ask(port: int, rounds: int) -> dict[str, Any]:
    from kserve import InferenceGRPCClient
    from kserve.protocol.infer_type import InferInput, InferRequest

    client = InferenceGRPCClient(url=f"127.0.0.1:{port}", timeout=60,
                                 channel_args=[("grpc.max_receive_message_length", -1),
                                               ("grpc.max_send_message_length", -1)])

    def request(name: str, x: np.ndarray, model: str = "doubler") -> Any:
        tensor = InferInput(name=name, shape=list(x.shape), datatype="FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        return InferRequest(model_name=model, infer_inputs=[tensor])

    async def outcome(req: Any, timeout: float | None = None) -> Any:
        try:
            resp = await client.infer(req, timeout=timeout) if timeout else await client.infer(req)
        except grpc.RpcError as e:
            return [e.code().name, e.details()]
        y = resp.outputs[0].as_numpy()
        return hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()[:16]

    out: dict[str, Any] = {"answers": {}, "seconds": {}}
    for label, n in SIZES.items():
        x = np.arange(n // 4, dtype=np.float32).reshape(-1, 4)
        out["answers"][label] = await outcome(request("x", x))
        start = time.perf_counter()
        for _ in range(rounds):
            await client.infer(request("x", x))
        out["seconds"][label] = (time.perf_counter() - start) / rounds
    small = np.ones((2, 2), np.float32)
    out["answers"]["over the server's limit"] = await outcome(
        request("x", np.zeros(TOO_LARGE // 4, np.float32)))
    out["answers"]["invalid input"] = await outcome(request("bad", small))
    out["answers"]["unknown model"] = await outcome(request("x", small, model="nope"))
    out["answers"]["deadline"] = await outcome(request("slow", small), timeout=0.5)
    await client.close()
    return out


def main() -> None:
    role, stack, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    swap(stack)
    if role == "server":
        serve(port, int(sys.argv[4]))
    else:
        rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        print(json.dumps(asyncio.run(ask(port, rounds))), flush=True)


if __name__ == "__main__":
    main()
