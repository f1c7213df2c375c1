"""The demo's figures: a class x sample grid with the judge's verdicts, reconstructions beside originals, and the
training curves of both stages (read from their `metrics.jsonl`).

Images are in [-1, 1] and shown in grey levels as the model produced them (no per-image normalisation).

Shapes: N images, 3/H/W channels and side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torchvision.utils import make_grid

from trainlab.engine.run_dir import RunDir
from trainlab.report.plots import DPI
from trainlab.report.runs import latest_rows

_PAD = 2


def _grid_image(images_N3HW: torch.Tensor, columns: int) -> np.ndarray:
    """(rows * (H + pad), columns * (W + pad), 3) float array in [0, 1] with a white padding between images."""
    grid_3HW = make_grid(images_N3HW.float().clamp(-1, 1).add(1).mul(0.5), nrow=columns, padding=_PAD, pad_value=1.0)
    return grid_3HW.permute(1, 2, 0).numpy()


def _pick(labels_N: torch.Tensor, per_class: int, num_classes: int) -> torch.Tensor:
    """Indices of the first `per_class` images of each class, class-major."""
    return torch.cat([torch.nonzero(labels_N == k).flatten()[:per_class] for k in range(num_classes)])


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def sample_grid(
    path: Path, samples_N3HW: torch.Tensor, labels_N: torch.Tensor, predicted_N: torch.Tensor, per_class: int = 10
) -> Path:
    """Row k: the first `per_class` samples conditioned on class k; a red frame where the judge disagrees."""
    num_classes = int(labels_N.max()) + 1
    index = _pick(labels_N, per_class, num_classes)
    columns = len(index) // num_classes
    side = samples_N3HW.shape[-1]
    fig = Figure(figsize=(1.0 + 0.55 * columns, 0.55 * num_classes + 0.8))
    ax = fig.add_subplot()
    ax.imshow(_grid_image(samples_N3HW[index], columns), interpolation="nearest")
    wrong = 0
    for j, i in enumerate(index.tolist()):
        if predicted_N[i] != labels_N[i]:
            wrong += 1
            row, col = divmod(j, columns)
            corner = (_PAD + col * (side + _PAD) - 1, _PAD + row * (side + _PAD) - 1)
            ax.add_patch(Rectangle(corner, side + 1, side + 1, fill=False, edgecolor="red", linewidth=1.5))
    centres = [_PAD + k * (side + _PAD) + side / 2 for k in range(num_classes)]
    ax.set_yticks(centres, [str(k) for k in range(num_classes)])
    ax.set_xticks([])
    ax.set_ylabel("conditioned class")
    ax.set_title(f"VAR samples ({wrong} of {len(index)} shown judged another class: red)", fontsize=9)
    return _save(fig, path)


def reconstruction_grid(
    path: Path, real_N3HW: torch.Tensor, recon_N3HW: torch.Tensor, labels_N: torch.Tensor, pairs_per_class: int = 2
) -> Path:
    """Alternating rows: held-out originals, then the tokenizer's reconstructions of exactly those images."""
    num_classes = int(labels_N.max()) + 1
    rows = []
    for p in range(pairs_per_class):
        index = torch.stack([torch.nonzero(labels_N == k).flatten()[p] for k in range(num_classes)])
        rows += [real_N3HW[index], recon_N3HW[index]]
    fig = Figure(figsize=(0.55 * num_classes + 1.2, 0.55 * len(rows) + 0.8))
    ax = fig.add_subplot()
    ax.imshow(_grid_image(torch.cat(rows), num_classes), interpolation="nearest")
    side = real_N3HW.shape[-1]
    names = ["original", "reconstructed"] * pairs_per_class
    ax.set_yticks([_PAD + r * (side + _PAD) + side / 2 for r in range(len(rows))], names, fontsize=8)
    ax.set_xticks([])
    ax.set_title("Tokenizer: held-out digits and their reconstructions (30 tokens each)", fontsize=9)
    return _save(fig, path)


def _curve(run_dir: Path, kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key` in rows of `kind`; a resumed run's repeated steps keep the later row."""
    rows = [
        r for r in latest_rows(RunDir(run_dir).read_metrics(), kind, "step") if isinstance(r.get(key), (int, float))
    ]
    return np.array([r["step"] for r in rows], dtype=float), np.array([float(r[key]) for r in rows])


def _plot(ax: Axes, run_dir: Path, kind: str, key: str, label: str, **style: object) -> None:
    x, y = _curve(run_dir, kind, key)
    if len(x):
        ax.plot(x, y, label=label, **style)  # type: ignore[arg-type]


def _legend(*axes: Axes) -> None:
    """One legend, below the plot (never over a curve), for the lines of all the axes (an axis and its twin)."""
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    axes[0].legend(
        handles,
        [str(h.get_label()) for h in handles],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=2,
        fontsize=8,
        frameon=False,
    )


def training_curves(path: Path, tokenizer_run: Path, var_run: Path) -> Path:
    """Left: the tokenizer's pixel and VQ losses (and held-out PSNR); right: VAR's token cross-entropy and accuracy."""
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax_tok, ax_var = fig.subplots(1, 2)
    _plot(ax_tok, tokenizer_run, "train", "generator/pixel_loss", "L1 pixel loss (train)", color="C0")
    _plot(ax_tok, tokenizer_run, "train", "generator/vq_loss", "VQ commitment loss (train)", color="C1")
    ax_tok.set(xlabel="optimizer step", ylabel="loss", title="Tokenizer")
    psnr_x, psnr_y = _curve(tokenizer_run, "eval", "psnr")
    twins_tok: list[Axes] = []
    if len(psnr_x):
        ax_psnr = ax_tok.twinx()
        ax_psnr.plot(psnr_x, psnr_y, "o--", color="C2", label="held-out PSNR (dB, right axis)")
        ax_psnr.set_ylabel("PSNR (dB)")
        twins_tok.append(ax_psnr)
    _legend(ax_tok, *twins_tok)

    _plot(ax_var, var_run, "train", "cross_entropy_mean", "token cross-entropy (train)", color="C0")
    _plot(ax_var, var_run, "eval", "val_cross_entropy_mean", "token cross-entropy (held-out)", marker="o", color="C3")
    ax_var.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title="VAR")
    acc_x, acc_y = _curve(var_run, "train", "token_accuracy_mean")
    twins_var: list[Axes] = []
    if len(acc_x):
        ax_acc = ax_var.twinx()
        ax_acc.plot(acc_x, 100 * acc_y, color="C2", alpha=0.7, label="token accuracy (train, %, right axis)")
        ax_acc.set_ylabel("token accuracy (%)")
        twins_var.append(ax_acc)
    _legend(ax_var, *twins_var)
    for ax in (ax_tok, ax_var):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def write_all(
    run_dir: Path,
    *,
    samples_N3HW: torch.Tensor,
    labels_N: torch.Tensor,
    predicted_N: torch.Tensor,
    real_N3HW: torch.Tensor,
    real_labels_N: torch.Tensor,
    recon_N3HW: torch.Tensor,
    tokenizer_run: Path,
    var_run: Path,
) -> dict[str, Path]:
    """All demo figures; returns {name: path}."""
    return {
        "samples": sample_grid(run_dir / "samples_grid.png", samples_N3HW, labels_N, predicted_N),
        "reconstructions": reconstruction_grid(run_dir / "reconstructions.png", real_N3HW, recon_N3HW, real_labels_N),
        "training_curves": training_curves(run_dir / "training_curves.png", tokenizer_run, var_run),
    }
