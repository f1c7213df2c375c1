"""`trainlab plan`'s time and cost: JSON keys, the `--gpu all` table, GPUs needed, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.memory.gpus import GPU_PROFILES
from trainlab.memory.planner import divisors

TOY = ["toy", "--num-samples", "64", "--batch-size", "32"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path / "cache"))  # no stored efficiency or data rate


def test_json_has_the_time_and_cost_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *TOY, "--gpu", "H100-80GB", "--price", "H100-80GB=2.0", "--dataset-size", "6400", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["flops_per_step"], int) and out["flops_per_step"] > 0
    assert out["flops_per_sample"] == round(out["flops_per_step"] / 32)
    assert out["efficiency_source"] == "assumed" and out["efficiency_assumed"] == 0.10  # small-convnet
    assert out["efficiency_measured_on"] is None
    assert out["steps"] == 6400 // 32 * 1  # one epoch (the toy default)
    assert out["run_hours"] == pytest.approx(out["steps"] * out["step_seconds"] / 3600)
    assert out["gpu_hours"] == pytest.approx(out["run_hours"])
    assert out["cost_usd"] == pytest.approx(out["gpu_hours"] * 2.0) and out["price_source"] == "given"
    assert out["data_cores_needed"] is None  # no stored measurement
    assert "candidates" not in out


def test_a_shipped_efficiency_is_named_with_its_three_digits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainlab.memory import efficiency

    monkeypatch.setitem(efficiency.SHIPPED, ("H100-80GB", "small-convnet"), (0.056, "a toy step on an H100"))
    assert main(["plan", *TOY, "--gpu", "H100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["efficiency_assumed"], out["efficiency_source"]) == (0.056, "measured")
    assert out["efficiency_measured_on"] == "a toy step on an H100"
    assert main(["plan", *TOY, "--gpu", "H100-80GB"]) == 0
    assert "MFU 0.056 measured (small-convnet; measured by trainlab: a toy step on an H100)" in capsys.readouterr().out


def test_gpus_needed_is_the_smallest_count_not_gpus_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--gpu", "RTX4090-24GB", "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus_needed"] == 1


def test_gpu_all_is_one_table_sorted_by_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--gpu", "all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert {(r["gpu"], r["gpus"]) for r in rows} == {(g, n) for g in GPU_PROFILES for n in (1, 2, 4, 8)}
    assert all(r["margin_bytes"] >= 0 for r in rows)  # only what fits
    costs = [r["cost_usd"] for r in rows]
    assert costs == sorted(costs)
    assert sum(r["cheapest"] for r in rows) == 1 and rows[0]["cheapest"]
    fastest = [r for r in rows if r["fastest"]]
    assert len(fastest) == 1 and fastest[0]["step_seconds"] == min(r["step_seconds"] for r in rows)
    assert main(["plan", *TOY, "--gpu", "all"]) == 0
    text = capsys.readouterr().out
    assert "every GPU x count that fits" in text and "an example price" in text


def test_a_comma_list_plans_those_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--gpu", "H100-80GB, L20-48GB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert {r["gpu"] for r in rows} == {"H100-80GB", "L20-48GB"}


def test_without_a_data_rate_the_command_that_measures_it_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, "--gpu", "H100-80GB"]) == 0
    assert "trainlab bench data toy --num-samples 64 --batch-size 32 --json >" in capsys.readouterr().out


def test_a_stored_data_rate_gives_the_cores(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    stored = tmp_path / "cache" / "bench_data" / "toy.json"
    stored.parent.mkdir(parents=True)
    stored.write_text(json.dumps({"samples_per_second_per_core": 1000.0}))
    assert main(["plan", *TOY, "--gpu", "H100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data_cores_needed"] == pytest.approx(out["samples_per_second"] / 1000.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["fifo", "device", "nan", "tiny"])
def test_a_store_that_is_no_store_is_nothing_stored(
    what: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The cache's stores (measured efficiencies, data rates) are read as small regular files: a FIFO in their place
    hung the plan, /dev/zero filled its memory; a NaN or 1e-300 rate printed NaN / Infinity into the JSON."""
    stores = [tmp_path / "cache" / "efficiency.json", tmp_path / "cache" / "bench_data" / "toy.json"]
    for store in stores:
        store.parent.mkdir(parents=True, exist_ok=True)
        if what == "fifo":
            os.mkfifo(store)
        elif what == "device":
            store.symlink_to("/dev/zero")
        else:
            store.write_text('{"samples_per_second_per_core": ' + ("NaN" if what == "nan" else "1e-300") + "}")
    assert main(["plan", *TOY, "--gpu", "H100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert out["data_cores_needed"] is None and out["efficiency_source"] == "assumed"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "B200"], "unknown GPU 'B200'"),
        (["--gpu", "H100-80GB,B200"], "unknown GPU 'B200'"),
        (["--gpu", " , "], "--gpu"),
        (["--price", "H100-80GB=2"], "--price prices a planned GPU"),
        (["--gpu", "all", "--price", "B200=2"], "unknown GPU 'B200'"),
        (["--gpu", "all", "--price", "H100-80GB=cheap"], "positive number"),
        (["--gpu", "all", "--price", "H100-80GB=-1"], "positive number"),
        (["--gpu", "all", "--price", "H100-80GB"], "NAME=USD_PER_HOUR"),
        (["--gpu", "all", "--price"], "--price needs"),
        (["--gpu", "L20-48GB", "--price", "H100-80GB=2"], "is not planned"),
        (["--gpu", "48GiB", "--price", "48GiB=2"], "by name"),
        (["--dataset-size", "-5"], "--dataset-size"),
        (["--gpu", "all", "--device", "cpu"], "--gpu plans for a CUDA device"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TOY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_printed_data_command_runs_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command creates the store's folder, names the home folder `~` and quotes a path with a space."""
    from trainlab.memory.run_cost import measure_data_command

    monkeypatch.setenv("TRAINLAB_CACHE", str(tmp_path / "a cache"))
    command = measure_data_command("toy", "--batch-size 8")
    assert command == (
        f"mkdir -p '{tmp_path}/a cache/bench_data' && trainlab bench data toy --batch-size 8 --json > "
        f"'{tmp_path}/a cache/bench_data/toy.json'"
    )
    monkeypatch.setenv("TRAINLAB_CACHE", str(Path.home() / ".cache" / "trainlab"))
    assert measure_data_command("toy").endswith("--json > ~/.cache/trainlab/bench_data/toy.json")


def test_divisors_are_those_of_a_scan_and_a_huge_batch_plans_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's accumulation and GPU-count searches run over the batch's divisors: found from its prime factors
    (a batch of 2**40 took hours when 1..batch was scanned)."""
    for n in range(1, 1500):
        assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0], n
    assert divisors(2**40) == [2**e for e in range(41)] and divisors(2**31 - 1) == [1, 2**31 - 1]
    big = ["toy", "--num-samples", str(2**40), "--batch-size", str(2**40), "--gpu", "H100-80GB", "--json"]
    assert main(["plan", *big]) == 0
    assert json.loads(capsys.readouterr().out)["max_micro_batch"] > 0


@pytest.mark.parametrize("argv", [["--batch-size", "128"], ["--dataset-size", "16"]])
def test_a_dataset_smaller_than_the_batch_gets_memory_but_no_run_time(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run would be refused (no step in an epoch): the memory is planned, the time and cost are not ("run: 0
    steps = 0.0 min, $0.00" before), and a note says why."""
    assert main(["plan", *TOY, *argv, "--gpu", "H100-80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["run_hours"] is None and out["cost_usd"] is None
    assert any("hold no batch of" in note and "`trainlab train` refuses this run" in note for note in out["notes"])
