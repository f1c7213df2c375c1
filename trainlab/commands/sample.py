"""`trainlab sample`: class-conditional images (and tokens) from official VAR checkpoints.

    trainlab sample --vae vae_ch160v4096z32.pth --var var_d16.pth --classes 1 500 999 --seed 42 \\
        --cfg 3.0 --top-k 600 --top-p 0.9 [--more-smooth] --out grid.png [--save-tokens tokens.pt]
    trainlab sample --vae ... --var ... --classes all --n-per-class 50 --out-dir samples/   # 50k images for FID

Images are generated in --classes order (each class --n-per-class times in a row), --batch-size at a time; batch i
uses seed + i (a single batch uses --seed itself, exactly like the official `autoregressive_infer_cfg(g_seed=seed)`).
Results depend on --seed, --batch-size and the device: a CUDA run draws from a CUDA generator, so it reproduces the
official code on CUDA, not a CPU run. Pixels are round(255 * img) with img in [0, 1].
--out-dir writes NNNNNN_cCCCC.png per image and, once all exist, samples.npz (uint8 (N, H, W, 3) under `arr_0`, the
layout of OpenAI's guided-diffusion evaluator); it is resumable: batches whose PNGs all exist are skipped
(unless --out or --save-tokens also need them).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import zipfile
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from PIL import Image

from trainlab.errors import UsageError

# Shape legend: B images in a batch, N images in total, H/W image side, pn token-map side.

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"trainlab sample: {message} (see trainlab sample --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trainlab sample",
        description="Sample class-conditional images from a VAR + VQVAE checkpoint pair (official or trained here).",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--vae", required=True, metavar="PATH", help="VQVAE weights, e.g. vae_ch160v4096z32.pth")
    p.add_argument("--var", required=True, metavar="PATH", help="VAR weights, e.g. var_d16.pth (.pth/.pt/.safetensors)")
    p.add_argument(
        "--classes", nargs="+", required=True, metavar="ID", help="class ids (1000 = unconditional) or 'all'"
    )
    p.add_argument("--n-per-class", type=int, default=1, metavar="N", help="images per listed class (1)")
    p.add_argument("--seed", type=int, default=0, help="generator seed; batch i uses seed + i (0)")
    p.add_argument("--cfg", type=float, default=1.5, help="classifier-free guidance scale >= 0 (1.5)")
    p.add_argument("--top-k", type=int, default=900, metavar="K", help="keep the K most likely tokens, 0 = all (900)")
    p.add_argument("--top-p", type=float, default=0.96, metavar="P", help="nucleus mass in (0, 1], 1 = off (0.96)")
    p.add_argument("--more-smooth", action="store_true", help="Gumbel-softmax code mixing (nicer, not for FID)")
    p.add_argument("--out", type=Path, metavar="PNG", help="write all images as one grid")
    p.add_argument("--out-dir", type=Path, metavar="DIR", help="one PNG per image + samples.npz (resumable)")
    p.add_argument(
        "--save-tokens", type=Path, metavar="PT", help="torch.save a list of int64 (N, pn, pn), one per scale"
    )
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="images per sampling batch (16)")
    p.add_argument("--device", default="", help="torch device (default: cuda if available, else cpu)")
    return p


def _parse_classes(values: list[str], num_classes: int, n_per_class: int) -> list[int]:
    if values == ["all"]:
        classes = list(range(num_classes))
    else:
        try:
            classes = [int(v) for v in values]
        except ValueError as err:
            raise UsageError(f"--classes takes integers or the single word 'all', got {' '.join(values)}") from err
    bad = [c for c in classes if not 0 <= c <= num_classes]
    if bad:
        raise UsageError(f"class id {bad[0]} is out of range: use 0..{num_classes - 1} ({num_classes} = unconditional)")
    return [c for c in classes for _ in range(n_per_class)]


def _to_uint8(img_B3HW: torch.Tensor) -> np.ndarray:
    """[0, 1] float images -> uint8 (B, H, W, 3), rounded."""
    return img_B3HW.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def _save_png(arr_HW3: np.ndarray, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    Image.fromarray(arr_HW3).save(tmp, format="PNG")
    os.replace(tmp, path)


def write_npz(png_paths: list[Path], out_path: Path) -> None:
    """Stream PNGs into an .npz holding uint8 (N, H, W, 3) as `arr_0`, one image in memory at a time."""
    first = np.asarray(Image.open(png_paths[0]).convert("RGB"))
    header: dict[str, Any] = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
        "fortran_order": False,
        "shape": (len(png_paths), *first.shape),
    }
    tmp = out_path.with_name(out_path.name + ".tmp")
    with (
        zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf,
        zf.open("arr_0.npy", "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_2_0(f, header)
        for path in png_paths:
            arr = np.asarray(Image.open(path).convert("RGB"), dtype=np.uint8)
            if arr.shape != first.shape:
                raise UsageError(f"{path} has shape {arr.shape}, expected {first.shape}: clear --out-dir and rerun")
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, out_path)


def _save_grid(images_N3HW: torch.Tensor, path: Path, n_per_class: int) -> None:
    """Tile images row-major (n_per_class per row when 2..16, else 8 per row) with a 2-pixel white border."""
    N, _, H, W = images_N3HW.shape
    ncol = n_per_class if 1 < n_per_class <= 16 else min(8, N)
    nrow, pad = -(-N // ncol), 2
    grid_3HW = images_N3HW.new_ones(3, pad + nrow * (H + pad), pad + ncol * (W + pad))
    for i in range(N):
        top, left = pad + (i // ncol) * (H + pad), pad + (i % ncol) * (W + pad)
        grid_3HW[:, top : top + H, left : left + W] = images_N3HW[i]
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_png(_to_uint8(grid_3HW.unsqueeze(0))[0], path)


def main(argv: list[str] | None = None) -> int:
    """Run `trainlab sample`; returns the exit code (errors raise UsageError)."""
    args = build_parser().parse_args(argv)
    if args.out is None and args.out_dir is None and args.save_tokens is None:
        raise UsageError("nothing to write: pass --out grid.png, --out-dir DIR and/or --save-tokens tokens.pt")
    if args.n_per_class < 1 or args.batch_size < 1:
        raise UsageError("--n-per-class and --batch-size must be >= 1")
    if args.out is not None and args.out.suffix.lower() != ".png":
        raise UsageError(f"--out must be a .png file, got {args.out}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        raise UsageError(f"unknown --device {args.device!r} (use cpu, cuda, cuda:1, ...)") from err

    from tqdm import tqdm

    from trainlab.models.var.loading import load_official
    from trainlab.models.var.sample import check_sampling_options, generate

    check_sampling_options(args.cfg, args.top_k, args.top_p)
    vqvae, var = load_official(args.vae, args.var)
    labels = _parse_classes(args.classes, var.num_classes, args.n_per_class)
    if args.out is not None and len(labels) > 1024:
        raise UsageError(f"--out makes one grid; {len(labels)} images is too many: use --out-dir")
    vqvae, var = vqvae.to(device), var.to(device)
    names = [f"{i:06d}_c{c:04d}.png" for i, c in enumerate(labels)]
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    may_skip = args.out_dir is not None and args.out is None and args.save_tokens is None
    grid_parts: list[torch.Tensor] = []
    token_parts: list[list[torch.Tensor]] = []
    starts = range(0, len(labels), args.batch_size)
    bar = tqdm(total=len(labels), unit="img", disable=not sys.stderr.isatty(), desc="sampling")
    skipped = 0
    for batch_idx, start in enumerate(starts):
        chunk = labels[start : start + args.batch_size]
        if may_skip and all((args.out_dir / names[start + j]).is_file() for j in range(len(chunk))):
            skipped += len(chunk)
            bar.update(len(chunk))
            continue
        samples = generate(
            var,
            vqvae,
            chunk,
            seed=args.seed + batch_idx,
            cfg=args.cfg,
            top_k=args.top_k,
            top_p=args.top_p,
            more_smooth=args.more_smooth,
        )
        with torch.inference_mode():
            img_B3HW = vqvae.fhat_to_img(samples.f_hat).add_(1.0).mul_(0.5).float().cpu()
        if args.out_dir is not None:
            for j, arr in enumerate(_to_uint8(img_B3HW)):
                _save_png(arr, args.out_dir / names[start + j])
        if args.out is not None:
            grid_parts.append(img_B3HW)
        if args.save_tokens is not None:
            token_parts.append([t.view(len(chunk), pn, pn).cpu() for t, pn in zip(samples.tokens, var.patch_nums)])
        bar.update(len(chunk))
    bar.close()

    if args.out is not None:
        _save_grid(torch.cat(grid_parts), args.out, args.n_per_class)
        print(f"wrote {args.out} ({len(labels)} images)")
    if args.save_tokens is not None:
        tokens = [torch.cat(per_scale) for per_scale in zip(*token_parts)]
        args.save_tokens.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tokens, args.save_tokens)
        print(f"wrote {args.save_tokens} ({len(tokens)} scales of int64 (N, pn, pn), N={len(labels)})")
    if args.out_dir is not None:
        npz = args.out_dir / "samples.npz"
        write_npz([args.out_dir / n for n in names], npz)
        print(f"wrote {len(labels)} PNGs to {args.out_dir} ({skipped} already there) and {npz}")
    return 0
