"""`--compile`: the trained models' training forward through torch.compile (trainlab/engine/compile.py).

A compiled run computes what the eager run computes (losses within float reordering: the same random draws, the same
data), repeats and resumes to the bit (deterministic kernels), and leaves evaluation, checkpoints and the recipes'
access to their models as they are. A missing toolchain is a one-line usage error before anything is built.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_compiler
from torch import nn

from trainlab.cli import main
from trainlab.engine.debug import debug_run_config, run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import TrainConfig, unwrap_model
from trainlab.recipes import get_recipe


def _debug_config(recipe: str, run_dir: Path, **kw: Any) -> TrainConfig:
    recipe_cls = get_recipe(recipe)
    cfg = debug_run_config(recipe_cls(recipe_cls.config_class()))
    return dataclasses.replace(cfg, run_dir=run_dir, tensorboard=False, progress=False, **kw)


@needs_compiler
@pytest.mark.slow  # about a minute; the default suite compiles toy below and in the DDP tests
def test_compiled_var_equals_eager_within_rounding_and_resumes_to_the_bit(tmp_path: Path) -> None:
    var = get_recipe("var")
    eager = Trainer(var(_debug_config("var", tmp_path / "eager"))).fit().losses

    straight = Trainer(var(_debug_config("var", tmp_path / "straight", compile=True)))
    assert unwrap_model(straight.wrapped["var"]) is straight.parts.models["var"]
    assert straight.wrapped["var"] is not straight.parts.models["var"]  # the training forward is the compiled one
    compiled = straight.fit().losses

    first = Trainer(var(_debug_config("var", tmp_path / "split", compile=True)))
    half = first.fit(stop_at_step=len(compiled) // 2).losses
    second = Trainer(var(_debug_config("var", tmp_path / "split", compile=True, resume="auto")))
    resumed = half + second.fit().losses

    assert len(eager) == len(compiled) == len(resumed) >= 8
    assert resumed == compiled  # deterministic kernels: a resumed compiled run repeats the straight one exactly
    final_straight, final_resumed = straight.parts.models["var"].state_dict(), second.parts.models["var"].state_dict()
    assert all(torch.equal(final_straight[k], final_resumed[k]) for k in final_straight)
    worst = max(abs(c - e) / abs(e) for c, e in zip(compiled, eager))
    assert worst < 1e-4, f"compiled losses drift from eager by {worst:.2e} (relative): more than float reordering"
    assert all(math.isfinite(x) for x in compiled)


def test_unwrap_model_reaches_the_model_under_compile() -> None:
    model = nn.Linear(3, 2)
    compiled = torch.compile(model)  # lazily compiled: nothing is built until a call
    assert unwrap_model(compiled) is model
    assert unwrap_model(model) is model


def test_missing_cpp_compiler_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    code = main(["train", "toy", "--compile", "true", "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "C++ compiler" in err and "drop --compile" in err, err
    assert not (tmp_path / "run" / "ckpt").exists()


@needs_compiler
@pytest.mark.parametrize(
    "recipe",
    ["toy", *(pytest.param(name, marks=pytest.mark.slow) for name in ("cifar", "moco", "tokenizer", "linear-probe"))],
)
def test_every_recipe_debug_check_passes_compiled(recipe: str, tmp_path: Path) -> None:
    """`trainlab train RECIPE --debug --compile`: straight vs stopped, saved, reloaded and finished, bit for bit."""
    recipe_cls = get_recipe(recipe)
    report = run_debug_check(
        recipe_cls, recipe_cls(recipe_cls.config_class(compile=True, progress=False)), tmp_path / "debug"
    )
    assert report.passed, report.line()
