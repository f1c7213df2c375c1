"""Benchmark of VAR training steps as `trainlab train var` runs them, side by side with the official trainer's step
written out from ../shared/reference/var.md (interleaved round by round, so machine load hits all variants alike), on
the CPU (default: fp32, 2 threads) or a GPU with the official mixed precision; and token sampling (CPU, fp32) against
the official sampling arithmetic.

    .venv/bin/python benchmarks/bench_var.py --label idlemachine      # all cases; JSON result in results/
    .venv/bin/python benchmarks/bench_var.py --case train_d4 --repeats 1 --json ''   # smoke run
    .venv/bin/python benchmarks/bench_var.py --case train_d16 --tokenizer ch160 --device cuda --precision bf16-amp \
        --batch-size 64 --train-images 1280 --repeats 3 --label h100     # GPU; also --precision fp16-amp-scale

Training cases train_d4 / train_d8 / train_d16: B = `--batch-size` (default 8) images at 256 px (L = 680 tokens,
V = 4096, code width 32), the tokenizer re-encoding every batch as the official trainer does. `--device` and
`--precision` apply to every training variant alike: `fp32`, `bf16-amp` (the official `--fp16 2`: bf16 autocast, no
scaler) or `fp16-amp-scale` (the official `--fp16 1`: fp16 autocast and a GradScaler); on CUDA the clock is read
after `torch.cuda.synchronize()`. Tokenizer (`--tokenizer`): `ch32` (default) is the official architecture at base
width 32 (the weights of ../shared/fixtures/var_official_d4.pt when present, else a seeded random init), so that the
encoder does not drown the transformer on a 2-core CPU; `ch160` is the released architecture (random init), where
the encoder is ~13 s of each step on that CPU. Variants:
  official   in its own process, the official `VARTrainer.train_step` (var.md section 3.1) as it runs: `img_to_idxBl` +
             `idxBl_to_var_input` with the official arithmetic (NCHW convolutions, bmm attention and in-place SiLU
             in the encoder, as the official `basic_vae.py`), the official VAR forward (one SDPA call with the full
             L x L additive mask, F.normalize, per-sample lvl_embed lookup), per-token `F.cross_entropy` x 1/L, the
             argmax for its accuracy log, backward, clip 2.0 and a fused AdamW step (official afuse default True),
             betas (0.9, 0.95), weight decay 0.05. Mixed precision as the official AmpOptimizer (var.md 3.2): the
             tokenizer outside autocast, forward + loss under it, the embeddings in fp32 and the residual stream
             in the autocast dtype; fp16: GradScaler(init_scale 2^11, growth_interval 1000), unscale before the
             clip, scale capped at 32768 after each step. On CUDA TF32 is on (official `--tf32` default).
  official_reuse  the same with trainlab's host allocator policy (below; CPU only, not a default variant on CUDA).
  command    THE NUMBER FOR USERS: the real `trainlab train var` run as a subprocess per round with `--data.kind fake
             --epochs 2`, the same device, precision, batch size and tokenizer weights, re-encoding every batch (its
             default); `--num-workers 0` on the CPU, 8 on CUDA.
             Seconds per optimizer step = batch / the `images_per_second` of the `summary` row of its metrics.jsonl
             (the engine times the training loop only and excludes epoch 1). Everything the recipe and engine do per
             step is in it: data loading, encode, teacher-forcing input, forward, loss, metrics, backward, clip,
             AdamW, schedule, logging.
  cached     the same command with `--use-token-cache true` (tokens encoded once, before training, from a center
             crop: no random crop per epoch; the cache is built once for all rounds and excluded from the timing).
  compiled   the re-encoding command with `--compile true` (the compile falls in the untimed epoch 1).
`--variants` picks among them. The rounds alternate the variants' order; medians (and minima) are reported, and the
official step's encode share. Sampling case sample_d4: d4, B=4 labels, cfg 1.5, top-k 900,
top-p 0.95, seed 0, VAR + sampling + f_hat without the VQVAE decode; ours = `models.var.sample.generate`, baseline =
the official algorithm (concatenating KV cache, head on 2B rows then CFG on logits, full-vocabulary sort for top-p,
`torch.multinomial`); both must give identical tokens. The whole `trainlab sample` process, decode included, is
benchmarks/bench_var_sample.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _env import environment, result_path, run_metrics, settings, write_result

from trainlab.engine.host_allocator import configure_host_allocator
from trainlab.models.var.blocks import MAX_LOG_SCALE_MUL, AdaLNSelfAttn, SelfAttention
from trainlab.models.var.convert import export_official, load_tokenizer
from trainlab.models.var.sample import filter_top_k_top_p_, generate
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B batch, L tokens, l tokens of one scale, C width, H heads, K head dim, V vocab, Cv code width.

# The official code's own timing on the 2-core development machine (../shared/reference/var.md section 6): a slower
# day of the same machine; it says which way to look, the in-process baseline is the comparison.
OFFICIAL_SECONDS = {"sample_d4": 1.06}
BATCH = 8  # --batch-size default
COMMAND = "trainlab train var"
PRECISIONS = ("fp32", "bf16-amp", "fp16-amp-scale")
VARIANTS = ("official", "command", "cached", "compiled", "official_reuse")


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
    with torch.autocast(x_BLCv.device.type, enabled=False):  # the official embeddings are fp32 under autocast too
        label_B = torch.where(torch.rand(B, device=label_B.device) < rate, var.num_classes, label_B)
        sos = cond_BD = var.class_emb(label_B)
        sos = sos.unsqueeze(1).expand(B, 1, -1) + var.pos_start.expand(B, 1, -1)
        x_BLC = torch.cat((sos, var.word_embed(x_BLCv.float())), dim=1)
        x_BLC += var.lvl_embed(var.lvl_1L.expand(B, -1)) + var.pos_1LC
    ones = x_BLC.new_ones(8, 8)
    main_type = torch.matmul(ones, ones).dtype  # the official hack: the autocast dtype (fp32 without autocast)
    x_BLC, cond_main = x_BLC.to(main_type), cond_BD.to(main_type)
    bias = var.attn_bias_for_masking.to(main_type)
    for blk in _blocks(var):
        x_BLC = _baseline_block(blk, x_BLC, cond_main, bias, {})
    return _baseline_head(var, x_BLC.float(), cond_BD)


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


# ------------------------------------------------------------------------------ `trainlab train var` as run
FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "var_official_d4.pt"


def write_tokenizer(work: Path, kind: str) -> tuple[Path, str]:
    """The tokenizer weights file both sides use (official format) and where they come from."""
    path = work / f"tokenizer_{kind}.pth"
    if kind == "ch32" and FIXTURE.is_file():
        source = "ch=32 VQVAE of ../shared/fixtures/var_official_d4.pt (official code's weights)"
        if not path.exists():
            torch.save(torch.load(FIXTURE, weights_only=False)["vae_state_dict"], path)
        return path, source
    cfg = VQVAEConfig.official()
    if kind == "ch32":
        cfg = dataclasses.replace(cfg, ch=32)
    if not path.exists():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            export_official(VQVAE(cfg), path)
    return path, f"ch={cfg.ch} VQVAE, random init (seed 0)"


class TrainVarCommand:
    """Runs the real `trainlab train var` command in a subprocess and reads its seconds per optimizer step.

    `work` holds the tokenizer weights, the token cache (built by the first cached run and reused by the rest: its
    fingerprint does not depend on the depth) and the run directories (deleted after each run).
    """

    def __init__(self, work: Path, tokenizer: Path, args: argparse.Namespace) -> None:
        self.work, self.tokenizer, self.args, self.runs = work, tokenizer, args, 0

    def argv(self, depth: int, run_dir: Path, cached: bool, compiled: bool = False) -> list[str]:
        a = self.args
        flags: dict[str, object] = {
            "--run-dir": run_dir,
            "--device": a.device,
            "--precision": a.precision,
            "--depth": depth,
            "--batch-size": a.batch_size,
            "--epochs": a.train_epochs,
            "--data.kind": "fake",
            "--data.fake-size": a.train_images,
            "--tokenizer-weights": self.tokenizer,
            "--use-token-cache": cached,
        }
        if compiled:
            flags["--compile"] = True
        if cached:  # one cache per image count: a cache built for another --train-images would be refused as stale
            flags["--token-cache-path"] = self.work / f"token_cache_{self.tokenizer.stem}_{a.train_images}images"
        flags.update(
            {
                "--eval-batch-size": a.batch_size,  # also the encoder's batch while the cache is built (bounded memory)
                "--num-workers": 0 if a.device == "cpu" else 8,
                "--export": False,
                "--tensorboard": False,
                "--progress": False,
            }
        )
        out = [sys.executable, "-m", "trainlab", *COMMAND.split()[1:]]
        for flag, value in flags.items():
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        return out

    def shown(self, depth: int, cached: bool) -> str:
        """The command as a user types it, with the work folder written $WORK."""
        argv = self.argv(depth, self.work / f"run_d{depth}", cached)
        return shlex.join(["trainlab", *argv[3:]]).replace(str(self.work), "$WORK")

    def seconds_per_step(self, depth: int, cached: bool, compiled: bool = False) -> tuple[float, dict[str, Any]]:
        run_dir = self.work / f"run_d{depth}_{self.runs}"
        self.runs += 1
        env = _child_env(self.args.threads)
        t0 = time.perf_counter()
        proc = subprocess.run(
            self.argv(depth, run_dir, cached, compiled), env=env, capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            raise SystemExit(f"`{self.shown(depth, cached)}` failed with exit code {proc.returncode}:\n{tail}")
        _, summary = run_metrics(run_dir)
        shutil.rmtree(run_dir)
        seconds = self.args.batch_size / summary["images_per_second"]  # = seconds_per_epoch / steps per epoch
        record = {
            "cached_tokens": cached,
            "compiled": compiled,
            "seconds_per_step": seconds,
            "seconds_per_epoch": summary["seconds_per_epoch"],
            "epochs_timed": summary["epochs_timed"],
            "process_wall_s": wall,
        }
        return seconds, record


@dataclasses.dataclass
class OfficialAmp:
    """The official `AmpOptimizer` (var.md 3.2) for one `--precision`: the autocast dtype (None: fp32) and, for fp16,
    its GradScaler."""

    device: torch.device
    dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def of(cls, precision: str, device: torch.device) -> OfficialAmp:
        if precision == "fp32":
            return cls(device)
        if precision == "bf16-amp":  # official --fp16 2
            return cls(device, torch.bfloat16)
        assert precision == "fp16-amp-scale", precision  # official --fp16 1
        return cls(device, torch.float16, torch.amp.GradScaler(device.type, init_scale=2.0**11, growth_interval=1000))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def clock(self) -> float:
        """perf_counter once the device's queued work is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def backward_clip_step(self, loss: torch.Tensor, var: VAR, opt: torch.optim.Optimizer) -> None:
        """`backward_clip_step` of a stepping iteration: backward, unscale, clip 2.0, step, zero_grad."""
        if self.scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(var.parameters(), 2.0)
            opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(var.parameters(), 2.0)
            self.scaler.step(opt)
            if self.scaler.get_scale() > 32768.0:  # the official cap on the scale (a host read every step, as there)
                self.scaler.update(new_scale=32768.0)
            else:
                self.scaler.update()
        opt.zero_grad(set_to_none=True)


def official_train_step(
    var: VAR,
    vqvae: VQVAE,
    opt: torch.optim.Optimizer,
    img_B3HW: torch.Tensor,
    label_B: torch.Tensor,
    amp: OfficialAmp | None = None,
) -> tuple[float, float]:
    """One official `VARTrainer.train_step` (var.md 3.1) at `amp`'s precision (default: fp32 on the CPU); returns
    (seconds, of which tokenisation)."""
    amp = amp or OfficialAmp(img_B3HW.device)
    t0 = amp.clock()
    # plain model: NCHW convolutions, bmm attention; under inference_mode its blocks apply SiLU in place as the
    # official `basic_vae.py` does (and also add the residual in place, which the official code does not: the
    # baseline's favour)
    with torch.inference_mode():
        idx_list = vqvae.img_to_idx(img_B3HW)
        gt_BL = torch.cat(idx_list, dim=1)
        x_BLCv = vqvae.quantize.idx_to_var_input(idx_list)
    gt_BL, x_BLCv = gt_BL.clone(), x_BLCv.clone()  # ordinary tensors, as the official step has (autograd saves x)
    t_encode = amp.clock() - t0
    B, L = gt_BL.shape
    with amp.autocast():  # the tokenizer above runs outside it, as in the official step
        logits_BLV = baseline_forward(var, label_B, x_BLCv)
        ce_BL = F.cross_entropy(logits_BLV.view(-1, var.vocab_size), gt_BL.view(-1), reduction="none").view(B, L)
        loss = ce_BL.mul(1.0 / L).sum(dim=-1).mean()
    pred_BL = logits_BLV.data.argmax(dim=-1)  # the official step computes its accuracy log from this
    amp.backward_clip_step(loss, var, opt)
    float((pred_BL == gt_BL).float().mean())  # Accm, read as a Python number like the official log
    return amp.clock() - t0, t_encode


def _setup(
    depth: int, tokenizer: Path, device: str = "cpu", batch: int = BATCH
) -> tuple[VQVAE, VAR, torch.Tensor, torch.Tensor]:
    """The tokenizer, a VAR of `depth` with the official init, and one batch of images and labels (seed 0, drawn on
    the CPU), all on `device`."""
    torch.manual_seed(0)
    vqvae = load_tokenizer(str(tokenizer), "auto", VARConfig.from_depth(depth).patch_nums).to(device)
    var = VAR(VARConfig.from_depth(depth))
    var.init_weights(0.5, 1e-3, 0.02, -1)
    img_B3HW, label_B = torch.rand(batch, 3, 256, 256) * 2 - 1, torch.randint(0, 1000, (batch,))
    return vqvae, var.to(device), img_B3HW.to(device), label_B.to(device)


def _child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def official_worker(
    depth: int,
    steps: int,
    tokenizer: Path,
    allocator: str,
    device: str = "cpu",
    precision: str = "fp32",
    batch: int = BATCH,
) -> dict[str, float]:
    """The official trainer in this (fresh) process: `steps` warm-up steps (the command's untimed epoch 1), then the
    mean of `steps` timed steps (the command's timed epoch). `allocator`: `system` is glibc as the official code runs
    with; `reuse` applies trainlab's host allocator policy (trainlab/engine/host_allocator.py) to the official
    code too."""
    if allocator == "reuse":
        configure_host_allocator("reuse")
    if device != "cpu":  # the official `--tf32` default (True): TF32 for fp32 matmuls and convolutions
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    vqvae, var, img_B3HW, label_B = _setup(depth, tokenizer, device, batch)
    var.train()
    opt = torch.optim.AdamW(var.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True)
    amp = OfficialAmp.of(precision, img_B3HW.device)
    for _ in range(steps):
        official_train_step(var, vqvae, opt, img_B3HW, label_B, amp)
    timed = [official_train_step(var, vqvae, opt, img_B3HW, label_B, amp) for _ in range(steps)]
    result = {
        "seconds_per_step": statistics.fmean(t for t, _ in timed),
        "encode_s": statistics.fmean(e for _, e in timed),
    }
    if img_B3HW.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(img_B3HW.device) / 2**30
    return result


def run_official(depth: int, args: argparse.Namespace, tokenizer: Path, allocator: str) -> dict[str, float]:
    steps = args.train_images // args.batch_size
    argv = [sys.executable, __file__, "--official-worker", str(depth), "--official-steps", str(steps)]
    argv += ["--official-allocator", allocator, "--threads", str(args.threads), "--tokenizer-path", str(tokenizer)]
    argv += ["--device", args.device, "--precision", args.precision, "--batch-size", str(args.batch_size)]
    proc = subprocess.run(argv, env=_child_env(args.threads), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the official worker failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def case_train(
    depth: int, repeats: int, command: TrainVarCommand, tokenizer: Path, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    encode_times: dict[str, list[float]] = {"official": [], "official_reuse": []}
    peak_memory: dict[str, list[float]] = {"official": [], "official_reuse": []}
    records: list[dict[str, Any]] = []

    def official(allocator: str, name: str) -> Callable[[], float]:
        def run() -> float:
            result = run_official(depth, args, tokenizer, allocator)
            encode_times[name].append(result["encode_s"])
            if "peak_memory_gib" in result:
                peak_memory[name].append(result["peak_memory_gib"])
            return result["seconds_per_step"]

        return run

    def run_command(cached: bool, compiled: bool = False) -> Callable[[], float]:
        def run() -> float:
            seconds, record = command.seconds_per_step(depth, cached, compiled)
            records.append(record)
            return seconds

        return run

    variants: dict[str, Callable[[], float]] = {
        "official": official("system", "official"),
        "command": run_command(cached=False),
        "cached": run_command(cached=True),
        "compiled": run_command(cached=False, compiled=True),
        "official_reuse": official("reuse", "official_reuse"),
    }
    variants = {name: run for name, run in variants.items() if name in args.variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(variants[name]())
    vqvae, var, img_B3HW, label_B = _setup(depth, tokenizer, args.device, args.batch_size)
    var.eval()
    with torch.no_grad():
        x_BLCv = vqvae.quantize.idx_to_var_input(vqvae.img_to_idx(img_B3HW))
        gap = (var(label_B, x_BLCv, cond_drop_rate=0.0) - baseline_forward(var, label_B, x_BLCv, 0.0)).abs().max()
    del vqvae, var, img_B3HW, label_B, x_BLCv
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # leave the GPU to the next case's processes
    extra: dict[str, Any] = {
        "official_encode_s": encode_times["official"],
        "official_reuse_encode_s": encode_times["official_reuse"],
        "command_runs": records,
        "note": f"fp32 eval logits max |trainlab model - official forward| = {gap:.1e}",
    }
    if peak_memory["official"]:
        extra["official_peak_memory_gib"] = peak_memory["official"]
    return times, extra


def report_sample(times: dict[str, list[float]], note: str, repeats: int) -> dict[str, Any]:
    base, ours, off = (
        statistics.median(times["baseline"]),
        statistics.median(times["ours"]),
        OFFICIAL_SECONDS["sample_d4"],
    )
    print(f"\nsample_d4: B=4, cfg 1.5, top-k 900, top-p 0.95, no decode; medians of {repeats} rounds; {note}")
    print(
        f"  ours {ours:.3f} s (min {min(times['ours']):.3f}) | baseline {base:.3f} s (min {min(times['baseline']):.3f})"
        f" -> {base / ours:.2f}x | official reference {off:.2f} s -> {off / ours:.2f}x"
    )
    return {"official_s": off, "baseline_s": times["baseline"], "ours_s": times["ours"], "note": note}


def report_train(
    case: str, times: dict[str, list[float]], extra: dict[str, Any], command: TrainVarCommand, source: str, repeats: int
) -> dict[str, Any]:
    """Print the case's medians (the ratios of the variants that ran) and return its JSON record."""
    depth, a = int(case.split("_d")[1]), command.args
    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"\n{case}: B={a.batch_size}, 256 px, {a.device}, {a.precision}, seconds per optimizer step, medians of "
        f"{repeats} rounds; {extra['note']}"
    )
    print(f"  tokenizer: {source}")
    if "official" in med:
        encode = statistics.median(extra["official_encode_s"])
        peak = extra.get("official_peak_memory_gib")
        memory = f"; peak {max(peak):.1f} GiB allocated" if peak else ""
        print(
            f"  official trainer step {med['official']:.3f} s (min {min(times['official']):.3f}; encode {encode:.3f} s"
            f"{memory})"
        )
    if "official_reuse" in med:
        line = f"  official trainer step with trainlab's host allocator policy {med['official_reuse']:.3f} s "
        line += f"(min {min(times['official_reuse']):.3f})"
        if "command" in med:
            line += f" -> `{COMMAND}` is {med['official_reuse'] / med['command']:.2f}x that"
        print(line)
    for name, label in (("command", "re-encoding"), ("cached", "--use-token-cache"), ("compiled", "--compile")):
        if name in med:
            ratio = f" -> {med['official'] / med[name]:.2f}x the official step" if "official" in med else ""
            print(f"  `{COMMAND}` ({label}) {med[name]:.3f} s (min {min(times[name]):.3f}){ratio}")
    print(f"  command: {command.shown(depth, cached=False)}")
    record: dict[str, Any] = {"tokenizer": source, **{f"{name}_s": v for name, v in times.items()}}
    if "official" in med:
        for name in ("compiled", "command", "cached"):
            if name in med:
                record[f"ratio_{name}"] = med["official"] / med[name]
    if "official_reuse" in med and "command" in med:
        record["ratio_command_vs_official_reuse"] = med["official_reuse"] / med["command"]
    return {**record, "command": command.shown(depth, cached=False), **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = ["sample_d4", "train_d4", "train_d8", "train_d16"]
    parser.add_argument("--case", choices=[*cases, "all"], default="all", help="all = sample_d4, train_d4, train_d8")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per case (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, also of the `trainlab train var` runs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N): the training cases' device")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="of every training variant")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="images per optimizer step")
    parser.add_argument(
        "--variants",
        default="",
        help=f"comma list of {','.join(VARIANTS)} ('': all on the CPU, all but official_reuse elsewhere)",
    )
    parser.add_argument("--tokenizer", choices=["ch32", "ch160"], default="ch32", help="see the module doc")
    parser.add_argument(
        "--train-images", type=int, default=24, help="fake images per run; steps per epoch = this // --batch-size"
    )
    parser.add_argument("--train-epochs", type=int, default=2, help="epochs per run; the engine does not time epoch 1")
    parser.add_argument(
        "--work-dir",
        default="",
        help="keep the tokenizer weights and the token cache here for later runs ('': a temporary folder)",
    )
    parser.add_argument("--json", default="auto", help="result file ('auto': results/var_<case>_<...>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    parser.add_argument("--official-worker", type=int, default=0, help=argparse.SUPPRESS)  # depth; internal
    parser.add_argument("--official-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--official-allocator", choices=["system", "reuse"], default="system", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.official_worker:
        torch.set_num_threads(args.threads)
        result = official_worker(
            args.official_worker,
            args.official_steps,
            Path(args.tokenizer_path),
            args.official_allocator,
            args.device,
            args.precision,
            args.batch_size,
        )
        print(json.dumps(result))
        return
    if args.train_images < args.batch_size or args.train_epochs < 2:
        parser.error(
            "--train-images must be >= --batch-size and --train-epochs >= 2 (the engine does not time epoch 1)"
        )
    cpu = torch.device(args.device).type == "cpu"
    default_variants = VARIANTS if cpu else VARIANTS[:-1]  # the host allocator policy is a CPU matter
    args.variants = [v for v in args.variants.split(",") if v] or list(default_variants)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose among {', '.join(VARIANTS)})")
    torch.set_num_threads(args.threads)
    run_cases = cases[:3] if args.case == "all" else [args.case]
    env = environment()
    gpu = "" if cpu else f"{env.get('gpu', 'no GPU')}, "
    print(
        f"{env['cpu_model']}, {env['machine']}; {gpu}torch {env['torch']}, {args.threads} threads, {args.device}, "
        f"{args.precision}, B={args.batch_size}; git {env['git_sha'][:12]}; "
        f"1-min load average {env['load_average_1min']}"
    )
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_var_")))
        tokenizer, source = write_tokenizer(work, args.tokenizer)
        command = TrainVarCommand(work, tokenizer, args)
        for case in run_cases:
            if case == "sample_d4":
                results[case] = report_sample(*case_sample(args.repeats), args.repeats)
                continue
            depth = int(case.split("_d")[1])
            times, extra = case_train(depth, args.repeats, command, tokenizer, args)
            results[case] = report_train(case, times, extra, command, source, args.repeats)
    env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(f"1-min load average at the end: {env['load_average_1min_at_end']}")
    where = f"cpu{args.threads}t" if cpu else args.device.replace(":", "")
    precision = "" if args.precision == "fp32" and cpu else args.precision  # CPU fp32: the names of earlier results
    path = result_path(args.json, "var", args.case, args.tokenizer, where, precision, args.label)
    write_result(path, {"environment": env, "config": settings(args), "results": results})


if __name__ == "__main__":
    main()
