"""One command-line vocabulary (`trainlab/vocabulary.py`), checked against every command's parser.

A command that takes a concept spells it as the vocabulary does, with the same placeholder; each setting shows one
flag; former spellings are accepted with a warning naming the current flag and never shown; no command shows a
spelling of another library (those are answered with "did you mean", or accepted where the meaning is identical);
no help text mentions a former spelling.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from trainlab.cli import _COMMANDS
from trainlab.commands.bench import PrecisionBenchConfig
from trainlab.commands.bench_data import DataBenchOptions
from trainlab.commands.doctor import DoctorConfig
from trainlab.commands.edit import EditConfig
from trainlab.commands.eval import FidConfig, JudgeConfig, KnnConfig
from trainlab.commands.plan import PlanOptions
from trainlab.commands.report import ReportConfig
from trainlab.commands.runs import RunsConfig
from trainlab.commands.sample import SampleConfig
from trainlab.config import FOREIGN_ALIASES, FOREIGN_FLAGS, FOREIGN_VALUES, build_parser, parse
from trainlab.demo.pipeline import DemoConfig
from trainlab.errors import UsageError
from trainlab.recipes import get_recipe, list_recipes
from trainlab.recipes.linear_probe import LinearProbeConfig
from trainlab.vocabulary import VOCABULARY, term

SHARED = {"--help", "--config", "--print-config"}  # every parser's own
OWN_NAMES = {"plan": {"--gpus"}}  # the plan's GPU count; `trainlab train --gpus` is answered with --device
RENAMED_ELSEWHERE = {"--model", "--arch", "--dataset"}  # the model and data settings, renamed outside this vocabulary


def _configs() -> dict[str, type]:
    """Every command as typed -> the config its flags come from."""
    configs: dict[str, type] = {f"train {name}": get_recipe(name).config_class for name in list_recipes()}
    configs.update(
        {
            "plan": PlanOptions,  # plus the flags of `train RECIPE`
            "bench precision": PrecisionBenchConfig,
            "bench data": DataBenchOptions,  # plus the flags of `train RECIPE`
            "report": ReportConfig,
            "runs": RunsConfig,
            "sample": SampleConfig,
            "edit": EditConfig,
            "eval knn": KnnConfig,
            "eval linear-probe": LinearProbeConfig,
            "eval fid": FidConfig,
            "eval judge": JudgeConfig,
            "demo": DemoConfig,
            "doctor": DoctorConfig,  # plus the flags of `train RECIPE` in `trainlab doctor RECIPE`
        }
    )
    return configs


CONFIGS = _configs()
PARSERS = {command: build_parser(cls, f"trainlab {command}", "") for command, cls in CONFIGS.items()}


def _visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags `--help` shows (not --help / --config / --print-config), each with its action."""
    shown: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        shown.update({flag: action for flag in action.option_strings if flag.startswith("--") and flag not in SHARED})
    return shown


def _hidden(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        flag: action for action in parser._actions if action.help == argparse.SUPPRESS for flag in action.option_strings
    }


def _takes(term_commands: tuple[str, ...], command: str) -> bool:
    return command in term_commands or (command.startswith("train ") and "train *" in term_commands)


def test_every_command_of_the_cli_is_checked() -> None:
    checked = {command.split()[0] for command in CONFIGS}
    assert set(_COMMANDS) <= checked | {"launch"}, set(_COMMANDS) - checked  # launch: torchrun's own options
    assert {f"train {name}" for name in list_recipes()} <= set(CONFIGS)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_each_setting_shows_one_flag(command: str) -> None:
    for action in {id(a): a for a in _visible(PARSERS[command]).values()}.values():
        flags = [f for f in action.option_strings if f.startswith("--")]
        assert len(flags) == 1, f"{command}: {'/'.join(flags)} names one setting twice; keep one, deprecate the other"


@pytest.mark.parametrize("term_", VOCABULARY, ids=lambda t: t.flag)
def test_the_commands_that_take_a_concept_spell_it_one_way(term_: Any) -> None:
    having = {command for command, parser in PARSERS.items() if term_.flag in _visible(parser)}
    expected = {c for c in CONFIGS if _takes(term_.commands, c)}
    assert having == expected, f"{term_.flag}: taken by {sorted(having)}, the vocabulary says {sorted(expected)}"
    if term_.metavar is not None:
        for command in having:
            action = _visible(PARSERS[command])[term_.flag]
            shown = action.metavar or action.dest.upper()  # what --help prints
            assert shown == term_.metavar, f"{command}: {term_.flag} {shown}, the vocabulary says {term_.metavar}"


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_no_command_shows_a_former_or_foreign_spelling(command: str) -> None:
    current = {t.flag for t in VOCABULARY}
    former = {flag for t in VOCABULARY for flag in t.former} - current
    foreign = set(FOREIGN_FLAGS) | set(FOREIGN_ALIASES)
    shown = set(_visible(PARSERS[command])) - OWN_NAMES.get(command, set()) - RENAMED_ELSEWHERE
    assert not shown & former, f"{command} shows former spellings {sorted(shown & former)}"
    assert not shown & foreign, f"{command} shows other libraries' spellings {sorted(shown & foreign)}"
    for flag in shown:
        if flag.endswith("-weights"):
            assert term(flag) is not None, f"{command}: {flag} is a weights file the vocabulary does not name"
        if flag.endswith("-dir"):
            assert flag in ("--run-dir", "--out-dir"), f"{command}: {flag}: a folder is --run-dir or --out-dir"


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_former_spelling_leads_to_the_vocabulary(command: str) -> None:
    """A hidden spelling of a vocabulary flag is one of its former spellings (or another library's identical one)."""
    parser = PARSERS[command]
    for flag, action in _hidden(parser).items():
        current = getattr(action, "replacement", "")
        owner = term(current)
        if owner is None:
            continue  # a rename outside the command-line vocabulary (data, model, optimizer settings)
        assert flag in owner.former or flag in FOREIGN_ALIASES, f"{command}: {flag} -> {current} is not recorded"


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_no_help_text_names_a_former_spelling(command: str) -> None:
    parser = build_parser(CONFIGS[command], f"trainlab {command}", CONFIGS[command].__doc__ or "")
    text = parser.format_help()
    shown = set(_visible(parser))
    for former in {flag for t in VOCABULARY for flag in t.former} - shown:
        assert not re.search(re.escape(former) + r"(?![\w-])", text), f"{command} --help mentions {former}"


def test_every_seed_has_one_range() -> None:
    ranges = {
        c: _visible(p)["--seed"].help.rsplit("range: ", 1)[-1] for c, p in PARSERS.items() if "--seed" in _visible(p)
    }
    assert set(ranges.values()) == {"[0, 2**63)"}, ranges


# ------------------------------------------------------------------------------------------ former spellings
SAMPLE = ["--classes", "1", "--out", "g.png"]
EDIT = ["--image", "EXISTS", "--box", "0", "0", "1", "1", "--out", "g.png"]
TOKENIZER, VAR = ["--tokenizer-weights", "t"], ["--var-weights", "w"]
FORMER_USES: list[tuple[type, list[str], list[str], str, str, Any]] = [
    # (config, the other required flags, the former flag and its value, the current flag, field, parsed value)
    (SampleConfig, [*VAR, *SAMPLE], ["--vae", "t"], "--tokenizer-weights", "tokenizer_weights", Path("t")),
    (SampleConfig, [*VAR, *SAMPLE], ["--vae-weights", "t"], "--tokenizer-weights", "tokenizer_weights", Path("t")),
    (SampleConfig, [*TOKENIZER, *SAMPLE], ["--var", "w"], "--var-weights", "var_weights", Path("w")),
    (SampleConfig, [*TOKENIZER, *VAR, *SAMPLE], ["--cfg", "3"], "--guidance", "guidance", 3.0),
    (SampleConfig, [*TOKENIZER, *VAR, *SAMPLE], ["--n-per-class", "2"], "--samples-per-class", "samples_per_class", 2),
    (EditConfig, [*VAR, *EDIT], ["--vae", "t"], "--tokenizer-weights", "tokenizer_weights", Path("t")),
    (EditConfig, [*TOKENIZER, *VAR, *EDIT], ["--n", "2"], "--num-results", "num_results", 2),
    (EditConfig, [*TOKENIZER, *VAR, *EDIT], ["--label", "7"], "--class", "label", 7),
    (KnnConfig, [], ["--checkpoint", ""], "--moco-weights", "moco_weights", ""),
    (LinearProbeConfig, [], ["--checkpoint", ""], "--moco-weights", "moco_weights", ""),
    (JudgeConfig, ["--samples", "s"], ["--judge", "j"], "--judge-weights", "judge_weights", Path("j")),
    (PrecisionBenchConfig, [], ["--seeds", "3"], "--num-seeds", "num_seeds", 3),
    (PrecisionBenchConfig, [], ["--out-dir", "OUT"], "--run-dir", "run_dir", Path("OUT")),
    (ReportConfig, ["RUN"], ["--out", "OUT"], "--out-dir", "out_dir", Path("OUT")),
    (get_recipe("var").config_class, [], ["--tokenizer", "t.pth"], "--tokenizer-weights", "tokenizer_weights", "t.pth"),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "required", "former", "current", "field", "value"), FORMER_USES, ids=str)
def test_a_former_spelling_still_works_and_warns(
    cls: type,
    required: list[str],
    former: list[str],
    current: str,
    field: str,
    value: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("EXISTS").write_bytes(b"")
    Path("RUN").mkdir()
    (Path("RUN") / "metrics.jsonl").write_text('{"kind": "event", "step": 0, "epoch": 0}\n')
    with caplog.at_level(logging.WARNING):
        config = parse(cls, [*required, *former], prog="t")
    assert getattr(config, field) == value
    assert f"{former[0]} is the former spelling of {current}" in caplog.text
    owner = term(current)
    assert owner is not None and former[0] in owner.former  # the vocabulary records the rename


def test_a_former_yaml_key_is_moved_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("vae_weights: t.pth\nvar_weights: w.pth\nclasses: [1]\ncfg: 2.5\nout: g.png\n")
    with caplog.at_level(logging.WARNING):
        config = parse(SampleConfig, ["--config", str(path)], prog="t")
    assert (config.tokenizer_weights, config.guidance) == (Path("t.pth"), 2.5)
    assert "'vae_weights' is the former name of 'tokenizer_weights'" in caplog.text
    assert "'cfg' is the former name of 'guidance'" in caplog.text


def test_edit_class_is_one_flag_and_its_yaml_key_is_the_field(tmp_path: Path) -> None:
    """`--class` (a Python keyword as a field name) is the flag of the field `label`; YAML and --print-config say
    `label`; `--label` is its former flag."""
    image = tmp_path / "i.png"
    image.write_bytes(b"")
    argv = ["--tokenizer-weights", "t", "--var-weights", "w", "--image", str(image), "--box", "0", "0", "1", "1"]
    argv += ["--out", str(tmp_path / "g.png"), "--class", "207"]
    assert parse(EditConfig, argv, prog="t").label == 207
    text = build_parser(EditConfig, "t", "").format_help()
    assert "--class ID" in text and "--label" not in text
    path = tmp_path / "e.yaml"
    path.write_text("label: 3\n")
    assert parse(EditConfig, [*argv[:-2], "--config", str(path)], prog="t").label == 3


# ------------------------------------------------------------------------------------------ other libraries
def test_other_libraries_flags_name_trainlab_flags_that_exist() -> None:
    every = set().union(*(_visible(p) for p in PARSERS.values()))
    later = ("--optim.", "--data.", "--data-root", "--data", "--optimizer", "--model", "--arch")  # other streams
    for flag, candidates in FOREIGN_FLAGS.items():
        assert any(c in every or c.startswith(later) for c in candidates), f"{flag}: none of {candidates} exists"
    for flag, (target, _) in FOREIGN_ALIASES.items():
        assert target in every and flag not in every, (flag, target)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "toy", "--max-epochs", "3"], ("epochs", 3, "--max-epochs (Lightning's spelling) is read as")),
        (["train", "toy", "--gradient-accumulation-steps", "2"], ("grad_accumulation", 2, "Accelerate's")),
        (["train", "toy", "--workers", "0"], ("num_workers", 0, "timm's")),
        (["train", "toy", "--gradient-clip-val", "1.5"], ("clip_grad_norm", 1.5, "Lightning's")),
        (["train", "toy", "--torch-compile"], ("compile", True, "the HF Trainer's")),
    ],
)  # fmt: skip
def test_identical_flags_of_other_libraries_are_accepted_and_named(
    argv: list[str], expected: tuple[str, Any, str], caplog: pytest.LogCaptureFixture
) -> None:
    field, value, said = expected
    cls = get_recipe(argv[1]).config_class
    with caplog.at_level(logging.INFO):
        config = parse(cls, argv[2:], prog="t")
    assert getattr(config, field) == value
    assert said in caplog.text
    assert argv[2] not in build_parser(cls, "t", "").format_help()


@pytest.mark.parametrize(
    ("command", "argv", "expected"),
    [
        ("train toy", ["--lr", "0.1"], "--lr: did you mean --optim.learning-rate?"),
        ("train toy", ["--mixed-precision", "bf16"], "did you mean --precision? (Accelerate's no / fp16 / bf16"),
        ("train toy", ["--output-dir", "x"], "--output-dir: did you mean --run-dir?"),
        ("report", ["RUN", "--output-dir", "x"], "--output-dir: did you mean --out-dir?"),
        ("sample", ["--vae-ckpt", "x"], "--vae-ckpt: did you mean --tokenizer-weights?"),
        ("train toy", ["--max-train-steps", "9"], "did you mean --max-steps? (it stops the run early"),
        ("train toy", ["--precision", "bf16-mixed"], "did you mean bf16-amp? (Lightning's bf16-mixed"),
        ("train toy", ["--precision", "16-mixed"], "did you mean fp16-amp-scale?"),
        ("bench precision", ["--modes", "fp32", "bfloat16"], "did you mean bf16-amp?"),
        ("sample", ["--vae-weight", "x"], "did you mean --tokenizer-weights?"),  # a near miss of a former spelling
    ],
)
def test_other_spellings_are_answered_with_the_trainlab_flag(
    command: str, argv: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError) as info:
        parse(CONFIGS[command], argv, prog=f"trainlab {command}")
    message = str(info.value)
    assert "\n" not in message and expected in message, message


def test_foreign_values_name_existing_modes() -> None:
    from trainlab.engine.precision_names import PRECISION_MODES

    assert {target for target, _ in FOREIGN_VALUES.values()} <= set(PRECISION_MODES)
    assert not set(FOREIGN_VALUES) & set(PRECISION_MODES)  # never shadows a trainlab mode


def test_the_vocabulary_names_each_flag_once() -> None:
    flags = [t.flag for t in VOCABULARY]
    assert len(flags) == len(set(flags))
    for t in VOCABULARY:
        assert t.flag.startswith("--") and t.meaning and t.commands
