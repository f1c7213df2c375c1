"""Resumable, seeded data order shared by every recipe.

The order of an epoch is a permutation drawn from (seed, epoch). One optimizer step consumes `batch_size`
consecutive indices of it (the *global* batch); the global batch is cut into `accumulation` micro-chunks and each
micro-chunk into one slice per rank. So the union of what all ranks and micro-steps see in a step is the same set
of samples whatever the number of processes or accumulation steps, which is what makes 2 x 8 equal 1 x 16 and
4 x 8 equal 32. Resuming mid-epoch skips whole optimizer steps without loading their data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainlab.data.loader_options import LoaderOptions
from trainlab.engine.seeding import derive_seed, worker_init_fn
from trainlab.errors import UsageError

if TYPE_CHECKING:
    from trainlab.engine.recipe import TrainConfig


def micro_batch_size(batch_size: int, accumulation: int, world: int) -> int:
    """Per-process micro-batch; refuses splits that would not add up to exactly `batch_size`."""
    if batch_size <= 0:
        raise UsageError(f"batch size must be positive, got {batch_size}")
    if accumulation <= 0:
        raise UsageError(f"gradient accumulation must be >= 1, got {accumulation}")
    parts = accumulation * world
    if batch_size % parts:
        raise UsageError(
            f"batch size {batch_size} does not split into {accumulation} accumulation step(s) x {world} process(es); "
            f"use a multiple of {parts}"
        )
    return batch_size // parts


class StepBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of an epoch, starting at optimizer step `start_step`."""

    def __init__(
        self,
        dataset_size: int,
        *,
        batch_size: int,
        accumulation: int,
        rank: int,
        world: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.rank = rank
        self.world = world
        self.seed = seed
        self.shuffle = shuffle
        self.micro = micro_batch_size(batch_size, accumulation, world)
        self.steps_per_epoch = dataset_size // batch_size
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"dataset has {dataset_size} samples, fewer than one batch of {batch_size}; lower --batch-size"
            )
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch))
        return torch.randperm(self.dataset_size, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.order()
        chunk = self.micro * self.world
        for step in range(self.start_step, self.steps_per_epoch):
            base = step * self.batch_size
            for a in range(self.accumulation):
                start = base + a * chunk + self.rank * self.micro
                yield perm[start : start + self.micro].tolist()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accumulation


def build_loader(
    dataset: Dataset[Any],
    sampler: StepBatchSampler,
    *,
    options: LoaderOptions,
    seed: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A DataLoader over the step sampler; worker RNGs derive from `seed` (distinct per worker, same run to run).

    Errors the data path raises on purpose inside a worker (an image folder without a readable image, ...) are
    `trainlab.data.errors.DataError`s: PyTorch re-raises them in this process as the same one line as without
    workers, not wrapped in the worker's traceback. `options` (`trainlab.data.loader_options`): workers, pinned
    memory, persistent workers, prefetch; none of them changes a sample.
    """
    generator = torch.Generator().manual_seed(derive_seed(seed, 0xD47A))
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=options.num_workers,
        worker_init_fn=worker_init_fn if options.num_workers > 0 else None,
        generator=generator,
        pin_memory=options.pin_memory,
        collate_fn=collate_fn,
        persistent_workers=options.persistent_workers,
        prefetch_factor=options.prefetch_factor,
    )


def training_loader(
    dataset: Dataset[Any], config: TrainConfig, *, device_type: str, rank: int, world: int
) -> tuple[StepBatchSampler, DataLoader[Any], LoaderOptions]:
    """The training loader of a run, as the Trainer, `trainlab bench data` and `trainlab plan --measure` all build it:
    the step sampler of `rank`'s share of the global batch and the DataLoader with the config's options resolved for
    the device (`config.loader_options`)."""
    sampler = StepBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size=config.batch_size,
        accumulation=config.grad_accumulation,
        rank=rank,
        world=world,
        seed=config.seed,
    )
    options = config.loader_options(device_type)
    return sampler, build_loader(dataset, sampler, options=options, seed=config.seed), options
