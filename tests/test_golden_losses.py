"""Golden per-step losses: every recipe's debug variant, run with a fixed seed, reproduces its stored curve exactly.

The stored values (`tests/assets/golden_losses.json`) are the per-step training losses (every phase), the evaluation
metrics and a SHA-256 of the final weights. A refactor must reproduce them bit for bit. When behaviour changes on
purpose, regenerate them with

    pytest tests/test_golden_losses.py --update-golden

and say in the commit message why the numbers moved. Runs use one thread, so the reductions are the same on any
machine with the same CPU kernels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Recipe, TrainConfig
from trainlab.recipes import get_recipe

GOLDEN = Path(__file__).parent / "assets" / "golden_losses.json"


def _toy(**kw: Any) -> Callable[[Path], TrainConfig]:
    return lambda run_dir: _debug("toy", {}, run_dir, epochs=6, **kw)


def _debug(recipe: str, base: dict[str, Any], run_dir: Path, **kw: Any) -> TrainConfig:
    recipe_cls = get_recipe(recipe)
    cfg = recipe_cls(recipe_cls.config_class(**base)).debug_config()
    return dataclasses.replace(cfg, run_dir=run_dir, tensorboard=False, progress=False, **kw)


# name -> config builder; each run takes ~50 optimizer steps of a debug variant
CASES: dict[str, Callable[[Path], TrainConfig]] = {
    "toy": _toy(dropout=0.1),
    "toy_accumulation_2": _toy(grad_accumulation=2, batch_size=16),
    "toy_bf16_amp": _toy(precision="bf16-amp"),
    "cifar_vgg_debug": lambda d: _debug("cifar", {"model": "vgg_debug"}, d, epochs=6),
    "cifar_resnet_debug": lambda d: _debug("cifar", {"model": "resnet_debug"}, d, epochs=6),
    "tokenizer": lambda d: _debug("tokenizer", {}, d, epochs=8),
    "tokenizer_ema": lambda d: _debug("tokenizer", {}, d, epochs=8, codebook_mode="ema"),
    "var": lambda d: _debug("var", {}, d, epochs=12),
    "var_progressive": lambda d: _debug("var", {}, d, epochs=12, progressive_until=0.5, label_smoothing=0.1),
    "moco_resnet_debug": lambda d: _debug("moco", {}, d, epochs=6),
    "moco_vit_debug": lambda d: _debug(
        "moco", {"arch": "vit_small", "optimizer": "adamw", "stop_grad_conv1": True}, d, epochs=6
    ),
}


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _hex(value: Any) -> str:
    return float(value).hex() if isinstance(value, (int, float)) else str(value)


def weights_sha256(models: dict[str, torch.nn.Module]) -> dict[str, str]:
    """One SHA-256 per model over its state_dict (names, dtypes, shapes and raw bytes), in state_dict order."""
    out = {}
    for name, model in models.items():
        h = hashlib.sha256()
        for key, tensor in model.state_dict().items():
            t = tensor.detach().cpu().reshape(-1).contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


def run_case(name: str, run_dir: Path) -> dict[str, Any]:
    """Train case `name` from scratch and return its losses, evaluation metrics and weight hashes."""
    cfg = CASES[name](run_dir)
    recipe_cls = get_recipe(_recipe_of(name))
    recipe: Recipe = recipe_cls(cfg)
    with _one_thread():
        trainer = Trainer(recipe)
        trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses: dict[str, list[str]] = {}
    evals: list[dict[str, str]] = []
    for row in rows:
        if row["kind"] == "train":
            for key, value in row.items():
                if key == "loss" or key.endswith("/loss"):
                    losses.setdefault(key, []).append(_hex(value))
        elif row["kind"] == "eval":
            evals.append({k: _hex(v) for k, v in sorted(row.items()) if k not in ("kind",)})
    steps = [row["step"] for row in rows if row["kind"] == "train"]
    return {
        "steps": steps,
        "losses": losses,
        "eval": evals,
        "weights_sha256": weights_sha256(trainer.parts.models),
    }


def _recipe_of(case: str) -> str:
    return case.split("_")[0]


def _load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_losses(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    got = run_case(case, tmp_path / case)
    assert all(len(v) >= 40 for v in got["losses"].values()), "each golden curve should cover ~50 steps"
    if request.config.getoption("--update-golden"):
        golden = _load()
        golden[case] = got
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    golden = _load()
    assert case in golden, f"no golden values for {case!r}: run pytest {__file__} --update-golden"
    want = golden[case]
    assert got["steps"] == want["steps"]
    for key, values in want["losses"].items():
        have = got["losses"].get(key, [])
        for i, (a, b) in enumerate(zip(have, values)):
            step = got["steps"][i]
            assert a == b, f"{case} {key} differs first at step {step}: {float.fromhex(a)!r} vs {float.fromhex(b)!r}"
        assert len(have) == len(values)
    assert got["eval"] == want["eval"]
    assert got["weights_sha256"] == want["weights_sha256"]
    assert all(math.isfinite(float.fromhex(v)) for vals in got["losses"].values() for v in vals)
