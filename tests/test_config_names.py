"""trainlab.config: `--config NAME` picks a shipped config, "did you mean" for unknown flags and keys, unreadable
files and wrong-typed values are one-line UsageErrors naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.config import from_dict, load_yaml, parse
from trainlab.configs import config_path, list_configs
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig
from trainlab.recipes.var import VARTrainConfig


def _one_line_error(cls: type, argv: list[str]) -> str:
    with pytest.raises(UsageError) as info:
        parse(cls, argv, prog="t")
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["var_d16", "var_d16.yaml"])
def test_config_selects_a_shipped_config_by_name(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no file of that name here: the shipped one is used
    by_name = parse(VARTrainConfig, ["--config", name, "--epochs", "3"], prog="t")
    by_path = parse(VARTrainConfig, ["--config", str(config_path("var_d16")), "--epochs", "3"], prog="t")
    assert by_name == by_path and by_name.depth == 16 and by_name.epochs == 3


def test_a_file_of_that_name_wins_over_the_shipped_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("var_d16").write_text("depth: 20\n")
    assert parse(VARTrainConfig, ["--config", "var_d16"], prog="t").depth == 20


def test_unknown_config_name_lists_the_shipped_ones() -> None:
    message = _one_line_error(ToyConfig, ["--config", "var_d61"])
    assert "no shipped config is named 'var_d61' (did you mean var_d16?)" in message
    assert all(name in message for name in list_configs())
    assert load_yaml("cifar_resnet18")["model"] == "cifar_resnet18"


def test_unknown_flag_suggests_the_closest() -> None:
    message = _one_line_error(ToyConfig, ["--optim.learnig-rate", "0.1"])
    assert "unrecognized arguments: --optim.learnig-rate 0.1; did you mean --optim.learning-rate?" in message
    message = _one_line_error(ToyConfig, ["--schedule.warmup-fracton=0.1"])
    assert "did you mean --schedule.warmup-fraction?" in message
    assert "did you mean" not in _one_line_error(ToyConfig, ["--zzzz", "1"])


def test_unknown_config_key_suggests_the_closest(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("optim: {learnig_rate: 0.1}\nschedule: {warmup_fracton: 0.1}\n")
    message = _one_line_error(ToyConfig, ["--config", str(path)])
    assert "config.optim: unknown key(s) learnig_rate (did you mean learning_rate?)" in message
    with pytest.raises(
        UsageError, match=r"config.schedule: unknown key\(s\) warmup_fracton \(did you mean warmup_fraction\?"
    ):
        from_dict(ToyConfig, {"schedule": {"warmup_fracton": 0.1}})


def test_non_utf8_and_invalid_yaml_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("run_dir: caf\xe9\n".encode("latin-1"))
    message = _one_line_error(ToyConfig, ["--config", str(latin1)])
    assert f"config file {latin1} is not UTF-8 text" in message
    broken = tmp_path / "broken.yaml"
    broken.write_text("epochs: [1, 2\n")
    assert f"config file {broken} is not valid YAML" in _one_line_error(ToyConfig, ["--config", str(broken)])
    assert main(["train", "toy", "--config", str(latin1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not UTF-8" in err


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"epochs": True}, "config.epochs: expected int, got True"),
        ({"run_dir": ["a", "b"]}, "config.run_dir: expected Path"),
        ({"wandb_project": {"a": 1}}, "config.wandb_project: expected str"),
        ({"schedule": {"warmup_fraction": "three"}}, "config.schedule.warmup_fraction: expected float, got 'three'"),
        ({"schedule": {"kind": ["cosine"]}}, "config.schedule.kind: ['cosine'] is not one of"),
        ({"schedule": 5}, "config.schedule: expected a mapping, got int"),
    ],
)  # fmt: skip
def test_wrong_typed_values_top_level_and_nested(data: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError) as info:
        from_dict(ToyConfig, data)
    assert message in str(info.value) and "\n" not in str(info.value)
