"""One rank of a real FSDP2 run on CPU (torchrun, gloo): the measured peak of live tensor bytes, for the planner test.

The run is `trainlab train --fsdp`'s own set-up (`engine.assemble` with the world of two: the trained models
sharded by `engine.fsdp`, block by block as the recipe names them, then the root) and its `StepRunner`, on the
recipe's example batches.

Measured like the planner's other CPU tests, with one change: FSDP2 frees and re-allocates its gathered parameters
by resizing their storages, so the live bytes are the sum of the current sizes of every storage seen so far that is
still alive, taken after each op. Storages are seen when an op creates or reads them, and the models' and
optimizers' own are registered before step 3; optimizer step 2 runs under the meter to see FSDP2's buffers, the
peak is taken over steps 3-4.

usage: torchrun --nproc-per-node 2 fsdp_peak_worker.py RECIPE OUT.json '{"config_field": value, ...}'
(the recipe's debug config with those fields replaced, the batch being the global batch over both ranks;
"fsdp": true is added)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import weakref
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainlab.engine.assemble import assemble
from trainlab.engine.debug import debug_run_config
from trainlab.engine.precision import Precision
from trainlab.engine.recipe import StepInfo
from trainlab.engine.run_length import run_length
from trainlab.recipes import get_recipe


class LiveStorageBytes(TorchDispatchMode):
    """Sum of the current sizes of the alive storages an op created or read; the peak after each op."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref[Any]] = {}
        self.ids = count()
        self.peak = 0

    def _see(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.storages:
            self.storages[key] = weakref.ref(storage)

    def live(self) -> int:
        total = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
            else:
                total += int(storage.nbytes())
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        self.peak = max(self.peak, self.live())
        return out


def resident(models: dict[str, nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every model's parameters, gradients and buffers and every optimizer state (local shards of DTensors)."""
    found = [t for m in models.values() for t in [*m.parameters(), *m.buffers()]]
    found += [p.grad for m in models.values() for p in m.parameters() if p.grad is not None]
    found += [v for o in optimizers for state in o.state.values() for v in state.values() if torch.is_tensor(v)]
    return found


def main(argv: list[str]) -> None:
    name, out, overrides = argv[0], Path(argv[1]), json.loads(argv[2])
    torch_dist.init_process_group("gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    torch.set_num_threads(1)
    cls = get_recipe(name)
    config = dataclasses.replace(debug_run_config(cls(cls.config_class())), device="cpu", fsdp=True, **overrides)
    recipe = cls(config)
    precision = Precision.parse(config.precision)
    length = run_length(100, epochs=1, max_steps=0)
    run = assemble(
        recipe,
        device=torch.device("cpu"),
        precision=precision,
        length_of=lambda parts: length,
        world=world,
    )
    assert run.sharding is not None, "nothing was sharded"
    for model in run.parts.models.values():
        model.train()
    micro = config.batch_size // world

    def batches() -> Any:
        while True:
            yield recipe.example_batch(micro)

    meter = LiveStorageBytes()
    iterator = batches()
    for step in range(4):
        info = StepInfo(step=step, total_steps=100, steps_per_epoch=100, epoch=0, log_now=True, num_micro_steps=1)
        if step == 2:
            for t in resident(run.all_models(), [p.optimizer for p in run.parts.phases]):
                meter._see(t)
            meter.peak = meter.live()
        if step == 0:
            run.runner.run(iterator, info)
            continue
        with meter:
            run.runner.run(iterator, info)
    if rank == 0:
        out.write_text(json.dumps({"peak_bytes": meter.peak, "micro_batch": micro}))
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
