"""`trainlab demo --quick`: the whole pipeline runs and writes sane outputs (the quality bar is the full demo's)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from trainlab.config import parse, to_dict
from trainlab.configs import config_path
from trainlab.demo.pipeline import REPORT_KEYS, DemoConfig, tokenizer_config
from trainlab.recipes.tokenizer import TokenizerConfig

REPO = Path(__file__).resolve().parents[1]


def _demo(python: str, run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [python, "-m", "trainlab", "demo", "--quick", "--run-dir", str(run_dir), "--samples-per-class", "5", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_quick_demo_writes_report_and_figures_then_continues_finished_stages(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "demo"
    done = _demo(python, run_dir, run_env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    for key in REPORT_KEYS:
        assert isinstance(report[key], float) and math.isfinite(report[key]), key
    assert 0.5 < report["classifier_heldout_accuracy"] <= 1.0  # 2 judge epochs already give ~94%
    assert 0.0 <= report["conditional_accuracy"] <= 1.0
    assert len(report["conditional_accuracy_per_class"]) == 10
    assert report["fid_samples"] >= 0.0 and report["fid_real_floor"] >= 0.0
    assert report["fid_num_images"] == [50, 500, 500]
    assert 5.0 < report["recon_psnr"] < 60.0
    assert report["seconds_total"] > 0
    assert report["settings"]["tokenizer_steps"] == 12 and report["settings"]["var_steps"] == 10
    for name in ("samples_grid.png", "reconstructions.png", "training_curves.png", "judge.safetensors"):
        assert (run_dir / name).stat().st_size > 1000, name
    markdown = (run_dir / "report.md").read_text()
    assert "conditional accuracy" in markdown and "![samples](samples_grid.png)" in markdown
    for stage in ("tokenizer", "var"):
        assert (run_dir / stage / "ckpt" / "last.pt").is_file()
        assert (run_dir / stage / "metrics.jsonl").stat().st_size > 0
    assert "conditional accuracy" in done.stdout

    grid = tmp_path / "grid.png"  # the run checkpoints load straight into `trainlab sample`
    sample = [python, "-m", "trainlab", "sample", "--tokenizer-weights", str(run_dir / "tokenizer/ckpt/last.pt")]
    sample += ["--var-weights", str(run_dir / "var/ckpt/last.pt"), "--classes", "0", "7", "--out", str(grid)]
    sampled = subprocess.run(sample, env=run_env, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert grid.stat().st_size > 100

    again = _demo(python, run_dir, run_env)  # finished stages resume at their end; the judge is reloaded
    assert again.returncode == 0, again.stderr[-3000:]
    assert "judge loaded from" in again.stderr
    second = json.loads((run_dir / "report.json").read_text())
    assert second["settings"]["tokenizer_steps"] == 12 and second["settings"]["var_steps"] == 10
    assert second["classifier_heldout_accuracy"] == report["classifier_heldout_accuracy"]
    assert second["conditional_accuracy"] == report["conditional_accuracy"]


@pytest.mark.parametrize("flag", [["--samples-per-class", "0"], ["--guidance", "-1"], ["--threads", "-2"]])
def test_bad_demo_flags_are_one_line_usage_errors(
    tmp_path: Path, python: str, run_env: dict[str, str], flag: list[str]
) -> None:
    done = _demo(python, tmp_path / "demo", run_env, *flag)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "demo" in done.stderr


def test_the_demo_tokenizer_is_the_shipped_config() -> None:
    """The demo reads the shipped tokenizer_digits config; it changes only where the run goes and how it is seeded."""
    shipped = parse(TokenizerConfig, ["--config", str(config_path("tokenizer_digits"))], prog="t")
    demo = to_dict(tokenizer_config(DemoConfig()))
    ignored = {"run_dir", "resume", "seed", "device", "progress"}
    different = {k: (v, demo[k]) for k, v in to_dict(shipped).items() if k not in ignored and demo[k] != v}
    assert not different
    assert (shipped.vocab_size, shipped.image_size, shipped.patch_nums) == (256, 16, (1, 2, 3, 4))


def test_interrupted_stage_exits_130_with_a_resume_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM / Ctrl-C inside a stage: the engine saved last.pt; the demo stops there and says how to continue."""
    import trainlab.demo.pipeline as demo_module
    from trainlab.commands.demo import main
    from trainlab.engine.loop import FitResult, Trainer
    from trainlab.models.digit_judge import DigitJudge

    monkeypatch.setattr(demo_module, "_judge", lambda demo, device: DigitJudge().eval())
    monkeypatch.setattr(Trainer, "fit", lambda self: FitResult("interrupted", 5, 0, [], {}))
    code = main(["--quick", "--run-dir", str(tmp_path / "demo"), "--progress", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert "interrupted during tokenizer training at step 5" in err[-1] and "run `trainlab demo` again" in err[-1]
    assert not (tmp_path / "demo" / "report.json").exists()


@pytest.mark.parametrize("slot", ["", "judge", "tokenizer", "var"])
def test_a_folder_holding_another_run_is_refused_before_any_stage_trains(tmp_path: Path, slot: str) -> None:
    from trainlab.demo.pipeline import run_demo
    from trainlab.errors import UsageError

    folder = tmp_path / "demo" / slot if slot else tmp_path / "demo"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("# recipe: moco\n# command: trainlab train moco\nseed: 0\n")
    with pytest.raises(UsageError, match=r"holds a 'moco' run \(its config.yaml\).*pass another --run-dir") as info:
        run_demo(DemoConfig(run_dir=tmp_path / "demo", quick=True))
    assert "--overwrite" not in str(info.value)  # the demo has none
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [slot or "config.yaml"]  # nothing trained or written


def test_a_quick_demo_folder_is_refused_for_a_full_demo_before_anything_trains(tmp_path: Path) -> None:
    """The stages' sizes differ: the engine's refusal (after training the judge) named flags the demo does not take."""
    from trainlab.demo.pipeline import _was_quick, run_demo
    from trainlab.errors import UsageError

    stage = tmp_path / "demo" / "tokenizer"
    stage.mkdir(parents=True)
    (stage / "config.yaml").write_text(f"# recipe: tokenizer\n# command: trainlab demo --quick --run-dir {tmp_path}\n")
    with pytest.raises(UsageError, match=r"holds a --quick demo's tokenizer stage and this is a full demo") as info:
        run_demo(DemoConfig(run_dir=tmp_path / "demo", quick=False))
    assert "--overwrite" not in str(info.value) and "--data.eval-limit" not in str(info.value)
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["tokenizer"]
    assert _was_quick(["trainlab", "demo", "--quick"]) and _was_quick(["trainlab", "demo", "--quick=true"])
    assert not _was_quick(["trainlab", "demo", "--quick", "false"]) and not _was_quick(["trainlab", "demo"])
