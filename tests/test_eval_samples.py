"""`trainlab eval fid` / `trainlab eval judge` through `trainlab.cli.main`: FID of a set against itself is ~0 and
against a shifted set equals our float64 Fréchet distance on the same features; the reference cache is reused and
invalidated by other weights or other images; folders and .npz files give the same numbers; an OpenAI-evaluator
reference batch is accepted (its mu/sigma give the second FID); `trainlab sample --out-dir` output is read as is;
the judge's accuracy on real digits; every bad input is one line with exit code 2.

The Inception network is torch-fidelity's, with random weights (conv weights He-initialised, so that activations
neither vanish nor explode) saved to a temporary file, and it resizes to 75x75 instead of 299x299 here (the smallest
input InceptionV3 takes; about 16x less CPU time). Most tests use the 64-d features (`--feature-dims 64`): a
2048x2048 matrix square root takes ~20 s on a small CPU.
"""

# Shape legend: N images, H/W pixels, 3 RGB channels, D features.

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from trainlab.cli import main
from trainlab.errors import UsageError
from trainlab.evaluate.frechet import feature_statistics, fid_from_features, frechet_distance
from trainlab.evaluate.image_sets import read_image_set

fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")

SIDE = 16


def _random_inception(path: Path, seed: int) -> Path:
    with pytest.MonkeyPatch.context() as patch:  # the real layout, random weights: nothing is downloaded
        patch.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda *a, **k: None)
        patch.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        torch.manual_seed(seed)
        model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_inception(tmp_path_factory.mktemp("inception") / "inception.pth", seed=0)


@pytest.fixture(autouse=True)
def small_inception_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(fe.FeatureExtractorInceptionV3, "INPUT_IMAGE_SIZE", 75)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small convolutions: one thread does as well, and waits on no other
    yield
    torch.set_num_threads(threads)


def _images(n: int, seed: int, shift: int = 0) -> np.ndarray:
    """n smooth random RGB images (a coarse 4x4 pattern upsampled), uint8 (N, H, W, 3), brightness + shift."""
    rng = np.random.default_rng(seed)
    coarse_N443 = rng.integers(0, 196, size=(n, 4, 4, 3))
    images_NHW3 = coarse_N443.repeat(SIDE // 4, axis=1).repeat(SIDE // 4, axis=2) + shift
    return np.clip(images_NHW3, 0, 255).astype(np.uint8)


def _write_folder(folder: Path, images_NHW3: np.ndarray, labels: list[int] | None = None) -> Path:
    folder.mkdir(parents=True)
    for i, arr in enumerate(images_NHW3):
        name = f"{i:06d}_c{labels[i]:04d}.png" if labels is not None else f"{i:06d}.png"
        Image.fromarray(arr).save(folder / name)
    return folder


def _json_line(out: str) -> dict[str, Any]:
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return dict(json.loads(lines[0]))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _fid(capsys: pytest.CaptureFixture[str], samples: Path, reference: Path, weights: Path, *extra: str) -> dict:
    argv = ["eval", "fid", "--samples", str(samples), "--reference", str(reference)]
    argv += ["--inception-weights", str(weights), "--device", "cpu", "--decode-workers", "false"]
    argv += ["--isc-splits", "2", *extra]
    assert main([*argv, *(["--feature-dims", "64"] if "--feature-dims" not in extra else [])]) == 0
    return _json_line(capsys.readouterr().out)


def _features(folder: Path, weights: Path, layer: str) -> np.ndarray:
    from trainlab.evaluate.fidelity import inception_feature_layers, load_metric_inception

    extractor = load_metric_inception(weights, torch.device("cpu"), feature_layer=layer)
    features, _ = inception_feature_layers(read_image_set(folder), extractor, batch_size=64, decode_workers=False)
    return features[layer].numpy()


# ------------------------------------------------------------------------------------------------------------ FID
def test_fid_against_itself_is_zero_and_a_shifted_set_matches_our_float64_fid(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = _write_folder(tmp_path / "reference", _images(6, seed=1))
    same = shutil.copytree(reference, tmp_path / "same")
    shifted = _write_folder(tmp_path / "shifted", _images(6, seed=1, shift=50))
    itself = _fid(capsys, same, reference, weights)
    moved = _fid(capsys, shifted, reference, weights)
    assert moved["fid"] > 1e-3 and abs(itself["fid"]) < 1e-6 * moved["fid"]
    assert itself["precision"] == itself["recall"] == 1.0 and moved["precision"] < 1.0
    (cached,) = Path(moved["cache_dir"]).glob("*-64.npz")  # the reference cache: the reference features
    with np.load(cached, allow_pickle=False) as entry:
        reference_MD = entry["features"]
    ours = fid_from_features(_features(shifted, weights, "64"), reference_MD)
    assert moved["fid"] == pytest.approx(ours, rel=1e-4)
    assert itself["num_samples"] == moved["num_reference"] == 6 and moved["samples_images_per_second"] > 0
    assert itself["inception_score"] >= 1.0 and itself["fid_vs_reference_mu_sigma"] is None


def test_reference_cache_is_reused_and_invalidated_by_other_weights_or_images(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = _write_folder(tmp_path / "reference", _images(6, seed=1))
    samples = _write_folder(tmp_path / "samples", _images(6, seed=2))
    first = _fid(capsys, samples, reference, weights)
    again = _fid(capsys, samples, reference, weights)
    cache = tmp_path / "reference.fidelity-cache"
    assert Path(first["cache_dir"]) == cache and len(list(cache.glob("*.npz"))) == 1
    assert (first["reference_cache"], again["reference_cache"]) == ("miss", "hit")
    assert again["reference_images_per_second"] is None and first["reference_images_per_second"] > 0
    assert (again["fid"], again["precision"], again["recall"]) == (first["fid"], first["precision"], first["recall"])

    other_weights = _random_inception(tmp_path / "other.pth", seed=1)
    changed = _fid(capsys, samples, reference, other_weights)
    assert changed["reference_cache"] == "miss" and changed["fid"] != first["fid"]
    assert len(list(cache.glob("*.npz"))) == 2

    Image.fromarray(_images(1, seed=9)[0]).save(reference / "000003.png")  # same names, other content
    edited = _fid(capsys, samples, reference, weights)
    assert edited["reference_cache"] == "miss" and edited["fid"] != first["fid"]


def test_the_reference_cache_is_read_as_data_and_a_damaged_entry_is_recomputed(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch-fidelity's own cache unpickles its files: a file planted next to a shared reference would run code."""
    reference = _write_folder(tmp_path / "reference", _images(6, seed=1))
    samples = _write_folder(tmp_path / "samples", _images(6, seed=2))
    first = _fid(capsys, samples, reference, weights)
    cache = tmp_path / "reference.fidelity-cache"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    (entry,) = cache.glob("*.npz")
    for name in (entry.with_suffix(".pt").name, "features.pt", "stats.pkl"):  # what torch-fidelity's cache would load
        torch.save({"features": Payload()}, cache / name)
    entry.write_bytes(entry.read_bytes()[:100])  # cut by a kill or a full disk
    again = _fid(capsys, samples, reference, weights)
    assert not marker.exists()
    assert again["reference_cache"] == "miss" and again["fid"] == first["fid"]
    assert _fid(capsys, samples, reference, weights)["reference_cache"] == "hit"  # rewritten whole
    with np.load(entry) as npz:
        arrays = {key: npz[key] for key in npz.files}
    np.savez(entry, **{**arrays, "sigma": np.full_like(arrays["sigma"], np.nan)})  # well-formed, values damaged
    recomputed = _fid(capsys, samples, reference, weights)
    assert recomputed["reference_cache"] == "miss" and recomputed["fid"] == first["fid"]


def test_npz_and_folder_inputs_give_the_same_numbers(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples_NHW3, reference_NHW3 = _images(6, seed=3), _images(6, seed=4)
    by_folder = _fid(
        capsys,
        _write_folder(tmp_path / "samples", samples_NHW3),
        _write_folder(tmp_path / "reference", reference_NHW3),
        weights,
    )
    np.savez(tmp_path / "samples.npz", samples_NHW3)  # stored: memory-mapped
    np.savez_compressed(tmp_path / "reference.npz", reference_NHW3)  # compressed: loaded
    by_npz = _fid(capsys, tmp_path / "samples.npz", tmp_path / "reference.npz", weights)
    for key in ("fid", "inception_score", "inception_score_std", "precision", "recall", "num_samples"):
        assert by_npz[key] == by_folder[key], key
    assert by_npz["cache_dir"] == str(tmp_path / "reference.npz.fidelity-cache")


def test_sample_out_dir_is_consumed_directly(tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainlab.evaluate.judge_accuracy import predict
    from trainlab.models.digit_judge import DigitJudge, save_judge
    from trainlab.models.var.convert import export_official
    from trainlab.models.var.transformer import VAR, VARConfig
    from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

    torch.manual_seed(0)
    vae = export_official(VQVAE(VQVAEConfig.debug()).freeze(), tmp_path / "vae.safetensors")
    var = export_official(VAR(VARConfig.debug()).eval(), tmp_path / "var.pth")
    out_dir = tmp_path / "samples"
    argv = ["sample", "--tokenizer-weights", str(vae), "--var-weights", str(var), "--classes", "3", "7"]
    assert main([*argv, "--samples-per-class", "3", "--out-dir", str(out_dir), "--device", "cpu"]) == 0
    capsys.readouterr()
    from_folder = _fid(capsys, out_dir, out_dir / "samples.npz", weights)
    assert from_folder["num_samples"] == from_folder["num_reference"] == 6
    assert abs(from_folder["fid"]) < 1e-6  # the folder's PNGs and the npz hold the same images

    judge = DigitJudge(resolution=SIDE, width=4, feature_dim=8)
    save_judge(judge, tmp_path / "judge.safetensors")
    judge_weights = ["--judge-weights", str(tmp_path / "judge.safetensors")]
    assert main(["eval", "judge", "--samples", str(out_dir), *judge_weights]) == 0
    printed = _json_line(capsys.readouterr().out)
    images_NHW3 = np.load(out_dir / "samples.npz")["arr_0"]
    predicted = predict(judge, torch.from_numpy(images_NHW3).permute(0, 3, 1, 2).float() / 127.5 - 1.0)
    expected = (predicted == torch.tensor([3, 3, 3, 7, 7, 7])).float().mean().item()
    assert printed["judged_accuracy"] == pytest.approx(expected) and printed["images"] == 6
    assert set(printed["per_class"]) == {"3", "7"}


@pytest.mark.slow
def test_openai_reference_batch_mu_sigma_give_the_second_fid(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference_NHW3 = _images(12, seed=5)
    reference_dir = _write_folder(tmp_path / "reference_images", reference_NHW3)
    pool_MD = _features(reference_dir, weights, "2048")
    mu_D, sigma_DD = feature_statistics(pool_MD)
    batch = tmp_path / "VIRTUAL_test_labeled.npz"
    np.savez(
        batch,
        arr_0=reference_NHW3,
        arr_1=np.arange(12) % 3,
        mu=mu_D,
        sigma=sigma_DD,
        mu_s=np.zeros(7),
        sigma_s=np.eye(7),
    )
    samples = _write_folder(tmp_path / "samples", _images(12, seed=6))
    printed = _fid(capsys, samples, batch, weights, "--feature-dims", "2048")
    sample_mu, sample_sigma = feature_statistics(_features(samples, weights, "2048"))
    expected = frechet_distance(sample_mu, sample_sigma, mu_D, sigma_DD)
    assert printed["fid_vs_reference_mu_sigma"] == pytest.approx(expected, rel=1e-6)
    assert printed["fid"] == pytest.approx(expected, rel=1e-3)  # the same statistics, torch-fidelity's arithmetic


# ---------------------------------------------------------------------------------------------------------- judge
def test_judge_accuracy_on_real_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainlab.data.digits import load_digits_dataset
    from trainlab.engine.loop import Trainer
    from trainlab.evaluate.judge_accuracy import accuracy
    from trainlab.models.digit_judge import load_judge
    from trainlab.recipes.judge import JudgeConfig, JudgeData, JudgeRecipe

    data = JudgeData(train_limit=1000, eval_limit=100)
    config = JudgeConfig(run_dir=tmp_path / "judge", data=data, epochs=3, tensorboard=False, progress=False)
    Trainer(JudgeRecipe(config)).fit()  # writes run_dir/judge.safetensors
    judge = load_judge(tmp_path / "judge" / "judge.safetensors")
    heldout = load_digits_dataset(split="heldout").subset(torch.arange(300))
    pixels_NHW3 = ((heldout.images_N3HW + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    folder = _write_folder(tmp_path / "digits", pixels_NHW3.numpy(), heldout.labels_N.tolist())
    judge_weights = ["--judge-weights", str(tmp_path / "judge" / "judge.safetensors")]
    assert main(["eval", "judge", "--samples", str(folder), *judge_weights]) == 0
    printed = _json_line(capsys.readouterr().out)
    reread_N3HW = pixels_NHW3.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    assert printed["judged_accuracy"] == pytest.approx(accuracy(judge, reread_N3HW, heldout.labels_N))
    assert printed["judged_accuracy"] > 0.8 and printed["images"] == 300
    per_class = printed["per_class"]
    assert sum(v["images"] for v in per_class.values()) == 300 and set(per_class) == {str(c) for c in range(10)}
    weighted = sum(v["images"] * v["accuracy"] for v in per_class.values()) / 300
    assert weighted == pytest.approx(printed["judged_accuracy"])


# ------------------------------------------------------------------------------------------------------ bad input
def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> None:
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert match in line, line


def test_bad_input_is_one_line_with_exit_code_2(
    tmp_path: Path, weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _write_folder(tmp_path / "good", _images(4, seed=0))
    fid = ["eval", "fid", "--samples", str(good)]
    with_weights = ["--inception-weights", str(weights)]

    _fails([*fid, "--reference", str(good), "--inception-weights", str(tmp_path / "nope.pth")], capsys, "download")
    _fails([*fid, "--reference", str(good)], capsys, "pt_inception-2015-12-05")

    np.savez(tmp_path / "stats_only.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    _fails([*fid, "--reference", str(tmp_path / "stats_only.npz"), *with_weights], capsys, "has no arr_0")
    np.savez(tmp_path / "no_sigma.npz", arr_0=_images(4, seed=0), mu=np.zeros(2048))
    _fails([*fid, "--reference", str(tmp_path / "no_sigma.npz"), *with_weights], capsys, "has mu but not sigma")
    np.savez(tmp_path / "small_mu.npz", arr_0=_images(4, seed=0), mu=np.zeros(64), sigma=np.eye(64))
    _fails([*fid, "--reference", str(tmp_path / "small_mu.npz"), *with_weights], capsys, "not statistics of 2048")
    np.savez(tmp_path / "float.npz", np.zeros((4, SIDE, SIDE, 3), dtype=np.float32))
    _fails([*fid, "--reference", str(tmp_path / "float.npz"), *with_weights], capsys, "expected uint8")
    np.savez(tmp_path / "neg.npz", arr_0=_images(4, seed=0), mu=np.zeros(2048), sigma=-np.eye(2048))
    _fails([*fid, "--reference", str(tmp_path / "neg.npz"), *with_weights], capsys, "sigma has the eigenvalue -1")
    skew = np.eye(2048)
    skew[0, 1] = 0.5
    np.savez(tmp_path / "skew.npz", arr_0=_images(4, seed=0), mu=np.zeros(2048), sigma=skew)
    _fails([*fid, "--reference", str(tmp_path / "skew.npz"), *with_weights], capsys, "sigma is not symmetric")
    state = torch.load(weights, weights_only=True)
    first = next(k for k, v in state.items() if v.is_floating_point())
    for name, value in (("nan", state[first].clone().fill_(float("nan"))), ("int", state[first].to(torch.int32))):
        torch.save({**state, first: value}, tmp_path / f"inception_{name}.pth")
        bad_weights = ["--inception-weights", str(tmp_path / f"inception_{name}.pth")]
        expected = "NaN" if name == "nan" else "holds integer values"
        _fails([*fid, "--reference", str(good), *bad_weights, "--feature-dims", "64"], capsys, expected)

    (tmp_path / "empty").mkdir()
    _fails(["eval", "fid", "--samples", str(tmp_path / "empty"), "--reference", str(good)], capsys, "no .png")
    mixed = _write_folder(tmp_path / "mixed", _images(2, seed=0))
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(mixed / "000009.png")
    _fails(["eval", "fid", "--samples", str(mixed), "--reference", str(good)], capsys, "mixes image sizes")
    _fails([*fid, "--reference", str(good), *with_weights, "--isc-splits", "10"], capsys, "--isc-splits 10")

    from trainlab.models.digit_judge import DigitJudge, save_judge

    save_judge(DigitJudge(resolution=SIDE, width=4, feature_dim=8), tmp_path / "judge.safetensors")
    judge = ["--judge-weights", str(tmp_path / "judge.safetensors")]
    _fails(["eval", "judge", "--samples", str(good), *judge], capsys, "has no class labels")
    np.savez(tmp_path / "unlabelled.npz", _images(4, seed=0))
    _fails(["eval", "judge", "--samples", str(tmp_path / "unlabelled.npz"), *judge], capsys, "has no class labels")
    out_of_range = _write_folder(tmp_path / "labelled", _images(2, seed=0), labels=[1, 12])
    _fails(["eval", "judge", "--samples", str(out_of_range), *judge], capsys, "label 12 is outside")
    huge = _write_folder(tmp_path / "huge", _images(2, seed=0), labels=[1, 10**23])
    _fails(["eval", "judge", "--samples", str(huge), *judge], capsys, f"names class {10**23}, which no model has")
    np.savez(tmp_path / "u64.npz", _images(2, seed=0), np.array([2**64 - 1, 1], dtype=np.uint64))
    _fails(["eval", "judge", "--samples", str(tmp_path / "u64.npz"), *judge], capsys, f"the label {2**64 - 1}, which")
    small = _write_folder(tmp_path / "small", np.zeros((2, 8, 8, 3), dtype=np.uint8), labels=[1, 2])
    _fails(["eval", "judge", "--samples", str(small), *judge], capsys, "the judge takes 16x16")
    _fails(["eval", "nope"], capsys, "choose knn, linear-probe, fid or judge")


def test_an_inception_weights_path_that_is_no_file_says_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO (or a folder) given as the weights is named as such, not as a file to download."""
    samples = _write_folder(tmp_path / "samples", _images(2, seed=1))
    os.mkfifo(tmp_path / "fifo.pth")
    argv = ["eval", "fid", "--samples", str(samples), "--reference", str(samples), "--device", "cpu"]
    assert main([*argv, "--inception-weights", str(tmp_path / "fifo.pth")]) == 2
    assert "fifo.pth is a FIFO, not a regular file" in capsys.readouterr().err


def test_a_folder_of_labelled_images_with_a_stray_unlabelled_one_names_it(tmp_path: Path) -> None:
    from trainlab.evaluate.image_sets import read_image_set

    folder = _write_folder(tmp_path / "samples", _images(3, seed=1), labels=[1, 2, 3])
    Image.fromarray(_images(1, seed=2)[0]).save(folder / "extra.png")
    with pytest.raises(UsageError, match=r"extra\.png has no class label in its name where the other images have"):
        read_image_set(folder)
