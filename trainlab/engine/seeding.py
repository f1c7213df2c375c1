"""Seeding and RNG state capture: one seed fixes init, data order and augmentation; states resume to the bit."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from trainlab.data.loader_workers import ignore_stop_signals


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (e.g. base seed, epoch, sample index)."""
    state = np.random.SeedSequence([int(p) % 2**32 for p in parts]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & (2**63 - 1)


def worker_init_fn(worker_id: int) -> None:
    """Seed NumPy and `random` in a DataLoader worker from torch's per-worker seed (distinct per worker); the stop
    signals are the training process's (`data.loader_workers`)."""
    ignore_stop_signals(worker_id)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global RNG, in a form `torch.load(weights_only=True)` accepts (no NumPy arrays)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels (cuDNN, cuBLAS workspace config is the caller's env); benchmark mode off when on."""
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
