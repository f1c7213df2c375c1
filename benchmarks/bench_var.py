"""CPU benchmark of VAR (fp32, 2 threads): sampling, and training steps as `trainlab train var` runs them, each
next to an official-style baseline (interleaved round by round, so machine load hits all variants alike).

    .venv/bin/python benchmarks/bench_var.py --label idlemachine      # all cases; JSON result in results/
    .venv/bin/python benchmarks/bench_var.py --case train_d4 --repeats 1 --train-images 8 --json ''   # smoke run

Cases (random weights with the official init; the reference timings of the official code on the 2-core development
machine are in ../shared/reference/var.md section 6, copied into `OFFICIAL_SECONDS`):
  sample_d4  d4, B=4 labels, cfg=1.5, top_k=900, top_p=0.95, seed 0; VAR + sampling + f_hat, no VQVAE decode
             (official: 1.06 s). Ours = `models.var.sample.generate`; the baseline follows the official algorithm:
             concatenating KV cache, head on 2B rows then CFG on logits, full-vocabulary sort for top-p,
             `torch.multinomial`. Both must give identical tokens.
  train_d4 / train_d8  B=8 training steps at 256 px (L = 680 tokens, V = 4096, code width 32), three variants:
    `trainlab train var`  THE NUMBER FOR THE RECIPE: the real command, run as a subprocess per round with
             `--dataset fake --batch-size 8 --epochs 2 --use-token-cache true` and a randomly initialised
             official-architecture tokenizer (ch=160, `--tokenizer-config official`, exported to the work folder:
             the command needs a weights file). Seconds per optimizer step = batch / the `images_per_second` of the
             `summary` row of its metrics.jsonl (the engine times the training loop only and excludes epoch 1; the
             token cache is built before it, once for all rounds). Everything the recipe and engine do per step is
             in it: teacher-forcing input from the cached tokens, forward, `F.cross_entropy`, token metrics,
             backward, grad-norm clip 2.0, AdamW (not fused on CPU: the recipe fuses only on CUDA), schedule,
             logging. Official reference for this work, tokens precomputed: 1.82 s / 10.28 s.
             With `--train-tokens encoded` the command encodes every batch with the ch=160 tokenizer instead (its
             default, no token cache); the official reference for that is one full `train_step` with tokenisation,
             15.7 s / 20.3 s (single runs).
    baseline  in process: the official op sequence (one SDPA call with the full L x L additive mask, F.normalize,
             in-place gamma multiply, per-sample lvl_embed lookup) + CE (1/L weights) + backward + clip 2.0 + fused
             AdamW, on precomputed teacher-forcing input: the workload of the official reference timing.
    model    in process: trainlab's VAR model in the same step as the baseline (same loss, same fused AdamW), to
             isolate the model's share of the difference.
Timing: in-process variants get one warm-up step, then `--repeats` rounds run baseline, model and the command,
alternating the order round by round; medians (and minima) reported. Sampling: one warm-up each, then `--repeats`
rounds interleaving baseline and ours.
"""

from __future__ import annotations

import argparse
import contextlib
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
from _env import environment, result_path, settings, write_result

from trainlab.models.var.blocks import MAX_LOG_SCALE_MUL, AdaLNSelfAttn, SelfAttention
from trainlab.models.var.loading import export_official
from trainlab.models.var.sample import filter_top_k_top_p_, generate
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B batch, L tokens, l tokens of one scale, C width, H heads, K head dim, V vocab, Cv code width.

# Official code on the 2-core development machine (../shared/reference/var.md section 6); training: tokens precomputed.
OFFICIAL_SECONDS = {"sample_d4": 1.06, "train_d4": 1.82, "train_d8": 10.28}
# Same source: one full official `VARTrainer.train_step` (tokenisation with the ch=160 encoder + VAR step), single run.
OFFICIAL_FULL_STEP_SECONDS = {"train_d4": 15.7, "train_d8": 20.3}
BATCH = 8
COMMAND = "trainlab train var"


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


# ------------------------------------------------------------------------------ `trainlab train var` as run
class TrainVarCommand:
    """Runs the real `trainlab train var` command in a subprocess and reads its seconds per optimizer step.

    `work` holds the tokenizer weights, the token cache (built by the first run and reused by the rest: its
    fingerprint does not depend on the depth) and the run directories (deleted after each run: checkpoints are big).
    """

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args, self.runs = work, args, 0
        self.tokenizer = work / "tokenizer_ch160_random.pth"
        if not self.tokenizer.exists():
            with torch.random.fork_rng(devices=[]):  # the in-process variants' initialisation stays as it was
                torch.manual_seed(0)
                export_official(VQVAE(VQVAEConfig.official()), self.tokenizer)

    def argv(self, depth: int, run_dir: Path) -> list[str]:
        a = self.args
        flags: dict[str, object] = {
            "--run-dir": run_dir,
            "--device": "cpu",
            "--precision": "fp32",
            "--depth": depth,
            "--batch-size": BATCH,
            "--epochs": a.train_epochs,
            "--dataset": "fake",
            "--fake-num-images": a.train_images,
            "--tokenizer": self.tokenizer,
            "--tokenizer-config": "official",
            "--use-token-cache": a.train_tokens == "cached",
        }
        if a.train_tokens == "cached":
            # one cache per image count: a cache built for another --train-images would be refused as stale
            flags["--token-cache-path"] = self.work / f"token_cache_{a.train_images}images"
        flags.update(
            {
                "--eval-batch-size": BATCH,  # also the encoder's batch while the cache is built (bounded memory)
                "--num-workers": 0,
                "--export": False,
                "--tensorboard": False,
                "--progress": False,
            }
        )
        out = [sys.executable, "-m", "trainlab", *COMMAND.split()[1:]]
        for flag, value in flags.items():
            out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        return out

    def shown(self, depth: int) -> str:
        """The command as a user types it, with the work folder written $WORK."""
        argv = self.argv(depth, self.work / f"run_d{depth}")
        return shlex.join(["trainlab", *argv[3:]]).replace(str(self.work), "$WORK")

    def seconds_per_step(self, depth: int) -> tuple[float, dict[str, Any]]:
        run_dir = self.work / f"run_d{depth}_{self.runs}"
        self.runs += 1
        threads = str(self.args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        t0 = time.perf_counter()
        proc = subprocess.run(self.argv(depth, run_dir), env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            raise SystemExit(f"`{self.shown(depth)}` failed with exit code {proc.returncode}:\n{tail}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        summary = [row for row in rows if row["kind"] == "summary"][-1]
        shutil.rmtree(run_dir)
        seconds = BATCH / summary["images_per_second"]  # = seconds_per_epoch / steps per epoch
        record = {
            "seconds_per_step": seconds,
            "seconds_per_epoch": summary["seconds_per_epoch"],
            "epochs_timed": summary["epochs_timed"],
            "process_wall_s": wall,
        }
        return seconds, record


def case_train(
    depth: int, repeats: int, command: TrainVarCommand
) -> tuple[dict[str, list[float]], str, list[dict[str, Any]]]:
    torch.manual_seed(0)
    var = VAR(VARConfig.from_depth(depth)).train()
    B, L = BATCH, var.seq_len
    x_BLCv = torch.randn(B, L - 1, var.cfg.vae_embed_dim)
    label_B, gt_BL = torch.randint(0, 1000, (B,)), torch.randint(0, var.vocab_size, (B, L))
    opt = torch.optim.AdamW(var.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05, fused=True)

    def loss_fn(logits_BLV: torch.Tensor, target_BL: torch.Tensor) -> torch.Tensor:
        """The official loss, as the recipe computes it: per-token F.cross_entropy, weights 1/L, batch mean."""
        ce_BL = F.cross_entropy(logits_BLV.view(-1, var.vocab_size), target_BL.view(-1), reduction="none")
        return ce_BL.view(B, L).mul(1.0 / L).sum(dim=-1).mean()

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], float]:
        def timed() -> float:
            t0 = time.perf_counter()
            loss_fn(forward(), gt_BL).backward()
            torch.nn.utils.clip_grad_norm_(var.parameters(), 2.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        return timed

    var.eval()
    with torch.no_grad():
        ref_BLV, ours_BLV = baseline_forward(var, label_B, x_BLCv, 0.0), var(label_B, x_BLCv, cond_drop_rate=0.0)
    var.train()
    records: list[dict[str, Any]] = []

    def run_command() -> float:
        seconds, record = command.seconds_per_step(depth)
        records.append(record)
        return seconds

    variants: dict[str, Callable[[], float]] = {
        "baseline": step(lambda: baseline_forward(var, label_B, x_BLCv)),
        "model": step(lambda: var(label_B, x_BLCv)),
        "train_var_command": run_command,
    }
    variants["baseline"](), variants["model"]()  # warm-up; the command's first epoch is excluded by the engine
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(variants[name]())
    note = f"eval logits max |model - baseline| = {(ours_BLV - ref_BLV).abs().max():.1e}"
    return times, note, records


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
    case: str,
    times: dict[str, list[float]],
    note: str,
    runs: list[dict[str, Any]],
    shown: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    base, model = statistics.median(times["baseline"]), statistics.median(times["model"])
    cmd = statistics.median(times["train_var_command"])
    cached = args.train_tokens == "cached"
    off = (OFFICIAL_SECONDS if cached else OFFICIAL_FULL_STEP_SECONDS)[case]
    print(f"\n{case}: B=8, 256 px, seconds per optimizer step, medians of {args.repeats} rounds; {note}")
    print(
        f"  what `{COMMAND}` runs ({args.train_tokens} tokens): {cmd:.3f} s (min {min(times['train_var_command']):.3f})"
        f" | official reference {off:.2f} s -> {off / cmd:.2f}x"
        + (f" | in-process baseline -> {base / cmd:.2f}x" if cached else " (in-process variants exclude tokenisation)")
    )
    print(
        f"  in process: baseline {base:.3f} s (min {min(times['baseline']):.3f}) | model {model:.3f} s "
        f"(min {min(times['model']):.3f}) -> model vs baseline {base / model:.2f}x"
    )
    print(f"  command: {shown}")
    return {
        "official_s": off,
        "official_reference": "VAR step, tokens precomputed" if cached else "full train_step with tokenisation",
        "train_var_command_s_per_step": times["train_var_command"],
        "train_var_command": shown,
        "train_var_command_runs": runs,
        "baseline_s": times["baseline"],
        "model_s": times["model"],
        "note": note,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["sample_d4", "train_d4", "train_d8", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per case (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, also of the `trainlab train var` runs")
    parser.add_argument(
        "--train-tokens",
        choices=["cached", "encoded"],
        default="cached",
        help="`trainlab train var` with --use-token-cache (tokens precomputed, as in the official reference timing) "
        "or encoding every batch with the ch=160 tokenizer (the command's default; ~13 s per step on 2 CPU threads)",
    )
    parser.add_argument("--train-images", type=int, default=24, help="fake images per run; steps per epoch = this / 8")
    parser.add_argument("--train-epochs", type=int, default=2, help="epochs per run; the engine does not time epoch 1")
    parser.add_argument(
        "--work-dir",
        default="",
        help="keep the tokenizer weights and the token cache here for later runs ('': a temporary folder)",
    )
    parser.add_argument("--json", default="auto", help="result file ('auto': results/var_<case>_<...>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run (e.g. idlemachine), in the auto name")
    args = parser.parse_args()
    if args.train_images < BATCH or args.train_epochs < 2:
        parser.error(f"--train-images must be >= {BATCH} and --train-epochs >= 2 (the engine does not time epoch 1)")
    torch.set_num_threads(args.threads)
    cases = ["sample_d4", "train_d4", "train_d8"] if args.case == "all" else [args.case]
    env = environment()
    print(
        f"{env['cpu_model']}, {env['machine']}; torch {env['torch']}, {args.threads} threads, fp32; "
        f"git {env['git_sha'][:12]}; 1-min load average {env['load_average_1min']}"
    )
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_var_")))
        command = TrainVarCommand(work, args) if any(c.startswith("train") for c in cases) else None
        for case in cases:
            if case == "sample_d4":
                results[case] = report_sample(*case_sample(args.repeats), args.repeats)
                continue
            assert command is not None
            depth = int(case[-1])
            results[case] = report_train(case, *case_train(depth, args.repeats, command), command.shown(depth), args)
    env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(f"1-min load average at the end: {env['load_average_1min_at_end']}")
    tokens = f"{args.train_tokens}tokens" if args.case != "sample_d4" else ""
    path = result_path(args.json, "var", args.case, tokens, f"cpu{args.threads}t", args.label)
    write_result(path, {"environment": env, "config": settings(args), "results": results})


if __name__ == "__main__":
    main()
