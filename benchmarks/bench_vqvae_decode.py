"""CPU decode speed of the official-size VQVAE (ch=160, random init): B=4 f_hat (4, 32, 16, 16) -> (4, 3, 256, 256).

Compares the plain path (the official arithmetic: bmm attention, NCHW, nearest upsample + conv, `torch.no_grad`)
with the switches of `VQVAE.optimize_for_inference` added one at a time, all on the same weights and f_hat.
Variants are run interleaved (one call of each per round, after one warm-up call each) so that load from other
processes hits them alike; the table gives the median and min wall-clock and the median process CPU time
(user+sys) of the `repeats` rounds, and each variant's max abs difference to the plain output.
Reference: the official code took 7.86 s for this decode on the 2-core development machine (2 threads).

Run: .venv/bin/python benchmarks/bench_vqvae_decode.py [--repeats 3] [--threads 2] [--ends-only] [--fhat sampled]
The JSON result (every round of every variant, plus the environment) goes to results/ unless `--json ''`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from _env import environment, result_path, settings, write_result

from trainlab.models.var.sample import generate
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig
from trainlab.models.var.vqvae_blocks import AttnBlock, Upsample

OFFICIAL_SECONDS = 7.86  # ../shared/reference/var.md, section 6


@dataclass(frozen=True)
class Variant:
    name: str
    sdpa: bool
    inference_mode: bool
    channels_last: bool
    subpixel: bool


VARIANTS = [
    Variant(
        "plain (official arithmetic, no_grad)", sdpa=False, inference_mode=False, channels_last=False, subpixel=False
    ),
    Variant("+ SDPA attention + inference_mode (in-place)", True, True, False, False),
    Variant("+ channels_last", True, True, True, False),
    Variant("+ sub-pixel upsample = optimize_for_inference()", True, True, True, True),
]


def configure(model: VQVAE, v: Variant) -> None:
    """Switch the model to variant `v` in place (outside the timed region)."""
    for module in model.modules():
        if isinstance(module, AttnBlock):
            module.use_sdpa = v.sdpa
        elif isinstance(module, Upsample):
            module.subpixel = v.subpixel
    model.channels_last = v.channels_last
    model.to(memory_format=torch.channels_last if v.channels_last else torch.contiguous_format)


@contextlib.contextmanager
def grad_context(v: Variant) -> Iterator[None]:
    with torch.inference_mode() if v.inference_mode else torch.no_grad():
        yield


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, float, torch.Tensor]:
    t_wall, t_cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - t_wall, cpu_seconds() - t_cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported), >= 3")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ends-only", action="store_true", help="only the plain and the fully optimised variants")
    parser.add_argument(
        "--fhat",
        choices=("sampled", "random-tokens"),
        default="random-tokens",
        help="decode the f_hat of a d4 VAR sample (official init, seed 0, cfg 1.5, top-k 900, top-p 0.95: the "
        "reference's protocol) or of uniformly random tokens",
    )
    parser.add_argument("--json", default="auto", help="result file ('auto': results/vqvae_decode_<...>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    args = parser.parse_args()
    variants = [VARIANTS[0], VARIANTS[-1]] if args.ends_only else VARIANTS
    torch.set_num_threads(args.threads)
    env = environment()
    torch.manual_seed(0)

    model = VQVAE(VQVAEConfig.official()).freeze()
    quantizer = model.quantize
    if args.fhat == "sampled":
        var = VAR(VARConfig.from_depth(4)).eval()
        labels = [1, 207, 360, 980][: args.batch] + [0] * max(0, args.batch - 4)
        with torch.no_grad():
            f_hat_BChw = generate(var, model, labels, seed=0, cfg=1.5, top_k=900, top_p=0.95).f_hat
    else:
        idx_list = [torch.randint(0, quantizer.vocab_size, (args.batch, pn * pn)) for pn in quantizer.patch_nums]
        with torch.no_grad():
            f_hat_BChw = quantizer.idx_to_fhat(idx_list)  # uniformly random tokens through the quantizer
    print(f"f_hat: {args.fhat}, mean {f_hat_BChw.mean():.3f}, std {f_hat_BChw.std():.3f}")

    def run(v: Variant) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with grad_context(v):
                return model.fhat_to_img(f_hat_BChw)

        return call

    outputs: dict[str, torch.Tensor] = {}
    for v in variants:  # warm-up (oneDNN primitive creation, allocator) and the outputs for the diff
        configure(model, v)
        outputs[v.name] = timed(run(v))[2]
    walls: dict[str, list[float]] = {v.name: [] for v in variants}
    cpus: dict[str, list[float]] = {v.name: [] for v in variants}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for v in variants:
            configure(model, v)
            wall, cpu, _ = timed(run(v))
            walls[v.name].append(wall)
            cpus[v.name].append(cpu)
    load_after = os.getloadavg()[0]

    plain = variants[0].name
    base = statistics.median(walls[plain])
    base_cpu = statistics.median(cpus[plain])
    print(
        f"\nVQVAE ch=160 decode of a {args.fhat} f_hat, B={args.batch}, fp32, CPU, {args.threads} threads, "
        f"torch {torch.__version__}; "
        f"{args.repeats} interleaved rounds; 1-min load average {load_before:.1f} -> {load_after:.1f} "
        f"on {os.cpu_count()} CPUs\n"
    )
    print(
        "| variant | wall median (s) | wall min (s) | CPU median (s) | speed-up (wall / CPU) | max abs diff vs plain |"
    )
    print("|---|---|---|---|---|---|")
    for v in variants:
        wall_med, cpu_med = statistics.median(walls[v.name]), statistics.median(cpus[v.name])
        diff = (outputs[v.name] - outputs[plain]).abs().max().item()
        print(
            f"| {v.name} | {wall_med:.2f} | {min(walls[v.name]):.2f} | {cpu_med:.2f} | "
            f"{base / wall_med:.2f}x / {base_cpu / cpu_med:.2f}x | {diff:.1e} |"
        )
    print(f"| official code (reference, var.md section 6) | {OFFICIAL_SECONDS:.2f} | | | | |")
    env["load_average_1min_at_end"] = round(load_after, 2)
    variant_results = {
        v.name: {
            "wall_s": walls[v.name],
            "cpu_s": cpus[v.name],
            "max_abs_diff_vs_plain": (outputs[v.name] - outputs[plain]).abs().max().item(),
        }
        for v in variants
    }
    results = {"variants": variant_results, "official_reference_s": OFFICIAL_SECONDS}
    fhat = args.fhat.replace("-", "")
    path = result_path(args.json, "vqvae_decode", f"{fhat}fhat", f"b{args.batch}", f"cpu{args.threads}t", args.label)
    write_result(path, {"environment": env, "config": settings(args), "results": results})


if __name__ == "__main__":
    main()
