"""CPU benchmark of the VAR transformer (fp32, 2 threads): sampling and training steps, ours vs an official-style
baseline run in the same process (interleaved, so machine load hits both alike).

    .venv/bin/python benchmarks/bench_var.py                 # all cases
    .venv/bin/python benchmarks/bench_var.py --case sample_d4 --repeats 5 --json out.json

Cases (random weights with the official init; the reference timings of the official code on the 2-core development
machine are in ../shared/reference/var.md section 6):
  sample_d4  d4, B=4 labels, cfg=1.5, top_k=900, top_p=0.95, seed 0; VAR + sampling + f_hat, no VQVAE decode
             (official: 1.06 s). Ours = `models.var.sample.generate`; the baseline follows the official algorithm:
             concatenating KV cache, head on 2B rows then CFG on logits, full-vocabulary sort for top-p,
             `torch.multinomial`. Both must give identical tokens.
  train_d4 / train_d8  B=8, train-mode forward + CE (1/L weights) + backward + clip 2.0 + fused AdamW step, tokens
             precomputed (official: 1.82 s / 10.28 s). The baseline forward follows the official op sequence: one
             SDPA call with the full L x L additive mask, F.normalize, in-place gamma multiply, per-sample
             lvl_embed lookup.
Timing: one warm-up each, then `--repeats` rounds alternating baseline and ours; medians (and minima) reported.
The training step of ours also uses `token_loss` (fused cross-entropy); the baseline uses F.cross_entropy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainlab.models.var.blocks import MAX_LOG_SCALE_MUL, AdaLNSelfAttn, SelfAttention
from trainlab.models.var.sample import filter_top_k_top_p_, generate
from trainlab.models.var.transformer import VAR, VARConfig, token_loss
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B batch, L tokens, l tokens of one scale, C width, H heads, K head dim, V vocab, Cv code width.

OFFICIAL_SECONDS = {"sample_d4": 1.06, "train_d4": 1.82, "train_d8": 10.28}


# ------------------------------------------------------------------------------------ official-style baseline
def _baseline_attn(attn: SelfAttention, x_BLC: torch.Tensor, bias: torch.Tensor | None, cache: dict) -> torch.Tensor:
    B, L, C = x_BLC.shape
    qkv_bias = torch.cat((attn.q_bias, attn.zero_k_bias, attn.v_bias))
    qkv = F.linear(x_BLC, attn.mat_qkv.weight, qkv_bias).view(B, L, 3, attn.num_heads, attn.head_dim)
    q_BHLK, k_BHLK, v_BHLK = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    q_BHLK = F.normalize(q_BHLK, dim=-1).mul(attn.scale_mul_1H11.clamp_max(MAX_LOG_SCALE_MUL).exp())
    k_BHLK = F.normalize(k_BHLK, dim=-1)
    if cache.get("on"):
        if "k" in cache:
            k_BHLK = cache["k"] = torch.cat((cache["k"], k_BHLK), dim=2)
            v_BHLK = cache["v"] = torch.cat((cache["v"], v_BHLK), dim=2)
        else:
            cache["k"], cache["v"] = k_BHLK, v_BHLK
    out = F.scaled_dot_product_attention(q_BHLK, k_BHLK, v_BHLK, scale=attn.scale, attn_mask=bias)
    return attn.proj(out.transpose(1, 2).reshape(B, L, C))


def _baseline_block(
    blk: AdaLNSelfAttn, x_BLC: torch.Tensor, cond_BD: torch.Tensor, bias: torch.Tensor | None, cache: dict
) -> torch.Tensor:
    C = blk.embed_dim
    g1, g2, s1, s2, b1, b2 = blk.ada_lin(cond_BD).view(-1, 1, 6, C).unbind(2)
    h = F.layer_norm(x_BLC, (C,), eps=blk.norm_eps).mul(s1.add(1)).add_(b1)
    x_BLC = x_BLC + blk.drop_path(_baseline_attn(blk.attn, h, bias, cache).mul_(g1))
    h = F.layer_norm(x_BLC, (C,), eps=blk.norm_eps).mul(s2.add(1)).add_(b2)
    return x_BLC + blk.drop_path(blk.ffn(h).mul(g2))


def _blocks(var: VAR) -> list[AdaLNSelfAttn]:
    return [blk for blk in var.blocks if isinstance(blk, AdaLNSelfAttn)]


def _baseline_head(var: VAR, x_BLC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
    scale, shift = var.head_nm.ada_lin(cond_BD).view(-1, 1, 2, var.embed_dim).unbind(2)
    h = F.layer_norm(x_BLC, (var.embed_dim,), eps=var.cfg.norm_eps).mul(scale.add(1)).add_(shift)
    return var.head(h).float()


def baseline_forward(
    var: VAR, label_B: torch.Tensor, x_BLCv: torch.Tensor, cond_drop_rate: float | None = None
) -> torch.Tensor:
    B = x_BLCv.shape[0]
    rate = var.cond_drop_rate if cond_drop_rate is None else cond_drop_rate
    label_B = torch.where(torch.rand(B) < rate, var.num_classes, label_B)
    sos = cond_BD = var.class_emb(label_B)
    sos = sos.unsqueeze(1).expand(B, 1, -1) + var.pos_start.expand(B, 1, -1)
    x_BLC = torch.cat((sos, var.word_embed(x_BLCv.float())), dim=1)
    x_BLC += var.lvl_embed(var.lvl_1L.expand(B, -1)) + var.pos_1LC
    for blk in _blocks(var):
        x_BLC = _baseline_block(blk, x_BLC, cond_BD, var.attn_bias_for_masking, {})
    return _baseline_head(var, x_BLC, cond_BD)


@torch.no_grad()
def baseline_sample(
    var: VAR, vqvae: VQVAE, labels: list[int], *, seed: int, cfg: float, top_k: int, top_p: float
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    label_B = torch.tensor(labels)
    B, K, quant = len(labels), len(var.patch_nums), vqvae.quantize
    cond_BD = var.class_emb(torch.cat((label_B, torch.full_like(label_B, var.num_classes))))
    lvl_pos = var.lvl_embed(var.lvl_1L) + var.pos_1LC
    x = cond_BD.unsqueeze(1) + var.pos_start.expand(2 * B, 1, -1) + lvl_pos[:, :1]
    caches = [{"on": True} for _ in var.blocks]
    f_hat = cond_BD.new_zeros(B, quant.embed_dim, var.patch_nums[-1], var.patch_nums[-1])
    tokens, cur = [], 0
    for si, pn in enumerate(var.patch_nums):
        cur += pn * pn
        for blk, cache in zip(_blocks(var), caches):
            x = _baseline_block(blk, x, cond_BD, None, cache)
        logits = _baseline_head(var, x, cond_BD)
        t = cfg * si / (K - 1)
        logits = (1 + t) * logits[:B] - t * logits[B:]
        probs = filter_top_k_top_p_(logits.reshape(-1, var.vocab_size), top_k, top_p).softmax(-1)
        idx_Bl = torch.multinomial(probs, 1, replacement=True, generator=g).view(B, -1)
        tokens.append(idx_Bl)
        h = quant.embedding(idx_Bl).transpose(1, 2).reshape(B, -1, pn, pn)
        f_hat, nxt = quant.next_autoregressive_input(si, f_hat, h)
        if nxt is not None:
            nxt = nxt.view(B, quant.embed_dim, -1).transpose(1, 2)
            x = (var.word_embed(nxt) + lvl_pos[:, cur : cur + var.patch_nums[si + 1] ** 2]).repeat(2, 1, 1)
    return tokens


# ------------------------------------------------------------------------------------------------- cases
def _timeit(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def case_sample(repeats: int) -> tuple[dict[str, list[float]], str]:
    torch.manual_seed(0)
    var = VAR(VARConfig.from_depth(4)).eval()
    vqvae = VQVAE(VQVAEConfig.official()).freeze()
    labels, kw = [1, 207, 360, 980], dict(seed=0, cfg=1.5, top_k=900, top_p=0.95)
    ours = generate(var, vqvae, labels, **kw).tokens  # type: ignore[arg-type]
    base = baseline_sample(var, vqvae, labels, **kw)  # type: ignore[arg-type]
    same = all(torch.equal(a, b) for a, b in zip(ours, base))
    times = _timeit(
        {
            "baseline": lambda: baseline_sample(var, vqvae, labels, **kw),  # type: ignore[arg-type]
            "ours": lambda: generate(var, vqvae, labels, **kw),  # type: ignore[arg-type]
        },
        repeats,
    )
    return times, f"identical tokens: {same}"


def case_train(depth: int, repeats: int) -> tuple[dict[str, list[float]], str]:
    torch.manual_seed(0)
    var = VAR(VARConfig.from_depth(depth)).train()
    B, L = 8, var.seq_len
    x_BLCv = torch.randn(B, L - 1, var.cfg.vae_embed_dim)
    label_B, gt_BL = torch.randint(0, 1000, (B,)), torch.randint(0, var.vocab_size, (B, L))
    opt = torch.optim.AdamW(var.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True)

    def official_loss(logits_BLV: torch.Tensor, target_BL: torch.Tensor) -> torch.Tensor:
        ce_BL = F.cross_entropy(logits_BLV.view(-1, var.vocab_size), target_BL.view(-1), reduction="none")
        return ce_BL.view(B, L).mul(1.0 / L).sum(dim=-1).mean()

    def step(
        forward: Callable[[], torch.Tensor], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        loss_fn(forward(), gt_BL).backward()
        torch.nn.utils.clip_grad_norm_(var.parameters(), 2.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    var.eval()
    with torch.no_grad():
        ref_BLV, ours_BLV = baseline_forward(var, label_B, x_BLCv, 0.0), var(label_B, x_BLCv, cond_drop_rate=0.0)
    var.train()
    times = _timeit(
        {
            "baseline": lambda: step(lambda: baseline_forward(var, label_B, x_BLCv), official_loss),
            "ours": lambda: step(lambda: var(label_B, x_BLCv), token_loss),
        },
        repeats,
    )
    return times, f"eval logits max |ours - baseline| = {(ours_BLV - ref_BLV).abs().max():.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["sample_d4", "train_d4", "train_d8", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=0, help="rounds (default 5 for sampling and training)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = ["sample_d4", "train_d4", "train_d8"] if args.case == "all" else [args.case]
    results = {}
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, fp32")
    head = ("case", "official", "baseline", "ours", "speedup", "vs off.", "min b/o")
    print("{:10s} {:>9s} {:>9s} {:>9s} {:>8s} {:>8s}  {:>13s}  note".format(*head))
    for case in cases:
        repeats = args.repeats or 5
        if case == "sample_d4":
            times, note = case_sample(repeats)
        else:
            times, note = case_train(int(case[-1]), repeats)
        base, ours = statistics.median(times["baseline"]), statistics.median(times["ours"])
        off = OFFICIAL_SECONDS[case]
        mins = f"{min(times['baseline']):.3f}/{min(times['ours']):.3f}"
        print(
            f"{case:10s} {off:9.2f} {base:9.3f} {ours:9.3f} {base / ours:7.2f}x {off / ours:7.2f}x  {mins:>13s}  {note}"
        )
        results[case] = {"official_s": off, "baseline_s": times["baseline"], "ours_s": times["ours"], "note": note}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
