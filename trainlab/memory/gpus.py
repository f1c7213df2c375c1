"""GPU profiles: memory a process can use and the memory outside PyTorch's tensors. Add a row to `GPU_PROFILES`.

`total_bytes` is the device memory as the driver reports it (`torch.cuda.mem_get_info()[1]`; marketing "80 GB" is
less than 80 GiB). The other constants are ESTIMATES until measured on the device (reference/engine-and-memory.md
B.2, B.4): the CUDA context (~300-600 MiB with lazy module loading), the cuBLAS workspace per handle (32 MiB on
sm90, 8.125 MiB otherwise; one handle for the forward thread and one for autograd's backward thread), a cuDNN
convolution workspace allowance, and NCCL buffers per process when training on several GPUs.

Speed and price: dense (no 2:4 sparsity) peak tensor throughput per compute dtype and the memory bandwidth are the
vendors' data-sheet figures (`source` names the sheet); `example_usd_per_hour` is an EXAMPLE on-demand price per GPU
for orientation only (prices differ by provider and month): `trainlab plan --price NAME=USD_PER_HOUR` overrides it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    peak_tflops: dict[str, float] = field(default_factory=dict)  # compute dtype name -> dense peak TFLOP/s
    bandwidth_gb_per_s: float = 0.0  # device memory bandwidth, GB/s (10^9 bytes)
    example_usd_per_hour: float | None = None  # an example price per GPU-hour (see the module docstring)
    device_names: tuple[str, ...] = ()  # substrings of `torch.cuda.get_device_name()` that identify this GPU
    source: str = ""  # the data sheet of the peak and bandwidth figures

    def peak_flops(self, compute: str) -> float | None:
        """Dense peak FLOP/s for a compute dtype name (`fp32`, `tf32`, `bf16`, `fp16`), None where unknown or where
        the GPU has no such unit (bf16 on a V100)."""
        tflops = self.peak_tflops.get(compute)
        return None if tflops is None else tflops * 1e12

    @property
    def cublas_workspace_bytes(self) -> int:
        per_handle = 32 * MIB if self.compute_capability >= (9, 0) else 8 * MIB + 8 * 16 * 1024
        return 2 * per_handle  # forward thread + autograd's backward thread


def _peaks(fp32: float, tf32: float, half: float | None, fp16: float | None = None) -> dict[str, float]:
    """Dense peak TFLOP/s per compute dtype: plain fp32 (CUDA cores), tf32 and bf16/fp16 (tensor cores, fp32
    accumulate); `fp16` only where it differs from bf16, `half=None` where the GPU has no bf16 unit."""
    peaks = {"fp32": fp32, "tf32": tf32}
    if half is not None:
        peaks["bf16"] = half
    peaks["fp16"] = fp16 if fp16 is not None else half if half is not None else fp32
    return peaks


_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM5 data sheet)"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM data sheet)"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_L20 = "NVIDIA L20 product brief (PCIe, 48 GB GDDR6; as listed by NVIDIA's partners)"
_L40S = "https://www.nvidia.com/en-us/data-center/l40s/ (L40S data sheet)"
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (appendix, RTX 4090)"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"

# total_bytes: mem_get_info's total where measured (H100-80GB, H200). Elsewhere the smallest `totalGlobalMem` seen in
# public deviceQuery outputs (not measured by trainlab): the same figure as mem_get_info's total (the H100's reading
# under the CUDA 13.0 driver is the 81,079 MiB measured here), a few hundred MiB below nvidia-smi's total (the memory
# the driver keeps), and tens of MiB apart between drivers (H100: 81,079 to 81,106 MiB). L20: nvidia-smi's total (no
# public reading found). RTX 4090: nvidia-smi's total, which Linux's reading equals (WDDM on Windows keeps ~1.5 GiB).
# Peaks: dense tensor-core TFLOP/s from the data sheets (their "with sparsity" figures halved); prices: examples.
GPU_PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in (
        GpuProfile(  # total and context measured on an H100 80GB HBM3 (driver 580.159.04, torch 2.11), 2026-11-24
            "H100-80GB",
            81_079 * MIB,  # mem_get_info's total; nvidia-smi shows 81,559 MiB, of which the driver keeps ~480 MiB
            (9, 0),
            context_bytes=619 * MIB,  # device memory in use after torch.cuda.init() and a first tensor, less reserved
            nccl_bytes=564 * MIB,  # one process's NCCL communicator and a 1 MiB all_reduce (1 rank)
            measured=True,
            peak_tflops=_peaks(67.0, 494.7, 989.4),
            bandwidth_gb_per_s=3350,
            example_usd_per_hour=2.50,
            device_names=("H100 80GB HBM3", "H100 SXM"),
            source=_H100,
        ),
        GpuProfile(  # total and context measured on an H200 (driver 580.159.04, torch 2.11), 2026-11-28
            "H200",
            150_109_880_320,  # mem_get_info's total (143,155.9 MiB); nvidia-smi shows 143,771 MiB
            (9, 0),
            context_bytes=619 * MIB,  # device memory in use after torch.cuda.init() and a first tensor, less reserved
            nccl_bytes=564 * MIB,  # the H100's measurement (same NCCL 2.28.9, driver and torch); not measured here
            measured=True,
            peak_tflops=_peaks(67.0, 494.7, 989.4),
            bandwidth_gb_per_s=4800,
            example_usd_per_hour=3.50,
            device_names=("H200",),
            source=_H200,
        ),
        GpuProfile(
            "A100-80GB",
            81_051 * MIB,  # deviceQuery, CUDA 12.2 driver (81,158 under 12.5); nvidia-smi shows 81,920 MiB
            (8, 0),
            peak_tflops=_peaks(19.5, 156.0, 312.0),
            bandwidth_gb_per_s=2039,
            example_usd_per_hour=1.60,
            device_names=("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB"),
            source=_A100,
        ),
        GpuProfile(
            "A100-40GB",
            40_339 * MIB,  # deviceQuery, CUDA 12.2 driver; nvidia-smi shows 40,960 MiB
            (8, 0),
            peak_tflops=_peaks(19.5, 156.0, 312.0),
            bandwidth_gb_per_s=1555,
            example_usd_per_hour=1.20,
            device_names=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
            source=_A100,
        ),
        GpuProfile(
            "L20-48GB",
            46_068 * MIB,  # nvidia-smi's total (no public deviceQuery reading found)
            (8, 9),
            peak_tflops=_peaks(59.8, 59.8, 119.5),
            bandwidth_gb_per_s=864,
            example_usd_per_hour=0.90,
            device_names=("L20",),
            source=_L20,
        ),
        GpuProfile(
            "L40S-48GB",
            45_373 * MIB,  # deviceQuery, CUDA 12.4 driver; nvidia-smi shows 46,068 MiB
            (8, 9),
            peak_tflops=_peaks(91.6, 183.0, 362.05),
            bandwidth_gb_per_s=864,
            example_usd_per_hour=1.00,
            device_names=("L40S",),
            source=_L40S,
        ),
        GpuProfile(
            "RTX4090-24GB",
            24_564 * MIB,  # nvidia-smi's total; deviceQuery on Linux (CUDA 12.1 driver) reads the same
            (8, 9),
            peak_tflops=_peaks(82.6, 82.6, 165.2),
            bandwidth_gb_per_s=1008,
            example_usd_per_hour=0.40,
            device_names=("RTX 4090",),
            source=_ADA,
        ),
        GpuProfile(
            "V100-32GB",
            32_480 * MIB,  # deviceQuery, CUDA 10.0 driver (32,494 to 32,511 under 11.2 to 12.9); nvidia-smi 32,768
            (7, 0),
            peak_tflops=_peaks(15.7, 15.7, None, fp16=125.0),
            bandwidth_gb_per_s=900,
            example_usd_per_hour=0.50,
            device_names=("V100",),
            source=_V100,
        ),
    )
}


def profile_for_device_name(device_name: str) -> GpuProfile | None:
    """The profile of a CUDA device from its name (`torch.cuda.get_device_name()`), None for an unknown GPU (then
    no peak is known and no MFU can be said). Longer identifying substrings win (`H200` before `H100`)."""
    matches = [
        (len(key), profile)
        for profile in GPU_PROFILES.values()
        for key in profile.device_names
        if key.lower() in device_name.lower()
    ]
    return max(matches, key=lambda m: m[0])[1] if matches else None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G)?\s*$", re.IGNORECASE)


def gpu_profile(spec: str) -> GpuProfile:
    """A profile from a name in `GPU_PROFILES` (case-insensitive) or a size such as `48GiB` (sm80 constants): GiB or G
    are binary (2**30 bytes), GB decimal (10**9 bytes, the unit cards are sold in).

    Raises:
        UsageError: neither a known name nor a size; the message lists the known names.
    """
    for name, profile in GPU_PROFILES.items():
        if spec.lower() == name.lower():
            return profile
    match = _SIZE.match(spec)
    if match and float(match.group(1)) > 0:
        size, unit = match.group(1), (match.group(2) or "GiB")
        if unit.lower() == "gb":  # decimal, as cards are sold: 48 GB is 44.7 GiB
            return GpuProfile(f"{size} GB GPU", int(float(size) * 10**9), (8, 0))
        return GpuProfile(f"{size} GiB GPU", int(float(size) * GIB), (8, 0))
    raise UsageError(f"unknown GPU {spec!r}; use a size such as 48GiB or one of: {', '.join(GPU_PROFILES)}")
