"""What `trainlab report` / `bench precision` print is true, and their inputs and outputs are checked first.

The per-epoch time says whether it includes the first epoch; the loss plot's zoom inset shows data; damaged run
directories are skipped with a warning naming them; an unusable output folder is refused before anything is drawn or
trained; a warning every bench run would repeat is printed once; `report` of a bench folder updates the bench's own
report instead of writing a second copy.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainlab.cli import main
from trainlab.report.runs import load_run, summarize_run
from trainlab.report.tables import write_results_table


def _run(
    run_dir: Path,
    *,
    precision: str = "fp32",
    epochs: int = 3,
    steps_per_epoch: int = 4,
    timed: int | None = None,
    start: tuple[int, int] = (0, 0),
    log_steps: tuple[int, ...] | None = None,
) -> Path:
    """A run directory as the engine writes it: a start event (step, epoch, total_steps), train rows, one eval per
    epoch and a summary with the epoch timing of the last process (`timed` full epochs)."""
    run_dir.mkdir(parents=True)
    config = {"run_dir": str(run_dir), "seed": 0, "precision": precision, "model": "vgg_debug", "epochs": epochs}
    (run_dir / "config.yaml").write_text("# recipe: cifar\n" + yaml.safe_dump(config))
    total = epochs * steps_per_epoch
    rows: list[dict[str, Any]] = [
        {"kind": "event", "step": start[0], "epoch": start[1], "event": "start", "total_steps": total}
    ]
    for step in log_steps or tuple(range(start[0] + 1, total + 1)):
        rows.append({"kind": "train", "step": step, "epoch": (step - 1) // steps_per_epoch, "loss": 2.0 / step})
    for epoch in range(start[1] + 1, epochs + 1):
        rows.append({"kind": "eval", "step": epoch * steps_per_epoch, "epoch": epoch, "test_accuracy": 0.1 * epoch})
    summary = {"kind": "summary", "step": total, "epoch": epochs, "precision": precision, "seconds_per_epoch": 2.0}
    rows.append(summary | {"epochs_timed": timed if timed is not None else max(epochs - start[1] - 1, 1)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _capture(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import trainlab.report.plots as plots

    figures: dict[str, Any] = {}
    real_save = plots._save

    def capture(fig: Any, out_dir: Path, name: str) -> Path:
        figures[name] = fig
        return real_save(fig, out_dir, name)

    monkeypatch.setattr(plots, "_save", capture)
    return figures


# ------------------------------------------------------------------------------------------------ timing label
def test_the_first_epoch_is_said_to_be_timed_only_when_it_is(tmp_path: Path) -> None:
    one = _run(tmp_path / "one", epochs=1, timed=1)  # `bench precision --epochs 1`: its only epoch is timed
    two = _run(tmp_path / "two", epochs=2, timed=1)  # two epochs, the first left out
    many = _run(tmp_path / "many", epochs=4, timed=3)
    resumed = _run(tmp_path / "resumed", epochs=3, timed=1, start=(6, 1))  # mid-epoch 2: epoch 2 partial, 3 full
    resumed_at_end = _run(tmp_path / "at-end", epochs=3, timed=1, start=(4, 1))  # epochs 2 and 3 full: 2 left out
    flags = {p.name: load_run(p).summary["first_epoch_timed"] for p in (one, two, many, resumed, resumed_at_end)}
    assert flags == {"one": True, "two": False, "many": False, "resumed": True, "at-end": False}
    (tmp_path / "nostart").mkdir()
    lines = (two / "metrics.jsonl").read_text().splitlines()[1:]  # an older run without the start event
    (tmp_path / "nostart" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert load_run(tmp_path / "nostart").summary["first_epoch_timed"] is None


def test_bench_of_one_epoch_labels_its_timing_honestly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainlab.report.plots import plot_comparison

    figures = _capture(monkeypatch)
    one_epoch = {m: [_run(tmp_path / "e1" / m, precision=m, epochs=1, timed=1)] for m in ("fp32", "bf16")}
    plot_comparison(one_epoch, tmp_path / "plots1")
    ax = figures["time_per_epoch.png"].axes[0]
    assert "first epoch included" in ax.get_ylabel() and "excluded" not in ax.get_ylabel()
    assert [t.get_text() for t in ax.texts] == ["2.00\nn=1 epoch (the first)"] * 2
    assert "first epoch included" in figures["accuracy_vs_time.png"].axes[0].get_xlabel()
    rows = [summarize_run(d[0], m) for m, d in one_epoch.items()]
    write_results_table(rows, tmp_path / "r.md", tmp_path / "r.csv")
    md = (tmp_path / "r.md").read_text()
    assert "(n=1 epoch incl. the first)" in md and "(first epoch included: one epoch per run)" in md
    assert "exclude" not in md

    several = {m: [_run(tmp_path / "e3" / m, precision=m, epochs=3, timed=2)] for m in ("fp32", "bf16")}
    plot_comparison(several, tmp_path / "plots3")
    assert figures["time_per_epoch.png"].axes[0].get_ylabel() == "train time per epoch (s, first epoch excluded)"


# ------------------------------------------------------------------------------------------------ zoom inset
def test_the_loss_inset_shows_the_tail_it_zooms_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four logged steps per run (a short bench): the inset holds the last two steps of every curve, with markers."""
    from trainlab.report.plots import plot_comparison

    figures = _capture(monkeypatch)
    groups = {m: [_run(tmp_path / m, precision=m, epochs=1, steps_per_epoch=4, timed=1)] for m in ("fp32", "bf16")}
    (tmp_path / "bf16" / "metrics.jsonl").write_text(
        (tmp_path / "bf16" / "metrics.jsonl").read_text().replace('"loss": 0.5}', '"loss": 0.52}')
    )
    plot_comparison(groups, tmp_path / "plots")
    (inset,) = figures["loss_vs_step.png"].axes[0].child_axes
    lines = inset.get_lines()
    assert len(lines) == 2
    for line in lines:
        xs = list(line.get_xdata())
        assert xs == [3, 4] and line.get_marker() == "o"
        lo, hi = inset.get_xlim()
        assert lo < 3 and hi > 4  # both points inside the view
        ylo, yhi = inset.get_ylim()
        assert all(ylo <= y <= yhi for y in line.get_ydata())


# ------------------------------------------------------------------------------------------------ damaged runs
def test_damaged_runs_are_skipped_with_a_warning_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    parent = tmp_path / "runs"
    for name in ("good", "good2", "config-binary", "metrics-binary", "config-deep"):
        _run(parent / name, precision=name)
    (parent / "config-binary" / "config.yaml").write_bytes(b"\x86\x00\xff binary")
    (parent / "metrics-binary" / "metrics.jsonl").write_bytes(b"\x8d\x00\x01 binary")
    (parent / "config-deep" / "config.yaml").write_text("[" * 5000 + "]" * 5000)
    with caplog.at_level("WARNING"):
        assert main(["report", str(parent)]) == 0
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping run")]
    assert len(skipped) == 3
    assert any("config-binary/config.yaml is not UTF-8 text" in m for m in skipped)
    assert any("metrics-binary/metrics.jsonl is not UTF-8 text" in m for m in skipped)
    assert any("config-deep/config.yaml is not valid YAML" in m for m in skipped)
    md = (parent / "report" / "results.md").read_text()
    assert "| good |" in md and "| good2 |" in md and "binary" not in md
    assert main(["report", str(parent / "metrics-binary")]) == 2  # the one run asked for: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl is not UTF-8 text" in err[0]


# ------------------------------------------------------------------------------------------------ output paths
@pytest.fixture
def no_drawing(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainlab.report.plots as plots

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("drew before checking the output folder")

    monkeypatch.setattr(plots, "plot_run", fail)
    monkeypatch.setattr(plots, "plot_comparison", fail)


def test_report_checks_its_output_folder_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_drawing: None
) -> None:
    run = _run(tmp_path / "run")
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(run), "--out-dir", str(tmp_path / "afile")]) == 2
    assert "--out-dir " + str(tmp_path / "afile") + " is a file; pass a directory" in capsys.readouterr().err

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)  # the run dir on a read-only mount
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run / 'plots'} cannot be written" in err[0] and "Read-only file system" in err[0]


def test_bench_and_demo_check_their_output_folder_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")

    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("started a run before checking the output folder")

    monkeypatch.setattr(subprocess, "run", no_run)
    assert main(["bench", "precision", "--run-dir", str(tmp_path / "afile"), "--model", "cifar_vgg_debug"]) == 2
    assert "--run-dir " + str(tmp_path / "afile") + " is a file" in capsys.readouterr().err
    import trainlab.demo.pipeline as pipeline

    monkeypatch.setattr(pipeline, "Trainer", no_run)
    assert main(["demo", "--quick", "--run-dir", str(tmp_path / "afile" / "demo")]) == 2
    assert "is not a directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ bench
def test_a_warning_every_mode_gives_is_printed_once(caplog: pytest.LogCaptureFixture) -> None:
    from trainlab.commands.bench import runnable_modes

    with caplog.at_level("WARNING"):
        modes, shown = runnable_modes(["fp32", "fp16", "fp16-amp", "bf16"], "cpu")
    assert modes == ["fp32", "fp16", "fp16-amp", "bf16"]
    fp16 = [r.getMessage() for r in caplog.records if "fp16 on CPU" in r.getMessage()]
    assert len(fp16) == 1 and "(modes fp16, fp16-amp; said once for all their runs)" in fp16[0], fp16
    assert len(shown) == 1 and shown[0] in fp16[0]


def test_bench_runs_do_not_repeat_the_warning_and_record_a_reproducing_command(
    tmp_path: Path, run_env: dict[str, str], python: str
) -> None:
    from trainlab.commands.bench import SHOWN_ENV, runnable_modes

    _, shown = runnable_modes(["fp16"], "cpu")
    outputs = {}
    for name, env in (("plain", run_env), ("bench", {**run_env, SHOWN_ENV: json.dumps(shown)})):
        run_dir = tmp_path / name
        argv = ["train", "toy", "--device", "cpu", "--precision", "fp16", "--max-steps", "1", "--run-dir", str(run_dir)]
        proc = subprocess.run(
            [python, "-m", "trainlab.commands.bench", *argv], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        outputs[name] = proc.stderr
        header = (run_dir / "config.yaml").read_text().splitlines()
        assert f"# command: python -m trainlab {' '.join(argv)}" in header
    assert shown[0] in outputs["plain"] and shown[0] not in outputs["bench"]


def test_report_of_a_bench_folder_updates_the_bench_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    groups = {m: [f"runs/vgg_debug-{m}-seed0"] for m in ("fp32", "bf16-amp", "fp16")}  # the bench's order
    for mode, (rel,) in groups.items():
        _run(out / rel, precision=mode)
    (out / "bench.json").write_text(json.dumps({"groups": groups}))
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "results.md") in printed and str(out / "plots" / "loss_vs_step.png") in printed
    assert not (out / "report").exists()
    rows = [line.split("|")[1].strip() for line in (out / "results.md").read_text().splitlines()[2:5]]
    assert rows == ["fp32", "bf16-amp", "fp16"]
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(
        ["loss_vs_step.png", "accuracy_vs_epoch.png", "memory.png", "time_per_epoch.png", "accuracy_vs_time.png"]
    )
    os.remove(out / "runs" / "vgg_debug-fp16-seed0" / "metrics.jsonl")  # a run lost since: said, the rest reported
    assert main(["report", str(out)]) == 0
    assert "| fp16 |" not in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "damage",
    [
        ('"loss": 0.5', '"loss": 1' + "0" * 400),  # an int no float holds
        ('"step": 5', '"step": NaN'),  # Python's json reads NaN
        ('"step": 6', '"step": -1e300'),
    ],
)
def test_numbers_no_run_writes_are_left_out_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: tuple[str, str]
) -> None:
    run = _run(tmp_path / "run")
    text = (run / "metrics.jsonl").read_text()
    assert damage[0] in text
    (run / "metrics.jsonl").write_text(text.replace(damage[0], damage[1], 1))
    assert main(["report", str(run), "--out-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "results.md").is_file()


def test_undecodable_names_are_drawn_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder name with bytes that are not UTF-8 (Python keeps them as lone surrogates), or a metric key with a
    lone surrogate from a JSON escape, cannot be drawn by matplotlib: they are drawn as \\xff / \\ud800 instead."""
    figures = _capture(monkeypatch)
    run = _run(tmp_path / os.fsdecode(b"r\xff"))
    rows = [f'{{"kind": "train", "step": {step}, "epoch": 0, "g\\ud800/loss": 1.0, "d/loss": 2.0}}' for step in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")  # two losses: each curve is labelled by its key
    assert main(["report", str(run), "--out-dir", str(tmp_path / "out")]) == 0
    texts = [text.get_text() for text in figures["loss.png"].findobj(lambda artist: hasattr(artist, "get_text"))]
    assert any("r\\xff" in text for text in texts) and any("g\\ud800/loss" in text for text in texts), texts
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_report_files_replace_what_is_in_their_place(tmp_path: Path) -> None:
    """results.md, results.csv and the plots are written beside their names and renamed onto them: a FIFO of that
    name is replaced instead of opened (which waited for a reader forever), and a reader never sees half a file."""
    run = _run(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.md", "results.csv", "loss.png"):
        os.mkfifo(out / name)
    assert main(["report", str(run), "--out-dir", str(out)]) == 0
    assert all((out / name).is_file() and (out / name).stat().st_size > 0 for name in ("results.md", "loss.png"))
    assert not list(out.glob(".*.tmp"))
