"""Model registry: every network a recipe or command builds by name, under one unique name each.

A constructor registers itself with `@register_model("name")` and takes keyword arguments (`num_classes`, ...);
`create_model(name, **kwargs)` builds it and `list_models(prefix)` lists the names. The built-in model files are
imported on first use, so callers never depend on import order and this module stays free of heavy imports.

Names carry their family, so that no name means two networks:

    cifar_*       kuangliu's CIFAR ResNets / VGGs (3x3 stem, PyTorch's default init)      `models/cifar_*.py`
    tv_resnet*    torchvision's ResNets and init (`tv_resnet18_cifar`: with a CIFAR stem)  `models/backbones/resnet.py`
    moco_vit_*    MoCo v3's ViTs on timm's                                                 `models/backbones/vit.py`
    vqvae_*       VAR's multi-scale VQVAE tokenizers                                       `models/var/vqvae.py`
    digit_judge   the demo's digit classifier                                              `models/digit_judge.py`
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from trainlab.errors import UsageError

ModelFn = Callable[..., nn.Module]
F = TypeVar("F", bound=ModelFn)

# Files whose import registers models. A new model family adds its module here.
_BUILTIN_MODULES = (
    "trainlab.models.cifar_resnet",
    "trainlab.models.cifar_vgg",
    "trainlab.models.backbones.resnet",
    "trainlab.models.backbones.vit",
    "trainlab.models.var.vqvae",
    "trainlab.models.digit_judge",
)

_registry: dict[str, ModelFn] = {}


def register_model(name: str) -> Callable[[F], F]:
    """Decorator that records a model constructor under `name`.

    Args:
        name: the name users pass to `create_model` and to a config's `--model`; unique across all families.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: if `name` is already registered to a different function (a programming error).
    """

    def decorator(fn: F) -> F:
        existing = _registry.get(name)
        # Re-importing a module (e.g. importlib.reload) re-registers the same qualified function: allow that.
        if existing is not None and (existing.__module__, existing.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"model name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        _registry[name] = fn
        return fn

    return decorator


def _import_builtin_models() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def list_models(prefix: str = "") -> list[str]:
    """The registered names starting with `prefix` ('' for all), sorted."""
    _import_builtin_models()
    return sorted(name for name in _registry if name.startswith(prefix))


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Builds a registered model.

    Args:
        name: a name from `list_models()`, e.g. "cifar_resnet18".
        **kwargs: the constructor's arguments, e.g. `num_classes` (0 for the backbone with an identity head, where
            the family supports it).

    Returns:
        The freshly initialised model (on CPU, fp32, train mode).

    Raises:
        UsageError: if `name` is unknown or `num_classes` is negative.
    """
    _import_builtin_models()
    if name not in _registry:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(sorted(_registry))}")
    num_classes = kwargs.get("num_classes", 0)
    if isinstance(num_classes, int) and num_classes < 0:
        raise UsageError(f"num_classes must be >= 0 (0 = no classifier), got {num_classes}")
    return _registry[name](**kwargs)
