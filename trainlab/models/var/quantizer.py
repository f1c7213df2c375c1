"""VAR's multi-scale residual vector quantizer (one shared codebook, partially shared phi refinement convs).

A feature map f (B, C, h, w) is turned into K token maps of growing side `patch_nums` (the last equals h = w):
at each scale the not-yet-explained residual is area-pooled to pn x pn, every position takes its nearest code
(squared L2), the code map is bicubic-upsampled back to h x w (not at the last scale), refined by a phi conv
phi(x) = (1-r)*x + r*conv3x3(x), and added to the running reconstruction f_hat. State_dict keys match the official
`quantize.*` entries: `ema_vocab_hit_SV`, `quant_resi.qresi_ls.{k}.weight/bias`, `embedding.weight`.

Deviation: the official code names the phi convs differently when `share_quant_resi` is 0 or 1; here they are always
`quant_resi.qresi_ls.{k}` (no released checkpoint uses those settings). share=0 (one phi per scale) is computed
exactly like share=K, which is what the official tick rule gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainlab.dtypes import at_least_float32
from trainlab.errors import UsageError

# Shape legend: B batch, C = embed_dim (Cvae), h/w latent side = patch_nums[-1], pn side of one scale,
# V vocab size, K number of scales, S scales (buffer rows), L = sum(pn^2) tokens, N = B*pn*pn.


def phi_index_table(num_scales: int, num_phis: int) -> tuple[int, ...]:
    """Which phi conv each scale uses: the tick nearest to si/(K-1), computed in float64 like the official code.

    Ticks are `linspace(1/(3n), 1-1/(3n), n)` for n = 4 phis, else `linspace(1/(2n), 1-1/(2n), n)`. Exact ties
    (si=2 and si=7 for K=10) are decided by float64 rounding: K=10, n=4 gives (0,0,1,1,1,2,2,3,3,3).
    """
    n = num_phis
    ticks = np.linspace(1 / 3 / n, 1 - 1 / 3 / n, n) if n == 4 else np.linspace(1 / 2 / n, 1 - 1 / 2 / n, n)
    ratios = [si / (num_scales - 1) if num_scales > 1 else 0.0 for si in range(num_scales)]
    return tuple(int(np.argmin(np.abs(ticks - r))) for r in ratios)


class Phi(nn.Conv2d):
    """Residual refinement phi(x) = (1 - r) * x + r * conv3x3(x); r = 0 makes it the identity."""

    def __init__(self, embed_dim: int, resi_ratio: float) -> None:
        super().__init__(embed_dim, embed_dim, kernel_size=3, stride=1, padding=1)
        self.resi_ratio = abs(resi_ratio)

    def forward(self, h_BChw: torch.Tensor) -> torch.Tensor:
        if self.resi_ratio <= 1e-6:
            return h_BChw
        return h_BChw.mul(1 - self.resi_ratio) + super().forward(h_BChw).mul_(self.resi_ratio)


class PhiPartiallyShared(nn.Module):
    """`num_phis` phi convs (`qresi_ls.{k}`) shared by K scales through `phi_index_table`."""

    def __init__(self, embed_dim: int, resi_ratio: float, num_phis: int, num_scales: int) -> None:
        super().__init__()
        self.qresi_ls = nn.ModuleList(Phi(embed_dim, resi_ratio) for _ in range(num_phis))
        self.scale_to_phi = phi_index_table(num_scales, num_phis)

    def __getitem__(self, si: int) -> Phi:
        phi = self.qresi_ls[self.scale_to_phi[si]]
        assert isinstance(phi, Phi)
        return phi


def _fp32_region(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Autocast off: the quantizer always runs in float32 (as the official code does)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class MultiScaleQuantizer(nn.Module):
    """Multi-scale residual VQ with one codebook (`embedding`, V x C) shared by all scales.

    Args:
        vocab_size: V, codebook size.
        embed_dim: C, code / latent channels (Cvae).
        patch_nums: token-map side of each scale, coarse to fine; the last equals the latent side.
        beta: commitment weight of the training loss.
        quant_resi: phi mixing ratio r.
        share_quant_resi: number of phi convs (4 in VAR); 0 = one per scale; 1 = a single shared phi.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        patch_nums: Sequence[int],
        *,
        beta: float = 0.25,
        quant_resi: float = 0.5,
        share_quant_resi: int = 4,
    ) -> None:
        super().__init__()
        if len(patch_nums) == 0 or list(patch_nums) != sorted(patch_nums) or min(patch_nums) < 1:
            raise UsageError(f"patch_nums must be a non-empty increasing list of positive sides, got {patch_nums}")
        if share_quant_resi < 0:
            raise UsageError(f"share_quant_resi must be >= 0 (0 = one phi per scale), got {share_quant_resi}")
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim
        self.patch_nums: tuple[int, ...] = tuple(int(pn) for pn in patch_nums)
        self.beta = beta
        num_phis = len(self.patch_nums) if share_quant_resi == 0 else share_quant_resi
        # Registration order gives the official state_dict order: buffer, quant_resi, embedding.
        self.ema_vocab_hit_SV: torch.Tensor
        self.register_buffer("ema_vocab_hit_SV", torch.zeros(len(self.patch_nums), vocab_size))
        self.quant_resi = PhiPartiallyShared(embed_dim, quant_resi, num_phis, len(self.patch_nums))
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / vocab_size, 1.0 / vocab_size)
        self.num_hit_updates = 0  # forward calls in training mode so far (EMA warm-up of `ema_vocab_hit_SV`)

    # ----------------------------------------------------------------------------------------------- helpers
    @property
    def num_scales(self) -> int:
        return len(self.patch_nums)

    @property
    def scale_to_phi(self) -> tuple[int, ...]:
        """Index into `quant_resi.qresi_ls` used by each scale."""
        return self.quant_resi.scale_to_phi

    def _check_f(self, f_BChw: torch.Tensor) -> None:
        side = self.patch_nums[-1]
        if f_BChw.ndim != 4 or f_BChw.shape[1] != self.embed_dim or tuple(f_BChw.shape[-2:]) != (side, side):
            raise UsageError(
                f"quantizer expects features (B, {self.embed_dim}, {side}, {side}) for patch_nums={self.patch_nums}, "
                f"got {tuple(f_BChw.shape)}: use images of side {side} x the VQVAE downsample factor"
            )

    def _nearest_code(self, z_NC: torch.Tensor) -> torch.Tensor:
        """argmin_v |z - e_v|^2 computed as |z|^2 + |e|^2 - 2 z.e (the official expansion, for identical ties)."""
        e_VC = at_least_float32(self.embedding.weight.detach())
        dist_NV = z_NC.square().sum(dim=1, keepdim=True) + e_VC.square().sum(dim=1)
        dist_NV.addmm_(z_NC, e_VC.T, beta=1.0, alpha=-2.0)
        return dist_NV.argmin(dim=1)

    def _embed_BChw(self, idx: torch.Tensor, pn: int) -> torch.Tensor:
        """Codes of one scale (B, pn*pn) or (B, pn, pn) -> embeddings (B, C, pn, pn)."""
        B = idx.shape[0]
        return self.embedding(idx.reshape(B, pn * pn)).transpose(1, 2).reshape(B, self.embed_dim, pn, pn)

    def _up_phi(self, si: int, h_BCpp: torch.Tensor) -> torch.Tensor:
        """phi_si(bicubic_up(h)) to the latent side, float32; no upsampling at the last scale."""
        side = self.patch_nums[-1]
        h_BCpp = at_least_float32(h_BCpp)
        if si != self.num_scales - 1:
            h_BCpp = F.interpolate(h_BCpp, size=(side, side), mode="bicubic", align_corners=False)
        phi = self.quant_resi[si]
        return at_least_float32(
            phi(h_BCpp.contiguous().to(phi.weight.dtype))
        )  # 16-bit weights: phi runs in their dtype

    def _residual_scales(self, f_BChw: torch.Tensor, keep_fhat: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The residual loop without gradients: per-scale codes (B, pn*pn) and, if `keep_fhat`, f_hat after each."""
        self._check_f(f_BChw)
        B, C = f_BChw.shape[:2]
        idx_list: list[torch.Tensor] = []
        f_hat_list: list[torch.Tensor] = []
        with torch.no_grad(), _fp32_region(f_BChw.device):
            f_rest_BChw = at_least_float32(f_BChw.detach()).clone()
            f_hat_BChw = torch.zeros_like(f_rest_BChw)
            for si, pn in enumerate(self.patch_nums):
                z_BCpp = f_rest_BChw if si == self.num_scales - 1 else F.interpolate(f_rest_BChw, (pn, pn), mode="area")
                idx_N = self._nearest_code(z_BCpp.permute(0, 2, 3, 1).reshape(-1, C))
                h_BChw = self._up_phi(si, self._embed_BChw(idx_N.view(B, pn * pn), pn))
                f_hat_BChw.add_(h_BChw)
                f_rest_BChw.sub_(h_BChw)
                idx_list.append(idx_N.view(B, pn * pn))
                if keep_fhat:
                    f_hat_list.append(f_hat_BChw.clone())
        return idx_list, f_hat_list

    # ------------------------------------------------------------------------------------------- public API
    def f_to_idx(self, f_BChw: torch.Tensor) -> list[torch.Tensor]:
        """Features (B, C, h, w) -> per-scale codes, int64 (B, pn*pn) in row-major order. No gradient."""
        return self._residual_scales(f_BChw, keep_fhat=False)[0]

    def f_to_fhat_per_scale(self, f_BChw: torch.Tensor) -> list[torch.Tensor]:
        """Features -> cumulative reconstruction f_hat (B, C, h, w) after each scale. No gradient."""
        return self._residual_scales(f_BChw, keep_fhat=True)[1]

    def idx_to_fhat(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-scale codes -> f_hat = sum_si phi_si(bicubic_up(embed(idx_si))), shape (B, C, h, w)."""
        self._check_idx(idx_list)
        with _fp32_region(idx_list[0].device):
            f_hat_BChw: torch.Tensor | None = None
            for si, (pn, idx) in enumerate(zip(self.patch_nums, idx_list)):
                h_BChw = self._up_phi(si, self._embed_BChw(idx, pn))
                f_hat_BChw = h_BChw if f_hat_BChw is None else f_hat_BChw + h_BChw
        assert f_hat_BChw is not None
        return f_hat_BChw

    def idx_to_var_input(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Teacher-forcing input of VAR: (B, L - patch_nums[0]**2, C).

        For si = 0..K-2: f_hat += phi_si(bicubic_up(embed(idx_si))); emit area_down(f_hat, pn_{si+1}) flattened to
        (B, pn_{si+1}**2, C). The input of scale k is the accumulated f_hat of scales < k on scale k's grid.
        """
        self._check_idx(idx_list)
        B = idx_list[0].shape[0]
        with _fp32_region(idx_list[0].device):
            side = self.patch_nums[-1]
            f_hat_BChw = torch.zeros(B, self.embed_dim, side, side, device=idx_list[0].device)
            next_BlC: list[torch.Tensor] = []
            for si in range(self.num_scales - 1):
                f_hat_BChw = f_hat_BChw + self._up_phi(si, self._embed_BChw(idx_list[si], self.patch_nums[si]))
                pn_next = self.patch_nums[si + 1]
                next_BCpp = F.interpolate(f_hat_BChw, size=(pn_next, pn_next), mode="area")
                next_BlC.append(next_BCpp.reshape(B, self.embed_dim, -1).transpose(1, 2))
        if not next_BlC:
            return f_hat_BChw.new_zeros(B, 0, self.embed_dim)
        return torch.cat(next_BlC, dim=1)

    def next_autoregressive_input(
        self, si: int, f_hat_BChw: torch.Tensor, h_BChw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sampling step: add scale si's embeddings h (B, C, pn, pn) to f_hat (not in place).

        Returns:
            (new f_hat, area_down(new f_hat, pn_{si+1}) as (B, C, pn', pn')) for si < K-1; (new f_hat, None) at the
            last scale (where h is not upsampled).
        """
        with _fp32_region(f_hat_BChw.device):
            f_hat_BChw = at_least_float32(f_hat_BChw) + self._up_phi(si, h_BChw)
            if si == self.num_scales - 1:
                return f_hat_BChw, None
            pn_next = self.patch_nums[si + 1]
            return f_hat_BChw, F.interpolate(f_hat_BChw, size=(pn_next, pn_next), mode="area")

    def forward(self, f_BChw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Tokenizer-training pass.

        Returns:
            f_hat (B, C, h, w) with a straight-through gradient to f; the VQ loss (scalar), the mean over scales of
            beta * MSE(f_hat.detach(), f) + MSE(f_hat, f.detach()) where f_hat is the running sum after that scale
            (it trains the codebook and the phi convs); and the per-scale codes.
            In training mode the per-scale code counts also update the EMA buffer `ema_vocab_hit_SV` (local counts;
            all-reduce them in the engine for multi-process runs).
        """
        self._check_f(f_BChw)
        B, C = f_BChw.shape[:2]
        with _fp32_region(f_BChw.device):
            f_BChw = at_least_float32(f_BChw)
            f_nograd_BChw = f_BChw.detach()
            f_rest_BChw = f_nograd_BChw.clone()
            f_hat_BChw = torch.zeros_like(f_rest_BChw)
            loss = f_BChw.new_zeros(())
            idx_list: list[torch.Tensor] = []
            for si, pn in enumerate(self.patch_nums):
                with torch.no_grad():
                    last = si == self.num_scales - 1
                    z_BCpp = f_rest_BChw if last else F.interpolate(f_rest_BChw, (pn, pn), mode="area")
                    idx_N = self._nearest_code(z_BCpp.permute(0, 2, 3, 1).reshape(-1, C))
                h_BChw = self._up_phi(si, self._embed_BChw(idx_N.view(B, pn * pn), pn))
                f_hat_BChw = f_hat_BChw + h_BChw
                f_rest_BChw = f_rest_BChw - h_BChw.detach()
                loss = (
                    loss + self.beta * F.mse_loss(f_hat_BChw.detach(), f_BChw) + F.mse_loss(f_hat_BChw, f_nograd_BChw)
                )
                idx_list.append(idx_N.view(B, pn * pn))
            if self.training:
                self._update_hits(idx_list)
            f_hat_st_BChw = (f_hat_BChw.detach() - f_nograd_BChw) + f_BChw
        return f_hat_st_BChw, loss / self.num_scales, idx_list

    # ---------------------------------------------------------------------------------------- usage statistics
    @torch.no_grad()
    def _update_hits(self, idx_list: Sequence[torch.Tensor]) -> None:
        decay = 0.0 if self.num_hit_updates == 0 else (0.9 if self.num_hit_updates < 100 else 0.99)
        for si, idx in enumerate(idx_list):
            hit_V = torch.bincount(idx.flatten(), minlength=self.vocab_size).float()
            self.ema_vocab_hit_SV[si].mul_(decay).add_(hit_V, alpha=1.0 - decay)
        self.num_hit_updates += 1

    def _check_idx(self, idx_list: Sequence[torch.Tensor]) -> None:
        if len(idx_list) != self.num_scales:
            raise UsageError(
                f"expected {self.num_scales} token maps (patch_nums={self.patch_nums}), got {len(idx_list)}"
            )
        for pn, idx in zip(self.patch_nums, idx_list):
            if idx.numel() != idx.shape[0] * pn * pn:
                raise UsageError(f"token map of scale side {pn} must have shape (B, {pn * pn}), got {tuple(idx.shape)}")
