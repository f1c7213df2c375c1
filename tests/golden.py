"""Golden runs: every recipe's debug variant trained with a fixed seed, compared with stored per-step losses.

Two tiers, because a CPU's float results are its own: AVX2 and AVX-512 kernels, MKL's code paths and oneDNN's
blocking sum in other orders, so two CPUs part after a few fp32 steps (VQ assignments flip, a GAN's curves diverge).

* **Reference (portable, every machine).** Each fp32 case is also run in the `fp64` precision mode (weights, data
  and augmentation in float64) and compared with `assets/golden_reference.json` to a relative tolerance
  `REFERENCE_RTOL`. Across kernel sets an fp64 run moves by at most 4e-10 over its ~50 steps (the GAN; 1e-13 or
  less for the other cases; measured: AVX2 vs the baseline kernels with MKL's compatible path and oneDNN capped at
  SSE4.1), while a real change moves it by 4e-5 or more (the probes in `test_golden_probes.py`: the learning rate
  x (1 + 1e-4), one more warm-up step, another dropout draw, a codebook restart one step later). Values that pass
  near zero, and weights whose true value is zero (pure rounding noise), are measured against the size of their
  quantity over the run. On the machine that recorded the file the comparison is bit for bit.
* **Native (exact, the recording machine).** The cases in their own precision (fp32, bf16-amp) compared bit for bit
  with `assets/golden_native/<fingerprint>.json`, recorded on a machine with that fingerprint (CPU model and flags,
  the kernel set in effect, torch / NumPy versions). Elsewhere these tests skip and say why.

Runs use one thread, so reductions do not depend on the core count. Regenerate both tiers after an intended change
with `pytest tests/test_golden_losses.py --update-golden` and say in the commit why the numbers moved.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import with_fields

from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Recipe, TrainConfig
from trainlab.recipes import get_recipe

ASSETS = Path(__file__).parent / "assets"
REFERENCE = ASSETS / "golden_reference.json"
NATIVE_DIR = ASSETS / "golden_native"
REFERENCE_RTOL = 1e-7  # relative: kernel sets move fp64 runs by <= 4e-10, the smallest probe by 4e-5
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile")


@dataclass(frozen=True)
class Case:
    """One golden run: a recipe's debug config with some fields changed (about 50 optimizer steps)."""

    recipe: str
    base: dict[str, Any] = field(default_factory=dict)  # fields set before `debug_config()` (e.g. the model)
    overrides: dict[str, Any] = field(default_factory=dict)  # fields set after it; `optim.name`: a nested field

    @property
    def has_reference(self) -> bool:
        """fp32 cases also run in fp64 for the portable tier (a bf16-amp case has no fp64 counterpart)."""
        return self.overrides.get("precision", "fp32") == "fp32"

    def config(self, run_dir: Path, **changes: Any) -> TrainConfig:
        recipe_cls = get_recipe(self.recipe)
        cfg = recipe_cls(with_fields(recipe_cls.config_class(), self.base)).debug_config()
        changes = {"run_dir": run_dir, "tensorboard": False, "progress": False, **self.overrides, **changes}
        return with_fields(cfg, changes)


CASES: dict[str, Case] = {
    "toy": Case("toy", overrides={"epochs": 6, "dropout": 0.1}),
    "toy_accumulation_2": Case("toy", overrides={"epochs": 6, "grad_accumulation": 2, "batch_size": 16}),
    "toy_bf16_amp": Case("toy", overrides={"epochs": 6, "precision": "bf16-amp"}),
    "cifar_vgg_debug": Case("cifar", {"model": "cifar_vgg_debug"}, {"epochs": 6}),
    "cifar_resnet_debug": Case("cifar", {"model": "cifar_resnet_debug"}, {"epochs": 6}),
    "tokenizer": Case("tokenizer", overrides={"epochs": 8}),
    "tokenizer_ema": Case("tokenizer", overrides={"epochs": 8, "codebook_mode": "ema"}),
    "var": Case("var", overrides={"epochs": 12}),
    "var_progressive": Case("var", overrides={"epochs": 12, "progressive_until": 0.5, "label_smoothing": 0.1}),
    "moco_resnet_debug": Case("moco", overrides={"epochs": 6}),
    # AdamW at a tenth of LARS's base learning rate: at LARS's 0.6 the run does not learn and is chaotic (any 1e-16
    # difference doubles every step), which a golden run must not be
    "moco_vit_debug": Case(
        "moco",
        {"model": "moco_vit_small", "optim.name": "adamw", "stop_grad_conv1": True},
        {"epochs": 6, "optim.base_learning_rate": 0.06},
    ),
    "judge": Case("judge", overrides={"epochs": 6}),
}
REFERENCE_CASES = sorted(name for name, case in CASES.items() if case.has_reference)


# ------------------------------------------------------------------------------------------------ machine
def _cpu_info() -> dict[str, Any]:
    """Model name, vendor, family/model and the SIMD flags that choose kernels (Linux /proc/cpuinfo)."""
    info: dict[str, Any] = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {**info, "model": platform.processor()}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {
        **info,
        "model": fields.get("model name", ""),
        "vendor": fields.get("vendor_id", ""),
        "family": fields.get("cpu family", ""),
        "model_number": fields.get("model", ""),
        "flags": [f for f in _CPU_FLAGS if f in flags],
    }


def machine_fingerprint() -> dict[str, Any]:
    """What decides a CPU run's float results: the CPU, the kernel set in effect and the library versions."""
    return {
        "cpu": _cpu_info(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_env": {name: os.environ[name] for name in KERNEL_ENV if name in os.environ},
        "torch": torch.__version__,
        "numpy": np.__version__,
    }


def fingerprint_id(fingerprint: dict[str, Any] | None = None) -> str:
    text = json.dumps(fingerprint or machine_fingerprint(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def native_path(fingerprint: dict[str, Any] | None = None) -> Path:
    return NATIVE_DIR / f"{fingerprint_id(fingerprint)}.json"


# ------------------------------------------------------------------------------------------------ running
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


def weights_moments(models: dict[str, torch.nn.Module]) -> dict[str, str]:
    """Per model and floating state tensor: the sums of |w| and of w^2 in float64 (hex), for the tolerance
    comparison that a hash cannot give (sums of magnitudes: no cancellation makes a tiny total fragile)."""
    out = {}
    for name, model in models.items():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                t = tensor.detach().cpu().double()
                out[f"{name}.{key}:abs"] = _hex(float(t.abs().sum()))
                out[f"{name}.{key}:sq"] = _hex(float(t.square().sum()))
    return out


def run_case(
    name: str,
    run_dir: Path,
    *,
    precision: str | None = None,
    perturb: Callable[[Trainer], None] | None = None,
    **changes: Any,
) -> dict[str, Any]:
    """Train case `name` from scratch (in `precision` if given) and return its losses, evaluation metrics and
    weights. `perturb(trainer)` runs after set-up, before training; `changes` override config fields."""
    if precision is not None:
        changes["precision"] = precision
    cfg = CASES[name].config(run_dir, **changes)
    recipe: Recipe[Any] = get_recipe(CASES[name].recipe)(cfg)
    with _one_thread():
        trainer = Trainer(recipe)
        if perturb is not None:
            perturb(trainer)
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
    return {
        "steps": [row["step"] for row in rows if row["kind"] == "train"],
        "losses": losses,
        "eval": evals,
        "weights_sha256": weights_sha256(trainer.parts.models),
        "weights_moments": weights_moments(trainer.parts.models),
    }


# ------------------------------------------------------------------------------------------------ comparing
def _float(value: str) -> float:
    try:
        return float.fromhex(value)
    except ValueError:
        return math.nan


def _close(a: str, b: str, rtol: float, scale: float = 0.0) -> bool:
    """Equal, or within `rtol` of the larger magnitude; values near zero are compared against `scale` (the size of
    the quantity over the run), so a loss passing close to 0 is not held to a relative bound of a tiny number."""
    if a == b:
        return True
    x, y = _float(a), _float(b)
    return math.isfinite(x) and math.isfinite(y) and abs(x - y) <= rtol * max(abs(x), abs(y), scale)


def _scale(values: list[str]) -> float:
    """A thousandth of the largest magnitude in `values`: the floor below which differences count as absolute."""
    finite = [abs(v) for v in map(_float, values) if math.isfinite(v)]
    return 1e-3 * max(finite, default=0.0)


def differences(got: dict[str, Any], want: dict[str, Any], rtol: float = 0.0) -> list[str]:
    """How `got` departs from `want`: [] when every step, loss, evaluation metric and weight moment agrees to the
    relative tolerance `rtol` (0: bit for bit, weight hashes included)."""
    problems: list[str] = []
    if got["steps"] != want["steps"]:
        return [f"logged steps differ: {got['steps'][:5]}... vs {want['steps'][:5]}..."]
    for key in sorted(set(want["losses"]) | set(got["losses"])):
        have, expected = got["losses"].get(key, []), want["losses"].get(key, [])
        if len(have) != len(expected):
            problems.append(f"{key}: {len(have)} logged values vs {len(expected)}")
            continue
        scale = _scale(expected)
        for i, (a, b) in enumerate(zip(have, expected)):
            if not _close(a, b, rtol, scale):
                x, y = float.fromhex(a), float.fromhex(b)
                rel = abs(x - y) / max(abs(x), abs(y), 1e-300)
                problems.append(f"{key} differs first at step {got['steps'][i]}: {x!r} vs {y!r} (relative {rel:.1e})")
                break
    if len(got["eval"]) != len(want["eval"]):
        problems.append(f"{len(got['eval'])} evaluations vs {len(want['eval'])}")
    keys = sorted({k for row in [*got["eval"], *want["eval"]] for k in row})
    scales = {k: _scale([row.get(k, "") for row in want["eval"]]) for k in keys}
    for have_row, want_row in zip(got["eval"], want["eval"]):
        bad = [k for k in keys if not _close(have_row.get(k, ""), want_row.get(k, ""), rtol, scales[k])]
        if bad:
            problems.append(f"evaluation at step {float.fromhex(want_row['step']):g} differs in {', '.join(bad)}")
            break
    # a tensor whose true value is zero (a running mean after a centring layer, a bias with no gradient) holds
    # rounding noise: it is measured against the larger tensors of its model (same moment kind)
    moments, expected_moments = got["weights_moments"], want["weights_moments"]
    groups: dict[str, list[str]] = {}
    for key, value in expected_moments.items():
        groups.setdefault(_moment_group(key), []).append(value)
    scales = {group: _scale(values) for group, values in groups.items()}
    bad = [
        k
        for k in sorted(set(moments) | set(expected_moments))
        if not _close(moments.get(k, ""), expected_moments.get(k, ""), rtol, scales.get(_moment_group(k), 0.0))
    ]
    if bad:
        problems.append(f"final weights differ ({len(bad)} moments, first {bad[0]})")
    if rtol == 0.0 and got["weights_sha256"] != want["weights_sha256"]:
        problems.append("final weights differ (SHA-256)")
    return problems


def _moment_group(key: str) -> str:
    """'vqvae.decoder.conv.weight:sq' -> 'vqvae:sq'."""
    return key.split(".", 1)[0] + ":" + key.rsplit(":", 1)[-1]


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
