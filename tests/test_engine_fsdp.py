"""`--fsdp` (engine/fsdp.py) in real gloo processes: a 2-process sharded run equals the 1-process run at the same
global batch (per-step losses and final weights within 1e-5 relative), its checkpoints (a folder of every rank's
shards: engine/sharded_checkpoint.py; also written in the background) resume in 2 processes to the bit and in 1 or 4
processes within float tolerance; in one process `--fsdp` changes nothing.

Weights are compared to 1e-5 of max(the tensor's largest magnitude, 1): AdamW's normalised update moves an entry with
a near-zero gradient (a bias trained up from 0 to ~1e-4) by ~lr whatever the gradient's size, so the order of a
float sum (a reduce-scatter against one process's backward) shows there at ~1e-6 absolute, not relative.

Runs go through `tests/fsdp_run.py` (a recipe's debug config with overrides, trained by the Trainer). The losses
compared are the logged ones (the mean over ranks of each rank's loss, per optimizer step)."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import subprocess
import time
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


def _train(python: str, env: dict[str, str], recipe: str, run_dir: Path, processes: int, **overrides: Any) -> str:
    """Train in `processes` processes; returns the log."""
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
    return done.stdout + done.stderr


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
    checkpoint (each rank's shards in one folder, written in the background: --async-checkpoint) reads back whole and
    resumes in 1 process to the same end (12 steps)."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train(python, run_env, "toy", one, 1, **TOY)
    log = _train(python, run_env, "toy", two, 2, **TOY, async_checkpoint=True, stop_at_step=5)
    assert "fsdp: model sharded over 2 processes: as one unit" in log
    assert "parameters resharded after forward: yes; CPU offload: no" in log
    _assert_close(_losses(two), _losses(one)[:5])
    folder = two / "ckpt" / torch.load(two / "ckpt" / "last.pt", weights_only=True)["shards"]
    assert sorted(p.name for p in folder.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
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


@pytest.mark.slow
def test_var_checkpoint_of_one_process_resumes_sharded_in_two(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """1 -> 2: a checkpoint of an unsharded 1-process run continues sharded in 2 processes, equal within tolerance."""
    one, moved = tmp_path / "one", tmp_path / "moved"
    _train(python, run_env, "var", one, 1, **VAR)
    _train(python, run_env, "var", moved, 1, **{**VAR, "fsdp": False}, stop_at_step=10)
    _train(python, run_env, "var", moved, 2, **VAR)
    _assert_close(_losses(moved)[10:], _losses(one)[10:])
    _assert_weights_close(_weights(moved), _weights(one))


def _kill_all(launcher: subprocess.Popen[str]) -> None:
    """SIGKILL the torchrun parent and its workers at once (a machine lost), and wait for every one."""
    import psutil

    procs = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=60)
    launcher.wait()


@pytest.mark.slow
def test_chaos_under_fsdp_ends_with_the_uninterrupted_weights(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """A sharded 2-process toy run killed 4 times (every process SIGKILLed in the middle of a checkpoint write,
    or the torchrun parent SIGKILLed at a random time: its workers save and stop), relaunched each time: every
    checkpoint on disk loads after every kill, and the finished run equals an uninterrupted one bit for bit."""
    import psutil
    from test_engine_chaos import ARGS, _equal

    launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainlab"]
    args = [*ARGS, "--fsdp"]
    reference, run = tmp_path / "reference", tmp_path / "chaos"
    done = subprocess.run([*launch, *args, "--run-dir", str(reference)], env=run_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rng, ckpt, during_write = random.Random(3), run / "ckpt", 0
    for i in range(4):
        launcher = subprocess.Popen(
            [*launch, *args, "--run-dir", str(run)],
            env=run_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if i % 2 == 0:
            end = time.monotonic() + 60
            while (
                launcher.poll() is None and time.monotonic() < end and not (ckpt.is_dir() and any(ckpt.glob(".*.tmp")))
            ):
                time.sleep(0.0005)
            if launcher.poll() is None:
                during_write += 1
            _kill_all(launcher)
        else:
            time.sleep(rng.uniform(6.0, 10.0))  # start-up of torchrun and two workers takes ~5 s
            workers = psutil.Process(launcher.pid).children(recursive=True)
            launcher.kill()
            launcher.wait()
            psutil.wait_procs(workers, timeout=60)
        for path in sorted(ckpt.glob("*.pt")) if ckpt.is_dir() else []:
            load_checkpoint(path)
    assert during_write >= 1, "no kill landed inside a checkpoint write"
    final = subprocess.run([*launch, *args, "--run-dir", str(run)], env=run_env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-2000:]
    ours, ref = load_checkpoint(ckpt / "last.pt"), load_checkpoint(reference / "ckpt" / "last.pt")
    assert ours["step"] == ref["step"] == 36
    for key in ("models", "optimizers", "schedulers", "rng_per_rank", "best_score", "best_step", "recipe_state"):
        assert _equal(ours[key], ref[key]), key


@pytest.mark.slow
def test_toy_checkpoint_of_two_processes_resumes_sharded_in_four(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """2 -> 4: each of 4 ranks reads its new shards from the 2 ranks' folder; the data order continues (global batch
    16)."""
    one, moved = tmp_path / "one", tmp_path / "moved"
    _train(python, run_env, "toy", one, 1, **TOY)
    _train(python, run_env, "toy", moved, 2, **TOY, stop_at_step=5)
    _train(python, run_env, "toy", moved, 4, **TOY)
    _assert_close(_losses(moved), _losses(one))
    _assert_weights_close(_weights(moved), _weights(one))
