"""Report plots and results tables from synthetic run directories."""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainlab.cli import main as cli_main
from trainlab.commands.report import main as report_main
from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError
from trainlab.report.plots import plot_comparison, plot_run
from trainlab.report.runs import group_runs, load_run, summarize_run
from trainlab.report.tables import write_results_table

MIB = 2**20
COMPARISON_PNGS = [
    "loss_vs_step.png",
    "accuracy_vs_epoch.png",
    "memory.png",
    "time_per_epoch.png",
    "accuracy_vs_time.png",
]


def write_run(
    run_dir: Path,
    *,
    precision: str,
    seed: int,
    final_acc: float,
    memory_mib: float,
    seconds: float,
    epochs: int = 6,
    steps_per_epoch: int = 10,
    loss_scale: float = 1.0,
    extra_lines: str = "",
) -> Path:
    """A run directory like the engine writes: config.yaml + metrics.jsonl (train rows, eval per epoch, summary)."""
    run_dir.mkdir(parents=True)
    config = {"run_dir": str(run_dir), "seed": seed, "precision": precision, "model": "resnet_debug", "epochs": epochs}
    (run_dir / "config.yaml").write_text("# recipe: cifar\n" + yaml.safe_dump(config))
    rows: list[dict[str, Any]] = []
    step = 0
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            step += 1
            loss = loss_scale * 2.3 * math.exp(-step / 15)
            rows.append(
                {
                    "kind": "train",
                    "step": step,
                    "epoch": epoch,
                    "loss": loss,
                    "lr": 0.1,
                    "grad_norm": 1.0,
                    "skipped": 0,
                    "images_per_second": 1000.0,
                }
            )
        accuracy = final_acc * (epoch + 1) / epochs
        rows.append({"kind": "eval", "step": step, "epoch": epoch + 1, "test_accuracy": accuracy, "test_loss": 1.0})
    rows.append(
        {
            "kind": "summary",
            "step": step,
            "epoch": epochs,
            "precision": precision,
            "final_test_accuracy": final_acc,
            "best_test_accuracy": final_acc + 0.01,
            "peak_memory_bytes": int(memory_mib * MIB),
            "memory_kind": "cuda_max_allocated",
            "cuda_max_reserved_bytes": int(memory_mib * 1.5 * MIB),
            "seconds_per_epoch": seconds,
            "images_per_second": 5000.0 / seconds,
        }
    )
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + extra_lines)
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, list[Path]]:
    fp32 = [
        write_run(tmp_path / "fp32-s0", precision="fp32", seed=0, final_acc=0.90, memory_mib=1000, seconds=10.0),
        write_run(tmp_path / "fp32-s1", precision="fp32", seed=1, final_acc=0.92, memory_mib=1002, seconds=12.0),
    ]
    bf16 = [
        write_run(
            tmp_path / "bf16-s0",
            precision="bf16-amp",
            seed=0,
            final_acc=0.91,
            memory_mib=600,
            seconds=6.0,
            loss_scale=1.1,
        )
    ]
    # a run that crashed mid-write and was resumed: a truncated line would be last; here a duplicate step follows
    fp16 = [
        write_run(
            tmp_path / "fp16-s0",
            precision="fp16",
            seed=0,
            final_acc=0.85,
            memory_mib=500,
            seconds=5.0,
            extra_lines='{"kind": "train", "step": 60, "epoch": 5, "loss": "nan"}\n{"kind": "tra',
        )
    ]
    return {"fp32": fp32, "bf16-amp": bf16, "fp16": fp16}


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, f"{path} is not a real plot ({len(data)} bytes)"


def test_read_metrics_handles_nan_duplicates_and_truncation(runs: dict[str, list[Path]]) -> None:
    rows = RunDir(runs["fp16"][0]).read_metrics()
    assert rows[0]["kind"] == "train" and rows[0]["step"] == 1
    assert math.isnan(rows[-1]["loss"]) and rows[-1]["step"] == 60  # "nan" string read back as float
    assert sum(r["kind"] == "train" and r["step"] == 60 for r in rows) == 2
    run = load_run(runs["fp16"][0])
    assert run.loss_steps.tolist() == list(range(1, 61))  # one value per step
    assert math.isnan(run.loss[-1]) and math.isfinite(run.loss[-2])  # step 60: the later (resumed) row wins
    assert run.accuracy.tolist() == pytest.approx([0.85 * e / 6 for e in range(1, 7)])


def test_plot_run_writes_pngs(runs: dict[str, list[Path]], tmp_path: Path) -> None:
    paths = plot_run(runs["fp32"][0], tmp_path / "out")
    assert [p.name for p in paths] == ["loss.png", "accuracy.png"]
    for path in paths:
        _assert_png(path)


def test_plot_comparison_writes_all_pngs(runs: dict[str, list[Path]], tmp_path: Path) -> None:
    paths = plot_comparison(runs, tmp_path / "cmp")
    assert sorted(p.name for p in paths) == sorted(COMPARISON_PNGS)
    for path in paths:
        _assert_png(path)
    single = plot_comparison({"fp32": runs["fp32"][0], "bf16-amp": runs["bf16-amp"][0]}, tmp_path / "cmp1")
    assert len(single) == 5


def test_results_table_values(runs: dict[str, list[Path]], tmp_path: Path) -> None:
    rows = [summarize_run(d, label) for label, dirs in runs.items() for d in dirs]
    assert rows[0]["final_train_loss"] == pytest.approx(2.3 * math.exp(-60 / 15))  # the last step's loss
    assert rows[0]["final_train_loss_step"] == 60
    write_results_table(rows, tmp_path / "results.md", tmp_path / "results.csv")
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0].startswith("| precision | seed(s) | final test acc. (%) | best test acc. (%, extra) |")
    body = [line for line in md[2:] if line.startswith("|")]
    assert len(body) == 3
    assert body[0].startswith("| fp32 | 0, 1 | 91.00 ± 1.41 | 92.00 ± 1.41 |")  # sample std of (90, 92)
    assert "| 1001 ± 1 | n/a | cuda_max_allocated | 11.00 ± 1.41 |" in body[0]
    assert body[1].startswith("| bf16-amp | 0 | 91.00 | 92.00 |")  # one seed: no ± part
    assert "±" not in body[1]
    with open(tmp_path / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["precision"] for r in table] == ["fp32", "bf16-amp", "fp16"]
    assert float(table[0]["final_test_accuracy_pct_mean"]) == pytest.approx(91.0)
    assert float(table[0]["final_test_accuracy_pct_std"]) == pytest.approx(math.sqrt(2))
    assert table[1]["final_test_accuracy_pct_std"] == ""
    assert float(table[2]["peak_memory_mib_mean"]) == pytest.approx(500, abs=0.01)
    assert table[0]["seeds"] == "0;1" and table[0]["num_seeds"] == "2"


def test_missing_numbers_show_as_na(tmp_path: Path) -> None:
    rows = [
        {"label": "fp16", "precision": "fp16", "seed": 0, "final_test_accuracy": 0.5},
        {"label": "fp16", "precision": "fp16", "seed": 1, "final_test_accuracy": None},
    ]
    write_results_table(rows, tmp_path / "r.md", tmp_path / "r.csv")
    line = (tmp_path / "r.md").read_text().splitlines()[2]
    assert line.startswith("| fp16 | 0, 1 | 50.00 (1 of 2 runs) | n/a |")


def test_percent_accuracies_are_normalised(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "pct", precision="fp32", seed=0, final_acc=91.0, memory_mib=1, seconds=1)
    row = summarize_run(run_dir)
    assert row["final_test_accuracy"] == pytest.approx(0.91)


def test_group_runs_merges_seeds_only(runs: dict[str, list[Path]]) -> None:
    dirs = [d for group in runs.values() for d in group]
    assert group_runs(dirs) == {"fp32": runs["fp32"], "bf16-amp": runs["bf16-amp"], "fp16": runs["fp16"]}


def test_a_copy_of_a_run_is_no_other_seed(runs: dict[str, list[Path]], tmp_path: Path) -> None:
    """Copies of one run (same config, same seed) were reported as seeds "0, 0, 0" with a std of 0."""
    import shutil

    copy = tmp_path / "copy-of-fp32"
    shutil.copytree(runs["fp32"][0], copy)
    dirs = [d for group in runs.values() for d in group]
    assert group_runs([*dirs, copy]) == group_runs(dirs)


def test_bad_inputs_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        RunDir(tmp_path / "missing").read_metrics()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no metrics\.jsonl"):
        RunDir(tmp_path / "empty").read_metrics()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(UsageError, match="no rows"):
        RunDir(tmp_path / "empty").read_metrics()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "eval"}\n')
    with pytest.raises(UsageError, match="line 2 is not valid JSON"):
        RunDir(tmp_path / "bad").read_metrics()
    (tmp_path / "bad" / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(UsageError, match="line 1 is not a metrics row"):
        RunDir(tmp_path / "bad").read_metrics()
    with pytest.raises(UsageError, match="no runs"):
        write_results_table([], tmp_path / "t.md", tmp_path / "t.csv")
    (tmp_path / "noloss").mkdir()
    (tmp_path / "noloss" / "metrics.jsonl").write_text('{"kind": "summary", "step": 0, "epoch": 0}\n')
    with pytest.raises(UsageError, match="no training loss"):
        plot_run(tmp_path / "noloss", tmp_path / "out")


def test_report_command(runs: dict[str, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = runs["fp32"][0]
    assert report_main([str(one)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(one / "plots" / n) for n in ("loss.png", "accuracy.png", "results.md", "results.csv")]

    dirs = [str(d) for group in runs.values() for d in group]
    assert report_main([*dirs, "--out-dir", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted([*COMPARISON_PNGS, "results.md", "results.csv"])
    for p in printed:
        assert Path(p).stat().st_size > 0
    assert "| fp32 | 0, 1 |" in (tmp_path / "report" / "results.md").read_text()

    with pytest.raises(UsageError, match="does not exist"):
        report_main([str(tmp_path / "nope")])
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(UsageError, match=r"no metrics\.jsonl"):
        report_main([dirs[0], str(tmp_path / "not-a-run")])


def test_saturated_accuracy_plots_stay_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """Every mode at 100%: no empty zoom inset, accuracy axes never pad past 100%, legends outside the data."""
    import trainlab.report.plots as plots

    figures: dict[str, Any] = {}
    real_save = plots._save

    def capture(fig: Any, out_dir: Path, name: str) -> Path:
        figures[name] = fig
        return real_save(fig, out_dir, name)

    monkeypatch.setattr(plots, "_save", capture)
    groups = {}
    for precision, seconds in (("fp32", 1.0), ("bf16-amp", 2.0)):
        run_dir = write_run(
            tmp_path / precision, precision=precision, seed=0, final_acc=1.0, memory_mib=10, seconds=seconds, epochs=12
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for row in rows:  # saturated: 100% from epoch 2 on
            if row["kind"] == "eval":
                row["test_accuracy"] = 0.9 if row["epoch"] == 1 else 1.0
            if row["kind"] == "summary":
                row["best_test_accuracy"] = 1.0
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        groups[precision] = [run_dir]
    plot_comparison(groups, tmp_path / "plots")
    accuracy_ax = figures["accuracy_vs_epoch.png"].axes[0]
    assert accuracy_ax.child_axes == [], "flat tail at 100% must not get a zoom inset"
    assert figures["accuracy_vs_time.png"].axes[0].get_ylim()[1] <= 100.5
    for name, fig in figures.items():
        legend = fig.axes[0].get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().x0 > fig.axes[0].bbox.x1 - 1, name
    loss_ax = figures["loss_vs_step.png"].axes[0]
    assert len(loss_ax.child_axes) == 1, "a falling loss keeps its tail zoom"
    assert not [w for w in recwarn if "No artists" in str(w.message)]


def test_report_modules_split_by_concept(python: str, run_env: dict[str, str]) -> None:
    """runs (reading), tables (results table) and plots (figures); only plots needs matplotlib."""
    import trainlab.engine.run_dir as run_dir_module
    import trainlab.report.plots as plots
    import trainlab.report.runs as runs_module
    import trainlab.report.tables as tables

    homes = {
        runs_module: [
            "latest_rows",
            "RunData",
            "load_run",
            "group_runs",
            "summarize_run",
        ],
        plots: ["plot_run", "plot_comparison"],
        tables: ["write_results_table", "mean_std"],
        run_dir_module: ["RunDir"],
    }
    for module, names in homes.items():
        assert all(getattr(module, name).__module__ == module.__name__ for name in names), module.__name__
    code = "import sys, trainlab.report.runs, trainlab.report.tables; print('matplotlib' in sys.modules)"
    out = subprocess.run([python, "-c", code], env=run_env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_report_cli_errors_and_print_config(
    runs: dict[str, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the dispatcher: one error line, exit 2; --print-config prints YAML and runs nothing."""
    assert cli_main(["report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "trainlab report: error: missing required RUN_DIR (on the command line or in the --config file); "
        "see `trainlab report --help`"
    ]
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("error:") == 1
    one = runs["fp32"][0]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", str(one), "--out-dir", str(tmp_path / "r"), "--print-config"])
    assert exit_info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == {"run_dirs": [str(one)], "out_dir": str(tmp_path / "r")}
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------ every recipe


def _write_rows(run_dir: Path, recipe: str, rows: list[dict[str, Any]], **config: Any) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"# recipe: {recipe}\n# command: trainlab train {recipe}\n" + yaml.safe_dump(
        {"run_dir": str(run_dir), "seed": 0, **config}
    ))  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _tokenizer_run(run_dir: Path) -> Path:
    rows: list[dict[str, Any]] = []
    for step in (1, 10, 20, 30):
        rows.append({"kind": "train", "step": step, "epoch": step // 16, "generator/loss": 1.0 / step,
                     "discriminator/loss": 0.7, "generator/lr": 1e-4})  # fmt: skip
    rows += [
        {"kind": "eval", "step": 16, "epoch": 1, "psnr": 18.0},
        {"kind": "eval", "step": 32, "epoch": 2, "psnr": 21.5},
    ]
    rows.append({"kind": "summary", "step": 32, "epoch": 2, "precision": "fp32", "final_psnr": 21.5, "best_psnr": 21.5,
                 "seconds_per_epoch": 3.0, "epochs_timed": 1})  # fmt: skip
    return _write_rows(run_dir, "tokenizer", rows, precision="fp32", epochs=2)


def _var_run(run_dir: Path, *, depth: int = 2, ce: float = 4.0) -> Path:
    rows: list[dict[str, Any]] = [
        {"kind": "train", "step": s, "epoch": 0, "loss": ce + 1 - s / 8, "cross_entropy_mean": ce + 1 - s / 8}
        for s in (1, 8)
    ]
    rows.append({"kind": "eval", "step": 8, "epoch": 1, "val_cross_entropy_last_scale": ce, "cross_entropy_mean": ce})
    summary = {"kind": "summary", "step": 8, "epoch": 1, "precision": "bf16-amp", "seconds_per_epoch": 2.0}
    summary |= {"final_val_cross_entropy_last_scale": ce, "best_val_cross_entropy_last_scale": ce, "epochs_timed": 1}
    rows.append(summary)
    return _write_rows(run_dir, "var", rows, precision="bf16-amp", depth=depth, model=f"var-d{depth}", epochs=1)


def _capture(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import trainlab.report.plots as plots

    figures: dict[str, Any] = {}
    real_save = plots._save

    def capture(fig: Any, out_dir: Path, name: str) -> Path:
        figures[name] = fig
        return real_save(fig, out_dir, name)

    monkeypatch.setattr(plots, "_save", capture)
    return figures


def test_tokenizer_run_plots_every_loss_and_its_psnr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _capture(monkeypatch)
    run_dir = _tokenizer_run(tmp_path / "tok")
    paths = plot_run(run_dir, tmp_path / "out")
    assert [p.name for p in paths] == ["loss.png", "eval.png"]
    lines = figures["loss.png"].axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "generator/loss (4 logged steps)",
        "discriminator/loss (4 logged steps)",
    ]
    assert list(figures["eval.png"].axes[0].get_lines()[0].get_ydata()) == [18.0, 21.5]
    row = summarize_run(run_dir)
    assert (row["eval_metric"], row["final_eval"], row["final_train_loss"]) == ("psnr", 21.5, pytest.approx(1 / 30))
    write_results_table([row], tmp_path / "r.md", tmp_path / "r.csv")
    md = (tmp_path / "r.md").read_text().splitlines()
    assert "final test acc." not in md[0] and "| final eval metric | best eval metric |" in md[0]
    assert "| psnr 21.5 | psnr 21.5 | 0.03333 (step 30) |" in md[2] and "| 3.00 (n=1 epoch) |" in md[2]


def test_var_runs_fill_the_table_and_a_parent_folder_is_searched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    parent = tmp_path / "runs"
    _var_run(parent / "d2", depth=2, ce=4.0)
    _var_run(parent / "deeper" / "d4", depth=4, ce=3.5)
    _tokenizer_run(parent / "tok")
    (parent / "d2" / "tb").mkdir()
    assert report_main([str(parent)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-2:] == [str(parent / "report" / "results.md"), str(parent / "report" / "results.csv")]
    assert any(p.endswith("eval_vs_epoch.png") for p in printed)
    md = (parent / "report" / "results.md").read_text()
    assert "val_cross_entropy_last_scale 4 |" in md and "val_cross_entropy_last_scale 3.5 |" in md
    assert "psnr 21.5" in md
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("different recipes tokenizer, var; models var-d2, var-d4" in w for w in warnings), warnings
    with pytest.raises(UsageError, match="nor in any folder under it"):
        report_main([str(parent / "d2" / "tb")])


def test_short_runs_show_their_points_and_epochs_are_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8-step run logs steps 1 and 8: both are drawn as markers; epoch ticks never fall between epochs."""
    figures = _capture(monkeypatch)
    run_dir = write_run(tmp_path / "short", precision="fp32", seed=0, final_acc=0.5, memory_mib=1, seconds=1.0,
                        epochs=2, steps_per_epoch=4)  # fmt: skip
    plot_run(run_dir, tmp_path / "out")
    (line,) = figures["loss.png"].axes[0].get_lines()
    assert line.get_marker() == "o" and list(line.get_xdata()) == list(range(1, 9))
    ax = figures["accuracy.png"].axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_identical_series_are_told_apart_and_timing_notes_n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _capture(monkeypatch)
    same = {
        p: write_run(tmp_path / p, precision=p, seed=0, final_acc=0.9, memory_mib=10, seconds=2.0)
        for p in ("fp32", "tf32")
    }
    for run_dir in same.values():  # one timed epoch each
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        summary = json.loads(lines[-1]) | {"epochs_timed": 1}
        (run_dir / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(summary)]) + "\n")
    plot_comparison(same, tmp_path / "cmp")
    for name in ("loss_vs_step.png", "accuracy_vs_epoch.png"):
        ax = figures[name].axes[0]
        labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert labels[1] == "tf32 (same values as fp32)", labels
        styles = [line.get_linestyle() for line in ax.get_lines()[:2]]
        assert styles[0] != styles[1]
    texts = [t.get_text() for t in figures["time_per_epoch.png"].axes[0].texts]
    assert texts == ["2.00\nn=1 epoch", "2.00\nn=1 epoch"]
