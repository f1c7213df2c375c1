"""trainlab.config: positional and list fields, Literal choices (flags and YAML), required fields, aliases,
--print-config; a run directory's config.yaml loads back with --config and records its command line."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Literal

import pytest
import yaml
from conftest import REPO

import trainlab.config as config_module
from trainlab.cli import main
from trainlab.config import from_dict, option, parse, to_dict
from trainlab.engine.runinfo import command_line, write_config
from trainlab.errors import UsageError
from trainlab.recipes.toy import ToyConfig

Color = Literal["red", "green", "blue"]


@dataclasses.dataclass(kw_only=True)
class _Inner:
    """Nested."""

    shade: Color = option("red", "a colour")


@dataclasses.dataclass(kw_only=True)
class _Example:
    """An example config."""

    inputs: list[Path] = option(help="input files", positional=True, metavar="FILE")
    colors: list[Color] = option(["red"], "one or more colours")
    accent: Color | None = option(None, "an optional colour")
    size: int = option(3, "a size", metavar="N", aliases=("--n",))
    inner: _Inner = option(_Inner(), "nested")


def test_positional_list_choices_and_aliases() -> None:
    cfg = parse(_Example, ["a.txt", "b.txt", "--colors", "green", "blue", "--n", "5", "--inner.shade", "blue"], "t")
    assert cfg.inputs == [Path("a.txt"), Path("b.txt")] and cfg.colors == ["green", "blue"]
    assert (cfg.size, cfg.inner.shade, cfg.accent) == (5, "blue", None)
    assert parse(_Example, ["a", "--size", "4", "--accent", "green"], "t").size == 4
    assert parse(_Example, ["a", "--accent", "none"], "t").accent is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["a", "--colors", "red", "pink"], "--colors: invalid choice: 'pink' (choose from 'red', 'green', 'blue')"),
        (["a", "--accent", "pink"], "argument --accent: invalid choice: 'pink'"),
        (["a", "--inner.shade", "pink"], "argument --inner.shade: invalid choice: 'pink'"),
        (["--size", "2"], "missing required FILE (on the command line or in the --config file); see `t --help`"),
        (["a", "--n"], "argument --size/--n: expected one argument; see `t --help`"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse(_Example, argv, "t")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_yaml_values_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inputs: [x.txt]\ncolors: [green]\ninner: {shade: blue}\n")
    cfg = parse(_Example, ["--config", str(path)], "t")  # a required positional may come from the file
    assert (cfg.inputs, cfg.colors, cfg.inner.shade) == ([Path("x.txt")], ["green"], "blue")
    for text, message in [
        ("inputs: [x]\ncolors: [green, pink]\n", "config.colors: 'pink' is not one of: red, green, blue"),
        ("inputs: [x]\ninner: {shade: pink}\n", "config.inner.shade: 'pink' is not one of: red, green, blue"),
        ("inputs: [x]\naccent: 7\n", "config.accent: 7 is not one of"),
    ]:
        path.write_text(text)
        with pytest.raises(UsageError) as info:
            parse(_Example, ["--config", str(path)], "t")
        assert message in str(info.value)
    path.write_text("wandb: maybe\n")
    with pytest.raises(UsageError) as info:
        parse(ToyConfig, ["--config", str(path)], "t")
    assert "config.wandb: 'maybe' is not one of: off, online, offline" in str(info.value)


def test_from_dict_required_keys_and_round_trip() -> None:
    with pytest.raises(UsageError, match="where: missing required key"):
        from_dict(_Example, {"size": 2}, where="where")
    cfg = from_dict(_Example, {"inputs": ["a"], "colors": ["blue"], "accent": "green"})
    assert from_dict(_Example, yaml.safe_load(yaml.safe_dump(to_dict(cfg)))) == cfg


def test_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(_Example, ["a", "--n", "9", "--print-config"], "t")
    assert info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == {
        "inputs": ["a"],
        "colors": ["red"],
        "accent": None,
        "size": 9,
        "inner": {"shade": "red"},
    }


def test_help_shows_choices_required_and_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(_Example, ["--help"], "t")
    out = capsys.readouterr().out
    assert "--colors {red,green,blue} [{red,green,blue} ...]" in out
    assert "--size N, --n N" in out and "FILE" in out and "input files (required)" in out
    assert "--print-config" in out


@dataclasses.dataclass(kw_only=True)
class _NestedPositional:
    """A positional field inside a nested config: a programming error."""

    names: list[str] = option(["x"], "names", positional=True)


@dataclasses.dataclass(kw_only=True)
class _Outer:
    """Holds the nested positional."""

    inner: _NestedPositional = option(_NestedPositional(), "nested")


def test_positional_fields_must_be_top_level() -> None:
    with pytest.raises(TypeError, match="only top-level fields can be positional"):
        parse(_Outer, [], "t")


def test_every_public_config_function_has_a_docstring() -> None:
    public = [
        obj
        for name, obj in vars(config_module).items()
        if inspect.isfunction(obj) and not name.startswith("_") and obj.__module__ == config_module.__name__
    ]
    assert {f.__name__ for f in public} >= {"option", "from_dict", "to_dict", "load_yaml", "merge", "parse"}
    assert all(inspect.getdoc(f) for f in public), [f.__name__ for f in public if not inspect.getdoc(f)]


# ------------------------------------------------------------------------------------------------ run directories
def test_command_line_is_pastable() -> None:
    assert command_line(["/venv/bin/trainlab", "train", "toy", "--run-dir", "my runs"]) == (
        "trainlab train toy --run-dir 'my runs'"
    )
    main_py = str(REPO / "trainlab" / "__main__.py")
    assert command_line([main_py, "train", "cifar"]) == "python -m trainlab train cifar"
    assert command_line(["/usr/bin/pytest", "-q"]) == "/usr/bin/pytest -q"


def test_written_config_records_the_command_and_loads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--seed", "5", "--wandb", "offline", "--schedule.kind", "linear", "--run-dir", str(tmp_path / "a b")]
    monkeypatch.setattr("sys.argv", ["/venv/bin/trainlab", "train", "toy", *argv, "--note", "two\nlines"])
    cfg = parse(ToyConfig, argv, "t")
    write_config(tmp_path, "toy", to_dict(cfg))
    text = (tmp_path / "config.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("# command: ")]
    assert header == [f"# command: trainlab train toy {' '.join(argv[:-1])} '{tmp_path / 'a b'}' --note 'two\\nlines'"]
    assert parse(ToyConfig, ["--config", str(tmp_path / "config.yaml")], "t") == cfg
    environment = yaml.safe_load((tmp_path / "environment.yaml").read_text())
    assert environment["command"].startswith("trainlab train toy --seed 5") and environment["recipe"] == "toy"


def test_a_trained_run_dir_reruns_with_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: the engine's config.yaml is accepted by `trainlab train toy --config` (and by --print-config)."""
    run_dir = tmp_path / "run"
    assert main(["train", "toy", "--run-dir", str(run_dir), "--max-steps", "2", "--seed", "4"]) == 0
    assert "# command: " in (run_dir / "config.yaml").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", "toy", "--config", str(run_dir / "config.yaml"), "--print-config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (printed["seed"], printed["max_steps"], printed["run_dir"]) == (4, 2, str(run_dir))


def test_one_git_sha_in_the_package() -> None:
    """runinfo.git_sha is the only place that asks git for the commit."""
    users = [p for p in (REPO / "trainlab").rglob("*.py") if "rev-parse" in p.read_text()]
    assert users == [REPO / "trainlab" / "engine" / "runinfo.py"]


@dataclasses.dataclass(kw_only=True)
class _Pair:
    """Nested, two fields."""

    first: int = option(1, "first")
    second: int = option(2, "second")


@dataclasses.dataclass(kw_only=True)
class _WithGroup:
    """A config whose nested group has its own defaults."""

    pair: _Pair = option(_Pair(first=10, second=20), "a group with non-class defaults")


def test_a_partial_group_keeps_the_fields_own_defaults(tmp_path: Path) -> None:
    """`--pair.first 5` changes that one setting: `pair.second` stays the field's default (20), not the class's (2);
    the same for YAML and `from_dict`."""
    assert parse(_WithGroup, ["--pair.first", "5"], prog="x").pair == _Pair(first=5, second=20)
    path = tmp_path / "c.yaml"
    path.write_text("pair:\n  second: 7\n")
    assert parse(_WithGroup, ["--config", str(path)], prog="x").pair == _Pair(first=10, second=7)
    assert from_dict(_WithGroup, {"pair": {"first": 3}}).pair == _Pair(first=3, second=20)
