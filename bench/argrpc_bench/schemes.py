"""Payload schemes: how a message's bytes are split into buffers (iovecs).

TF-gRPC-Bench builds each payload from several buffers whose sizes follow one of three
distributions; these functions produce those sizes, deterministically from a seed, so
every transport in a run (and every rerun with the same seed) sees identical payloads.

* ``uniform``: all buffers the same size.
* ``random``: sizes drawn uniformly from a range (``RANDOM_RANGE``, relative weights),
  then scaled to the total.
* ``skew``: the shape of a real DL model, ResNet-50's float32 variables (see
  ``models.py``): many small BatchNorm/bias tensors and a few multi-MiB convolutions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from argrpc_bench import SCHEMES
from argrpc_bench.models import resnet50_variable_bytes

if TYPE_CHECKING:  # numpy is a runtime dependency anyway; this keeps the hint cheap
    import numpy.typing as npt

# Relative weights for ``random``: the largest buffer is at most 16x the smallest
# (before integer rounding), wide enough to differ clearly from ``uniform``.
RANDOM_RANGE = (1.0, 16.0)


def _check(scheme: str, total: int, buffers: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if buffers < 1:
        raise ValueError(f"buffers must be >= 1, got {buffers}")


def scale_to_total(weights: Sequence[float], total: int) -> list[int]:
    """Integer sizes proportional to ``weights`` that sum to exactly ``total``.

    Largest-remainder rounding: floors first, then the leftover bytes go one each to the
    entries with the largest fractional parts (ties by position), so the result is
    deterministic and never off by a byte.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0:
        raise ValueError("no weights")
    if np.any(w < 0) or not np.isfinite(w).all():
        raise ValueError("weights must be finite and >= 0")
    s = float(w.sum())
    if s == 0.0:
        w = np.ones_like(w)
        s = float(w.size)
    exact = w * (total / s)
    base = np.floor(exact).astype(np.int64)
    short = int(total - int(base.sum()))
    if short > 0:
        # stable sort on -fraction: ties keep index order
        order = np.argsort(-(exact - base), kind="stable")[:short]
        base[order] += 1
    return [int(x) for x in base]


def _skew_weights(buffers: int, seed: int) -> list[float]:
    """``buffers`` sizes with ResNet-50's size distribution.

    With 161 buffers this is exactly the model. Otherwise the model's sizes are sampled at
    evenly spaced quantiles of their sorted order, so 4 buffers still span small to large
    instead of (likely) four BatchNorm vectors; the seed then shuffles the order.
    """
    model = sorted(resnet50_variable_bytes())
    n = len(model)
    if buffers == n:
        picked = list(model)
    else:
        idx = [min(n - 1, int((i + 0.5) * n / buffers)) for i in range(buffers)]
        picked = [model[i] for i in idx]
    rng = np.random.default_rng(seed)
    rng.shuffle(picked)
    return [float(x) for x in picked]


def buffer_sizes(scheme: str, total: int, buffers: int, seed: int) -> list[int]:
    """Byte size of each of ``buffers`` buffers making up a ``total``-byte message.

    Always ``len == buffers``, ``sum == total``, every entry ``>= 0`` (entries can be 0
    when ``total < buffers``). Same arguments, same result.
    """
    _check(scheme, total, buffers)
    if scheme == "uniform":
        q, r = divmod(total, buffers)
        return [q + 1 if i < r else q for i in range(buffers)]
    if scheme == "random":
        rng = np.random.default_rng(seed)
        lo, hi = RANDOM_RANGE
        return scale_to_total(rng.uniform(lo, hi, size=buffers).tolist(), total)
    return scale_to_total(_skew_weights(buffers, seed), total)


def model_variables(scheme: str, seed: int) -> list[int]:
    """Byte sizes of the variables the parameter server holds.

    ``skew`` is ResNet-50 itself (161 float32 tensors, 25,557,032 parameters, 102,228,128
    bytes, in model order). ``uniform`` and ``random`` keep the count and the total so PS
    runs differ only in the shape of the mix.
    """
    model = resnet50_variable_bytes()
    if scheme == "skew":
        _check(scheme, sum(model), len(model))
        return list(model)
    return buffer_sizes(scheme, sum(model), len(model), seed)


def make_buffers(sizes: list[int], seed: int) -> list["npt.NDArray[np.uint8]"]:
    """One uint8 array per size, filled with seeded pseudo-random bytes.

    Random rather than zeros so nothing on the path (compression, page sharing) can
    benefit from trivially compressible data; deterministic so runs are comparable.
    """
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        if n < 0:
            raise ValueError(f"negative buffer size {n}")
        out.append(rng.integers(0, 256, size=n, dtype=np.uint8))
    return out
