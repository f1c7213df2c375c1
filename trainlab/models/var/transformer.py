"""VAR: visual autoregressive modeling by next-scale prediction (Tian et al., 2024), the class-conditional transformer.

The model predicts all tokens of scale k at once from the class token and the tokenizer's accumulated f_hat of
scales < k (block-causal attention, AdaLN conditioned on the class embedding). It is numerically the official
FoundationVision/VAR model and loads the released `var_d16.pth` ... `var_d36.pth` state_dicts with strict key
matching (see `convert`). Sampling lives in `sample`; this file holds only the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainlab.dtypes import at_least_float32
from trainlab.errors import UsageError
from trainlab.models.var.blocks import AdaLNBeforeHead, AdaLNSelfAttn, AttnSegment, StaticKVCache
from trainlab.models.var.scales import scale_ends, scale_of_position, sequence_length

# Shape legend: B batch, L tokens (all scales, sum of pn^2), l tokens of one scale, C width (embed_dim), D condition
# width (= C), Cv tokenizer code width (vae_embed_dim), V vocab size, K number of scales.

PATCH_NUMS_256: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
PATCH_NUMS_512: tuple[int, ...] = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)


@dataclass(kw_only=True)
class VARConfig:
    """Architecture of the VAR transformer. Defaults follow the official `build_vae_var` for a given depth.

    Attributes:
        depth: number of transformer blocks.
        embed_dim: width C; -1 means 64 * depth (head dim 64).
        num_heads: -1 means depth.
        mlp_ratio: FFN hidden width / C.
        drop_path_rate: stochastic depth of the last block (linear from 0 at block 0); -1 means 0.1 * depth / 24.
        norm_eps: LayerNorm epsilon.
        shared_adaln: one AdaLN projection shared by all blocks plus per-block `ada_gss` (the 512 px d36 model).
        attn_l2_norm: cosine attention with a learnable per-head temperature (all released models).
        cond_drop_rate: probability of replacing the class label by the null class in training forwards.
        num_classes: number of classes; the class embedding has one more row (the null / unconditional class).
        patch_nums: token-map sides, coarse to fine.
        vocab_size: tokenizer codebook size V.
        vae_embed_dim: tokenizer code width Cv.
    """

    depth: int
    embed_dim: int = -1
    num_heads: int = -1
    mlp_ratio: float = 4.0
    drop_path_rate: float = -1.0
    norm_eps: float = 1e-6
    shared_adaln: bool = False
    attn_l2_norm: bool = True
    cond_drop_rate: float = 0.1
    num_classes: int = 1000
    patch_nums: tuple[int, ...] = PATCH_NUMS_256
    vocab_size: int = 4096
    vae_embed_dim: int = 32

    def __post_init__(self) -> None:
        if self.embed_dim == -1:
            self.embed_dim = 64 * self.depth
        if self.num_heads == -1:
            self.num_heads = self.depth
        if self.drop_path_rate == -1.0:
            self.drop_path_rate = 0.1 * self.depth / 24
        self.patch_nums = tuple(int(pn) for pn in self.patch_nums)
        if self.depth < 1 or self.num_heads < 1 or self.embed_dim % self.num_heads != 0:
            raise UsageError(
                f"VAR needs depth >= 1 and embed_dim divisible by num_heads, got depth={self.depth}, "
                f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
            )
        if not self.patch_nums or list(self.patch_nums) != sorted(set(self.patch_nums)) or self.patch_nums[0] < 1:
            raise UsageError(f"patch_nums must be strictly increasing positive sides, got {self.patch_nums}")
        if self.num_classes < 1 or self.vocab_size < 1 or self.vae_embed_dim < 1:
            raise UsageError("num_classes, vocab_size and vae_embed_dim must be >= 1")

    @property
    def seq_len(self) -> int:
        """L = sum of pn^2 over scales (680 for the 256 px set, 2240 for 512 px)."""
        return sequence_length(self.patch_nums)

    @classmethod
    def from_depth(cls, depth: int, **overrides: object) -> VARConfig:
        """The official architecture of a given depth (16, 20, 24, 30 at 256 px; 36 with `shared_adaln=True` and
        `patch_nums=PATCH_NUMS_512`); keyword overrides replace any field."""
        return cls(depth=depth, **overrides)  # type: ignore[arg-type]

    @classmethod
    def debug(cls) -> VARConfig:
        """A tiny model for CPU tests, matching `VQVAEConfig.debug()` (V=64, Cv=8, patch_nums 1,2,3,4)."""
        return cls(depth=2, embed_dim=64, num_heads=2, patch_nums=(1, 2, 3, 4), vocab_size=64, vae_embed_dim=8)


class VAR(nn.Module):
    """Class-conditional next-scale-prediction transformer.

    Class dropout: in training mode `forward` replaces each label by the null class with probability
    `cond_drop_rate` (attribute, from the config), drawing B uniforms from the global RNG of the label's device like
    the official code. Pass `cond_drop_rate=` to `forward` to override it for one call (0.0 turns it off; a value > 0
    also applies in eval mode). Deviation: the official model applies class dropout in eval mode too, so its
    validation loss sees ~10 % null labels; reproduce that with `forward(..., cond_drop_rate=0.1)` in eval mode.

    Args:
        cfg: the architecture.
    """

    # Buffers that hold -inf by design: the block-causal mask (0 where a query may attend, -inf elsewhere). A
    # training checkpoint refuses NaN / inf in every other floating tensor (trainlab.engine.checkpoint).
    non_finite_buffers: ClassVar[tuple[str, ...]] = ("attn_bias_for_masking",)

    def __init__(self, cfg: VARConfig) -> None:
        super().__init__()
        self.cfg = cfg
        C, K = cfg.embed_dim, len(cfg.patch_nums)
        self.num_classes, self.vocab_size, self.embed_dim = cfg.num_classes, cfg.vocab_size, C
        self.patch_nums = cfg.patch_nums
        self.first_l = cfg.patch_nums[0] ** 2
        self.seq_len = L = cfg.seq_len
        self.cond_drop_rate = cfg.cond_drop_rate
        self.scale_ends: tuple[int, ...] = tuple(scale_ends(cfg.patch_nums))
        # Teacher forcing: scales < this index share one attention call with the block-causal mask; each later scale
        # is its own call without a mask (its queries see every key up to the scale's end). Any value gives the same
        # result (the official code is K: one masked L x L call). K-1 computes 354k instead of 462k scores for the
        # 256 px set (the last scale's queries need no mask, the others skip its keys) and keeps two large calls,
        # which parallelise better on CPU than one small call per scale.
        self.attn_split_from_scale = max(K - 1, 1)

        # Registration order reproduces the official state_dict order.
        init_std = math.sqrt(1 / C / 3)
        self.pos_start = nn.Parameter(torch.empty(1, self.first_l, C))
        self.pos_1LC = nn.Parameter(torch.empty(1, L, C))
        nn.init.trunc_normal_(self.pos_start, std=init_std)
        nn.init.trunc_normal_(self.pos_1LC, std=init_std)
        # Constant buffers: computed on the CPU, then placed like the parameters (honours a `torch.device` context;
        # under "meta", used to load without init, computing them there would need torch's meta decompositions).
        lvl_L = torch.tensor(scale_of_position(cfg.patch_nums), dtype=torch.int64, device="cpu")
        visible_LL = lvl_L.view(L, 1) >= lvl_L.view(1, L)  # key scale <= query scale
        bias_11LL = torch.zeros(L, L, device="cpu").masked_fill_(~visible_LL, -math.inf).view(1, 1, L, L)
        device = self.pos_1LC.device
        self.lvl_1L: torch.Tensor
        self.attn_bias_for_masking: torch.Tensor
        self.register_buffer("lvl_1L", lvl_L.view(1, L).to(device))
        self.register_buffer("attn_bias_for_masking", bias_11LL.to(device))
        self.word_embed = nn.Linear(cfg.vae_embed_dim, C)
        self.class_emb = nn.Embedding(cfg.num_classes + 1, C)
        self.lvl_embed = nn.Embedding(K, C)
        if cfg.shared_adaln:
            self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        drop_rates = torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu").tolist()
        self.grad_checkpointing = False  # see `set_grad_checkpointing`
        self.blocks = nn.ModuleList(
            AdaLNSelfAttn(
                embed_dim=C,
                cond_dim=C,
                num_heads=cfg.num_heads,
                mlp_ratio=cfg.mlp_ratio,
                drop_path=drop_rates[i],
                norm_eps=cfg.norm_eps,
                shared_adaln=cfg.shared_adaln,
                attn_l2_norm=cfg.attn_l2_norm,
            )
            for i in range(cfg.depth)
        )
        self.head_nm = AdaLNBeforeHead(C, C, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)
        self.init_weights()

    def shard_units(self) -> list[nn.Module]:
        """The blocks `--fsdp` shards one by one (`TrainParts.shard_units`): the transformer blocks."""
        return list(self.blocks)

    # --------------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(
        self, init_adaln: float = 0.5, init_adaln_gamma: float = 1e-5, init_head: float = 0.02, init_std: float = -1.0
    ) -> None:
        """The official initialisation (pos_start / pos_1LC are drawn in the constructor with the same std).

        Args:
            init_adaln: factor on the AdaLN scale/shift rows (blocks and head norm).
            init_adaln_gamma: factor on the AdaLN gamma rows (README runs: 1e-3 d16/d20, 1e-4 d24, 1e-5 d30).
            init_head: factor on the head weight.
            init_std: std of every Linear / Embedding weight (truncated normal); < 0 means sqrt(1 / (3C)).
        """
        C = self.embed_dim
        std = math.sqrt(1 / C / 3) if init_std < 0 else init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                nn.init.trunc_normal_(m.weight, std=std)
        self.head.weight.mul_(init_head)
        self.head.bias.zero_()
        head_ada = self.head_nm.ada_lin[-1]
        assert isinstance(head_ada, nn.Linear)
        head_ada.weight.mul_(init_adaln)
        head_ada.bias.zero_()
        depth = len(self.blocks)
        for block in self.blocks:
            assert isinstance(block, AdaLNSelfAttn)
            block.attn.proj.weight.div_(math.sqrt(2 * depth))
            block.ffn.fc2.weight.div_(math.sqrt(2 * depth))
            if block.shared_adaln:
                block.ada_gss[:, :, 2:].mul_(init_adaln)
                block.ada_gss[:, :, :2].mul_(init_adaln_gamma)
            else:
                lin = block.ada_lin[-1]
                assert isinstance(lin, nn.Linear)
                lin.weight[2 * C :].mul_(init_adaln)
                lin.weight[: 2 * C].mul_(init_adaln_gamma)
                lin.bias.zero_()

    # ------------------------------------------------------------------------------------------ conditioning
    def drop_labels(self, label_B: torch.Tensor, rate: float) -> torch.Tensor:
        """Replace each label by the null class (`num_classes`) with probability `rate` (global RNG, label's device)."""
        if rate <= 0.0:
            return label_B
        drop_B = torch.rand(label_B.shape[0], device=label_B.device) < rate
        return torch.where(drop_B, self.num_classes, label_B)

    def condition(self, cond_BD: torch.Tensor) -> torch.Tensor:
        """What the blocks receive: the class embedding, or with shared AdaLN its shared projection (B, 1, 6, C)."""
        if self.cfg.shared_adaln:
            return self.shared_ada_lin(cond_BD).view(-1, 1, 6, self.embed_dim)
        return cond_BD

    def logits(self, h_BLC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        """Head: AdaLN (on the raw class embedding) + Linear, float32 logits (B, L, V) (float64 in an fp64 run)."""
        return at_least_float32(self.head(at_least_float32(self.head_nm(at_least_float32(h_BLC), cond_BD))))

    def _segments(self, end: int) -> list[AttnSegment]:
        """Block-structured attention plan for the first `end` tokens (a scale boundary)."""
        num_scales = self.scale_ends.index(end) + 1
        split = min(self.attn_split_from_scale, num_scales)
        segments = []
        if split > 0:
            first_end = self.scale_ends[split - 1]
            bias_ll = self.attn_bias_for_masking[0, 0, :first_end, :first_end] if split > 1 else None
            segments.append(AttnSegment(0, first_end, first_end, bias_ll))
        for si in range(split, num_scales):
            segments.append(AttnSegment(self.scale_ends[si - 1], self.scale_ends[si], self.scale_ends[si], None))
        return segments

    # ------------------------------------------------------------------------------------------ teacher forcing
    def forward(
        self,
        label_B: torch.Tensor,
        x_BLCv_wo_first_l: torch.Tensor,
        *,
        cond_drop_rate: float | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Teacher-forcing forward.

        Args:
            label_B: class ids (B,) int64 in [0, num_classes] (num_classes = unconditional).
            x_BLCv_wo_first_l: tokenizer input of scales 1.. (B, L - first_l, Cv) (`idx_to_var_input`); a prefix
                ending at a scale boundary runs only those scales.
            cond_drop_rate: class-dropout rate for this call; None uses `self.cond_drop_rate` in training mode and
                no dropout in eval mode.
            return_hidden: return the last block's output (B, L, C) instead of the logits.

        Returns:
            logits (B, L, V) float32.
        """
        B, end = x_BLCv_wo_first_l.shape[0], self.first_l + x_BLCv_wo_first_l.shape[1]
        if end not in self.scale_ends:
            raise ValueError(f"input covers {end} tokens, not a scale boundary of {self.scale_ends}")
        if cond_drop_rate is None:
            cond_drop_rate = self.cond_drop_rate if self.training else 0.0
        device_type = x_BLCv_wo_first_l.device.type
        with torch.autocast(device_type, enabled=False):
            cond_BD = self.class_emb(self.drop_labels(label_B, cond_drop_rate))
            sos_BlC = cond_BD.unsqueeze(1).expand(B, self.first_l, -1) + self.pos_start.expand(B, self.first_l, -1)
            x_BLC = torch.cat((sos_BlC, self.word_embed(at_least_float32(x_BLCv_wo_first_l))), dim=1)
            x_BLC = x_BLC + (self.lvl_embed(self.lvl_1L[:, :end]) + self.pos_1LC[:, :end])
        cond_in = self.condition(cond_BD)
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x_BLC, cond_in = x_BLC.to(dtype), cond_in.to(dtype)
        segments = self._segments(end)
        recompute = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:  # keep only the block's input; backward reruns the block (same RNG: same drop path)
                x_BLC = checkpoint(block, x_BLC, cond_in, segments, use_reentrant=False)
            else:
                x_BLC = block(x_BLC, cond_in, segments)
        if return_hidden:
            return x_BLC
        return self.logits(x_BLC, cond_BD)

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each transformer block in backward instead of keeping its activations (training with gradients
        only; the same RNG draws, so the same drop path)."""
        self.grad_checkpointing = enabled

    # ------------------------------------------------------------------------------------------ KV-cache inference
    def enable_kv_cache(self) -> None:
        """Give every attention layer an empty static cache of `seq_len` tokens (allocated on first use)."""
        for block in self.blocks:
            assert isinstance(block, AdaLNSelfAttn)
            block.attn.kv_cache = StaticKVCache(self.seq_len)

    def disable_kv_cache(self) -> None:
        """Drop the caches (frees their memory); `forward_cached` is unavailable until `enable_kv_cache`."""
        for block in self.blocks:
            assert isinstance(block, AdaLNSelfAttn)
            block.attn.kv_cache = None

    @property
    def kv_cache_enabled(self) -> bool:
        first = self.blocks[0]
        assert isinstance(first, AdaLNSelfAttn)
        return first.attn.kv_cache is not None

    def lvl_pos(self) -> torch.Tensor:
        """Scale embedding + absolute position for every position, (1, L, C)."""
        return self.lvl_embed(self.lvl_1L) + self.pos_1LC

    def first_tokens(self, cond_BD: torch.Tensor, lvl_pos_1LC: torch.Tensor) -> torch.Tensor:
        """Inputs of scale 0: class embedding + pos_start + lvl_pos, (B, first_l, C)."""
        B = cond_BD.shape[0]
        sos_BlC = cond_BD.unsqueeze(1).expand(B, self.first_l, -1) + self.pos_start.expand(B, self.first_l, -1)
        return sos_BlC + lvl_pos_1LC[:, : self.first_l]

    def next_tokens(self, si: int, next_BlCv: torch.Tensor, lvl_pos_1LC: torch.Tensor) -> torch.Tensor:
        """Inputs of scale si >= 1 from the tokenizer's area-downsampled f_hat (B, pn^2, Cv): word_embed + lvl_pos."""
        start, end = self.scale_ends[si - 1], self.scale_ends[si]
        return self.word_embed(next_BlCv) + lvl_pos_1LC[:, start:end]

    def forward_cached(self, x_BlC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        """One scale of inference: run the blocks on this scale's tokens, attending to the KV cache (which they
        extend), and return the last block's output (B, l, C). Requires `enable_kv_cache()`; scales come in order."""
        if not self.kv_cache_enabled:
            raise RuntimeError("forward_cached needs the KV cache: call enable_kv_cache() first")
        cond_in = self.condition(cond_BD)
        for block in self.blocks:
            x_BlC = block(x_BlC, cond_in, None)
        return x_BlC

    def guided_logits(self, h_BlC: torch.Tensor, cond_BD: torch.Tensor, t: float) -> torch.Tensor:
        """Classifier-free guidance (1 + t) * logits_cond - t * logits_uncond, float32 (B, l, V), for hidden states
        whose first half of rows is conditional and second half unconditional.

        The head Linear is affine, so the mix is taken on the head-normed features and the head runs on B rows
        instead of 2B (same value up to float rounding; at t = 0 the unconditional rows are skipped).
        """
        feat_BlC = at_least_float32(self.head_nm(at_least_float32(h_BlC), cond_BD))
        B = feat_BlC.shape[0] // 2
        feat_BlC = feat_BlC[:B] if t == 0.0 else (1 + t) * feat_BlC[:B] - t * feat_BlC[B:]
        return at_least_float32(self.head(feat_BlC))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
