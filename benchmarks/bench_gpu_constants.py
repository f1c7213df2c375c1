"""The device memory outside PyTorch's tensors that the memory planner models as constants (`GpuProfile` in
trainlab/memory/gpus.py: `context_bytes`, `cublas_workspace_bytes`, `cudnn_workspace_bytes`, `nccl_bytes`),
measured on the GPU at hand (CUDA only), plus which attention kernels and optimizer paths run there.

    python benchmarks/bench_gpu_constants.py               # every step, results/gpu_constants_<gpu>_<date>.json
    python benchmarks/bench_gpu_constants.py --steps context,cublas
    python benchmarks/bench_gpu_constants.py --dry-run     # print the plan of steps; needs no GPU

Every step runs in a FRESH child process (this script with --child STEP), so each first call pays its own one-time
costs. "used" is the device's total minus free memory (`torch.cuda.mem_get_info`, all processes on the GPU: run it on
an otherwise idle GPU); "reserved" and "allocated" are PyTorch's caching allocator's counters. A first call that grows
"used" more than "reserved" allocated outside the allocator (library handles, lazily loaded kernels, workspaces of
libraries that do not use the allocator); one that grows "allocated" beyond its output tensors holds a workspace in the
allocator. Steps:
  context          torch.cuda.init() and a 1-element tensor: used - reserved (the CUDA context), CUDA_MODULE_LOADING,
                   torch / CUDA / cuDNN / NCCL versions
  cublas           first fp32 4096x4096 matmul, first bf16 matmul, first backward of a matmul (autograd's thread has
                   its own cuBLAS handle): deltas of used, reserved and allocated beyond the outputs; matmul settings
  cudnn            first conv2d forward+backward (N=64, 64->64 channels, 3x3, 56x56), fp32 then bf16 under autocast,
                   cudnn.benchmark off: the same deltas, and the peak allocated beyond the tensors (the workspace)
  cudnn_benchmark  the same with cudnn.benchmark on (it tries algorithms with their workspaces)
  sdpa             which scaled_dot_product_attention backends (flash, efficient, cudnn, math) run forward+backward in
                   bf16 (B=8, H=16, L=680, K=64) without and with an additive float mask (VAR trains with one)
  fused_adamw      one step of torch.optim.AdamW(fused=True), fp32 and bf16 parameters
  nccl             a one-process NCCL group (tcp://127.0.0.1) and an all_reduce of 1 MiB: used growth (NCCL buffers)
Each measurement is guarded: an error is recorded as its message and the next one runs; a child that dies or hangs
(--timeout) is recorded with the end of its stderr. A compact table is printed at the end.
"""

# Legend: q, k, v (B, H, L, K) attention inputs; x (N, C, S, S) images; w, a, b (D, D) matrices.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result

MIB = 2**20
RESULT_TAG = "RESULT "
STEPS = {
    "context": "CUDA context: used - reserved after init and a 1-element tensor; CUDA_MODULE_LOADING; versions",
    "cublas": "first fp32 / bf16 4096^2 matmul and first matmul backward: used / reserved / allocated deltas",
    "cudnn": "first conv2d fwd+bwd (64x64x56x56, 3x3), fp32 and bf16 autocast, cudnn.benchmark off",
    "cudnn_benchmark": "the same with cudnn.benchmark on",
    "sdpa": "SDPA backends flash / efficient / cudnn / math, bf16 B=8 H=16 L=680 K=64, without and with float mask",
    "fused_adamw": "one step of AdamW(fused=True), fp32 and bf16 parameters",
    "nccl": "one-process NCCL group + all_reduce of 1 MiB: used delta (NCCL buffers)",
}


# ---------------------------------------------------------------------------------------------------------------------
# Child side: one step in a fresh process, its record printed as one JSON line tagged RESULT.


def snap() -> dict[str, int]:
    """Device used (all processes), and the caching allocator's reserved, allocated and peak allocated bytes."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "used": total - free,
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
    }


def deltas(before: dict[str, int], after: dict[str, int], tensor_bytes: int = 0) -> dict[str, float]:
    """MiB growth of used, reserved, allocated and peak allocated; `*_beyond_tensors` subtract the bytes of the
    tensors the measured code created and kept (`tensor_bytes`); `outside_allocator` = used growth - reserved growth."""
    d = {k: after[k] - before[k] for k in before}
    return {
        "used_mib": d["used"] / MIB,
        "reserved_mib": d["reserved"] / MIB,
        "allocated_mib": d["allocated"] / MIB,
        "allocated_beyond_tensors_mib": (d["allocated"] - tensor_bytes) / MIB,
        "peak_allocated_beyond_start_mib": (after["max_allocated"] - before["allocated"]) / MIB,
        "outside_allocator_mib": (d["used"] - d["reserved"]) / MIB,
        "tensor_mib": tensor_bytes / MIB,
    }


def error_text(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:3])[:600]}"


def attempt(record: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """record[key] = fn(), or {"error": ...} when it raises; returns the value (None on error)."""
    try:
        value = fn()
    except Exception as exc:  # every measurement is optional: record why it failed, go on
        record[key] = {"error": error_text(exc)}
        return None
    record[key] = value
    return value


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def start_cuda() -> dict[str, int]:
    """Context and a 1-element tensor (the baseline of every step)."""
    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    return snap()


def nvml_used() -> dict[str, Any]:
    """Device memory used, and this process's, from NVML (pynvml), where it is installed."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return {
            "device_used_mib": used / MIB,
            "this_process_mib": mine[0] / MIB if mine else None,
            "processes": len(procs),
        }
    finally:
        pynvml.nvmlShutdown()


def step_context(record: dict[str, Any]) -> None:
    record["cuda_module_loading_at_start"] = os.environ.get("CUDA_MODULE_LOADING", "(unset)")
    attempt(record, "nvml_before_init", nvml_used)
    base = start_cuda()
    record["cuda_module_loading_after_init"] = os.environ.get("CUDA_MODULE_LOADING", "(unset)")
    record["snapshot_mib"] = {k: v / MIB for k, v in base.items()}
    record["context_mib"] = (base["used"] - base["reserved"]) / MIB
    nvml_after = attempt(record, "nvml_after_init", nvml_used)
    before = record.get("nvml_before_init", {})
    if nvml_after and "device_used_mib" in before:
        record["context_nvml_delta_mib"] = nvml_after["device_used_mib"] - before["device_used_mib"]
    props = torch.cuda.get_device_properties(0)
    record["device"] = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_mib": props.total_memory / MIB,
        "multiprocessors": props.multi_processor_count,
    }
    record["versions"] = {
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda),
        "cudnn": torch.backends.cudnn.version(),
        "nccl": None,
        "driver": None,
    }
    with contextlib.suppress(Exception):
        record["versions"]["nccl"] = ".".join(str(n) for n in torch.cuda.nccl.version())
    with contextlib.suppress(Exception):
        record["versions"]["driver"] = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]
    record["summary"] = (
        f"context {record['context_mib']:.0f} MiB, CUDA_MODULE_LOADING={record['cuda_module_loading_after_init']}"
    )


def step_cublas(record: dict[str, Any]) -> None:
    start_cuda()
    m = torch.backends.cuda.matmul
    settings_: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    for name in ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        with contextlib.suppress(Exception):
            settings_[name] = getattr(m, name)
    with contextlib.suppress(Exception):
        settings_["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    for var in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        settings_[var] = os.environ.get(var, "(unset)")
    record["settings"] = settings_
    d = 4096
    a = torch.randn(d, d, device="cuda")
    b = torch.randn(d, d, device="cuda")
    a16, b16 = a.bfloat16(), b.bfloat16()
    w = torch.randn(d, d, device="cuda", requires_grad=True)
    x = torch.randn(d, d, device="cuda")
    kept: list[torch.Tensor] = []

    def first(fn: Callable[[], torch.Tensor | None], grad_of: torch.Tensor | None = None) -> dict[str, float]:
        torch.cuda.reset_peak_memory_stats()
        before = snap()
        out = fn()
        after = snap()
        if out is not None:
            kept.append(out)
        return deltas(before, after, nbytes(out, grad_of.grad if grad_of is not None else None))

    def backward() -> None:
        (x @ w).sum().backward()

    attempt(record, "fp32_matmul", lambda: first(lambda: a @ b))
    attempt(record, "bf16_matmul", lambda: first(lambda: a16 @ b16))
    attempt(record, "matmul_backward", lambda: first(backward, grad_of=w))
    attempt(record, "second_fp32_matmul", lambda: first(lambda: a @ b))
    record["summary"] = summary(
        record,
        ("fp32_matmul", "bf16_matmul", "matmul_backward"),
        lambda r: f"used+{r['used_mib']:.0f} res+{r['reserved_mib']:.0f} alloc+{r['allocated_beyond_tensors_mib']:.0f}",
    )


def summary(record: dict[str, Any], keys: tuple[str, ...], line: Callable[[dict[str, Any]], str]) -> str:
    """One line of a step's sub-measurements: `line` of each, or ERROR."""
    failed = [key for key in keys if "error" in record.get(key, {"error": ""})]
    parts = [f"{key} ERROR" if key in failed else f"{key} {line(record[key])}" for key in keys]
    return "; ".join(parts) + " MiB"


def step_cudnn(record: dict[str, Any], benchmark: bool) -> None:
    start_cuda()
    torch.backends.cudnn.benchmark = benchmark
    record["settings"] = {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
    }
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()

    def fwd_bwd(autocast: bool) -> dict[str, float]:
        conv.zero_grad(set_to_none=True)
        x = torch.randn(64, 64, 56, 56, device="cuda", requires_grad=True)
        g = torch.randn(64, 64, 56, 56, device="cuda", dtype=torch.bfloat16 if autocast else torch.float32)
        torch.cuda.reset_peak_memory_stats()
        before = snap()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = conv(x)
        y.backward(g)
        after = snap()
        assert conv.weight.grad is not None
        r = deltas(
            before, after, nbytes(y, x.grad, conv.weight.grad, conv.bias.grad if conv.bias is not None else None)
        )
        # the peak beyond the kept tensors: cuDNN's workspace (and, under autocast, the cast copies)
        r["workspace_estimate_mib"] = r["peak_allocated_beyond_start_mib"] - r["tensor_mib"]
        return r

    attempt(record, "fp32_conv", lambda: fwd_bwd(False))
    attempt(record, "bf16_autocast_conv", lambda: fwd_bwd(True))
    attempt(record, "second_fp32_conv", lambda: fwd_bwd(False))
    record["summary"] = summary(
        record,
        ("fp32_conv", "bf16_autocast_conv"),
        lambda r: f"used+{r['used_mib']:.0f} res+{r['reserved_mib']:.0f} workspace~{r['workspace_estimate_mib']:.0f}",
    )


def step_sdpa(record: dict[str, Any]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    start_cuda()
    B, H, L, K = 8, 16, 680, 64  # the shape's letters (Legend)
    q, k, v = (torch.randn(B, H, L, K, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 1, L, L, device="cuda", dtype=torch.bfloat16)  # additive, broadcast over B and H
    backends = {
        "flash": "FLASH_ATTENTION",
        "efficient": "EFFICIENT_ATTENTION",
        "cudnn": "CUDNN_ATTENTION",
        "math": "MATH",
    }
    table: dict[str, dict[str, str]] = {}
    for name, attr in backends.items():
        table[name] = {}
        for masked in (False, True):
            key = "float_mask" if masked else "no_mask"
            try:
                backend = getattr(SDPBackend, attr)
                with sdpa_kernel([backend]):
                    out = scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None)
                    out.sum().backward()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None).sum().backward()
                    torch.cuda.synchronize()
                table[name][key] = f"ok ({(time.perf_counter() - t0) / 3 * 1e3:.2f} ms fwd+bwd)"
            except Exception as exc:  # a backend that does not run here: record why
                table[name][key] = error_text(exc)
            q.grad = k.grad = v.grad = None
    record["backends"] = table
    record["summary"] = (
        "; ".join(
            f"{n}: {'/'.join('ok' if r[c].startswith('ok') else 'no' for c in ('no_mask', 'float_mask'))}"
            for n, r in table.items()
        )
        + " (no mask / float mask)"
    )


def step_fused_adamw(record: dict[str, Any]) -> None:
    start_cuda()

    def one_step(dtype: torch.dtype) -> str:
        model = torch.nn.Linear(1024, 1024).cuda().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        model(torch.randn(32, 1024, device="cuda", dtype=dtype)).float().square().mean().backward()
        before = model.weight.detach().clone()
        opt.step()
        torch.cuda.synchronize()
        moved = not torch.equal(before, model.weight.detach())
        return "ok" if moved else "ran, but the weights did not change"

    attempt(record, "fp32", lambda: one_step(torch.float32))
    attempt(record, "bf16", lambda: one_step(torch.bfloat16))
    record["summary"] = "; ".join(
        f"{k}: {record[k] if isinstance(record[k], str) else record[k]['error']}" for k in ("fp32", "bf16")
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def step_nccl(record: dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    record["env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    base = start_cuda()
    t = torch.ones(MIB // 4, device="cuda")  # 1 MiB of fp32
    port = free_port()
    try:
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        after_init = snap()
        record["init"] = deltas(base, after_init, nbytes(t))
        dist.all_reduce(t)
        after = snap()
        record["all_reduce_ok"] = bool(torch.all(t == 1).item())
        record["after_all_reduce"] = deltas(base, after, nbytes(t))
        record["nccl_mib"] = record["after_all_reduce"]["outside_allocator_mib"]
        record["summary"] = (
            f"used+{record['after_all_reduce']['used_mib']:.0f} MiB "
            f"(outside allocator {record['nccl_mib']:.0f} MiB), all_reduce ok={record['all_reduce_ok']}"
        )
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def child(step: str) -> None:
    record: dict[str, Any] = {"step": step}
    try:
        if step == "context":
            step_context(record)
        elif step == "cublas":
            step_cublas(record)
        elif step == "cudnn":
            step_cudnn(record, benchmark=False)
        elif step == "cudnn_benchmark":
            step_cudnn(record, benchmark=True)
        elif step == "sdpa":
            step_sdpa(record)
        elif step == "fused_adamw":
            step_fused_adamw(record)
        elif step == "nccl":
            step_nccl(record)
        else:
            raise ValueError(f"unknown step {step!r}")
        record.setdefault("summary", "")
    except Exception as exc:  # the step's own failure is its result
        record["error"] = error_text(exc)
        record["traceback"] = traceback.format_exc()[-3000:]
    print(RESULT_TAG + json.dumps(record, default=str), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Parent side: one child per step, the table and the result file.


def run_step(step: str, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", step]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"step": step, "error": f"timed out after {timeout:g} s", "stderr_tail": err[-2000:], "seconds": timeout}
    except Exception as exc:  # could not even start the child
        return {"step": step, "error": error_text(exc), "seconds": 0.0}
    seconds = round(time.perf_counter() - t0, 1)
    tagged = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    record: dict[str, Any]
    try:
        record = json.loads(tagged[-1][len(RESULT_TAG) :]) if tagged else {}
    except json.JSONDecodeError as exc:
        record = {"error": f"unreadable result line: {exc}"}
    if not tagged:
        record = {"error": f"no result (exit code {proc.returncode})"}
    record.update(step=step, seconds=seconds, exit_code=proc.returncode)
    if "error" in record or proc.returncode != 0:
        record["stderr_tail"] = "\n".join(proc.stderr.splitlines()[-20:])
    return record


def constants(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the measurements say about `GpuProfile`'s constants (MiB; None where the step failed). cuBLAS is given
    both ways: growth outside the allocator (older PyTorch) and workspace inside it (recent PyTorch)."""

    def get(step: str, *keys: str) -> Any:
        value: Any = records.get(step, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    cublas_outside = cublas_inside = 0.0
    for key in ("fp32_matmul", "bf16_matmul", "matmul_backward"):
        outside, inside = (
            get("cublas", key, "outside_allocator_mib"),
            get("cublas", key, "allocated_beyond_tensors_mib"),
        )
        if outside is None or inside is None:
            cublas_outside = cublas_inside = float("nan")
            break
        cublas_outside += outside
        cublas_inside += inside
    workspaces = [
        get(step, key, "workspace_estimate_mib")
        for step in ("cudnn", "cudnn_benchmark")
        for key in ("fp32_conv", "bf16_autocast_conv")
    ]
    known = [w for w in workspaces if isinstance(w, (int, float))]
    return {
        "context_mib": get("context", "context_mib"),
        "cublas_outside_allocator_mib": None if cublas_outside != cublas_outside else cublas_outside,
        "cublas_in_allocator_mib": None if cublas_inside != cublas_inside else cublas_inside,
        "cudnn_workspace_max_mib": max(known) if known else None,
        "nccl_mib": get("nccl", "nccl_mib"),
    }


def table(records: dict[str, dict[str, Any]], derived: dict[str, Any]) -> str:
    lines = [f"{'step':<16}{'s':>6}  result", "-" * 100]
    for step, r in records.items():
        text = f"ERROR {r['error']}" if "error" in r else r.get("summary", "")
        lines.append(f"{step:<16}{r.get('seconds', 0.0):>6.1f}  {text[:200]}")
    lines.append("-" * 100)
    lines.append(
        "GpuProfile constants (MiB): "
        + ", ".join(f"{k}={'?' if v is None else f'{v:.0f}'}" for k, v in derived.items())
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated, of: " + ", ".join(STEPS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per step's process before it is killed")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/gpu_constants_<gpu>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run, in the auto name")
    parser.add_argument("--dry-run", action="store_true", help="print the plan of steps and exit")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # internal: run one step in this process
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"unknown step(s) {', '.join(unknown)}; choose from: {', '.join(STEPS)}")
    if args.dry_run:
        print("plan (each step in a fresh child process):")
        for step in steps:
            print(f"  {step:<16} {STEPS[step]}")
        return
    # is_available() creates no CUDA context: the parent must hold no device memory while the children measure
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_constants.py measures CUDA memory: no CUDA device here (--dry-run shows the plan)")
    records: dict[str, dict[str, Any]] = {}
    for step in steps:
        print(f"{step} ...", flush=True)
        records[step] = run_step(step, args.timeout)
    derived = constants(records)
    env = environment()  # after the children: this touches CUDA in this process
    gpu = env.get("gpu", "nogpu").replace(" ", "-")
    out = result_path(args.json, "gpu_constants", gpu, args.label)
    write_result(out, {"environment": env, "config": settings(args), "constants_mib": derived, "steps": records})
    print(table(records, derived))


if __name__ == "__main__":
    main()
