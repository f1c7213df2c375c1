"""One data vocabulary: every recipe and `trainlab eval` command selects images with the same `--data.*` flags, the
former spellings still work for one release (each with a warning), and values are spelled as the parser takes them.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from test_layering import PACKAGE, imported_names

from trainlab.cli import main
from trainlab.commands.bench import PrecisionBenchConfig
from trainlab.commands.eval import KnnConfig
from trainlab.config import build_parser, from_dict, parse
from trainlab.data.config import DATA_KINDS, DataConfig, accepted_kinds, kind_option
from trainlab.errors import UsageError
from trainlab.recipes import get_recipe, list_recipes
from trainlab.recipes.cifar import CifarConfig
from trainlab.recipes.linear_probe import LinearProbeConfig
from trainlab.recipes.moco import MocoConfig
from trainlab.recipes.tokenizer import TokenizerConfig
from trainlab.recipes.var import VARTrainConfig

DATA_FLAGS = ("--data.kind", "--data.root", "--data.train-limit", "--data.eval-limit", "--data.fake-size")
FORMER_FLAGS = (
    "--dataset",
    "--data-root",
    "--fake-num-images",
    "--fake-size",
    "--eval-max-images",
    "--eval-size",
    "--eval-subset",
    "--train-subset",
    "--subset",
    "--download",
)
IMAGE_RECIPES = [name for name in list_recipes() if name != "toy"]  # the toy's samples are feature vectors
COMMANDS = {f"train {name}": ["train", name] for name in IMAGE_RECIPES}
COMMANDS |= {"eval knn": ["eval", "knn"], "eval linear-probe": ["eval", "linear-probe"]}
COMMANDS |= {"bench precision": ["bench", "precision"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reading_images_has_the_data_flags_and_hides_the_former_ones(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([*COMMANDS[command], "--help"])
    text = capsys.readouterr().out
    missing = [flag for flag in DATA_FLAGS if flag not in text]
    assert not missing, f"{command} --help lacks {missing}"
    shown = [flag for flag in FORMER_FLAGS if re.search(rf"{re.escape(flag)}\b(?![.-])", text)]
    assert not shown, f"{command} --help shows former flags {shown}"
    assert "image_folder" not in text


def _data_class(config_class: type) -> type:
    hints = {f.name: f.type for f in dataclasses.fields(config_class)}
    assert "data" in hints, f"{config_class.__name__} has no data group"
    return type(config_class().data)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "config_class",
    [get_recipe(name).config_class for name in IMAGE_RECIPES] + [KnnConfig, PrecisionBenchConfig],
    ids=[*IMAGE_RECIPES, "eval-knn", "bench-precision"],
)
def test_each_data_group_reads_a_subset_of_the_one_kind_list(config_class: type) -> None:
    data = _data_class(config_class)
    kinds = accepted_kinds(data)
    assert kinds and set(kinds) <= set(DATA_KINDS), kinds
    names = [f.name for f in dataclasses.fields(data)]
    assert names == [f.name for f in dataclasses.fields(DataConfig)], names  # the same fields, in the same order


def test_a_kind_outside_the_one_list_is_a_programming_error() -> None:
    from typing import Literal

    with pytest.raises(TypeError, match=r"'imagenet'"):
        kind_option("imagenet", Literal["imagenet", "digits"])


@pytest.mark.parametrize(
    ("cls", "argv", "field", "value"),
    [
        (VARTrainConfig, ["--dataset", "fake"], "kind", "fake"),
        (VARTrainConfig, ["--data-root", "/old"], "root", Path("/old")),
        (VARTrainConfig, ["--fake-num-images", "12"], "fake_size", 12),
        (VARTrainConfig, ["--eval-max-images", "5"], "eval_limit", 5),
        (TokenizerConfig, ["--dataset", "digits"], "kind", "digits"),
        (TokenizerConfig, ["--data-root", "/old"], "root", Path("/old")),
        (TokenizerConfig, ["--fake-size", "12"], "fake_size", 12),
        (TokenizerConfig, ["--eval-size", "5"], "eval_limit", 5),
        (CifarConfig, ["--data-root", "/old"], "root", Path("/old")),
        (CifarConfig, ["--download"], "download", True),
        (MocoConfig, ["--data", "digits", "--image-size", "16"], "kind", "digits"),
        (MocoConfig, ["--data-root", "/old"], "root", Path("/old")),
        (MocoConfig, ["--train-subset", "7"], "train_limit", 7),
        (MocoConfig, ["--eval-subset", "300"], "eval_limit", 300),
        (LinearProbeConfig, ["--data", "digits"], "kind", "digits"),
        (LinearProbeConfig, ["--data-root", "/old"], "root", Path("/old")),
        (LinearProbeConfig, ["--eval-subset", "9"], "eval_limit", 9),
        (KnnConfig, ["--data", "digits"], "kind", "digits"),
        (KnnConfig, ["--data-root", "/old"], "root", Path("/old")),
        (KnnConfig, ["--subset", "300"], "eval_limit", 300),
        (PrecisionBenchConfig, ["--data-root", "/old"], "root", Path("/old")),
        (VARTrainConfig, ["--data.kind", "image_folder"], "kind", "image-folder"),  # the value the docs spelled
        (MocoConfig, ["--data", "image_folder"], "kind", "image-folder"),
    ],
)
def test_a_former_data_flag_still_works_with_a_warning(
    cls: type, argv: list[str], field: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = parse(cls, argv, prog="t")
    assert getattr(cfg.data, field) == value  # type: ignore[attr-defined]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "former spelling" in warned and "until the next release" in warned, warned


@pytest.mark.parametrize("cls", [CifarConfig, PrecisionBenchConfig])
def test_the_former_fake_data_flag_selects_fake_images_of_that_size(
    cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = parse(cls, ["--fake-data", "96"], prog="t")
    assert (cfg.data.kind, cfg.data.fake_size, cfg.fake_data) == ("fake", 96, 0)  # type: ignore[attr-defined]
    assert "--fake-data 96 is the former spelling of --data.kind fake --data.fake-size 96" in caplog.text
    assert parse(cls, [], prog="t").data.kind == "cifar10"  # type: ignore[attr-defined]


def test_former_yaml_keys_are_moved_into_the_data_group(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("dataset: digits\ndata_root: /old\nfake_num_images: 12\neval_max_images: 5\n")
    with caplog.at_level(logging.WARNING):
        cfg = parse(VARTrainConfig, ["--config", str(path)], prog="t")
    assert (cfg.data.kind, cfg.data.root, cfg.data.fake_size, cfg.data.eval_limit) == ("digits", Path("/old"), 12, 5)
    assert "'dataset' is the former name of 'data.kind'" in caplog.text
    moco = from_dict(MocoConfig, {"data": "digits", "data_root": "/x", "train_subset": 3, "image_size": 16})
    assert (moco.data.kind, moco.data.root, moco.data.train_limit) == ("digits", Path("/x"), 3)


def test_a_group_keeps_the_recipe_defaults_of_the_fields_not_given() -> None:
    """Each recipe's data group is its own class: a flag for one field leaves the others at that recipe's defaults."""
    assert parse(TokenizerConfig, ["--data.root", "/x"], prog="t").data.eval_limit == 1000
    assert parse(CifarConfig, ["--data.fake-size", "8"], prog="t").data.root == Path("data/cifar10")
    assert parse(MocoConfig, ["--data.eval-limit", "800"], prog="t").data.kind == "cifar10"


@pytest.mark.parametrize(
    ("cls", "argv", "message"),
    [
        (VARTrainConfig, ["--data.kind", "cifar10"], "invalid choice: 'cifar10'"),
        (CifarConfig, ["--data.kind", "digits"], "invalid choice: 'digits'"),
        (MocoConfig, ["--data.kind", "digits", "--data.download", "--image-size", "16"], "fetches CIFAR-10 only"),
        (MocoConfig, ["--data.kind", "digits", "--image-size", "40"], "digits are 8 to 32 px; got --image-size 40"),
        (MocoConfig, ["--data.kind", "digits", "--image-size", "16", "--knn-k", "4001"], "bank size 4000"),
        (KnnConfig, ["--data.train-limit", "3"], "a kNN evaluation trains nothing"),
    ],
)
def test_a_kind_or_setting_a_recipe_cannot_read_is_one_line(cls: type, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse(cls, argv, prog="t")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_yaml_with_a_kind_the_recipe_does_not_read_is_refused() -> None:
    with pytest.raises(UsageError, match=r"config\.data\.kind: 'cifar10' is not one of: image-folder, digits, fake"):
        from_dict(VARTrainConfig, {"data": {"kind": "cifar10"}})


def test_resume_may_change_a_named_field_of_the_data_group_only(tmp_path: Path) -> None:
    """`resume_may_change` names fields of a group by their dotted name: the root may move, the fake set may not."""
    from trainlab.engine.loop import Trainer
    from trainlab.recipes.cifar import CifarData, CifarRecipe

    base = CifarRecipe(CifarConfig(run_dir=tmp_path / "run", model="vgg_debug")).debug_config()
    cfg = dataclasses.replace(base, run_dir=tmp_path / "run", max_steps=1, tensorboard=False, progress=False)
    Trainer(CifarRecipe(cfg)).fit()
    moved = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=tmp_path / "elsewhere"), max_steps=2)
    assert Trainer(CifarRecipe(moved)).fit().step == 2
    grown = dataclasses.replace(moved, data=dataclasses.replace(moved.data, fake_size=64), max_steps=3)
    assert isinstance(grown.data, CifarData)
    with pytest.raises(UsageError, match=r"trained with data\.fake_size=128 but this run has data\.fake_size=64"):
        Trainer(CifarRecipe(grown)).fit()


# ------------------------------------------------------------------------------------------------ docs
_VALUE = re.compile(r"--data(?:\.kind)?[ =]([a-z][\w-]*)")  # a value as written (`KIND`, a placeholder, is not)


def test_docs_and_shipped_configs_spell_kinds_as_the_parser_does() -> None:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE / "configs").glob("*.yaml"))
    files += sorted((PACKAGE.parent / "benchmarks").glob("*.py"))
    bad = [
        f"{path.relative_to(PACKAGE.parent)}: --data {value}"
        for path in files
        for value in _VALUE.findall(path.read_text())
        if value not in DATA_KINDS
    ]
    assert bad == []
    for path in sorted((PACKAGE / "configs").glob("*.yaml")):  # shipped configs use the data group, no former key
        text = path.read_text()
        assert not re.search(r"^(dataset|data_root|eval_size|eval_max_images|eval_subset|train_subset):", text, re.M)


def test_former_flags_appear_only_where_they_are_declared() -> None:
    """Help strings and docstrings name the current flags: a former flag is written only in `deprecated=(...)`."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "config.py" and path.parent == PACKAGE:  # the rename machinery's own examples
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for flag in FORMER_FLAGS:
                if re.search(rf"{re.escape(flag)}\b(?![.-])", node.value) and node.value != flag:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {flag}")
    assert bad == []


# ------------------------------------------------------------------------------------------------ layering
def test_no_recipe_imports_another_recipe() -> None:
    """Recipes share data and models through `trainlab.data` / `trainlab.models`, never through each other."""
    recipes = {p.stem for p in (PACKAGE / "recipes").glob("*.py") if p.stem != "__init__"}
    helpers = {"var": {"var_progressive"}, "moco": {"moco_plan"}}  # a recipe's own helper modules
    bad = []
    for stem in sorted(recipes):
        for line, name in imported_names(PACKAGE / "recipes" / f"{stem}.py"):
            other = name.removeprefix("trainlab.recipes.").split(".")[0]
            if name.startswith("trainlab.recipes.") and other in recipes and other not in helpers.get(stem, set()):
                bad.append(f"recipes/{stem}.py:{line} imports {name}")
    assert bad == []


def test_data_imports_no_model_recipe_command_or_engine() -> None:
    forbidden = ("trainlab.models", "trainlab.recipes", "trainlab.commands", "trainlab.engine", "trainlab.demo")
    bad = [
        f"{path.name}:{line} imports {name}"
        for path in sorted((PACKAGE / "data").glob("*.py"))
        for line, name in imported_names(path)
        if any(name == p or name.startswith(p + ".") for p in forbidden)
    ]
    assert bad == []


def test_the_data_config_parses_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, trainlab.data.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False", out.stderr


def test_help_lists_the_kinds_each_recipe_reads() -> None:
    text = build_parser(VARTrainConfig, "t", "d").format_help()
    assert "{image-folder,digits,fake}" in text and "cifar10" not in text.split("--data.kind")[1].split("--data.")[0]
