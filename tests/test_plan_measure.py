"""`trainlab plan RECIPE ... --measure`: real optimizer steps timed on the device present, the JSON keys, the stored
efficiency (only for a GPU with a known peak) and the one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.cli import main
from trainlab.commands.plan_measure import store_efficiency, without_downloads
from trainlab.engine.throughput import DevicePeak
from trainlab.errors import UsageError
from trainlab.memory.efficiency import efficiency_for
from trainlab.memory.gpus import GPU_PROFILES
from trainlab.memory.measure import COUNTED, Measurement, measure_step, synthetic_batches
from trainlab.recipes import get_recipe

TOY = ["toy", "--num-samples", "64", "--batch-size", "16", "--device", "cpu"]


def _measurement(device: str, peak: float | None) -> Measurement:
    return Measurement(
        device=device,
        precision="bf16-amp",
        compute="bf16",
        global_batch=64,
        micro_batch=32,
        grad_accumulation=2,
        gpus=1,
        warmup_steps=3,
        steps=3,
        step_seconds=[0.2, 0.1, 0.3],
        flops_per_step=4 * 10**12,
        flops_source="test",
        peak=DevicePeak(peak, "H100-80GB" if peak else "", "peak"),
    )


def test_the_measured_numbers_hold_together() -> None:
    m = _measurement("cuda:0", 100e12)
    assert m.median_step_seconds == 0.2
    assert m.samples_per_second == pytest.approx(64 / 0.2)
    assert m.achieved_tflops == pytest.approx(20.0)
    assert m.mfu == pytest.approx(0.2)
    assert _measurement("cpu", None).mfu is None


def test_synthetic_batches_have_the_example_shapes_and_random_floats() -> None:
    recipe_cls = get_recipe("toy")
    recipe = recipe_cls(recipe_cls.config_class())
    batches = synthetic_batches(recipe, 8, torch.device("cpu"))
    example = recipe.example_batch(8)
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (v.shape, v.dtype) for k, v in example.items()}
        assert batch["input"].std() > 0.5  # drawn, not the example's zeros
    assert not torch.equal(batches[0]["input"], batches[1]["input"])


def test_measure_step_times_real_steps_with_accumulation() -> None:
    recipe_cls = get_recipe("toy")
    config = recipe_cls.config_class(num_samples=64, batch_size=16, grad_accumulation=2, device="cpu")
    m = measure_step(recipe_cls(config), torch.device("cpu"), steps=4, warmup_steps=1)
    assert len(m.step_seconds) == 4 and all(s > 0 for s in m.step_seconds)
    assert (m.micro_batch, m.grad_accumulation, m.global_batch) == (8, 2, 16)
    # Linear(16 -> 32), ReLU, Linear(32 -> 4), 2 micro-batches of 8: forward, weight gradients, hidden gradient
    assert m.flops_per_step == 2 * (2 * 8 * (16 * 32 + 32 * 4) * 2 + 2 * 8 * 32 * 4)
    assert m.memory["memory_kind"] == "cpu_peak_rss_growth" and m.mfu is None


def test_measure_step_times_the_training_loop_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainlab.engine import loop
    from trainlab.engine.metrics import RunProgress

    monkeypatch.chdir(tmp_path)
    shown: list[int] = []
    update = RunProgress.update
    monkeypatch.setattr(
        RunProgress, "update", lambda bar, step, metrics: shown.append(step) or update(bar, step, metrics)
    )
    recipe_cls = get_recipe("toy")
    between_epochs: list[str] = []  # nothing is evaluated, no checkpoint state gathered, nothing exported
    monkeypatch.setattr(recipe_cls, "evaluate", lambda *args: between_epochs.append("evaluate") or {})
    monkeypatch.setattr(recipe_cls, "on_fit_end", lambda *args: between_epochs.append("export"))
    monkeypatch.setattr(loop, "training_state", lambda *args, **kwargs: between_epochs.append("save") or {})
    config = recipe_cls.config_class(
        num_samples=64, batch_size=16, max_steps=2, device="cpu", run_dir=tmp_path / "run", checkpoint_every=1
    )
    recipe = recipe_cls(config)
    m = measure_step(recipe, torch.device("cpu"), steps=6, warmup_steps=2)
    # the loop's own steps (its progress display shown after each), past --max-steps 2 and the 1 epoch of 4 steps
    assert shown == list(range(1, 9)) and len(m.step_seconds) == 6 and between_epochs == []
    assert list(tmp_path.iterdir()) == [] and recipe.config is config  # no run dir, no checkpoint, no log
    assert m.flops_per_step > 0 and m.flops_source == COUNTED  # the loop's count, on its first step


def test_the_efficiency_is_stored_only_for_a_known_gpu_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path))
    h100 = GPU_PROFILES["H100-80GB"]
    assert store_efficiency(_measurement("cpu", None), None, "convnet", "") == ""
    assert store_efficiency(_measurement("cuda:0", None), None, "convnet", "Some GPU") == ""
    assert not (tmp_path / "efficiency.json").exists()
    line = store_efficiency(_measurement("cuda:0", 100e12), h100, "convnet", "NVIDIA H100 80GB HBM3")
    assert "later estimates for GPU H100-80GB and family convnet use it" in line
    stored = efficiency_for("H100-80GB", "convnet")
    assert stored.source == "measured" and stored.value == pytest.approx(0.2)
    assert efficiency_for("A100-80GB", "small-transformer").source == "assumed"
    # a family measured for the project on that GPU: the shipped measurement, said so, until the user measures one
    shipped = efficiency_for("H100-80GB", "transformer")
    assert shipped.source == "measured" and shipped.value == 0.122 and "VAR-d16" in shipped.measured_on
    assert efficiency_for("H200", "transformer").value == 0.122  # the same chip's compute
    # MoCo v3 ViT-S and ResNet-50 measured on an H200, shipped for both chips (the user's H100 convnet above wins)
    vit, resnet = efficiency_for("H100-80GB", "small-transformer"), efficiency_for("H200", "convnet")
    assert (vit.value, resnet.value) == (0.099, 0.056) and "ViT-S" in vit.measured_on
    assert "ResNet-50" in resnet.measured_on and "H200" in resnet.measured_on
    assert efficiency_for("A100-80GB", "transformer").source == "assumed"


def test_steps_zero_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--measure", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--steps" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the present device is a GPU")
def test_measure_with_a_gpu_that_is_not_present_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--measure", "--gpu", "H100-80GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "runs on the device present" in err and "H100-80GB" in err and len(err.splitlines()) == 1
    for several in ("all", "H100-80GB,A100-80GB"):  # valid plans without --measure, not one device to time
        assert main(["plan", *TOY, "--measure", "--gpu", several]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--measure times the one device present, --gpu {several} plans several" in err, err


def test_grad_accumulation_auto_is_trains_and_said_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--grad-accumulation", "auto", "--gpu", "H100-80GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--grad-accumulation auto is resolved by `trainlab train`" in err and len(err.splitlines()) == 1


def test_measure_json_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path))
    assert main(["plan", *TOY, "--measure", "--steps", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters_bytes"] > 0  # the plan's keys stay
    assert out["measured_step_seconds"] > 0 and len(out["measured_step_seconds_all"]) == 3
    assert out["measured_samples_per_second"] == pytest.approx(16 / out["measured_step_seconds"])
    assert out["measured_tflops"] == pytest.approx(out["flops_per_step"] / out["measured_step_seconds"] / 1e12)
    assert out["dataset_size"] == 64 and out["projected_run_steps"] == 4  # 64 // 16 steps x 1 epoch
    assert out["projected_run_seconds"] == pytest.approx(4 * out["measured_step_seconds"])
    assert out["measured_mfu"] is None and out["efficiency_stored"] is False
    assert out["measured_memory_kind"] == "cpu_peak_rss_growth"
    assert not (tmp_path / "efficiency.json").exists()


def _data_not_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy recipe as if its data were not on this machine (as a missing CIFAR-10 folder raises)."""

    def missing(self: object, parts: object, device: object) -> None:
        raise UsageError("--data.root /nowhere not found: pass the folder")

    monkeypatch.setattr(get_recipe("toy"), "build_data", missing)


def test_measure_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["plan", *TOY, "--measure", "--steps", "2", "--num-workers", "0"]) == 0
    text = capsys.readouterr().out
    rows = ("measured on cpu", "s/step", "samples/s", "FLOP/s per device", "unknown peak", "not measured on a CPU")
    for row in (*rows, "batches from the loader", "the recipe's data through its training loader"):
        assert row in text
    _data_not_here(monkeypatch)
    assert main(["plan", *TOY, "--measure", "--steps", "2", "--num-workers", "0"]) == 0
    text = capsys.readouterr().out
    for row in (*rows, "synthetic batches", "not read (the data is not on this machine (--data.root /nowhere not "):
        assert row in text
    assert "--num-workers 0 adds" in text


def test_measure_step_runs_the_recipe_loader_when_the_data_is_here(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe_cls = get_recipe("toy")
    config = recipe_cls.config_class(num_samples=64, batch_size=16, device="cpu")
    fetched: list[int] = []
    build_data = recipe_cls.build_data

    def counted(self: Any, parts: Any, device: torch.device) -> Any:
        dataset = build_data(self, parts, device)
        getitem = type(dataset).__getitem__
        monkeypatch.setattr(type(dataset), "__getitem__", lambda ds, i: fetched.append(i) or getitem(ds, i))
        return dataset

    monkeypatch.setattr(recipe_cls, "build_data", counted)
    m = measure_step(recipe_cls(config), torch.device("cpu"), steps=5, warmup_steps=2)
    assert m.data == "loader" and "training loader" in m.data_note
    assert len(fetched) == 7 * 16  # every step's samples read through the loader, across the epoch's end (4 steps)
    assert len(m.data_wait_seconds) == 5 and all(0 < w <= s for w, s in zip(m.data_wait_seconds, m.step_seconds))
    _data_not_here(monkeypatch)
    m = measure_step(recipe_cls(config), torch.device("cpu"), steps=2, warmup_steps=1)
    assert m.data == "synthetic" and "not on this machine" in m.data_note and m.data_wait_seconds == []


def test_measure_never_downloads() -> None:
    cifar = get_recipe("cifar").config_class()
    cifar = dataclasses.replace(cifar, data=dataclasses.replace(cifar.data, kind="cifar10", download=True))
    assert without_downloads(cifar).data.download is False and cifar.data.download is True
    toy = get_recipe("toy").config_class()
    assert without_downloads(toy) == toy


def test_the_present_gpu_is_found_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainlab.commands.plan_measure import present_device
    from trainlab.engine import device as device_module
    from trainlab.errors import UsageError

    monkeypatch.setattr(device_module, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    device, profile = present_device("cuda", None)
    assert device == torch.device("cuda", 0) and profile is not None and profile.name == "H100-80GB"
    assert present_device("cuda", "h100-80gb")[1] == profile  # the present GPU named: fine
    with pytest.raises(UsageError, match=r"runs on the device present .*H100 80GB HBM3.*, not A100-80GB"):
        present_device("cuda", "A100-80GB")


def test_a_stored_data_rate_is_not_added_to_steps_that_ran_the_loader(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path))
    (tmp_path / "bench_data").mkdir()
    (tmp_path / "bench_data" / "toy.json").write_text(json.dumps({"samples_per_second_per_core": 160.0}))
    assert main(["plan", *TOY, "--measure", "--steps", "3", "--json", "--num-workers", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_data"] == "loader"
    assert out["projected_step_seconds"] == out["measured_step_seconds"]
    assert 0 < out["measured_data_seconds_per_step"] < out["measured_step_seconds"]  # the loader's part, not 0.1 s


def test_a_stored_data_rate_is_added_to_synthetic_steps_where_the_training_process_loads_the_data(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path))
    (tmp_path / "bench_data").mkdir()
    (tmp_path / "bench_data" / "toy.json").write_text(json.dumps({"samples_per_second_per_core": 160.0}))
    _data_not_here(monkeypatch)
    assert main(["plan", *TOY, "--measure", "--steps", "2", "--json", "--num-workers", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_data_seconds_per_step"] == pytest.approx(16 / 160)
    assert out["projected_step_seconds"] == pytest.approx(out["measured_step_seconds"] + 0.1)
    assert main(["plan", *TOY, "--measure", "--steps", "2", "--json", "--num-workers", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["projected_step_seconds"] == pytest.approx(max(out["measured_step_seconds"], 0.05))
