"""`trainlab plan` against the real CUDA peaks: predicted vs `torch.cuda.max_memory_allocated` / `_reserved` after the
third optimizer step, at three micro-batches per case (a usual one, the predicted largest that fits, the next size).

    .venv/bin/python benchmarks/bench_plan_gpu.py predict --gpu H100-80GB      # on any machine (fake tensors)
    python benchmarks/bench_plan_gpu.py measure --predicted results/plan_gpu_predicted_<...>.json   # on that GPU

`predict` runs the user's command, `trainlab plan RECIPE FLAGS --gpu GPU --json`, first at the case's usual
micro-batch (its `max_micro_batch` is the predicted largest that fits), then at that largest and at the next size
(each `--batch-size M --grad-accumulation 1`), and stores the three plans. `measure` runs each of those
configurations for real, one fresh process per configuration (`--child`), through the `--measure` code path of
`trainlab plan` (`memory.measure.measure_step`: the Trainer's loop with the recipe's loader, `--data.kind fake`):
2 warm-up steps and 1 timed step, then reads the allocator's peaks, the allocator's reserved bytes now, and the
device memory in use (`torch.cuda.mem_get_info`: context, library workspaces and everything outside the allocator
included). A configuration that runs out of memory is recorded as such: the question for the next size is whether it
does. The configurations that do not run at the limit run first, then the others one at a time with the GPU alone.

Cases (the recipes' official configurations; the data is `--data.kind fake`, which the planner does not read):
  var_d16     `--config var_d16`, the ch=160 VQVAE of the official architecture (random init, written once into the
              work folder: memory does not depend on the values), fp16-amp-scale, usual micro-batch 96 (768 / 8 GPUs)
  moco_vit_s  `--config moco_v3_vit_small`, fp16-amp-scale, usual micro-batch 128 (1024 / 8 GPUs)
  moco_r50    `--config moco_v3_r50_100ep`, fp16-amp-scale, usual micro-batch 128
  cifar_r18   `--config cifar_resnet18`, fp32, usual micro-batch 128
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _env import environment, result_path, settings, write_result

CASES: dict[str, tuple[str, list[str], int]] = {
    "var_d16": ("var", ["--config", "var_d16"], 96),
    "moco_vit_s": ("moco", ["--config", "moco_v3_vit_small"], 128),
    "moco_r50": ("moco", ["--config", "moco_v3_r50_100ep"], 128),
    "cifar_r18": ("cifar", ["--config", "cifar_resnet18"], 128),
}
PLAN_KEYS = (
    "precision",
    "micro_batch",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "overhead_bytes",
    "total_bytes",
    "gpu_bytes",
    "fits",
    "max_micro_batch",
)
ROWS = ("usual", "largest", "next")  # the three stored plans of a case, in order
MEASURE_STEPS = (2, 1)  # warm-up steps, timed steps: the peaks are read after the third optimizer step
MIB = 2**20


def case_flags(case: str, work: Path, micro_batch: int, device: str = "cuda", extra: str = "") -> tuple[str, list[str]]:
    """The recipe and its flags for one configuration of `case` (the same on both machines, but for paths), with the
    `extra` flags (`--flags`, e.g. "--deterministic true") last."""
    recipe, flags, _ = CASES[case]
    flags = [*flags, "--batch-size", str(micro_batch), "--grad-accumulation", "1", "--data.kind", "fake"]
    # one micro-batch of fake images per epoch (at least 256: MoCo's kNN monitor needs a bank of --knn-k 200): making
    # them is the child's longest part at 224 pixels, and memory does not depend on how many there are
    flags += ["--data.fake-size", str(max(micro_batch, 256)), "--device", device]
    if recipe == "var":
        flags += ["--tokenizer-weights", str(tokenizer_file(work)), "--use-token-cache", "false"]
    return recipe, flags + shlex.split(extra)


def tokenizer_file(work: Path) -> Path:
    """The ch=160 VQVAE of the official architecture (random init, seed 0), written once."""
    from bench_var import write_tokenizer

    return write_tokenizer(work, "ch160")[0]


def shown(recipe: str, flags: list[str], work: Path, plan: bool) -> str:
    words = ["trainlab", "plan" if plan else "train", recipe, *flags]
    return shlex.join(words).replace(str(work), "$WORK")


# ------------------------------------------------------------------------------------------------ predict
def plan_json(recipe: str, flags: list[str], gpu: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "trainlab", "plan", recipe, *flags, "--gpu", gpu, "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"`{shlex.join(argv[3:])}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def predict(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for case in args.cases.split(","):
        recipe, _, usual = CASES[case]
        rows = []
        t0 = time.perf_counter()
        first = plan_json(*case_flags(case, work, usual, extra=args.flags), args.gpu)
        largest = int(first["max_micro_batch"])
        for micro in (usual, largest, largest + 1):
            flags = case_flags(case, work, micro, extra=args.flags)
            result = first if micro == usual else plan_json(*flags, args.gpu)
            row = {k: result[k] for k in PLAN_KEYS}
            row["command"] = shown(*flags, work, plan=True) + f" --gpu {args.gpu} --json"
            rows.append(row)
            print(
                f"{case:11s} micro-batch {micro:6d}: allocated {row['peak_allocated_bytes'] / MIB:10,.0f} MiB, "
                f"reserved {row['peak_reserved_bytes'] / MIB:10,.0f} MiB, total {row['total_bytes'] / MIB:10,.0f} "
                f"MiB of {row['gpu_bytes'] / MIB:,.0f}: {'fits' if row['fits'] else 'DOES NOT FIT'}",
                flush=True,
            )
        cases[case] = {"recipe": recipe, "largest": largest, "plans": rows, "plan_seconds": time.perf_counter() - t0}
    return cases


# ------------------------------------------------------------------------------------------------ measure
def child(case: str, micro_batch: int, work: Path, device_name: str, extra: str = "") -> dict[str, Any]:
    """One configuration's real steps in this fresh process; the peaks and the device's memory in use after them
    (`device_name` cpu: the plumbing only, the resident-set growth instead of the allocator's peaks)."""
    import torch

    from trainlab.config import parse
    from trainlab.memory.measure import measure_step
    from trainlab.recipes import get_recipe

    recipe_name, flags = case_flags(case, work, micro_batch, device_name, extra)
    recipe_cls = get_recipe(recipe_name)
    recipe = recipe_cls(parse(recipe_cls.config_class, flags, prog=f"trainlab plan {recipe_name}"))
    device = torch.device(device_name)
    row: dict[str, Any] = {"case": case, "micro_batch": micro_batch}
    if device.type == "cuda":
        torch.cuda.init()
        free0, total = torch.cuda.mem_get_info(device)
        row["device_used_at_start_bytes"] = total - free0
    warmup, steps = MEASURE_STEPS
    try:
        measured = measure_step(recipe, device, steps=steps, warmup_steps=warmup)
    except torch.OutOfMemoryError as error:
        row.update(status="out of memory", error=str(error).splitlines()[0][:300])
    except Exception as error:  # recorded, not fatal: the other configurations still run
        oom = "out of memory" in str(error).lower()
        row.update(status="out of memory" if oom else "error", error=f"{type(error).__name__}: {error}"[:600])
    else:
        row.update(status="ran", step_seconds=measured.median_step_seconds, **measured.memory)
    if device.type != "cuda":
        return row
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    row.update(
        device_used_bytes=total - free,
        device_total_bytes=total,
        reserved_now_bytes=torch.cuda.memory_reserved(device),
        max_reserved_bytes=torch.cuda.max_memory_reserved(device),
        max_allocated_bytes=torch.cuda.max_memory_allocated(device),
        alloc_retries=int(stats.get("num_alloc_retries", 0)),
        ooms=int(stats.get("num_ooms", 0)),
    )
    return row


def run_child(case: str, micro_batch: int, work: Path, timeout: int, device: str, extra: str = "") -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", case, str(micro_batch), "--work-dir", str(work), "--device", device]
    argv += [f"--flags={extra}"] if extra else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": case, "micro_batch": micro_batch, "status": "timeout", "seconds": timeout}
    seconds = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-12:])
        oom = "out of memory" in proc.stderr.lower()
        status = "out of memory" if oom else "error"
        return {"case": case, "micro_batch": micro_batch, "status": status, "exit": proc.returncode, "error": tail}
    row: dict[str, Any] = json.loads(lines[-1])
    row["seconds"] = seconds
    return row


def compare(plan: dict[str, Any], real: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"predicted_fits": plan["fits"], "ran": real.get("status") == "ran"}
    if real.get("status") == "ran" and "cuda_max_reserved_bytes" in real:
        for what, measured_key in (("allocated", "peak_memory_bytes"), ("reserved", "cuda_max_reserved_bytes")):
            predicted, measured = plan[f"peak_{what}_bytes"], real[measured_key]
            out[f"{what}_error"] = (predicted - measured) / measured
        out["outside_allocator_bytes"] = real["device_used_bytes"] - real["reserved_now_bytes"]
        out["predicted_outside_allocator_bytes"] = plan["overhead_bytes"]
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    predicted: dict[str, Any] = {}
    for path in args.predicted.split(","):  # later files replace earlier ones' cases
        predicted.update(json.loads(Path(path).read_text())["cases"])
    cases = [c for c in args.cases.split(",") if c in predicted]
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    # the stored plans are the usual micro-batch, the predicted largest and the next size, in that order
    jobs = [(case, plan) for case in cases for row, plan in zip(ROWS, predicted[case]["plans"]) if row in rows]
    for case in cases:  # the tokenizer file first (the children read it)
        if CASES[case][0] == "var":
            tokenizer_file(work)
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    # the usual micro-batches first (far from the limit), then each near-limit configuration with the GPU alone
    ordered = sorted(jobs, key=lambda job: job[1]["micro_batch"] != CASES[job[0]][2])
    for case, plan in ordered:
        real = run_child(case, plan["micro_batch"], work, args.timeout, args.device, args.flags)
        row = {"plan": plan, "real": real, **compare(plan, real)}
        results[case].append(row)
        print(line(case, row), flush=True)
        print("ROW " + json.dumps(row), flush=True)  # every row in the log as it finishes (a stopped run keeps them)
    return results


def line(case: str, row: dict[str, Any]) -> str:
    plan, real = row["plan"], row["real"]
    head = f"{case:11s} {plan['micro_batch']:6d} predicted {'fits' if plan['fits'] else 'no fit':6s} | "
    if real.get("status") != "ran" or "allocated_error" not in row:
        return head + f"{real.get('status')}: {str(real.get('error', ''))[-160:]}"
    return head + (
        f"allocated {plan['peak_allocated_bytes'] / MIB:9,.0f} vs {real['peak_memory_bytes'] / MIB:9,.0f} MiB "
        f"({row['allocated_error']:+.1%}) | reserved {plan['peak_reserved_bytes'] / MIB:9,.0f} vs "
        f"{real['cuda_max_reserved_bytes'] / MIB:9,.0f} MiB ({row['reserved_error']:+.1%}) | outside the allocator "
        f"{row['predicted_outside_allocator_bytes'] / MIB:,.0f} vs {row['outside_allocator_bytes'] / MIB:,.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["predict", "measure"], default="predict")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--gpu", default="H100-80GB", help="predict: the GPU profile planned for")
    parser.add_argument("--predicted", default="", help="measure: the JSON files `predict` wrote (comma-separated)")
    parser.add_argument(
        "--flags", default="", help='more flags of every configuration, planned and run (e.g. "--deterministic true")'
    )
    parser.add_argument("--rows", default=",".join(ROWS), help="measure: which stored plans of each case to run")
    parser.add_argument("--timeout", type=int, default=240, help="measure: seconds per configuration")
    parser.add_argument("--device", default="cuda", help="measure: cuda, or cpu to check the plumbing (no figures)")
    parser.add_argument("--work-dir", default="", help="tokenizer weights ('': a temporary folder)")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/plan_gpu_<mode>_<...>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run, in the auto name")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "MICRO_BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_plan_gpu_") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.child:
            print(json.dumps(child(args.child[0], int(args.child[1]), work, args.device, args.flags)))
            return
        env = environment()
        if args.mode == "predict":
            results = predict(args, work)
            name = ["plan_gpu", "predicted", args.gpu, args.label]
        else:
            if not args.predicted:
                parser.error("measure needs --predicted FILE (the JSON file `predict` wrote)")
            results = measure(args, work)
            name = ["plan_gpu", "measured", env.get("gpu", "nogpu").replace(" ", "-"), args.label]
    write_result(
        result_path(args.json, *name),
        {"environment": env, "config": settings(args), "cases": results},
    )


if __name__ == "__main__":
    main()
