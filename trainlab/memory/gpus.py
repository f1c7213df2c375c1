"""GPU profiles: memory a process can use and the memory outside PyTorch's tensors. Add a row to `GPU_PROFILES`.

`total_bytes` is the device memory as the driver reports it (`torch.cuda.mem_get_info()[1]`; marketing "80 GB" is
less than 80 GiB). The other constants are ESTIMATES until measured on the device (reference/engine-and-memory.md
B.2, B.4): the CUDA context (~300-600 MiB with lazy module loading), the cuBLAS workspace per handle (32 MiB on
sm90, 8.125 MiB otherwise; one handle for the forward thread and one for autograd's backward thread), a cuDNN
convolution workspace allowance, and NCCL buffers per process when training on several GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainlab.errors import UsageError
from trainlab.memory.allocator import GIB, MIB


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model. `measured` stays False until the constants come from a run on that GPU."""

    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    context_bytes: int = 500 * MIB
    cudnn_workspace_bytes: int = 128 * MIB
    nccl_bytes: int = 400 * MIB
    measured: bool = False

    @property
    def cublas_workspace_bytes(self) -> int:
        per_handle = 32 * MIB if self.compute_capability >= (9, 0) else 8 * MIB + 8 * 16 * 1024
        return 2 * per_handle  # forward thread + autograd's backward thread


# total_bytes: MiB as nvidia-smi / mem_get_info report them for each card (not measured here: no GPU on this machine)
GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile("H100-80GB", 81_559 * MIB, (9, 0)),
        GpuProfile("H200", 143_771 * MIB, (9, 0)),
        GpuProfile("A100-80GB", 81_920 * MIB, (8, 0)),
        GpuProfile("A100-40GB", 40_960 * MIB, (8, 0)),
        GpuProfile("L20-48GB", 46_068 * MIB, (8, 9)),
        GpuProfile("L40S-48GB", 46_068 * MIB, (8, 9)),
        GpuProfile("RTX4090-24GB", 24_564 * MIB, (8, 9)),
        GpuProfile("V100-32GB", 32_768 * MIB, (7, 0)),
    )
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G)?\s*$", re.IGNORECASE)


def gpu_profile(spec: str) -> GpuProfile:
    """A profile from a name in `GPU_PROFILES` (case-insensitive) or a size such as `48GiB` (sm80 constants).

    Raises:
        UsageError: neither a known name nor a size; the message lists the known names.
    """
    for name, profile in GPU_PROFILES.items():
        if spec.lower() == name.lower():
            return profile
    match = _SIZE.match(spec)
    if match and float(match.group(1)) > 0:
        return GpuProfile(f"{match.group(1)} GiB GPU", int(float(match.group(1)) * GIB), (8, 0))
    raise UsageError(f"unknown GPU {spec!r}; use a size such as 48GiB or one of: {', '.join(GPU_PROFILES)}")
