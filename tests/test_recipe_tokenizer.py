"""The tokenizer recipe: bit-exact resume with two optimizers, phase gradient isolation, GAN / adaptive-weight /
codebook / perceptual math against hand formulas, and one-line errors for bad input. CPU, tiny models."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainlab.cli import main
from trainlab.config import load_yaml, parse
from trainlab.engine.debug import debug_run_config, run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import StepInfo, TrainConfig
from trainlab.errors import UsageError
from trainlab.losses.gan import adaptive_gan_weight, discriminator_loss, generator_loss
from trainlab.losses.perceptual import VGG16_TAPS, PerceptualLoss, load_perceptual_loss, vgg16_features
from trainlab.models.discriminator import PatchDiscriminator
from trainlab.models.var.codebook import (
    DeadCodeTracker,
    EMACodebook,
    assignment_sums,
    code_usage,
    restart_codes_,
    scale_residuals,
)
from trainlab.models.var.quantizer import MultiScaleQuantizer
from trainlab.recipes.tokenizer import TokenizerConfig, TokenizerRecipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These models are tiny (8-16 px, batch 4): a second thread gains little, and on a busy 2-core machine OpenMP
    oversubscription made the debug checks 3-5x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _with_data(cfg: TokenizerConfig, kw: dict[str, object]) -> TokenizerConfig:
    """`cfg` with `kw` set; the keys of the data group (`fake_size`, `eval_limit`, `kind`, `root`) go into it."""
    data = {k: kw.pop(k) for k in list(kw) if k in ("fake_size", "eval_limit", "kind", "root")}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data), **kw)  # type: ignore[arg-type]


def _micro(cfg: TrainConfig, **kw: object) -> TrainConfig:
    """The debug config shrunk further: 8 px images, 2 levels, 3 scales, a 1-layer discriminator."""
    assert isinstance(cfg, TokenizerConfig)
    base: dict[str, object] = dict(ch_mult=(1, 2), patch_nums=(1, 2, 4), image_size=8, discriminator_layers=1)
    base.update(eval_limit=4, **kw)
    return _with_data(cfg, base)


class MicroTokenizerRecipe(TokenizerRecipe):
    """Debug check under dynamic loss scaling (one GradScaler per phase), EMA codebook, vanilla GAN loss."""

    def debug_config(self) -> TokenizerConfig:
        return _micro(  # type: ignore[return-value]
            super().debug_config(),
            precision="bf16-amp-scale",
            codebook_mode="ema",
            gan_loss="vanilla",
            fake_size=16,  # 4 steps: the check resumes at step 2; D trains from step 1, before and after
            discriminator_start=1,
            dead_code_steps=1,
        )


def _base(run_dir: Path, **kw: object) -> TokenizerConfig:
    cfg = TokenizerConfig(run_dir=run_dir, tensorboard=False, progress=False, device="cpu", seed=3)
    return _with_data(debug_run_config(TokenizerRecipe(cfg)), dict(kw))


# ------------------------------------------------------------------------------------------- engine-level
@pytest.mark.parametrize("codebook_mode", ["ema", "vq"])
def test_accumulation_is_the_large_batch_for_the_codebook_too(tmp_path: Path, codebook_mode: str) -> None:
    """4 micro-batches of 2 == one batch of 8: the same gradients, and the EMA codebook and dead-code restarts act
    once per optimizer step on the statistics of all micro-batches (no GAN, so no BatchNorm batch statistics).

    Parameters are compared through the codebook and the first step's gradients: biases right before a GroupNorm
    get pure rounding noise as gradients, which Adam turns into lr-sized steps, so comparing every weight after
    Adam would test that noise. The runs are fp64 (the reference mode): in fp32 the two summation orders part by
    ~1e-5 after three steps, by an amount that depends on the CPU's kernels (AVX2 against AVX-512), so a tolerance
    tuned on one CPU fails on another; in fp64 they part by ~3e-14 on any."""

    def run(accumulation: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[float]]:
        cfg = _base(
            tmp_path / f"acc{accumulation}",
            codebook_mode=codebook_mode,
            discriminator_weight=0.0,
            dead_code_steps=1,
            fake_size=24,
            batch_size=8,
            grad_accumulation=accumulation,
            precision="fp64",
        )
        trainer = Trainer(TokenizerRecipe(cfg))
        vqvae, optimizer = trainer.parts.models["vqvae"], trainer.phases[0].optimizer
        grads: dict[str, torch.Tensor] = {}
        original_step = optimizer.step

        def spy_step(*args: Any, **kwargs: Any) -> Any:
            if not grads:
                grads.update({n: p.grad.clone() for n, p in vqvae.named_parameters() if p.grad is not None})
            return original_step(*args, **kwargs)

        optimizer.step = spy_step  # type: ignore[method-assign]
        trainer.fit(stop_at_step=3)
        rows = [json.loads(x) for x in (tmp_path / f"acc{accumulation}" / "metrics.jsonl").read_text().splitlines()]
        restarted = [r["generator/codes_restarted"] for r in rows if r["kind"] == "train"]
        return vqvae.quantize.embedding.weight.detach().clone(), grads, restarted

    codebook_big, grads_big, restarted_big = run(1)
    codebook_acc, grads_acc, restarted_acc = run(4)
    assert restarted_big == restarted_acc and sum(restarted_big) > 0  # restarts happened, the same number of them
    torch.testing.assert_close(codebook_acc, codebook_big, rtol=1e-10, atol=1e-11)
    total_big = torch.cat([g.flatten() for g in grads_big.values()]).norm()
    total_diff = torch.cat([(grads_acc[n] - g).flatten() for n, g in grads_big.items()]).norm()
    assert float(total_diff / total_big) < 1e-12


def test_debug_check_is_bit_exact_with_discriminator_starting_mid_run(tmp_path: Path) -> None:
    recipe = TokenizerRecipe(TokenizerConfig(run_dir=tmp_path, tensorboard=False, progress=False, device="cpu"))
    report = run_debug_check(TokenizerRecipe, recipe, tmp_path / "debug")
    assert report.passed, report.line()
    assert report.resumed_at == 3  # D trains from step 2: before and after the resume


def test_debug_check_with_a_grad_scaler_per_phase_and_ema_codebook(tmp_path: Path) -> None:
    recipe = MicroTokenizerRecipe(TokenizerConfig(run_dir=tmp_path, tensorboard=False, progress=False, device="cpu"))
    report = run_debug_check(MicroTokenizerRecipe, recipe, tmp_path / "debug")
    assert report.passed, report.line()
    rows = [json.loads(line) for line in (tmp_path / "debug/straight/metrics.jsonl").read_text().splitlines()]
    steps = {int(r["step"]): r for r in rows if r["kind"] == "train"}  # step k = after k optimizer steps
    assert "discriminator/loss" not in steps[1] and "discriminator/loss" in steps[2]  # D from step 1 (0-based)
    assert steps[4]["generator/loss_scale"] > 0 and steps[4]["discriminator/loss_scale"] > 0
    assert sum(r["generator/codes_restarted"] for r in steps.values()) > 0  # 64 codes, 1-step threshold
    assert 0 < steps[1]["generator/codebook_used_pct"] <= 100


def test_an_ema_of_the_vqvae_is_checkpointed_resumed_and_read_by_loaders(tmp_path: Path) -> None:
    """--model-ema-decay: the engine keeps `vqvae_ema` (the discriminator has none); the debug check resumes it bit for
    bit, and a loader handed the run's checkpoint reads the averaged VQVAE."""
    from trainlab.engine.checkpoint import load_checkpoint, weights_in_checkpoint

    recipe = TokenizerRecipe(_base(tmp_path, model_ema_decay=0.5))
    report = run_debug_check(TokenizerRecipe, recipe, tmp_path / "debug")
    assert report.passed and report.averaged_identical, report.line()
    path = tmp_path / "debug" / "resumed" / "ckpt" / "last.pt"
    state = load_checkpoint(path)
    assert list(state["averaged"]) == ["vqvae_ema"] and state["averaged"]["vqvae_ema"]["follows"] == "vqvae"
    read = weights_in_checkpoint("vqvae")(state, path)
    average = state["averaged"]["vqvae_ema"]["weights"]
    assert read.keys() == average.keys() and all(torch.equal(read[k], v) for k, v in average.items())
    assert any(not torch.equal(state["models"]["vqvae"][k], v) for k, v in average.items())


def test_each_phase_only_has_gradients_for_its_own_modules(tmp_path: Path) -> None:
    cfg = _micro(_base(tmp_path, discriminator_start=1, max_steps=3))
    trainer = Trainer(TokenizerRecipe(cfg))
    vqvae_params = list(trainer.parts.models["vqvae"].parameters())
    disc_params = list(trainer.parts.models["discriminator"].parameters())
    seen: list[tuple[str, bool, bool]] = []
    for phase in trainer.phases:
        original = phase.optimizer.step

        def spy(*args: object, _original: object = original, _name: str = phase.name, **kwargs: object) -> object:
            has_g = any(p.grad is not None for p in vqvae_params)
            has_d = any(p.grad is not None for p in disc_params)
            seen.append((_name, has_g, has_d))
            return _original(*args, **kwargs)  # type: ignore[operator]

        phase.optimizer.step = spy  # type: ignore[method-assign, assignment]
    trainer.fit()
    assert seen == [
        ("generator", True, False),  # step 0: D not yet active
        ("generator", True, False),  # step 1: G gets the GAN term through a frozen D
        ("discriminator", False, True),
        ("generator", True, False),
        ("discriminator", False, True),
    ]


# ------------------------------------------------------------------------------------------------ losses
def test_adaptive_weight_matches_the_closed_form() -> None:
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    x = torch.tensor([1.0, -2.0])
    out = w @ x
    a, b = torch.tensor([0.5, 1.5]), torch.tensor([2.0, -1.0])
    recon, g = (a * out).sum(), (b * out).sum()  # d/dW = outer(a, x), outer(b, x)
    weight = adaptive_gan_weight(recon, g, w)
    expected = a.norm() * x.norm() / (b.norm() * x.norm() + 1e-4)
    assert torch.allclose(weight, expected) and not weight.requires_grad and w.grad is None
    flat = adaptive_gan_weight(recon, 0.0 * out.sum(), w, max_weight=10.0)  # no GAN gradient: clamped
    assert float(flat) == 10.0


def test_gan_losses_match_hand_formulas() -> None:
    real, fake = [2.0, 0.5, -1.0], [-2.0, 0.3, 1.5]
    r, f = torch.tensor(real), torch.tensor(fake)

    def softplus(v: float) -> float:
        return math.log1p(math.exp(v))

    hinge_d = 0.5 * (sum(max(0.0, 1 - v) for v in real) / 3 + sum(max(0.0, 1 + v) for v in fake) / 3)
    vanilla_d = 0.5 * (sum(softplus(-v) for v in real) / 3 + sum(softplus(v) for v in fake) / 3)
    assert discriminator_loss(r, f, "hinge").item() == pytest.approx(hinge_d, rel=1e-6)
    assert discriminator_loss(r, f, "vanilla").item() == pytest.approx(vanilla_d, rel=1e-6)
    assert generator_loss(f, "hinge").item() == pytest.approx(-sum(fake) / 3, rel=1e-6)
    assert generator_loss(f, "vanilla").item() == pytest.approx(sum(softplus(-v) for v in fake) / 3, rel=1e-6)


def test_patch_discriminator_shape_and_init() -> None:
    torch.manual_seed(0)
    disc = PatchDiscriminator(3, 64, 3, norm="batch")
    assert disc(torch.randn(2, 3, 64, 64)).shape == (2, 1, 6, 6) and PatchDiscriminator.output_side(256, 3) == 30
    conv_w = torch.cat([m.weight.flatten() for m in disc.modules() if isinstance(m, nn.Conv2d)])
    assert abs(conv_w.std().item() - 0.02) < 0.002
    group = PatchDiscriminator(3, 16, 2, norm="group")
    assert any(isinstance(m, nn.GroupNorm) for m in group.modules()) and group(torch.randn(1, 3, 16, 16)).numel() == 4


# ---------------------------------------------------------------------------------------------- codebook
def test_codebook_usage_on_a_hand_built_index_list() -> None:
    idx_list = [torch.tensor([[3], [3]]), torch.tensor([[0, 1, 1, 3], [1, 1, 0, 3]])]
    usage = code_usage(idx_list, vocab_size=5)
    assert usage.counts_V.tolist() == [2, 4, 0, 4, 0]
    assert usage.used_frac.item() == pytest.approx(0.6) and usage.dead_codes.item() == 2
    entropy = -(0.2 * math.log(0.2) + 2 * 0.4 * math.log(0.4))
    assert usage.perplexity.item() == pytest.approx(math.exp(entropy), rel=1e-6)


def test_scale_residuals_are_what_the_quantizer_matched() -> None:
    torch.manual_seed(1)
    quantizer = MultiScaleQuantizer(16, 4, (1, 2, 4))
    nn.init.normal_(quantizer.embedding.weight)
    f_BChw = torch.randn(2, 4, 4, 4)
    z_list = scale_residuals(quantizer, f_BChw)
    for z_NC, idx in zip(z_list, quantizer.f_to_idx(f_BChw)):
        nearest = torch.cdist(z_NC, quantizer.embedding.weight.detach()).argmin(dim=1)
        assert torch.equal(nearest, idx.flatten())


def test_ema_update_moves_codes_to_their_assigned_vectors_in_closed_form() -> None:
    weight = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    ema = EMACodebook(weight, decay=0.5, epsilon=1e-5)
    z = [torch.tensor([[2.0, 0.0], [4.0, 0.0], [1.0, 3.0]])]
    counts, sums = assignment_sums(z, [torch.tensor([[0, 0, 1]])], vocab_size=3)
    assert counts.tolist() == [2, 1, 0] and sums.tolist() == [[6, 0], [1, 3], [0, 0]]
    before = weight.clone()
    ema.update_(weight, counts, sums)
    size = torch.tensor([1.5, 1.0, 0.5])  # 0.5 * 1 + 0.5 * counts
    smoothed = (size + 1e-5) / (3 + 3e-5) * 3
    mean_sum = torch.tensor([[3.0, 0.0], [1.0, 2.0], [2.5, 2.5]])  # 0.5 * weight + 0.5 * sums
    assert torch.allclose(weight, mean_sum / smoothed[:, None], atol=1e-6)
    targets = torch.tensor([[3.0, 0.0], [1.0, 3.0]])  # means of the assigned vectors
    assert ((weight[:2] - targets).norm(dim=1) < (before[:2] - targets).norm(dim=1)).all()
    assert torch.allclose(weight[2], before[2], atol=1e-4)  # unhit code stays put


def test_dead_codes_are_restarted_from_recent_encoder_vectors() -> None:
    tracker = DeadCodeTracker(4, threshold_steps=2, device=torch.device("cpu"))
    tracker.observe(torch.tensor([1.0, 0.0, 0.0, 1.0]), step=0)
    tracker.observe(torch.tensor([1.0, 0.0, 1.0, 0.0]), step=1)
    dead = tracker.dead(step=2)
    assert dead.tolist() == [False, True, False, True]
    weight = torch.zeros(4, 2)
    candidates = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    first = restart_codes_(weight, dead, candidates, torch.Generator().manual_seed(0))
    assert first.tolist() == dead.tolist() and (weight[[0, 2]] == 0).all()
    assert all(any(torch.equal(row, c) for c in candidates) for row in weight[[1, 3]])
    assert not torch.equal(weight[1], weight[3])  # distinct vectors: identical codes would tie forever
    again = torch.zeros(4, 2)
    restart_codes_(again, dead, candidates, torch.Generator().manual_seed(0))
    assert torch.equal(weight, again)  # the draw is reproducible from the generator state
    tracker.revive(dead, step=2)  # a fresh grace period for 1 and 3; 0 and 2 were last hit at step 1
    assert tracker.dead(step=3).tolist() == [True, False, True, False] and tracker.dead(step=4).all()


def test_more_dead_codes_than_candidates_restart_distinct_vectors_and_the_rest_wait() -> None:
    weight = torch.zeros(5, 2)
    dead = torch.tensor([True, True, False, True, True])
    candidates = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    restarted = restart_codes_(weight, dead, candidates, torch.Generator().manual_seed(3))
    assert restarted.tolist() == [True, True, False, False, False]  # the lowest-numbered dead codes, one per vector
    assert sorted(weight[:2, 0].tolist()) == [1.0, 2.0] and (weight[2:] == 0).all()


# -------------------------------------------------------------------------------------------- perceptual
def test_perceptual_distance_matches_the_lpips_formula() -> None:
    torch.manual_seed(2)
    features = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1), nn.ReLU())
    x, y = torch.rand(2, 3, 4, 4) * 2 - 1, torch.rand(2, 3, 4, 4) * 2 - 1
    plain = PerceptualLoss(features, taps=(1, 3))
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)

    def taps(img: torch.Tensor) -> list[torch.Tensor]:
        h1 = features[1](features[0]((img - shift) / scale))
        return [h1, features[3](features[2](h1))]

    expected = torch.zeros(2)
    for fx, fy in zip(taps(x), taps(y)):
        nx = fx / (fx.square().sum(1, keepdim=True).sqrt() + 1e-10)
        ny = fy / (fy.square().sum(1, keepdim=True).sqrt() + 1e-10)
        expected += (nx - ny).square().sum(1).mean((1, 2))
    assert torch.allclose(plain(x, y), expected, atol=1e-6)
    assert plain(x, x).abs().max() == 0
    doubled = PerceptualLoss(features, taps=(1, 3), lin_weights=[torch.full((1, 4, 1, 1), 2.0), torch.full((5,), 2.0)])
    assert torch.allclose(doubled(x, y), 2 * expected, atol=1e-6)
    assert not any(p.requires_grad for p in doubled.parameters())


def test_perceptual_loader_reads_a_local_vgg16_state_dict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(3)
    shapes = vgg16_features().state_dict()  # meta tensors: shapes only, nothing allocated
    state = {f"features.{k}": torch.randn(v.shape) * 0.05 for k, v in shapes.items()}
    channels = [64, 128, 256, 512, 512]
    state.update({f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1) for i, c in enumerate(channels)})
    path = tmp_path / "vgg_lpips.pth"
    torch.save(state, path)
    with caplog.at_level(logging.INFO):
        loss = load_perceptual_loss(path)
    assert "LPIPS linear" in caplog.text and loss.taps == VGG16_TAPS
    x = torch.rand(1, 3, 16, 16) * 2 - 1
    assert loss(x, x).item() == 0 and loss(x, -x).item() > 0
    del state["features.28.weight"]
    torch.save(state, path)
    with pytest.raises(UsageError, match=r"features\.28\.weight"):
        load_perceptual_loss(path)


def test_perceptual_and_rfid_are_off_without_weights_and_say_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = TokenizerRecipe(_micro(_base(tmp_path)))
    with caplog.at_level(logging.INFO):
        parts = recipe.build(torch.device("cpu"))
    assert caplog.text.count("perceptual loss off: no --perceptual-weights given") == 1
    assert "rFID off: no --inception-weights given" in caplog.text
    # with a perceptual network the generator's reconstruction loss is pixel + weight * perceptual
    assert parts.frozen == {}
    perceptual = PerceptualLoss(nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU()), taps=(1,))
    models = {**parts.models, "perceptual": perceptual}
    batch = {"image": torch.rand(2, 3, 8, 8) * 2 - 1}
    out = recipe.train_step(models, batch, "generator", StepInfo(step=0, total_steps=1, steps_per_epoch=1))
    expected = out["pixel_loss"] + recipe.config.perceptual_loss_weight * out["perceptual_loss"]
    assert torch.allclose(out["recon_loss"], expected) and out["perceptual_loss"] > 0


# ------------------------------------------------------------------------------------------- data, errors
def test_image_folder_is_resized_center_cropped_and_scaled(tmp_path: Path) -> None:
    from PIL import Image

    for split, name in [("train", "a"), ("train", "b"), ("val", "a"), ("val", "b")]:  # the same classes
        (tmp_path / "data" / split / name).mkdir(parents=True, exist_ok=True)
        pixels = (torch.rand(12, 20, 3) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / "data" / split / name / "img.png")
    cfg = _base(tmp_path, kind="image-folder", root=tmp_path / "data")
    recipe = TokenizerRecipe(cfg)
    train = recipe.build_data(recipe.build(torch.device("cpu")), torch.device("cpu"))
    img = train[0]["image"]
    assert img.shape == (3, 16, 16) and img.min() >= -1 and img.max() <= 1 and len(train) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data.kind", "image-folder", "--data.root", "{tmp}/nowhere"], "--data.root {tmp}/nowhere not found"),
        (["--data.kind", "fake", "--perceptual-weights", "{tmp}/vgg16.pth"], "--perceptual-weights"),
        (["--data.kind", "fake", "--inception-weights", "{tmp}/inception.pth"], "--inception-weights"),
        (["--data.kind", "fake", "--model", "custom", "--image-size", "32"], "does not match the VQVAE"),
        (["--data.kind", "fake", "--ch", "64"], "--model vqvae_debug sets ch"),
        (["--data.kind", "cifar10"], "invalid choice: 'cifar10'"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["train", "tokenizer", "--model", "vqvae_debug", "--discriminator-layers", "2", "--run-dir", str(tmp_path)]
    code = main(argv + [f.format(tmp=tmp_path) for f in flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert message.format(tmp=tmp_path) in err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["tokenizer_digits.yaml", "tokenizer_imagenet256.yaml"])
def test_shipped_configs_parse(name: str) -> None:
    path = REPO / "trainlab" / "configs" / name
    cfg = parse(TokenizerConfig, ["--config", str(path)], prog="t")
    raw = load_yaml(path)
    assert cfg.data.kind == raw["data"]["kind"] and cfg.vqvae_config().image_size == cfg.image_size


@pytest.mark.slow
def test_rfid_with_local_inception_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    with monkeypatch.context() as patch:  # a random-weights file with the real layout (nothing is downloaded)
        patch.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda *a, **k: None)
        patch.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        state = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"]).state_dict()
    torch.save(state, tmp_path / "inception.pth")
    cfg = _micro(_base(tmp_path, inception_weights=str(tmp_path / "inception.pth")), eval_limit=6)
    recipe = TokenizerRecipe(cfg)
    parts = recipe.build(torch.device("cpu"))
    recipe.build_data(parts, torch.device("cpu"))
    assert set(parts.frozen) == {"inception"}
    for m in [*parts.models.values(), *parts.frozen.values()]:
        m.eval()
    with torch.no_grad():
        metrics = recipe.evaluate({**parts.models, **parts.frozen}, torch.device("cpu"), epoch=1)
    assert "rfid" in metrics and metrics["psnr"] > 0
