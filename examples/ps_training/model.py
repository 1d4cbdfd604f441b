"""The model, the data and the placement of variables: plain numpy, deterministic.

A multi-layer perceptron (ReLU hidden layers, softmax output) on scikit-learn's bundled
8x8 digits (1797 images shipped inside the package: no download). Every task derives the
same split, the same initial values and the same minibatches from the seed, so a
synchronous run computes the same numbers whatever transport carries them.
"""
from __future__ import annotations

import importlib.util
import os
import zlib
from dataclasses import dataclass

import numpy as np

TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])


def _digits_table() -> np.ndarray:
    """scikit-learn's bundled digits: 1797 rows of 64 pixels and the label.

    Read straight from the file the package ships: importing sklearn.datasets pulls in
    scipy, a second per task (and far more in an emulated guest) for one 500 KB table.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                            "digits.csv.gz")
        if os.path.exists(path):
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits as _load  # the file moved: ask sklearn

    data = _load()
    return np.column_stack([data.data, data.target])


def load_digits(seed: int) -> Dataset:
    table = _digits_table()
    x = (table[:, :-1] / 16.0).astype(np.float32)  # pixel intensities are 0..16
    y = table[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test])


def minibatch(data: Dataset, worker: int, workers: int, step: int, batch_size: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker `worker`'s batch for `step`: drawn from its own 1/workers of the training set."""
    shard = np.arange(worker, len(data.y_train), workers)
    rng = np.random.default_rng([seed, worker, step])
    pick = shard[rng.integers(0, len(shard), size=batch_size)]
    return data.x_train[pick], data.y_train[pick]


class MLP:
    def __init__(self, features: int, hidden: tuple[int, ...], classes: int = 10) -> None:
        self.sizes = (features, *hidden, classes)

    @property
    def layers(self) -> int:
        return len(self.sizes) - 1

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.layers):
            out[f"dense{i}/kernel"] = (self.sizes[i], self.sizes[i + 1])
            out[f"dense{i}/bias"] = (self.sizes[i + 1],)
        return out

    def initial_value(self, name: str, seed: int) -> np.ndarray:
        shape = self.shapes()[name]
        if name.endswith("/bias"):
            return np.zeros(shape, np.float32)
        # He initialisation, seeded by the name so each PS can create its shard alone.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        return (rng.standard_normal(shape) * np.sqrt(2.0 / shape[0])).astype(np.float32)

    def forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        acts = [x]
        h = x
        for i in range(self.layers):
            h = h @ params[f"dense{i}/kernel"] + params[f"dense{i}/bias"]
            if i < self.layers - 1:
                h = np.maximum(h, 0.0)
            acts.append(h)
        return h, acts

    def loss_and_grads(self, params: dict[str, np.ndarray], x: np.ndarray,
                       y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        logits, acts = self.forward(params, x)
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        delta = p
        delta[np.arange(n), y] -= 1.0
        delta /= n
        grads: dict[str, np.ndarray] = {}
        for i in reversed(range(self.layers)):
            grads[f"dense{i}/kernel"] = (acts[i].T @ delta).astype(np.float32)
            grads[f"dense{i}/bias"] = delta.sum(axis=0).astype(np.float32)
            if i > 0:
                delta = (delta @ params[f"dense{i}/kernel"].T) * (acts[i] > 0)
        return loss, grads

    def accuracy(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        logits, _ = self.forward(params, x)
        return float((logits.argmax(axis=1) == y).mean())


def place(shapes: dict[str, tuple[int, ...]], ps_tasks: int) -> dict[str, int]:
    """Variable -> PS index, greedily by bytes (TF's GreedyLoadBalancingStrategy).

    Round-robin placement would put every kernel of a 2-PS cluster on ps.0 and every bias
    on ps.1; balancing bytes keeps the PS links equally loaded.
    """
    load = [0] * ps_tasks
    placement: dict[str, int] = {}
    for name in sorted(shapes, key=lambda n: (-int(np.prod(shapes[n])), n)):
        target = min(range(ps_tasks), key=lambda i: (load[i], i))
        placement[name] = target
        load[target] += int(np.prod(shapes[name]))
    return placement


DIGITS_FEATURES = 64  # 8x8 images: what a PS needs to shape its variables without the data
