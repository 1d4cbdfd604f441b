"""Parameter-server throughput: one PS process holding the variables, N worker processes.

    python -m argrpc_bench.ps serve  --stack grpc|argrpc --scheme skew [--model-bytes B]
    python -m argrpc_bench.ps worker --target HOST:PORT --stack ... --transport ... \
        --mode raw|serialized --warmup W (--iterations N | --duration S) --repeats R

The pattern is TensorFlow's between-graph, asynchronous data-parallel training with one
parameter server, with the model's compute taken out so only communication is measured:

* The PS holds the variables: ``schemes.model_variables(scheme, seed)`` (skew: ResNet-50's
  161 float32 tensors, 102 MB), optionally scaled to ``--model-bytes`` keeping the count
  and mix (tests use a tiny model). float32 where the size allows, else uint8.
* Each worker step = **pull** then **push**, 2 × (number of variables) unary RPCs:
  - pull: one ``Pull`` RPC per variable (TF's RecvTensor: one RPC per tensor), **all in
    flight at once** — TF's executor issues every RecvTensor of a step as soon as the step
    starts — and the step waits for all of them (the forward pass needs every variable).
    The pulled tensors are kept until the step ends, as the backward pass would.
  - push: one ``Push`` RPC per variable carrying a gradient of the same size, again all in
    flight at once (TF sends each gradient as soon as backprop produces it); the step ends
    when every push is acknowledged.
* The PS applies each pushed gradient to its variable (``var += grad``, a numpy add in the
  handler thread) without a lock, like TF's default ``use_locking=False`` (Hogwild-style
  asynchronous updates); workers never synchronize with each other (async training).
* Concurrency: each worker has up to V RPCs in flight (V = variables); the PS serves them
  with a thread pool of ``--threads`` (default 8) threads, the same size on both stacks.

Wire format: serialized mode sends ``VarRequest{id}`` → ``Tensor{id, data}`` and
``Tensor{id, data}`` → ``Ack`` through protobuf (the worker builds each gradient's
``Tensor`` per step from its numpy array: ``tobytes()`` + encode, what an unchanged
service pays; the PS answers a pull with ``var.tobytes()`` in a ``Tensor``). Raw mode
sends the id as 4 bytes and the variable back as a bare buffer (``memoryview`` of the
numpy array), and pushes the gradient as a bare buffer with the variable id in call
metadata (so a multi-MiB gradient is never copied to prepend a header).

Measured: step time per worker (p50/p99/mean), aggregate steps/s over all workers =
total steps / (last worker's end − first worker's start) of each timed phase (timestamps
from the system-wide monotonic clock), aggregate payload bytes/s = steps/s × bytes per
step (pull + push), aggregate RPCs/s = steps/s × 2V. Workers warm up, then report
``READY`` and wait for ``GO`` on stdin, so every timed phase starts together.

Each worker prints exactly one JSON line at the end; the PS prints ``PORT n`` and serves
until stdin closes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import sys
import time
from typing import Any

import grpc
import numpy as np

from argrpc_bench import TRANSPORTS
from argrpc_bench import messages as msg
from argrpc_bench import schemes
from argrpc_bench.client import (CALL_TIMEOUT_S, StdinControl, check_transport,
                                     emit_outcome, fetch_env, make_channel, stats_us)
from argrpc_bench.server import (DEFAULT_THREADS, make_server, parse_raw_ack, raw_ack,
                                 raw_serializer, serve, tf_rdma_env)

_ID = struct.Struct("<I")


def variable_sizes(scheme: str, seed: int, model_bytes: int | None) -> list[int]:
    sizes = schemes.model_variables(scheme, seed)
    if model_bytes is not None:
        sizes = schemes.scale_to_total(sizes, model_bytes)
    return sizes


def _dtype(nbytes: int) -> Any:
    return np.float32 if nbytes % 4 == 0 else np.uint8


# ------------------------------------------------------------------------------ PS

class ParameterServer:
    def __init__(self, sizes: list[int], stack: str) -> None:
        self.sizes = sizes
        self.vars = []
        for n in sizes:
            var = np.empty(n // np.dtype(_dtype(n)).itemsize, dtype=_dtype(n))
            var.fill(0)  # written, not calloc'ed: every page resident before the first pull
            self.vars.append(var)
        self.stack = stack

    def _apply(self, i: int, grad: Any) -> None:
        var = self.vars[i]
        g = np.frombuffer(grad, dtype=var.dtype)
        if g.size != var.size:
            raise ValueError(f"gradient for variable {i} has {g.nbytes} B, "
                             f"the variable {var.nbytes} B")
        np.add(var, g, out=var)  # the real update: reads both, writes the variable

    # serialized
    def pull(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return msg.Tensor(id=req.id, data=self.vars[req.id].tobytes())

    def push(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        self._apply(req.id, req.data)
        return msg.Ack(size=len(req.data), count=1)

    # raw
    def pull_raw(self, req: Any, ctx: grpc.ServicerContext) -> Any:
        return memoryview(self.vars[_ID.unpack(bytes(req))[0]]).cast("B")

    def push_raw(self, req: Any, ctx: grpc.ServicerContext) -> bytes:
        md = dict(ctx.invocation_metadata())
        self._apply(int(md[msg.VAR_ID_KEY]), req)
        return raw_ack(memoryview(req).nbytes, 1)

    def info(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        return json.dumps({"pid": os.getpid(), "env": tf_rdma_env(),
                           "sizes": self.sizes}).encode()

    def handler(self) -> grpc.GenericRpcHandler:
        uu = grpc.unary_unary_rpc_method_handler
        out_raw = raw_serializer(self.stack)
        return grpc.method_handlers_generic_handler(msg.PS_SERVICE, {
            msg.PULL: uu(self.pull, msg.VarRequest.FromString, msg.Tensor.SerializeToString),
            msg.PUSH: uu(self.push, msg.Tensor.FromString, msg.Ack.SerializeToString),
            msg.PULL_RAW: uu(self.pull_raw, None, out_raw),
            msg.PUSH_RAW: uu(self.push_raw, None, None),
            msg.PS_INFO: uu(self.info, None, None),
        })


def run_ps(args: argparse.Namespace) -> int:
    sizes = variable_sizes(args.scheme, args.seed, args.model_bytes)
    ps = ParameterServer(sizes, args.stack)
    return serve(make_server(args.stack, args.threads), [ps.handler()])


# -------------------------------------------------------------------------- worker

class Worker:
    def __init__(self, channel: grpc.Channel, stack: str, mode: str, sizes: list[int]) -> None:
        self.sizes = sizes
        self.mode = mode
        # Gradients: a small constant, so the PS's float adds stay finite forever.
        self.grads = [np.full(n // np.dtype(_dtype(n)).itemsize, 1e-3, dtype=_dtype(n))
                      if _dtype(n) is np.float32 else np.ones(n, dtype=np.uint8)
                      for n in sizes]
        self.bytes_per_step = 2 * sum(sizes)
        self.rpcs_per_step = 2 * len(sizes)
        if mode == "serialized":
            self._pull = channel.unary_unary(
                msg.path(msg.PS_SERVICE, msg.PULL),
                request_serializer=msg.VarRequest.SerializeToString,
                response_deserializer=msg.Tensor.FromString)
            self._push = channel.unary_unary(
                msg.path(msg.PS_SERVICE, msg.PUSH),
                request_serializer=msg.Tensor.SerializeToString,
                response_deserializer=msg.Ack.FromString)
            self._pull_reqs = [msg.VarRequest(id=i) for i in range(len(sizes))]
        else:
            to_wire = msg.bytes_only(memoryview) if stack == "grpc" else memoryview
            self._pull = channel.unary_unary(
                msg.path(msg.PS_SERVICE, msg.PULL_RAW),
                request_serializer=None,
                response_deserializer=lambda d: np.frombuffer(d, dtype=np.uint8))
            self._push = channel.unary_unary(
                msg.path(msg.PS_SERVICE, msg.PUSH_RAW),
                # argrpc takes any buffer (grpc's stubs say bytes)
                request_serializer=lambda a: to_wire(  # type: ignore[arg-type,return-value]
                    a.view(np.uint8)),
                response_deserializer=parse_raw_ack)
            self._pull_reqs = [_ID.pack(i) for i in range(len(sizes))]
            self._md = [((msg.VAR_ID_KEY, str(i)),) for i in range(len(sizes))]

    def step(self) -> None:
        pulls = [self._pull.future(r, timeout=CALL_TIMEOUT_S) for r in self._pull_reqs]
        pulled = [f.result() for f in pulls]  # the forward pass needs every variable
        for i, got in enumerate(pulled):
            n = len(got.data) if self.mode == "serialized" else got.nbytes
            if n != self.sizes[i]:
                raise RuntimeError(f"pulled {n} B for variable {i}, expected {self.sizes[i]}")
        if self.mode == "serialized":
            pushes = [self._push.future(msg.Tensor(id=i, data=g.tobytes()),
                                        timeout=CALL_TIMEOUT_S)
                      for i, g in enumerate(self.grads)]
            acks = [f.result().size for f in pushes]
        else:
            pushes = [self._push.future(g, timeout=CALL_TIMEOUT_S, metadata=md)
                      for g, md in zip(self.grads, self._md)]
            acks = [f.result()[0] for f in pushes]
        if acks != self.sizes:
            raise RuntimeError("the PS acknowledged different gradient sizes")
        del pulled  # end of step: the pulled tensors are released


def run_worker(args: argparse.Namespace, control: StdinControl) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False, "pid": os.getpid(), "env": tf_rdma_env(),
                              "benchmark": "ps", "transport": None}
    channel = make_channel(args.stack, args.target)
    try:
        info = fetch_env(channel, msg.PS_SERVICE, msg.PS_INFO)
        result["server_env"], result["server_pid"] = info["env"], info["pid"]
        result["transport"] = check_transport(channel, args.transport)
        worker = Worker(channel, args.stack, args.mode, [int(s) for s in info["sizes"]])
        result.update(variables=len(worker.sizes), bytes_per_step=worker.bytes_per_step,
                      rpcs_per_step=worker.rpcs_per_step)
        for _ in range(max(1, args.warmup)):
            worker.step()
        phases = []
        samples: list[int] = []
        for _ in range(args.repeats):
            gc.collect()  # before READY: not inside the other workers' timed windows
            control.wait_go()
            gc.disable()
            try:
                steps = 0
                start_ns = time.monotonic_ns()
                deadline = (None if args.duration is None
                            else start_ns + int(args.duration / args.repeats * 1e9))
                while True:
                    t0 = time.perf_counter_ns()
                    worker.step()
                    samples.append(time.perf_counter_ns() - t0)
                    steps += 1
                    if args.iterations is not None:
                        if steps >= args.iterations:
                            break
                    elif time.monotonic_ns() >= deadline:  # type: ignore[operator]
                        break
                end_ns = time.monotonic_ns()
            finally:
                gc.enable()
            phases.append({"steps": steps, "start_ns": start_ns, "end_ns": end_ns})
        check_transport(channel, args.transport)
        result.update(ok=True, phases=phases, step_ns=samples, **stats_us(samples))
    finally:
        channel.close()
    return result


# ---------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m argrpc_bench.ps")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    s.add_argument("--scheme", default="skew")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--model-bytes", type=int, default=None,
                   help="scale the model's variables to this total (count and mix kept)")
    s.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    w = sub.add_parser("worker")
    w.add_argument("--target", required=True)
    w.add_argument("--stack", choices=("grpc", "argrpc"), required=True)
    w.add_argument("--transport", choices=TRANSPORTS, required=True)
    w.add_argument("--mode", choices=("raw", "serialized"), default="raw")
    w.add_argument("--warmup", type=int, default=1)
    w.add_argument("--iterations", type=int)
    w.add_argument("--duration", type=float)
    w.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    if args.role == "worker" and (args.iterations is None) == (args.duration is None):
        p.error("give exactly one of --iterations and --duration")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "serve":
        return run_ps(args)
    control = StdinControl()
    return emit_outcome(lambda: run_worker(args, control))


if __name__ == "__main__":
    sys.exit(main())
