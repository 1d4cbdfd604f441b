"""Variable shapes of real models, used by the ``skew`` scheme and the PS benchmark.

ResNet-50 is the model TF-gRPC-Bench and most PS studies use. Its layout is from
He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016, arXiv:1512.03385),
Table 1 (50-layer column: bottleneck stages of 3, 4, 6, 3 blocks, widths 64..512,
expansion 4), with the trainable tensors exactly as torchvision enumerates them in
``torchvision/models/resnet.py`` (``resnet50()``: ``model.named_parameters()``):
bias-free convolutions, one BatchNorm (gamma, beta) after each convolution, one
projection shortcut (1x1 conv + BN) at the start of each stage, and a 2048 -> 1000 fully
connected layer with bias. That gives 161 tensors and 25,557,032 parameters
(torchvision documents "25.6M"). BatchNorm running statistics are not trainable and not
pushed as gradients, so they are left out, as a parameter server would.
"""
from __future__ import annotations

import math
from functools import lru_cache

FLOAT32_BYTES = 4

# (blocks, bottleneck width) per stage: He et al. 2016, Table 1, "50-layer".
_RESNET50_STAGES: tuple[tuple[int, int], ...] = ((3, 64), (4, 128), (6, 256), (3, 512))
_EXPANSION = 4
_NUM_CLASSES = 1000


@lru_cache(maxsize=None)
def resnet50_shapes() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every trainable ResNet-50 tensor, in torchvision's order.

    Conv weights are (out, in, kh, kw) as in PyTorch; only the element count matters here.
    """
    out: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(prefix: str, bn: str, cin: int, cout: int, k: int) -> None:
        out.append((f"{prefix}.weight", (cout, cin, k, k)))
        out.append((f"{bn}.weight", (cout,)))
        out.append((f"{bn}.bias", (cout,)))

    conv_bn("conv1", "bn1", 3, 64, 7)
    cin = 64
    for stage, (blocks, width) in enumerate(_RESNET50_STAGES, start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            conv_bn(f"{p}.conv1", f"{p}.bn1", cin, width, 1)
            conv_bn(f"{p}.conv2", f"{p}.bn2", width, width, 3)
            conv_bn(f"{p}.conv3", f"{p}.bn3", width, width * _EXPANSION, 1)
            if b == 0:  # projection shortcut: channel count (and stride) change
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", cin, width * _EXPANSION, 1)
            cin = width * _EXPANSION
    out.append(("fc.weight", (_NUM_CLASSES, cin)))
    out.append(("fc.bias", (_NUM_CLASSES,)))
    return tuple(out)


def resnet50_param_counts() -> list[int]:
    """Element count of each trainable tensor (161 entries, sum 25,557,032)."""
    return [math.prod(shape) for _, shape in resnet50_shapes()]


def resnet50_variable_bytes() -> list[int]:
    """Byte size of each tensor as float32: what a PS holds and a worker pulls/pushes."""
    return [n * FLOAT32_BYTES for n in resnet50_param_counts()]
