"""The FLOP counter of a traced step against hand counts, and the step-time estimate."""

import dataclasses

import pytest

from trainlab.errors import UsageError
from trainlab.memory.flops import StepFlops, count_step_flops, estimate_step_seconds
from trainlab.memory.gpus import GPU_PROFILES, gpu_profile
from trainlab.recipes.toy import ToyRecipe


def test_toy_mlp_flops_are_the_hand_count() -> None:
    """Linear(F, H) -> GELU -> Linear(H, K) at batch B: forward 2B(FH + HK); backward 2B(FH + HK) for the weight
    gradients plus 2BHK for the hidden activations' gradient (the input needs none); SGD with momentum: a few
    elementwise FLOPs per parameter."""
    config = ToyRecipe(ToyRecipe.config_class()).debug_config()
    recipe = ToyRecipe(config)
    B, F, H, K = 4, config.num_features, config.hidden, config.num_classes
    flops = count_step_flops(recipe, micro_batch=B, grad_accumulation=1, device="cpu")
    assert flops.forward == 2 * B * (F * H + H * K)
    assert flops.backward == 2 * B * (F * H + H * K) + 2 * B * H * K
    parameters = F * H + H + H * K + K
    assert parameters <= flops.optimizer <= 8 * parameters
    assert flops.total == flops.forward + flops.backward + flops.optimizer
    assert flops.per_sample == round(flops.total / B)
    assert flops.bytes_moved > 0


def test_accumulation_multiplies_the_model_flops() -> None:
    recipe = ToyRecipe(ToyRecipe(ToyRecipe.config_class()).debug_config())
    one = count_step_flops(recipe, micro_batch=4, grad_accumulation=1, device="cpu")
    three = count_step_flops(recipe, micro_batch=4, grad_accumulation=3, device="cpu")
    assert (three.forward, three.backward) == (3 * one.forward, 3 * one.backward)
    assert three.optimizer == one.optimizer
    assert three.per_sample < one.per_sample  # the optimizer's FLOPs spread over more samples


def test_step_seconds_is_flops_over_peak_or_the_bandwidth_floor() -> None:
    gpu = GPU_PROFILES["H100-80GB"]
    flops = StepFlops.of(10**15, 0, 0, samples=1, bytes_moved=0)
    assert estimate_step_seconds(flops, gpu, "bf16", 0.5) == pytest.approx(1e15 / (989.4e12 * 0.5))
    heavy = dataclasses.replace(flops, bytes_moved=10**13)
    assert estimate_step_seconds(heavy, gpu, "bf16", 0.5) == pytest.approx(1e13 / 3350e9)


def test_step_seconds_refuses_a_gpu_without_a_known_peak() -> None:
    flops = StepFlops.of(10**12, 0, 0, samples=1)
    with pytest.raises(UsageError, match="no bf16 peak"):
        estimate_step_seconds(flops, gpu_profile("48GiB"), "bf16", 0.3)
    with pytest.raises(UsageError, match="no bf16 peak"):
        estimate_step_seconds(flops, GPU_PROFILES["V100-32GB"], "bf16", 0.3)


def test_recipe_families() -> None:
    from trainlab.recipes.cifar import CifarRecipe
    from trainlab.recipes.moco import MocoConfig, MocoRecipe
    from trainlab.recipes.var import VARRecipe

    assert VARRecipe(VARRecipe.config_class()).model_family() == "transformer"
    assert MocoRecipe(MocoConfig(model="moco_vit_small")).model_family() == "small-transformer"
    assert MocoRecipe(MocoConfig(model="moco_vit_base")).model_family() == "transformer"
    assert MocoRecipe(MocoConfig(model="tv_resnet50")).model_family() == "convnet"
    assert CifarRecipe(CifarRecipe.config_class()).model_family() == "small-convnet"
    assert ToyRecipe(ToyRecipe.config_class()).model_family() == "small-convnet"


def test_every_family_has_an_assumed_efficiency_and_every_backbone_a_family() -> None:
    from typing import get_args

    from trainlab.memory.efficiency import ASSUMED
    from trainlab.models.names import MOCO_BACKBONE_FAMILY, MOCO_BACKBONES, ModelFamily

    assert set(get_args(ModelFamily)) == set(ASSUMED)
    assert set(MOCO_BACKBONE_FAMILY) == set(MOCO_BACKBONES)
