"""Planning needs no weight files: a registered tokenizer architecture stands in for its file (shapes only)."""

from __future__ import annotations

import dataclasses

import pytest

from trainlab.errors import UsageError
from trainlab.memory.trace import trace_training
from trainlab.models.var.convert import load_tokenizer
from trainlab.models.var.vqvae import VQVAE, vqvae_config
from trainlab.recipes.var import VARRecipe
from trainlab.user_files import shapes_only, weights_needed

PATCH_NUMS = (1, 2, 4, 16)  # 16 x 16 tokens of the official tokenizer: 256 px


def _official_var(**changes: object) -> VARRecipe:
    debug = VARRecipe(VARRecipe.config_class()).debug_config()
    config = dataclasses.replace(debug, patch_nums=PATCH_NUMS, image_size=256, vocab_size=4096, batch_size=2, **changes)  # type: ignore[arg-type]
    return VARRecipe(config)


def _official_bytes() -> int:
    model = VQVAE(vqvae_config("vqvae_official", PATCH_NUMS))
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize(
    "changes",
    [
        {"tokenizer_model": "vqvae_official", "tokenizer_weights": ""},  # --tokenizer-model official, no file
        {"tokenizer_model": "auto", "tokenizer_weights": "official"},  # --tokenizer official: a preset name
    ],
)
def test_the_official_tokenizer_is_planned_without_its_file(changes: dict[str, str]) -> None:
    run = trace_training(_official_var(**changes), device="cpu", micro_batch=1, grad_accumulation=1)
    assert run.frozen_bytes == _official_bytes()


def test_training_still_needs_the_file() -> None:
    assert weights_needed()
    with pytest.raises(UsageError, match="--tokenizer-weights is required"):
        load_tokenizer("official", "auto", PATCH_NUMS)


def test_auto_without_a_file_names_the_fix() -> None:
    with shapes_only(), pytest.raises(UsageError, match="--tokenizer-model vqvae_official"):
        load_tokenizer("", "auto", PATCH_NUMS)
    assert weights_needed()


def test_the_fsdp_layout_needs_no_file_either() -> None:
    """The --fsdp lever of a multi-GPU plan builds the recipe for its shard units: shapes only, as the trace."""
    from trainlab.memory.fsdp_memory import recipe_layout

    layout = recipe_layout(_official_var(tokenizer_model="vqvae_official", tokenizer_weights=""))
    assert set(layout) == {"var"} and len(layout["var"]) > 1
    assert weights_needed()
