"""Tokenizer training: VAR's multi-scale VQVAE trained VQGAN-style (`trainlab train tokenizer`).

VAR never released its tokenizer training code (the most requested item in its issue tracker); this recipe follows
taming-transformers' VQGAN conventions on VAR's architecture and quantizer:

    generator      recon = pixel (L1 | L2) + perceptual_loss_weight * LPIPS-style VGG16 distance
                   loss  = recon + codebook_weight * vq_loss + discriminator_weight * w * g_loss
                   (w = taming's adaptive weight ||grad recon|| / ||grad g_loss|| at the decoder's last conv, or 1;
                   the GAN term is on from step `discriminator_start`)
    discriminator  hinge | vanilla loss on D(real) and D(reconstruction), from step `discriminator_start`

Alternation: every optimizer step runs the "generator" phase (modules ["vqvae"]; the engine freezes D's parameters,
so the D pass on the reconstruction only sends gradient to the images), then the "discriminator" phase (modules
["discriminator"]). The D phase recomputes the reconstruction under `no_grad` with the generator it has just updated
(encode -> quantizer `f_to_fhat_per_scale` -> decode, which does not touch the quantizer's usage buffer) instead of
caching the G phase's output: this is the seed notes' "re-compute y_ which leads better quality" and what taming does;
it costs one gradient-free encoder/decoder pass and needs no cache keyed to micro-batches. D sees real and fake images
in two separate calls (as in taming; with BatchNorm each call has its own batch statistics).

Codebook: "vq" trains the codebook by gradient (codebook + beta * commitment loss, in the quantizer); "ema" freezes the
codebook parameter and updates it by exponential moving averages of the encoder residuals assigned to each code
(`trainlab.models.var.codebook`), summed over processes so every rank keeps the same codebook. `dead_code_steps` > 0
re-initialises codes unused for that many optimizer steps from random encoder vectors of the current batch (drawn on
rank 0, broadcast). Both act once per optimizer step, after the generator's optimizer step, on the statistics of all
micro-batches of the step: `--grad-accumulation 4` is the large batch for the codebook too.

Shapes: B batch, H/W image side, V vocab size, S scales.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainlab import dist
from trainlab.config import option
from trainlab.data.config import DataConfig, eval_limit_option, fake_size_option, kind_option, root_option
from trainlab.data.sources import open_split
from trainlab.data.transforms import VarResizeCrop
from trainlab.dtypes import at_least_float32
from trainlab.engine.ema import WeightAverage
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts, unwrap_model
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.evaluate.frechet import feature_statistics, frechet_distance
from trainlab.evaluate.inception import inception_features, load_inception
from trainlab.evaluate.psnr import psnr
from trainlab.losses.gan import GanLossKind, adaptive_gan_weight, discriminator_loss, generator_loss
from trainlab.losses.perceptual import PerceptualLoss, load_perceptual_loss
from trainlab.models.discriminator import NormKind, PatchDiscriminator
from trainlab.models.names import FORMER_VQVAE_NAMES, ModelFamily, VQVAEName
from trainlab.models.var.codebook import (
    DeadCodeTracker,
    EMACodebook,
    StepAssignments,
    code_counts,
    code_usage,
    restart_codes_,
    scale_residuals,
    usage_from_counts,
)
from trainlab.models.var.vqvae import PATCH_NUMS_256, VQVAE, VQVAEConfig, vqvae_config
from trainlab.optim.config import OptimConfig

log = logging.getLogger(__name__)

TokenizerKind = Literal["image-folder", "digits", "fake"]
EMA_MODEL = "vqvae_ema"  # the averaged copy of "vqvae" (--model-ema-decay)
_ARCH_FIELDS = (
    "vocab_size",
    "z_channels",
    "ch",
    "ch_mult",
    "num_res_blocks",
    "patch_nums",
    "quant_resi",
    "share_quant_resi",
    "image_size",
)


@dataclasses.dataclass(kw_only=True)
class TokenizerData(DataConfig):
    """The tokenizer's images: an ImageNet-layout folder, the bundled digits or fake images (labels unused), through
    `var_resize_crop` at --image-size; the held-out split gives PSNR, codebook usage and rFID."""

    kind: TokenizerKind = kind_option("image-folder", TokenizerKind, deprecated=("--dataset",))
    root: Path = root_option(Path("data/imagenet"), TokenizerKind, deprecated=("--data-root",))
    eval_limit: int = eval_limit_option(
        1000, "held-out images (PSNR, codebook usage, rFID after each evaluated epoch)", deprecated=("--eval-size",)
    )
    fake_size: int = fake_size_option(deprecated=("--fake-size",))


@dataclasses.dataclass(kw_only=True)
class TokenizerOptimConfig(OptimConfig):
    """The generator's optimizer group, with the tokenizer's former `--generator-learning-rate` spelling."""

    learning_rate: float = option(
        -1.0, "peak learning rate (-1: from --optim.base-learning-rate)", gt=0, sentinels=(-1,),
        deprecated=("--learning-rate", "--generator-learning-rate"),
    )  # fmt: skip


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig(TrainConfig):
    """Train VAR's multi-scale VQVAE tokenizer VQGAN-style (pixel + perceptual + PatchGAN losses; VQ or EMA codes)."""

    run_dir: Path = option(
        Path("runs/tokenizer"),
        "the run's folder: config, metrics, checkpoints; launched again, it resumes",
        metavar="DIR",
    )
    # ---- VQVAE architecture (defaults: the official vae_ch160v4096z32, 256 px)
    model: Literal["custom", VQVAEName] = option(
        "custom",
        "custom: the architecture fields below; else a registered VQVAE (vqvae_official 256 px, vqvae_digits / "
        "vqvae_debug 16 px)",
        deprecated=("--vqvae-preset",),
        deprecated_values=FORMER_VQVAE_NAMES,
    )
    vocab_size: int = option(4096, "codebook size V", ge=1)
    z_channels: int = option(32, "latent / code channels", ge=1)
    ch: int = option(160, "base width of the encoder / decoder", ge=1)
    ch_mult: tuple[int, ...] = option((1, 1, 2, 2, 4), "width multipliers; downsample = 2 ** (len - 1)", ge=1)
    num_res_blocks: int = option(2, "ResnetBlocks per encoder level (the decoder has one more)", ge=1)
    patch_nums: tuple[int, ...] = option(PATCH_NUMS_256, "token-map sides, coarse to fine; last = latent side", ge=1)
    quant_resi: float = option(0.5, "phi mixing ratio r in phi(x) = (1-r) x + r conv(x)", ge=0, le=1)
    share_quant_resi: int = option(4, "number of phi convs (0: one per scale)", ge=0)
    image_size: int = option(256, "image side; must equal patch_nums[-1] * downsample", ge=1)
    # ---- data
    data: TokenizerData = option(TokenizerData(), "which images")
    train_crop: Literal["center", "random"] = option(
        "center", "image-folder training crop after VAR's 1.125x Lanczos resize (held-out: always center)"
    )
    eval_batch_size: int = option(64, "batch size of the held-out evaluation", ge=1)
    # ---- reconstruction and codebook
    reconstruction_loss: Literal["l1", "l2"] = option("l1", "pixel loss (taming: l1)")
    perceptual_loss_weight: float = option(1.0, "weight of the perceptual term (taming: 1.0)", ge=0)
    perceptual_weights: str = option(
        "", "local torchvision vgg16 state_dict (+ optional LPIPS lin weights); '': off", metavar="PATH"
    )
    codebook_mode: Literal["vq", "ema"] = option("vq", "vq: codebook by gradient; ema: EMA updates (decay below)")
    commitment_beta: float = option(0.25, "commitment weight beta of the VQ loss", ge=0)
    codebook_weight: float = option(1.0, "weight of the VQ loss in the generator loss (taming: 1.0)", ge=0)
    ema_decay: float = option(0.99, "ema codebook: decay of the cluster-size and embedding-sum averages", ge=0, lt=1)
    dead_code_steps: int = option(
        0, "restart codes unused for this many optimizer steps from encoder vectors (0: off)", ge=0
    )
    # ---- adversarial
    discriminator_start: int = option(20000, "optimizer step at which D training and the GAN term start", ge=0)
    discriminator_weight: float = option(0.8, "weight of the GAN term (taming ImageNet: 0.8); 0: no GAN at all", ge=0)
    adaptive_weight: bool = option(True, "scale the GAN term by taming's adaptive weight (else by 1)")
    max_adaptive_weight: float = option(1e4, "clamp of the adaptive weight (inf: no clamp)", ge=0, allow_inf=True)
    gan_loss: GanLossKind = option("hinge", "hinge or vanilla (non-saturating) GAN losses")
    discriminator_layers: int = option(3, "stride-2 conv layers of the PatchGAN discriminator (3: 70x70 patches)", ge=1)
    discriminator_channels: int = option(64, "width of the discriminator's first conv", ge=1)
    discriminator_norm: NormKind = option("batch", "discriminator normalisation: batch (taming) or group")
    # ---- optimisation
    optim: TokenizerOptimConfig = option(
        TokenizerOptimConfig(name="adam", learning_rate=2.88e-4, betas=(0.5, 0.9)),
        "the VQVAE's optimizer (taming: Adam, lr 4.5e-6 x batch, betas 0.5 0.9); the discriminator's is the same "
        "but for its learning rate",
    )
    discriminator_learning_rate: float = option(2.88e-4, "peak learning rate of the discriminator's optimizer", gt=0)
    adam_beta1: float = option(
        -1.0, "former spelling of the first --optim.betas value, until the next release (-1: unset)", ge=0, lt=1,
        sentinels=(-1,),
    )  # fmt: skip
    adam_beta2: float = option(
        -1.0, "former spelling of the second --optim.betas value, until the next release (-1: unset)", ge=0, lt=1,
        sentinels=(-1,),
    )  # fmt: skip
    batch_size: int = option(64, "global batch per optimizer step", gt=0)
    schedule: ScheduleConfig = option(ScheduleConfig(kind="constant"), "learning-rate schedule (taming: constant)")
    # ---- evaluation
    inception_weights: str = option(
        "", "local torch-fidelity Inception weights (pt_inception-2015-12-05) for rFID", metavar="PATH"
    )
    model_ema_decay: float = option(
        0.0,
        "keep an EMA of the VQVAE's weights, this decay per optimizer step (0: off; e.g. 0.999; --ema-decay is the "
        "codebook's); when on, evaluation (PSNR, codebook usage, rFID), best.pt's metric and the weights other "
        "commands read from this run's checkpoints (--tokenizer-weights of train var and sample) are the averaged "
        "ones",
        ge=0,
        lt=1,
    )

    def validate(self) -> None:
        self._adopt_former_betas()
        super().validate()
        self._resolve_preset()
        vq = self.vqvae_config()  # checks widths (UsageError)
        if self.image_size != vq.image_size:
            raise UsageError(
                f"--image-size {self.image_size} does not match the VQVAE: patch_nums[-1] {vq.patch_nums[-1]} x "
                f"downsample {vq.downsample} = {vq.image_size}; change --image-size or --patch-nums"
            )
        if PatchDiscriminator.output_side(self.image_size, self.discriminator_layers) < 1:
            raise UsageError(
                f"{self.image_size} px images are too small for a {self.discriminator_layers}-layer discriminator; "
                "lower --discriminator-layers"
            )

    def _adopt_former_betas(self) -> None:
        """`--adam-beta1 B1` / `--adam-beta2 B2` (the former spellings) into `optim.betas`, with a warning."""
        former = (self.adam_beta1, self.adam_beta2)
        if former == (-1.0, -1.0):
            return
        betas = tuple(new if new >= 0 else old for new, old in zip(former, self.optim.betas, strict=False))
        if self.optim.betas != _default_betas(type(self)) and betas != tuple(self.optim.betas):
            raise UsageError(
                f"--adam-beta1 / --adam-beta2 ask for betas {betas[0]:g} {betas[1]:g} but --optim.betas is "
                f"{' '.join(f'{b:g}' for b in self.optim.betas)}; pass only --optim.betas (the former spellings go "
                "in the next release)"
            )
        log.warning(
            "--adam-beta1 / --adam-beta2 (adam_beta1 / adam_beta2) are the former spellings of --optim.betas "
            "(accepted until the next release); use --optim.betas %g %g",
            *betas,
        )
        self.optim.betas, self.adam_beta1, self.adam_beta2 = betas, -1.0, -1.0

    def _resolve_preset(self) -> None:
        if self.model == "custom":
            return
        preset = vqvae_config(self.model)
        wanted = {name: getattr(preset, name) for name in _ARCH_FIELDS if name != "image_size"}
        wanted["image_size"] = preset.image_size
        defaults = {f.name: f.default for f in dataclasses.fields(TokenizerConfig) if f.name in _ARCH_FIELDS}
        for name, value in wanted.items():
            current = getattr(self, name)
            if current != value and current != defaults[name]:
                raise UsageError(
                    f"--model {self.model} sets {name}; drop --{name.replace('_', '-')} or use --model custom"
                )
            setattr(self, name, value)

    def vqvae_config(self) -> VQVAEConfig:
        """The VQVAE architecture these fields describe."""
        return VQVAEConfig(
            vocab_size=self.vocab_size,
            z_channels=self.z_channels,
            ch=self.ch,
            ch_mult=tuple(self.ch_mult),
            num_res_blocks=self.num_res_blocks,
            share_quant_resi=self.share_quant_resi,
            quant_resi=self.quant_resi,
            beta=self.commitment_beta,
            patch_nums=tuple(self.patch_nums),
        )


# ---------------------------------------------------------------------------------------------------- recipe
class TokenizerRecipe(Recipe[TokenizerConfig]):
    """Two phases, "generator" (the VQVAE) then "discriminator"; see the module docstring."""

    name = "tokenizer"
    config_class = TokenizerConfig
    best_metric = "psnr"
    best_mode = "max"
    resume_may_change = ("data.root", "eval_batch_size", "inception_weights")

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__(config)
        self.vqvae: VQVAE | None = None  # for the quantizer's usage counter, a Python int outside its state_dict
        self.ema: EMACodebook | None = None
        self.dead_codes: DeadCodeTracker | None = None
        self.restart_generator = torch.Generator().manual_seed(config.seed + 7919)
        self._pending: StepAssignments | None = None  # this optimizer step's micro-batches, for the codebook
        self._heldout: Dataset[Any] | None = None
        self._real_fid_stats: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------------------------------------ build
    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        frozen: dict[str, nn.Module] = {}
        perceptual = self._build_perceptual()
        if perceptual is not None:
            frozen["perceptual"] = perceptual
        inception = self._build_inception()
        if inception is not None:
            frozen["inception"] = inception
        vqvae = VQVAE(c.vqvae_config()).to(device)
        quantize = vqvae.quantize
        if c.codebook_mode == "ema":
            quantize.embedding.weight.requires_grad_(False)
            self.ema = EMACodebook(quantize.embedding.weight, decay=c.ema_decay)
        if c.dead_code_steps > 0:
            self.dead_codes = DeadCodeTracker(c.vocab_size, c.dead_code_steps, device)
        self.vqvae = vqvae
        discriminator = PatchDiscriminator(
            3, c.discriminator_channels, c.discriminator_layers, norm=c.discriminator_norm
        ).to(device)
        g_params = [p for p in vqvae.parameters() if p.requires_grad]
        opt_g = c.optim.build(g_params, batch_size=c.batch_size, device=device)
        d_optim = dataclasses.replace(c.optim, learning_rate=c.discriminator_learning_rate, base_learning_rate=-1.0)
        opt_d = d_optim.build(discriminator.parameters(), batch_size=c.batch_size, device=device)
        log.info(
            "tokenizer: VQVAE %.2f M parameters, discriminator %.2f M; codebook %s (V=%d); GAN %s from step %d",
            sum(p.numel() for p in vqvae.parameters()) / 1e6,
            sum(p.numel() for p in discriminator.parameters()) / 1e6,
            c.codebook_mode,
            c.vocab_size,
            c.gan_loss if c.discriminator_weight > 0 else "off",
            c.discriminator_start,
        )
        averaged = {EMA_MODEL: WeightAverage(follows="vqvae", decay=c.model_ema_decay)} if c.model_ema_decay else {}
        return TrainParts(
            models={"vqvae": vqvae, "discriminator": discriminator},
            phases=[Phase("generator", opt_g, ["vqvae"]), Phase("discriminator", opt_d, ["discriminator"])],
            frozen=frozen,
            averaged=averaged,
            shard_units={"vqvae": vqvae.shard_units()},
        )

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        crop = VarResizeCrop(c.image_size, crop=c.train_crop)
        train = open_split(c.data, "train", crop, seed=c.seed)
        heldout = open_split(c.data, "eval", VarResizeCrop(c.image_size), seed=c.seed)
        assert train is not None
        self._heldout = heldout.images if heldout is not None else None
        return train.images

    def example_batch(self, batch_size: int) -> Batch:
        side = self.config.image_size
        return {"image": torch.zeros(batch_size, 3, side, side), "label": torch.zeros(batch_size, dtype=torch.long)}

    def _build_perceptual(self) -> PerceptualLoss | None:
        c = self.config
        if not c.perceptual_weights:
            log.info("perceptual loss off: no --perceptual-weights given")
            return None
        loss = load_perceptual_loss(Path(c.perceptual_weights))  # a missing file is a UsageError even at weight 0
        if c.perceptual_loss_weight <= 0:
            log.info("perceptual loss off: --perceptual-loss-weight is %g", c.perceptual_loss_weight)
            return None
        return loss

    def _build_inception(self) -> nn.Module | None:
        if not self.config.inception_weights:
            log.info("rFID off: no --inception-weights given (PSNR and codebook usage are still evaluated)")
            return None
        return load_inception(Path(self.config.inception_weights))

    # ---------------------------------------------------------------------------------------------- training
    def phase_active(self, phase: str, step: int) -> bool:
        return phase != "discriminator" or self._gan_on(step)

    def _gan_on(self, step: int) -> bool:
        return self.config.discriminator_weight > 0 and step >= self.config.discriminator_start

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        img_B3HW = batch["image"]
        if phase == "generator":
            return self._generator_step(models, img_B3HW, info)
        if phase == "discriminator":
            return self._discriminator_step(models, img_B3HW)
        raise ValueError(f"unknown phase {phase!r}")

    def _generator_step(
        self, models: Mapping[str, nn.Module], img_B3HW: torch.Tensor, info: StepInfo
    ) -> dict[str, Any]:
        c = self.config
        recon_B3HW, vq_loss, idx_list, f_BChw = models["vqvae"](img_B3HW, return_features=True)
        img_f, recon_f = at_least_float32(img_B3HW), at_least_float32(recon_B3HW)
        pixel_loss = F.l1_loss(recon_f, img_f) if c.reconstruction_loss == "l1" else F.mse_loss(recon_f, img_f)
        recon_loss = pixel_loss
        out: dict[str, Any] = {}
        if "perceptual" in models:
            perceptual_loss = models["perceptual"](img_f, recon_f).mean()
            recon_loss = recon_loss + c.perceptual_loss_weight * perceptual_loss
            out["perceptual_loss"] = perceptual_loss.detach()
        loss = recon_loss + c.codebook_weight * vq_loss
        g_loss = torch.zeros((), device=img_B3HW.device)
        weight = torch.zeros((), device=img_B3HW.device)
        if self._gan_on(info.step):
            logits_fake = models["discriminator"](recon_B3HW)  # D's parameters are frozen by the engine
            g_loss = generator_loss(logits_fake, c.gan_loss)
            if c.adaptive_weight:
                vqvae = unwrap_model(models["vqvae"])
                assert isinstance(vqvae, VQVAE)
                last_layer = vqvae.decoder.conv_out.weight
                weight = adaptive_gan_weight(recon_loss, g_loss, last_layer, c.max_adaptive_weight)
            else:
                weight = torch.ones((), device=img_B3HW.device)
            loss = loss + c.discriminator_weight * weight * g_loss
        usage = code_usage(idx_list, c.vocab_size)
        self._collect_codebook_stats(models, f_BChw, idx_list, usage.counts_V, info)
        out.update(
            loss=loss,
            pixel_loss=pixel_loss.detach(),
            recon_loss=recon_loss.detach(),
            vq_loss=vq_loss.detach(),
            g_loss=g_loss.detach(),
            adaptive_weight=weight,
            codebook_used_pct=usage.used_frac * 100,
            codebook_perplexity=usage.perplexity,
            dead_codes=usage.dead_codes,
        )
        return out

    def _collect_codebook_stats(
        self,
        models: Mapping[str, nn.Module],
        f_BChw: torch.Tensor,
        idx_list: Sequence[torch.Tensor],
        counts_V: torch.Tensor,
        info: StepInfo,
    ) -> None:
        """Add one micro-batch's code assignments to the step's statistics (used once, after the optimizer step)."""
        if self.ema is None and self.dead_codes is None:
            return
        vqvae = unwrap_model(models["vqvae"])
        assert isinstance(vqvae, VQVAE)
        if info.micro_step == 0 or self._pending is None:
            self._pending = StepAssignments()
        self._pending.add(scale_residuals(vqvae.quantize, f_BChw), idx_list, counts_V, with_sums=self.ema is not None)

    def after_optimizer_step(self, models: Mapping[str, nn.Module], phase: str, info: StepInfo) -> dict[str, float]:
        if phase != "generator" or self._pending is None:
            return {}
        pending, self._pending = self._pending, None
        restarted = self._maintain_codebook(models, pending, info.step)
        return {"codes_restarted": float(restarted)} if self.dead_codes is not None else {}

    def _maintain_codebook(self, models: Mapping[str, nn.Module], stats: StepAssignments, step: int) -> int:
        """EMA update and dead-code restart on one optimizer step's statistics (identical on every rank)."""
        vqvae = unwrap_model(models["vqvae"])
        assert isinstance(vqvae, VQVAE) and stats.counts_V is not None
        weight_VC = vqvae.quantize.embedding.weight
        counts_V = stats.counts_V
        if self.ema is not None:
            assert stats.sums_VC is not None
            dist.all_reduce_sum_(counts_V, stats.sums_VC)
            self.ema.update_(weight_VC, counts_V, stats.sums_VC)
        else:
            dist.all_reduce_sum_(counts_V)
        if self.dead_codes is None:
            return 0
        self.dead_codes.observe(counts_V, step)
        dead_V = self.dead_codes.dead(step)
        if not bool(dead_V.any()):
            return 0
        restarted_V = restart_codes_(weight_VC, dead_V, stats.candidates(), self.restart_generator)
        with torch.no_grad():
            dist.broadcast_(weight_VC.data)
        if self.ema is not None:
            self.ema.reset_codes_(restarted_V, weight_VC)
        self.dead_codes.revive(restarted_V, step)
        return int(restarted_V.sum())

    def _discriminator_step(self, models: Mapping[str, nn.Module], img_B3HW: torch.Tensor) -> dict[str, Any]:
        vqvae = unwrap_model(models["vqvae"])
        assert isinstance(vqvae, VQVAE)
        with torch.no_grad():  # fresh fakes from the just-updated generator, no graph through it
            f_BChw = vqvae.encode(img_B3HW)
            f_hat_BChw = vqvae.quantize.f_to_fhat_per_scale(f_BChw)[-1]
            recon_B3HW = vqvae.decode(f_hat_BChw.to(vqvae.post_quant_conv.weight.dtype))
        discriminator = models["discriminator"]
        logits_real = discriminator(img_B3HW)
        logits_fake = discriminator(recon_B3HW.to(img_B3HW.dtype))
        d_loss = discriminator_loss(logits_real, logits_fake, self.config.gan_loss)
        return {
            "loss": d_loss,
            "logits_real": at_least_float32(logits_real.detach()).mean(),
            "logits_fake": at_least_float32(logits_fake.detach()).mean(),
        }

    # -------------------------------------------------------------------------------------------- evaluation
    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        c = self.config
        if self._heldout is None:
            return {}
        vqvae = unwrap_model(models[EMA_MODEL if c.model_ema_decay else "vqvae"])
        assert isinstance(vqvae, VQVAE)
        dtype = vqvae.post_quant_conv.weight.dtype
        loader = DataLoader(self._heldout, batch_size=c.eval_batch_size, shuffle=False, num_workers=0)
        psnr_sum, count = 0.0, 0
        counts_SV = torch.zeros(len(c.patch_nums), c.vocab_size, device=device)  # code_counts of every batch
        real_feats: list[torch.Tensor] = []
        fake_feats: list[torch.Tensor] = []
        inception = models.get("inception")
        for batch in loader:
            img_B3HW = batch["image"].to(device, dtype)
            recon_B3HW, _, idx_list = vqvae(img_B3HW)
            recon_B3HW = at_least_float32(recon_B3HW).clamp(-1.0, 1.0)
            psnr_sum += psnr(recon_B3HW, at_least_float32(img_B3HW), data_range=2.0) * img_B3HW.shape[0]
            count += img_B3HW.shape[0]
            counts_SV += code_counts(idx_list, c.vocab_size)
            if inception is not None:
                if self._real_fid_stats is None:
                    real_feats.append(inception_features(inception, img_B3HW))
                fake_feats.append(inception_features(inception, recon_B3HW))
        metrics: dict[str, float] = {"psnr": psnr_sum / max(count, 1)}
        usage = usage_from_counts(counts_SV)
        metrics["codebook_used_pct"] = float(usage.used_frac) * 100
        metrics["codebook_perplexity"] = float(usage.perplexity)
        for si, used_frac in enumerate(usage.used_frac_S.tolist()):
            metrics[f"codebook_used_pct/s{si}"] = used_frac * 100
        if inception is not None:
            metrics["rfid"] = self._rfid(real_feats, fake_feats)
        return metrics

    def _rfid(self, real_feats: list[torch.Tensor], fake_feats: list[torch.Tensor]) -> float:
        if self._real_fid_stats is None:
            self._real_fid_stats = feature_statistics(torch.cat(real_feats))
        mu_fake, sigma_fake = feature_statistics(torch.cat(fake_feats))
        try:
            mu_real, sigma_real = self._real_fid_stats
            return frechet_distance(mu_real, sigma_real, mu_fake, sigma_fake)
        except ValueError as err:
            log.warning("rFID not computed: %s", err)
            return float("nan")

    # ----------------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        assert self.vqvae is not None
        return {
            "quantizer_hit_updates": self.vqvae.quantize.num_hit_updates,
            "restart_generator": self.restart_generator.get_state(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "dead_codes": self.dead_codes.state_dict() if self.dead_codes is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.vqvae is not None
        self.vqvae.quantize.num_hit_updates = int(state["quantizer_hit_updates"])
        self.restart_generator.set_state(state["restart_generator"])
        if self.ema is not None:
            if state.get("ema") is None:
                raise UsageError("this checkpoint was trained without --codebook-mode ema; resume with the same mode")
            self.ema.load_state_dict(state["ema"])
        if self.dead_codes is not None and state.get("dead_codes") is not None:
            self.dead_codes.load_state_dict(state["dead_codes"])

    def model_family(self) -> ModelFamily:
        return "convnet"

    def debug_config(self) -> TokenizerConfig:
        """Debug VQVAE (16 px, V=64, 4 scales) on 24 fake images, batch 4: 6 steps (the check resumes at step 3);
        D from step 2; dead-code restarts after 2 unused steps; no perceptual / rFID networks."""
        debug = VQVAEConfig.debug()
        return dataclasses.replace(
            self.config,
            model="custom",
            vocab_size=debug.vocab_size,
            z_channels=debug.z_channels,
            ch=debug.ch,
            ch_mult=debug.ch_mult,
            num_res_blocks=debug.num_res_blocks,
            patch_nums=debug.patch_nums,
            quant_resi=debug.quant_resi,
            share_quant_resi=debug.share_quant_resi,
            image_size=debug.image_size,
            data=dataclasses.replace(self.config.data, kind="fake", fake_size=24, train_limit=0, eval_limit=8),
            eval_batch_size=8,
            batch_size=4,
            grad_accumulation=1,
            epochs=1,
            discriminator_start=2,
            discriminator_weight=0.8,
            discriminator_layers=2,
            discriminator_channels=16,
            dead_code_steps=2,
            perceptual_weights="",
            inception_weights="",
        )


def _default_betas(config_class: type[TokenizerConfig]) -> tuple[float, ...]:
    """The betas of the config's default optimizer group (what --optim.betas is when not given)."""
    field = {f.name: f for f in dataclasses.fields(config_class)}["optim"]
    optim = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[operator]
    assert isinstance(optim, OptimConfig)
    return tuple(optim.betas)
