"""Renamed settings keep their old spelling for one release (with a warning); other libraries' flags are answered.

`option(..., deprecated=(...), deprecated_values={...})` in `trainlab/config.py`: a former flag or YAML key still
sets the field, a former value of a Literal is mapped, each with one warning naming the new spelling; the old
spellings stay out of `--help`. Flags of timm / Accelerate / Lightning get a "did you mean" naming the trainlab flag.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

import pytest

from trainlab.config import build_parser, from_dict, option, parse
from trainlab.errors import UsageError


@dataclasses.dataclass(kw_only=True)
class _Data:
    kind: Literal["image-folder", "digits"] = option(
        "digits", "which images", deprecated=("--data", "--dataset"), deprecated_values={"image_folder": "image-folder"}
    )
    root: Path = option(Path("data"), "where", deprecated=("--data-root",))


@dataclasses.dataclass(kw_only=True)
class _Config:
    """A config with a nested group whose fields were flat before."""

    data: _Data = option(_Data(), "the data")
    learning_rate: float = option(0.1, "peak learning rate", gt=0)
    batch_size: int = option(8, "global batch", ge=1)
    precision: Literal["fp32", "bf16-amp"] = option("fp32", "precision")


def test_a_former_flag_sets_the_field_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = parse(_Config, ["--dataset", "image-folder", "--data-root", "/x"], prog="t")
    assert cfg.data.kind == "image-folder" and cfg.data.root == Path("/x")
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "--dataset is the former spelling of --data.kind" in warned and "--data.root" in warned


def test_former_flags_are_hidden_from_help() -> None:
    text = build_parser(_Config, "t", "d").format_help()
    assert "--data.kind" in text and "--data.root" in text
    assert "--dataset" not in text and "--data-root" not in text and "image_folder" not in text


def test_a_former_value_is_mapped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = parse(_Config, ["--data.kind", "image_folder"], prog="t")
    assert cfg.data.kind == "image-folder"
    assert "'image_folder' is the former spelling of 'image-folder'" in caplog.text


def test_former_yaml_keys_are_moved_including_a_name_that_is_now_a_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("data: image_folder\ndata_root: /old\nlearning_rate: 0.5\n")
    with caplog.at_level(logging.WARNING):
        cfg = parse(_Config, ["--config", str(path)], prog="t")
    assert (cfg.data.kind, cfg.data.root, cfg.learning_rate) == ("image-folder", Path("/old"), 0.5)
    assert "'data' is the former name of 'data.kind'" in caplog.text
    new_style = from_dict(_Config, {"data": {"kind": "digits"}})  # a group under the former name is not a value
    assert new_style.data.kind == "digits"


def test_a_setting_given_under_both_names_is_refused() -> None:
    with pytest.raises(UsageError, match=r"both data_root .* and data\.root are set; keep data\.root only"):
        from_dict(_Config, {"data_root": "/a", "data": {"root": "/b"}})


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lr", "0.1"], "did you mean --learning-rate?"),
        (["--mixed-precision", "bf16"], "did you mean --precision? (Accelerate's no / fp16 / bf16"),
        (["--batch_size", "4"], "did you mean --batch-size?"),
        (["--max-epochs", "3"], ""),  # no --epochs here: no suggestion, still one line
        (["--learnig-rate", "0.1"], "did you mean --learning-rate?"),
    ],
)
def test_other_libraries_flags_are_answered_with_the_trainlab_flag(argv: list[str], expected: str) -> None:
    with pytest.raises(UsageError) as err:
        parse(_Config, argv, prog="t")
    message = str(err.value)
    assert "\n" not in message and expected in message
    if not expected:
        assert "did you mean" not in message
