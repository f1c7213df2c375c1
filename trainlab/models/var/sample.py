"""Class-conditional sampling from VAR: scale-by-scale generation with a static KV cache, classifier-free guidance,
top-k / top-p filtering, and the tokenizer's residual f_hat accumulation.

Reproduces the official `autoregressive_infer_cfg` including its random stream: one `torch.Generator` on the
model's device seeded with `seed`, one multinomial draw per scale over the B * pn^2 rows (row order: batch, then
token), and, with `more_smooth`, the Gumbel noise drawn from the same generator after it. On a CPU model the
generator is a CPU generator and the tokens match the official CPU run for the same seed. On CUDA the generator is a
CUDA generator (Philox), so the tokens match the official code run on CUDA, not a CPU run with the same seed.

CPU fast path (same tokens): `torch.multinomial(p, 1)` is argmax(p / q) with q ~ Exp(1) drawn for all V entries
from the generator (q = -log1p(-u), u a float64 uniform). With top-k, only the k candidates can win, so top-p,
softmax and the argmax run on those k values, while the V uniforms per row are still drawn to keep the stream.

Editing (`trainlab.models.var.edit`) goes through the same loop: a `token_hook` may overwrite a scale's sampled
tokens right after the draw and before they are embedded, so the next scale's input, f_hat and the KV cache are all
built from the overwritten tokens. The hook draws nothing, so the random stream is the one of plain sampling.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainlab.errors import UsageError
from trainlab.models.var.transformer import VAR
from trainlab.models.var.vqvae import VQVAE

# Shape legend: B images, l = pn^2 tokens of one scale, N = B * l rows, V vocab, k top-k candidates, Cv code width,
# h/w latent side.

log = logging.getLogger(__name__)

LogitsHook = Callable[[int, torch.Tensor], None]
TokenHook = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`token_hook(si, idx_Bl) -> (idx_Bl, kept_Bl)`: scale si's sampled tokens (B, l) int64 -> the tokens to use and a
bool (B, l) map of the positions it wrote (those get their hard codebook embedding even with `more_smooth`)."""


@dataclass
class Samples:
    """Result of `generate`: per-scale tokens (B, pn^2) int64 and the accumulated f_hat (B, Cv, h, w)."""

    tokens: list[torch.Tensor]
    f_hat: torch.Tensor


def check_sampling_options(cfg: float, top_k: int, top_p: float) -> None:
    """Raise UsageError for a negative guidance scale, top_k < 0 or top_p outside (0, 1]."""
    if not cfg >= 0.0:
        raise UsageError(f"cfg (guidance scale) must be >= 0, got {cfg}")
    if top_k < 0:
        raise UsageError(f"top_k must be >= 0 (0 = no top-k filtering), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"top_p must be in (0, 1] (1 = no nucleus filtering), got {top_p}")


def check_sampling_args(var: VAR, vqvae: VQVAE, labels_B: torch.Tensor, cfg: float, top_k: int, top_p: float) -> None:
    """Raise UsageError for arguments the official code would silently misuse or crash on: class ids outside
    [0, num_classes], bad cfg / top_k / top_p, or a tokenizer that does not fit the transformer."""
    if labels_B.ndim != 1 or labels_B.numel() == 0:
        raise UsageError(f"labels must be a non-empty 1-D list of class ids, got shape {tuple(labels_B.shape)}")
    bad = labels_B[(labels_B < 0) | (labels_B > var.num_classes)]
    if bad.numel():
        raise UsageError(
            f"class id {int(bad[0])} is out of range: use 0..{var.num_classes - 1} ({var.num_classes} = unconditional)"
        )
    check_sampling_options(cfg, top_k, top_p)
    quant = vqvae.quantize
    if (tuple(quant.patch_nums), quant.vocab_size, quant.embed_dim) != (
        tuple(var.patch_nums),
        var.vocab_size,
        var.cfg.vae_embed_dim,
    ):
        raise UsageError(
            f"VQVAE (patch_nums={quant.patch_nums}, V={quant.vocab_size}, Cv={quant.embed_dim}) does not match VAR "
            f"(patch_nums={var.patch_nums}, V={var.vocab_size}, Cv={var.cfg.vae_embed_dim}): load a matching pair"
        )


def filter_top_k_top_p_(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The official filter, in place: logits below the k-th largest -> -inf (ties survive); then, ascending, drop the
    entries whose cumulative softmax probability is <= 1 - top_p (never the largest). Returns `logits_NV`."""
    V = logits_NV.shape[-1]
    if 0 < top_k < V:
        kth_N1 = logits_NV.topk(top_k, dim=-1, largest=True, sorted=False).values.amin(dim=-1, keepdim=True)
        logits_NV.masked_fill_(logits_NV < kth_N1, -torch.inf)
    if top_p < 1.0:
        sorted_NV, order_NV = logits_NV.sort(dim=-1, descending=False)
        remove_NV = sorted_NV.softmax(dim=-1).cumsum_(dim=-1) <= (1.0 - top_p)
        remove_NV[..., -1:] = False
        logits_NV.masked_fill_(remove_NV.scatter(-1, order_NV, remove_NV), -torch.inf)
    return logits_NV


@functools.cache
def cpu_multinomial_is_exponential_argmax() -> bool:
    """Whether this torch's CPU `multinomial(p, 1, replacement=True, generator=g)` equals argmax(p / q) with
    q = float32(-log1p(-u)), u = `torch.rand(float64, generator=g)` over every entry, leaving `g` in the same state
    (true for torch 2.x; checked once so that a torch with another RNG layout falls back to `torch.multinomial`)."""
    probs_NV = torch.rand(64, 1000, generator=torch.Generator().manual_seed(1)).pow_(8)
    expected_N1 = torch.multinomial(probs_NV, 1, replacement=True, generator=(g1 := torch.Generator().manual_seed(7)))
    u_NV = torch.rand(probs_NV.shape, dtype=torch.float64, generator=(g2 := torch.Generator().manual_seed(7)))
    got_N1 = probs_NV.div(u_NV.neg().log1p_().neg_().float()).argmax(dim=-1, keepdim=True)
    ok = torch.equal(expected_N1, got_N1) and torch.equal(g1.get_state(), g2.get_state())
    if not ok:
        log.warning("torch.multinomial does not match its exponential-argmax form here; sampling uses the slow path")
    return ok


def _sample_top_k_candidates(
    logits_NV: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """The draw of `filter_top_k_top_p_` + `torch.multinomial` (CPU), computed on the k candidates of each row.

    Rows whose result depends on how ties are ordered take the full-V computation (the official `sort`): a tie
    between the k-th and (k+1)-th largest logits (more than k entries survive top-k), or equal logits on both sides
    of the top-p cut. Either way the N x V uniforms of the multinomial are drawn once, in row order.
    """
    N, V = logits_NV.shape
    vals_Nk, idx_Nk = logits_NV.topk(top_k + 1, dim=-1, largest=True, sorted=True)
    full_rows_N = vals_Nk[:, top_k] == vals_Nk[:, top_k - 1]
    asc_Nk, idx_Nk = vals_Nk[:, :top_k].flip(-1), idx_Nk[:, :top_k].flip(-1)
    if top_p < 1.0:
        remove_Nk = asc_Nk.softmax(dim=-1).cumsum_(dim=-1) <= (1.0 - top_p)
        remove_Nk[:, -1] = False
        straddle_Nk = (asc_Nk[:, 1:] == asc_Nk[:, :-1]) & (remove_Nk[:, 1:] != remove_Nk[:, :-1])
        full_rows_N |= straddle_Nk.any(dim=-1)
        asc_Nk = asc_Nk.masked_fill_(remove_Nk, -torch.inf)
    probs_Nk = asc_Nk.softmax(dim=-1)
    u_NV = torch.rand(N, V, dtype=torch.float64, generator=generator)
    q_Nk = u_NV.gather(1, idx_Nk).neg_().log1p_().neg_().to(probs_Nk.dtype)
    idx_N1 = idx_Nk.gather(1, probs_Nk.div_(q_Nk).argmax(dim=-1, keepdim=True))
    if bool(full_rows_N.any()):
        rows = full_rows_N.nonzero().squeeze(1)
        probs_rV = filter_top_k_top_p_(logits_NV[rows].clone(), top_k, top_p).softmax(dim=-1)
        q_rV = u_NV[rows].neg_().log1p_().neg_().to(probs_rV.dtype)
        idx_N1[rows] = probs_rV.div_(q_rV).argmax(dim=-1, keepdim=True)
    return idx_N1


def sample_scale(
    logits_BlV: torch.Tensor, generator: torch.Generator, *, top_k: int, top_p: float, keep_filtered: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row from filtered logits with exactly one multinomial draw over B * l rows.

    Returns:
        (tokens (B, l) int64, the filtered logits (B, l, V) when `keep_filtered` else None).
    """
    B, l, V = logits_BlV.shape
    logits_NV = logits_BlV.reshape(B * l, V)
    if (
        not keep_filtered
        and 0 < top_k < V
        and logits_NV.device.type == "cpu"
        and cpu_multinomial_is_exponential_argmax()
    ):
        return _sample_top_k_candidates(logits_NV, top_k, top_p, generator).view(B, l), None
    filtered_NV = filter_top_k_top_p_(logits_NV.clone(), top_k, top_p)
    idx_N1 = torch.multinomial(filtered_NV.softmax(dim=-1), num_samples=1, replacement=True, generator=generator)
    return idx_N1.view(B, l), filtered_NV.view(B, l, V) if keep_filtered else None


def _smooth_embeddings(
    filtered_BlV: torch.Tensor, ratio: float, codebook_VC: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """`more_smooth`: Gumbel-softmax (tau = max(0.27 (1 - 0.95 ratio), 0.005)) of the filtered logits * (1 + ratio),
    noise -log(Exp(1)) from the generator, mixed over the codebook -> (B, l, Cv)."""
    tau = max(0.27 * (1 - ratio * 0.95), 0.005)
    gumbels_BlV = -torch.empty_like(filtered_BlV).exponential_(generator=generator).log()
    soft_BlV = ((filtered_BlV.mul(1 + ratio) + gumbels_BlV) / tau).softmax(dim=-1)
    return soft_BlV @ codebook_VC.unsqueeze(0)


@torch.inference_mode()
def generate(
    var: VAR,
    vqvae: VQVAE,
    labels_B: torch.Tensor | Sequence[int],
    *,
    seed: int,
    cfg: float = 1.5,
    top_k: int = 900,
    top_p: float = 0.96,
    more_smooth: bool = False,
    logits_hook: LogitsHook | None = None,
    token_hook: TokenHook | None = None,
) -> Samples:
    """Generate tokens and the accumulated f_hat for a batch of class labels (see `sample_tokens` for the args).

    `logits_hook(si, logits_BlV)` sees each scale's guided logits before filtering. `token_hook` (see `TokenHook`)
    may overwrite scale si's tokens after they are drawn and before they are embedded for the next scale; without
    it, or with a hook that writes nothing, the result is that of plain sampling, bit for bit.
    """
    device = var.pos_start.device
    labels_B = torch.as_tensor(labels_B, dtype=torch.int64).to(device)
    check_sampling_args(var, vqvae, labels_B, cfg, top_k, top_p)
    quant = vqvae.quantize
    B, K, Cv, side = labels_B.shape[0], len(var.patch_nums), quant.embed_dim, var.patch_nums[-1]
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    was_training = var.training
    var.eval()  # no DropPath while sampling
    var.enable_kv_cache()
    try:
        lvl_pos_1LC = var.lvl_pos()
        cond_BD = var.class_emb(torch.cat((labels_B, torch.full_like(labels_B, var.num_classes))))
        x_BlC = var.first_tokens(cond_BD, lvl_pos_1LC)
        f_hat_BChw = cond_BD.new_zeros(B, Cv, side, side)
        tokens: list[torch.Tensor] = []
        for si, pn in enumerate(var.patch_nums):
            ratio = si / (K - 1) if K > 1 else 0.0
            h_BlC = var.forward_cached(x_BlC, cond_BD)
            logits_BlV = var.guided_logits(h_BlC, cond_BD, cfg * ratio)
            if not bool(torch.isfinite(logits_BlV).all()):  # NaN would reach the draw: stop with the cause instead
                raise UsageError(_non_finite_logits(var, h_BlC, cond_BD, cfg, ratio, si))
            if logits_hook is not None:
                logits_hook(si, logits_BlV)
            idx_Bl, filtered_BlV = sample_scale(
                logits_BlV, generator, top_k=top_k, top_p=top_p, keep_filtered=more_smooth
            )
            kept_Bl = None
            if token_hook is not None:
                idx_Bl, kept_Bl = token_hook(si, idx_Bl)
            tokens.append(idx_Bl)
            if filtered_BlV is None:
                h_BlC = quant.embedding(idx_Bl)
            else:
                h_BlC = _smooth_embeddings(filtered_BlV, ratio, quant.embedding.weight, generator)
                if kept_Bl is not None:  # written positions are ground truth: their hard code, not a soft mix
                    h_BlC = torch.where(kept_Bl.unsqueeze(-1), quant.embedding(idx_Bl), h_BlC)
            h_BChw = h_BlC.transpose(1, 2).reshape(B, Cv, pn, pn)
            f_hat_BChw, next_BChw = quant.next_autoregressive_input(si, f_hat_BChw, h_BChw)
            if next_BChw is not None:
                next_BlC = next_BChw.reshape(B, Cv, -1).transpose(1, 2)
                x_BlC = var.next_tokens(si + 1, next_BlC, lvl_pos_1LC).repeat(2, 1, 1)
    finally:
        var.disable_kv_cache()
        var.train(was_training)
    if not bool(torch.isfinite(f_hat_BChw).all()):
        raise UsageError(
            "the sampled image features hold NaN or inf (the tokenizer's codebook or phi convolutions compute "
            "non-finite values): check the VQVAE weights"
        )
    return Samples(tokens=tokens, f_hat=f_hat_BChw)


def _non_finite_logits(var: VAR, h_BlC: torch.Tensor, cond_BD: torch.Tensor, cfg: float, ratio: float, si: int) -> str:
    """Why scale si's guided logits are not finite: the guidance mix overflowed (each half is finite on its own), or
    the model itself computes NaN / inf (damaged weights)."""
    where = f"at scale {si + 1} of {len(var.patch_nums)}"
    unguided_BlV = var.head(var.head_nm(h_BlC.float(), cond_BD).float())  # conditional and unconditional rows
    if bool(torch.isfinite(unguided_BlV).all()):
        return (
            f"classifier-free guidance {cfg:g} makes the logits overflow {where} (t = {cfg * ratio:g}; the conditional "
            "and unconditional logits are finite on their own): lower the guidance scale (cfg)"
        )
    return f"the model computes NaN or inf logits {where} (damaged or diverged weights): check the VAR weights"


def sample_tokens(
    var: VAR,
    vqvae: VQVAE,
    labels_B: torch.Tensor | Sequence[int],
    *,
    seed: int,
    cfg: float = 1.5,
    top_k: int = 900,
    top_p: float = 0.96,
    more_smooth: bool = False,
) -> list[torch.Tensor]:
    """Sample token maps for the given class labels, reproducing the official sampler and its random stream.

    Args:
        var: the transformer (its device is where everything runs; it is put in eval mode while sampling).
        vqvae: the matching tokenizer (its quantizer's codebook and phi convs build the next scale's input).
        labels_B: class ids in [0, num_classes]; num_classes means unconditional.
        seed: seeds a fresh `torch.Generator` on the model's device.
        cfg: guidance scale; scale si uses t = cfg * si / (K-1) and (1 + t) * cond - t * uncond on logits.
        top_k: keep the k largest logits (0: all).
        top_p: nucleus mass in (0, 1] (1: no nucleus filtering, the official top_p=0).
        more_smooth: Gumbel-softmax code mixing (visualisation only; not for FID).

    Returns:
        one int64 tensor (B, pn^2) per scale, row-major.

    Raises:
        UsageError: class ids out of range, cfg < 0, top_p outside (0, 1], top_k < 0, or a mismatched VQVAE.
    """
    return generate(var, vqvae, labels_B, seed=seed, cfg=cfg, top_k=top_k, top_p=top_p, more_smooth=more_smooth).tokens


def sample_images(
    var: VAR,
    vqvae: VQVAE,
    labels_B: torch.Tensor | Sequence[int],
    *,
    seed: int,
    cfg: float = 1.5,
    top_k: int = 900,
    top_p: float = 0.96,
    more_smooth: bool = False,
) -> torch.Tensor:
    """Like `sample_tokens`, then decode the accumulated f_hat: images (B, 3, H, W) float32 in [0, 1]."""
    samples = generate(var, vqvae, labels_B, seed=seed, cfg=cfg, top_k=top_k, top_p=top_p, more_smooth=more_smooth)
    with torch.inference_mode():
        return vqvae.fhat_to_img(samples.f_hat).add_(1.0).mul_(0.5)
