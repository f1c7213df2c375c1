"""Evaluation pieces: FID and PSNR against closed forms, the digit judge (training on the engine, its views,
accuracy, save/load)."""

# Legend: N/M samples, D feature width, B batch, H/W pixels, K classes.

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trainlab.data.digit_views import digit_view
from trainlab.data.digits import DigitsData, load_digits_dataset
from trainlab.engine.loop import Trainer
from trainlab.errors import UsageError
from trainlab.evaluate.features import extract_features
from trainlab.evaluate.frechet import feature_statistics, fid_from_features, frechet_distance
from trainlab.evaluate.judge_accuracy import accuracy
from trainlab.evaluate.psnr import psnr, psnr_from_mse
from trainlab.models.digit_judge import DigitJudge, load_judge, save_judge
from trainlab.recipes.judge import JudgeConfig, JudgeData, JudgeRecipe


def _random_covariance(rng: np.random.Generator, dim: int) -> np.ndarray:
    a_DD = rng.normal(size=(dim, dim))
    return a_DD @ a_DD.T / dim + 0.1 * np.eye(dim)


def _frechet_by_eigenvalues(mu1: np.ndarray, s1: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    """Independent reference: Tr sqrt(s1 s2) = sum sqrt(eig(sqrt(s1) s2 sqrt(s1))), all symmetric."""
    w, v = np.linalg.eigh(s1)
    root1 = v @ np.diag(np.sqrt(np.clip(w, 0, None))) @ v.T
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh(root1 @ s2 @ root1), 0, None)).sum()
    return float((mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


# ---------------------------------------------------------------- FID


def test_fid_of_a_set_with_itself_is_zero() -> None:
    features_ND = torch.from_numpy(np.random.default_rng(0).normal(size=(2000, 16)) * 3.0 + 1.0)
    assert abs(fid_from_features(features_ND, features_ND)) < 1e-6


def test_frechet_distance_matches_the_closed_form_for_diagonal_gaussians() -> None:
    mu1, mu2 = np.array([0.0, 1.0, -2.0, 0.5]), np.array([1.0, 1.0, 0.0, -0.5])
    s1, s2 = np.array([1.0, 4.0, 0.25, 2.0]), np.array([2.0, 1.0, 0.25, 8.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))  # 6 + (0.1716 + 1 + 0 + 2)
    got = frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2))
    assert got == pytest.approx(expected, rel=1e-3)
    assert expected == pytest.approx(9.1716, abs=1e-4)


def test_fid_from_samples_of_two_gaussians_approaches_the_closed_form() -> None:
    rng = np.random.default_rng(1)
    mu1, mu2 = np.array([0.0, 2.0, 0.0]), np.array([1.0, 0.0, 0.0])
    s1, s2 = np.array([1.0, 2.0, 0.5]), np.array([4.0, 2.0, 1.0])
    a_ND = mu1 + rng.normal(size=(200_000, 3)) * np.sqrt(s1)
    b_MD = mu2 + rng.normal(size=(200_000, 3)) * np.sqrt(s2)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert fid_from_features(a_ND, b_MD) == pytest.approx(expected, rel=1e-2)


def test_frechet_distance_matches_an_eigenvalue_reference_for_full_covariances() -> None:
    rng = np.random.default_rng(2)
    mu1, mu2 = rng.normal(size=12), rng.normal(size=12)
    s1, s2 = _random_covariance(rng, 12), _random_covariance(rng, 12)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_frechet_by_eigenvalues(mu1, s1, mu2, s2), rel=1e-6)


def test_frechet_distance_matches_torch_fidelity() -> None:
    metric_fid = pytest.importorskip(
        "torch_fidelity.metric_fid", reason="optional cross-check: pip install torch-fidelity"
    )
    rng = np.random.default_rng(3)
    a_ND = torch.from_numpy(rng.normal(size=(500, 8)))
    b_MD = torch.from_numpy(rng.normal(size=(400, 8)) * 1.5 + 0.3)
    theirs = metric_fid.fid_statistics_to_metric(
        metric_fid.fid_features_to_statistics(a_ND), metric_fid.fid_features_to_statistics(b_MD), verbose=False
    )[metric_fid.KEY_METRIC_FID]
    assert fid_from_features(a_ND, b_MD) == pytest.approx(theirs, rel=1e-6)


def test_shifting_features_adds_the_squared_shift() -> None:
    a_ND = np.random.default_rng(4).normal(size=(300, 5))
    shift_D = np.array([1.0, -2.0, 0.0, 0.5, 3.0])
    assert fid_from_features(a_ND, a_ND + shift_D) == pytest.approx(float(shift_D @ shift_D), rel=1e-6)


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")
def test_fid_survives_singular_covariances() -> None:
    rng = np.random.default_rng(5)
    a_ND = rng.normal(size=(50, 8))
    b_MD = rng.normal(size=(60, 8)) + 0.5
    a_ND[:, 3] = 0.0  # a dead ReLU unit: zero variance in both sets
    b_MD[:, 3] = 0.0
    value = fid_from_features(a_ND, b_MD)
    assert value == pytest.approx(
        _frechet_by_eigenvalues(*feature_statistics(a_ND), *feature_statistics(b_MD)), rel=1e-5
    )
    assert value > 0.5
    # fewer samples than features: covariances of rank < D
    few_ND, few_MD = rng.normal(size=(6, 10)), rng.normal(size=(6, 10)) + 1.0
    assert np.isfinite(fid_from_features(few_ND, few_MD))


def test_frechet_distance_rejects_covariances_without_a_real_square_root() -> None:
    with pytest.raises(ValueError, match="imaginary"):
        frechet_distance(np.zeros(3), -np.eye(3), np.zeros(3), np.eye(3))


def test_feature_statistics_agree_with_torch() -> None:
    x_ND = torch.from_numpy(np.random.default_rng(6).normal(size=(100, 4))).double()
    mu_D, sigma_DD = feature_statistics(x_ND)
    np.testing.assert_allclose(mu_D, x_ND.mean(0).numpy(), rtol=1e-12)
    np.testing.assert_allclose(sigma_DD, torch.cov(x_ND.T).numpy(), rtol=1e-10)
    with pytest.raises(UsageError):
        feature_statistics(x_ND[:1])
    with pytest.raises(UsageError):
        frechet_distance(mu_D, sigma_DD, mu_D[:3], sigma_DD[:3, :3])


# ---------------------------------------------------------------- PSNR


def test_psnr_closed_form_for_a_known_mse() -> None:
    a_BCHW = torch.rand(2, 3, 8, 8) * 1.6 - 0.8
    b_BCHW = a_BCHW + 0.1  # MSE 0.01 -> 10 log10(4 / 0.01) = 26.0206 dB
    assert psnr(a_BCHW, b_BCHW) == pytest.approx(10 * math.log10(400.0), abs=1e-4)
    assert psnr(a_BCHW, b_BCHW) == pytest.approx(26.0206, abs=1e-4)
    assert psnr(a_BCHW, b_BCHW, data_range=1.0) == pytest.approx(20.0, abs=1e-4)


def test_psnr_averages_per_image_values_not_the_batch_mse() -> None:
    a_BCHW = torch.zeros(2, 3, 4, 4)
    b_BCHW = a_BCHW.clone()
    b_BCHW[0] += 0.1  # MSE 0.01 -> 26.02 dB
    b_BCHW[1] += 1.0  # MSE 1    ->  6.02 dB
    expected = (psnr_from_mse(0.01) + psnr_from_mse(1.0)) / 2
    assert psnr(a_BCHW, b_BCHW) == pytest.approx(expected, abs=1e-6)
    assert psnr(a_BCHW, b_BCHW) != pytest.approx(psnr_from_mse((0.01 + 1.0) / 2), abs=1e-2)


def test_psnr_of_an_exact_copy_is_finite_and_bad_shapes_raise() -> None:
    a_BCHW = torch.rand(2, 3, 4, 4)
    assert psnr(a_BCHW, a_BCHW) == pytest.approx(10 * math.log10(4 / 1e-10))
    with pytest.raises(UsageError):
        psnr(a_BCHW, a_BCHW[:1])


# ---------------------------------------------------------------- judge


class _OracleJudge(DigitJudge):
    """Predicts the class written (as a number 0-9) in pixel (0, 0, 0): a judge whose answers we know."""

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(img_B3HW[:, 0, 0, 0].round().long(), self.num_classes).float()


def test_conditional_accuracy_on_a_hand_built_case() -> None:
    judge = _OracleJudge(resolution=8)
    samples_B3HW = torch.zeros(4, 3, 8, 8)
    samples_B3HW[:, 0, 0, 0] = torch.tensor([3.0, 7.0, 1.0, 1.0])
    assert accuracy(judge, samples_B3HW, torch.tensor([3, 7, 1, 2])) == pytest.approx(0.75)
    assert accuracy(judge, samples_B3HW, torch.tensor([0, 0, 0, 0])) == 0.0
    with pytest.raises(UsageError, match="one label per image"):
        accuracy(judge, samples_B3HW, torch.tensor([3, 7]))
    with pytest.raises(UsageError, match="resize the samples"):
        accuracy(judge, torch.zeros(4, 3, 16, 16), torch.tensor([3, 7, 1, 2]))


@pytest.mark.parametrize("resolution", [16, 32])
def test_judge_shapes(resolution: int) -> None:
    judge = DigitJudge(resolution=resolution, feature_dim=24).eval()
    img_B3HW = torch.rand(5, 3, resolution, resolution) * 2 - 1
    assert judge(img_B3HW).shape == (5, 10)
    features_BD = judge.features(img_B3HW)
    assert features_BD.shape == (5, 24) and (features_BD >= 0).all()
    with pytest.raises(UsageError):
        DigitJudge(resolution=20)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny convs gain nothing from a second thread, and on a busy 2-core machine OpenMP waits make it ~8x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_16() -> tuple[DigitsData, DigitsData]:
    return load_digits_dataset(split="train"), load_digits_dataset(split="heldout")


def _train_judge(run_dir: Path, **changes: object) -> tuple[DigitJudge, float]:
    """The `judge` recipe on the engine; the trained judge (from its exported file) and its held-out accuracy."""
    config = JudgeConfig(run_dir=run_dir, log_every=50, tensorboard=False, progress=False, **changes)  # type: ignore[arg-type]
    result = Trainer(JudgeRecipe(config)).fit()
    return load_judge(run_dir / "judge.safetensors"), result.last_eval["heldout_accuracy"]


@pytest.mark.usefixtures("one_thread")
def test_judge_learns_digits_quickly_on_a_small_subset(
    tmp_path: Path, digits_16: tuple[DigitsData, DigitsData]
) -> None:
    _, heldout = digits_16
    judge, heldout_accuracy = _train_judge(tmp_path, data=JudgeData(train_limit=1000), epochs=3, batch_size=64)
    assert heldout_accuracy == accuracy(judge, heldout.images_N3HW, heldout.labels_N) > 0.8


@pytest.mark.usefixtures("one_thread")
def test_judge_training_is_seeded(tmp_path: Path) -> None:
    small = {"data": JudgeData(train_limit=256, eval_limit=50), "epochs": 1, "batch_size": 64}
    first, _ = _train_judge(tmp_path / "a", seed=0, **small)
    again, _ = _train_judge(tmp_path / "b", seed=0, **small)
    other, _ = _train_judge(tmp_path / "c", seed=1, **small)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(first.head.weight, other.head.weight)


def test_judge_views_are_a_function_of_seed_epoch_index(digits_16: tuple[DigitsData, DigitsData]) -> None:
    img_3HW = digits_16[0].images_N3HW[0]
    view = digit_view(img_3HW, seed=0, epoch=1, index=5)
    assert torch.equal(view, digit_view(img_3HW, seed=0, epoch=1, index=5))
    for other in (digit_view(img_3HW, seed=0, epoch=2, index=5), digit_view(img_3HW, seed=1, epoch=1, index=5)):
        assert not torch.equal(view, other)
    assert view.shape == img_3HW.shape and view.dtype == img_3HW.dtype
    assert float(view.min()) >= -1.0 - 1e-6 and float(view.max()) <= 1.0 + 1e-6
    assert abs(float(view.mean()) - float(img_3HW.mean())) < 0.1  # a small warp of the same digit, not noise


def test_judge_save_load_round_trip(tmp_path: Path) -> None:
    judge = DigitJudge(resolution=16, width=8, feature_dim=32)
    judge.train()
    judge(torch.rand(8, 3, 16, 16))  # move the BatchNorm running statistics away from their defaults
    judge.eval()
    path = tmp_path / "judge.safetensors"
    save_judge(judge, path)
    loaded = load_judge(path)
    assert (loaded.resolution, loaded.width, loaded.feature_dim) == (16, 8, 32) and not loaded.training
    img_B3HW = torch.rand(4, 3, 16, 16) * 2 - 1
    torch.testing.assert_close(loaded(img_B3HW), judge(img_B3HW), rtol=0, atol=0)
    features_BD = extract_features(loaded.features, img_B3HW, batch_size=3, device="cpu")
    torch.testing.assert_close(features_BD, judge.features(img_B3HW).detach())


def test_load_judge_rejects_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        load_judge(tmp_path / "nope.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(UsageError, match="not a trainlab digit-judge"):
        load_judge(foreign)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="not a readable"):
        load_judge(garbage)
    torch.save({"format": "trainlab-checkpoint"}, tmp_path / "last.pt")  # the judge run's checkpoint, not its export
    with pytest.raises(UsageError, match=r"last\.pt is a torch checkpoint, not a judge's safetensors weights file"):
        load_judge(tmp_path / "last.pt")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_judge_reaches_97_percent_at_the_demo_settings(tmp_path: Path) -> None:
    _, heldout_accuracy = _train_judge(tmp_path, seed=0)  # the recipe's defaults: what `trainlab demo` trains
    assert heldout_accuracy >= 0.97
