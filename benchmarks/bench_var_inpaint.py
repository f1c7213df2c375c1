"""Zero-shot in-painting on the demo's digits, judged: erase the bottom half, regenerate it with VAR, ask the judge.

    .venv/bin/python -m trainlab demo                       # once: trains runs/demo (~5-8 min on 2 CPU cores)
    .venv/bin/python benchmarks/bench_var_inpaint.py        # 500 held-out digits, seeds 0 1 2, ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_var_inpaint.py --run-dir runs/demo --num-images 500 --seeds 0 1 2 --json ''

What is measured on `--num-images` held-out digits (the same number of every class, the first ones of the held-out
split, which neither the tokenizer, VAR nor the judge trained on), with the bottom 8 of 16 pixel rows as the mask:
    original          the judge's accuracy on the digits themselves (its ceiling here)
    reconstruction    ... on the tokenizer's reconstruction (what keeping every token gives)
    masked            ... on the digits with the bottom half erased to black (no in-painting)
    inpaint class     in-painted with the true class as condition (`edit_images`, cfg `--cfg`)
    inpaint uncond    in-painted with the null class (the VAR paper's zero-shot setting)
For the in-painted rows: accuracy (judged class == true class) and "preserved" (judged class == the judge's class
for the original digit), mean and min/max over `--seeds` (one `edit_images` call per seed on all images).
Seam: the largest and the mean |in-painted - reconstruction| (pixels in [0, 1]) in the kept top half, by distance
(rows) from the mask; kept tokens are the image's, but the regenerated coarse tokens (the 1x1 scale covers the whole
image) still change the kept region through the tokenizer's upsampling.

Writes a JSON (results/var_inpaint_digits_<label>_<date>.json unless `--json` says otherwise) and, with `--figures`
(default docs/var_edit), inpaint_digits.png (one digit per class: original / masked / in-painted) and
seam_bleed.png.
"""

# Legend: N images, 3/H/W channels and side, S seeds, D distances from the mask.

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result
from matplotlib.figure import Figure
from torchvision.utils import make_grid

from trainlab.data.digits import NUM_CLASSES, load_digits_dataset
from trainlab.evaluate.judge_accuracy import predict
from trainlab.models.digit_judge import load_judge
from trainlab.models.var.convert import load_official
from trainlab.models.var.edit import edit_images, encode_tokens, kept_token_maps

SIDE = 16


def _balanced(labels_N: torch.Tensor, num_images: int) -> torch.Tensor:
    """The first num_images / 10 positions of every class, class-major."""
    per_class = num_images // NUM_CLASSES
    return torch.cat([torch.nonzero(labels_N == k).flatten()[:per_class] for k in range(NUM_CLASSES)])


def _seam(inpainted_N3HW: torch.Tensor, recon_N3HW: torch.Tensor, mask_rows: int) -> dict[str, list[float]]:
    """Max and mean |in-painted - reconstruction| ([0, 1] pixels) per kept row, by distance 1..D from the mask."""
    diff_NH = (inpainted_N3HW - recon_N3HW).abs().amax(dim=1).amax(dim=-1)  # worst channel and column per row
    diff_all_NH = (inpainted_N3HW - recon_N3HW).abs().mean(dim=(1, 3))
    kept = SIDE - mask_rows
    rows = list(range(kept - 1, -1, -1))  # distance 1 = the row just above the mask
    return {
        "distance_px": [kept - r for r in rows],
        "max_abs": [float(diff_NH[:, r].max()) for r in rows],
        "mean_abs": [float(diff_all_NH[:, r].mean()) for r in rows],
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _figures(
    out_dir: Path,
    images_N3HW: torch.Tensor,
    masked_N3HW: torch.Tensor,
    cond_N3HW: torch.Tensor,
    uncond_N3HW: torch.Tensor,
    labels_N: torch.Tensor,
    seams: dict[str, dict[str, list[float]]],
) -> list[Path]:
    """inpaint_digits.png (two digits per class) and seam_bleed.png under `out_dir`."""
    pick = torch.cat([torch.nonzero(labels_N == k).flatten()[:2] for k in range(NUM_CLASSES)])
    rows = [
        ("original", images_N3HW[pick]),
        ("bottom half erased", masked_N3HW[pick]),
        ("in-painted, true class", cond_N3HW[pick]),
        ("in-painted, unconditional", uncond_N3HW[pick]),
    ]
    fig = Figure(figsize=(10, 4.6))
    for i, (title, row_N3HW) in enumerate(rows):
        ax = fig.add_subplot(len(rows), 1, i + 1)
        grid = make_grid(row_N3HW.clamp(-1, 1).add(1).mul(0.5), nrow=len(pick), padding=2, pad_value=1.0)
        ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(title, fontsize=9, loc="left")
        ax.axis("off")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "inpaint_digits.png", out_dir / "seam_bleed.png"]
    fig.savefig(paths[0], dpi=120)
    fig = Figure(figsize=(5.5, 3.4))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, seam) in enumerate(seams.items()):
        ax.plot(seam["distance_px"], seam["max_abs"], marker="o", color=f"C{i}", label=f"{name}: max")
        ax.plot(seam["distance_px"], seam["mean_abs"], marker=".", linestyle="--", color=f"C{i}", label=f"{name}: mean")
    ax.set_xlabel("distance from the mask (pixel rows, 16 px digits)")
    ax.set_ylabel("|in-painted - reconstruction| (0..1)")
    ax.set_title("How far the edit reaches into the kept half", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--run-dir", default="runs/demo", help="a finished `trainlab demo` run directory")
    parser.add_argument("--num-images", type=int, default=500, help="held-out digits (a multiple of 10)")
    parser.add_argument("--mask-rows", type=int, default=8, help="bottom pixel rows erased and regenerated")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one in-painting pass per seed")
    parser.add_argument("--guidance", type=float, default=1.5, help="guidance scale (the demo's sampling default)")
    parser.add_argument("--top-k", type=int, default=900, help="top-k (900 > V = 256: no filtering, as the demo)")
    parser.add_argument("--top-p", type=float, default=0.96, help="nucleus mass (the sampler's default)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/var_inpaint_digits_<...>.json)")
    parser.add_argument("--figures", default="docs/var_edit", help="folder for the figures ('': none)")
    parser.add_argument("--label", default="", help="what distinguishes this run, in the auto name")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    env = environment()
    run_dir = Path(args.run_dir)
    vqvae, var = load_official(run_dir / "tokenizer/ckpt/last.pt", run_dir / "var/ckpt/last.pt")
    judge = load_judge(run_dir / "judge.safetensors")
    heldout = load_digits_dataset(resolution=SIDE, split="heldout")
    index_N = _balanced(heldout.labels_N, args.num_images)
    images_N3HW, labels_N = heldout.images_N3HW[index_N], heldout.labels_N[index_N]
    N = len(labels_N)
    mask_N1HW = torch.zeros(N, 1, SIDE, SIDE, dtype=torch.bool)
    mask_N1HW[:, :, SIDE - args.mask_rows :] = True
    masked_N3HW = images_N3HW.masked_fill(mask_N1HW, -1.0)  # erased to the digits' black background
    with torch.inference_mode():
        recon_N3HW = vqvae.idx_to_img(encode_tokens(vqvae, images_N3HW))

    original_pred_N = predict(judge, images_N3HW)
    table: dict[str, Any] = {
        "original": {"accuracy": float((original_pred_N == labels_N).float().mean())},
        "reconstruction": {"accuracy": float((predict(judge, recon_N3HW) == labels_N).float().mean())},
        "masked": {"accuracy": float((predict(judge, masked_N3HW) == labels_N).float().mean())},
    }
    conditions = {"inpaint_class": labels_N.tolist(), "inpaint_uncond": [var.num_classes] * N}
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in conditions}
    first: dict[str, torch.Tensor] = {}
    seconds = 0.0
    for seed in args.seeds:
        for name, labels in conditions.items():
            start = time.perf_counter()
            result = edit_images(
                var, vqvae, images_N3HW, mask_N1HW, labels, seed=seed, cfg=args.cfg, top_k=args.top_k, top_p=args.top_p
            )
            seconds += time.perf_counter() - start
            inpainted_N3HW = result.images.mul(2).sub(1)
            first.setdefault(name, inpainted_N3HW)
            pred_N = predict(judge, inpainted_N3HW)
            per_seed[name].append(
                {
                    "seed": seed,
                    "accuracy": float((pred_N == labels_N).float().mean()),
                    "preserved": float((pred_N == original_pred_N).float().mean()),
                }
            )
    for name, runs in per_seed.items():
        table[name] = {
            "accuracy": _summary([r["accuracy"] for r in runs]),
            "preserved": _summary([r["preserved"] for r in runs]),
            "per_seed": runs,
        }
    recon01_N3HW = recon_N3HW.add(1).mul(0.5)
    seams = {name: _seam(first[name].add(1).mul(0.5), recon01_N3HW, args.mask_rows) for name in conditions}

    print(f"{N} held-out digits, bottom {args.mask_rows} of {SIDE} rows masked, seeds {args.seeds}, cfg {args.cfg}")
    print(f"{'images judged':<28} {'accuracy':>22} {'class preserved':>22}")
    for name in ("original", "reconstruction", "masked"):
        print(f"{name:<28} {table[name]['accuracy']:>22.3f} {'':>22}")
    for name in conditions:
        acc, kept = table[name]["accuracy"], table[name]["preserved"]
        print(
            f"{name:<28} {acc['mean']:>10.3f} [{acc['min']:.3f}-{acc['max']:.3f}]"
            f" {kept['mean']:>10.3f} [{kept['min']:.3f}-{kept['max']:.3f}]"
        )
    for name, seam in seams.items():
        pairs = ", ".join(
            f"{d}: {m:.3f}/{a:.3f}" for d, m, a in zip(seam["distance_px"], seam["max_abs"], seam["mean_abs"])
        )
        print(f"seam {name} (distance px: max/mean |in-painted - recon|): {pairs}")
    print(f"in-painting took {seconds:.1f} s for {len(args.seeds) * len(conditions) * N} images")

    figures = []
    if args.figures:
        figures = _figures(
            Path(args.figures),
            images_N3HW,
            masked_N3HW,
            first["inpaint_class"],
            first["inpaint_uncond"],
            labels_N,
            seams,
        )
        print("wrote " + ", ".join(str(p) for p in figures))
    result_json = {
        "settings": settings(args),
        "num_images": N,
        "table": table,
        "seam": seams,
        "inpaint_seconds": seconds,
        "kept_tokens_per_scale": [int(k[0].sum()) for k in kept_token_maps(mask_N1HW[:1], var.patch_nums)],
        "environment": env,
    }
    write_result(result_path(args.json, "var_inpaint_digits", args.label), result_json)


if __name__ == "__main__":
    main()
