"""Model registry: build any model by name.

A model family registers its constructors with `@register_model("name")`; a constructor takes `num_classes`
and returns an `nn.Module`. `create_model` and `list_models` import the built-in model files on first use, so
callers never depend on import order and this module stays free of heavy imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from torch import nn

from trainlab.errors import UsageError

ModelFn = Callable[..., nn.Module]
F = TypeVar("F", bound=ModelFn)

# Files whose import registers models. A new model family adds its module here.
_BUILTIN_MODULES = (
    "trainlab.models.cifar_resnet",
    "trainlab.models.cifar_vgg",
)

_registry: dict[str, ModelFn] = {}


def register_model(name: str) -> Callable[[F], F]:
    """Decorator that records a model constructor under `name`.

    Args:
        name: the name users pass to `create_model` / `--model`.

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


def list_models() -> list[str]:
    """Returns the names of all registered models, sorted."""
    _import_builtin_models()
    return sorted(_registry)


def create_model(name: str, num_classes: int = 10) -> nn.Module:
    """Builds a registered model.

    Args:
        name: a name from `list_models()`, e.g. "resnet18".
        num_classes: size of the classifier output; 0 gives the backbone with an identity head.

    Returns:
        The freshly initialised model (on CPU, fp32, train mode).

    Raises:
        UsageError: if `name` is unknown or `num_classes` is negative.
    """
    _import_builtin_models()
    if name not in _registry:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(sorted(_registry))}")
    if num_classes < 0:
        raise UsageError(f"num_classes must be >= 0 (0 = no classifier), got {num_classes}")
    return _registry[name](num_classes=num_classes)
