"""FID, Inception Score and precision/recall of generated images against a reference set, through torch-fidelity.

torch-fidelity computes everything here; this module only feeds it and keeps its reference statistics:

- features: torch-fidelity's `inception-v3-compat` InceptionV3 (the TF 2015-12-05 graph that FID is defined on,
  resized to 299x299 inside the network) from a LOCAL weights file; nothing is downloaded. Its 2048-d pool features
  give FID and precision/recall, its `logits_unbiased` the Inception Score.
- FID: `fid_features_to_statistics` + `fid_statistics_to_metric`; Inception Score: `isc_features_to_metric`
  (`isc_splits` splits, shuffled with torch-fidelity's seed); precision/recall: `prc_features_to_metric`
  (k = 3 nearest neighbours, Kynkäänniemi et al. 2019: precision = share of samples inside the reference
  manifold, recall = share of reference images inside the samples' manifold), all on the Inception pool features,
  as OpenAI's evaluator does (torch-fidelity's default for precision/recall would be VGG16, a second download).
- `feature_layer` "64" / "192" / "768" (pytorch-fid's `--dims`) swaps the pool features for an earlier layer's, for
  sets of fewer than 2048 images (whose 2048-d covariance is singular) and for quick checks: such numbers are not
  comparable with published FIDs.
- caching: the reference's features and FID statistics are cached in a folder next to the reference
  (`REF.fidelity-cache/`), one `.npz` per key made of the SHA-256 of the reference images and of the Inception weights
  file (other images or other weights never reuse a stale entry), read with `allow_pickle=False`: not torch-fidelity's
  own cache, which unpickles its files (`torch.load(weights_only=False)`), so a file planted in that folder could run
  code. A damaged entry is computed again, with a warning.

An OpenAI-evaluator reference batch (e.g. VAR's `VIRTUAL_imagenet256_labeled.npz`) holds `arr_0` (the reference
images), `arr_1` (labels), `mu`/`sigma` (pool-feature statistics of the evaluator's TF Inception) and
`mu_s`/`sigma_s` (spatial features for sFID). `arr_0` is used for everything: precision/recall need the reference's
individual features, and statistics from the same extractor as the samples keep FID free of extractor
differences. `mu`/`sigma`, when present, give a second number, `fid_vs_reference_mu_sigma` (our float64
`frechet_distance`): the samples' statistics against the evaluator's own, i.e. how published VAR FIDs are
computed (the same Inception graph and TF-style resize, so close to `fid`, though TensorFlow's and PyTorch's
arithmetic are not bit-identical). `mu_s`/`sigma_s` (sFID) are not used.
"""

# Shape legend: N samples, M reference images, D = 2048 pool features, H/W pixels.

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from trainlab.errors import UsageError, missing_file
from trainlab.evaluate.frechet import frechet_distance
from trainlab.evaluate.image_sets import ImageSet, npz_members, read_npz_member
from trainlab.evaluate.inception import load_inception

log = logging.getLogger(__name__)

POOL_FEATURES = "2048"
FEATURE_LAYERS = ("64", "192", "768", "2048")
LOGITS = "logits_unbiased"


@dataclasses.dataclass(frozen=True)
class FidelityReport:
    """The numbers of one samples-vs-reference comparison (see the module docstring for each)."""

    fid: float
    fid_vs_reference_mu_sigma: float | None
    inception_score: float
    inception_score_std: float
    precision: float
    recall: float
    num_samples: int
    num_reference: int
    samples_images_per_second: float
    reference_images_per_second: float | None  # None: the reference features came from the cache
    reference_cache: str  # "hit", "miss" or "off" (the folder next to the reference is not writable)
    cache_dir: str


def _torch_fidelity() -> Any:
    try:
        import torch_fidelity
    except ImportError:
        raise UsageError("trainlab eval fid needs torch-fidelity: pip install 'trainlab[rfid]'") from None
    return torch_fidelity


def load_metric_inception(path: Path | None, device: torch.device, *, feature_layer: str = POOL_FEATURES) -> nn.Module:
    """torch-fidelity's InceptionV3 with `feature_layer` features (see `compare_image_sets`) and unbiased logits,
    weights from the local file `path`.

    Raises:
        UsageError: torch-fidelity missing, no or a missing file (the message says where to get it), a file that is
            not a plain state_dict, or weights that do not fit the network.
    """
    _torch_fidelity()
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    if feature_layer not in FEATURE_LAYERS:
        raise UsageError(f"feature layer {feature_layer!r} is not one of {', '.join(FEATURE_LAYERS)}")
    if path is None or not path.is_file():
        given = "no --inception-weights given" if path is None else f"--inception-weights {path} {missing_file(path)}"
        raise UsageError(
            f"{given}: download torch-fidelity's release asset {URL_INCEPTION_V3} (the pt_inception-2015-12-05 "
            "weights) and pass its path"
        )
    module: nn.Module = load_inception(path, (feature_layer, LOGITS)).to(device)
    return module


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Uint8Images(Dataset[torch.Tensor]):
    """An ImageSet as the uint8 (3, H, W) tensors torch-fidelity's extractors take."""

    def __init__(self, images: ImageSet) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.images.image(index)).permute(2, 0, 1)


def inception_feature_layers(
    images: ImageSet, extractor: nn.Module, *, batch_size: int, decode_workers: bool
) -> tuple[dict[str, torch.Tensor], float]:
    """Inception features of every image (torch-fidelity's `get_featuresdict_from_dataset`) and images/s.

    Args:
        images: the set to run through the network.
        extractor: from `load_metric_inception`, on the device to use.
        batch_size: images per forward pass.
        decode_workers: decode images in torch-fidelity's DataLoader workers (up to 4 processes) rather than in this
            process.

    Returns:
        {feature layer: float32 (N, D) features, "logits_unbiased": float32 (N, 1008)} and images per second.
    """
    from torch_fidelity.utils import get_featuresdict_from_dataset

    cuda = next(extractor.parameters()).device.type == "cuda"
    start = time.perf_counter()
    features = get_featuresdict_from_dataset(
        _Uint8Images(images), extractor, batch_size, cuda, not decode_workers, False
    )
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return features, len(images) / seconds


def compare_image_sets(
    samples: ImageSet,
    reference: ImageSet,
    extractor: nn.Module,
    *,
    weights_sha256: str,
    feature_layer: str = POOL_FEATURES,
    batch_size: int = 64,
    decode_workers: bool = True,
    isc_splits: int = 10,
    prc_neighborhood: int = 3,
) -> FidelityReport:
    """FID, Inception Score (of the samples) and precision/recall of `samples` against `reference`.

    Args:
        samples: the generated images.
        reference: the real images; an `.npz` reference may also carry the evaluator's `mu`/`sigma`.
        extractor: from `load_metric_inception`.
        weights_sha256: SHA-256 of the Inception weights file (part of the cache key).
        feature_layer: the features of FID and precision/recall, the layer `extractor` was built with: "2048" (the
            pool features FID is defined on) or "64" / "192" / "768" (earlier layers, pytorch-fid's `--dims`: a
            covariance of rank < D is singular, so these suit sets of fewer than 2048 images; their numbers are not
            comparable with published FIDs, and the reference's `mu`/`sigma` are then not used).
        batch_size: images per forward pass.
        decode_workers: see `inception_feature_layers`.
        isc_splits: Inception Score splits (the samples are shuffled, then cut into this many parts).
        prc_neighborhood: k of the k-nearest-neighbour manifolds of precision/recall.

    Raises:
        UsageError: too few images for the splits or the neighbourhood, or a reference `.npz` whose `mu`/`sigma`
            are not the statistics of 2048-d features.
    """
    from torch_fidelity.defaults import DEFAULTS
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_isc import isc_features_to_metric
    from torch_fidelity.metric_prc import prc_features_to_metric

    if len(samples) < isc_splits:
        raise UsageError(
            f"{len(samples)} samples cannot be cut into --isc-splits {isc_splits}: lower it or add samples"
        )
    for name, count in (("samples", len(samples)), ("reference images", len(reference))):
        if count <= prc_neighborhood:
            raise UsageError(
                f"precision/recall with --prc-neighborhood {prc_neighborhood} needs more than {prc_neighborhood} "
                f"{name}, got {count}"
            )
    reference_mu_sigma = read_reference_mu_sigma(reference)
    if reference_mu_sigma is not None and feature_layer != POOL_FEATURES:
        log.warning(
            "the reference's mu/sigma are statistics of 2048-d features: not used with %s-d features", feature_layer
        )
        reference_mu_sigma = None
    ref_features, ref_stats, ref_speed, cache_state, cache_dir = _reference_features(
        reference,
        extractor,
        weights_sha256=weights_sha256,
        feature_layer=feature_layer,
        batch_size=batch_size,
        decode_workers=decode_workers,
    )
    features, speed = inception_feature_layers(samples, extractor, batch_size=batch_size, decode_workers=decode_workers)
    features_ND = features[feature_layer]
    stats = fid_features_to_statistics(features_ND)
    fid = fid_statistics_to_metric(stats, ref_stats, False)["frechet_inception_distance"]
    isc = isc_features_to_metric(features[LOGITS], isc_splits, DEFAULTS["samples_shuffle"], DEFAULTS["rng_seed"])
    prc = prc_features_to_metric(  # save_cpu_ram: the same numbers without an N x N distance matrix in memory
        features_ND, ref_features, prc_neighborhood=prc_neighborhood, save_cpu_ram=True, verbose=False
    )
    fid_openai = None
    if reference_mu_sigma is not None:
        try:
            fid_openai = frechet_distance(stats["mu"], stats["sigma"], *reference_mu_sigma)
        except ValueError as err:  # a covariance too singular for sqrtm (a handful of samples): say so, go on
            log.warning("fid_vs_reference_mu_sigma not computed: %s (use more samples)", err)
    return FidelityReport(
        fid=float(fid),
        fid_vs_reference_mu_sigma=fid_openai,
        inception_score=float(isc["inception_score_mean"]),
        inception_score_std=float(isc["inception_score_std"]),
        precision=float(prc["precision"]),
        recall=float(prc["recall"]),
        num_samples=len(samples),
        num_reference=len(reference),
        samples_images_per_second=speed,
        reference_images_per_second=ref_speed,
        reference_cache=cache_state,
        cache_dir=str(cache_dir),
    )


def read_reference_mu_sigma(reference: ImageSet) -> tuple[np.ndarray, np.ndarray] | None:
    """The evaluator's `mu` (D,) and `sigma` (D, D) of a reference `.npz`, or None when it has neither.

    Raises:
        UsageError: only one of the two, or not the statistics of D = 2048 features.
    """
    if reference.array_NHW3 is None:
        return None
    names = npz_members(reference.source, "--reference")
    present = [name for name in ("mu", "sigma") if name in names]
    if not present:
        return None
    if len(present) == 1:
        raise UsageError(
            f"--reference {reference.source} has {present[0]} but not {'sigma' if present == ['mu'] else 'mu'}: "
            "an OpenAI-evaluator reference batch holds both (or drop the one)"
        )
    mu_D, sigma_DD = (read_npz_member(reference.source, name, "--reference") for name in ("mu", "sigma"))
    if mu_D.dtype.kind not in "fiu" or sigma_DD.dtype.kind not in "fiu":
        raise UsageError(
            f"--reference {reference.source}: mu is {mu_D.dtype} and sigma {sigma_DD.dtype}, expected float statistics"
        )
    mu_D, sigma_DD = np.asarray(mu_D, dtype=np.float64), np.asarray(sigma_DD, dtype=np.float64)
    dim = int(POOL_FEATURES)
    if mu_D.shape != (dim,) or sigma_DD.shape != (dim, dim):
        raise UsageError(
            f"--reference {reference.source}: mu {mu_D.shape} / sigma {sigma_DD.shape} are not statistics of "
            f"{dim}-d Inception pool features ((2048,) / (2048, 2048))"
        )
    if not (np.isfinite(mu_D).all() and np.isfinite(sigma_DD).all()):
        raise UsageError(f"--reference {reference.source}: mu or sigma holds NaN or inf; recompute the statistics")
    scale = max(float(np.abs(sigma_DD).max()), 1e-300)
    if not np.allclose(sigma_DD, sigma_DD.T, rtol=0.0, atol=1e-6 * scale):
        raise UsageError(f"--reference {reference.source}: sigma is not symmetric, so no covariance; recompute it")
    lowest = float(np.linalg.eigvalsh(sigma_DD)[0])
    if lowest < -1e-6 * scale * dim:  # a covariance has no negative eigenvalue (beyond rounding)
        raise UsageError(
            f"--reference {reference.source}: sigma has the eigenvalue {lowest:.3g}, so it is no covariance (a "
            "Fréchet distance from it could come out negative); recompute the statistics"
        )
    return mu_D, sigma_DD


def _reference_features(
    reference: ImageSet,
    extractor: nn.Module,
    *,
    weights_sha256: str,
    feature_layer: str,
    batch_size: int,
    decode_workers: bool,
) -> tuple[torch.Tensor, dict[str, np.ndarray], float | None, str, Path]:
    """Features (M, D) and FID statistics of the reference, from the cache next to it when there (module docstring:
    an `.npz` read without pickle; a damaged entry is computed again)."""
    from torch_fidelity.metric_fid import fid_features_to_statistics

    cache_dir = reference.source.parent / f"{reference.source.name}.fidelity-cache"
    try:
        cache_dir.mkdir(exist_ok=True)
        cache = True
    except OSError as err:
        log.warning("cannot cache the reference statistics in %s (%s): computing them every time", cache_dir, err)
        cache = False
    name = extractor.get_name()  # type: ignore[operator]
    key = f"ref-{reference.fingerprint()[:16]}-weights-{weights_sha256[:16]}"
    entry = cache_dir / f"{key}-{name}-{feature_layer}.npz"
    cached = _read_cache_entry(entry) if cache and entry.is_file() else None
    if cached is not None:
        log.info("reference statistics from the cache %s (key %s)", cache_dir, key)
        return torch.from_numpy(cached[0]), cached[1], None, "hit", cache_dir
    layers, speed = inception_feature_layers(reference, extractor, batch_size=batch_size, decode_workers=decode_workers)
    reference_MD = layers[feature_layer]
    stats: dict[str, np.ndarray] = fid_features_to_statistics(reference_MD)
    if cache:
        _write_cache_entry(entry, reference_MD, stats)
    return reference_MD, stats, speed, ("miss" if cache else "off"), cache_dir


def _read_cache_entry(entry: Path) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """A cached reference's (features (M, D), {mu, sigma}), or None (with a warning) when the entry is damaged."""
    try:
        with np.load(entry, allow_pickle=False) as npz:
            features_MD, mu_D, sigma_DD = npz["features"], npz["mu"], npz["sigma"]
        dim = features_MD.shape[-1] if features_MD.ndim == 2 else -1
        if dim < 1 or mu_D.shape != (dim,) or sigma_DD.shape != (dim, dim) or features_MD.dtype.kind != "f":
            raise ValueError(f"features {features_MD.shape}, mu {mu_D.shape}, sigma {sigma_DD.shape}")
        if not all(np.isfinite(array).all() for array in (features_MD, mu_D, sigma_DD)):
            raise ValueError("NaN or inf values")
    except Exception as err:  # whatever a cut or foreign file makes the reader raise: compute again
        log.warning("cached reference statistics %s are damaged (%s): computing them again", entry, err)
        return None
    return features_MD, {"mu": mu_D, "sigma": sigma_DD}


def _write_cache_entry(entry: Path, features_MD: torch.Tensor, stats: dict[str, np.ndarray]) -> None:
    """Write a cache entry atomically (a killed write leaves no entry, only a temp file the next write replaces)."""
    partial = entry.with_name(f".{entry.name}.partial.npz")
    try:
        np.savez(partial, features=features_MD.cpu().numpy(), mu=stats["mu"], sigma=stats["sigma"])
        os.replace(partial, entry)
    except OSError as err:
        log.warning("cannot cache the reference statistics in %s (%s)", entry, err)
