"""Model FLOPs utilisation (MFU) for time estimates: an assumption per recipe family until measured on that GPU.

step seconds = traced FLOPs per optimizer step / (the GPU's dense peak for the compute dtype x efficiency). The
ASSUMED values are documented guesses, not measurements; `trainlab plan RECIPE --measure` on a device stores the
efficiency it measured (keyed by the device's profile name and the recipe family) in the user's cache folder
(`$TRAINLAB_CACHE`, else `$XDG_CACHE_HOME/trainlab`, else `~/.cache/trainlab`), and later estimates for that GPU and
family use it and say so (`source == "measured"`). SHIPPED holds the efficiencies measured the same way for the
project (benchmarks/README.md sections 13d and 13f), the defaults for that GPU and family where the user measured none.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainlab.small_files import read_small_text

# Assumed MFU per recipe family, with the reasoning (no measurement behind these numbers):
ASSUMED: dict[str, float] = {
    # large transformer blocks (VAR d16+, ViT-B+): big GEMMs; published well-tuned bf16 training reaches 0.4-0.5,
    # a research codebase without fused kernels less.
    "transformer": 0.35,
    # small transformers (ViT-S, debug sizes): narrower GEMMs, more time in norms, softmax and optimizer steps.
    "small-transformer": 0.25,
    # ImageNet-size convnets (ResNet-50): convolutions plus BatchNorm / ReLU passes that are bandwidth-bound.
    "convnet": 0.25,
    # CIFAR-size convnets (32 px images): kernels too small to fill the GPU.
    "small-convnet": 0.10,
}
DEFAULT_FAMILY = "convnet"


# Measured with `trainlab plan RECIPE --measure` (the recipe's real step, traced FLOPs over the dense data-sheet peak)
# and shipped as the default for the GPUs of that chip (the H200 has the H100's compute: the same SMs and peaks, with
# more and faster memory) and that family: (GPU, family) -> (MFU, what was measured).
_VAR_D16_H100 = (
    0.122,
    "VAR-d16, fp16-amp-scale, micro-batch 96, re-encoding every batch; H100 80GB HBM3, torch 2.11, 2026-11-24",
)
_MOCO_VIT_S_H200 = (
    0.099,
    "MoCo v3 ViT-S, fp16-amp-scale, micro-batch 128, 224 px, batches from the loader; H200, torch 2.11, 2026-11-28",
)
_MOCO_R50_H200 = (
    0.056,
    "MoCo v3 ResNet-50, fp16-amp-scale, micro-batch 128, 224 px, batches from the loader; H200, torch 2.11, 2026-11-28",
)
_SAME_CHIP = " (the {} has the {}'s compute)"
SHIPPED: dict[tuple[str, str], tuple[float, str]] = {
    ("H100-80GB", "transformer"): _VAR_D16_H100,
    ("H200", "transformer"): (_VAR_D16_H100[0], _VAR_D16_H100[1] + _SAME_CHIP.format("H200", "H100")),
    ("H200", "small-transformer"): _MOCO_VIT_S_H200,
    ("H100-80GB", "small-transformer"): (_MOCO_VIT_S_H200[0], _MOCO_VIT_S_H200[1] + _SAME_CHIP.format("H100", "H200")),
    ("H200", "convnet"): _MOCO_R50_H200,
    ("H100-80GB", "convnet"): (_MOCO_R50_H200[0], _MOCO_R50_H200[1] + _SAME_CHIP.format("H100", "H200")),
}


@dataclass(frozen=True)
class Efficiency:
    """An efficiency and where it comes from: "assumed" (the table above) or "measured" (stored by --measure)."""

    value: float
    source: str
    family: str
    measured_on: str = ""  # a shipped measurement: what was measured, where and when


def cache_folder() -> Path:
    """The user's trainlab cache folder (not created here)."""
    if os.environ.get("TRAINLAB_CACHE"):
        return Path(os.environ["TRAINLAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainlab"


def _store_path() -> Path:
    return cache_folder() / "efficiency.json"


def _read_store() -> dict[str, dict[str, object]]:
    path = _store_path()
    try:
        stored = json.loads(read_small_text(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # an unreadable store is ignored: estimates fall back to the assumed values (said by source)
    return stored if isinstance(stored, dict) else {}


def _key(gpu: str, family: str) -> str:
    return f"{gpu}|{family}"


def efficiency_for(gpu: str, family: str) -> Efficiency:
    """The efficiency to use for `family` on the GPU profile named `gpu`: the user's measured one if stored, else the
    shipped measurement for that GPU and family, else the assumed one."""
    entry = _read_store().get(_key(gpu, family))
    if isinstance(entry, dict):
        value = entry.get("efficiency")
        if isinstance(value, (int, float)) and 0 < value <= 1:
            return Efficiency(float(value), "measured", family)
    if (gpu, family) in SHIPPED:
        value, what = SHIPPED[(gpu, family)]
        return Efficiency(value, "measured", family, measured_on=what)
    return Efficiency(ASSUMED.get(family, ASSUMED[DEFAULT_FAMILY]), "assumed", family)


def store_measured(gpu: str, family: str, value: float, details: dict[str, object]) -> Path:
    """Store a measured efficiency (atomically: a reader never sees half a file); returns the store's path."""
    if not 0 < value <= 1:
        raise ValueError(f"an efficiency is in (0, 1], got {value}")
    stored = _read_store()
    stored[_key(gpu, family)] = {"efficiency": value, **details}
    path = _store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(stored, handle, indent=1, sort_keys=True)
    os.replace(handle.name, path)
    return path
