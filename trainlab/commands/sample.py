"""`trainlab sample`: class-conditional images (and tokens) from official VAR checkpoints.

    trainlab sample --tokenizer-weights vae_ch160v4096z32.pth --var-weights var_d16.pth --classes 1 500 999 \\
        --seed 42 --guidance 3.0 --top-k 600 --top-p 0.9 [--more-smooth] --out grid.png [--save-tokens tokens.pt]
    trainlab sample --tokenizer-weights ... --var-weights ... --classes all --samples-per-class 50 \\
        --out-dir samples/                                                    # 50k images for FID

Images are generated in --classes order (each class --samples-per-class times in a row), --batch-size at a time; batch i
uses seed + i (a single batch uses --seed itself, exactly like the official `autoregressive_infer_cfg(g_seed=seed)`).
Results depend on --seed, --batch-size and the device: a CUDA run draws from a CUDA generator, so it reproduces the
official code on CUDA, not a CPU run. Pixels are round(255 * img) with img in [0, 1].
--var-weights may be a trainlab VAR run's checkpoint (RUN_DIR/ckpt/last.pt): it records the SHA-256 of the tokenizer it
was trained with, and --tokenizer-weights with other weights are refused (its codes would mean something else:
garbage images).
--out-dir writes NNNNNN_cCCCC.png per image and, once all exist, samples.npz (uint8 (N, H, W, 3) under `arr_0` and
the int64 class labels under `arr_1`, the layout of OpenAI's guided-diffusion evaluator); it is resumable: batches
whose PNGs all exist and read back whole are skipped (unless --out or --save-tokens also need them); a truncated or
otherwise unreadable PNG is logged and its batch sampled again; a PNG of another size than these weights make is
refused before sampling (it comes from other weights: use another --out-dir), and so are other settings than those
recorded in the folder's sampling.json, and PNGs of labels this sampling does not make.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainlab.config import option, parse
from trainlab.engine.device import DEVICE_HELP, resolve_device
from trainlab.engine.host_allocator import host_allocator
from trainlab.errors import UsageError, check_output_path, first_line

if TYPE_CHECKING:  # imported where used: parsing the flags (and refusing bad ones) loads neither
    import numpy as np
    import torch

# Shape legend: B images in a batch, N images in total, H/W image side, pn token-map side.

log = logging.getLogger(__name__)

MAX_GUIDANCE = 1000.0
"""The largest guidance scale sampling accepts: far past any useful value (papers use 1-10), and far below the
scale where (1 + t) x cond - t x uncond overflows float32 logits (1e38 did)."""
TOKENIZER_MODEL, VAR_MODEL = "vqvae", "var"  # the tokenizer and var recipes' model names in a run's checkpoint


@dataclasses.dataclass(kw_only=True)
class SampleConfig:
    """Sample class-conditional images from a VAR + VQVAE checkpoint pair (official or trained here)."""

    tokenizer_weights: Path = option(
        help="tokenizer (VQVAE) weights: vae_ch160v4096z32.pth, or a trainlab tokenizer export or checkpoint",
        metavar="PATH",
        deprecated=("--vae-weights", "--vae"),
    )
    var_weights: Path = option(
        help="VAR weights: var_d16.pth (.pth/.pt/.safetensors), or a trainlab VAR export or checkpoint",
        metavar="PATH",
        deprecated=("--var",),
    )
    classes: list[str] = option(help="class ids (1000 = unconditional) or 'all'", metavar="ID")
    samples_per_class: int = option(1, "images per listed class", metavar="N", ge=1, deprecated=("--n-per-class",))
    seed: int = option(0, "generator seed; batch i uses seed + i", ge=0, lt=2**63)
    guidance: float = option(
        1.5, "classifier-free guidance scale", metavar="SCALE", ge=0, le=MAX_GUIDANCE, deprecated=("--cfg",)
    )
    top_k: int = option(900, "keep the K most likely tokens, 0 = all", metavar="K", ge=0)
    top_p: float = option(0.96, "nucleus mass, 1 = off", metavar="P", gt=0, le=1)
    more_smooth: bool = option(False, "Gumbel-softmax code mixing (nicer, not for FID)")
    fast_decode: bool = option(
        True,
        "NHWC convolutions, SDPA attention and sub-pixel upsampling in the VQVAE decoder (~1.3-1.5x on CPU); the "
        "image equals the official decode to ~5e-5, a rare 1/255 step in a PNG pixel; false: official arithmetic",
    )
    out: Path | None = option(None, "write all images as one grid", metavar="PNG")
    out_dir: Path | None = option(None, "one PNG per image + samples.npz (resumable)", metavar="DIR")
    save_tokens: Path | None = option(None, "torch.save a list of int64 (N, pn, pn), one per scale", metavar="PT")
    batch_size: int = option(16, "images per sampling batch", metavar="B", ge=1)
    device: str = option("auto", DEVICE_HELP)

    def validate(self) -> None:
        if self.out is None and self.out_dir is None and self.save_tokens is None:
            raise UsageError("nothing to write: pass --out grid.png, --out-dir DIR and/or --save-tokens tokens.pt")
        if self.out is not None and self.out.suffix.lower() != ".png":
            raise UsageError(f"--out must be a .png file, got {self.out}")
        for flag, path, is_dir in (
            ("--out", self.out, False),
            ("--out-dir", self.out_dir, True),
            ("--save-tokens", self.save_tokens, False),
        ):
            if path is not None:
                _check_writable(flag, path, is_dir=is_dir)
        if self.device != "auto":  # a device this machine lacks is refused before any weights are read
            resolve_device(self.device)


_check_writable = check_output_path  # the one output-location check (trainlab.errors), also used by `trainlab edit`


def load_var_pair(vae_path: Path, var_path: Path) -> tuple[Any, Any]:
    """The VQVAE and VAR of --tokenizer-weights / --var-weights (see `trainlab.models.var.convert.load_official`); a
    trainlab run's checkpoint is read as its model's weights (the averaged copy when the run kept one)."""
    from trainlab.engine.checkpoint import weights_in_checkpoint
    from trainlab.models.var.convert import load_official

    return load_official(
        vae_path,
        var_path,
        unwrap_vae=weights_in_checkpoint(TOKENIZER_MODEL),
        unwrap_var=weights_in_checkpoint(VAR_MODEL),
    )


def _trained_tokenizer_sha256(var_path: Path) -> str | None:
    """The tokenizer SHA-256 a trainlab VAR run checkpoint records (`recipe_state.tokenizer_sha256`), else None
    (official weights and exports record none)."""
    from trainlab.engine.checkpoint import is_trainlab_checkpoint, recipe_state
    from trainlab.user_files import load_user_file

    if var_path.suffix not in (".pt", ".pth"):
        return None
    obj = load_user_file(var_path, "VAR checkpoint", fix="pass a complete weights file")  # memory-mapped: cheap
    if not is_trainlab_checkpoint(obj):
        return None
    sha = recipe_state(obj).get("tokenizer_sha256")
    return sha if isinstance(sha, str) and sha else None


def check_tokenizer_matches(var_path: Path, vae_path: Path, vqvae: torch.nn.Module) -> None:
    """Refuse --tokenizer-weights that differ from the tokenizer a trainlab VAR checkpoint was trained with.

    Raises:
        UsageError: the checkpoint records a tokenizer SHA-256 and `vqvae`'s differs; the message names both.
    """
    from trainlab.data.token_cache import tokenizer_sha256

    expected = _trained_tokenizer_sha256(var_path)
    if expected is None:
        return
    found = tokenizer_sha256(vqvae)
    if found != expected:
        raise UsageError(
            f"--var-weights {var_path} was trained with tokenizer sha256 {expected[:12]}..., but "
            f"--tokenizer-weights {vae_path} has sha256 {found[:12]}...; pass the tokenizer that run used (its "
            "--tokenizer-weights, see the run's config.yaml)"
        )


def _parse_classes(values: list[str], num_classes: int) -> list[int]:
    """The class ids of --classes (each once; --samples-per-class repeats them later)."""
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
    return classes


def _check_room(config: SampleConfig, total: int, side: int, seq_len: int) -> None:
    """Refuse, before sampling, outputs that cannot fit: samples.npz larger than the free space of --out-dir (it is
    written uncompressed, N x side x side x 3 bytes), or --save-tokens larger than the memory available to hold them
    (N x L int64, twice while concatenated). Warn when the PNGs (at most the same size again) may not fit."""
    import psutil

    gib = 2**30
    if config.out_dir is not None:
        npz = total * side * side * 3
        existing = config.out_dir if config.out_dir.exists() else config.out_dir.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if npz > free:
            raise UsageError(
                f"--out-dir {config.out_dir}: {total} images of {side}x{side} make a {npz / gib:.1f} GiB samples.npz "
                f"but only {free / gib:.1f} GiB are free there; free space, or sample fewer (--classes, "
                "--samples-per-class)"
            )
        if 2 * npz > free:
            log.warning("%s: %.1f GiB free for up to %.1f GiB of PNGs and samples.npz", config.out_dir, free / gib,
                        2 * npz / gib)  # fmt: skip
    if config.save_tokens is not None:
        needed, available = 2 * total * seq_len * 8, psutil.virtual_memory().available
        if needed > available:
            raise UsageError(
                f"--save-tokens holds {total} images' tokens in memory ({needed / gib:.1f} GiB) but only "
                f"{available / gib:.1f} GiB are available; sample fewer (--classes, --samples-per-class)"
            )


def _to_uint8(img_B3HW: torch.Tensor) -> np.ndarray:
    """[0, 1] float images -> uint8 (B, H, W, 3), rounded."""
    import torch

    return img_B3HW.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def _save_png(arr_HW3: np.ndarray, path: Path) -> None:
    from PIL import Image

    tmp = path.with_name(path.name + ".tmp")
    Image.fromarray(arr_HW3).save(tmp, format="PNG")
    os.replace(tmp, path)


def png_problem(path: Path) -> tuple[str | None, tuple[int, int] | None]:
    """(why an existing PNG cannot be read back whole or None, its (width, height) or None when unreadable).

    PIL's `verify` walks every chunk and its CRC without decoding the pixels: a truncated, zero-byte or corrupted file
    fails it at a fraction of a decode's cost (this runs over every PNG of a resumed --out-dir).
    """
    from PIL import Image

    try:
        with Image.open(path) as img:
            size = img.size
            img.verify()
    except (OSError, SyntaxError, ValueError) as err:  # PIL's errors for truncated / corrupt files
        return first_line(err), None
    return None, size


def _read_png(path: Path) -> np.ndarray:
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (OSError, SyntaxError, ValueError) as err:
        raise UsageError(
            f"{path} is unreadable ({first_line(err)}); delete it and run the same command again: its batch is "
            "sampled again"
        ) from None


def write_npz(png_paths: list[Path], out_path: Path, labels: list[int] | None = None) -> None:
    """Stream PNGs into an .npz holding uint8 (N, H, W, 3) as `arr_0`, one image in memory at a time, and the class
    labels as int64 (N,) under `arr_1` when given (the layout of OpenAI's labelled reference batches)."""
    import numpy as np

    first = _read_png(png_paths[0])
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
            arr = _read_png(path)
            if arr.shape != first.shape:
                raise UsageError(f"{path} has shape {arr.shape}, expected {first.shape}: clear --out-dir and rerun")
            f.write(np.ascontiguousarray(arr).tobytes())
    if labels is not None:
        with (
            zipfile.ZipFile(tmp, "a", compression=zipfile.ZIP_STORED, allowZip64=True) as zf,
            zf.open("arr_1.npy", "w") as f,
        ):
            np.lib.format.write_array(f, np.asarray(labels, dtype=np.int64))
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


def main(argv: list[str]) -> int:
    """Run `trainlab sample`; returns the exit code (errors raise UsageError)."""
    timer = PhaseTimer()
    config = parse(SampleConfig, argv, prog="trainlab sample", epilog=__doc__ or "")
    device = resolve_device(config.device)

    import torch
    from tqdm import tqdm

    from trainlab.engine.checkpoint import atomic_save
    from trainlab.models.var.sample import generate

    timer.lap("startup")
    vqvae, var = load_var_pair(config.tokenizer_weights, config.var_weights)
    check_tokenizer_matches(config.var_weights, config.tokenizer_weights, vqvae)
    if config.fast_decode:
        vqvae.optimize_for_inference()
    log.info(host_allocator())
    log.info("decoder: %s", "fast (NHWC, SDPA, sub-pixel upsample)" if config.fast_decode else "official arithmetic")
    classes = _parse_classes(config.classes, var.num_classes)
    total = len(classes) * config.samples_per_class  # counted before anything of that size is built
    if config.out is not None and total > 1024:
        raise UsageError(f"--out makes one grid; {total} images is too many: use --out-dir")
    _check_room(config, total, vqvae.cfg.image_size, sum(pn * pn for pn in var.patch_nums))
    labels = [c for c in classes for _ in range(config.samples_per_class)]
    vqvae, var = vqvae.to(device), var.to(device)
    timer.lap("load")
    names = [f"{i:06d}_c{c:04d}.png" for i, c in enumerate(labels)]
    out_dir = config.out_dir
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _claim_out_dir(out_dir, _sampling_settings(config, labels, device.type), names)
    may_skip = out_dir is not None and config.out is None and config.save_tokens is None
    damaged = _damaged_pngs(out_dir, names, vqvae.cfg.image_size) if may_skip and out_dir is not None else set()
    grid_parts: list[torch.Tensor] = []
    token_parts: list[list[torch.Tensor]] = []
    starts = range(0, len(labels), config.batch_size)
    bar = tqdm(total=len(labels), unit="img", disable=not sys.stderr.isatty(), desc="sampling")
    skipped = 0
    for batch_idx, start in enumerate(starts):
        chunk = labels[start : start + config.batch_size]
        batch_names = names[start : start + len(chunk)]
        if may_skip and out_dir is not None and all((out_dir / n).is_file() and n not in damaged for n in batch_names):
            skipped += len(chunk)
            bar.update(len(chunk))
            continue
        samples = generate(
            var,
            vqvae,
            chunk,
            seed=config.seed + batch_idx,
            cfg=config.guidance,
            top_k=config.top_k,
            top_p=config.top_p,
            more_smooth=config.more_smooth,
        )
        timer.lap("tokens", sync=device)
        with torch.inference_mode():
            img_B3HW = vqvae.fhat_to_img(samples.f_hat).add_(1.0).mul_(0.5).float().cpu()
        timer.lap("decode")
        if out_dir is not None:
            for j, arr in enumerate(_to_uint8(img_B3HW)):
                _save_png(arr, out_dir / names[start + j])
        if config.out is not None:
            grid_parts.append(img_B3HW)
        if config.save_tokens is not None:
            token_parts.append([t.view(len(chunk), pn, pn).cpu() for t, pn in zip(samples.tokens, var.patch_nums)])
        bar.update(len(chunk))
        timer.lap("write")
    bar.close()

    if config.out is not None:
        _save_grid(torch.cat(grid_parts), config.out, config.samples_per_class)
        print(f"wrote {config.out} ({len(labels)} images)")
    if config.save_tokens is not None:
        tokens = [torch.cat(per_scale) for per_scale in zip(*token_parts)]
        config.save_tokens.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(tokens, config.save_tokens, fix="free disk space or pass another --save-tokens")
        print(f"wrote {config.save_tokens} ({len(tokens)} scales of int64 (N, pn, pn), N={len(labels)})")
    if out_dir is not None:
        npz = out_dir / "samples.npz"
        write_npz([out_dir / n for n in names], npz, labels)
        print(f"wrote {len(labels)} PNGs to {out_dir} ({skipped} already there) and {npz}")
    timer.lap("write")
    log.info("time per phase: %s", timer.summary())
    generated = len(labels) - skipped
    if generated:
        busy = timer.seconds.get("tokens", 0.0) + timer.seconds.get("decode", 0.0)
        log.info("%d images sampled and decoded: %.2f images/s", generated, generated / max(busy, 1e-9))
    return 0


SETTINGS_FILE = "sampling.json"  # in --out-dir: what its PNGs were sampled with


def _sampling_settings(config: SampleConfig, labels: list[int], device_type: str) -> dict[str, Any]:
    """Everything an --out-dir's images depend on: the weights files (path, size, modification time), the sampling
    arguments, the batch size (batch i uses seed + i), the device type (its generator) and the label list."""

    def identity(path: Path) -> list[Any]:
        info = path.stat()
        return [str(path.resolve()), info.st_size, info.st_mtime_ns]

    fields = ("seed", "guidance", "top_k", "top_p", "more_smooth", "fast_decode", "batch_size")
    return {
        "var_weights": identity(config.var_weights),
        "tokenizer_weights": identity(config.tokenizer_weights),
        **{name: getattr(config, name) for name in fields},
        "device": device_type,
        "labels": hashlib.sha256(json.dumps(labels).encode()).hexdigest()[:16],
        "images": len(labels),
    }


def _claim_out_dir(out_dir: Path, settings: dict[str, Any], names: list[str]) -> None:
    """Resume an --out-dir only with the settings its images were sampled with (`sampling.json`): other weights, seed,
    guidance or classes would mix two sets under one name (kept PNGs of the old, stale ones beyond the new list).
    A folder of PNGs without the file (written by an earlier trainlab) is taken as it is."""
    path = out_dir / SETTINGS_FILE
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        recorded = None  # damaged: written again below
    if isinstance(recorded, dict) and recorded != settings:
        key = next(k for k in settings if recorded.get(k) != settings[k])
        raise UsageError(
            f"--out-dir {out_dir} holds images sampled with other settings ({key}: {recorded.get(key)!r}, now "
            f"{settings[key]!r}); pass another --out-dir, or delete its PNGs and {SETTINGS_FILE} to start over"
        )
    stale = sorted(set(p.name for p in out_dir.glob("[0-9]*_c*.png")) - set(names))
    if stale:
        raise UsageError(
            f"--out-dir {out_dir} holds {len(stale)} PNG(s) this sampling does not make (first: {stale[0]}): another "
            "class list; pass another --out-dir, or delete them"
        )
    tmp = path.with_name(f".{SETTINGS_FILE}.tmp")
    tmp.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _damaged_pngs(out_dir: Path, names: list[str], side: int) -> set[str]:
    """The names of existing PNGs in a resumed --out-dir that do not read back whole (logged: their batches are
    sampled again).

    Raises:
        UsageError: a PNG of another size than `side`, i.e. from other weights (before any sampling).
    """
    damaged: set[str] = set()
    for name in names:
        path = out_dir / name
        if not path.is_file():
            continue
        problem, size = png_problem(path)
        if problem is not None:
            log.warning("%s is unreadable (%s): its batch is sampled again", path, problem)
            damaged.add(name)
        elif size is not None and size != (side, side):
            raise UsageError(
                f"{path} is {size[0]}x{size[1]} pixels but these weights make {side}x{side} images: it was sampled "
                "with other weights; use another --out-dir (or clear this one)"
            )
    return damaged


class PhaseTimer:
    """Wall seconds per named phase (laps add up when a phase recurs, e.g. per batch). The first lap, `startup`,
    runs from the process start (interpreter, imports, argument parsing)."""

    def __init__(self) -> None:
        import psutil

        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()
        self._startup = time.time() - psutil.Process().create_time()  # before this object existed

    def lap(self, phase: str, sync: torch.device | None = None) -> None:
        """Charge the time since the previous lap to `phase` (after waiting for `sync`'s queued CUDA work)."""
        if sync is not None and sync.type == "cuda":
            import torch

            torch.cuda.synchronize(sync)
        now = time.perf_counter()
        extra = self._startup if phase == "startup" else 0.0
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last + extra
        self._last = now

    def summary(self) -> str:
        """`startup 1.20 s, load 0.35 s, ..., total 9.10 s`."""
        parts = [f"{name} {sec:.2f} s" for name, sec in self.seconds.items()]
        return ", ".join([*parts, f"total {sum(self.seconds.values()):.2f} s"])
