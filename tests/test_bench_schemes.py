"""argrpc_bench.schemes / models: payload sizes are right, exact and seeded."""
from __future__ import annotations

import numpy as np
import pytest

from argrpc_bench import SCHEMES
from argrpc_bench.models import resnet50_param_counts, resnet50_shapes, \
    resnet50_variable_bytes
from argrpc_bench.schemes import RANDOM_RANGE, buffer_sizes, make_buffers, \
    model_variables, scale_to_total

MiB = 1 << 20


# --------------------------------------------------------------------------- models

def test_resnet50_matches_the_published_model() -> None:
    counts = resnet50_param_counts()
    # torchvision resnet50: 161 trainable tensors, 25,557,032 parameters ("25.6M")
    assert len(counts) == 161
    assert sum(counts) == 25_557_032
    assert sum(resnet50_variable_bytes()) == 25_557_032 * 4
    shapes = dict(resnet50_shapes())
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["fc.weight"] == (1000, 2048)
    assert shapes["layer4.0.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["layer3.0.downsample.0.weight"] == (1024, 512, 1, 1)
    assert sum(1 for n in shapes if n.endswith("downsample.0.weight")) == 4


def test_resnet50_is_skewed() -> None:
    b = sorted(resnet50_variable_bytes())
    small = sum(1 for x in b if x <= 8192)          # BN vectors, fc bias
    assert small > len(b) / 2                        # many small tensors ...
    assert sum(b[-10:]) > 0.3 * sum(b)               # ... and a few carry much of the bytes
    assert b[-1] == 512 * 512 * 9 * 4


# --------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("total,buffers", [
    (0, 1), (1, 1), (3, 8), (64, 1), (64, 7), (4 * MiB, 1), (4 * MiB, 16),
    (64 * MiB, 161), (64 * MiB + 13, 33), (1000, 1000), (12345, 500)])
def test_len_sum_nonnegative(scheme: str, total: int, buffers: int) -> None:
    sizes = buffer_sizes(scheme, total, buffers, seed=7)
    assert len(sizes) == buffers
    assert sum(sizes) == total
    assert all(isinstance(s, int) and s >= 0 for s in sizes)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_seeded_deterministic(scheme: str) -> None:
    a = buffer_sizes(scheme, 16 * MiB, 24, seed=3)
    assert a == buffer_sizes(scheme, 16 * MiB, 24, seed=3)
    if scheme != "uniform":
        assert a != buffer_sizes(scheme, 16 * MiB, 24, seed=4)


def test_uniform_is_an_equal_split() -> None:
    assert buffer_sizes("uniform", 64, 4, seed=0) == [16, 16, 16, 16]
    assert buffer_sizes("uniform", 10, 4, seed=9) == [3, 3, 2, 2]


def test_random_stays_in_its_range() -> None:
    sizes = buffer_sizes("random", 64 * MiB, 200, seed=1)
    lo, hi = RANDOM_RANGE
    mean = 64 * MiB / 200
    scale = mean / ((lo + hi) / 2)          # expected bytes per unit weight, roughly
    assert min(sizes) >= 0.5 * lo * scale
    assert max(sizes) <= 1.5 * hi * scale
    assert max(sizes) / min(sizes) > 4      # actually spread, not uniform
    assert len(set(sizes)) > 150


def test_skew_is_many_small_few_large() -> None:
    sizes = sorted(buffer_sizes("skew", 64 * MiB, 32, seed=0))
    assert sizes[-1] > 50 * sizes[0]
    median = sizes[len(sizes) // 2]
    assert sizes[-1] > 20 * median
    # 161 buffers: exactly ResNet-50's mix (scaled), as a multiset
    total = sum(resnet50_variable_bytes())
    assert sorted(buffer_sizes("skew", total, 161, seed=5)) == \
        sorted(resnet50_variable_bytes())


@pytest.mark.parametrize("bad", [("nope", 10, 1), ("uniform", -1, 1), ("skew", 10, 0)])
def test_bad_arguments(bad: tuple[str, int, int]) -> None:
    with pytest.raises(ValueError):
        buffer_sizes(*bad, seed=0)


def test_scale_to_total_is_exact() -> None:
    assert scale_to_total([1, 1, 1], 10) == [4, 3, 3]
    assert scale_to_total([0, 0], 5) == [3, 2]
    assert sum(scale_to_total([0.1, 7.3, 2.2, 1e-9], 999_999_937)) == 999_999_937


# --------------------------------------------------------------------------- PS variables

def test_model_variables_skew_is_resnet50() -> None:
    v = model_variables("skew", seed=0)
    assert v == resnet50_variable_bytes()
    assert len(v) == 161 and sum(v) == 102_228_128


@pytest.mark.parametrize("scheme", ["uniform", "random"])
def test_model_variables_other_schemes_keep_count_and_total(scheme: str) -> None:
    v = model_variables(scheme, seed=2)
    assert len(v) == 161 and sum(v) == 102_228_128
    assert v != resnet50_variable_bytes()
    assert v == model_variables(scheme, seed=2)
    if scheme == "uniform":
        assert max(v) - min(v) <= 1


# --------------------------------------------------------------------------- buffers

def test_make_buffers() -> None:
    sizes = [0, 1, 64, 4096, 100_000]
    a = make_buffers(sizes, seed=11)
    assert [x.nbytes for x in a] == sizes
    assert all(x.dtype == np.uint8 and x.ndim == 1 and x.flags.c_contiguous for x in a)
    b = make_buffers(sizes, seed=11)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = make_buffers(sizes, seed=12)
    assert not np.array_equal(a[-1], c[-1])
    assert len(np.unique(a[-1])) > 200          # not trivially compressible
