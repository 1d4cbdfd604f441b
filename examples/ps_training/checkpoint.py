"""Checkpoints: ``ckpt-<global step>.npz`` (every variable by name, and ``global_step``)
plus a ``checkpoint`` file naming the newest, as TensorFlow's Saver lays them out.

The chief writes them; every task restores from the newest one when it starts with the
same ``--output_dir`` (the PS tasks their shard, the workers their step), so a cluster
started again continues where it stopped instead of from step 0.
"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

import numpy as np

STATE_FILE = "checkpoint"


class CheckpointError(ValueError):
    """The newest checkpoint cannot be used; the message names the file and why."""


def save(directory: str, params: dict[str, np.ndarray], step: int) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ckpt-{step}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, global_step=np.int64(step), **params)
    os.replace(tmp, path)  # a reader never sees half a checkpoint
    state = os.path.join(directory, STATE_FILE)
    with open(state + ".tmp", "w", encoding="utf-8") as f:
        f.write(f"latest: {os.path.basename(path)}\n")
    os.replace(state + ".tmp", state)
    return path


def latest(directory: Optional[str]) -> Optional[str]:
    """The newest checkpoint's path, or None when the directory has none."""
    if not directory:
        return None
    state = os.path.join(directory, STATE_FILE)
    try:
        with open(state, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    key, _, name = text.partition(":")
    if key.strip() != "latest" or not name.strip():
        raise CheckpointError(f"{state}: expected 'latest: ckpt-<step>.npz', found {text[:80]!r}")
    return os.path.join(directory, name.strip())


def load(path: str, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, np.ndarray], int]:
    """The variables named in `shapes` and the global step, checked against the model."""
    try:
        with np.load(path) as z:
            stored = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None
    if "global_step" not in stored:
        raise CheckpointError(f"{path}: no global_step")
    values = {}
    for name, shape in shapes.items():
        if name not in stored:
            raise CheckpointError(f"{path} has no variable {name} (a different model?)")
        value = stored[name]
        if value.shape != shape or value.dtype != np.float32:
            raise CheckpointError(f"{path}: {name} is {value.dtype}{list(value.shape)}, the model "
                                  f"needs float32{list(shape)} (--hidden differs from the run "
                                  "that wrote it?)")
        values[name] = value.copy()
    return values, int(stored["global_step"])
