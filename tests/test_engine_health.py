"""Training health: a dead ReLU layer is named once with its remedies, a healthy network is not; metrics are logged
every --health-every steps to metrics.jsonl and TensorBoard; observing never changes a golden run."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from golden import CASES, differences, load_json, native_path, run_case
from torch import nn

from trainlab.engine.health import HealthMonitor, parameter_blocks, relu_modules, sampled
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import Phase, StepInfo, TrainParts
from trainlab.models.registry import create_model
from trainlab.recipes.toy import ToyConfig, ToyRecipe

# Shape legend: B batch, D input features, H hidden units, K classes.


class ReluToyRecipe(ToyRecipe):
    """The toy MLP with two ReLU layers; `dead=True` gives the second a bias of -100: every unit is zero for every
    input (and, its gradient being zero, stays so)."""

    dead = False

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        model = nn.Sequential(
            nn.Linear(c.num_features, c.hidden),
            nn.ReLU(),
            nn.Linear(c.hidden, c.hidden),
            nn.ReLU(),
            nn.Linear(c.hidden, c.num_classes),
        ).to(device)
        if self.dead:
            with torch.no_grad():
                model[2].bias.fill_(-100.0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return TrainParts(models={"model": model}, phases=[Phase("main", optimizer, ["model"])])


class DeadReluToyRecipe(ReluToyRecipe):
    dead = True


def _config(tmp_path: Path, **changes: object) -> ToyConfig:
    base = ToyConfig(
        run_dir=tmp_path, num_samples=128, batch_size=16, epochs=2, health_every=2, tensorboard=False, progress=False
    )
    return dataclasses.replace(base, **changes)


def _health_rows(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "health"]


def _health_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "trainlab.engine.health" and r.levelno >= logging.WARNING
    ]


def test_a_dead_relu_layer_is_named_once_with_the_usual_remedies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    Trainer(DeadReluToyRecipe(_config(tmp_path))).fit()
    dead = [w for w in _health_warnings(caplog) if "model.3" in w]
    assert len(dead) == 1, _health_warnings(caplog)  # once per run, though every observed step sees it
    assert "100% of the units after model.3 are zero" in dead[0]
    assert "learning rate" in dead[0] and "initialisation" in dead[0] and "LeakyReLU" in dead[0]
    rows = _health_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(2, 17, 2))
    assert all(r["dead_fraction/model.3"] == 1.0 for r in rows)
    assert all(r["dead_fraction/model.1"] < 0.5 for r in rows)


def test_a_healthy_relu_network_gives_no_health_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    Trainer(ReluToyRecipe(_config(tmp_path))).fit()
    assert _health_warnings(caplog) == []
    row = _health_rows(tmp_path)[3]  # step 8 (the cosine schedule ends at a learning rate of 0: no update)
    assert row["step"] == 8 and row["dead_fraction/model.1"] < 0.5 and row["dead_fraction/model.3"] < 0.5
    for block in ("model.0", "model.2", "model.4"):
        assert row[f"grad_norm/{block}"] > 0
        assert 1e-6 < row[f"update_ratio/{block}"] < 0.1
    assert row["health_seconds"] > 0 and 0 < row["overhead"] < 1


@pytest.mark.parametrize("precision", ["fp64", "bf16", "fp16-scale", "bf16-amp"])
def test_health_is_measured_in_every_precision(tmp_path: Path, precision: str) -> None:
    Trainer(ReluToyRecipe(_config(tmp_path, precision=precision, health_every=4))).fit()
    rows = _health_rows(tmp_path)
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert all(r["grad_norm/model.2"] > 0 for r in rows)
    assert all(r["update_ratio/model.2"] > 0 for r in rows[:-1])  # the last step's learning rate is 0 (cosine)


def test_health_is_off_at_0_and_mirrored_to_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Trainer(ReluToyRecipe(_config(tmp_path / "off", health_every=0))).fit()
    assert _health_rows(tmp_path / "off") == []
    Trainer(ReluToyRecipe(_config(tmp_path / "tb", health_every=4, tensorboard=True))).fit()
    events = EventAccumulator(str(tmp_path / "tb" / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "health/grad_norm/model.2" in tags and "health/dead_fraction/model.3" in tags
    assert [e.step for e in events.Scalars("health/update_ratio/model.4")] == [4, 8, 12, 16]


def test_report_plots_health_when_the_run_logged_it(tmp_path: Path) -> None:
    from trainlab.report.plots import plot_run

    Trainer(DeadReluToyRecipe(_config(tmp_path / "on"))).fit()
    paths = plot_run(tmp_path / "on", tmp_path / "on" / "plots")
    assert [p.name for p in paths] == ["loss.png", "accuracy.png", "health.png"]
    assert paths[-1].stat().st_size > 10_000
    Trainer(ReluToyRecipe(_config(tmp_path / "off", health_every=0))).fit()
    assert "health.png" not in [p.name for p in plot_run(tmp_path / "off", tmp_path / "off" / "plots")]


def _monitor(model: nn.Module, every: int = 1) -> HealthMonitor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return HealthMonitor({"model": model}, [Phase("main", optimizer, ["model"])], every, torch.device("cpu"))


def test_exploding_gradients_and_lasting_huge_updates_are_warned_about() -> None:
    monitor = _monitor(nn.Linear(4, 4))
    for step in range(1, 6):
        assert monitor.check(step, {"grad_norm/model": 0.01, "update_ratio/model": 1e-3}) == []
    growth = monitor.check(6, {"grad_norm/model": 50.0, "update_ratio/model": 0.5})
    assert len(growth) == 1  # a huge update once is a fresh model's first steps; a second in a row is a warning
    assert "grew 5e+03-fold" in growth[0] and "clipping (--clip-grad-norm)" in growth[0]
    lasting = monitor.check(7, {"grad_norm/model": 500.0, "update_ratio/model": 0.9})
    assert len(lasting) == 1 and "changed by 0.9 of its weights' norm" in lasting[0]
    assert "lower learning rate" in lasting[0]
    assert monitor.check(8, {"grad_norm/model": 5000.0, "update_ratio/model": 0.9}) == []  # each kind once
    for step in (9, 10):  # barely moving at a tenth of the peak learning rate is the schedule, not a problem
        assert monitor.check(step, {"update_ratio/other": 1e-9, "lr_factor/main": 0.1}) == []
    assert monitor.check(11, {"update_ratio/other": 1e-9, "lr_factor/main": 1.0}) == []
    assert len(monitor.check(12, {"update_ratio/other": 1e-9, "lr_factor/main": 1.0})) == 1


def test_blocks_cover_every_parameter_once() -> None:
    resnet = create_model("cifar_resnet18")
    blocks = parameter_blocks("model", resnet)
    assert list(blocks)[:4] == ["model.conv1", "model.bn1", "model.layer1.0", "model.layer1.1"]
    assert "model.layer4.1" in blocks and "model.fc" in blocks
    ids = [id(p) for params in blocks.values() for p in params]
    assert len(ids) == len(set(ids)) == len(list(resnet.parameters()))
    relus = relu_modules("model", resnet)
    assert "model.relu" in relus and "model.layer4.1.relu" in relus


def test_a_backbone_inside_a_wrapper_is_cut_further() -> None:
    wrapper = nn.Module()
    wrapper.backbone = create_model("cifar_resnet18")
    wrapper.head = nn.Linear(10, 2)
    blocks = parameter_blocks("moco", wrapper)
    assert "moco.backbone.layer2.0" in blocks and "moco.head" in blocks


def test_the_update_sample_walks_through_every_column() -> None:
    weight_HD = torch.arange(1024 * 512, dtype=torch.float32).reshape(1024, 512)
    picked = sampled(weight_HD)
    assert picked.numel() <= 65_536 and picked.dtype == torch.float32
    assert len(set((picked % 512).tolist())) == 512
    small_K = torch.ones(10)
    assert torch.equal(sampled(small_K), small_K)


def test_observing_reads_only() -> None:
    """The hooks and measurements of an observed step leave outputs, gradients and updates unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    reference = [p.detach().clone() for p in model.parameters()]
    x_BD = torch.randn(4, 8)
    results = []
    for observe in (False, True):
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference):
                p.copy_(r)
        monitor = _monitor(model, every=1 if observe else 0)
        optimizer = monitor.optimizers["main"]
        info = StepInfo(step=0, total_steps=1, steps_per_epoch=1)
        with monitor.watch_forward("main", info):
            out = model(x_BD)
        out.square().sum().backward()
        monitor.record_gradients("main", info)
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        monitor.before_update("main", info)
        optimizer.step()
        monitor.after_update("main", info, stepped=True)
        metrics = monitor.pop_metrics(info)
        assert bool(metrics) == observe
        results.append((out.detach(), grads, [p.detach().clone() for p in model.parameters()]))
        optimizer.zero_grad()
    for a, b in zip(results[0], results[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, list) else torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ golden runs
FAST_GOLDEN = ("toy_accumulation_2", "toy_bf16_amp", "cifar_resnet_debug", "tokenizer")


def _bit_for_bit_with_health_every_step(case: str, tmp_path: Path) -> None:
    path = native_path()
    if not path.is_file():
        pytest.skip(f"no native goldens for this machine ({path.name}); test_golden_losses.py explains")
    got = run_case(case, tmp_path / case, health_every=1)
    problems = differences(got, load_json(path)["cases"][case])
    assert not problems, f"{case} with --health-every 1 is not bit for bit its golden run: " + "; ".join(problems)
    assert len(_health_rows(tmp_path / case)) == len(got["steps"])  # the debug runs log every step


@pytest.mark.parametrize("case", FAST_GOLDEN)
def test_health_at_every_step_leaves_golden_runs_bit_for_bit(case: str, tmp_path: Path) -> None:
    _bit_for_bit_with_health_every_step(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES) - set(FAST_GOLDEN)))
def test_health_at_every_step_leaves_every_golden_run_bit_for_bit(case: str, tmp_path: Path) -> None:
    _bit_for_bit_with_health_every_step(case, tmp_path)
