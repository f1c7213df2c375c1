"""`--fsdp` (engine/fsdp.py) in real gloo processes: a 2-process sharded run equals the 1-process run at the same
global batch (per-step losses and final weights within 1e-5 relative), its checkpoints hold whole tensors and resume
in 2 processes to the bit and in 1 process within float tolerance; in one process `--fsdp` changes nothing.

Weights are compared to 1e-5 of max(the tensor's largest magnitude, 1): AdamW's normalised update moves an entry with
a near-zero gradient (a bias trained up from 0 to ~1e-4) by ~lr whatever the gradient's size, so the order of a
float sum (a reduce-scatter against one process's backward) shows there at ~1e-6 absolute, not relative.

Runs go through `tests/fsdp_run.py` (a recipe's debug config with overrides, trained by the Trainer). The losses
compared are the logged ones (the mean over ranks of each rank's loss, per optimizer step)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

from trainlab.engine.checkpoint import load_checkpoint
from trainlab.engine.fsdp import describe_policy, fsdp_policy
from trainlab.engine.loop import Trainer
from trainlab.engine.precision import Precision
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig, ToyRecipe

RUN = str(REPO / "tests" / "fsdp_run.py")
TOLERANCE = 1e-5


def _train(python: str, env: dict[str, str], recipe: str, run_dir: Path, processes: int, **overrides: Any) -> None:
    launch = [python] if processes == 1 else [python, "-m", "torch.distributed.run", "--standalone"]
    launch += [] if processes == 1 else ["--nproc-per-node", str(processes)]
    done = subprocess.run(
        [*launch, RUN, recipe, str(run_dir), json.dumps(overrides)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if line["kind"] == "train"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(run_dir / "ckpt" / "last.pt")
    weights = {f"{m}.{k}": v for m, sd in state["models"].items() for k, v in sd.items()}
    weights.update({f"{m}.{k}": v for m, a in state["averaged"].items() for k, v in a["weights"].items()})
    return weights


def _assert_close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) > 0
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    assert worst < TOLERANCE, (worst, a, b)


def _assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], skip: str = "\0") -> None:
    assert a.keys() == b.keys()
    for key in a:
        if not a[key].is_floating_point() or skip in key:
            continue
        same = a[key] == b[key]  # equal infinities (VAR's attention mask) are no difference
        scale = max(float(b[key].nan_to_num(posinf=0.0, neginf=0.0).abs().max()), 1.0)
        assert float(torch.where(same, 0.0, a[key] - b[key]).abs().max()) <= TOLERANCE * scale, key


# ------------------------------------------------------------------------------------------------ in one process
def test_one_process_fsdp_is_a_logged_no_op(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def run(name: str, fsdp: bool) -> list[float]:
        config = ToyConfig(run_dir=tmp_path / name, num_samples=32, batch_size=16, tensorboard=False, fsdp=fsdp)
        return Trainer(ToyRecipe(config)).fit().losses

    plain = run("plain", False)
    with caplog.at_level(logging.INFO, logger="trainlab.engine.fsdp"):
        sharded = run("fsdp", True)
    assert sharded == plain
    assert "--fsdp in one process: nothing to shard" in caplog.text


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fsdp": True, "compile": True}, "--compile with --fsdp is not built yet"),
        ({"fsdp": True, "precision": "bf16"}, "--precision bf16 .* with --fsdp is not built yet"),
        ({"fsdp_cpu_offload": True}, "--fsdp-cpu-offload only applies with --fsdp"),
        ({"fsdp_reshard_after_forward": False}, "--fsdp-reshard-after-forward false only applies with --fsdp"),
    ],
)
def test_combinations_not_built_are_one_line(settings: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=message):
        ToyConfig(run_dir=tmp_path, **settings).validate()


def test_precision_modes_gather_and_reduce_in_the_weights_dtype() -> None:
    """Autocast casts the gathered fp32 weights per operation, as without --fsdp (VAR keeps fp32 islands)."""
    for mode in ("fp32", "bf16-amp", "fp16-amp-scale", "fp64"):
        assert describe_policy(fsdp_policy(Precision.parse(mode))) == (
            "parameters gathered in the weights' dtype, gradients reduced in the weights' dtype"
        )


# ------------------------------------------------------------------------------------------- 2 gloo processes
TOY = {"fsdp": True, "grad_accumulation": 2, "batch_size": 16, "epochs": 3, "clip_grad_norm": 0.5, "num_samples": 64}


def test_toy_two_processes_sharded_equal_one_process_and_resume_in_one(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """The toy model (root only) with accumulation 2 and clipping: 2 sharded processes equal 1 for 5 steps; their
    checkpoint holds whole tensors and resumes in 1 process to the same end (12 steps)."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(python, run_env, "toy", one, 1, **TOY)
    _train(python, run_env, "toy", two, 2, **TOY, stop_at_step=5)
    _assert_close(_losses(two), _losses(one)[:5])
    assert all(type(v) is torch.Tensor for v in _weights(two).values())
    _train(python, run_env, "toy", two, 1, **TOY)
    _assert_close(_losses(two), _losses(one))
    _assert_weights_close(_weights(two), _weights(one))


# ---------------------------------------------------------------- VAR and MoCo ViT debug models (slow: ~1 min each)
VAR = {
    "fsdp": True,
    "grad_accumulation": 2,
    "batch_size": 16,
    "epochs": 10,
    "max_steps": 20,
    "eval_every_epochs": 100,
    "cond_drop_rate": 0.0,  # class dropout draws from each rank's generator: another computation in 2 processes
    "model_ema_decay": 0.9,  # an averaged copy, sharded like its model
    "clip_grad_norm": 0.5,  # clipped by the global norm of the sharded gradients
}


@pytest.mark.slow
def test_var_two_processes_sharded_equal_one_process_and_resume(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """VAR debug (2 transformer blocks, each a unit), 20 steps, accumulation 2, with an EMA and clipping: 2 sharded
    processes equal 1. Stopped at step 10 and resumed: in 2 processes to the bit, in 1 within float tolerance."""
    one, two, again, alone = (tmp_path / name for name in ("one", "two", "again", "alone"))
    _train(python, run_env, "var", one, 1, **VAR)
    _train(python, run_env, "var", two, 2, **VAR)
    _assert_close(_losses(two), _losses(one))
    _assert_weights_close(_weights(two), _weights(one))
    _train(python, run_env, "var", again, 2, **VAR, stop_at_step=10)
    shutil.copytree(again, alone)
    _train(python, run_env, "var", again, 2, **VAR)
    assert _losses(again) == _losses(two)
    assert all(torch.equal(v, _weights(two)[k]) for k, v in _weights(again).items())
    _train(python, run_env, "var", alone, 1, **VAR)
    _assert_close(_losses(alone)[10:], _losses(two)[10:])
    _assert_weights_close(_weights(alone), _weights(two))


@pytest.mark.slow
def test_moco_vit_two_processes_sharded_equal_one_process(tmp_path: Path, python: str, run_env: dict[str, str]) -> None:
    """MoCo v3 ViT debug, 20 steps, 2 processes x accumulation 2 against 1 process x accumulation 4: the same
    micro-batches of 4 (the sampler cuts the global batch micro-step first), so that the projector's and predictor's
    BatchNorm normalise the same samples together. Parameters are compared; BatchNorm running statistics are each
    rank's own (as under DDP), so they are not. The momentum encoder (sharded like the base encoder, updated on the
    local shards) is a parameter of the model and compared."""
    moco: dict[str, Any] = {"base": {"model": "moco_vit_debug"}, **VAR, "grad_accumulation": 2}
    del moco["cond_drop_rate"], moco["model_ema_decay"]
    one, two = tmp_path / "one", tmp_path / "two"
    _train(python, run_env, "moco", one, 1, **{**moco, "grad_accumulation": 4})
    _train(python, run_env, "moco", two, 2, **moco)
    _assert_close(_losses(two), _losses(one))
    _assert_weights_close(_weights(two), _weights(one), skip="running_")
