"""Whole-process benchmark of `trainlab sample` against the official demo flow, phase by phase (CPU, fp32).

    .venv/bin/python benchmarks/bench_var_sample.py --repeats 3 --label idlemachine    # JSON result in results/

Work (the official `demo_sample.ipynb` settings): 8 images, classes 207 360 387 974 88 979 417 279, seed 0, cfg 4,
top-k 900, top-p 0.95, one batch; a d4 VAR (official init) and the official-architecture VQVAE (ch=160, random
init), both written as official-format `.pth` files into a temporary folder first.

Two processes per round, their order alternating round by round (machine load hits both alike), each with
OMP_NUM_THREADS = --threads:
  trainlab   `trainlab sample --vae ... --var ... --classes ... --out grid.png --save-tokens t.pt`: the command a user
             runs. Its phases come from its own log line `time per phase: startup .., load .., tokens .., decode ..,
             write ..` (startup = from the process start: interpreter, imports, argument parsing).
  official   this file run with `--child-official`: the official demo's flow with trainlab's modules standing in for
             the official classes (their parity is tested in tests/test_var_*.py): import torch + torchvision, build
             both models with their random init (`build_vae_var`), `torch.load` without memory mapping +
             `load_state_dict`, the official sampling arithmetic (`bench_var.baseline_sample`: concatenating KV
             cache, full-vocabulary sort for top-p, `torch.multinomial`) under `inference_mode` as the demo runs it, the
             VQVAE decode with the official arithmetic (bmm attention, nearest upsample + conv, NCHW, in-place
             SiLU), `torchvision.utils.make_grid` + PIL.
  official_reuse  the same official flow with trainlab's host allocator policy applied first (`reuse`,
             trainlab/host_memory.py): how much of the difference is that policy alone.
All must produce identical tokens (checked every round). Whole-process wall time is measured from outside.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]
SETTINGS = {"seed": 0, "cfg": 4.0, "top_k": 900, "top_p": 0.95}
PHASES = ("startup", "load", "tokens", "decode", "write")


# ------------------------------------------------------------------------------------- official flow (child)
def child_official(vae_path: Path, var_path: Path, out: Path, tokens_out: Path, allocator: str) -> None:
    """The official demo flow; prints one JSON line of phase seconds. `allocator` `reuse` applies trainlab's host
    allocator policy (trainlab/host_memory.py) to it; `system` is glibc as the official code runs with."""
    import psutil

    if allocator == "reuse":
        from trainlab.host_memory import configure_host_allocator

        configure_host_allocator("reuse")

    startup = time.time() - psutil.Process().create_time()
    t0 = time.perf_counter()
    import torchvision
    from bench_var import baseline_sample
    from PIL import Image

    from trainlab.models.var.transformer import VAR, VARConfig
    from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

    seconds = {"startup": startup + time.perf_counter() - t0}
    t0 = time.perf_counter()
    vae = VQVAE(VQVAEConfig.official())
    var = VAR(VARConfig.from_depth(4))
    var.init_weights(0.5, 1e-5, 0.02, -1)
    vae.load_state_dict(torch.load(vae_path, map_location="cpu"), strict=True)
    var.load_state_dict(torch.load(var_path, map_location="cpu"), strict=True)
    vae.eval().requires_grad_(False)
    var.eval().requires_grad_(False)
    seconds["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():  # the official demo samples under inference_mode
        tokens = baseline_sample(var, vae, CLASSES, **SETTINGS)  # type: ignore[arg-type]
        f_hat = vae.quantize.idx_to_fhat(tokens)
    seconds["tokens"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():  # in-place SiLU as the official decoder (and in-place residual adds: its favour)
        img_B3HW = vae.fhat_to_img(f_hat).add_(1).mul_(0.5)
    seconds["decode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    grid_3HW = torchvision.utils.make_grid(img_B3HW, nrow=8, padding=0, pad_value=1.0)
    Image.fromarray(grid_3HW.permute(1, 2, 0).mul(255).cpu().numpy().astype("uint8")).save(out)
    torch.save([t.view(len(CLASSES), pn, pn) for t, pn in zip(tokens, var.patch_nums)], tokens_out)
    seconds["write"] = time.perf_counter() - t0
    print(json.dumps(seconds))


# ------------------------------------------------------------------------------------------------ parent
def _env(threads: int) -> dict[str, str]:
    here = str(Path(__file__).resolve().parent)
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p),
    }


def run_trainlab(work: Path, threads: int, r: int) -> tuple[float, dict[str, float], list[torch.Tensor]]:
    tokens = work / f"trainlab_tokens_{r}.pt"
    argv = [sys.executable, "-m", "trainlab", "sample", "--tokenizer-weights", str(work / "vae.pth")]
    argv += ["--var-weights", str(work / "var.pth")]
    argv += ["--classes", *map(str, CLASSES), "--seed", "0", "--guidance", "4", "--top-k", "900", "--top-p", "0.95"]
    argv += ["--batch-size", "8", "--device", "cpu", "--out", str(work / f"trainlab_{r}.png")]
    argv += ["--save-tokens", str(tokens)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=_env(threads), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"trainlab sample failed:\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stderr.splitlines() if "time per phase:" in x).split("time per phase:")[1]
    phases = {}
    for part in line.split(","):
        name, value, _ = part.split()
        phases[name] = float(value)
    return wall, phases, torch.load(tokens)


def run_official(
    work: Path, threads: int, r: int, allocator: str = "system"
) -> tuple[float, dict[str, float], list[torch.Tensor]]:
    tokens = work / f"official_tokens_{r}.pt"
    argv = [sys.executable, __file__, "--child-official", str(work), "--round", str(r), "--child-allocator", allocator]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=_env(threads), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"official flow failed:\n{proc.stderr[-2000:]}")
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    phases["total"] = sum(phases.values())
    return wall, phases, torch.load(tokens)


def write_weights(work: Path) -> None:
    from trainlab.models.var.convert import export_official
    from trainlab.models.var.transformer import VAR, VARConfig
    from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

    torch.manual_seed(0)
    var = VAR(VARConfig.from_depth(4))
    var.init_weights(0.5, 1e-5, 0.02, -1)
    export_official(var, work / "var.pth")
    export_official(VQVAE(VQVAEConfig.official()), work / "vae.pth")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="auto", help="result file ('auto': results/var_sample_<...>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    parser.add_argument("--child-official", default="", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-allocator", default="system", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_official:
        work = Path(args.child_official)
        r = args.round
        paths = (work / "vae.pth", work / "var.pth", work / f"official_{r}.png", work / f"official_tokens_{r}.pt")
        child_official(*paths, args.child_allocator)
        return
    from _env import environment, result_path, settings, write_result

    torch.set_num_threads(args.threads)
    env = environment()
    print(f"{env['cpu_model']}; torch {env['torch']}, {args.threads} threads; load average {env['load_average_1min']}")
    runs: dict[str, list[dict[str, Any]]] = {"trainlab": [], "official": [], "official_reuse": []}
    flows = {
        "trainlab": run_trainlab,
        "official": run_official,
        "official_reuse": lambda work, threads, r: run_official(work, threads, r, "reuse"),
    }
    with tempfile.TemporaryDirectory(prefix="bench_var_sample_") as tmp:
        work = Path(tmp)
        write_weights(work)
        for r in range(args.repeats):
            order = list(flows) if r % 2 == 0 else list(flows)[::-1]
            got = {}
            for name in order:
                wall, phases, tokens = flows[name](work, args.threads, r)
                runs[name].append({"wall_s": wall, **phases})
                got[name] = tokens
                shown = "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
                print(f"round {r} {name:8s} wall {wall:6.2f} s  {shown}")
            same = all(torch.equal(a, b) for name in got for a, b in zip(got["trainlab"], got[name]))
            if not same:
                raise SystemExit("the two flows sampled different tokens: the comparison is void")
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in runs.items()}
    ratio = {k: med["official"][k] / med["trainlab"][k] for k in ("wall_s", *PHASES) if med["trainlab"][k] > 0}
    ratio_reuse = {
        k: med["official_reuse"][k] / med["trainlab"][k] for k in ("wall_s", *PHASES) if med["trainlab"][k] > 0
    }
    print("medians (s):")
    for name, m in med.items():
        print(f"  {name:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()))
    print("official / trainlab: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    print("official with trainlab's host allocator policy / trainlab: ", end="")
    print("  ".join(f"{k} {v:.2f}x" for k, v in ratio_reuse.items()))
    env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    path = result_path(args.json, "var_sample", f"cpu{args.threads}t", args.label)
    result = {"environment": env, "config": settings(args), "runs": runs, "medians": med, "ratio": ratio}
    write_result(path, {**result, "ratio_vs_official_reuse": ratio_reuse})


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
