"""`trainlab plan --device cpu` against the measured peak of live tensor bytes of the same real run on this CPU.

The measurement is independent of the planner: a real `Trainer` (real data, real tensors) runs optimizer step 1,
then a small dispatch mode counts live storages (the model, optimizer and recipe state found by walking the
objects, plus every storage an op creates, minus the ones that die) over optimizer steps 2-4.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, Dataset
from torch.utils.weak import WeakIdKeyDictionary

from trainlab.engine.loop import Trainer
from trainlab.memory.breakdown import breakdown
from trainlab.memory.trace import trace_training
from trainlab.recipes import get_recipe


class LiveBytes(TorchDispatchMode):
    """Live bytes of tracked storages: registered ones plus every new storage an op returns, until it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0
        self._refs: list[Any] = []

    def add(self, storage: Any) -> None:
        if storage in self.seen or storage.nbytes() == 0:
            return
        nbytes = int(storage.nbytes())
        self.seen[storage] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def on_free(_: Any, nbytes: int = nbytes) -> None:
            self.live -= nbytes

        self._refs.append(weakref.ref(storage, on_free))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an output that aliases an input (a view, an in-place op) allocated nothing: without this, indexing an
        # in-memory dataset (MoCo's digits views) would count the whole dataset's storage as a new allocation
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.add(t.untyped_storage())
        return out


def _state_tensors(obj: Any, found: list[torch.Tensor], visited: set[int], depth: int = 0) -> None:
    """Tensors held by models, optimizers, scalers and recipe state (not datasets or loaders)."""
    if id(obj) in visited or depth > 6 or isinstance(obj, (Dataset, DataLoader, torch.Generator, str, bytes, Path)):
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        if obj.grad is not None:
            found.append(obj.grad)
    elif isinstance(obj, nn.Module):
        found += [*obj.parameters(), *obj.buffers()]
        found += [p.grad for p in obj.parameters() if p.grad is not None]
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    elif isinstance(obj, dict):
        for value in obj.values():
            _state_tensors(value, found, visited, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _state_tensors(value, found, visited, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            _state_tensors(value, found, visited, depth + 1)


def measure_real_peak(recipe: Any, first: int = 2, last: int = 4) -> int:
    """Peak live tensor bytes of a real CPU run over optimizer steps `first`..`last` (1-based)."""
    trainer = Trainer(recipe, write_outputs=False)
    for model in trainer.parts.models.values():
        model.train()
    iterator = iter(trainer.loader)
    for _ in range(first - 1):
        trainer.runner.run(iterator, trainer.step_info())
        trainer.progress.step += 1
    meter = LiveBytes()
    found: list[torch.Tensor] = []
    holders = [trainer.parts.models, trainer.parts.frozen, [p.optimizer for p in trainer.phases]]
    _state_tensors([*holders, trainer.scalers, recipe], found, set())
    for t in found:
        meter.add(t.untyped_storage())
    meter.peak = meter.live
    with meter:
        for _ in range(last - first + 1):
            batch_iterator = iterator
            trainer.runner.run(batch_iterator, trainer.step_info())
            trainer.progress.step += 1
    return meter.peak


def _recipe(name: str, tmp_path: Path, **overrides: Any) -> Any:
    cls = get_recipe(name)
    config = dataclasses.replace(cls(cls.config_class()).debug_config(), run_dir=tmp_path, device="cpu", **overrides)
    if "batch_size" not in overrides and config.batch_size % config.grad_accumulation:
        config = dataclasses.replace(config, batch_size=config.batch_size * config.grad_accumulation)
    return cls(config)


CASES = {
    "cifar-resnet-fp32": ("cifar", {"model": "cifar_resnet_debug"}),
    "cifar-resnet-accumulation-2": ("cifar", {"model": "cifar_resnet_debug", "grad_accumulation": 2}),
    "cifar-resnet-bf16-amp": ("cifar", {"model": "cifar_resnet_debug", "precision": "bf16-amp"}),
    "var-fp32": ("var", {}),
    "var-bf16-amp-scale": ("var", {"precision": "bf16-amp-scale"}),
    "var-activation-checkpointing": ("var", {"activation_checkpointing": True}),
    "tokenizer": ("tokenizer", {}),
    "moco-resnet": ("moco", {}),
    "moco-vit": ("moco", {"model": "moco_vit_debug"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_plan_matches_measured_peak(case: str, tmp_path: Path) -> None:
    name, overrides = CASES[case]
    recipe = _recipe(name, tmp_path, **overrides)
    cfg = recipe.config
    micro = cfg.batch_size // cfg.grad_accumulation
    predicted = breakdown(
        trace_training(recipe, device="cpu", micro_batch=micro, grad_accumulation=cfg.grad_accumulation)
    )
    measured = measure_real_peak(_recipe(name, tmp_path / "real", **overrides))
    error = (predicted.peak_allocated_bytes - measured) / measured
    print(f"{case}: predicted {predicted.peak_allocated_bytes} measured {measured} error {error:+.2%}")
    assert abs(error) <= 0.03, f"{case}: predicted {predicted.peak_allocated_bytes} B, measured {measured} B"
    assert predicted.peak_reserved_bytes == predicted.peak_allocated_bytes  # cpu: no allocator model


@pytest.mark.parametrize("name", ["cifar", "var"])
def test_parameters_and_optimizer_states_are_exact(name: str, tmp_path: Path) -> None:
    recipe = _recipe(name, tmp_path)
    cfg = recipe.config
    predicted = breakdown(trace_training(recipe, device="cpu", micro_batch=cfg.batch_size, grad_accumulation=1))
    trainer = Trainer(_recipe(name, tmp_path / "real"), write_outputs=False)
    iterator = iter(trainer.loader)
    for _ in range(2):
        trainer.runner.run(iterator, trainer.step_info())
        trainer.progress.step += 1
    params = [p for m in trainer.parts.models.values() for p in m.parameters()]
    states = [v for p in trainer.phases for s in p.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert predicted.parameters_bytes == sum(p.numel() * p.element_size() for p in params)
    assert predicted.optimizer_states_bytes == sum(t.untyped_storage().nbytes() for t in states)
    assert predicted.optimizer_states_bytes > 0


@pytest.mark.parametrize("arch", ["tv_resnet_debug", "moco_vit_debug"])
def test_moco_momentum_encoder_is_a_momentum_copy(arch: str, tmp_path: Path) -> None:
    """The momentum encoder's parameters (written by after_optimizer_step) are counted as momentum / EMA copies,
    not as trained parameters; its BatchNorm statistics (updated by its forward) stay buffers."""
    recipe = _recipe("moco", tmp_path, model=arch)
    predicted = breakdown(
        trace_training(recipe, device="cpu", micro_batch=recipe.config.batch_size, grad_accumulation=1)
    )
    model = recipe.build(torch.device("cpu")).models["moco"]

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    momentum = nbytes(model.momentum_encoder.parameters())
    trained = nbytes(model.base_encoder.parameters()) + nbytes(model.predictor.parameters())
    assert momentum > 0
    assert predicted.at_peak["recipe_state"] == momentum
    assert predicted.at_peak["parameter"] == trained
    assert predicted.at_peak["buffer"] == nbytes(model.buffers())
    assert predicted.parameters_bytes == momentum + trained  # every parameter of the trained model, as before
