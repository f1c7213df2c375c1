"""CIFAR ResNet / VGG models and the model registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from trainlab.errors import UsageError
from trainlab.models.cifar_resnet import CifarResNet
from trainlab.models.names import CIFAR_MODELS
from trainlab.models.registry import create_model, list_models, register_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Batch-2 forward/backward gains nothing from intra-op threads, and on a shared 2-core machine the thread
    # synchronisation made this file ~5x slower (65 s vs 11 s measured); restore the setting afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_all_cifar_models_are_registered() -> None:
    assert set(CIFAR_MODELS) == set(list_models("cifar_"))
    assert list_models() == sorted(list_models())


@pytest.mark.parametrize("name", CIFAR_MODELS)
def test_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, num_classes=10)
    img_B3HW = torch.randn(2, 3, 32, 32)
    logits_BK = model(img_B3HW)
    assert logits_BK.shape == (2, 10)
    assert logits_BK.dtype == torch.float32
    logits_BK.logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "every parameter gets a gradient"
    assert all(torch.isfinite(g).all() for g in grads if g is not None)
    assert any(g.abs().sum() > 0 for g in grads if g is not None)


@pytest.mark.parametrize(
    ("name", "expected"),
    # kuangliu/pytorch-cifar definitions: VGG19 20.04 M, ResNet18 11.17 M (../shared/reference/cifar-and-moco.md 1.3).
    [("cifar_vgg19", 20_040_522), ("cifar_resnet18", 11_173_962)],
)
def test_param_counts_match_reference(name: str, expected: int) -> None:
    count = _num_params(create_model(name))
    assert count == expected
    assert round(count / 1e6, 2) == round(expected / 1e6, 2)


def test_resnet_uses_cifar_stem() -> None:
    model = create_model("cifar_resnet18")
    assert isinstance(model, CifarResNet)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert model.forward_features(torch.randn(1, 3, 32, 32)).shape == (1, 512, 4, 4)


@pytest.mark.parametrize("name", ["cifar_resnet_debug", "cifar_vgg_debug"])
def test_num_classes_and_backbone_mode(name: str) -> None:
    model = create_model(name, num_classes=100)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    backbone = create_model(name, num_classes=0)
    features_BC = backbone(torch.randn(2, 3, 32, 32))
    assert features_BC.shape == (2, backbone.num_features)


def test_debug_models_are_small() -> None:
    assert _num_params(create_model("cifar_resnet_debug")) < 100_000
    assert _num_params(create_model("cifar_vgg_debug")) < 50_000


def test_unknown_model_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"unknown model 'resnet19'; choose one of: .*cifar_resnet18.*cifar_vgg19"):
        create_model("resnet19")


def test_negative_num_classes_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="num_classes"):
        create_model("cifar_vgg_debug", num_classes=-1)


def test_registering_a_taken_name_fails() -> None:
    list_models()  # make sure built-ins are registered

    def imposter(num_classes: int = 10) -> nn.Module:
        return nn.Linear(1, num_classes)

    with pytest.raises(ValueError, match="already registered"):
        register_model("cifar_resnet18")(imposter)
    assert isinstance(create_model("cifar_resnet18"), CifarResNet)
