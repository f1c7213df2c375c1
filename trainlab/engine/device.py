"""Device resolution: the one place a `--device` value becomes a `torch.device`, for every command.

`auto` (the default everywhere except `trainlab demo`, whose documented numbers are the CPU's) picks CUDA when it is
available, else the CPU, and logs which; an explicit device that this machine does not have is a one-line UsageError.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trainlab.errors import UsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEVICE_HELP = "auto (cuda when available, else cpu; logged), cpu, cuda, cuda:N or mps"


def resolve_device(name: str, *, flag: str = "--device") -> torch.device:
    """The device `name` stands for on this machine.

    Args:
        name: auto, cpu, cuda, cuda:N or mps.
        flag: how error messages name the setting.

    Raises:
        UsageError: an unknown name, or a device this machine does not have (no CUDA, no GPU N, no MPS).
    """
    import torch  # here, not at the top: command configs import DEVICE_HELP without loading torch

    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device: %s (auto: CUDA %savailable)", device, "" if device.type == "cuda" else "not ")
        return device
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown {flag} {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"{flag} {name}: CUDA is not available here; use {flag} cpu (or auto)")
        if device.index is not None and device.index >= count:
            raise UsageError(f"{flag} {name}: only {count} CUDA device(s) here (cuda:0..cuda:{count - 1})")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"{flag} {name}: MPS is not available here; use {flag} cpu (or auto)")
    elif device.type != "cpu":
        raise UsageError(f"unknown {flag} {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device
