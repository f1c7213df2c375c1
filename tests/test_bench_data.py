"""`trainlab bench data RECIPE`: the recipe's real training loader timed, its JSON keys, and its flags checked before
anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainlab.commands import bench
from trainlab.commands.bench_data import take_bench_options
from trainlab.errors import UsageError


def test_json_gives_the_rate_the_workers_and_the_sample_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["data", "cifar", "--data.kind", "fake", "--data.fake-size", "128", "--batch-size", "16"]
    argv += ["--seconds", "0.3", "--json", "--run-dir", str(tmp_path / "run")]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workers"] == 0
    assert result["samples_per_second"] > 0 and result["batches"] >= 1
    assert result["samples_per_second_per_core"] == result["samples_per_second"]
    assert result["sample_shapes"] == {"image": [3, 32, 32], "label": []}


def test_the_bench_flags_are_taken_out_and_the_rest_left_to_the_recipe() -> None:
    options, rest = take_bench_options(["--num-workers", "3", "--batch-size", "8", "--json", "--seconds=2.5"])
    assert (options.seconds, options.json) == (2.5, True)
    assert rest == ["--num-workers", "3", "--batch-size", "8"]  # the loader's workers are the recipe's


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--num-workers", "-1"], "--num-workers"), (["--seconds", "0"], "--seconds"), ([], "unknown recipe")],
)
def test_wrong_flags_stop_with_one_line_before_anything_is_built(flags: list[str], needle: str) -> None:
    recipe = ["nosuch"] if needle == "unknown recipe" else ["cifar"]
    with pytest.raises(UsageError, match=needle):
        bench.main(["data", *recipe, *flags])


def test_a_run_dir_in_use_or_of_another_recipe_is_left_alone(tmp_path: Path) -> None:
    """A recipe's data may write into its run directory (VAR's token cache): never into a live run or another's."""
    from trainlab.engine.run_lock import RunDirLock

    argv = ["data", "cifar", "--data.kind", "fake", "--data.fake-size", "64", "--batch-size", "16", "--seconds", "0.1"]
    busy = tmp_path / "busy"
    busy.mkdir()
    with RunDirLock(busy), pytest.raises(UsageError, match=r"busy is in use by pid \d+"):
        bench.main([*argv, "--run-dir", str(busy)])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text("# recipe: moco\nseed: 0\n")
    with pytest.raises(UsageError, match=r"holds a 'moco' run; `bench data cifar` may write its data caches there"):
        bench.main([*argv, "--run-dir", str(other)])
    assert sorted(p.name for p in other.iterdir()) == ["config.yaml"]
