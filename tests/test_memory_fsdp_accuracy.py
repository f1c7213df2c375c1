"""`trainlab plan --fsdp --device cpu` against the measured per-rank peak of a real 2-process gloo FSDP2 run.

The run (`fsdp_peak_worker.py`, under torchrun) is `trainlab train --fsdp`'s set-up and steps on the VAR debug
model (4 blocks); its rank 0 measures the peak of live tensor bytes as the planner's other
CPU tests do (`test_memory_accuracy.py`), with storage resizes seen. The plan is the traced one-process step at the
per-rank micro-batch with `memory.fsdp_memory`'s sharding applied.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.breakdown import breakdown
from trainlab.memory.fsdp_memory import FsdpPlanner, FsdpSettings
from trainlab.memory.trace import trace_training
from trainlab.recipes.var import VARRecipe

WORKER = Path(__file__).parent / "fsdp_peak_worker.py"


def _measured(python: str, env: dict[str, str], tmp_path: Path, overrides: dict[str, Any]) -> int:
    out = tmp_path / "peak.json"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    launched = subprocess.run(
        [*torchrun, "var", str(out), json.dumps(overrides)], env=env, capture_output=True, text=True, timeout=600
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    return int(json.loads(out.read_text())["peak_bytes"])


@pytest.mark.parametrize("reshard_after_forward", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_planned_rank_peak_matches_a_real_fsdp_run(
    reshard_after_forward: bool, tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    overrides: dict[str, Any] = {"run_dir": str(tmp_path / "run"), "depth": 4}
    config = dataclasses.replace(debug_run_config(VARRecipe(VARRecipe.config_class())), device="cpu", **overrides)
    recipe = VARRecipe(config)
    traced = breakdown(trace_training(recipe, device="cpu", micro_batch=config.batch_size // 2, grad_accumulation=1))
    settings = FsdpSettings(world=2, reshard_after_forward=reshard_after_forward)
    planned = FsdpPlanner(recipe, settings).memory(traced)
    measured = _measured(python, run_env, tmp_path, {**overrides, "fsdp_reshard_after_forward": reshard_after_forward})
    error = (planned.peak_bytes - measured) / measured
    print(f"reshard {reshard_after_forward}: planned {planned.peak_bytes} measured {measured} error {error:+.2%}")
    assert abs(error) <= 0.05, f"planned {planned.peak_bytes} B, measured {measured} B ({error:+.2%})"
    assert planned.peak_bytes < traced.peak_allocated_bytes  # sharding saves memory on this model
