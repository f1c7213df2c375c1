"""Files handed to `trainlab sample / edit / eval` are checked before use, and what the commands print is true.

Malformed or non-finite weights (VAR, VQVAE, digit judge, MoCo) end in one line naming the file and the key, exit
code 2; the sampler stops with one line on non-finite logits; a resumed `sample --out-dir` regenerates damaged PNGs;
`eval knn / linear-probe` read the data set and side a checkpoint was pretrained with; a linear probe that stopped
before its evaluation says so; `load_official(..., stop_grad_conv1=True)` keeps a ViT's patch projection frozen.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from trainlab.cli import main
from trainlab.engine.loop import FitResult
from trainlab.errors import UsageError, check_output_path, first_line
from trainlab.models.moco import MoCo, load_official, official_checkpoint
from trainlab.models.var.convert import export_official
from trainlab.models.var.convert import load_official as load_var_pair
from trainlab.models.var.sample import generate
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig
from trainlab.recipes.linear_probe import LinearProbeConfig, ProbeData, resolve_eval_data
from trainlab.user_files import check_state_dict, load_user_file

# Shape legend: B images, l tokens of one scale, V vocab.

State = dict[str, torch.Tensor]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if "error:" in line or "Traceback" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------------------ helpers
def test_first_line_is_the_type_and_first_line_within_the_limit() -> None:
    assert first_line(ValueError("\n  bad value \nmore detail")) == "ValueError: bad value"
    assert first_line(KeyError()) == "KeyError"
    long = first_line(RuntimeError("x" * 500))
    assert len(long) == 200 and long.endswith("...")


def test_output_paths_are_checked_for_kind_and_writability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("x")
    check_output_path("--out-dir", tmp_path / "new" / "deeper", is_dir=True)  # created later: fine
    with pytest.raises(UsageError, match=r"--out-dir .*afile is a file; pass a directory"):
        check_output_path("--out-dir", tmp_path / "afile", is_dir=True)
    with pytest.raises(UsageError, match=r"afile is not a directory"):
        check_output_path("--out", tmp_path / "afile" / "grid.png", is_dir=False)
    with pytest.raises(UsageError, match=r"is a directory; pass a file path"):
        check_output_path("--out", tmp_path, is_dir=False)
    os.mkfifo(tmp_path / "fifo.pt")  # opening it to write would wait for a reader forever
    with pytest.raises(UsageError, match=r"--save-tokens .*fifo\.pt is a FIFO, not a regular file; pass a file"):
        check_output_path("--save-tokens", tmp_path / "fifo.pt", is_dir=False)
    with pytest.raises(UsageError, match=r"/dev/full is not a regular file \(a device\?\)"):
        check_output_path("--save-tokens", "/dev/full", is_dir=False)  # every write fails: refused before sampling

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)  # a read-only mount, as root sees it
    with pytest.raises(UsageError, match=r"cannot be written \(.*Read-only file system\)"):
        check_output_path("--run-dir", tmp_path / "run", is_dir=True)


def test_load_user_file_refuses_code_and_damage_in_one_line(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("ran",))

    torch.save({"w": torch.zeros(1), "x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(
        UsageError, match=r"evil\.pt \(it names Python code to run, .*: refused, never run\); fix"
    ) as info:
        load_user_file(tmp_path / "evil.pt", "checkpoint", fix="fix it")
    assert "weights_only" not in str(info.value)  # the library's advice to turn the safety off is not repeated
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 3)  # damaged, not malicious: no talk of code
    with pytest.raises(UsageError, match=r"noise\.pt \(not a torch weights file \(damaged, or another format"):
        load_user_file(tmp_path / "noise.pt", "checkpoint", fix="fix it")
    from trainlab.engine.checkpoint import load_checkpoint

    with pytest.raises(UsageError, match=r"could not be read \(it names Python code to run") as info:
        load_checkpoint(tmp_path / "evil.pt")  # --resume reads through the same words
    assert "weights_only" not in str(info.value)
    torch.save({"w": torch.zeros(3)}, tmp_path / "ok.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:100])
    with pytest.raises(UsageError, match=r"cannot read checkpoint .*cut\.pt \("):
        load_user_file(tmp_path / "cut.pt", "checkpoint", fix="fix it")
    with pytest.raises(UsageError, match="is a directory"):
        load_user_file(tmp_path, "checkpoint", fix="fix it")
    (tmp_path / "zip.safetensors").write_bytes((tmp_path / "ok.pt").read_bytes())  # a torch.save file, misnamed
    with pytest.raises(UsageError, match=r"zip\.safetensors is a torch\.save file .*rename it to \.pth"):
        load_user_file(tmp_path / "zip.safetensors", "checkpoint", fix="fix it")
    assert torch.equal(load_user_file(tmp_path / "ok.pt", "checkpoint", fix="")["w"], torch.zeros(3))


def test_check_state_dict_names_the_first_problem() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    good = {k: v.clone() for k, v in model.state_dict().items()}
    check_state_dict(good, model.state_dict(), source="f.pt")
    cases: list[tuple[Callable[[State], Any], str]] = [
        (lambda s: s.pop("0.bias"), r"f\.pt lacks 0\.bias of the model's 7 tensors"),
        (lambda s: s.__setitem__("2.weight", torch.zeros(1)), r"f\.pt holds 2\.weight, which the model"),
        (lambda s: s.__setitem__("0.weight", torch.zeros(2, 3)), r"0\.weight has shape \(2, 3\) where the model has"),
        (lambda s: s.__setitem__("0.weight", torch.zeros(3, 2, dtype=torch.int32)), r"0\.weight holds integer"),
        (lambda s: s.__setitem__("1.num_batches_tracked", torch.tensor(1.0)), r"holds floating-point values"),
        (lambda s: s["1.running_var"].fill_(torch.inf), r"1\.running_var holds 0 NaN and 3 inf values"),
        (lambda s: s.__setitem__("0.weight", torch.zeros(3, 2).to_sparse()), r"0\.weight is a torch\.sparse_coo"),
        (lambda s: s.__setitem__("0.weight", torch.zeros(3, 2, device="meta")), r"0\.weight holds no values"),
    ]
    for mutate, pattern in cases:
        state = {k: v.clone() for k, v in good.items()}
        mutate(state)
        with pytest.raises(UsageError, match=pattern):
            check_state_dict(state, model.state_dict(), source="f.pt")
    masked = {k: v.clone() for k, v in good.items()}
    masked["0.bias"][0] = -torch.inf
    check_state_dict(masked, model.state_dict(), source="f.pt", neg_inf_ok=("0.bias",))  # declared: allowed
    masked["0.bias"][1] = torch.nan
    with pytest.raises(UsageError, match="1 NaN"):
        check_state_dict(masked, model.state_dict(), source="f.pt", neg_inf_ok=("0.bias",))


# ------------------------------------------------------------------------------------------------ VAR / VQVAE
@pytest.fixture(scope="module")
def var_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    vqvae, var = VQVAE(VQVAEConfig.debug()), VAR(VARConfig.debug())
    return export_official(vqvae, folder / "vae.pth"), export_official(var, folder / "var.pth")


def _mutated(path: Path, out: Path, mutate: Callable[[State], None]) -> Path:
    state = {k: v.clone() for k, v in torch.load(path, weights_only=True).items()}
    mutate(state)
    if out.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    else:
        torch.save(state, out)
    return out


def _set(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[State], None]:
    return lambda state: state.__setitem__(key, fn(state[key]))


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = torch.nan
    return t


VAR_CASES: dict[str, tuple[str, Callable[[State], None], str]] = {
    "word-embed-1d": ("var", _set("word_embed.weight", torch.flatten), r"word_embed\.weight has shape \(512,\)"),
    "scale-mul-1d": ("var", _set("blocks.0.attn.scale_mul_1H11", torch.flatten), r"scale_mul_1H11 has shape \(2,\)"),
    "int-dtype": (
        "var",
        lambda s: s.update({k: v.long() for k, v in s.items() if k != "attn_bias_for_masking"}),
        r"pos_start holds integer values \(torch\.int64\) where the model keeps floating-point",
    ),
    "bool-value": ("var", _set("pos_1LC", lambda t: t > 0), r"pos_1LC holds bool values"),
    "nan-deep": ("var", _set("blocks.1.ffn.fc2.weight", _nan_at), r"blocks\.1\.ffn\.fc2\.weight holds 1 NaN"),
    "nan-head": ("var", _set("head.weight", lambda t: t.fill_(torch.nan)), r"head\.weight holds 4096 NaN"),
    "inf-class-emb": (
        "var",
        _set("class_emb.weight", lambda t: t.index_fill(0, torch.tensor([1]), torch.inf)),
        r"class_emb\.weight holds 0 NaN and 64 inf",
    ),
    "nan-mask": ("var", _set("attn_bias_for_masking", _nan_at), r"attn_bias_for_masking holds 1 NaN"),
    "vae-emb-3d": ("vae", _set("quantize.embedding.weight", lambda t: t[None]), r"embedding\.weight has shape \(1,"),
    "vae-nan": ("vae", _set("decoder.conv_out.weight", _nan_at), r"decoder\.conv_out\.weight holds 1 NaN"),
    "vae-nan-codebook": ("vae", _set("quantize.embedding.weight", _nan_at), r"quantize\.embedding\.weight holds"),
    # read before the architecture is inferred from the shapes (lvl_1L's values): one line, not torch's meta error
    "all-meta": ("var", lambda s: s.update({k: v.to("meta") for k, v in s.items()}), r"pos_start holds no values"),
    "vae-meta": ("vae", _set("decoder.conv_out.weight", lambda t: t.to("meta")), r"conv_out\.weight holds no values"),
    "fp8-nan": (
        "var",
        lambda s: s.update({k: _nan_at(v).to(torch.float8_e4m3fn) for k, v in s.items() if k == "head.weight"}),
        r"head\.weight holds 1 NaN",
    ),
}


@pytest.mark.parametrize("case", sorted(VAR_CASES))
def test_malformed_var_and_vqvae_weights_are_one_line_naming_file_and_key(
    case: str, var_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    which, mutate, pattern = VAR_CASES[case]
    vae, var = var_pair
    suffix = ".safetensors" if case == "int-dtype" else ".pth"
    bad = _mutated(var if which == "var" else vae, tmp_path / f"{case}{suffix}", mutate)
    vae, var = (vae, bad) if which == "var" else (bad, var)
    argv = ["sample", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--classes", "1", "2"]
    argv += ["--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "grid.png")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(bad) in line and re.search(pattern, line), line
    assert not (tmp_path / "grid.png").exists()


def test_edit_refuses_nan_weights_in_one_line(
    var_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vae, var = var_pair
    bad = _mutated(var, tmp_path / "nan.pth", _set("blocks.0.attn.proj.weight", _nan_at))
    Image.new("RGB", (16, 16), "white").save(tmp_path / "img.png")
    argv = ["edit", "--tokenizer-weights", str(vae), "--var-weights", str(bad), "--image", str(tmp_path / "img.png")]
    argv += ["--box", "0", "8", "16", "16", "--num-results", "1", "--out", str(tmp_path / "e.png"), "--device", "cpu"]
    assert main(argv) == 2
    assert "blocks.0.attn.proj.weight holds 1 NaN" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flag", "target", "names"),
    [
        ("--out", "img.png", "--out .*img\\.png is the --image file"),
        ("--save-tokens", "img.png", "--save-tokens .*img\\.png is the --image file"),
        ("--save-tokens", "e.png", "--save-tokens .*e\\.png is the --out file"),
        ("--out", "link.png", "--out .*link\\.png is the --image file"),  # a link to the image: the same file
    ],
)
def test_edit_never_writes_over_its_input(
    flag: str, target: str, names: str, var_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vae, var = var_pair
    Image.new("RGB", (16, 16), "white").save(tmp_path / "img.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "img.png")
    before = (tmp_path / "img.png").read_bytes()
    argv = ["edit", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--image", str(tmp_path / "img.png")]
    argv += ["--box", "0", "8", "16", "16", "--num-results", "1", "--out", str(tmp_path / "e.png"), "--device", "cpu"]
    argv += [flag, str(tmp_path / target)]  # the later flag wins
    assert main(argv) == 2
    assert re.search(names, _one_error_line(capsys.readouterr().err))
    assert (tmp_path / "img.png").read_bytes() == before


def test_sampler_stops_on_non_finite_logits_with_the_cause(var_pair: tuple[Path, Path]) -> None:
    vqvae, var = load_var_pair(*var_pair)
    labels = [1, 2]
    with pytest.raises(UsageError, match=r"guidance 1e\+38 makes the logits overflow at scale \d of 4"):
        generate(var, vqvae, labels, seed=0, cfg=1e38)
    generate(var, vqvae, labels, seed=0, cfg=1.5)  # the same model samples at a normal scale
    with torch.no_grad():
        var.head.bias[3] = torch.nan  # damage after loading: only the sampler can see it
    with pytest.raises(UsageError, match="the model computes NaN or inf logits at scale 1 of 4"):
        generate(var, vqvae, labels, seed=0, cfg=1.5, top_k=5)  # the CPU fast path never calls multinomial
    with pytest.raises(UsageError, match="NaN or inf logits"):
        generate(var, vqvae, labels, seed=0, cfg=1.5, top_k=0)


# ------------------------------------------------------------------------------------------------ sample --out-dir
def test_out_dir_rerun_regenerates_damaged_pngs_and_refuses_foreign_ones(
    var_pair: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vae, var = var_pair
    out = tmp_path / "samples"
    argv = ["sample", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--classes", "1", "2", "3"]
    argv += ["--samples-per-class", "2", "--batch-size", "2", "--out-dir", str(out), "--device", "cpu"]
    assert main(argv) == 0
    first = np.load(out / "samples.npz")["arr_0"]
    pngs = sorted(out.glob("*.png"))
    kept = pngs[0].stat().st_mtime_ns
    pngs[3].write_bytes(pngs[3].read_bytes()[:60])  # truncated (batch 1)
    pngs[4].write_bytes(b"")  # zero bytes (batch 2)
    with caplog.at_level("WARNING", logger="trainlab.commands.sample"):
        assert main(argv) == 0
    warned = [r.getMessage() for r in caplog.records if "is unreadable" in r.getMessage()]
    assert len(warned) == 2 and pngs[3].name in warned[0] and pngs[4].name in warned[1]
    assert pngs[0].stat().st_mtime_ns == kept  # an intact batch is not sampled again
    assert np.array_equal(np.load(out / "samples.npz")["arr_0"], first)  # the same seeds give the same images
    Image.new("RGB", (8, 8)).save(pngs[1])  # a PNG of other weights (another size)
    with pytest.raises(UsageError, match=r"is 8x8 pixels but these weights make 16x16 images"):
        from trainlab.commands.sample import main as sample_main

        sample_main(argv[1:])


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (["--seed", "1"], "seed: 0, now 1"),
        (["--guidance", "3"], "guidance: 1.5, now 3.0"),
        (["--var-weights", "OTHER"], "var_weights"),
        (["--classes", "4"], "labels"),
    ],
)
def test_an_out_dir_resumes_only_with_the_settings_of_its_images(
    change: list[str], said: str, var_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another seed, guidance, weights or class list would keep the old PNGs as the new set's (or leave stale ones
    beyond it): refused, naming the setting; the folder's images stay as they were."""
    vae, var = var_pair
    other = export_official(VAR(VARConfig.debug()), tmp_path / "other.pth")
    out = tmp_path / "samples"
    argv = ["sample", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--classes", "1", "2"]
    argv += ["--out-dir", str(out), "--device", "cpu"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.png")}
    capsys.readouterr()
    assert main([*argv, *[str(other) if word == "OTHER" else word for word in change]]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "holds images sampled with other settings" in line and said in line, line
    assert {p.name: p.read_bytes() for p in out.glob("*.png")} == before
    assert main(argv) == 0  # the same settings resume (nothing left to sample)
    (out / "sampling.json").unlink()  # a folder an earlier trainlab wrote: taken as it is, stale PNGs refused
    assert main([*argv[:7], *argv[8:]]) == 2  # --classes 1: the PNG of class 2 is not this sampling's
    assert "PNG(s) this sampling does not make (first: 000001_c0002.png)" in capsys.readouterr().err


def test_outputs_that_cannot_fit_are_refused_before_sampling(
    var_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10^8 images per class: the labels alone would exhaust memory; the .npz could never fit on the disk."""
    vae, var = var_pair
    base = ["sample", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--classes", "all"]
    base += ["--samples-per-class", "100000000", "--device", "cpu"]
    assert main([*base, "--out-dir", str(tmp_path / "huge")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "100000000000 images of 16x16 make a" in line and "GiB samples.npz but only" in line
    assert main([*base, "--save-tokens", str(tmp_path / "t.pt")]) == 2
    assert "--save-tokens holds 100000000000 images' tokens in memory" in _one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------ digit judge
def _judge_file(tmp_path: Path, name: str, *, meta: dict[str, str] | None = None, nan: bool = False) -> Path:
    from trainlab.models.digit_judge import DigitJudge, save_judge

    base = tmp_path / "judge.safetensors"
    if not base.is_file():
        torch.manual_seed(0)
        save_judge(DigitJudge(resolution=16), base)
    with safe_open(str(base), framework="pt") as f:
        metadata, state = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    metadata = {k: v for k, v in {**metadata, **(meta or {})}.items() if v != "DROP"}
    if nan:
        state["head.weight"][0, 0] = torch.nan
    save_file(state, str(tmp_path / name), metadata=metadata)
    return tmp_path / name


@pytest.mark.parametrize(
    ("meta", "nan", "pattern"),
    [
        ({"resolution": "DROP"}, False, "lacks the metadata key 'resolution'"),
        ({"resolution": "abc"}, False, "metadata 'resolution' is 'abc', not an integer"),
        ({"width": "-5"}, False, "metadata 'width' is -5, it must be >= 1"),
        ({"width": "100000000"}, False, "trunk.0.0.weight has shape (16, 3, 3, 3) where the model has"),
        ({"resolution": "7"}, False, "resolution 7 is not supported"),
        (None, True, "head.weight holds 1 NaN"),
    ],
)
def test_damaged_judge_files_are_one_line(
    meta: dict[str, str] | None, nan: bool, pattern: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    judge = _judge_file(tmp_path, "bad.safetensors", meta=meta, nan=nan)
    assert main(["eval", "judge", "--samples", str(tmp_path), "--judge-weights", str(judge)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"judge file {judge}" in line and pattern in line, line


# ------------------------------------------------------------------------------------------------ MoCo
def _moco(arch: str, image_size: int = 16) -> MoCo:
    torch.manual_seed(0)
    return MoCo(arch, dim=16, mlp_dim=32, temperature=0.2, image_size=image_size)  # type: ignore[arg-type]


def test_moco_without_predictor_or_with_nan_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = official_checkpoint(_moco("tv_resnet_debug"), epoch=1)
    no_predictor = {k: v for k, v in ckpt["state_dict"].items() if ".predictor." not in k}
    torch.save({**ckpt, "state_dict": no_predictor}, tmp_path / "nopred.pth.tar")
    nan = {k: v.clone() for k, v in ckpt["state_dict"].items()}
    nan["module.base_encoder.layer1.0.conv1.weight"][0] = torch.nan
    torch.save({**ckpt, "state_dict": nan}, tmp_path / "nan.pth.tar")
    for name, pattern in (("nopred", "lacks predictor.0.weight"), ("nan", "layer1.0.conv1.weight holds")):
        path = tmp_path / f"{name}.pth.tar"
        assert main(["eval", "knn", "--moco-weights", str(path), "--data.eval-limit", "32", "--k", "5"]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert str(path) in line and pattern in line, line


def test_load_official_keeps_a_vit_patch_projection_frozen_on_request(tmp_path: Path) -> None:
    torch.save(official_checkpoint(_moco("moco_vit_debug"), epoch=3), tmp_path / "vit.pth.tar")
    torch.save(official_checkpoint(_moco("tv_resnet_debug"), epoch=3), tmp_path / "r.pth.tar")
    free = load_official(tmp_path / "vit.pth.tar", temperature=0.2)
    frozen = load_official(tmp_path / "vit.pth.tar", temperature=0.2, stop_grad_conv1=True)
    proj, fc1 = "base_encoder.patch_embed.proj", "base_encoder.blocks.0.mlp.fc1.weight"
    for model, requires in ((free, True), (frozen, False)):
        params = dict(model.named_parameters())
        assert params[f"{proj}.weight"].requires_grad is requires and params[f"{proj}.bias"].requires_grad is requires
    assert torch.equal(frozen.state_dict()[f"{proj}.weight"], free.state_dict()[f"{proj}.weight"])
    # training on from the checkpoint: the projection stays where it was, the rest moves
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in frozen.parameters() if p.requires_grad], lr=0.5)
    frozen(torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16), 0.99).backward()
    optimizer.step()
    after = frozen.state_dict()
    assert torch.equal(after[f"{proj}.weight"], before[f"{proj}.weight"]) and not torch.equal(after[fc1], before[fc1])
    with pytest.raises(UsageError, match="stop_grad_conv1 freezes a ViT's linear patch projection"):
        load_official(tmp_path / "r.pth.tar", temperature=1.0, stop_grad_conv1=True)


# ------------------------------------------------------------------------------------------------ eval data
def _trainlab_moco(tmp_path: Path, *, image_size: int, data: str = "digits", flat: bool = False) -> Path:
    """A trainlab MoCo checkpoint; `flat`: its config as runs recorded it before the data group (and the registry)."""
    model = _moco("tv_resnet_debug")
    root = str(tmp_path / "root")
    group = {"data": data, "data_root": root} if flat else {"data": {"kind": data, "root": root}}
    backbone = {"arch": "resnet_debug"} if flat else {"model": "tv_resnet_debug"}
    config = {**backbone, "image_size": image_size, **group}
    ckpt = {"format": "trainlab-checkpoint", "recipe": "moco", "models": {"moco": model.state_dict()}, "config": config}
    path = tmp_path / f"moco_{data}_{image_size}{'_flat' if flat else ''}.pt"
    torch.save(ckpt, path)
    return path


def _resolve(checkpoint: str, kind: str | None = None, image_size: int | None = None) -> tuple[ProbeData, int]:
    return resolve_eval_data(checkpoint, ProbeData(kind=kind), image_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("flat", [False, True])
def test_eval_data_comes_from_the_checkpoint_unless_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flat: bool
) -> None:
    ckpt = str(_trainlab_moco(tmp_path, image_size=32, flat=flat))
    assert _resolve("") == resolve_eval_data("", ProbeData(kind="digits", root=Path("data/cifar10")), 16)
    found, side = _resolve(ckpt)
    assert (found.kind, side) == ("digits", 32)
    with caplog.at_level("WARNING"):
        _, asked = _resolve(ckpt, image_size=16)
    assert asked == 16  # a different side is used, and said
    assert any(
        "pretrained with --image-size 32; evaluating with --image-size 16" in r.getMessage() for r in caplog.records
    )
    cifar = str(_trainlab_moco(tmp_path, image_size=32, data="cifar10", flat=flat))
    assert _resolve(cifar)[0].root == tmp_path / "root"
    assert _resolve(cifar, kind="digits")[0].root == Path("data/cifar10")  # not cifar's root
    torch.save(official_checkpoint(_moco("moco_vit_debug", image_size=16), epoch=1), tmp_path / "vit.pth.tar")
    assert _resolve(str(tmp_path / "vit.pth.tar"))[1] == 16
    with pytest.raises(UsageError, match="position table is for 16 px inputs"):
        _resolve(str(tmp_path / "vit.pth.tar"), image_size=32)


def test_eval_knn_reads_a_32px_checkpoint_at_32px(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainlab.data.config import DataConfig
    from trainlab.data.sources import eval_images
    from trainlab.recipes.linear_probe import load_backbone
    from trainlab.recipes.moco import knn_of_features

    ckpt = _trainlab_moco(tmp_path, image_size=32)
    assert main(["eval", "knn", "--moco-weights", str(ckpt), "--data.eval-limit", "64", "--k", "5"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (printed["data"], printed["image_size"]) == ("digits", 32)
    model, _ = load_backbone(str(ckpt), "tv_resnet_debug", 32)
    images = eval_images(DataConfig(kind="digits", eval_limit=64), 32)
    expected = knn_of_features(model.eval().features, images, device=torch.device("cpu"), batch_size=256, k=5,
                               temperature=0.1)  # fmt: skip
    assert printed["knn_accuracy"] == expected


# ------------------------------------------------------------------------------------------------ linear probe
def _probe_args(run: Path, *extra: str) -> list[str]:
    args = ["eval", "linear-probe", "--moco-weights", "", "--model", "tv_resnet_debug", "--run-dir", str(run)]
    args += ["--data.train-limit", "64", "--data.eval-limit", "64", "--batch-size", "16"]
    return [*args, "--tensorboard", "false", "--progress", "false", *extra]


def test_linear_probe_without_an_evaluation_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "lp"
    assert main(_probe_args(run, "--epochs", "1", "--max-steps", "2")) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert printed["final_test_accuracy"] is None and printed["status"] == "max_steps" and printed["step"] == 2
    assert "no evaluation yet: training stopped at step 2" in captured.err
    assert main(_probe_args(run, "--epochs", "1")) == 0  # the same run goes on to its evaluation
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= printed["final_test_accuracy"] <= 1.0 and printed["evaluated_after_epoch"] == 1
    assert main(_probe_args(run, "--epochs", "1")) == 0  # relaunched when finished: the same result again
    assert (
        json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final_test_accuracy"]
        == printed["final_test_accuracy"]
    )


def test_an_interrupted_linear_probe_exits_130_with_a_resume_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainlab.engine.loop import Trainer

    monkeypatch.setattr(Trainer, "fit", lambda self: FitResult("interrupted", 5, 0, [], {}))
    assert main(_probe_args(tmp_path / "lp", "--epochs", "1")) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 5" in err and "run the same command again to resume" in err
    assert "Traceback" not in err


def test_linear_probe_cadence_is_proportionate_by_default(tmp_path: Path) -> None:
    defaults = LinearProbeConfig()
    assert (defaults.log_every, defaults.eval_every_epochs, defaults.epochs) == (50, 10, 90)
    # the default 90 epochs of a 4,000-image digits probe at batch 256: 15 steps per epoch
    steps = 90 * (4000 // 256)
    assert steps // defaults.log_every + 90 // defaults.eval_every_epochs < 40  # log rows, not hundreds
    run = tmp_path / "lp"
    assert main(_probe_args(run, "--epochs", "20", "--batch-size", "64")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "eval"] == [10, 20]


def test_linear_probe_config_resolves_data_from_the_checkpoint(tmp_path: Path) -> None:
    from trainlab.recipes.linear_probe import LinearProbeRecipe

    ckpt = _trainlab_moco(tmp_path, image_size=32)
    recipe = LinearProbeRecipe(dataclasses.replace(LinearProbeConfig(), moco_weights=str(ckpt), run_dir=tmp_path))
    assert (recipe.config.data.kind, recipe.config.image_size) == ("digits", 32)
    assert recipe.example_batch(2)["image"].shape == (2, 3, 32, 32)


def test_torch_fidelity_is_required_from_0_4() -> None:
    """Before 0.4 torch-fidelity has no precision / recall of samples against a reference as `eval fid` reads it."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pins = re.findall(r'"torch-fidelity([^"]*)"', text)
    assert len(pins) == 2 and all(pin == ">=0.4" for pin in pins), pins


def test_a_file_that_is_not_there_says_what_is_there_instead(tmp_path: Path) -> None:
    """A FIFO, a folder or a looping link named as a weights file is named for what it is, not "not found"."""
    from trainlab.errors import missing_file

    os.mkfifo(tmp_path / "fifo.pth")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    assert missing_file(tmp_path / "fifo.pth") == "is a FIFO, not a regular file"
    assert missing_file(tmp_path) == "is a folder, not a regular file"
    assert missing_file(tmp_path / "a") == "is a symbolic link that loops"
    assert missing_file(tmp_path / "broken") == "is a broken symbolic link"
    assert missing_file(tmp_path / "nowhere") == "not found"
    with pytest.raises(UsageError, match=r"fifo\.pth is a FIFO, not a regular file; fix it"):
        load_user_file(tmp_path / "fifo.pth", "checkpoint", fix="fix it")  # refused without opening: no hang
