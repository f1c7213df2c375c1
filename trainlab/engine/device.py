"""Device resolution: the one place a `--device` value becomes a `torch.device`, for every command.

`auto` (the default everywhere except `trainlab demo`, whose documented numbers are the CPU's) picks CUDA when it is
available, else the CPU, and logs which; an explicit device that this machine does not have is a one-line UsageError.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from trainlab.errors import UsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEVICE_HELP = "auto (cuda when available, else cpu; logged), cpu, cuda, cuda:N or mps"
TRAIN_DEVICES = "auto, cpu, cuda or cuda:N (training runs on CPUs and CUDA GPUs)"
_DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def check_device_name(name: str, *, flag: str = "--device", training: bool = False) -> None:
    """Refuse a --device value that names no device trainlab runs on, before torch is imported: the same rule for
    every command (training: no mps; `cpu:1`, `cuda:-1`, `cuda:abc` nowhere).

    Raises:
        UsageError: one line naming the value and the choices.
    """
    index = name.partition(":")[2]
    if not _DEVICE_NAME.fullmatch(name) or (training and name == "mps") or len(index) > 5:  # no machine has 10^5 GPUs
        choices = TRAIN_DEVICES if training else "auto, cpu, cuda, cuda:N or mps"
        raise UsageError(f"unknown {flag} {name!r}; use {choices}")


def parse_device(name: str, *, flag: str = "--device") -> torch.device:
    """The device `name` names (cpu, cuda, cuda:N, mps, ...), whether or not this machine has it (what a plan needs).

    Raises:
        UsageError: a name torch does not parse (`cuda:abc`).
    """
    import torch

    check_device_name(name, flag=flag)
    return torch.device(name)


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
    device = parse_device(name, flag=flag)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"{flag} {name}: CUDA is not available here; use {flag} cpu (or auto)")
        if device.index is not None and device.index >= count:
            raise UsageError(f"{flag} {name}: only {count} CUDA device(s) here (cuda:0..cuda:{count - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"{flag} {name}: MPS is not available here; use {flag} cpu (or auto)")
    return device
