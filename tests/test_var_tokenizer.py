"""Tests of the VAR multi-scale VQVAE tokenizer: shapes, phi tables, round trips, checkpoint format, and parity
with the official code (`../shared/fixtures/var_official_d4.pt`, skipped when absent)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainlab.errors import UsageError
from trainlab.models.var.codebook import code_counts, code_usage, usage_from_counts
from trainlab.models.var.quantizer import MultiScaleQuantizer, phi_index_table
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig, infer_vqvae_config
from trainlab.models.var.vqvae_blocks import AttnBlock, Upsample

# Shape legend: B batch, C code channels, h/w latent side, V vocab, L total tokens.

SHARED = Path(os.environ.get("TRAINLAB_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SPEC = SHARED / "specs" / "var-checkpoint-format.md"


@pytest.fixture()
def debug_vqvae() -> VQVAE:
    torch.manual_seed(0)
    model = VQVAE(VQVAEConfig.debug())
    with torch.no_grad():  # a codebook with spread-out codes, so that many are used
        model.quantize.embedding.weight.normal_(0.0, 0.5)
    return model.eval()


def debug_images(cfg: VQVAEConfig, batch: int = 3) -> torch.Tensor:
    return torch.rand(batch, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(1)) * 2 - 1


# ------------------------------------------------------------------------------------------- phi tables


def test_phi_table_256px_10_scales() -> None:
    assert phi_index_table(10, 4) == (0, 0, 1, 1, 1, 2, 2, 3, 3, 3)


def test_phi_table_1024px_14_scales() -> None:
    assert phi_index_table(14, 4) == (0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3)


def test_phi_table_share_0_is_one_per_scale_and_share_1_single() -> None:
    q0 = MultiScaleQuantizer(16, 4, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), share_quant_resi=0)
    assert q0.scale_to_phi == tuple(range(10)) and len(q0.quant_resi.qresi_ls) == 10
    q1 = MultiScaleQuantizer(16, 4, (1, 2, 4), share_quant_resi=1)
    assert q1.scale_to_phi == (0, 0, 0) and len(q1.quant_resi.qresi_ls) == 1


# ------------------------------------------------------------------------------------------- debug model


def test_debug_shapes_and_training_forward(debug_vqvae: VQVAE) -> None:
    cfg = debug_vqvae.cfg
    img = debug_images(cfg)
    B, side = img.shape[0], cfg.patch_nums[-1]
    f = debug_vqvae.encode(img)
    assert f.shape == (B, cfg.z_channels, side, side)
    idx_list = debug_vqvae.img_to_idx(img)
    assert [tuple(i.shape) for i in idx_list] == [(B, pn * pn) for pn in cfg.patch_nums]
    assert all(i.dtype == torch.int64 and int(i.max()) < cfg.vocab_size for i in idx_list)
    with torch.no_grad():
        rec = debug_vqvae.idx_to_img(idx_list)
        x_BlC = debug_vqvae.quantize.idx_to_var_input(idx_list)
    assert rec.shape == img.shape and float(rec.abs().max()) <= 1.0
    assert x_BlC.shape == (B, sum(pn * pn for pn in cfg.patch_nums) - 1, cfg.z_channels)

    debug_vqvae.train()
    recon, vq_loss, idx_train = debug_vqvae(img)
    assert recon.shape == img.shape and vq_loss.ndim == 0 and math.isfinite(vq_loss.item())
    assert all(torch.equal(a, b) for a, b in zip(idx_train, idx_list))
    (F.mse_loss(recon, img) + vq_loss).backward()
    for name in ("encoder.conv_in.weight", "quantize.embedding.weight", "quantize.quant_resi.qresi_ls.0.weight"):
        grad = debug_vqvae.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    hits = debug_vqvae.quantize.ema_vocab_hit_SV
    assert torch.allclose(hits.sum(dim=1), torch.tensor([float(B * pn * pn) for pn in cfg.patch_nums]))


def test_bf16_weights_train_step_keeps_quantizer_in_fp32() -> None:
    torch.manual_seed(0)
    model = VQVAE(VQVAEConfig.debug()).to(torch.bfloat16)
    img = debug_images(model.cfg, batch=2).to(torch.bfloat16)
    recon, vq_loss, idx_list = model(img)
    assert recon.dtype == torch.bfloat16 and vq_loss.dtype == torch.float32
    (recon.float().square().mean() + vq_loss).backward()
    assert model.quantize.embedding.weight.grad is not None
    with torch.no_grad():
        assert model.quantize.idx_to_var_input(idx_list).dtype == torch.float32
        assert model.quantize.idx_to_fhat(idx_list).dtype == torch.float32


def test_straight_through_value_and_loss(debug_vqvae: VQVAE) -> None:
    q = debug_vqvae.quantize
    f = debug_vqvae.encode(debug_images(debug_vqvae.cfg)).detach()
    f_hat_st, vq_loss, _ = q(f)
    f_hat_per_scale = q.f_to_fhat_per_scale(f)
    torch.testing.assert_close(f_hat_st, f_hat_per_scale[-1], atol=1e-6, rtol=0)
    want = sum((1 + q.beta) * F.mse_loss(fh, f) for fh in f_hat_per_scale) / len(f_hat_per_scale)
    torch.testing.assert_close(vq_loss, want)


def test_nearest_code_matches_brute_force_at_scale_0(debug_vqvae: VQVAE) -> None:
    q = debug_vqvae.quantize
    f = torch.randn(5, q.embed_dim, q.patch_nums[-1], q.patch_nums[-1])
    idx0 = q.f_to_idx(f)[0]
    want = torch.cdist(f.mean(dim=(2, 3)).double(), q.embedding.weight.double()).argmin(dim=1)
    assert torch.equal(idx0[:, 0], want)


def test_idx_round_trip_and_ar_steps_match_teacher_forcing(debug_vqvae: VQVAE) -> None:
    q = debug_vqvae.quantize
    f = torch.randn(2, q.embed_dim, q.patch_nums[-1], q.patch_nums[-1])
    idx_list = q.f_to_idx(f)
    f_hat_per_scale = q.f_to_fhat_per_scale(f)
    torch.testing.assert_close(q.idx_to_fhat(idx_list), f_hat_per_scale[-1], atol=1e-6, rtol=0)
    # Sampling-time steps rebuild the same f_hat and the same VAR inputs as the teacher-forcing path.
    x_BlC = q.idx_to_var_input(idx_list)
    f_hat = torch.zeros_like(f)
    inputs = []
    for si, (pn, idx) in enumerate(zip(q.patch_nums, idx_list)):
        h = q.embedding(idx).transpose(1, 2).reshape(2, q.embed_dim, pn, pn)
        f_hat, nxt = q.next_autoregressive_input(si, f_hat, h)
        torch.testing.assert_close(f_hat, f_hat_per_scale[si], atol=1e-6, rtol=0)
        if nxt is not None:
            inputs.append(nxt.flatten(2).transpose(1, 2))
        else:
            assert si == len(q.patch_nums) - 1
    torch.testing.assert_close(torch.cat(inputs, dim=1), x_BlC, atol=1e-6, rtol=0)


def test_codebook_usage_stats() -> None:
    """The one code-usage statistic (`codebook.code_usage`), pooled and per scale, from codes or summed counts."""
    usage = code_usage([torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], vocab_size=4)
    assert float(usage.used_frac) == 0.25 and float(usage.dead_codes) == 3.0
    assert float(usage.perplexity) == pytest.approx(1.0)
    idx_list = [torch.tensor([[0]]), torch.tensor([[0, 1, 2, 3]])]
    usage = code_usage(idx_list, vocab_size=4)
    assert float(usage.used_frac) == 1.0 and usage.used_frac_S.tolist() == [0.25, 1.0] and float(usage.dead_codes) == 0
    p = torch.tensor([2, 1, 1, 1]) / 5.0
    assert float(usage.perplexity) == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    summed = usage_from_counts(code_counts(idx_list, 4) + code_counts(idx_list, 4))  # two batches' counts
    assert summed.counts_V.tolist() == [4, 2, 2, 2] and summed.used_frac_S.tolist() == [0.25, 1.0]


def test_wrong_latent_size_is_a_usage_error(debug_vqvae: VQVAE) -> None:
    with pytest.raises(UsageError, match="quantizer expects"):
        debug_vqvae.quantize.f_to_idx(torch.randn(1, debug_vqvae.cfg.z_channels, 5, 5))
    with pytest.raises(UsageError, match="token maps"):
        debug_vqvae.quantize.idx_to_fhat([torch.zeros(1, 1, dtype=torch.long)])


# ------------------------------------------------------------------------------------------- fast paths


def test_sdpa_attention_matches_explicit_softmax() -> None:
    torch.manual_seed(0)
    block = AttnBlock(64).eval()
    x = torch.randn(2, 64, 6, 5)
    with torch.no_grad():
        want = block(x)
        block.use_sdpa = False
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("channels_last", [False, True])
def test_subpixel_upsample_matches_nearest_then_conv(channels_last: bool) -> None:
    torch.manual_seed(0)
    up = Upsample(32).eval()
    x = torch.randn(2, 32, 5, 7)
    with torch.no_grad():
        want = up(x)
        up.subpixel = True
        if channels_last:
            up.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        got = up(x)
    assert got.shape == (2, 32, 10, 14)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_optimize_for_inference_same_images(debug_vqvae: VQVAE) -> None:
    img = debug_images(debug_vqvae.cfg)
    with torch.no_grad():
        idx_list = debug_vqvae.img_to_idx(img)
        want = debug_vqvae.idx_to_img(idx_list)
    debug_vqvae.optimize_for_inference()
    with torch.inference_mode():
        got = debug_vqvae.idx_to_img(idx_list)
        assert all(torch.equal(a, b) for a, b in zip(debug_vqvae.img_to_idx(img), idx_list))
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- checkpoint format


def _spec_vqvae_shapes() -> dict[str, tuple[int, ...]]:
    text = SPEC.read_text().split("## 3. VQVAE", 1)[1].split("## 4.", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| \(([\d, ]+)\) \| float32 \|$", text, flags=re.M)
    return {key: tuple(int(s) for s in shape.split(",")) for key, shape in rows}


def test_official_config_key_set_and_parameter_count() -> None:
    with torch.device("meta"):
        model = VQVAE(VQVAEConfig.official())
    sd = model.state_dict()
    assert len(sd) == 324
    assert sum(p.numel() for p in model.parameters()) == 108_948_355
    assert sum(p.numel() for p in model.encoder.parameters()) == 44_107_872
    assert sum(p.numel() for p in model.decoder.parameters()) == 64_653_923
    assert sum(p.numel() for p in model.quantize.parameters()) == 168_064
    assert model.quantize.ema_vocab_hit_SV.shape == (10, 4096)
    assert infer_vqvae_config(sd) == VQVAEConfig.official()
    if not SPEC.exists():
        pytest.skip(f"spec {SPEC} absent: key names checked only by count")
    spec = _spec_vqvae_shapes()
    assert len(spec) == 324
    assert {k: tuple(v.shape) for k, v in sd.items()} == spec


def test_load_state_dict_tolerates_only_ema_rows(debug_vqvae: VQVAE) -> None:
    sd = {k: v.clone() for k, v in debug_vqvae.state_dict().items()}
    other = VQVAE(dataclasses.replace(VQVAEConfig.debug(), patch_nums=(1, 2, 4)))
    other.load_state_dict(sd)  # 4-row buffer into a 3-scale model: keeps its own
    assert other.quantize.ema_vocab_hit_SV.shape == (3, 64)
    torch.testing.assert_close(other.quantize.embedding.weight, sd["quantize.embedding.weight"])
    with pytest.raises(RuntimeError):
        other.load_state_dict({**sd, "quantize.ema_vocab_hit_SV": torch.zeros(4, 65)})
    with pytest.raises(RuntimeError):
        other.load_state_dict({k: v for k, v in sd.items() if k != "quant_conv.bias"})
    with pytest.raises(RuntimeError):
        other.load_state_dict({**sd, "extra.weight": torch.zeros(1)})


def test_infer_config_round_trip_and_patch_nums_rule(debug_vqvae: VQVAE) -> None:
    sd = debug_vqvae.state_dict()
    with pytest.raises(UsageError, match="patch_nums"):
        infer_vqvae_config(sd)  # 4 scales: cannot guess
    assert infer_vqvae_config(sd, patch_nums=(1, 2, 3, 4)) == debug_vqvae.cfg
    with pytest.raises(UsageError, match="not a VQVAE"):
        infer_vqvae_config({"foo": torch.zeros(1)})


# ------------------------------------------------------------------------------------------- official parity


@pytest.fixture(scope="module")
def official(fx: dict[str, Any]) -> dict[str, Any]:
    return fx


@pytest.fixture(scope="module")
def official_vqvae(official: dict[str, Any]) -> VQVAE:
    return VQVAE.from_state_dict(official["vae_state_dict"]).freeze()


def _official_img(official: dict[str, Any]) -> torch.Tensor:
    x = official["img_u8"].float() / 255
    return x + x - 1


@pytest.mark.fixtures
def test_parity_config_inferred_from_fixture(official_vqvae: VQVAE) -> None:
    assert official_vqvae.cfg == VQVAEConfig(ch=32)


@pytest.mark.fixtures
def test_parity_encode_and_tokens(official: dict[str, Any], official_vqvae: VQVAE) -> None:
    with torch.no_grad():
        f = official_vqvae.encode(_official_img(official))
    torch.testing.assert_close(f, official["f_BChw"], atol=1e-5, rtol=0)
    idx_list = official_vqvae.quantize.f_to_idx(f)
    for si, (got, want) in enumerate(zip(idx_list, official["idx_Bl"], strict=True)):
        assert torch.equal(got, want), f"scale {si}"


@pytest.mark.fixtures
def test_parity_fhat_and_var_input(official: dict[str, Any], official_vqvae: VQVAE) -> None:
    q = official_vqvae.quantize
    f_hat_per_scale = q.f_to_fhat_per_scale(official["f_BChw"])
    torch.testing.assert_close(torch.stack(f_hat_per_scale), official["f_hat_per_scale"], atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(
            q.idx_to_fhat(official["idx_Bl"]), official["f_hat_per_scale"][-1], atol=1e-5, rtol=0
        )
        x_BlC = q.idx_to_var_input(official["idx_Bl"])
    torch.testing.assert_close(x_BlC, official["x_BLCv_wo_first_l"], atol=1e-5, rtol=0)


@pytest.mark.fixtures
def test_parity_decoded_image(official: dict[str, Any], official_vqvae: VQVAE) -> None:
    with torch.no_grad():
        img = official_vqvae.idx_to_img(official["idx_Bl"])
    torch.testing.assert_close(img, official["img_decoded"], atol=1e-4, rtol=0)
