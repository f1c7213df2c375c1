"""The VAR training recipe: --debug resume check, the loss against a hand computation, label smoothing, no-decay
groups, lr scaling, the token cache, image folders with broken files, class-count errors, fp16 accumulation, the
shipped configs, progressive training and the export. Tiny models on CPU (debug VAR + a random debug tokenizer)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainlab.cli import main
from trainlab.config import load_yaml, parse
from trainlab.data.config import DataConfig
from trainlab.data.image_folder import ImageFolderDataset, scan_image_folder
from trainlab.data.sources import open_split
from trainlab.data.tensors import TensorImageDataset
from trainlab.data.token_cache import (
    TokenCacheDataset,
    TokenCacheSpec,
    build_token_cache,
    check_token_cache,
    encode_batch,
    ensure_token_cache,
    tokenizer_sha256,
)
from trainlab.data.transforms import VarResizeCrop
from trainlab.engine.debug import debug_run_config, run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.engine.recipe import StepInfo
from trainlab.errors import UsageError
from trainlab.models.var.convert import VAR_EXPORT_PTH, VAR_EXPORT_SAFETENSORS, load_tokenizer
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, vqvae_config
from trainlab.optim.param_groups import no_weight_decay, param_groups
from trainlab.recipes.var import VarData, VARRecipe, VARTrainConfig, export_run
from trainlab.recipes.var_progressive import ProgressiveSchedule

# Shape legend: B batch, L tokens of all scales (30 for patch_nums 1,2,3,4), V vocabulary (64).

REPO = Path(__file__).resolve().parents[1]
PATCH_NUMS = (1, 2, 3, 4)
CPU = torch.device("cpu")


def _cfg(run_dir: Path, **kw: object) -> VARTrainConfig:
    tiny = debug_run_config(VARRecipe(VARTrainConfig(run_dir=run_dir)))
    assert isinstance(tiny, VARTrainConfig)
    return dataclasses.replace(tiny, run_dir=run_dir, tensorboard=False, progress=False, **kw)  # type: ignore[arg-type]


def _rows(run_dir: Path, kind: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _images(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# ------------------------------------------------------------------------------------------- debug + export


def test_debug_check_passes_and_exports_official_format(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    report = run_debug_check(VARRecipe, VARRecipe(cfg), tmp_path / "debug")
    assert report.passed, report.line()
    run = tmp_path / "debug" / "resumed"
    from trainlab.models.var.convert import build_var, read_state_dict

    final = torch.load(run / "ckpt" / "last.pt", weights_only=True)["models"]["var"]
    for name in (VAR_EXPORT_PTH, VAR_EXPORT_SAFETENSORS):
        exported = build_var(read_state_dict(run / name, "VAR"))  # the official-format loader infers the shape
        assert exported.cfg.depth == 2 and exported.cfg.patch_nums == PATCH_NUMS
        for key, value in exported.state_dict().items():
            assert torch.equal(value, final[key]), key
    (run / VAR_EXPORT_PTH).unlink()
    pth, _ = export_run(run)
    assert pth.is_file()
    rows = _rows(run, "train")
    assert {
        "cross_entropy_mean",
        "cross_entropy_last_scale",
        "token_accuracy_mean",
        "token_accuracy_last_scale",
    } <= set(rows[0])
    assert "cross_entropy_scale_3" in rows[0] and "val_cross_entropy_scale_0" in _rows(run, "eval")[-1]


def test_an_ema_of_var_is_checkpointed_resumed_and_what_the_export_holds(tmp_path: Path) -> None:
    """--model-ema-decay: the engine keeps `var_ema`; the debug check resumes it bit for bit, and the export (at the
    end of training and from the checkpoint) holds the averaged weights, not the trained ones."""
    cfg = _cfg(tmp_path, model_ema_decay=0.5)
    report = run_debug_check(VARRecipe, VARRecipe(cfg), tmp_path / "debug")
    assert report.passed and report.averaged_identical, report.line()
    run = tmp_path / "debug" / "resumed"
    state = torch.load(run / "ckpt" / "last.pt", weights_only=True)
    average = state["averaged"]["var_ema"]
    assert average["follows"] == "var" and average["decay"] == 0.5
    trained = state["models"]["var"]
    assert any(not torch.equal(trained[k], v) for k, v in average["weights"].items())
    from trainlab.models.var.convert import read_state_dict

    for exported in (read_state_dict(run / VAR_EXPORT_PTH, "VAR"), read_state_dict(export_run(run)[0], "VAR")):
        assert all(torch.equal(exported[k], v) for k, v in average["weights"].items())


def test_init_from_official_weights_loads_them_strictly(tmp_path: Path) -> None:
    """Fine-tuning: `--init-from var_d*.pth` (official format) replaces the fresh init; a wrong depth names the fix."""
    from trainlab.models.var.convert import export_official

    _, source, _ = _built(tmp_path / "source")
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))  # anything but the seed's init
    export_official(source, tmp_path / "var_official.pth")
    _, tuned, _ = _built(tmp_path / "tuned", init_from=str(tmp_path / "var_official.pth"))
    for key, value in source.state_dict().items():
        assert torch.equal(tuned.state_dict()[key], value), key
    deeper = dataclasses.replace(_cfg(tmp_path / "deeper"), depth=3, init_from=str(tmp_path / "var_official.pth"))
    with pytest.raises(UsageError, match="has depth=2 but this run builds 3; set --depth 2"):
        VARRecipe(deeper).build(CPU)


# ------------------------------------------------------------------------------------------------- the loss


STEP0 = StepInfo(step=0, total_steps=1, steps_per_epoch=1)


def _built(tmp_path: Path, **kw: object) -> tuple[VARRecipe, VAR, VQVAE]:
    """The recipe, its VAR (eval: no class dropout, so the forward is deterministic) and its frozen tokenizer."""
    recipe = VARRecipe(_cfg(tmp_path, **kw))
    torch.manual_seed(0)
    parts = recipe.build(CPU)
    var, tokenizer = parts.models["var"], parts.frozen["tokenizer"]
    assert isinstance(var, VAR) and isinstance(tokenizer, VQVAE)
    return recipe, var.eval(), tokenizer


def test_loss_equals_hand_computed_mean_token_cross_entropy(tmp_path: Path) -> None:
    recipe, var, tokenizer = _built(tmp_path)
    img_B3HW, label_B = _images(), torch.tensor([0, 3, 3, 9])
    out = recipe.train_step({"var": var, "tokenizer": tokenizer}, {"image": img_B3HW, "label": label_B}, "main", STEP0)

    idx_list = tokenizer.img_to_idx(img_B3HW)
    target_BL = torch.cat(idx_list, dim=1)
    logits_BLV = var(label_B, tokenizer.quantize.idx_to_var_input(idx_list))
    B, L, V = logits_BLV.shape
    assert (B, L, V) == (4, 30, 64)
    nll_BL = logits_BLV.logsumexp(-1) - logits_BLV.gather(-1, target_BL.unsqueeze(-1)).squeeze(-1)
    expected = sum(float(nll_BL[b].detach().sum()) / L for b in range(B)) / B  # weight 1/L per token, mean over images
    assert float(out["loss"].detach()) == pytest.approx(expected, rel=1e-5)
    assert float(out["cross_entropy_last_scale"]) == pytest.approx(float(nll_BL[:, -16:].detach().mean()), rel=1e-5)
    correct_BL = (logits_BLV.argmax(-1) == target_BL).float()
    assert float(out["token_accuracy_mean"]) == pytest.approx(float(correct_BL.mean()))
    assert float(out["token_accuracy_scale_1"]) == pytest.approx(float(correct_BL[:, 1:5].mean()))
    out["loss"].backward()  # the loss carries gradients to VAR only
    assert var.head.weight.grad is not None
    assert all(p.grad is None for p in tokenizer.parameters())


def test_label_smoothing_changes_the_loss_but_not_the_logged_cross_entropy(tmp_path: Path) -> None:
    plain, var, tokenizer = _built(tmp_path / "a")
    with torch.no_grad():
        var.head.weight.mul_(200.0)  # peaked predictions (at init they are near-uniform, where smoothing is moot)
    smooth = VARRecipe(_cfg(tmp_path / "b", label_smoothing=0.1))
    models = {"var": var, "tokenizer": tokenizer}  # same frozen tokenizer and the same VAR weights
    batch = {"image": _images(), "label": torch.tensor([1, 2, 3, 4])}
    a = plain.train_step(models, batch, "main", STEP0)
    b = smooth.train_step(models, batch, "main", STEP0)
    assert float(b["cross_entropy_mean"]) == float(a["cross_entropy_mean"]) == pytest.approx(float(a["loss"].detach()))
    assert abs(float(b["loss"].detach()) - float(a["loss"].detach())) > 0.05

    idx_list = tokenizer.img_to_idx(batch["image"])
    logits_BLV = var(batch["label"], tokenizer.quantize.idx_to_var_input(idx_list))
    logp_BLV = logits_BLV.log_softmax(-1)
    nll_BL = -logp_BLV.gather(-1, torch.cat(idx_list, 1).unsqueeze(-1)).squeeze(-1)
    smoothed = (0.9 * nll_BL + 0.1 * -logp_BLV.mean(-1)).mean()  # torch's definition of label smoothing
    assert float(b["loss"].detach()) == pytest.approx(float(smoothed.detach()), rel=1e-5)


# --------------------------------------------------------------------------------------- optimizer settings


def _expected_no_decay(depth: int, shared: bool) -> set[str]:
    names = {"pos_start", "pos_1LC", "lvl_embed.weight", "word_embed.bias", "head_nm.ada_lin.1.bias", "head.bias"}
    per_block = ["attn.scale_mul_1H11", "attn.q_bias", "attn.v_bias", "attn.proj.bias", "ffn.fc1.bias", "ffn.fc2.bias"]
    per_block += ["ada_gss"] if shared else ["ada_lin.1.bias"]
    if shared:
        names.add("shared_ada_lin.1.bias")
    return names | {f"blocks.{i}.{n}" for i in range(depth) for n in per_block}


@pytest.mark.parametrize("shared", [False, True])
def test_no_decay_groups_hold_exactly_the_official_names(shared: bool) -> None:
    var = VAR(dataclasses.replace(VARConfig.debug(), shared_adaln=shared))
    named = dict(var.named_parameters())
    no_decay = {n for n, p in named.items() if no_weight_decay(n, p)}
    assert no_decay == _expected_no_decay(2, shared)
    assert {"class_emb.weight", "word_embed.weight", "head.weight", "blocks.1.attn.mat_qkv.weight"}.isdisjoint(no_decay)
    decay_group, no_decay_group = param_groups(var, 0.05, 1e-3)
    assert decay_group["weight_decay"] == 0.05 and no_decay_group["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay_group["params"]}
    assert ids == {id(named[n]) for n in no_decay}
    assert len(decay_group["params"]) + len(no_decay_group["params"]) == len(named)


def test_learning_rate_is_base_times_batch_over_256(tmp_path: Path) -> None:
    optim = VARTrainConfig().optim
    assert optim.peak_lr(768) == pytest.approx(3e-4)
    assert dataclasses.replace(optim, base_learning_rate=8e-5).peak_lr(1024) == pytest.approx(3.2e-4)
    recipe = VARRecipe(_cfg(tmp_path, batch_size=16, optim=dataclasses.replace(optim, base_learning_rate=2e-3)))
    optimizer = recipe.build(CPU).phases[0].optimizer
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-3 * 16 / 256] * 2)
    assert optimizer.defaults["betas"] == (0.9, 0.95)


# ----------------------------------------------------------------------------------------------- token cache


def test_token_cache_round_trip_and_stale_fingerprints(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("", "vqvae_debug", PATCH_NUMS, seed=0)
    fake = open_split(DataConfig(kind="fake", fake_size=24), "train", VarResizeCrop(16), fake_classes=4)
    assert fake is not None and isinstance(fake.images, TensorImageDataset)
    data = fake.images
    desc = {"kind": "fake", "size": 24}
    spec = TokenCacheSpec(tokenizer_sha256(tokenizer), PATCH_NUMS, 30, 64, desc)
    cache = build_token_cache(tmp_path / "c", spec, [data], tokenizer, device=CPU, batch_size=5)
    expected_NL = encode_batch(tokenizer, data.images_N3HW)
    assert torch.equal(torch.stack([cache.tokens(i) for i in range(24)]), expected_NL)
    assert np.load(tmp_path / "c" / "tokens.npy", mmap_mode="r").dtype == np.int16
    assert cache.labels.tolist() == data.labels_N.tolist()
    assert check_token_cache(tmp_path / "c", spec) == ("ok", [])

    other = load_tokenizer("", "vqvae_debug", PATCH_NUMS, seed=1)  # different weights
    stale = TokenCacheSpec(tokenizer_sha256(other), PATCH_NUMS, 30, 64, desc)
    assert check_token_cache(tmp_path / "c", stale) == ("stale", ["tokenizer_sha256"])
    grown = dataclasses.replace(spec, dataset={"kind": "fake", "size": 25})
    assert check_token_cache(tmp_path / "c", grown) == ("stale", ["dataset.size"])
    with pytest.raises(UsageError, match="it differs in: tokenizer_sha256"):
        ensure_token_cache(tmp_path / "c", stale, lambda: [data], other, on_stale="refuse", device=CPU)
    rebuilt = ensure_token_cache(tmp_path / "c", stale, lambda: [data], other, on_stale="rebuild", device=CPU)
    assert torch.equal(rebuilt.tokens(5), encode_batch(other, data.images_N3HW[5:6])[0])
    assert check_token_cache(tmp_path / "c", stale) == ("ok", [])
    dataset = TokenCacheDataset(rebuilt)
    assert dataset[3]["tokens"].shape == (30,) and dataset[3]["tokens"].dtype == torch.int64


def test_a_folder_that_is_not_a_token_cache_is_refused_and_kept(tmp_path: Path) -> None:
    """A cache is built into a new folder and moved into place, replacing what is there: only ever a cache."""
    tokenizer = load_tokenizer("", "vqvae_debug", PATCH_NUMS, seed=0)
    fake = open_split(DataConfig(kind="fake", fake_size=8), "train", VarResizeCrop(16), fake_classes=4)
    assert fake is not None
    spec = TokenCacheSpec(tokenizer_sha256(tokenizer), PATCH_NUMS, 30, 64, {"kind": "fake", "size": 8})
    user = tmp_path / "photos"
    (user / "cat").mkdir(parents=True)
    (user / "cat" / "0.png").write_bytes(b"precious")
    (tmp_path / "notes.txt").write_text("precious")
    for path in (user, tmp_path / "notes.txt"):
        for on_stale in ("rebuild", "refuse"):
            with pytest.raises(UsageError, match=r"is not a token cache|is a file, not a folder"):
                ensure_token_cache(path, spec, lambda: [fake.images], tokenizer, on_stale=on_stale, device=CPU)
    with pytest.raises(UsageError, match="is not a token cache"):
        build_token_cache(user, spec, [fake.images], tokenizer, device=CPU)
    assert (user / "cat" / "0.png").read_bytes() == b"precious" and (tmp_path / "notes.txt").read_text() == "precious"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        ensure_token_cache(empty, spec, lambda: [fake.images], tokenizer, on_stale="refuse", device=CPU).num_items == 8
    )


@pytest.mark.parametrize(
    ("name", "value", "refusal"),
    [
        ("tokens.npy", 64, r"token ids must be in \[0, 64\) \(the codebook size\), found 64"),
        ("tokens.npy", -1, r"token ids must be in \[0, 64\) \(the codebook size\), found -1"),
        ("labels.npy", 4, r"class ids must be in \[0, 4\) \(the dataset's class count\), found 4"),
    ],
)
def test_a_token_cache_with_ids_out_of_range_is_one_line_naming_the_file(
    tmp_path: Path, name: str, value: int, refusal: str
) -> None:
    """An edited or foreign cache: an id beyond the codebook is an IndexError inside the model, a label equal to the
    class count is VAR's "no class" row (a silently unconditional run)."""
    from trainlab.data.errors import DataError
    from trainlab.data.token_cache import TokenCache

    tokenizer = load_tokenizer("", "vqvae_debug", PATCH_NUMS, seed=0)
    fake = open_split(DataConfig(kind="fake", fake_size=8), "train", VarResizeCrop(16), fake_classes=4)
    assert fake is not None
    spec = TokenCacheSpec(tokenizer_sha256(tokenizer), PATCH_NUMS, 30, 64, {"kind": "fake", "size": 8})
    ensure_token_cache(
        tmp_path / "c", spec, lambda: [fake.images], tokenizer, on_stale="refuse", device=CPU, num_classes=4
    )
    array = np.load(tmp_path / "c" / name, mmap_mode="r+")
    array.reshape(-1)[-1] = value
    array.flush()
    del array
    with pytest.raises(DataError, match=f"{name}.*{refusal}"):
        ensure_token_cache(
            tmp_path / "c", spec, lambda: [fake.images], tokenizer, on_stale="refuse", device=CPU, num_classes=4
        )
    if name == "tokens.npy":
        with pytest.raises(DataError, match=refusal):
            TokenCache(tmp_path / "c")  # the codebook size is in meta.json: checked without a class count too


def test_tokenizer_loads_from_a_tokenizer_run_checkpoint_and_checks_its_preset(tmp_path: Path) -> None:
    """The VAR recipe reads `--tokenizer-weights runs/tok/ckpt/last.pt` through the engine's checkpoint reader (the
    loader is handed the VQVAE's plain state dict)."""
    from trainlab.engine.checkpoint import weights_in_checkpoint
    from trainlab.models.var.vqvae import VQVAE
    from trainlab.recipes.var import TOKENIZER_MODEL

    unwrap = weights_in_checkpoint(TOKENIZER_MODEL)

    torch.manual_seed(0)
    weights = VQVAE(vqvae_config("vqvae_digits", PATCH_NUMS)).state_dict()
    other = {"conv.weight": torch.zeros(1)}  # e.g. the discriminator of a `trainlab train tokenizer` run
    path = tmp_path / "last.pt"
    torch.save({"format": "trainlab-checkpoint", "models": {"vqvae": weights, "discriminator": other}}, path)
    for preset in ("vqvae_digits", "auto"):
        tokenizer = load_tokenizer(str(path), preset, PATCH_NUMS, unwrap=unwrap)
        assert not any(p.requires_grad for p in tokenizer.parameters()) and not tokenizer.training
        assert torch.equal(tokenizer.quantize.embedding.weight, weights["quantize.embedding.weight"])
    with pytest.raises(UsageError, match="do not fit --tokenizer-model vqvae_official"):
        load_tokenizer(str(path), "vqvae_official", PATCH_NUMS, unwrap=unwrap)
    with pytest.raises(UsageError, match=r"huggingface\.co"):
        load_tokenizer(str(tmp_path / "missing.pth"), "official", PATCH_NUMS)


def test_training_from_the_cache_matches_training_from_images(tmp_path: Path) -> None:
    from_images = Trainer(VARRecipe(_cfg(tmp_path / "a", max_steps=3))).fit().losses
    cached_cfg = _cfg(tmp_path / "b", max_steps=3, use_token_cache=True)
    from_cache = Trainer(VARRecipe(cached_cfg)).fit().losses
    assert (tmp_path / "b" / "token_cache" / "train" / "meta.json").is_file()
    assert from_cache == from_images  # fake images have no augmentation: the same tokens, the same steps


# ---------------------------------------------------------------------------------------------- image folder


def _write_image(path: Path, seed: int, size: tuple[int, int] = (24, 20)) -> None:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def _write_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog"), broken: bool = True) -> None:
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            for i in range(3):
                _write_image(root / split / name / f"{i}.{'jpg' if c % 2 == 0 else 'png'}", seed=100 * c + i)
    if broken:
        whole = root / "train" / classes[0] / "trunc.jpg"
        _write_image(whole, seed=7)
        data = whole.read_bytes()
        whole.write_bytes(data[: len(data) // 2])  # a truncated JPEG: index 3
        (root / "train" / classes[1] / "notes.txt").write_text("not an image")  # ignored by extension
        (root / "train" / classes[1] / "zz_fake.jpg").write_text("not a JPEG either")  # index 7 -> wraps to 0


def test_image_folder_skips_broken_files_deterministically(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write_folder(tmp_path)
    index = scan_image_folder(tmp_path / "train")
    assert index.classes == ("cat", "dog") and len(index.files) == 8 and index.ignored_files == 1
    data = ImageFolderDataset(tmp_path / "train", image_size=16, train=True, seed=3)
    with caplog.at_level(logging.WARNING):
        samples = [data[i] for i in range(len(data))]
    assert data.skipped_images == 2 and "skipping unreadable image" in caplog.text
    assert all(s["image"].shape == (3, 16, 16) for s in samples)
    assert all(float(s["image"].min()) >= -1.0 and float(s["image"].max()) <= 1.0 for s in samples)
    assert int(samples[3]["label"]) == 1 and int(samples[7]["label"]) == 0  # the next readable file (wrapping)
    center = ImageFolderDataset(tmp_path / "train", image_size=16, train=False)
    assert torch.equal(center[7]["image"], center[0]["image"]) and torch.equal(center[3]["image"], center[4]["image"])
    assert torch.equal(data[1]["image"], samples[1]["image"])  # a pure function of (seed, epoch, index)
    data.set_epoch(1)
    assert data.skipped_images == 0
    assert any(not torch.equal(data[i]["image"], samples[i]["image"]) for i in range(3))  # new crops
    val = ImageFolderDataset(tmp_path / "val", image_size=16, train=False)
    val.set_epoch(5)
    assert torch.equal(val[2]["image"], ImageFolderDataset(tmp_path / "val", image_size=16, train=False)[2]["image"])


def test_an_epoch_over_a_folder_with_broken_files_completes(tmp_path: Path) -> None:
    _write_folder(tmp_path / "data")
    data = VarData(kind="image-folder", root=tmp_path / "data")
    cfg = _cfg(tmp_path / "run", data=data, batch_size=4, epochs=1)
    result = Trainer(VARRecipe(cfg)).fit()
    assert result.status == "finished" and result.epoch == 1 and len(result.losses) == 2
    assert _rows(tmp_path / "run", "train")[-1]["unreadable_images_skipped"] == 2.0
    evaluation = _rows(tmp_path / "run", "eval")[-1]
    assert evaluation["train_unreadable_images_skipped"] == 2.0 and evaluation["val_images"] == 6.0


def _cli(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        "var",
        "--run-dir",
        str(tmp_path / "run"),
        "--image-size",
        "16",
        "--patch-nums",
        "1",
        "2",
        "3",
        "4",
        "--vocab-size",
        "64",
        "--depth",
        "2",
        *extra,
    ]


def test_more_dataset_classes_than_model_classes_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_folder(tmp_path / "data", classes=("a", "b", "c"), broken=False)
    args = _cli(
        tmp_path, "--data.root", str(tmp_path / "data"), "--num-classes", "2", "--tokenizer-model", "vqvae_debug"
    )
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "has 3 classes but the model has --num-classes 2" in err[-1]


@pytest.mark.parametrize(
    ("layout", "message"),
    [("missing", "not found"), ("flat", "no class sub-folders"), ("no-tokenizer", "huggingface.co")],
)
def test_bad_inputs_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, message: str
) -> None:
    root = tmp_path / "data"
    if layout == "flat":
        _write_image(root / "train" / "lonely.jpg", seed=1)
    extra = ["--tokenizer-model", "auto"] if layout == "no-tokenizer" else ["--tokenizer-model", "vqvae_debug"]
    assert main(_cli(tmp_path, "--data.root", str(root), *extra)) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------------ precision


def test_fp16_autocast_with_accumulation_runs_two_steps(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, precision="fp16-amp-scale", grad_accumulation=2, batch_size=8, max_steps=2)  # 2 x 4
    result = Trainer(VARRecipe(cfg)).fit()
    assert result.status == "max_steps" and len(result.losses) == 2
    for row in _rows(tmp_path, "train"):
        assert row["skipped"] == 1.0 or np.isfinite(float(row["grad_norm"]))  # type: ignore[arg-type]
        assert float(row["loss_scale"]) > 0  # type: ignore[arg-type]


def test_pure_16_bit_weights_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli(tmp_path, "--precision", "bf16", "--tokenizer-model", "vqvae_debug")) == 2
    assert "fp16-amp-scale" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- progressive


def test_progressive_schedule_follows_the_official_rule() -> None:
    prog = ProgressiveSchedule(num_scales=4, start_scale=1, warmup_steps=2, end_step=10, stage_warmup_steps=4)
    assert [prog.scale(s) for s in range(12)] == [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]  # round(progress x 2)
    assert [prog.weight(s) for s in (0, 4, 5, 6, 8, 9)] == [1.0, 1.0, 0.25, 0.5, 0.25, 0.5]
    assert prog.stage_start(7) == 5


def test_progressive_training_trains_a_prefix_of_the_scales(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, progressive_until=0.9, progressive_start_scale=1, epochs=1, batch_size=8)
    Trainer(VARRecipe(cfg)).fit()
    rows = _rows(tmp_path, "train")
    assert rows[0]["progressive_scale"] == 1.0 and "cross_entropy_scale_2" not in rows[0]
    assert "cross_entropy_last_scale" not in rows[0]


# ------------------------------------------------------------------------------------------------- configs


README_ROWS = {  # reference/var.md section 3.3: depth -> (bs, ep, tblr, alng, wpe, twde)
    16: (768, 200, 1e-4, 1e-3, 0.1, -1.0),
    20: (768, 250, 1e-4, 1e-3, 0.1, -1.0),
    24: (768, 350, 8e-5, 1e-4, 0.01, -1.0),
    30: (1024, 350, 8e-5, 1e-5, 0.01, 0.08),
}


@pytest.mark.parametrize("depth", sorted(README_ROWS))
def test_shipped_configs_parse_and_match_the_readme(depth: int) -> None:
    path = REPO / "trainlab" / "configs" / f"var_d{depth}.yaml"
    cfg = parse(VARTrainConfig, ["--config", str(path)], prog="t")
    bs, ep, tblr, alng, wpe, twde = README_ROWS[depth]
    assert (cfg.depth, cfg.batch_size, cfg.epochs, cfg.precision) == (depth, bs, ep, "fp16-amp-scale")
    assert (cfg.optim.base_learning_rate, cfg.init_adaln_gamma) == (tblr, alng)
    assert (cfg.optim.name, cfg.optim.betas, cfg.optim.fused, cfg.tokenizer_model) == (
        "adamw",
        (0.9, 0.95),
        True,
        "vqvae_official",
    )
    assert (cfg.schedule.kind, cfg.schedule.final_ratio, cfg.schedule.weight_decay_end) == ("var-lin0", wpe, twde)
    assert cfg.schedule.warmup_fraction == 0.02 and cfg.clip_grad_norm == 2.0 and cfg.optim.weight_decay == 0.05
    assert load_yaml(path)["depth"] == depth


def test_every_shipped_var_config_is_covered() -> None:
    shipped = sorted(p.name for p in (REPO / "trainlab" / "configs").glob("var_d*.yaml"))
    assert shipped == [f"var_d{d}.yaml" for d in sorted(README_ROWS)]


@pytest.mark.parametrize(
    ("damage", "outcome"),
    [
        (lambda c: (c / "meta.json").write_text("[1, 2]"), "rebuilt"),
        (lambda c: (c / "meta.json").write_text("[" * 100_000), "rebuilt"),
        (lambda c: (c / "meta.json").write_text('{"fingerprint": [1, "a"]}'), "rebuilt"),
        (lambda c: ((c / "tokens.npy").unlink(), (c / "tokens.npy").mkdir()), "tokens.npy.*not a regular file"),
        (lambda c: ((c / "labels.npy").unlink(), os.mkfifo(c / "labels.npy")), "labels.npy.*not a regular file"),
    ],
)
def test_a_damaged_token_cache_is_rebuilt_or_one_line_never_a_traceback_or_a_hang(
    tmp_path: Path, damage: Callable[[Path], object], outcome: str
) -> None:
    """A meta.json that is not what a build writes counts as no cache (the folder holds only a cache's files, so it
    is rebuilt); an array that is not a regular file is named (a FIFO is never opened)."""
    from trainlab.data.errors import DataError

    tokenizer = load_tokenizer("", "vqvae_debug", PATCH_NUMS, seed=0)
    fake = open_split(DataConfig(kind="fake", fake_size=8), "train", VarResizeCrop(16), fake_classes=4)
    assert fake is not None
    spec = TokenCacheSpec(tokenizer_sha256(tokenizer), PATCH_NUMS, 30, 64, {"kind": "fake", "size": 8})

    def ensure() -> object:
        return ensure_token_cache(tmp_path / "c", spec, lambda: [fake.images], tokenizer, on_stale="refuse", device=CPU)

    ensure()
    damage(tmp_path / "c")
    if outcome == "rebuilt":
        assert check_token_cache(tmp_path / "c", spec) == ("missing", [])
        ensure()
        assert check_token_cache(tmp_path / "c", spec) == ("ok", [])
    else:
        with pytest.raises(DataError, match=outcome):
            ensure()
