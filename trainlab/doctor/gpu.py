"""GPU checks: is CUDA usable, which GPUs torch sees, and per GPU whether this wheel can really train on it.

Per GPU (`gpu<i>-*`):
- **arch**: the GPU's compute capability against the wheel's architecture list (`torch.cuda.get_arch_list()`).
  Machine code for sm_XY runs on capability X.Z with Z >= Y (same major), PTX (`compute_XY`) is compiled for any
  newer GPU at load time (minutes at the first start, then cached); anything else cannot run: "no kernel image is
  available for execution on the device".
- **precision**: bf16 (and TF32, which trainlab leaves off: fp32 stays fp32) need capability 8.0; a run asking for a
  bf16 mode on an older GPU fails.
- **sdpa**: which scaled-dot-product-attention kernels run here (flash, memory-efficient, cuDNN), each tried on a
  tiny bf16/fp16 input. Without flash and memory-efficient attention the math kernel keeps the (B, H, L, L)
  attention weights, which the memory planner does not assume.
- **cudnn-conv**: a tiny convolution, the one place `CUDNN_STATUS_NOT_INITIALIZED` shows up (a cuDNN that does not
  match the driver, or a GPU whose memory other processes took).
- **memory**: free against total memory (another process on a shared or rented GPU).

Across GPUs: `CUDA_VISIBLE_DEVICES` against what torch sees (an entry the driver does not know, or a variable set
after CUDA was initialised, which CUDA then ignores), training processes against GPUs (two ranks on one GPU is
NCCL's "invalid usage"), and an NCCL all-reduce over every GPU when there are several (`collective.py`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

from trainlab.doctor.report import Check
from trainlab.doctor.versions import CudaIntent, DriverInfo
from trainlab.errors import first_line

GIB = 2**30
FREE_MEMORY_WARN = 0.9  # less free than this fraction of the total: another process holds the GPU
_SDPA_BACKENDS = ("flash", "efficient", "cudnn")
PER_GPU_CHECKS = ("arch", "precision", "sdpa", "cudnn-conv", "memory")


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as torch sees it."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]


def cuda_usable(intent: CudaIntent, torch_cuda: str | None, driver: DriverInfo, torch_count: int) -> tuple[bool, Check]:
    """(whether to run the per-GPU checks, the `cuda` check saying so and why not)."""
    if intent == "off":
        return False, Check("cuda", "SKIP", "--device cpu: GPU checks skipped")
    if torch_count > 0:
        return True, Check("cuda", "PASS", f"torch sees {torch_count} GPU(s)", values={"device_count": torch_count})
    if torch_cuda is None:
        why, fix = "this torch wheel is CPU-only", "install a CUDA wheel of torch (see torch above)"
    elif driver.cuda is None:
        why, fix = driver.problem, "install the NVIDIA driver (in a container: run it with --gpus all)"
    elif driver.gpus == ():
        why, fix = (
            "the driver lists no GPU (nvidia-smi)",
            "nvidia-smi -q shows the GPUs' state; rent a machine with one",
        )
    else:
        why = "torch sees no GPU"
        fix = "see cuda-visible-devices and nvidia-driver (a hidden GPU, or a driver too old for the wheel)"
    if intent == "required":
        return False, Check("cuda", "FAIL", f"CUDA is not usable: {why}", fix)
    return False, Check("cuda", "SKIP", f"no usable GPU: {why}; --device cuda makes this a failure")


def skipped_gpu_checks(reason: str) -> list[Check]:
    """The per-GPU and multi-GPU checks, each saying why it did not run."""
    names = [f"gpu-{name}" for name in PER_GPU_CHECKS] + [
        "cuda-visible-devices",
        "gpus-vs-processes",
        "nccl-all-reduce",
    ]
    return [Check(name, "SKIP", reason) for name in names]


# ------------------------------------------------------------------------------------------------ gathering
def gather_gpus() -> list[GpuFacts]:
    """Every GPU torch sees (creates a CUDA context on each)."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuFacts(i, props.name, int(total), int(free), (props.major, props.minor)))
    return gpus


def probe_sdpa(index: int, dtype: torch.dtype) -> dict[str, str]:
    """Each SDPA backend tried on a tiny input on GPU `index`: backend -> '' (runs) or why not (PyTorch's warning
    that explains the refusal when there is one, else the error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    q = torch.randn(1, 2, 16, 64, device=f"cuda:{index}", dtype=dtype)
    result = {}
    for name, backend in backends.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, q, q)
                torch.cuda.synchronize(index)
                result[name] = ""
            except RuntimeError as err:
                reasons = [" ".join(str(w.message).split())[:120] for w in caught]
                result[name] = reasons[0] if reasons else first_line(err, 120)
    return result


def probe_cudnn_conv(index: int) -> str:
    """'' when a tiny cuDNN convolution (forward and backward) runs on GPU `index`, else the error."""
    try:
        with torch.backends.cudnn.flags(enabled=True):
            x = torch.randn(2, 3, 16, 16, device=f"cuda:{index}", requires_grad=True)
            w = torch.randn(8, 3, 3, 3, device=f"cuda:{index}", requires_grad=True)
            torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
            torch.cuda.synchronize(index)
    except RuntimeError as err:
        return first_line(err, 160)
    return ""


# ------------------------------------------------------------------------------------------------ judgements
def _arch(entry: str) -> tuple[str, int, int, bool] | None:
    """`sm_86` -> ("sm", 8, 6, False); `sm_90a` -> ("sm", 9, 0, True) (arch-specific); `compute_90` -> PTX."""
    m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", entry)
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3)), bool(m.group(4))


def arch_coverage(capability: tuple[int, int], arch_list: list[str]) -> tuple[str, str]:
    """How the wheel runs on a GPU of `capability`: ("native" | "compatible" | "ptx" | "none", the entry used)."""
    major, minor = capability
    parsed = [(entry, _arch(entry)) for entry in arch_list]
    for entry, arch in parsed:
        if arch and arch[0] == "sm" and (arch[1], arch[2]) == (major, minor):
            return "native", entry
    compatible = [
        (arch[2], entry)
        for entry, arch in parsed
        if arch and arch[0] == "sm" and not arch[3] and arch[1] == major and arch[2] <= minor
    ]
    if compatible:
        return "compatible", max(compatible)[1]
    ptx = [
        ((arch[1], arch[2]), entry)
        for entry, arch in parsed
        if arch and arch[0] == "compute" and (arch[1], arch[2]) <= (major, minor)
    ]
    if ptx:
        return "ptx", max(ptx)[1]
    return "none", ""


def check_arch(gpu: GpuFacts, arch_list: list[str], torch_cuda: str | None) -> Check:
    cap = f"{gpu.capability[0]}.{gpu.capability[1]}"
    kind, entry = arch_coverage(gpu.capability, arch_list)
    listed = ", ".join(arch_list) or "empty"
    values = {"capability": cap, "arch_list": arch_list, "coverage": kind}
    name = f"gpu{gpu.index}-arch"
    if kind == "native":
        return Check(name, "PASS", f"{gpu.name}: capability {cap}, in the wheel ({entry})", values=values)
    if kind == "compatible":
        return Check(name, "PASS", f"{gpu.name}: capability {cap}, runs the wheel's {entry} code", values=values)
    fix = (
        "install a torch wheel built for this GPU (a newer CUDA: pip install torch --index-url "
        "https://download.pytorch.org/whl/cu128 or newer)"
    )
    if kind == "ptx":
        return Check(
            name,
            "WARN",
            f"{gpu.name}: capability {cap} has no machine code in the wheel ({listed}); its {entry} PTX is compiled "
            "at start-up (slow first run, some kernels missing)",
            fix,
            values=values,
        )
    return Check(
        name,
        "FAIL",
        f"{gpu.name}: capability {cap} is not covered by the wheel's architectures ({listed}, CUDA {torch_cuda}): "
        "'no kernel image is available for execution on the device'",
        fix,
        values=values,
    )


def check_precision(gpu: GpuFacts, precision: str | None) -> Check:
    """bf16 / TF32 support (capability 8.0), against the precision the planned run asks for."""
    name = f"gpu{gpu.index}-precision"
    ampere = gpu.capability >= (8, 0)
    fp16 = gpu.capability >= (5, 3)
    detail = (
        f"bf16 {'yes' if ampere else 'no'}, TF32 {'yes (trainlab keeps fp32 matmuls exact)' if ampere else 'no'}, "
        f"fp16 {'yes' if fp16 else 'no'}"
    )
    values = {"bf16": ampere, "tf32": ampere, "fp16": fp16, "planned_precision": precision}
    if precision and precision.startswith("bf16") and not ampere:
        return Check(
            name,
            "FAIL",
            f"{detail}; the run asks for --precision {precision}",
            "--precision fp16-amp-scale (or fp32)",
            values=values,
        )
    if precision and precision.startswith("fp16") and not fp16:
        return Check(
            name, "FAIL", f"{detail}; the run asks for --precision {precision}", "--precision fp32", values=values
        )
    return Check(name, "PASS", detail, values=values)


def check_sdpa(gpu: GpuFacts, probes: dict[str, str]) -> Check:
    name = f"gpu{gpu.index}-sdpa"
    runs = [b for b in _SDPA_BACKENDS if probes.get(b) == ""]
    detail = f"attention kernels: {', '.join(runs) or 'math only'}"
    missing = {b: why for b, why in probes.items() if why}
    if missing:
        detail += " (" + "; ".join(f"{b}: {why}" for b, why in missing.items()) + ")"
    values = {"sdpa": {b: (why or "ok") for b, why in probes.items()}}
    if "flash" not in runs and "efficient" not in runs:
        return Check(
            name,
            "WARN",
            detail + ": attention falls back to the math kernel, which keeps the whole attention matrix",
            "expect more memory than `trainlab plan` predicts for attention models; a newer GPU or torch wheel",
            values=values,
        )
    return Check(name, "PASS", detail, values=values)


def check_cudnn_conv(gpu: GpuFacts, error: str) -> Check:
    name = f"gpu{gpu.index}-cudnn-conv"
    if not error:
        return Check(name, "PASS", "a cuDNN convolution runs (forward and backward)")
    if "NOT_INITIALIZED" in error or "CUDNN" in error.upper():
        fix = (
            "reinstall torch for a CUDA the driver supports (the wheel bundles cuDNN; see nvidia-driver), and check "
            "that no other process fills the GPU (nvidia-smi)"
        )
    else:
        fix = "see the error; nvidia-smi shows whether the GPU is in a bad state"
    return Check(name, "FAIL", f"a tiny convolution fails: {error}", fix)


def check_memory(gpu: GpuFacts) -> Check:
    name = f"gpu{gpu.index}-memory"
    detail = f"{gpu.free_bytes / GIB:,.1f} GiB free of {gpu.total_bytes / GIB:,.1f} GiB"
    values = {"free_bytes": gpu.free_bytes, "total_bytes": gpu.total_bytes}
    if gpu.free_bytes < FREE_MEMORY_WARN * gpu.total_bytes:
        held = (gpu.total_bytes - gpu.free_bytes) / GIB
        return Check(
            name,
            "WARN",
            detail + f": {held:,.1f} GiB are held by other processes (or this one's CUDA context)",
            "nvidia-smi lists them; stop them, or plan with the free memory (`trainlab plan RECIPE --gpu "
            f"{gpu.free_bytes / GIB:.0f}GiB`)",
            values=values,
        )
    return Check(name, "PASS", detail, values=values)


def visible_entries(value: str, driver_count: int | None) -> tuple[list[str], str]:
    """The CUDA_VISIBLE_DEVICES entries CUDA honours (it stops at the first invalid one), and that entry ('' if none).

    Entries are indices (`0,2`) or UUIDs (`GPU-...`, `MIG-...`). An index the driver does not have, a repeated
    index, a negative one or anything else ends the list: the GPUs after it are hidden.
    """
    honoured: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.startswith(("GPU-", "MIG-")):
            if entry in honoured:
                return honoured, entry
            honoured.append(entry)
            continue
        if not entry.lstrip("-").isdigit():
            return honoured, entry
        index = int(entry)
        if index < 0 or (driver_count is not None and index >= driver_count) or str(index) in honoured:
            return honoured, entry
        honoured.append(str(index))
    return honoured, ""


def check_visible_devices(value: str | None, torch_count: int, driver_count: int | None) -> Check:
    """CUDA_VISIBLE_DEVICES against the GPUs torch sees (and the driver lists, when nvidia-smi answers)."""
    name = "cuda-visible-devices"
    machine = f"; the driver lists {driver_count}" if driver_count is not None else ""
    values = {"CUDA_VISIBLE_DEVICES": value, "torch_device_count": torch_count, "driver_device_count": driver_count}
    if value is None:
        detail = f"not set: torch sees {torch_count} GPU(s){machine}"
        if driver_count is not None and torch_count != driver_count:
            return Check(
                name,
                "WARN",
                detail,
                "nvidia-smi -q shows why a GPU is hidden (MIG mode, a GPU in error)",
                values=values,
            )
        return Check(name, "PASS", detail, values=values)
    honoured, stopped = visible_entries(value, driver_count)
    detail = f"CUDA_VISIBLE_DEVICES={value!r} names {len(honoured)} usable GPU(s), torch sees {torch_count}{machine}"
    if stopped:
        return Check(
            name,
            "FAIL",
            detail + f": CUDA stops at the entry {stopped!r} (unknown, repeated or invalid) and hides the rest",
            f"list only GPUs the driver has (nvidia-smi -L), e.g. CUDA_VISIBLE_DEVICES={','.join(honoured) or '0'}",
            values=values,
        )
    if len(honoured) != torch_count:
        return Check(
            name,
            "FAIL",
            detail + ": the variable was changed after CUDA was initialised in this process, so CUDA ignores it",
            "set it before Python starts (`CUDA_VISIBLE_DEVICES=0,1 trainlab ...`), never inside a script after "
            "torch.cuda was used",
            values=values,
        )
    return Check(name, "PASS", detail, values=values)


def check_processes(processes: int, torch_count: int) -> Check:
    """Training processes on this machine against its GPUs (one GPU per process)."""
    detail = f"{processes} training process(es) for {torch_count} GPU(s)"
    values = {"processes": processes, "gpus": torch_count}
    if processes > torch_count:
        return Check(
            "gpus-vs-processes",
            "FAIL",
            detail + ": two ranks on one GPU stop in NCCL with 'invalid usage'",
            f"--nproc-per-node {torch_count} (torchrun), or make more GPUs visible",
            values=values,
        )
    if processes < torch_count:
        return Check("gpus-vs-processes", "PASS", detail + f" ({torch_count - processes} GPU(s) idle)", values=values)
    return Check("gpus-vs-processes", "PASS", detail, values=values)


def check_all_reduce(gpus: int, outcome: tuple[bool, str] | None) -> Check:
    """The NCCL all-reduce over every GPU (`collective.probe_all_reduce`); None when it was not run."""
    if outcome is None:
        return Check("nccl-all-reduce", "SKIP", f"{gpus} GPU: nothing to reduce across")
    ok, detail = outcome
    if ok:
        return Check("nccl-all-reduce", "PASS", detail)
    return Check(
        "nccl-all-reduce",
        "FAIL",
        detail,
        "rerun with NCCL_DEBUG=WARN for NCCL's reason; in containers add --ipc=host (or a larger --shm-size); "
        "NCCL_P2P_DISABLE=1 works around broken peer-to-peer links",
    )
