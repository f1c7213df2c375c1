"""VAR transformer: parity with the official model (../shared/fixtures/var_official_d4.pt), KV cache, loading/export."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainlab.commands.sample import load_var_pair
from trainlab.engine import sharded_checkpoint as sharded
from trainlab.engine.checkpoint import CheckpointStore
from trainlab.errors import UsageError
from trainlab.losses.token_cross_entropy import token_cross_entropy
from trainlab.models.var.blocks import AdaLNSelfAttn
from trainlab.models.var.convert import build_var, export_official, infer_var_config, load_official, read_state_dict
from trainlab.models.var.transformer import PATCH_NUMS_512, VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B batch, L tokens, l tokens of one scale, C width, V vocab, Cv code width.


@pytest.fixture(scope="module")
def official_d4(fx: dict[str, Any]) -> VAR:
    var = VAR(VARConfig.from_depth(4))
    var.load_state_dict(fx["var_state_dict"], strict=True)
    return var.eval()


@pytest.fixture(scope="module")
def fx_logits(fx: dict[str, Any], official_d4: VAR) -> torch.Tensor:
    with torch.no_grad():
        return official_d4(fx["label_B"], fx["x_BLCv_wo_first_l"], cond_drop_rate=0.0)


def _debug_var(**overrides: Any) -> VAR:
    torch.manual_seed(0)
    return VAR(VARConfig(**{**vars(VARConfig.debug()), **overrides}))


# ----------------------------------------------------------------------------------------------- official parity
def test_official_state_dict_keys_order_dtypes(fx: dict[str, Any], official_d4: VAR) -> None:
    ours, ref = official_d4.state_dict(), fx["var_state_dict"]
    assert list(ours) == list(ref)
    assert all(ours[k].dtype == v.dtype and ours[k].shape == v.shape for k, v in ref.items())
    assert ours["lvl_1L"].dtype == torch.int64
    fresh = VAR(VARConfig.from_depth(4))  # buffers we compute equal the official ones
    for key in ("lvl_1L", "attn_bias_for_masking", "blocks.0.attn.zero_k_bias"):
        assert torch.equal(fresh.state_dict()[key], ref[key]), key


def test_forward_matches_official(fx: dict[str, Any], official_d4: VAR, fx_logits: torch.Tensor) -> None:
    with torch.no_grad():
        h_BLC = official_d4(fx["label_B"], fx["x_BLCv_wo_first_l"], cond_drop_rate=0.0, return_hidden=True)
    assert (h_BLC - fx["h_out"]).abs().max() <= 1e-4
    assert (fx_logits[:, fx["logits_rows_index"]] - fx["logits_rows"]).abs().max() <= 1e-4
    assert (fx_logits @ fx["logits_proj_matrix"] - fx["logits_proj"]).abs().max() <= 1e-4
    assert (fx_logits.logsumexp(-1) - fx["logits_lse"]).abs().max() <= 1e-4
    assert (fx_logits.amax(-1) - fx["logits_max"]).abs().max() <= 1e-4
    gt_BL = torch.cat(fx["idx_Bl"], dim=1)
    assert (fx_logits.gather(-1, gt_BL.unsqueeze(-1)).squeeze(-1) - fx["logits_at_gt"]).abs().max() <= 1e-4
    assert torch.equal(fx_logits.argmax(-1), fx["logits_argmax"])


def token_loss(logits_BLV: torch.Tensor, target_BL: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """The official loss: per-token CE, weights 1/L, mean over the batch (what the recipe optimises)."""
    L = logits_BLV.shape[1]
    return token_cross_entropy(logits_BLV, target_BL, torch.full((L,), 1.0 / L), smoothing).loss


def test_train_loss_and_gradients_match_official(fx: dict[str, Any], official_d4: VAR) -> None:
    gt_BL = torch.cat(fx["idx_Bl"], dim=1)
    official_d4.zero_grad(set_to_none=True)
    logits_BLV = official_d4(fx["label_B"], fx["x_BLCv_wo_first_l"], cond_drop_rate=0.0)
    loss = token_loss(logits_BLV, gt_BL)
    assert abs(loss.item() - fx["train_loss_ls0"].item()) <= 1e-4
    assert abs(token_loss(logits_BLV, gt_BL, 0.1).item() - fx["train_loss_ls0.1"].item()) <= 1e-4
    loss.backward()
    ref = fx["grad_norm_per_param"]
    assert set(ref) == {n for n, _ in official_d4.named_parameters()}
    for name, p in official_d4.named_parameters():
        assert p.grad is not None, name
        assert abs(p.grad.norm().item() - ref[name]) <= 1e-4 * max(ref[name], 1e-6), name
    total = math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in official_d4.parameters() if p.grad is not None))
    assert abs(total - fx["grad_norm_total"].item()) <= 1e-4 * fx["grad_norm_total"].item()
    official_d4.zero_grad(set_to_none=True)


def test_kv_cache_scale_by_scale_equals_teacher_forcing(
    fx: dict[str, Any], official_d4: VAR, fx_logits: torch.Tensor
) -> None:
    var, x_BLCv, label_B = official_d4, fx["x_BLCv_wo_first_l"], fx["label_B"]
    with torch.no_grad():
        cond_BD = var.class_emb(label_B)
        lvl_pos_1LC = var.lvl_pos()
        var.enable_kv_cache()
        try:
            chunks = []
            for si in range(len(var.patch_nums)):
                if si == 0:
                    x_BlC = var.first_tokens(cond_BD, lvl_pos_1LC)
                else:
                    start, end = var.scale_ends[si - 1], var.scale_ends[si]
                    x_BlC = var.next_tokens(si, x_BLCv[:, start - var.first_l : end - var.first_l], lvl_pos_1LC)
                chunks.append(var.logits(var.forward_cached(x_BlC, cond_BD), cond_BD))
        finally:
            var.disable_kv_cache()
    assert (torch.cat(chunks, dim=1) - fx_logits).abs().max() <= 1e-4
    assert not var.kv_cache_enabled


# ---------------------------------------------------------------------------------------------- model behaviour
def test_debug_forward_backward_and_attention_plans() -> None:
    var = _debug_var().train()
    B, L = 3, var.seq_len
    x_BLCv, label_B = torch.randn(B, L - 1, var.cfg.vae_embed_dim), torch.tensor([0, 5, 999])
    logits_BLV = var(label_B, x_BLCv, cond_drop_rate=0.0)
    assert logits_BLV.shape == (B, L, var.vocab_size) and logits_BLV.dtype == torch.float32
    token_loss(logits_BLV, torch.randint(0, var.vocab_size, (B, L))).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in var.parameters())
    var.eval()
    with torch.no_grad():
        plans = []
        for split in range(1, len(var.patch_nums) + 1):  # 1 = per-scale calls ... K = one masked call (official)
            var.attn_split_from_scale = split
            plans.append(var(label_B, x_BLCv))
        prefix = var(label_B, x_BLCv[:, : var.scale_ends[2] - 1])  # first 3 scales only
    assert all((p - plans[-1]).abs().max() <= 1e-5 for p in plans)
    assert (prefix - plans[-1][:, : var.scale_ends[2]]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="scale boundary"):
        var(label_B, x_BLCv[:, :7])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_token_cross_entropy_equals_torch_cross_entropy(smoothing: float) -> None:
    """Value, gradient, unsmoothed CE and argmax of the fused loss against F.cross_entropy, with non-uniform weights
    (progressive training) and a non-unit incoming gradient (accumulation / loss scaling)."""
    gen = torch.Generator().manual_seed(0)
    logits_BLV = (torch.randn(3, 14, 50, generator=gen) * 3).requires_grad_(True)
    target_BL = torch.randint(0, 50, (3, 14), generator=gen)
    weight_L = torch.rand(14, generator=gen) / 14
    flat_logits, flat_target = logits_BLV.reshape(-1, 50), target_BL.reshape(-1)
    train_ce_BL = F.cross_entropy(flat_logits, flat_target, label_smoothing=smoothing, reduction="none").view(3, 14)
    ref = train_ce_BL.mul(weight_L).sum(-1).mean()
    (ref_grad,) = torch.autograd.grad(ref * 2.5, logits_BLV)
    out = token_cross_entropy(logits_BLV, target_BL, weight_L, smoothing)
    (grad,) = torch.autograd.grad(out.loss * 2.5, logits_BLV)
    assert abs(out.loss.item() - ref.item()) <= 1e-6
    assert (grad - ref_grad).abs().max() <= 1e-7
    plain_ce_BL = F.cross_entropy(flat_logits, flat_target, reduction="none").view(3, 14)
    assert (out.ce_BL - plain_ce_BL).abs().max() <= 1e-5 and not out.ce_BL.requires_grad
    assert torch.equal(out.prediction_BL, logits_BLV.argmax(dim=-1))


def test_fused_token_cross_entropy_refuses_a_second_backward() -> None:
    logits_BLV = torch.randn(2, 3, 5, requires_grad=True)
    out = token_cross_entropy(logits_BLV, torch.zeros(2, 3, dtype=torch.long), torch.full((3,), 1 / 3))
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        out.loss.backward()


def test_class_dropout_control() -> None:
    var = _debug_var()
    x_BLCv, label_B = torch.randn(2, var.seq_len - 1, var.cfg.vae_embed_dim), torch.tensor([3, 7])
    null_B = torch.full_like(label_B, var.num_classes)
    with torch.no_grad():
        var.eval()
        cond, uncond = var(label_B, x_BLCv), var(null_B, x_BLCv)
        assert not torch.allclose(cond, uncond)
        assert torch.equal(var(label_B, x_BLCv, cond_drop_rate=1.0), uncond)  # explicit rate applies in eval too
        var.train()
        var.cond_drop_rate = 1.0  # default in train mode: the attribute (official behaviour)
        var.blocks.apply(lambda m: setattr(m, "drop_prob", 0.0) if hasattr(m, "drop_prob") else None)
        assert torch.equal(var(label_B, x_BLCv), uncond)
        assert torch.equal(var(label_B, x_BLCv, cond_drop_rate=0.0), cond)


def test_training_forward_draws_the_official_random_numbers() -> None:
    """Class dropout (B uniforms), then per block the attention and FFN DropPath masks (B Bernoullis each, blocks
    with drop_prob > 0 only): the official order, so seeded training consumes the global RNG identically."""
    var = _debug_var(drop_path_rate=0.5).train()
    x_BLCv, label_B = torch.randn(4, var.seq_len - 1, var.cfg.vae_embed_dim), torch.tensor([1, 2, 3, 4])
    torch.manual_seed(11)
    var(label_B, x_BLCv)
    after_forward = torch.get_rng_state()
    torch.manual_seed(11)
    torch.rand(4)
    for block in var.blocks:
        assert isinstance(block, AdaLNSelfAttn)
        if block.drop_path.drop_prob > 0:
            torch.empty(4, 1, 1).bernoulli_(0.5)
            torch.empty(4, 1, 1).bernoulli_(0.5)
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_official_init_scheme() -> None:
    var = VAR(VARConfig.from_depth(4))
    C, std = 256, math.sqrt(1 / 256 / 3)
    block = var.blocks[1]
    assert isinstance(block, AdaLNSelfAttn)
    ada_lin = block.ada_lin[-1]
    assert isinstance(ada_lin, torch.nn.Linear)
    ada_W = ada_lin.weight
    assert ada_W[: 2 * C].std().item() == pytest.approx(std * 1e-5, rel=0.05)
    assert ada_W[2 * C :].std().item() == pytest.approx(std * 0.5, rel=0.05)
    assert block.attn.proj.weight.std().item() == pytest.approx(std / math.sqrt(8), rel=0.05)
    assert block.ffn.fc1.weight.std().item() == pytest.approx(std, rel=0.05)
    assert var.head.weight.std().item() == pytest.approx(std * 0.02, rel=0.05)
    assert var.pos_1LC.std().item() == pytest.approx(std, rel=0.05)
    assert torch.allclose(block.attn.scale_mul_1H11, torch.full((1, 4, 1, 1), math.log(4.0)))
    assert var.head.bias.abs().max() == 0 and block.attn.q_bias.abs().max() == 0
    drop = [b.drop_path.drop_prob for b in var.blocks if isinstance(b, AdaLNSelfAttn)]
    assert drop[0] == 0.0 and drop[-1] == pytest.approx(0.1 * 4 / 24)


def test_shared_adaln_layout_and_inference() -> None:
    var = _debug_var(shared_adaln=True)
    keys = list(var.state_dict())
    assert (
        "shared_ada_lin.1.weight" in keys
        and keys.index("shared_ada_lin.1.weight") == keys.index("lvl_embed.weight") + 1
    )
    assert next(k for k in keys if k.startswith("blocks.0.")) == "blocks.0.ada_gss"
    assert not any(k.startswith("blocks.0.ada_lin") for k in keys)
    cfg = infer_var_config(var.state_dict())
    assert cfg.shared_adaln and cfg.depth == 2 and cfg.patch_nums == (1, 2, 3, 4)
    x_BLCv = torch.randn(2, var.seq_len - 1, var.cfg.vae_embed_dim)
    with torch.no_grad():
        rebuilt = build_var(var.state_dict()).eval()
        assert torch.equal(rebuilt(torch.tensor([1, 2]), x_BLCv), var.eval()(torch.tensor([1, 2]), x_BLCv))


def test_infer_config_patch_nums_from_lvl() -> None:
    small512 = VAR(VARConfig(depth=1, embed_dim=64, num_heads=1, patch_nums=PATCH_NUMS_512, vocab_size=16))
    cfg = infer_var_config(small512.state_dict())
    assert cfg.patch_nums == PATCH_NUMS_512 and cfg.seq_len == 2240 and cfg.vocab_size == 16 and cfg.num_heads == 1
    assert infer_var_config(_debug_var().state_dict()).patch_nums == (1, 2, 3, 4)


# ----------------------------------------------------------------------------------------------- export / loading
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_export_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    var = _debug_var(shared_adaln=suffix == ".safetensors")
    (tmp_path / f"var{suffix}lbhcr48q.tmp").write_bytes(b"")  # what an export killed mid-write leaves
    path = export_official(var, tmp_path / f"var{suffix}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"var{suffix}"]
    if suffix == ".pth":  # a plain state_dict loadable with weights_only, like the released files
        raw = torch.load(path, map_location="cpu", weights_only=True)
        assert isinstance(raw, dict) and list(raw) == list(var.state_dict())
    loaded = read_state_dict(path, "VAR")
    ref = var.state_dict()
    assert sorted(loaded) == sorted(ref)  # safetensors stores keys sorted; .pth keeps the official order
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in ref.items())
    for skip_init in (False, True):  # plain construction, and meta-device construction adopting the tensors
        again = build_var(loaded, skip_init=skip_init).state_dict()
        assert all(torch.equal(again[k], v) and again[k].dtype == v.dtype for k, v in ref.items())


@pytest.fixture
def debug_pair(tmp_path: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    vae = export_official(VQVAE(VQVAEConfig.debug()), tmp_path / "vae.pth")
    var = export_official(_debug_var(), tmp_path / "var.pth")
    return vae, var


def test_load_official_debug_pair(debug_pair: tuple[Path, Path]) -> None:
    vae_path, var_path = debug_pair
    vqvae, var = load_official(vae_path, var_path)
    assert not var.training and not vqvae.training and var.cfg.patch_nums == vqvae.quantize.patch_nums
    assert all(not p.requires_grad for p in vqvae.parameters()) and all(p.requires_grad for p in var.parameters())
    half = {k: v.half() if v.is_floating_point() else v for k, v in torch.load(var_path, weights_only=True).items()}
    torch.save(half, var_path.with_name("half.pth"))  # half-precision files are accepted and cast to float32
    assert load_official(vae_path, var_path.with_name("half.pth"))[1].head.weight.dtype == torch.float32


def test_loader_errors(debug_pair: tuple[Path, Path], tmp_path: Path) -> None:
    vae_path, var_path = debug_pair
    with pytest.raises(UsageError, match=r"not a VAR checkpoint.*VQVAE checkpoint: pass it as --tokenizer-weights"):
        load_official(vae_path, vae_path)
    with pytest.raises(UsageError, match=r"not a VQVAE checkpoint.*VAR checkpoint: pass it as --var-weights"):
        load_official(var_path, var_path)
    with pytest.raises(UsageError, match="not found"):
        load_official(vae_path, tmp_path / "missing.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot read VAR checkpoint"):
        load_official(vae_path, tmp_path / "junk.pth")
    (tmp_path / "weights.bin").write_bytes(var_path.read_bytes())
    with pytest.raises(UsageError, match=r"\.pth, \.pt or \.safetensors"):
        load_official(vae_path, tmp_path / "weights.bin")
    state = torch.load(var_path, weights_only=True)
    state["blocks.1.ffn.fc2.weight"] = torch.zeros(64, 100)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(UsageError, match=r"bad\.pth: blocks\.1\.ffn\.fc2\.weight has shape \(64, 100\).*no known"):
        load_official(vae_path, tmp_path / "bad.pth")
    with pytest.raises(UsageError, match="match no known configuration"):
        load_official(vae_path, var_path, patch_nums=(1, 2, 4, 5))
    wide = VAR(VARConfig(**{**vars(VARConfig.debug()), "vae_embed_dim": 16}))
    export_official(wide, tmp_path / "wide.pth")
    with pytest.raises(UsageError, match="does not fit VAR") as excinfo:
        load_official(vae_path, tmp_path / "wide.pth")
    assert "\n" not in str(excinfo.value)


def test_trainlab_run_checkpoints_are_unwrapped(debug_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`ckpt/last.pt` of a tokenizer run (VQVAE + discriminator) and of a VAR run load as --tokenizer-weights /
    --var-weights (the command unwraps them through the engine's checkpoint reader)."""
    vae_path, var_path = debug_pair
    vae_sd, var_sd = torch.load(vae_path, weights_only=True), torch.load(var_path, weights_only=True)
    disc_sd = {"main.0.weight": torch.zeros(4, 3, 4, 4)}
    tok_run = {"format": "trainlab-checkpoint", "step": 3, "models": {"vqvae": vae_sd, "discriminator": disc_sd}}
    var_run = {"format": "trainlab-checkpoint", "step": 5, "models": {"var": var_sd}}
    torch.save(tok_run, tmp_path / "tok_last.pt")
    torch.save(var_run, tmp_path / "var_last.pt")
    vqvae, var = load_var_pair(tmp_path / "tok_last.pt", tmp_path / "var_last.pt")
    assert torch.equal(var.head.weight, var_sd["head.weight"])
    assert torch.equal(vqvae.quant_conv.weight, vae_sd["quant_conv.weight"])
    # a sharded run's checkpoint (--fsdp): the folder of shards, or its index file
    store = CheckpointStore(tmp_path / "sharded")
    folder = store.temp_folder(5)
    store.prepare_temp_folder(folder)
    tensors, index = sharded.split({**var_run, "version": 2})
    sharded.write(tensors, folder, None)
    final = store.commit_folder(folder, index, is_best=False)
    for given in (final, store.last):
        assert torch.equal(load_var_pair(tmp_path / "tok_last.pt", given)[1].head.weight, var_sd["head.weight"])
    with pytest.raises(UsageError, match="holding no model 'var' \\(models: discriminator, vqvae\\)"):
        load_var_pair(tmp_path / "tok_last.pt", tmp_path / "tok_last.pt")
    with pytest.raises(UsageError, match="not a plain state_dict"):  # the model loader alone reads official files
        load_official(tmp_path / "tok_last.pt", tmp_path / "var_last.pt")
