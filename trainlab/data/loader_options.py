"""How the training loader runs: workers, pinned memory, persistent workers, prefetch (`--num-workers`,
`--pin-memory`, `--persistent-workers`, `--prefetch-factor`), resolved once for the device the run is on.

    pin_memory           auto: on when the device is CUDA (page-locked batches, copied with `non_blocking`)
    persistent_workers   auto: on when there are workers (they keep their dataset copy between epochs; the epoch
                         of the augmentation draws reaches them through `trainlab.data.augment.EpochCounter`)
    prefetch_factor      batches each worker prepares ahead (PyTorch's default, 2); workers only

None of them changes a sample: the draws are a function of (seed, epoch, index) whatever the loader does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainlab.errors import UsageError

Switch = Literal["auto", "on", "off"]

DEFAULT_PREFETCH_FACTOR = 2  # torch.utils.data.DataLoader's


@dataclass(frozen=True)
class LoaderOptions:
    """What `torch.utils.data.DataLoader` is given (`prefetch_factor` None: no workers, PyTorch refuses one)."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None

    def describe(self) -> str:
        """One line for the run's log."""
        if self.num_workers == 0:
            where = "0 workers (batches load in the training process)"
        else:
            persistent = "persistent" if self.persistent_workers else "restarted each epoch"
            where = f"{self.num_workers} workers ({persistent}, {self.prefetch_factor} batches ahead each)"
        return f"{where}, pinned memory {'on' if self.pin_memory else 'off'}"


def resolve_loader_options(
    *, num_workers: int, pin_memory: Switch, persistent_workers: Switch, prefetch_factor: int, device_type: str | None
) -> LoaderOptions:
    """The loader settings a run on `device_type` uses: each `auto` decided, each impossible request refused
    (`device_type` None: not known yet, `--device auto` before it is resolved; pinning is then decided as off).

    Raises:
        UsageError: `--pin-memory on` off CUDA; `--persistent-workers on` or another `--prefetch-factor` than 2
            without workers.
    """
    if pin_memory == "on" and device_type not in ("cuda", None):
        raise UsageError(f"--pin-memory on needs a CUDA device (the run is on {device_type}); use auto or off")
    if num_workers == 0 and persistent_workers == "on":
        raise UsageError("--persistent-workers on needs loader workers; add --num-workers N or use auto")
    if num_workers == 0 and prefetch_factor != DEFAULT_PREFETCH_FACTOR:
        raise UsageError(
            f"--prefetch-factor {prefetch_factor} needs loader workers (batches load in the training process); "
            "add --num-workers N or drop it"
        )
    return LoaderOptions(
        num_workers=num_workers,
        pin_memory=pin_memory == "on" or (pin_memory == "auto" and device_type == "cuda"),
        persistent_workers=num_workers > 0 and persistent_workers != "off",
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
