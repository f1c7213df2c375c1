"""The GPU measurements of the speed issue, each taken from the command a user runs (CUDA; `--smoke` runs the same
plumbing at toy sizes on any device and measures nothing worth reporting).

    python benchmarks/bench_gpu.py                       # all three sections on cuda, results/gpu_<...>.json
    python benchmarks/bench_gpu.py --section var_train   # one section
    python benchmarks/bench_gpu.py --smoke --device cpu  # toy sizes: checks the commands and the parsing

Sections (every one a real `trainlab` command in a subprocess; the numbers come from its own outputs):
  var_train   `trainlab train var --depth 16 --precision P --data.kind fake` for P in bf16-amp, fp16-amp-scale, fused
              AdamW, re-encoding every batch with the ch=160 tokenizer: images/s over the engine's timed epochs (its
              first epoch is not timed), peak CUDA memory allocated and reserved, from the run's `summary` row.
  var_sample  `trainlab sample --batch-size 64` (d16 VAR, ch=160 VQVAE, cfg 1.5, top-k 900, top-p 0.96): images/s
              of the 50,000-image FID job in steady state, from the `tokens` and `decode` phases of two runs of
              different length (the difference removes the first batch's warm-up).
  precision   `trainlab bench precision --model cifar_resnet18 --data.kind fake --data.fake-size N` (the CIFAR-10 lab
              on synthetic data), all eight modes or --precision-modes: its results.csv (images/s, peak memory, final
              loss per mode).

Weights are random-init official-architecture files written into the work folder (speed does not depend on the
values): the ch=160 VQVAE in the `vae_ch160v4096z32.pth` layout (bench_var.py's) and a VAR of --depth in the official
format.
"""

from __future__ import annotations

import argparse
import csv
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, run_metrics, settings, write_result
from bench_var import write_tokenizer

from trainlab.models.var.convert import export_official, read_state_dict
from trainlab.models.var.transformer import VAR, VARConfig

SECTIONS = ("var_train", "var_sample", "precision")
TRAIN_PRECISIONS = ("bf16-amp", "fp16-amp-scale")
PHASE_RE = re.compile(r"time per phase: (.*)")


def run(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run a `trainlab` command; a failure stops the benchmark with the command and the end of its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"{what}: `{shlex.join(argv[2:])}` failed with exit code {proc.returncode}:\n{tail}")
    return proc


def trainlab(*args: object) -> list[str]:
    return [sys.executable, "-m", "trainlab", *(str(a).lower() if isinstance(a, bool) else str(a) for a in args)]


def shown(argv: list[str], work: Path) -> str:
    """A `trainlab(...)` command as a user types it, the work folder written $WORK."""
    return shlex.join(["trainlab", *argv[3:]]).replace(str(work), "$WORK")


def write_weights(work: Path, depth: int, smoke: bool) -> tuple[Path, Path]:
    """Tokenizer (bench_var's: ch=160 random init, or for --smoke the ch=32 one) and a random-init VAR of `depth` that
    fits it, both in the official formats (seeded: the same files every run)."""
    tokenizer, _ = write_tokenizer(work, "ch32" if smoke else "ch160")
    code_dim = read_state_dict(str(tokenizer), "VQVAE")["quantize.embedding.weight"].shape[1]
    var_path = work / f"var_d{depth}.pth"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        var = VAR(VARConfig.from_depth(depth, vae_embed_dim=code_dim))
        var.init_weights(0.5, 1e-5, 0.02, -1)
        export_official(var, var_path)
    return tokenizer, var_path


def var_train(args: argparse.Namespace, work: Path, tokenizer: Path) -> dict[str, Any]:
    """images/s and peak memory of `trainlab train var` per precision mode (the summary row of each run)."""
    out: dict[str, Any] = {}
    images = args.train_batch_size * args.train_steps
    for precision in TRAIN_PRECISIONS:
        run_dir = work / f"train_{precision}"
        argv = trainlab(
            "train", "var", "--run-dir", run_dir, "--device", args.device, "--precision", precision,
            "--depth", args.depth, "--batch-size", args.train_batch_size, "--epochs", 2,
            "--data.kind", "fake", "--data.fake-size", images, "--tokenizer", tokenizer,
            "--eval-batch-size", args.train_batch_size, "--data.eval-limit", args.train_batch_size,
            "--num-workers", args.num_workers, "--log-every", 1, "--export", False, "--tensorboard", False,
            "--progress", False,
        )  # fmt: skip
        t0 = time.perf_counter()
        run(argv, f"var_train {precision}")
        rows, summary = run_metrics(run_dir)
        out[precision] = {
            "command": shown(argv, work),
            "images_per_second": summary["images_per_second"],
            "seconds_per_step": args.train_batch_size / summary["images_per_second"],
            "peak_memory_gib": summary["peak_memory_bytes"] / 2**30,
            "memory_kind": summary["memory_kind"],
            "cuda_max_reserved_gib": summary.get("cuda_max_reserved_bytes", 0) / 2**30,
            "skipped_steps": sum(int(r.get("skipped", 0)) for r in rows if r["kind"] == "train"),
            "process_wall_s": time.perf_counter() - t0,
        }
        shutil.rmtree(run_dir)
        r = out[precision]
        print(
            f"var_train d{args.depth} {precision}: {r['images_per_second']:.1f} images/s "
            f"({r['seconds_per_step']:.3f} s/step at B={args.train_batch_size}), peak {r['peak_memory_gib']:.2f} GiB "
            f"({r['memory_kind']}; reserved {r['cuda_max_reserved_gib']:.2f} GiB)"
        )
    return out


def phases(stderr: str) -> dict[str, float]:
    """The seconds of each phase in `trainlab sample`'s `time per phase: startup 1.20 s, ..., total 9.10 s` line."""
    match = PHASE_RE.search(stderr)
    if match is None:
        raise SystemExit("trainlab sample printed no `time per phase` line")
    return {name: float(sec) for name, sec in re.findall(r"(\w+) ([\d.]+) s", match.group(1))}


def var_sample(args: argparse.Namespace, work: Path, tokenizer: Path, var_path: Path) -> dict[str, Any]:
    """Steady-state images/s of `trainlab sample` at --sample-batch-size: two runs of 1 and 1 + k batches."""
    B, extra = args.sample_batch_size, args.sample_batches
    busy: dict[int, float] = {}
    records = {}
    for batches in (1, 1 + extra):
        argv = trainlab(
            "sample", "--tokenizer-weights", tokenizer, "--var-weights", var_path, "--device", args.device,
            "--classes", *range(batches * B), "--batch-size", B, "--guidance", 1.5, "--top-k", 900, "--top-p", 0.96,
            "--seed", 0, "--out", work / f"grid_{batches}.png",
        )  # fmt: skip
        seconds = phases(run(argv, f"var_sample {batches} batches").stderr)
        busy[batches] = seconds["tokens"] + seconds["decode"]
        records[f"{batches}_batches"] = {"phases_s": seconds}
    per_batch = (busy[1 + extra] - busy[1]) / extra
    out = {
        "batch_size": B,
        "steady_images_per_second": B / per_batch,
        "first_batch_images_per_second": B / busy[1],
        "runs": records,
    }
    print(
        f"var_sample d{args.depth} B={B}: {out['steady_images_per_second']:.1f} images/s in steady state "
        f"(first batch, warm-up included: {out['first_batch_images_per_second']:.1f})"
    )
    return out


def precision_lab(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`trainlab bench precision` on synthetic CIFAR-format data, every mode; its table as read from results.csv."""
    out_dir = work / "precision"
    argv = trainlab(
        "bench", "precision", "--model", args.precision_model, "--data.kind", "fake", "--data.fake-size",
        args.precision_images,
        "--epochs", args.precision_epochs, "--batch-size", args.precision_batch_size, "--device", args.device,
        "--num-workers", args.num_workers, "--num-seeds", 1, "--run-dir", out_dir,
    )  # fmt: skip
    if args.precision_modes:  # each mode is a process of about 20 s on a GPU (start, files, autotuning, evaluation)
        argv += ["--modes", *args.precision_modes.split(",")]
    run(argv, "precision")
    with (out_dir / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    table = {
        row["precision"]: {
            "images_per_second": float(row["images_per_second_mean"]),
            "seconds_per_epoch": float(row["seconds_per_epoch_mean"]),
            "peak_memory_mib": float(row["peak_memory_mib_mean"]),
            "memory_kind": row["memory_kind"],
            "final_train_loss": float(row["final_train_loss_mean"]),
            "final_test_accuracy_pct": float(row["final_test_accuracy_pct_mean"]),
        }
        for row in rows
    }
    for mode, r in table.items():
        print(
            f"precision {args.precision_model} {mode:15s} {r['images_per_second']:9.1f} images/s, "
            f"peak {r['peak_memory_mib']:8.1f} MiB ({r['memory_kind']}), final loss {r['final_train_loss']:.4g}"
        )
    return {"command": shown(argv, work), "modes": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (depth 2, ch=32 tokenizer, few images)")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--train-batch-size", type=int, default=64, help="per step (one GPU)")
    parser.add_argument("--train-steps", type=int, default=20, help="optimizer steps per epoch (2 epochs)")
    parser.add_argument("--sample-batch-size", type=int, default=64)
    parser.add_argument("--sample-batches", type=int, default=3, help="extra batches of the longer sampling run")
    parser.add_argument("--precision-model", default="cifar_resnet18")
    parser.add_argument("--precision-images", type=int, default=25_000)
    parser.add_argument("--precision-epochs", type=int, default=3)
    parser.add_argument("--precision-batch-size", type=int, default=128)
    parser.add_argument("--precision-modes", default="", help="comma-separated (default: all eight)")
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--work-dir", default="", help="keep weights and runs here (default: a temporary folder)")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/gpu_<...>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run, in the auto name")
    args = parser.parse_args()
    if args.smoke:
        args.depth, args.train_batch_size, args.train_steps = 2, 2, 2
        args.sample_batch_size, args.sample_batches = 2, 1
        args.precision_model, args.precision_images, args.precision_epochs = "vgg_debug", 64, 2
        args.precision_batch_size = 16
        args.num_workers = 0
    elif not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(f"these are GPU measurements: --device {args.device} needs CUDA (or pass --smoke)")
    sections = SECTIONS if args.section == "all" else (args.section,)
    env = environment()
    gpu = env.get("gpu", "nogpu").replace(" ", "-")
    name_parts = ["gpu", args.section, f"d{args.depth}", gpu, "smoke" if args.smoke else "", args.label]
    path = result_path(args.json, *name_parts)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer, var_path = write_weights(work, args.depth, args.smoke)
        sections_run = {
            "var_train": lambda: var_train(args, work, tokenizer),
            "var_sample": lambda: var_sample(args, work, tokenizer, var_path),
            "precision": lambda: precision_lab(args, work),
        }
        for section in sections:
            results[section] = sections_run[section]()
            # rewritten after every section: a run stopped in a later one keeps the sections it finished
            complete = section == sections[-1]
            write_result(path, {"environment": env, "config": settings(args), "results": results, "complete": complete})


if __name__ == "__main__":
    main()
