"""VAR: class-conditional next-scale prediction, trained by teacher forcing on the token maps of a FROZEN tokenizer.

`trainlab train var --config var_d16 --data.root /path/imagenet --tokenizer-weights vae_ch160v4096z32.pth`

What one step does (official `trainer.py: train_step`):
    tokens  = tokenizer.img_to_idx(image)               (or read from the token cache); float32, autocast off
    x       = tokenizer.quantize.idx_to_var_input(tokens)  accumulated f_hat of scales < k on scale k's grid
    logits  = var(label, x)                             class dropout 10 % (training mode), (B, L, V) float32
    loss    = sum_l CE(logits_l, token_l) / L, mean over the batch   (= mean token cross-entropy)

Settings and where they come from (reference/var.md section 3):
    peak lr         = optim.base_learning_rate x batch_size / 256, `OptimConfig.peak_lr` (the one linear-scaling
                      rule; official tblr; batch_size is the global batch per optimizer step, accumulation included)
    optimizer       AdamW, betas (0.9, 0.95), weight decay 0.05, fused (CUDA and CPU); no decay for 1-D parameters,
                      biases and names containing one of `NO_WEIGHT_DECAY_KEYWORDS` (official `filter_params`)
    clipping        total grad norm 2.0 after unscaling (engine)
    schedule        `var-lin0`: warm-up from 0.005 x peak over warmup_fraction of the steps (official wp = ep/50
                      epochs -> 1/50 = 0.02 whatever the epoch count), flat for 5 %, then linear to final_ratio
                      x peak (official wpe); weight decay cosine from 0.05 to weight_decay_end (official twde)
    label smoothing 0.0 (official default; no README run sets it)

Metrics (every logged step; fractions, not the official percentages):
    loss                                  the training objective (label-smoothed when label_smoothing > 0)
    cross_entropy_mean / _last_scale      official Lm / Lt: unsmoothed token CE, all tokens / last scale
    token_accuracy_mean / _last_scale     official Accm / Acct
    cross_entropy_scale_{k}, token_accuracy_scale_{k}   per scale k, on logged steps (official: tensorboard)
Evaluation reports the same with a `val_` prefix, class dropout OFF. Deviation: the official `eval_ep` keeps the
10 % class dropout in evaluation (its VAR applies dropout in eval mode too), so its val loss is slightly higher.

Tokenizer: loaded from `--tokenizer-weights` (official `vae_ch160v4096z32.pth`, a trainlab-exported VQVAE state_dict as
.pth/.safetensors, a trainlab checkpoint holding a VQVAE, or an official `ar-ckpt-*.pth`), frozen (eval,
requires_grad False): one of the engine's frozen models, in no phase, not DDP-wrapped, not in `ckpt/last.pt`
(which stays VAR-only and small); instead the checkpoint records the SHA-256 of its weights and a resume with
different tokenizer weights is refused. trainlab never downloads weights: get them from
https://huggingface.co/FoundationVision/var (`vae_ch160v4096z32.pth`, `var_d16.pth`, ...) and pass the paths.

Progressive training (official `--pg`, off by default, used for the 512 px d30 run): with progressive_until = X
in (0, 1) the model is trained on the first s+1 scales only, s growing from progressive_start_scale (official pg0)
at the end of warm-up linearly (rounded) to the last scale at X x total steps. Within a stage, the newest scale's
loss weight ramps linearly from 0.01 to 1 over progressive_warmup_epochs (official pgwp, default epochs/300) of
steps, except in the first stage (weight 1). Loss weights stay 1/L of the full sequence (not renormalised), as
in the official code. The schedule is a pure function of the optimizer step, so resumes are exact. Deviation: the
official counts iterations in micro-batches; here steps are optimizer steps (the same with no accumulation).

Precision: fp16-amp-scale uses the engine's `torch.amp.GradScaler` with torch defaults (initial scale 2^16,
growth every 2000 steps, no cap); the official AmpOptimizer starts at 2^11, grows every 1000 steps and caps the
scale at 32768. The first few steps therefore may be skipped as overflows (logged) while the scale settles.

Export: after the last epoch, the run dir gets `var_export.pth` (official state_dict format, loads into the
official code and `trainlab sample`) and `var_export.safetensors`; `export_run(run_dir)` does it from a checkpoint.
"""

# Shape legend: B batch, L tokens of all scales, l tokens of one scale, V vocabulary, Cv code width, K scales,
# 3/H/W image channels and side.

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab.config import from_dict, option
from trainlab.data.config import DataConfig, eval_limit_option, fake_size_option, kind_option, root_option
from trainlab.data.loader_workers import ignore_stop_signals
from trainlab.data.sources import ImageSplit, open_split
from trainlab.data.token_cache import (
    VARIANT_MIRRORED,
    VARIANT_PLAIN,
    TokenCacheDataset,
    TokenCacheSpec,
    encode_batch,
    ensure_token_cache,
    tokenizer_sha256,
)
from trainlab.data.transforms import VarResizeCrop
from trainlab.engine.checkpoint import weights_in_checkpoint
from trainlab.engine.ema import WeightAverage
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.losses.token_cross_entropy import TokenMetricTotals, token_cross_entropy, token_metrics
from trainlab.models.names import FORMER_VQVAE_NAMES, ModelFamily, VQVAEName
from trainlab.models.var.convert import export_var, load_official_into_, load_tokenizer
from trainlab.models.var.scales import scale_slices, sequence_length
from trainlab.models.var.transformer import PATCH_NUMS_256, VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE
from trainlab.optim.config import OptimConfig
from trainlab.optim.param_groups import param_groups
from trainlab.recipes.var_progressive import ProgressiveSchedule
from trainlab.user_files import weights_needed

log = logging.getLogger(__name__)

VarKind = Literal["image-folder", "digits", "fake"]
TokenizerModel = Literal["auto", VQVAEName]  # inferred from the weights, or a registered VQVAE
EMA_MODEL = "var_ema"  # the averaged copy of "var" (--model-ema-decay)
TOKENIZER_MODEL = "vqvae"  # the tokenizer recipe's name for its VQVAE in a run's checkpoint (--tokenizer-weights)


@dataclasses.dataclass(kw_only=True)
class VarData(DataConfig):
    """VAR's images: an ImageNet-layout folder (the official runs: root/train, root/val), the bundled digits (the demo)
    or fake images; `open_split` applies `var_resize_crop` at --image-size."""

    kind: VarKind = kind_option("image-folder", VarKind, deprecated=("--dataset",))
    root: Path = root_option(Path("data/imagenet"), VarKind, deprecated=("--data-root",))
    eval_limit: int = eval_limit_option(0, "validation images", deprecated=("--eval-max-images",))
    fake_size: int = fake_size_option(deprecated=("--fake-num-images",))


@dataclasses.dataclass(kw_only=True)
class VARTrainConfig(TrainConfig):
    """Train a class-conditional VAR transformer on token maps of a frozen multi-scale VQVAE tokenizer.

    Defaults are the official README's VAR-d16 run (depth 16, batch 768, 200 epochs, base lr 1e-4, alng 1e-3,
    wpe 0.1); configs/var_d{16,20,24,30}.yaml hold all four README rows with their sources.
    """

    run_dir: Path = option(
        Path("runs/var"), "the run's folder: config, metrics, checkpoints; launched again, it resumes", metavar="DIR"
    )
    # ---------------------------------------------------------------------------------------------- model
    depth: int = option(16, "transformer blocks; width 64 x depth and depth heads unless overridden (official)", ge=1)
    embed_dim: int = option(-1, "width C (-1: 64 x depth)", ge=1, sentinels=(-1,))
    num_heads: int = option(-1, "attention heads (-1: depth)", ge=1, sentinels=(-1,))
    shared_adaln: bool = option(False, "one AdaLN projection shared by all blocks (official saln; the 512 px d36)")
    drop_path_rate: float = option(
        -1.0, "stochastic depth of the last block (-1: 0.1 x depth / 24, official)", ge=0, le=1, sentinels=(-1,)
    )
    num_classes: int = option(1000, "class count of the model (the class embedding has one more row: 'no class')", ge=1)
    image_size: int = option(256, "image side R; must equal patch_nums[-1] x the tokenizer's downsample factor", ge=1)
    patch_nums: tuple[int, ...] = option(
        PATCH_NUMS_256, "token-map sides, coarse to fine (512 px: 1 2 3 4 6 9 13 18 24 32)", ge=1
    )
    vocab_size: int = option(4096, "tokenizer codebook size V (checked against the tokenizer)", ge=1)
    cond_drop_rate: float = option(0.1, "class-dropout probability in training (classifier-free guidance)", ge=0, le=1)
    init_adaln: float = option(0.5, "AdaLN scale/shift init factor (official aln)", ge=0)
    init_adaln_gamma: float = option(
        1e-3, "AdaLN gamma init factor (official alng; README 1e-3 d16/d20, 1e-4 d24, 1e-5 d30)", ge=0
    )
    init_head: float = option(0.02, "head weight init factor (official hd)", ge=0)
    init_std: float = option(
        -1.0, "std of Linear/Embedding weights (-1: sqrt(1 / (3C)), official ini)", gt=0, sentinels=(-1,)
    )
    init_from: str = option(
        "", "fine-tune from official var_d*.pth weights (strict load; '' = from scratch)", metavar="PATH"
    )
    # ------------------------------------------------------------------------------------------ tokenizer
    tokenizer_weights: str = option(
        "",
        "frozen tokenizer (VQVAE) weights: vae_ch160v4096z32.pth, or a trainlab tokenizer export or checkpoint",
        metavar="PATH",
        deprecated=("--tokenizer",),
    )
    tokenizer_model: TokenizerModel = option(
        "auto",
        "tokenizer architecture: auto (from the weights) or a registered VQVAE (vqvae_official = ch160 v4096 z32)",
        deprecated=("--tokenizer-config",),
        deprecated_values=FORMER_VQVAE_NAMES,
    )
    # ----------------------------------------------------------------------------------------------- data
    data: VarData = option(VarData(), "which images (the official runs: an ImageNet-layout folder)")
    horizontal_flip: bool = option(False, "random horizontal flips in training (official hflip, off in README runs)")
    use_token_cache: bool = option(False, "encode every image once (center crop) and train from the stored tokens")
    token_cache_path: str = option("", "token cache directory ('' = run_dir/token_cache; a stale one is rebuilt)")
    token_cache_rebuild: bool = option(False, "rebuild a stale cache at --token-cache-path instead of refusing it")
    token_cache_batch_size: int = option(64, "images per tokenizer forward when building the token cache", ge=1)
    eval_batch_size: int = option(64, "batch size of the validation pass (rank 0)", ge=1)
    # -------------------------------------------------------------------------------------- optimisation
    epochs: int = option(200, "number of epochs (official ep)", ge=1)
    batch_size: int = option(
        768, "global batch per optimizer step, all GPUs and accumulation steps (official bs)", gt=0
    )
    optim: OptimConfig = option(
        OptimConfig(name="adamw", base_learning_rate=1e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True),
        "official: AdamW, base lr per 256 images (tblr; peak = base x batch_size / 256), betas (0.9, 0.95), "
        "weight decay of the decayed group (twd), fused kernel (afuse)",
    )
    clip_grad_norm: float = option(
        2.0, "clip the total gradient norm to this after unscaling (official tclip; 0: no clip)", ge=0
    )
    label_smoothing: float = option(
        0.0, "label smoothing of the training loss (official ls; logged CE is unsmoothed)", ge=0, lt=1
    )
    schedule: ScheduleConfig = option(
        ScheduleConfig(
            kind="var-lin0", warmup_fraction=0.02, warmup_start_ratio=0.005, final_ratio=0.1, weight_decay_end=-1.0
        ),
        "official lr_wd_annealing: warmup_fraction = wp / ep (default ep/50 -> 0.02), final_ratio = wpe, "
        "weight_decay_end = twde (-1: constant)",
    )
    progressive_until: float = option(
        0.0, "progressive training (official pg): 0 off; X in (0,1) all scales by X x steps", ge=0, lt=1
    )
    progressive_start_scale: int = option(
        4, "progressive training: last scale index of the first stage (official pg0)", ge=0
    )
    progressive_warmup_epochs: float = option(
        -1.0, "newest-scale loss ramp per stage, epochs (-1: epochs/300, pgwp)", ge=0, sentinels=(-1,)
    )
    export: bool = option(True, "write var_export.pth and var_export.safetensors after the last epoch")
    model_ema_decay: float = option(
        0.0,
        "keep an EMA of VAR's weights, this decay per optimizer step (0: off, as in the official code; e.g. 0.9999); "
        "when on, evaluation, best.pt's metric, the export and `trainlab sample` from this run's checkpoints use the "
        "averaged weights",
        ge=0,
        lt=1,
    )

    def validate(self) -> None:
        super().validate()
        if self.precision in ("fp16", "bf16", "fp16-scale"):
            raise UsageError(
                f"precision {self.precision!r} casts VAR's weights to 16 bits; use fp16-amp-scale (official), bf16-amp "
                "or fp32"
            )
        if self.progressive_until > 0 and not self.progressive_start_scale < len(self.patch_nums) - 1:
            raise UsageError(
                f"--progressive-start-scale must be in [0, {len(self.patch_nums) - 2}] for {len(self.patch_nums)} "
                f"scales, got {self.progressive_start_scale}"
            )
        var_model_config(self, vae_embed_dim=1)  # widths, heads and scales the transformer can be built with


# ------------------------------------------------------------------------------------------------- building


def var_model_config(cfg: VARTrainConfig, vae_embed_dim: int) -> VARConfig:
    """The `VARConfig` a training config describes (the code width comes from the tokenizer)."""
    return VARConfig.from_depth(
        cfg.depth,
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        drop_path_rate=cfg.drop_path_rate,
        shared_adaln=cfg.shared_adaln,
        cond_drop_rate=cfg.cond_drop_rate,
        num_classes=cfg.num_classes,
        patch_nums=tuple(cfg.patch_nums),
        vocab_size=cfg.vocab_size,
        vae_embed_dim=vae_embed_dim,
    )


def _check_tokenizer(cfg: VARTrainConfig, tokenizer: VQVAE) -> None:
    vq = tokenizer.cfg
    if vq.vocab_size != cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {vq.vocab_size} codes but --vocab-size is {cfg.vocab_size}; pass --vocab-size "
            f"{vq.vocab_size}"
        )
    side = cfg.patch_nums[-1] * vq.downsample
    if side != cfg.image_size:
        raise UsageError(
            f"--image-size {cfg.image_size} does not match patch_nums[-1]={cfg.patch_nums[-1]} x the tokenizer's "
            f"downsample {vq.downsample} = {side}; set --image-size {side} or change --patch-nums"
        )


# --------------------------------------------------------------------------------------------------- recipe


class VARRecipe(Recipe[VARTrainConfig]):
    name = "var"
    config_class = VARTrainConfig
    best_metric = "val_cross_entropy_last_scale"  # the official "best" checkpoint tracks the val tail loss
    best_mode = "min"
    resume_may_change = (
        "data.root",
        "tokenizer_weights",  # a moved file: the checkpoint keeps the weights' SHA-256 and refuses others
        "eval_batch_size",
        "data.eval_limit",
        "token_cache_path",
        "token_cache_rebuild",
        "token_cache_batch_size",
        "export",
    )

    def __init__(self, config: VARTrainConfig) -> None:
        super().__init__(config)
        self.tokenizer_hash = ""
        self.train_images: Dataset[dict[str, torch.Tensor]] | None = None
        self.val_set: Dataset[dict[str, torch.Tensor]] | None = None
        self.slices = scale_slices(config.patch_nums)
        self.seq_len = sequence_length(config.patch_nums)
        self._progressive: tuple[int, ProgressiveSchedule] | None = None  # (total steps it was built for, schedule)
        self._evaluated = EMA_MODEL if config.model_ema_decay else "var"  # what evaluation and export use

    # --------------------------------------------------------------------------------------------- data
    def _cached(
        self, split: ImageSplit, name: Literal["train", "val"], tokenizer: VQVAE, device: torch.device, train: bool
    ) -> Dataset[dict[str, torch.Tensor]]:
        c = self.config
        variants = (VARIANT_PLAIN, VARIANT_MIRRORED) if (train and c.horizontal_flip) else (VARIANT_PLAIN,)
        spec = TokenCacheSpec(
            self.tokenizer_hash, tuple(c.patch_nums), self.seq_len, c.vocab_size, split.description, variants
        )
        base = Path(c.token_cache_path) if c.token_cache_path else c.run_dir / "token_cache"
        on_stale: Literal["rebuild", "refuse"] = (
            "rebuild" if (not c.token_cache_path or c.token_cache_rebuild) else "refuse"
        )
        cache = ensure_token_cache(
            base / name,
            spec,
            lambda: self._variants("train" if name == "train" else "eval", variants),
            tokenizer,
            on_stale=on_stale,
            device=device,
            batch_size=c.token_cache_batch_size,
            num_workers=c.num_workers,
            num_classes=split.num_classes,
        )
        return TokenCacheDataset(cache, seed=c.seed, random_variant=train)

    def _variants(self, split: Literal["train", "eval"], variants: tuple[str, ...]) -> list[Dataset[Batch]]:
        """The fixed preprocessings a token cache stores: centre crop, plain or mirrored."""
        c, out = self.config, []
        for variant in variants:
            flip: Literal["always", "none"] = "always" if variant == VARIANT_MIRRORED else "none"
            crop = VarResizeCrop(c.image_size, flip=flip)
            images = open_split(c.data, split, crop, seed=c.seed, fake_classes=self._fake_classes)
            assert images is not None  # the split was opened before
            out.append(images.images)
        return out

    @property
    def _fake_classes(self) -> int:
        return min(self.config.num_classes, 10)

    # -------------------------------------------------------------------------------------------- build
    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        tokenizer = load_tokenizer(
            c.tokenizer_weights,
            c.tokenizer_model,
            c.patch_nums,
            seed=c.seed,
            unwrap=weights_in_checkpoint(TOKENIZER_MODEL),
        )
        _check_tokenizer(c, tokenizer)
        # the planner builds for shapes only: no weight value to hash (and hashing fake tensors costs ~1 s a build)
        self.tokenizer_hash = tokenizer_sha256(tokenizer) if weights_needed() else ""
        # NHWC convolutions and SDPA in the encoder's attention: the same tokens, ~1.3x faster encoding on CPU
        tokenizer.optimize_for_inference()
        var = VAR(var_model_config(c, tokenizer.cfg.z_channels))
        var.init_weights(c.init_adaln, c.init_adaln_gamma, c.init_head, c.init_std)
        if c.init_from:
            load_official_into_(var, Path(c.init_from), unwrap=weights_in_checkpoint(self.name))
        var = var.to(device)
        groups = param_groups(var, c.optim.weight_decay, c.optim.peak_lr(c.batch_size))
        optimizer = c.optim.build(groups, batch_size=c.batch_size, device=device)
        log.info(
            "VAR d%d: %.2f M parameters; %s; %d decayed / %d not decayed tensors; %s%s",
            c.depth,
            var.num_parameters() / 1e6,
            c.optim.describe_lr(c.batch_size),
            len(groups[0]["params"]),
            len(groups[1]["params"]),
            c.optim.name,
            " (fused)" if optimizer.defaults.get("fused") else "",
        )
        averaged = {EMA_MODEL: WeightAverage(follows="var", decay=c.model_ema_decay)} if c.model_ema_decay else {}
        return TrainParts(
            models={"var": var},
            phases=[Phase("main", optimizer, ["var"])],
            frozen={"tokenizer": tokenizer},
            averaged=averaged,
            shard_units={"var": var.shard_units()},
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        tokenizer = parts.frozen["tokenizer"]
        assert isinstance(tokenizer, VQVAE)
        crop = VarResizeCrop(c.image_size, crop="random", flip="random" if c.horizontal_flip else "none")
        train = open_split(c.data, "train", crop, seed=c.seed, fake_classes=self._fake_classes)
        val = open_split(c.data, "eval", VarResizeCrop(c.image_size), seed=c.seed, fake_classes=self._fake_classes)
        assert train is not None
        if train.num_classes > c.num_classes:
            raise UsageError(
                f"the dataset has {train.num_classes} classes but the model has --num-classes {c.num_classes}; "
                f"pass --num-classes {train.num_classes} (or more)"
            )
        self.train_images = train.images
        train_set = self._cached(train, "train", tokenizer, device, True) if c.use_token_cache else train.images
        if val is not None:
            self.val_set = self._cached(val, "val", tokenizer, device, False) if c.use_token_cache else val.images
            log.info("evaluation: class dropout OFF (official eval keeps cond_drop_rate %.2f)", c.cond_drop_rate)
        return train_set

    def example_batch(self, batch_size: int) -> Batch:
        c = self.config
        label_B = torch.zeros(batch_size, dtype=torch.long)
        if c.use_token_cache:
            return {"tokens": torch.zeros(batch_size, self.seq_len, dtype=torch.long), "label": label_B}
        return {"image": torch.zeros(batch_size, 3, c.image_size, c.image_size), "label": label_B}

    def progressive(self, info: StepInfo) -> ProgressiveSchedule | None:
        """The progressive-training schedule of this run (None when off), from the engine's step arithmetic."""
        c = self.config
        if c.progressive_until <= 0:
            return None
        if self._progressive is None or self._progressive[0] != info.total_steps:
            stage_epochs = c.progressive_warmup_epochs if c.progressive_warmup_epochs >= 0 else c.epochs / 300
            schedule = ProgressiveSchedule(
                num_scales=len(c.patch_nums),
                start_scale=c.progressive_start_scale,
                warmup_steps=round(c.schedule.warmup_fraction * info.total_steps),
                end_step=c.progressive_until * info.total_steps,
                stage_warmup_steps=stage_epochs * info.steps_per_epoch,
            )
            self._progressive = (info.total_steps, schedule)
        return self._progressive[1]

    # --------------------------------------------------------------------------------------------- step
    @staticmethod
    def tokens(tokenizer: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Tokens (B, L) int64 from the cache, or by encoding the images with the frozen tokenizer (fp32)."""
        if "tokens" in batch:
            return batch["tokens"].long()
        assert isinstance(tokenizer, VQVAE)
        return encode_batch(tokenizer, batch["image"])

    def teacher_forcing_input(self, tokenizer: nn.Module, tokens_BL: torch.Tensor) -> torch.Tensor:
        """x (B, L - first_l, Cv): the accumulated f_hat of scales < k on scale k's grid, float32."""
        assert isinstance(tokenizer, VQVAE)
        idx_list = list(torch.split(tokens_BL, [s.stop - s.start for s in self.slices], dim=1))
        with torch.no_grad(), torch.autocast(tokens_BL.device.type, enabled=False):
            return tokenizer.quantize.idx_to_var_input(idx_list)

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        c = self.config
        tokens_BL = self.tokens(models["tokenizer"], batch)
        label_B = batch["label"]
        x_BLCv = self.teacher_forcing_input(models["tokenizer"], tokens_BL)
        first_l = c.patch_nums[0] ** 2
        weight_L = torch.full((self.seq_len,), 1.0 / self.seq_len, device=tokens_BL.device)
        end, stage_scale = self.seq_len, len(c.patch_nums) - 1
        metrics: dict[str, Any] = {}
        progressive = self.progressive(info)
        if progressive is not None:
            stage_scale = progressive.scale(info.step)
            end = self.slices[stage_scale].stop
            # official: once all scales train, prog_si = -1 and the plain 1/L weights apply (no ramp)
            prog_weight = progressive.weight(info.step) if stage_scale < len(c.patch_nums) - 1 else 1.0
            weight_L = weight_L[:end].clone()
            weight_L[self.slices[stage_scale]] *= prog_weight
            metrics.update(progressive_scale=float(stage_scale), progressive_weight=prog_weight)
        logits_BLV = models["var"](label_B, x_BLCv[:, : end - first_l])
        target_BL = tokens_BL[:, :end]
        out = token_cross_entropy(logits_BLV, target_BL, weight_L, c.label_smoothing)
        per_scale = info.log_now
        slices = self.slices[: stage_scale + 1]
        all_scales = len(slices) == len(self.slices)
        metrics.update(
            token_metrics(out.ce_BL, out.prediction_BL, target_BL, slices, all_scales=all_scales, per_scale=per_scale)
        )
        skipped = getattr(self.train_images, "skipped_images", None)
        if per_scale and skipped is not None:
            metrics["unreadable_images_skipped"] = float(skipped)
        return {"loss": out.loss, **metrics}

    # ----------------------------------------------------------------------------------------- evaluate
    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.val_set is not None:
            metrics = self._validate(models[self._evaluated], models["tokenizer"], device)
        skipped = getattr(self.train_images, "skipped_images", None)
        if skipped:
            metrics["train_unreadable_images_skipped"] = float(skipped)
        return metrics

    def on_fit_end(self, models: Mapping[str, nn.Module]) -> None:
        var = models[self._evaluated]
        if self.config.export:
            assert isinstance(var, VAR)
            export_var(var, self.config.run_dir)

    def _validate(self, var: nn.Module, tokenizer: nn.Module, device: torch.device) -> dict[str, float]:
        c = self.config
        assert self.val_set is not None
        loader = DataLoader(  # an own generator: evaluation leaves the global RNG (class dropout) alone
            self.val_set,
            batch_size=c.eval_batch_size,
            shuffle=False,
            num_workers=c.num_workers,
            worker_init_fn=ignore_stop_signals,
            generator=torch.Generator().manual_seed(0),
        )
        totals = TokenMetricTotals(self.slices, device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            tokens_BL = self.tokens(tokenizer, batch)
            logits_BLV = var(batch["label"], self.teacher_forcing_input(tokenizer, tokens_BL), cond_drop_rate=0.0)
            totals.add(logits_BLV, tokens_BL)
        return totals.metrics(prefix="val_")

    # --------------------------------------------------------------------------------------- resume/debug
    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer_sha256": self.tokenizer_hash}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("tokenizer_sha256", "")
        if saved and self.tokenizer_hash and saved != self.tokenizer_hash:
            raise UsageError(
                f"the checkpoint was trained with other tokenizer weights (sha256 {saved[:12]}..., this run "
                f"{self.tokenizer_hash[:12]}...); pass the same --tokenizer-weights to resume"
            )

    def model_family(self) -> ModelFamily:
        return "transformer"

    def hand_formula_depth(self) -> int | None:
        return self.config.depth

    def debug_config(self) -> VARTrainConfig:
        c = self.config
        return dataclasses.replace(
            c,
            depth=2,
            embed_dim=64,
            num_heads=2,
            drop_path_rate=0.0,
            patch_nums=(1, 2, 3, 4),
            image_size=16,
            vocab_size=64,
            num_classes=10,
            tokenizer_weights="",
            tokenizer_model="vqvae_debug",
            init_from="",
            data=dataclasses.replace(c.data, kind="fake", fake_size=32, train_limit=0, eval_limit=0),
            batch_size=8 * c.grad_accumulation,
            # peak lr 1e-3 at batch 8, so that the weights visibly move in a few steps
            optim=dataclasses.replace(c.optim, learning_rate=-1.0, base_learning_rate=0.03),
            epochs=3,  # 4 steps per epoch: the debug check resumes mid-epoch (step 6)
            eval_batch_size=32,
            num_workers=0,
            progressive_start_scale=min(c.progressive_start_scale, 1),
            token_cache_path="",
        )


# -------------------------------------------------------------------------------------------------- export


def export_run(run_dir: str | Path, checkpoint: str = "last") -> tuple[Path, Path]:
    """Export the VAR weights of a finished or interrupted run (its `ckpt/<checkpoint>.pt`), no command needed.

    Args:
        run_dir: the run directory of a `trainlab train var` run.
        checkpoint: "last" or "best".

    Returns:
        (`run_dir/var_export.pth`, `run_dir/var_export.safetensors`).
    """
    from trainlab.engine.checkpoint import load_checkpoint, stored_config
    from trainlab.engine.run_dir import RunDir

    run_dir = Path(run_dir)
    path = RunDir(run_dir).ckpt / f"{checkpoint}.pt"
    state = load_checkpoint(path, whole=False)  # the weights are read by weights_in_checkpoint
    if state.get("recipe") != VARRecipe.name:
        raise UsageError(f"{run_dir} is a {state.get('recipe')!r} run, not a VAR run")
    cfg = from_dict(VARTrainConfig, stored_config(state, VARTrainConfig, where=f"checkpoint {path}") or {})
    weights = weights_in_checkpoint(VARRecipe.name)(state, path)
    var = VAR(var_model_config(cfg, int(weights["word_embed.weight"].shape[1])))
    var.load_state_dict(weights)
    return export_var(var, run_dir)
