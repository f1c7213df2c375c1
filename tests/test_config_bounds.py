"""Every number a user can set has a declared range, checked where the config is parsed: NaN, an infinity or a value
outside the range is a one-line UsageError naming the flag (before anything is built or trained), and `--help`
shows the range. The config classes are found by scanning the package source, so a new config cannot slip past."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from trainlab.cli import main
from trainlab.config import (
    Auto,
    Range,
    build_parser,
    check_ranges,
    field_flag,
    field_range,
    from_dict,
    load_yaml,
    option,
    parse,
    range_error,
)
from trainlab.configs import config_path, list_configs
from trainlab.errors import UsageError
from trainlab.recipes import get_recipe, list_recipes
from trainlab.recipes.toy import ToyConfig

PACKAGE = REPO / "trainlab"


# ------------------------------------------------------------------------------------------ finding the configs
def _declares_options(node: ast.ClassDef) -> bool:
    """A class body with at least one `name: type = option(...)` field."""
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call):
            func = item.value.func
            if (isinstance(func, ast.Name) and func.id == "option") or (
                isinstance(func, ast.Attribute) and func.attr == "option"
            ):
                return True
    return False


def _config_classes() -> list[type]:
    """Every class in the package whose fields are declared with `option` (the configs `parse` can build)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and _declares_options(node)]
        if names:
            module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
            found += [getattr(module, name) for name in names]
    return found


CONFIGS = _config_classes()


def _parse_targets() -> list[tuple[Path, str]]:
    """The first argument of every `parse(...)` call in the package, as source text."""
    targets = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "parse" and node.args:
                targets.append((path, ast.unparse(node.args[0])))
    return targets


def test_the_scan_finds_every_config_the_cli_parses() -> None:
    names = {cls.__name__ for cls in CONFIGS}
    assert {get_recipe(name).config_class.__name__ for name in list_recipes()} <= names
    assert {"TrainConfig", "ScheduleConfig", "SampleConfig", "EditConfig", "DemoConfig"} <= names
    assert {"KnnConfig", "FidConfig", "JudgeConfig", "PrecisionBenchConfig", "ReportConfig", "RunsConfig"} <= names
    targets = _parse_targets()
    assert len(targets) >= 10, targets
    for path, target in targets:
        assert target in names or target.endswith(".config_class"), f"{path}: parse({target}, ...) is not scanned"


# ----------------------------------------------------------------------------------------- the numeric fields
@dataclasses.dataclass(frozen=True)
class NumericField:
    cls: type  # the top-level config
    dotted: str  # schedule.final_ratio
    kind: type  # int or float
    tp: Any  # the annotation: int, float | None, tuple[int, ...], ...
    field: dataclasses.Field[Any]

    @property
    def flag(self) -> str:
        return field_flag(self.dotted, self.field)

    def __str__(self) -> str:
        return f"{self.cls.__name__}.{self.dotted}"


def _numeric(tp: Any) -> type | None:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _numeric(args[0])
    if origin in (list, tuple):
        return _numeric(args[0]) if args else None
    return tp if tp in (int, float) else None


def _numeric_fields(cls: type, top: type | None = None, prefix: str = "") -> list[NumericField]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _numeric_fields(tp, top or cls, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif (kind := _numeric(tp)) is not None:
            out.append(NumericField(top or cls, prefix + f.name, kind, tp, f))
    return out


FIELDS = [nf for cls in CONFIGS for nf in _numeric_fields(cls)]


def _required_argv(cls: type) -> list[str]:
    """Placeholder values for the required fields (the ranges are checked before any file is looked at)."""
    argv = []
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            argv += ["x"] if f.metadata.get("positional") else [f"--{f.name.replace('_', '-')}=x"]
    return argv


def _required_data(cls: type) -> dict[str, Any]:
    return {
        f.name: ["x"] if typing.get_origin(typing.get_type_hints(cls)[f.name]) is list else "x"
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


def _outside(bounds: Range, kind: type) -> list[float]:
    """Values just outside each side of the range (never one of its sentinels), plus the type's own limits."""
    values: list[float] = []
    if bounds.ge is not None:
        values.append(bounds.ge - 1 if kind is int else math.nextafter(bounds.ge, -math.inf))
    if bounds.gt is not None:
        values.append(bounds.gt)
    if bounds.le is not None:
        values.append(bounds.le + 1 if kind is int else math.nextafter(bounds.le, math.inf))
    if bounds.lt is not None:
        values.append(bounds.lt)
    values = [v - 1 if v in bounds.sentinels else v for v in values]
    assert values and not any(bounds.admits(v) for v in values), (bounds, values)
    # beyond an int64 / a float32 even where no upper bound is declared
    return [*values, 2**63 if kind is int else 1e39]


def _text(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


@pytest.mark.parametrize("nf", FIELDS, ids=str)
def test_every_number_has_a_range_that_help_shows_and_parsing_enforces(nf: NumericField) -> None:
    bounds = field_range(nf.field)
    assert bounds is not None, f"{nf}: declare its range with option(..., ge=/gt=/le=/lt=)"
    default = nf.field.default
    if default is dataclasses.MISSING and nf.field.default_factory is not dataclasses.MISSING:
        default = nf.field.default_factory()
    assert range_error(default, nf.tp, bounds) is None

    parser = build_parser(nf.cls, "t", "d")
    action = next(a for a in parser._actions if a.dest == nf.dotted)
    assert (action.help or "").endswith(f"); range: {bounds.core()}"), action.help
    assert f"range: {bounds.core()}" in " ".join(parser.format_help().split())

    values: list[float] = [*_outside(bounds, nf.kind), math.nan, -math.inf]
    if not bounds.allow_inf:
        values.append(math.inf)
    for value in [values[0], math.nan]:  # the command line (the same `from_dict` as YAML, below, checks it)
        with pytest.raises(UsageError) as info:
            parse(nf.cls, [*_required_argv(nf.cls), f"{nf.flag}={_text(value)}"], "t")
        message = str(info.value)
        assert "\n" not in message and f"got {_text(value)}" in message.replace("'", ""), (nf, value, message)
        assert nf.flag in message or nf.dotted in message, (nf, value, message)
    for value in values:
        data = _required_data(nf.cls)
        keys = nf.dotted.split(".")
        nested = data
        for key in keys[:-1]:
            nested = nested.setdefault(key, {})
        nested[keys[-1]] = value
        with pytest.raises(UsageError) as info:  # a YAML file's values
            from_dict(nf.cls, data)
        message = str(info.value)
        assert "\n" not in message and f"got {_text(value)}" in message.replace("'", ""), (nf, value, message)
        assert nf.flag in message or nf.dotted in message, (nf, value, message)


@pytest.mark.parametrize("nf", [nf for nf in FIELDS if (b := field_range(nf.field)) and b.allow_inf], ids=str)
def test_a_field_that_allows_infinity_takes_it(nf: NumericField) -> None:
    assert range_error(math.inf, float, field_range(nf.field)) is None
    assert range_error(math.nan, float, field_range(nf.field)) is not None


def test_shipped_configs_are_within_the_ranges() -> None:
    classes = {"var": "var", "moco": "moco", "cifar": "cifar", "tokenizer": "tokenizer"}
    for name in list_configs():
        recipe = next(recipe for prefix, recipe in classes.items() if name.startswith(prefix))
        path = config_path(name)
        assert path is not None
        check_ranges(from_dict(get_recipe(recipe).config_class, load_yaml(path), where=str(path)))


# ---------------------------------------------------------------------------------------- the reported cases
TOY = ["train", "toy", "--device", "cpu", "--max-steps", "2"]
VAR = ["train", "var", "--depth", "2", "--embed-dim", "64", "--num-heads", "2", "--tokenizer-model", "vqvae_debug"]
TOKENIZER = ["train", "tokenizer", "--model", "vqvae_debug", "--patch-nums", "1", "2", "3", "4", "--image-size", "16"]
MOCO = ["train", "moco", "--model", "tv_resnet_debug", "--data.kind", "digits", "--image-size", "16"]
MOCO += ["--data.eval-limit", "64"]
SAMPLE = ["sample", "--tokenizer-weights", "v.pth", "--var-weights", "w.pth", "--classes", "1", "--out", "g.png"]
EDIT = [
    "edit",
    "--tokenizer-weights",
    "v.pth",
    "--var-weights",
    "w.pth",
    "--image",
    "i.png",
    "--box",
    "0",
    "0",
    "8",
    "8",
    "--out",
    "g.png",
]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([*TOY, "--optim.learning-rate", "1e308"], "--optim.learning-rate must be > 0 or -1 and within float32's"),
        ([*TOY, "--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
        ([*TOY, "--dropout=-0.1"], "--dropout must be in [0, 1), got -0.1"),
        ([*TOY, "--optim.weight-decay=-1"], "--optim.weight-decay must be >= 0, got -1"),
        ([*TOY, "--num-classes", "0"], "--num-classes must be >= 1, got 0"),
        ([*TOY, "--num-features", "0"], "--num-features must be >= 1, got 0"),
        ([*TOY, "--hidden", "0"], "--hidden must be >= 1, got 0"),
        ([*TOY, "--hidden=-4"], "--hidden must be >= 1, got -4"),
        ([*TOY, "--num-samples=-10"], "--num-samples must be >= 1, got -10"),
        ([*TOY, "--schedule.final-ratio", "nan"], "--schedule.final-ratio must be a finite number >= 0, got nan"),
        ([*TOY, "--schedule.final-ratio", "inf"], "--schedule.final-ratio must be a finite number >= 0, got inf"),
        ([*TOY, "--schedule.final-ratio=-5", "--schedule.kind", "linear"], "--schedule.final-ratio must be >= 0"),
        ([*TOY, "--schedule.warmup-start-ratio", "inf"], "--schedule.warmup-start-ratio must be a finite number"),
        ([*TOY, "--schedule.weight-decay-end", "nan"], "--schedule.weight-decay-end must be a finite number"),
        ([*TOY, "--schedule.weight-decay-end=-0.5"], "--schedule.weight-decay-end must be >= 0 or -1, got -0.5"),
        ([*TOY, "--step-sleep-seconds=-1"], "--step-sleep-seconds must be in [0, 3600], got -1"),
        ([*TOY, "--batch-size", "0"], "--batch-size must be positive, got 0"),
        ([*TOY, "--batch-size=-1"], "--batch-size must be positive, got -1"),
        ([*TOY, "--seed=-1"], "--seed must be in [0, 2**63), got -1"),
        ([*TOY, "--seed", str(2**63)], "--seed must be in [0, 2**63), got 9223372036854775808"),
        ([*TOY, "--max-steps", "0"], "--max-steps must be >= 1 or -1, got 0"),
        ([*TOY, "--num-workers", str(10**20)], "--num-workers must be >= 0 and fit a 64-bit integer"),
        ([*TOY, "--precision", "fp16-scale", "--optim.learning-rate", "1e6"], "1e+06 exceeds the largest fp16"),
        ([*TOY, "--precision", "fp16", "--optim.weight-decay", "1e5"], "--optim.weight-decay 100000 exceeds the"),
        ([*MOCO, "--precision", "fp16", "--optim.base-learning-rate", "1e5"], "x batch 512 / 256 = 200000 exceeds"),
        ([*TOY, "--optim.learning-rate", "1e38", "--schedule.final-ratio", "10"], "= 1e+39 exceeds the largest"),
        ([*TOY, "--optim.base-learning-rate", "0.2"], "are both set; keep one (set the other to -1)"),
        ([*TOY, "--optim.learning-rate", "-1"], "no learning rate: set --optim.learning-rate or"),
        (["train", "cifar", "--optim.momentum=-1"], "--optim.momentum must be in [0, 1), got -1"),
        (["train", "cifar", "--optim.weight-decay=-1"], "--optim.weight-decay must be >= 0, got -1"),
        ([*VAR, "--drop-path-rate", "5"], "--drop-path-rate must be in [0, 1] or -1, got 5"),
        ([*VAR, "--init-std", "0"], "--init-std must be > 0 or -1, got 0"),
        ([*VAR, "--optim.weight-decay=-1"], "--optim.weight-decay must be >= 0, got -1"),
        ([*VAR, "--optim.betas", "0.9", "1.5"], "--optim.betas (each value) must be in [0, 1), got 1.5"),
        ([*VAR, "--optim.betas", "0.9"], "--optim.betas takes two values"),
        ([*VAR, "--num-heads", "3"], "embed_dim divisible by num_heads"),
        ([*TOKENIZER, "--discriminator-channels", "0"], "--discriminator-channels must be >= 1, got 0"),
        ([*TOKENIZER, "--adam-beta1", "2"], "--adam-beta1 must be in [0, 1) or -1, got 2"),
        ([*TOKENIZER, "--discriminator-weight=-1"], "--discriminator-weight must be >= 0, got -1"),
        ([*MOCO, "--projection-dim", "0"], "--projection-dim must be >= 1, got 0"),
        ([*MOCO, "--knn-k", "0"], "--knn-k must be >= 1, got 0"),
        ([*MOCO, "--knn-k", "65"], "--knn-k: k=65 must be between 1 and the bank size 64 (--data.eval-limit 64)"),
        ([*MOCO, "--data.eval-limit", "0", "--knn-k", "4001"], "bank size 4000 (the training images of digits)"),
        ([*MOCO, "--knn-temperature", "0"], "--knn-temperature must be >= 0.02, got 0"),
        ([*MOCO, "--knn-temperature", "0.01"], "--knn-temperature must be >= 0.02, got 0.01"),
        ([*MOCO, "--temperature", "1e-40"], "--temperature must be positive and within float32's range"),
        ([*MOCO, "--data.train-limit=-5"], "--data.train-limit must be >= 0, got -5"),
        ([*MOCO, "--data.eval-limit=-5"], "--data.eval-limit must be >= 0, got -5"),
        ([*MOCO, "--data.fake-size", "0"], "--data.fake-size must be >= 1, got 0"),
        ([*VAR, "--data.kind", "cifar10"], "invalid choice: 'cifar10'"),
        ([*MOCO, "--data.kind", "digits", "--data.download"], "--data.download fetches CIFAR-10 only"),
        ([*MOCO, "--optim.momentum=-1"], "--optim.momentum must be in [0, 1), got -1"),
        ([*MOCO, "--model", "moco_vit_debug", "--image-size", "18"], "--image-size must be a multiple of 4, got 18"),
        ([*SAMPLE, "--seed", str(2**64)], "--seed must be in [0, 2**63), got 18446744073709551616"),
        ([*SAMPLE, "--guidance", "inf"], "--guidance must be a finite number in [0, 1000], got inf"),
        ([*SAMPLE, "--guidance", "1e38"], "--guidance must be in [0, 1000], got 1e+38"),
        ([*SAMPLE, "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
        ([*EDIT, "--guidance", "inf"], "--guidance must be a finite number in [0, 1000], got inf"),
        ([*EDIT, "--num-results", "0"], "--num-results must be in [1, 64], got 0"),
        (["demo", "--guidance", "inf"], "--guidance must be a finite number in [0, 1000], got inf"),
        (["eval", "knn", "--temperature", "0"], "--temperature must be >= 0.02, got 0"),
        (["eval", "knn", "--temperature=-1"], "--temperature must be >= 0.02, got -1"),
        (["eval", "knn", "--temperature", "nan"], "--temperature must be a finite number >= 0.02, got nan"),
        (["eval", "knn", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["eval", "knn", "--batch-size=-1"], "--batch-size must be >= 1, got -1"),
        (["eval", "knn", "--data.eval-limit=-5"], "--data.eval-limit must be >= 0, got -5"),
        (["eval", "knn", "--data.train-limit", "5"], "a kNN evaluation trains nothing"),
        (["eval", "knn", "--seed=-1"], "--seed must be in [0, 2**63), got -1"),
        (["eval", "linear-probe", "--optim.base-learning-rate", "0"], "--optim.base-learning-rate must be > 0 or -1"),
        (["bench", "precision", "--num-seeds", "0"], "--num-seeds must be >= 1, got 0"),
        (["plan", "toy", "--dropout", "2"], "--dropout must be in [0, 1), got 2"),
        (["plan", "toy", "--device", "cuda:abc"], "unknown --device 'cuda:abc'"),
        (["train", "toy", "--device", "cuda:abc"], "unknown --device 'cuda:abc'"),
    ],
)  # fmt: skip
def test_reported_settings_are_one_line_usage_errors_before_anything_runs(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written: a run dir would appear here
    if argv[0] == "train":
        argv = [*argv, "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------- YAML
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("wandb_project: " + "[" * 10_000 + "]" * 10_000 + "\n", "is nested too deeply to be a config"),
        ("schedule: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n", "is nested too deeply to be a config"),
        ("wandb_project: !!binary aGVsbG8=\n", "config.wandb_project: expected str, got b'hello'"),
        ("run_dir: !!binary aGVsbG8=\n", "config.run_dir: expected Path, got b'hello'"),
        ("run_dir: 2024-01-01\n", "config.run_dir: expected Path, got datetime.date(2024, 1, 1)"),
        ("hidden: !!binary MTI=\n", "config.hidden: expected int, got b'12'"),
        ("dropout: !!binary MC4x\n", "config.dropout: expected float, got b'0.1'"),
        ("deterministic: !!binary dHJ1ZQ==\n", "config.deterministic: expected true/false, got b'true'"),
        ("schedule: {kind: !!binary Y29zaW5l}\n", "config.schedule.kind: b'cosine' is not one of"),
        ("hidden: {a: 1}\n", "config.hidden: expected int, got {'a': 1}"),
        ("optim: {learning_rate: [0.1]}\n", "config.optim.learning_rate: expected float, got [0.1]"),
        ("optim: {learning_rate: 1" + "0" * 400 + "}\n", "config.optim.learning_rate: expected float, got 1000"),
        ("dropout: .nan\n", "--dropout must be a finite number in [0, 1), got nan"),
        ("schedule: {final_ratio: -.inf}\n", "--schedule.final-ratio must be a finite number >= 0, got -inf"),
        ("epochs: 1.0e+20\n", "--epochs must be >= 1 and fit a 64-bit integer"),
        ("seed: " + "9" * 5000 + "\n", "holds a value no setting takes (an integer of thousands of digits)"),
        ("seed: 1\nhidden: 8\nseed: 2\n", "is not valid YAML (the key 'seed' is written twice in one mapping)"),
        ("schedule: {kind: cosine, kind: linear}\n", "(the key 'kind' is written twice in one mapping)"),
    ],
    ids=lambda x: x[:40] if isinstance(x, str) else x,
)
def test_yaml_values_that_are_not_what_the_field_holds_are_one_line_errors(
    text: str, expected: str, tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as info:
        parse(ToyConfig, ["--config", str(path)], "t")
    message = str(info.value)
    assert expected in message and "\n" not in message and len(message) < 600, message


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    """`<<: *base` then the same key: YAML's override, not a key written twice."""
    path = tmp_path / "c.yaml"
    path.write_text("schedule: &s {kind: cosine, final_ratio: 0.5}\noptim: {}\nhidden: 8\n")
    assert parse(ToyConfig, ["--config", str(path)], "t").hidden == 8
    from trainlab.config import _safe_load

    assert _safe_load("a: &a {x: 1, y: 2}\nb: {<<: *a, y: 3}\n") == {"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 3}}


def test_a_billion_laughs_value_is_refused_in_a_short_line(tmp_path: Path) -> None:
    laughs = "hidden: &h [&g [&f [&e [1, 1, 1, 1, 1, 1, 1, 1, 1], *e, *e, *e, *e, *e, *e, *e, *e]"
    laughs += ", *f, *f, *f, *f, *f, *f, *f, *f], *g, *g, *g, *g, *g, *g, *g, *g]\n"
    path = tmp_path / "c.yaml"
    path.write_text(laughs)
    with pytest.raises(UsageError, match=r"config.hidden: expected int, got \[\[\[") as info:
        parse(ToyConfig, ["--config", str(path)], "t")
    assert len(str(info.value)) < 300


def test_a_scalar_or_a_list_for_a_list_field() -> None:
    from trainlab.recipes.var import VARTrainConfig

    assert from_dict(VARTrainConfig, {"patch_nums": 4, "image_size": 64}).patch_nums == (4,)
    with pytest.raises(UsageError, match=r"config.patch_nums: expected int, got \[2\]"):
        from_dict(VARTrainConfig, {"patch_nums": [1, [2]]})
    with pytest.raises(UsageError, match=r"config.patch_nums: expected tuple, got \{'a': 1\}"):
        from_dict(VARTrainConfig, {"patch_nums": {"a": 1}})


# ------------------------------------------------------------------------------------------------- the machinery
@dataclasses.dataclass(kw_only=True)
class _Bounded:
    """Ranges of every kind."""

    rate: float = option(0.5, "a probability", ge=0, le=1)
    steps: int = option(-1, "steps (-1: all)", ge=1, sentinels=(-1,))
    clamp: float = option(1.0, "a clamp (inf: none)", gt=0, allow_inf=True)
    sides: list[int] = option([1, 2], "sides", ge=1)
    label: int | None = option(None, "a class id", ge=0, metavar="ID", aliases=("--class",))
    anything: float = option(0.0, "no declared range")


def test_ranges_messages_and_help() -> None:
    assert parse(_Bounded, ["--steps", "-1", "--clamp", "inf", "--class", "none"], "t").clamp == math.inf
    for argv, message in [
        (["--rate", "1.5"], "--rate must be in [0, 1], got 1.5"),
        (["--steps", "0"], "--steps must be >= 1 or -1, got 0"),
        (["--clamp", "0"], "--clamp must be positive, got 0"),
        (["--clamp", "nan"], "--clamp must be a number > 0 (inf allowed), got nan"),
        (["--sides", "1", "0"], "--sides (each value) must be >= 1, got 0"),
        (["--class=-3"], "--label/--class must be >= 0, got -3"),
        (["--anything", "inf"], "--anything must be a finite number, got inf"),
        (
            ["--anything", "1e39"],
            "--anything must be within float32's range (0 or magnitude in [1.2e-38, 3.4e38]), got 1e+39",
        ),
        (
            ["--anything=-1e-40"],
            "--anything must be within float32's range (0 or magnitude in [1.2e-38, 3.4e38]), got -1e-40",
        ),
    ]:
        with pytest.raises(UsageError) as info:
            parse(_Bounded, argv, "t")
        assert str(info.value) == message
    with pytest.raises(UsageError, match=r"^c.yaml: --rate must be in \[0, 1\], got 2$"):
        from_dict(_Bounded, {"rate": 2}, where="c.yaml")
    text = " ".join(build_parser(_Bounded, "t", "d").format_help().split())
    assert "(default: 0.5); range: [0, 1]" in text and "(default: -1); range: >= 1 or -1" in text
    assert "range: > 0 (inf allowed)" in text and "(default: 1 2); range: >= 1" in text
    assert text.endswith("no declared range (default: 0.0)")


def test_declaration_mistakes_fail_at_import_time() -> None:
    with pytest.raises(TypeError, match="outside the declared range"):
        option(0, "a width", ge=1)
    with pytest.raises(TypeError, match="outside the declared range"):
        option([1, 0], "widths", ge=1)
    with pytest.raises(TypeError, match="one lower bound"):
        option(1, "x", ge=0, gt=0)

    @dataclasses.dataclass(kw_only=True)
    class _Wrong:
        """A range on text."""

        name: str = option("a", "text", ge=0)

    with pytest.raises(TypeError, match="holds no number"):
        check_ranges(_Wrong())


def test_a_value_resolved_from_auto_is_checked_too() -> None:
    auto = {"steps": Auto[_Bounded]("a bad guess", lambda cfg: 0)}
    with pytest.raises(UsageError, match=r"--steps must be >= 1 or -1, got 0"):
        parse(_Bounded, ["--steps", "auto"], "t", auto=auto)


def test_a_config_built_in_python_is_checked_by_validate(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--dropout must be in \[0, 1\), got 2"):
        ToyConfig(run_dir=tmp_path, dropout=2.0).validate()
    with pytest.raises(UsageError, match=r"--schedule.final-ratio must be a finite number >= 0, got nan"):
        cfg = ToyConfig(run_dir=tmp_path)
        cfg.schedule.final_ratio = math.nan
        cfg.validate()
