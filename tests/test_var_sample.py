"""VAR sampling: the official seeded sample, the fast CPU sampler vs the official filter + multinomial, argument
checks, and the `trainlab sample` command on a tiny checkpoint pair."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from trainlab.errors import UsageError
from trainlab.models.var.convert import export_official
from trainlab.models.var.sample import (
    cpu_multinomial_is_exponential_argmax,
    filter_top_k_top_p_,
    generate,
    sample_images,
    sample_scale,
    sample_tokens,
)
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B images, l tokens of one scale, V vocab, N images in total.


@pytest.fixture(scope="module")
def debug_models() -> tuple[Any, VAR]:
    torch.manual_seed(0)
    return VQVAE(VQVAEConfig.debug()).freeze(), VAR(VARConfig.debug()).eval()


def test_seeded_sample_matches_official(fx: dict[str, Any]) -> None:
    var = VAR(VARConfig.from_depth(4))
    var.load_state_dict(fx["var_state_dict"], strict=True)
    vqvae = VQVAE.from_state_dict(fx["vae_state_dict"]).freeze()
    args = fx["meta"]["ar_args"]
    assert (args["g_seed"], args["cfg"], args["top_k"], args["top_p"]) == (0, 1.5, 900, 0.95)
    guided: dict[int, torch.Tensor] = {}
    samples = generate(
        var.train(),  # sampling must switch to eval (no DropPath) and restore the mode
        vqvae,
        args["label_B"],
        seed=0,
        cfg=1.5,
        top_k=900,
        top_p=0.95,
        logits_hook=lambda si, logits_BlV: guided.__setitem__(si, logits_BlV.clone()),
    )
    assert var.training
    assert all(torch.equal(ours, ref) for ours, ref in zip(samples.tokens, fx["ar_idx_Bl"]))
    first4 = torch.cat([guided[si] for si in range(4)], dim=1)
    assert (first4 - fx["ar_logits_guided_first4"]).abs().max() <= 1e-4
    img_B3HW = vqvae.fhat_to_img(samples.f_hat).add(1).mul(0.5)
    assert (img_B3HW - fx["ar_img"]).abs().max() <= 1e-4
    assert torch.equal(vqvae.quantize.idx_to_fhat(samples.tokens), samples.f_hat)


def test_fast_sampler_equals_official_filter_and_multinomial() -> None:
    assert cpu_multinomial_is_exponential_argmax()
    gen = torch.Generator().manual_seed(123)
    for trial in range(48):
        B, l, V = 2, (1, 9, 40)[trial % 3], (64, 4096, 300)[trial % 3]
        logits_BlV = torch.randn(B, l, V, generator=gen) * (0.1, 1.0, 5.0, 20.0)[trial % 4]
        if trial % 3 == 0:  # many exact ties, at the top-k cut and across the top-p cut
            logits_BlV = (logits_BlV * 4).round() / 4
        top_k = min((1, 5, 50, 900)[trial % 4], V - 1)
        top_p = (1.0, 0.95, 0.5, 0.1)[(trial // 4) % 4]
        g_fast, g_ref = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        fast_Bl, _ = sample_scale(logits_BlV, g_fast, top_k=top_k, top_p=top_p)
        probs_NV = filter_top_k_top_p_(logits_BlV.reshape(-1, V).clone(), top_k, top_p).softmax(-1)
        ref_Bl = torch.multinomial(probs_NV, 1, replacement=True, generator=g_ref).view(B, l)
        assert torch.equal(fast_Bl, ref_Bl), (trial, top_k, top_p)
        assert torch.equal(g_fast.get_state(), g_ref.get_state())


def test_filter_semantics() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 2.0, 3.0, -1.0]])
    kept = filter_top_k_top_p_(logits.clone(), 3, 1.0) > -torch.inf
    assert kept.tolist() == [[False, False, True, True, True, False]]  # ties at the k-th value survive
    probs = torch.tensor([[0.05, 0.15, 0.3, 0.5]]).log()
    assert (filter_top_k_top_p_(probs.clone(), 0, 0.6) > -torch.inf).tolist() == [[False, False, True, True]]
    assert (filter_top_k_top_p_(probs.clone(), 0, 0.01) > -torch.inf).tolist() == [[False, False, False, True]]


def test_more_smooth_still_draws_the_multinomial(debug_models: tuple[Any, VAR]) -> None:
    vqvae, var = debug_models
    plain = generate(var, vqvae, [1, 2], seed=5, cfg=2.0, top_k=20, top_p=0.9)
    smooth = generate(var, vqvae, [1, 2], seed=5, cfg=2.0, top_k=20, top_p=0.9, more_smooth=True)
    assert torch.equal(plain.tokens[0], smooth.tokens[0])  # same first draw from the same stream
    assert not torch.equal(plain.f_hat, smooth.f_hat)  # but soft code mixing changes f_hat
    again = generate(var, vqvae, [1, 2], seed=5, cfg=2.0, top_k=20, top_p=0.9, more_smooth=True)
    assert torch.equal(smooth.f_hat, again.f_hat)


def test_sample_api_and_validation(debug_models: tuple[Any, VAR]) -> None:
    vqvae, var = debug_models
    tokens = sample_tokens(var, vqvae, [0, 999, 1000], seed=3, cfg=1.5, top_k=0, top_p=1.0)
    assert [tuple(t.shape) for t in tokens] == [(3, pn * pn) for pn in var.patch_nums]
    assert all(t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < var.vocab_size for t in tokens)
    img_B3HW = sample_images(var, vqvae, [0, 999, 1000], seed=3, cfg=1.5, top_k=0, top_p=1.0)
    assert img_B3HW.shape == (3, 3, 16, 16) and float(img_B3HW.min()) >= 0.0 and float(img_B3HW.max()) <= 1.0
    assert not torch.equal(tokens[-1], sample_tokens(var, vqvae, [0, 999, 1000], seed=4, top_k=0, top_p=1.0)[-1])
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(labels_B=[1001]), "out of range"),
        (dict(labels_B=[-1]), "out of range"),
        (dict(cfg=-0.5), "cfg"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ]
    for kwargs, pattern in cases:
        call: dict[str, Any] = {"labels_B": [1], "seed": 0, "cfg": 1.5, "top_k": 5, "top_p": 0.9, **kwargs}
        with pytest.raises(UsageError, match=pattern):
            sample_tokens(var, vqvae, **call)
    other = VQVAE(VQVAEConfig(**{**vars(VQVAEConfig.debug()), "vocab_size": 32}))
    with pytest.raises(UsageError, match="does not match VAR"):
        sample_tokens(var, VQVAE.freeze(other), [1], seed=0)
    assert not var.kv_cache_enabled
    with pytest.raises(RuntimeError, match="enable_kv_cache"):
        var.forward_cached(torch.zeros(1, 1, var.embed_dim), torch.zeros(1, var.embed_dim))


# -------------------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def ckpts(tmp_path: Path, debug_models: tuple[Any, VAR]) -> tuple[Path, Path]:
    vqvae, var = debug_models
    return export_official(vqvae, tmp_path / "vae.safetensors"), export_official(var, tmp_path / "var.pth")


def test_cli_grid_and_tokens(ckpts: tuple[Path, Path], tmp_path: Path, debug_models: tuple[Any, VAR]) -> None:
    from trainlab.commands.sample import main

    vae, var_path = ckpts
    argv = ["--tokenizer-weights", str(vae), "--var-weights", str(var_path), "--classes", "1", "500", "999"]
    argv += ["--seed", "42", "--guidance", "3.0", "--top-k", "600", "--top-p", "0.9", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "grid.png"), "--save-tokens", str(tmp_path / "tokens.pt")]) == 0
    grid = Image.open(tmp_path / "grid.png")
    assert grid.size == (2 + 3 * 18, 2 + 18) and grid.mode == "RGB"
    tokens = torch.load(tmp_path / "tokens.pt", weights_only=True)
    vqvae, var = debug_models
    assert isinstance(tokens, list) and len(tokens) == len(var.patch_nums)
    assert [tuple(t.shape) for t in tokens] == [(3, pn, pn) for pn in var.patch_nums]
    expected = sample_tokens(var, vqvae, [1, 500, 999], seed=42, cfg=3.0, top_k=600, top_p=0.9)
    assert all(torch.equal(t.flatten(1), e) for t, e in zip(tokens, expected))


def test_cli_fast_decode_is_the_official_image_within_a_rounding_step(
    ckpts: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default decoder (NHWC, SDPA, sub-pixel upsample) and `--fast-decode false` (official arithmetic) write
    the same PNG up to one 1/255 step, and the command logs its time per phase."""
    from trainlab.commands.sample import main

    vae, var_path = ckpts
    argv = ["--tokenizer-weights", str(vae), "--var-weights", str(var_path), "--classes", "3", "7", "--seed", "1"]
    argv += ["--device", "cpu"]
    with caplog.at_level("INFO", logger="trainlab.commands.sample"):
        assert main([*argv, "--out", str(tmp_path / "fast.png")]) == 0
    assert main([*argv, "--out", str(tmp_path / "plain.png"), "--fast-decode", "false"]) == 0
    fast = np.asarray(Image.open(tmp_path / "fast.png"), dtype=np.int16)
    plain = np.asarray(Image.open(tmp_path / "plain.png"), dtype=np.int16)
    assert np.abs(fast - plain).max() <= 1
    phases = next(r.getMessage() for r in caplog.records if "time per phase" in r.getMessage())
    assert all(f"{name} " in phases for name in ("startup", "load", "tokens", "decode", "write", "total"))
    assert any("2 images sampled and decoded" in r.getMessage() for r in caplog.records)


def test_cli_out_dir_npz_and_resume(ckpts: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from trainlab.commands.sample import main

    vae, var_path = ckpts
    out_dir = tmp_path / "samples"
    argv = ["--tokenizer-weights", str(vae), "--var-weights", str(var_path), "--classes", "3", "7"]
    argv += ["--samples-per-class", "3", "--batch-size", "4", "--out-dir", str(out_dir), "--device", "cpu"]
    assert main(argv) == 0
    pngs = sorted(out_dir.glob("*.png"))
    assert [p.name for p in pngs][:4] == [
        "000000_c0003.png",
        "000001_c0003.png",
        "000002_c0003.png",
        "000003_c0007.png",
    ]
    arr = np.load(out_dir / "samples.npz")["arr_0"]
    assert arr.shape == (6, 16, 16, 3) and arr.dtype == np.uint8
    assert np.load(out_dir / "samples.npz")["arr_1"].tolist() == [3, 3, 3, 7, 7, 7]  # labels, OpenAI's layout
    assert np.array_equal(arr[4], np.asarray(Image.open(pngs[4])))
    first = pngs[0].stat().st_mtime_ns
    pngs[5].unlink()  # an interrupted run: the second batch (images 4, 5) is redone, the first skipped
    assert main(argv) == 0
    assert "(4 already there)" in capsys.readouterr().out
    assert pngs[0].stat().st_mtime_ns == first and pngs[5].is_file()
    assert np.array_equal(np.load(out_dir / "samples.npz")["arr_0"], arr)


def test_cli_errors(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    from trainlab.commands.sample import main

    vae, var_path = ckpts
    base = ["--tokenizer-weights", str(vae), "--var-weights", str(var_path)]
    grid = ["--out", str(tmp_path / "g.png")]
    cases = [
        ([*base, "--classes", "1"], "nothing to write"),
        ([*base, "--classes", "1", "2000", "--out", str(tmp_path / "g.png")], "out of range"),
        ([*base, "--classes", "cat", "--out", str(tmp_path / "g.png")], "integers"),
        (
            [*base, "--classes", "1", "--top-p", "0", "--out", str(tmp_path / "g.png")],
            r"--top-p must be in \(0, 1\], got 0",
        ),
        ([*base, "--classes", "1", "--out", str(tmp_path / "g.jpg")], r"\.png"),
        (["--tokenizer-weights", str(var_path), "--var-weights", str(vae), "--classes", "1", *grid], "not a"),
        ([*base, "--out", str(tmp_path / "g.png")], "--classes"),
    ]
    for argv, pattern in cases:
        with pytest.raises(UsageError, match=pattern):
            main(argv)


def test_cli_former_flags_current_flags_and_yaml_agree(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The former short flags (--vae, --var, --cfg, --n-per-class) still set the fields, each with a warning naming
    the current flag; YAML uses the field names (and accepts the former ones, with a warning)."""
    from trainlab.commands.sample import SampleConfig
    from trainlab.config import parse

    former = ["--vae", "a.pth", "--var", "b.pth", "--classes", "all", "--n-per-class", "2", "--cfg", "3"]
    former += ["--out", "g.png"]
    current = ["--tokenizer-weights", "a.pth", "--var-weights", "b.pth", "--classes", "all"]
    current += ["--samples-per-class", "2", "--guidance", "3", "--out", "g.png"]
    (tmp_path / "sample.yaml").write_text(
        "tokenizer_weights: a.pth\nvar_weights: b.pth\nclasses: all\nsamples_per_class: 2\nguidance: 3\nout: g.png\n"
    )
    (tmp_path / "former.yaml").write_text("vae_weights: a.pth\nvar_weights: b.pth\nclasses: all\nout: g.png\n")
    with caplog.at_level(logging.WARNING):
        configs = [parse(SampleConfig, argv, prog="trainlab sample") for argv in (former, current)]
    warned = [r.getMessage() for r in caplog.records]
    for old, new in (("--vae", "--tokenizer-weights"), ("--var", "--var-weights"), ("--cfg", "--guidance")):
        assert any(m.startswith(f"{old} is the former spelling of {new}") for m in warned), (old, warned)
    configs.append(parse(SampleConfig, ["--config", str(tmp_path / "sample.yaml")], prog="trainlab sample"))
    assert configs[0] == configs[1] == configs[2]
    with caplog.at_level(logging.WARNING):
        from_former_yaml = parse(SampleConfig, ["--config", str(tmp_path / "former.yaml")], prog="trainlab sample")
    assert from_former_yaml.tokenizer_weights == Path("a.pth")
    assert "'vae_weights' is the former name of 'tokenizer_weights'" in caplog.text
    assert (configs[0].classes, configs[0].guidance, configs[0].samples_per_class) == (["all"], 3.0, 2)
