"""Time `trainlab plan` for VAR-d16 at its official batch (768) on this CPU: the issue's bar is <= 10 s.

    .venv/bin/python benchmarks/bench_plan.py [--repeats 3] [--gpus 1] [--precision fp16-amp-scale]

The planner needs the tokenizer's weights file for its architecture; with no official `vae_ch160v4096z32.pth` at
hand, the script writes a VQVAE of the official architecture (random weights, ~0.4 GB) to a temporary folder
once, outside the timed part. Times the planning call (one trace at the configured micro-batch, on fake tensors)
and records the peak resident memory growth, to show that planning allocates no training memory.
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch
from _env import environment, result_path, write_result

from trainlab.config import parse
from trainlab.memory.planner import PlanRequest, plan
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig
from trainlab.recipes.var import VARRecipe, VARTrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--precision", default="fp16-amp-scale")
    parser.add_argument("--json", default="auto", help="result path ('auto': benchmarks/results/, '': none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = Path(folder) / "vae_official_random.pth"
        torch.save(VQVAE(VQVAEConfig.official()).state_dict(), tokenizer)
        argv = ["--config", "var_d16", "--tokenizer", str(tokenizer), "--precision", args.precision, "--device", "cuda"]
        config = parse(VARTrainConfig, argv, prog="bench_plan")
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seconds = []
        result = None
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = plan(VARRecipe(config), PlanRequest(device="cuda", gpus=args.gpus, search=False))
            seconds.append(time.perf_counter() - start)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert result is not None
    b = result.breakdown
    summary = {
        "what": "trainlab plan var --config var_d16 (batch 768), one trace, --device cuda, no --gpu search",
        "precision": args.precision,
        "gpus": args.gpus,
        "micro_batch": b.micro_batch,
        "seconds": seconds,
        "seconds_min": min(seconds),
        "peak_rss_growth_bytes": rss_after - rss_before,
        "peak_allocated_bytes": b.peak_allocated_bytes,
        "peak_reserved_bytes": b.peak_reserved_bytes,
        "parameters": b.parameters,
        "environment": environment(),
    }
    print(
        f"VAR-d16 batch {config.batch_size} on {args.gpus} GPU(s), {args.precision}: planned in "
        f"{min(seconds):.2f} s (runs: {', '.join(f'{s:.2f}' for s in seconds)}); predicted reserved peak "
        f"{b.peak_reserved_bytes / 2**30:.2f} GiB; RSS growth while planning {(rss_after - rss_before) / 2**20:.0f} MiB"
    )
    write_result(result_path(args.json, "plan_var_d16_b768", args.precision, f"gpus{args.gpus}"), summary)


if __name__ == "__main__":
    main()
