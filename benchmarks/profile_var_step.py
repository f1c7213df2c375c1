"""Where one VAR training step spends its time on this CPU, and how fast it could possibly be (fp32, 2 threads).

    .venv/bin/python benchmarks/profile_var_step.py --depth 4      # also --depth 8; JSON result in results/

Two steps side by side on the same weights and images (B=8, 256 px, the ch=32 tokenizer of bench_var.py):
  official  the official trainer step of bench_var.py (`official_train_step`: NCHW encoder, full-mask attention,
            F.cross_entropy, fused AdamW);
  trainlab  the step `trainlab train var` runs, built from the recipe's own functions: `encode_batch` on the
            tokenizer after `optimize_for_inference()`, the teacher-forcing input, the VAR forward with block-split
            attention, `token_cross_entropy` + `token_metrics`, backward, clip 2.0, fused AdamW.
For each: FLOPs (`torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions, attention), the wall time per
step (median of --repeats, alternating), and a `torch.profiler` breakdown of one step by kernel family (matmul,
convolution, attention, optimizer, everything else). Then every matmul shape of the trainlab step is timed alone
(`torch.mm` / `torch.addmm` on fresh tensors, median of 5): the sum is what those matmuls cost with nothing around
them, and (matmul in isolation + convolution + attention as profiled) is a floor for any eager implementation of
the same computation on this machine. The ratio official / floor bounds the speed-up any rewrite of the Python
around the kernels can reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result
from bench_var import BATCH, official_train_step, write_tokenizer
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from trainlab.data.token_cache import encode_batch
from trainlab.losses.token_cross_entropy import token_cross_entropy, token_metrics
from trainlab.models.var.convert import load_tokenizer
from trainlab.models.var.scales import scale_slices
from trainlab.models.var.transformer import VAR, VARConfig

# Shape legend: B batch, L tokens, V vocabulary.

MATMUL_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "aten::mm": torch.mm,
    "aten::addmm": torch.addmm,
    "aten::bmm": torch.bmm,
}
MATMUL = set(MATMUL_FUNCTIONS)
CONV = {"aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution", "aten::thnn_conv2d"}


def family(op: str) -> str:
    if op in MATMUL:
        return "matmul"
    if op in CONV or "conv" in op:
        return "convolution"
    if "scaled_dot_product" in op or "flash_attention" in op:
        return "attention"
    if "adam" in op:
        return "optimizer"
    return "other"


def trainlab_step_fn(
    var: VAR, tokenizer: Any, opt: torch.optim.Optimizer, img: torch.Tensor, label: torch.Tensor
) -> Callable[[], float]:
    """The recipe's step (`VARRecipe.train_step` + the engine's backward / clip / step) on one batch."""
    slices = scale_slices(var.patch_nums)
    L = var.seq_len
    weight_L = torch.full((L,), 1.0 / L)

    def step() -> float:
        t0 = time.perf_counter()
        tokens_BL = encode_batch(tokenizer, img)
        parts = list(torch.split(tokens_BL, [s.stop - s.start for s in slices], dim=1))
        with torch.no_grad():
            x_BLCv = tokenizer.quantize.idx_to_var_input(parts)
        out = token_cross_entropy(var(label, x_BLCv), tokens_BL, weight_L)
        metrics = token_metrics(out.ce_BL, out.prediction_BL, tokens_BL, slices, all_scales=True, per_scale=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(var.parameters(), 2.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        {k: float(v) for k, v in metrics.items()}  # the engine reads its metrics as numbers
        return time.perf_counter() - t0

    return step


def breakdown(fn: Callable[[], Any]) -> tuple[dict[str, float], list[tuple[str, tuple, int]]]:
    """Self CPU seconds per kernel family of one call, and the matmul calls (op, input shapes, count)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    seconds: dict[str, float] = defaultdict(float)
    matmuls: list[tuple[str, tuple, int]] = []
    for event in prof.key_averages(group_by_input_shape=True):
        seconds[family(event.key)] += event.self_cpu_time_total / 1e6
        if event.key in MATMUL:
            matmuls.append((event.key, tuple(tuple(s) for s in event.input_shapes), event.count))
    return dict(seconds), matmuls


def matmul_operands(op: str, shapes: tuple) -> list[tuple[int, ...]]:
    """The tensor operands of a profiled matmul call (addmm's bias first; scalars dropped)."""
    return [tuple(shape) for shape in shapes[: 3 if op == "aten::addmm" else 2]]


def matmul_flops(op: str, shapes: tuple) -> int:
    """2 x M x K x N (times the batch for bmm)."""
    a, b = matmul_operands(op, shapes)[-2:]
    batch = a[0] if op == "aten::bmm" else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def isolated_matmul_seconds(matmuls: list[tuple[str, tuple, int]]) -> float:
    """Seconds the listed matmuls take alone (median of 5 per shape, after one warm-up)."""
    total = 0.0
    for op, shapes, count in matmuls:
        args = [torch.randn(shape) for shape in matmul_operands(op, shapes)]
        fn = MATMUL_FUNCTIONS[op]

        def run(fn: Callable[..., torch.Tensor] = fn, args: list[torch.Tensor] = args) -> torch.Tensor:
            return fn(*args)

        run()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        total += statistics.median(times) * count
    return total


def count_flops(fn: Callable[[], Any]) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="auto")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path, source = write_tokenizer(Path(tmp), "ch32")
        cfg = VARConfig.from_depth(args.depth)
        plain = load_tokenizer(str(tokenizer_path), "auto", cfg.patch_nums)
        fast = load_tokenizer(str(tokenizer_path), "auto", cfg.patch_nums).optimize_for_inference()
    torch.manual_seed(0)
    var = VAR(cfg).train()
    var.init_weights(0.5, 1e-3, 0.02, -1)
    img = torch.rand(BATCH, 3, 256, 256) * 2 - 1
    label = torch.randint(0, 1000, (BATCH,))
    opt = torch.optim.AdamW(var.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True)
    steps: dict[str, Callable[[], float]] = {
        "official": lambda: official_train_step(var, plain, opt, img, label)[0],
        "trainlab": trainlab_step_fn(var, fast, opt, img, label),
    }
    for fn in steps.values():
        fn()  # warm-up
    flops = {name: count_flops(fn) for name, fn in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.repeats):
        for name in list(steps)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(steps[name]())
    med = {name: statistics.median(v) for name, v in times.items()}
    families: dict[str, dict[str, float]] = {}
    matmul_calls: dict[str, list[tuple[str, tuple, int]]] = {}
    for name, fn in steps.items():
        families[name], matmul_calls[name] = breakdown(fn)
    isolated = {name: isolated_matmul_seconds(calls) for name, calls in matmul_calls.items()}
    flops_in_matmuls = {
        name: sum(matmul_flops(op, shapes) * n for op, shapes, n in calls) for name, calls in matmul_calls.items()
    }
    print(f"VAR d{args.depth}, B={BATCH}, 256 px, fp32, {args.threads} threads; tokenizer: {source}")
    print(f"load average {env['load_average_1min']} at the start, {os.getloadavg()[0]:.2f} now")
    result: dict[str, Any] = {}
    for name in steps:
        fam = families[name]
        profiled = sum(fam.values())
        floor = isolated[name] + fam.get("convolution", 0.0) + fam.get("attention", 0.0)
        print(
            f"{name:9s} step {med[name]:.3f} s (min {min(times[name]):.3f}) | {flops[name] / 1e9:.0f} GFLOP -> "
            f"{flops[name] / med[name] / 1e9:.0f} GFLOP/s"
        )
        print(
            "          profiled: "
            + ", ".join(f"{k} {v:.3f} s ({v / profiled:.0%})" for k, v in sorted(fam.items(), key=lambda kv: -kv[1]))
        )
        print(
            f"          matmuls: {fam.get('matmul', 0.0):.3f} s in the step = "
            f"{flops_in_matmuls[name] / max(fam.get('matmul', 1e-9), 1e-9) / 1e9:.0f} GFLOP/s; "
            f"alone {isolated[name]:.3f} s"
            f" = {flops_in_matmuls[name] / isolated[name] / 1e9:.0f} GFLOP/s; floor (matmuls alone + convolutions + "
            f"attention) {floor:.3f} s"
        )
        result[name] = {
            "step_s": times[name],
            "gflop": flops[name] / 1e9,
            "profile_s": fam,
            "matmul_gflop": flops_in_matmuls[name] / 1e9,
            "matmul_isolated_s": isolated[name],
            "floor_s": floor,
        }
    floor = result["trainlab"]["floor_s"]
    print(
        f"official / trainlab: {med['official'] / med['trainlab']:.2f}x; official / floor of the trainlab step: "
        f"{med['official'] / floor:.2f}x (the most any eager rewrite of this computation could reach here)"
    )
    env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    path = result_path(args.json, "var_step_profile", f"d{args.depth}", f"cpu{args.threads}t", args.label)
    write_result(path, {"environment": env, "config": settings(args), "results": result})


if __name__ == "__main__":
    main()
