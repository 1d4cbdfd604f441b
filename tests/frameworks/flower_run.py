"""One process of a Flower federation (flwr's own server and clients, its gRPC transport),
with grpc's factories swapped for argrpc's or left alone:

    python -m tests.frameworks.flower_run server STACK PORT ROUNDS MIB
    python -m tests.frameworks.flower_run client STACK PORT SEED MIB

The server trains ROUNDS rounds of FedAvg with two clients over a model of MIB MiB of
float32 weights and prints one JSON line: the aggregated weights' digest after each round,
the distributed losses and metrics, the time the rounds took. A client's update is
deterministic (its seed), so both stacks must print the same digests."""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from typing import Any

import grpc
import numpy as np


def swap(stack: str) -> None:
    """The documented swap: grpc's factories replaced before Flower makes its server and
    channels (it calls them through the grpc module)."""
    if stack == "argrpc":
        import argrpc

        grpc.server = argrpc.server  # type: ignore[assignment]
        grpc.insecure_channel = argrpc.insecure_channel  # type: ignore[assignment]
        logging.getLogger("argrpc").setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("argrpc-log %(message)s"))
        logging.getLogger("argrpc").addHandler(handler)


def model(mib: int) -> list[np.ndarray]:
    n = mib * (1 << 20) // 4
    return [np.zeros(n // 2, np.float32), np.zeros(n - n // 2, np.float32).reshape(-1, 4)]


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def serve(port: int, rounds: int, mib: int) -> None:
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.server.app import start_server
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg

    digests: list[str] = []

    class Recorded(FedAvg):  # type: ignore[misc]
        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
            params, metrics = super().aggregate_fit(server_round, results, failures)
            if failures:
                raise RuntimeError(f"round {server_round}: {failures}")
            digests.append(digest(parameters_to_ndarrays(params)))
            return params, metrics

    strategy = Recorded(min_fit_clients=2, min_evaluate_clients=2, min_available_clients=2,
                        fraction_fit=1.0, fraction_evaluate=1.0,
                        initial_parameters=ndarrays_to_parameters(model(mib)),
                        fit_metrics_aggregation_fn=lambda m: {"sum": sum(x["sum"] for _, x in m)},
                        evaluate_metrics_aggregation_fn=lambda m: {"n": len(m)})
    start = time.monotonic()
    history = start_server(server_address=f"127.0.0.1:{port}",
                           config=ServerConfig(num_rounds=rounds), strategy=strategy)
    took = time.monotonic() - start
    print(json.dumps({"digests": digests, "losses": history.losses_distributed,
                      "fit_metrics": history.metrics_distributed_fit,
                      "eval_metrics": history.metrics_distributed, "seconds": took}),
          flush=True)


def join(port: int, seed: int, mib: int) -> None:
    from flwr.compat.client.app import start_client
    from flwr.compat.client.numpy_client import NumPyClient

    class Member(NumPyClient):  # type: ignore[misc]
        def get_parameters(self, config: Any) -> list[np.ndarray]:
            return model(mib)

        def fit(self, parameters: list[np.ndarray], config: Any) -> Any:
            step = np.float32(seed + 1)
            updated = [p + step for p in parameters]
            return updated, 10 * (seed + 1), {"sum": float(sum(float(u.sum()) for u in updated))}

        def evaluate(self, parameters: list[np.ndarray], config: Any) -> Any:
            loss = float(np.mean([float(p.mean()) for p in parameters]))
            return loss, 10 * (seed + 1), {"seed": seed}

    start_client(server_address=f"127.0.0.1:{port}", client=Member().to_client(),
                 insecure=True)


def main() -> None:
    role, stack, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    swap(stack)
    if role == "server":
        serve(port, int(sys.argv[4]), int(sys.argv[5]))
    else:
        join(port, int(sys.argv[4]), int(sys.argv[5]))


if __name__ == "__main__":
    main()
