"""Building blocks of the VAR transformer: AdaLN-conditioned self-attention blocks, the AdaLN head norm, DropPath,
and the static key/value cache used for scale-by-scale inference.

Parameter and buffer names follow the official checkpoints (`attn.mat_qkv`, `attn.q_bias`, `attn.zero_k_bias`,
`attn.scale_mul_1H11`, `ffn.fc1`, `ada_lin.1`, `ada_gss`, ...), so official state_dicts load with strict matching.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Shape legend: B batch, L tokens in this call, S tokens in the KV cache, C width (embed_dim), D condition width,
# H heads, K head dim (C / H), l a query segment's tokens, e a segment's key count.

# The learnable attention temperature exp(scale_mul_1H11) is capped at 100 (ln 100 rounded via float32, as officially).
MAX_LOG_SCALE_MUL = float(torch.tensor(100.0).log())


@dataclass(frozen=True)
class AttnSegment:
    """Queries [q_start, q_end) attend to keys [0, k_end), with an additive mask (l, e) or none (all visible).
    A list of segments partitions the sequence in order."""

    q_start: int
    q_end: int
    k_end: int
    bias_le: torch.Tensor | None


class DropPath(nn.Module):
    """Stochastic depth: in training, drop a sample's residual branch with probability `drop_prob` (kept branches are
    scaled by 1 / keep). `keep_factor` gives the per-sample factor so a block can fold it into its gamma."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def keep_factor(self, x_BLC: torch.Tensor) -> torch.Tensor | None:
        """(B, 1, 1) factors 0 or 1/keep drawn from the global RNG, or None when nothing is dropped (eval / p=0)."""
        if not self.training or self.drop_prob == 0.0:
            return None
        keep = 1.0 - self.drop_prob
        keep_B11 = x_BLC.new_empty(x_BLC.shape[0], 1, 1).bernoulli_(keep)
        return keep_B11.div_(keep) if keep > 0.0 else keep_B11

    def forward(self, x_BLC: torch.Tensor) -> torch.Tensor:
        keep_B11 = self.keep_factor(x_BLC)
        return x_BLC if keep_B11 is None else x_BLC * keep_B11

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.4f}"


class StaticKVCache:
    """Preallocated keys/values of one attention layer, filled scale by scale (no concatenation).

    The storage (B, H, max_len, K) is allocated on the first `append`, with the dtype/device of the keys it receives
    (so it follows autocast), and written in place afterwards.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k_BHSK: torch.Tensor | None = None
        self.v_BHSK: torch.Tensor | None = None

    def append(self, k_BHLK: torch.Tensor, v_BHLK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values after the cached ones; return views of everything cached so far."""
        B, H, L, K = k_BHLK.shape
        if self.k_BHSK is None or self.v_BHSK is None:
            self.k_BHSK = k_BHLK.new_empty(B, H, self.max_len, K)
            self.v_BHSK = v_BHLK.new_empty(B, H, self.max_len, K)
        end = self.length + L
        if end > self.max_len or self.k_BHSK.shape[0] != B or self.k_BHSK.dtype != k_BHLK.dtype:
            raise RuntimeError(
                f"KV cache overflow or mismatch: {self.length}+{L} tokens of batch {B} ({k_BHLK.dtype}) into "
                f"{tuple(self.k_BHSK.shape)} ({self.k_BHSK.dtype}); re-enable the cache before a new sequence"
            )
        self.k_BHSK[:, :, self.length : end].copy_(k_BHLK)
        self.v_BHSK[:, :, self.length : end].copy_(v_BHLK)
        self.length = end
        return self.k_BHSK[:, :, :end], self.v_BHSK[:, :, :end]


class SelfAttention(nn.Module):
    """Multi-head self-attention with fused qkv, bias only on q and v, and (default) cosine attention: q and k are
    L2-normalised per head and q is scaled by the learnable exp(min(scale_mul_1H11, ln 100)), softmax scale 1.

    Args:
        embed_dim: C.
        num_heads: H; the head dim is C / H.
        attn_l2_norm: cosine attention (the released models); otherwise scale 0.25 / sqrt(K).
    """

    def __init__(self, embed_dim: int, num_heads: int, attn_l2_norm: bool = True) -> None:
        super().__init__()
        assert embed_dim % num_heads == 0
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.attn_l2_norm = attn_l2_norm
        # Registration order gives the official key order: scale_mul_1H11, q_bias, v_bias, zero_k_bias, mat_qkv, proj.
        if attn_l2_norm:
            self.scale = 1.0
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), 4.0).log())
        else:
            self.scale = 0.25 / math.sqrt(self.head_dim)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.zero_k_bias: torch.Tensor
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.mat_qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.kv_cache: StaticKVCache | None = None

    def forward(self, x_BLC: torch.Tensor, segments: Sequence[AttnSegment] | None = None) -> torch.Tensor:
        """Attention over `x_BLC`; with `segments`, block-structured (teacher forcing); without, every query sees every
        key (one scale of inference, plus whatever the KV cache holds)."""
        B, L, C = x_BLC.shape
        qkv_bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv_BL3HK = F.linear(x_BLC, self.mat_qkv.weight, qkv_bias).view(B, L, 3, self.num_heads, self.head_dim)
        q_BLHK, k_BLHK, v_BLHK = qkv_BL3HK.unbind(2)
        if self.attn_l2_norm:  # F.normalize(q) * exp(min(s, ln 100)) with the head scale folded into q's divisor
            scale_H1 = self.scale_mul_1H11.clamp_max(MAX_LOG_SCALE_MUL).exp().view(self.num_heads, 1)
            q_BLHK = q_BLHK * (scale_H1 / q_BLHK.norm(dim=-1, keepdim=True).clamp_min(1e-12))
            k_BLHK = k_BLHK / k_BLHK.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        q_BHLK, k_BHLK, v_BHLK = q_BLHK.transpose(1, 2), k_BLHK.transpose(1, 2), v_BLHK.transpose(1, 2)
        if self.kv_cache is not None:
            k_BHLK, v_BHLK = self.kv_cache.append(k_BHLK, v_BHLK)
        if segments is None:
            out_BLHK = F.scaled_dot_product_attention(q_BHLK, k_BHLK, v_BHLK, scale=self.scale).transpose(1, 2)
        else:
            # Segments partition the queries in order: split (its backward is one concatenation) rather than slice,
            # and only slice keys/values that are a strict prefix (a slice's backward zero-fills a full-size grad).
            q_parts = q_BHLK.split([seg.q_end - seg.q_start for seg in segments], dim=2)
            outs_BlHK = [
                F.scaled_dot_product_attention(
                    q_BHlK,
                    k_BHLK if seg.k_end == L else k_BHLK[:, :, : seg.k_end],
                    v_BHLK if seg.k_end == L else v_BHLK[:, :, : seg.k_end],
                    attn_mask=None if seg.bias_le is None else seg.bias_le.to(q_BHLK.dtype),
                    scale=self.scale,
                ).transpose(1, 2)  # SDPA returns (B, l, H, K) memory: concatenating along l needs no transpose copy
                for q_BHlK, seg in zip(q_parts, segments)
            ]
            out_BLHK = outs_BlHK[0] if len(outs_BlHK) == 1 else torch.cat(outs_BlHK, dim=1)
        return self.proj(out_BLHK.reshape(B, L, C))


class FeedForward(nn.Module):
    """fc1 (C -> hidden) -> GELU (tanh approximation) -> fc2 (hidden -> C)."""

    def __init__(self, embed_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, embed_dim)

    def forward(self, x_BLC: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x_BLC), approximate="tanh"))


class AdaLNSelfAttn(nn.Module):
    """Transformer block with adaptive LayerNorm (no affine parameters) conditioned on the class embedding.

    x = x + drop_path(attn(LN(x) * (1 + scale1) + shift1) * gamma1)
    x = x + drop_path(ffn(LN(x) * (1 + scale2) + shift2) * gamma2)
    The six modulation vectors come, in the order gamma1, gamma2, scale1, scale2, shift1, shift2, from the block's own
    `ada_lin` (SiLU, Linear(D, 6C)) or, with `shared_adaln`, from the model's shared projection plus `ada_gss`.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        cond_dim: int,
        num_heads: int,
        mlp_ratio: float,
        drop_path: float,
        norm_eps: float,
        shared_adaln: bool,
        attn_l2_norm: bool,
    ) -> None:
        super().__init__()
        C = embed_dim
        self.embed_dim, self.norm_eps, self.shared_adaln = C, norm_eps, shared_adaln
        if shared_adaln:  # first key of the block in official checkpoints
            self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, C) / math.sqrt(C))
        self.drop_path = DropPath(drop_path)
        self.attn = SelfAttention(C, num_heads, attn_l2_norm)
        self.ffn = FeedForward(C, round(C * mlp_ratio))
        if not shared_adaln:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 6 * C))

    def forward(
        self, x_BLC: torch.Tensor, cond_BD: torch.Tensor, segments: Sequence[AttnSegment] | None = None
    ) -> torch.Tensor:
        """`cond_BD` is the class embedding (B, D), or with shared AdaLN the shared projection viewed (B, 1, 6, C)."""
        C = self.embed_dim
        mod_B16C = self.ada_gss + cond_BD if self.shared_adaln else self.ada_lin(cond_BD).view(-1, 1, 6, C)
        gamma1_B1C, gamma2_B1C, scale1_B1C, scale2_B1C, shift1_B1C, shift2_B1C = mod_B16C.unbind(2)
        # DropPath scales a whole branch per sample: fold its factor into gamma (same RNG draws, in the same order).
        keep_B11 = self.drop_path.keep_factor(x_BLC)
        if keep_B11 is not None:
            gamma1_B1C = gamma1_B1C * keep_B11
        h_BLC = torch.addcmul(shift1_B1C, F.layer_norm(x_BLC, (C,), eps=self.norm_eps), scale1_B1C + 1.0)
        x_BLC = torch.addcmul(x_BLC, self.attn(h_BLC, segments), gamma1_B1C)
        keep_B11 = self.drop_path.keep_factor(x_BLC)
        if keep_B11 is not None:
            gamma2_B1C = gamma2_B1C * keep_B11
        h_BLC = torch.addcmul(shift2_B1C, F.layer_norm(x_BLC, (C,), eps=self.norm_eps), scale2_B1C + 1.0)
        return torch.addcmul(x_BLC, self.ffn(h_BLC), gamma2_B1C)


class AdaLNBeforeHead(nn.Module):
    """Final adaptive LayerNorm: LN(x) * (1 + scale) + shift with (scale, shift) = ada_lin(cond) (SiLU, Linear)."""

    def __init__(self, embed_dim: int, cond_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.embed_dim, self.norm_eps = embed_dim, norm_eps
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(cond_dim, 2 * embed_dim))

    def forward(self, x_BLC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        scale_B1C, shift_B1C = self.ada_lin(cond_BD).view(-1, 1, 2, self.embed_dim).unbind(2)
        return torch.addcmul(shift_B1C, F.layer_norm(x_BLC, (self.embed_dim,), eps=self.norm_eps), scale_B1C + 1.0)
