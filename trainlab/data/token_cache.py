"""Precomputed VAR token maps: encode every image once with the frozen tokenizer, then train from the tokens.

VAR never updates its tokenizer, so encoding the same image every epoch (the official code does, and on a CPU or a
small GPU the VQVAE encoder dominates the step time) can be done once. The price is augmentation: a cache holds
the tokens of a FIXED preprocessing, the validation one (resize the shorter side to 1.125 R with LANCZOS, center
crop R), not the official random crop. With horizontal flips on, it also holds the tokens of the mirrored image, and
the dataset picks the plain or mirrored variant of sample i in epoch e from (seed, e, i), so flips stay random.
Train from images (no cache) to reproduce the official random-crop augmentation exactly.

A cache is a directory:

    meta.json     fingerprint, shapes, counts; written last, so its presence marks a complete cache
    tokens.npy    (N, A, L) int16 when the vocabulary fits (V <= 32768, e.g. 4096), else int32;
                  A variants (1: plain; 2: plain and mirrored), L = sum(pn^2) tokens, scales concatenated coarse
                  to fine, row-major inside a scale
    labels.npy    (N,) int64 class ids

ImageNet-1k at 256 px: 1,281,167 x 680 x 2 bytes = 1.74 GB per variant.

Fingerprint: a SHA-256 of the tokenizer's weights, the patch_nums, the vocabulary size, the variants and a
description of the dataset (kind, size, class count, image side, crop, and for folders a hash of the file list).
`ensure_token_cache` rebuilds a cache whose fingerprint differs, or refuses it (one-line `UsageError` naming the
fields that differ), as the caller chooses. It never deletes what is not a cache: a folder at the cache path that
holds other files than a cache's is refused, not replaced. Under torchrun every rank encodes its share of the images
into the same files (the cache path must be visible to all ranks: one node, or a shared file system).
"""

# Shape legend: N images, A variants, L tokens of all scales, B batch, pn side of one scale.

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from trainlab import dist
from trainlab.data.augment import EpochCounter, augment_draws, decide_flip
from trainlab.data.errors import DataError
from trainlab.data.loader_workers import ignore_stop_signals
from trainlab.dtypes import at_least_float32
from trainlab.errors import UsageError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
VARIANT_PLAIN = "plain"
VARIANT_MIRRORED = "mirrored"
_META = "meta.json"
_TOKENS = "tokens.npy"
_LABELS = "labels.npy"
_CACHE_FILES = frozenset({_META, _TOKENS, _LABELS})
_CHECK_CHUNK = 1 << 24  # array elements per pass of the value check (32 MiB of int16 tokens)


def _damaged(path: Path, detail: str) -> DataError:
    detail = " ".join(detail.split())[:200]
    return DataError(f"token cache file {path} is damaged ({detail}); delete {path.parent} and it is rebuilt")


def _check_range(path: Path, array: np.ndarray, end: int, what: str, bound: str) -> None:
    """Every value of `array` in [0, end), read in chunks (a memory map is not loaded whole)."""
    flat = array.reshape(-1)
    for start in range(0, flat.size, _CHECK_CHUNK):
        chunk = flat[start : start + _CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= end:
            bad = low if low < 0 else high
            raise _damaged(path, f"{what} must be in [0, {end}) ({bound}), found {bad}")


def _refuse_foreign(path: Path) -> None:
    """Refuse a cache path that holds anything but a cache's own files: building a cache replaces the folder.

    Raises:
        UsageError: `path` is a file, or a folder with other entries than meta.json, tokens.npy and labels.npy.
    """
    if not path.exists():
        return
    if not path.is_dir():
        raise UsageError(f"token cache path {path} is a file, not a folder; pass a new --token-cache-path")
    foreign = sorted(entry.name for entry in path.iterdir() if entry.name not in _CACHE_FILES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(
            f"{path} is not a token cache (it holds {shown}), and building one would replace it; "
            "pass an empty or new --token-cache-path"
        )


def tokenizer_sha256(model: nn.Module) -> str:
    """SHA-256 over a model's state_dict (names, dtypes, shapes and bytes, in key order)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class TokenCacheSpec:
    """What a cache must have been built from.

    Attributes:
        tokenizer_sha256: `tokenizer_sha256(tokenizer)`.
        patch_nums: the token-map sides, coarse to fine.
        seq_len: tokens per image, all scales (`trainlab.models.var.scales.sequence_length(patch_nums)`).
        vocab_size: codebook size V (chooses int16 or int32 storage).
        dataset: a JSON-able description of the dataset's content (e.g. `ImageFolderDataset.describe()`).
        variants: ("plain",) or ("plain", "mirrored").
    """

    tokenizer_sha256: str
    patch_nums: tuple[int, ...]
    seq_len: int
    vocab_size: int
    dataset: dict[str, Any]
    variants: tuple[str, ...] = (VARIANT_PLAIN,)

    @property
    def token_dtype(self) -> np.dtype[Any]:
        """int16 when every token id fits (V <= 32768), else int32."""
        return np.dtype(np.int16) if self.vocab_size <= 2**15 else np.dtype(np.int32)

    def fingerprint(self) -> dict[str, Any]:
        """The JSON-able identity stored in meta.json and compared by `check_token_cache`."""
        return {
            "format_version": FORMAT_VERSION,
            "tokenizer_sha256": self.tokenizer_sha256,
            "patch_nums": [int(pn) for pn in self.patch_nums],
            "vocab_size": int(self.vocab_size),
            "variants": list(self.variants),
            "dataset": json.loads(json.dumps(self.dataset)),
        }


def _differences(expected: dict[str, Any], found: dict[str, Any], prefix: str = "") -> list[str]:
    diffs: list[str] = []
    for key in sorted(set(expected) | set(found)):
        a, b = expected.get(key), found.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}")
    return diffs


def read_meta(path: Path) -> dict[str, Any] | None:
    """The cache's meta.json, or None when there is no complete cache at `path`."""
    meta_path = Path(path) / _META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, or nested past the parser's depth
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), dict):
        return None  # JSON, but not what a finished build writes
    return meta


def check_token_cache(path: Path, spec: TokenCacheSpec) -> tuple[Literal["ok", "missing", "stale"], list[str]]:
    """Whether a usable cache for `spec` is at `path`; for a stale one, the fingerprint fields that differ."""
    meta = read_meta(path)
    if meta is None:
        return "missing", []
    for name in (_TOKENS, _LABELS):
        array = Path(path) / name
        if array.exists() and not array.is_file():  # a folder or FIFO: never opened (a FIFO would block)
            raise _damaged(array, "not a regular file")
    diffs = _differences(spec.fingerprint(), meta["fingerprint"])
    if not diffs and not ((Path(path) / _TOKENS).is_file() and (Path(path) / _LABELS).is_file()):
        diffs = [f"{_TOKENS} or {_LABELS} (missing)"]
    return ("stale", diffs) if diffs else ("ok", [])


class TokenCache:
    """A complete cache directory, memory-mapped read-only (opened lazily in each process, never pickled).

    Opening checks the arrays against meta.json (integer tokens of shape (N, A, L) with ids in [0, V), int labels of
    shape (N,), in [0, num_classes) when that is given), so a damaged or replaced file is one line naming it here, not
    an error inside a loader worker (or a class id read as "no class") later. The value check reads every token once
    (about a second for ImageNet's 1.7 GB per variant).

    Args:
        path: the cache directory.
        num_classes: the class count of the dataset it was built from; None: labels are not range-checked.

    Raises:
        UsageError: no meta.json; `DataError`: a damaged meta.json, tokens.npy or labels.npy.
    """

    def __init__(self, path: Path, *, num_classes: int | None = None) -> None:
        self.path = Path(path)
        meta = read_meta(self.path)
        if meta is None:
            raise UsageError(f"no complete token cache at {self.path} (meta.json missing); rebuild it")
        self.meta = meta
        try:
            self.num_items = int(meta["num_items"])
            self.num_variants = len(meta["fingerprint"]["variants"])
            self.patch_nums = tuple(int(pn) for pn in meta["fingerprint"]["patch_nums"])
            seq_len = int(meta["seq_len"])
        except (KeyError, TypeError, ValueError) as err:
            raise _damaged(self.path / _META, f"{type(err).__name__}: {err}") from None
        self._tokens: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        tokens_NAL, labels_N = self._open()
        if tokens_NAL.shape != (self.num_items, self.num_variants, seq_len) or tokens_NAL.dtype.kind != "i":
            raise _damaged(
                self.path / _TOKENS,
                f"{tokens_NAL.dtype} {tokens_NAL.shape}, meta.json says int ({self.num_items}, {self.num_variants}, "
                f"{seq_len})",
            )
        if labels_N.shape != (self.num_items,) or labels_N.dtype.kind != "i":
            raise _damaged(self.path / _LABELS, f"{labels_N.dtype} {labels_N.shape}, expected int ({self.num_items},)")
        vocab_size = meta["fingerprint"].get("vocab_size")
        if isinstance(vocab_size, int):
            _check_range(self.path / _TOKENS, tokens_NAL, vocab_size, "token ids", "the codebook size")
        if num_classes is not None:
            _check_range(self.path / _LABELS, labels_N, num_classes, "class ids", "the dataset's class count")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokens"] = state["_labels"] = None
        return state

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        if self._tokens is None or self._labels is None:
            for name in (_TOKENS, _LABELS):
                try:  # no pickle: object arrays are refused by np.load
                    array = np.load(self.path / name, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError, EOFError) as err:
                    raise _damaged(self.path / name, f"{type(err).__name__}: {err}") from None
                if name == _TOKENS:
                    self._tokens = array
                else:
                    self._labels = array
        assert self._tokens is not None and self._labels is not None
        return self._tokens, self._labels

    def tokens(self, index: int, variant: int = 0) -> torch.Tensor:
        """Tokens of one image, int64 (L,), all scales concatenated."""
        tokens_NAL, _ = self._open()
        return torch.from_numpy(np.asarray(tokens_NAL[index, variant], dtype=np.int64))

    def label(self, index: int) -> int:
        """Class id of one image."""
        _, labels_N = self._open()
        return int(labels_N[index])

    @property
    def labels(self) -> np.ndarray:
        """Class ids of all images, int64 (N,)."""
        return np.asarray(self._open()[1])


class TokenCacheDataset(Dataset[dict[str, torch.Tensor]]):
    """`{"tokens": int64 (L,), "label": int64}` samples from a `TokenCache`.

    With two variants and `random_variant`, sample i in epoch e is the mirrored variant when
    `decide_flip("random", augment_draws(seed, e, i))`: the same decision `ImageFolderDataset` makes for a random
    flip.

    Args:
        cache: the cache.
        seed: data seed.
        random_variant: choose between plain and mirrored per (seed, epoch, index); False always gives plain.
    """

    def __init__(self, cache: TokenCache, *, seed: int = 0, random_variant: bool = True) -> None:
        self.cache = cache
        self.seed = seed
        self.random_variant = random_variant and cache.num_variants > 1
        self._epoch = EpochCounter()

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch of the variant draws (visible to already-started loader workers too)."""
        self._epoch.set(epoch)

    def __len__(self) -> int:
        return self.cache.num_items

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        variant = 0
        if self.random_variant:
            variant = int(decide_flip("random", augment_draws(self.seed, self._epoch.get(), index)))
        return {
            "tokens": self.cache.tokens(index, variant),
            "label": torch.tensor(self.cache.label(index), dtype=torch.int64),
        }


@torch.no_grad()
def encode_batch(tokenizer: nn.Module, img_B3HW: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] -> tokens (B, L) int64 of all scales, in the tokenizer's dtype (at least float32) with
    autocast off.

    The encoder runs under `torch.inference_mode()` (in-place activations in the tokenizer's blocks); the tokens
    are returned as an ordinary tensor, usable by autograd-recorded code.
    """
    with torch.inference_mode(), torch.autocast(img_B3HW.device.type, enabled=False):
        dtype = at_least_float32(next(tokenizer.parameters()).detach()).dtype
        tokens_BL = torch.cat(list(tokenizer.img_to_idx(img_B3HW.to(dtype))), dim=1)  # type: ignore[operator]
    return tokens_BL.clone()


def build_token_cache(
    path: Path,
    spec: TokenCacheSpec,
    variant_datasets: Sequence[Dataset[dict[str, torch.Tensor]]],
    tokenizer: nn.Module,
    *,
    device: torch.device,
    batch_size: int = 64,
    num_workers: int = 0,
    num_classes: int | None = None,
) -> TokenCache:
    """Encode every image of every variant dataset and write the cache at `path` (replacing a cache that is there).

    Every rank of a process group encodes rows rank, rank + world, ... into the same files; rank 0 writes
    `meta.json` last and moves the finished directory into place.

    Args:
        path: the cache directory.
        spec: its fingerprint.
        variant_datasets: one dataset per entry of `spec.variants`, same length and order, yielding
            `{"image": (3, R, R) in [-1, 1], "label": int64}`.
        tokenizer: the frozen VQVAE (on `device`, eval mode).
        device: where to encode.
        batch_size: images per encoder call.
        num_workers: DataLoader workers for decoding images.
        num_classes: as `TokenCache`'s.

    Returns:
        The finished cache.

    Raises:
        UsageError: `path` holds other files than a cache's (checked before encoding: nothing is deleted).
    """
    assert len(variant_datasets) == len(spec.variants)
    path = Path(path)
    _refuse_foreign(path)
    num_items = len(variant_datasets[0])  # type: ignore[arg-type]
    building = path.with_name(path.name + ".building")
    rank, world = dist.rank(), dist.world_size()
    if rank == 0:
        if building.exists():
            shutil.rmtree(building)
        building.mkdir(parents=True)
        np.lib.format.open_memmap(
            building / _TOKENS, mode="w+", dtype=spec.token_dtype, shape=(num_items, len(spec.variants), spec.seq_len)
        ).flush()
        np.lib.format.open_memmap(building / _LABELS, mode="w+", dtype=np.int64, shape=(num_items,)).flush()
    dist.barrier()
    tokens_NAL = np.load(building / _TOKENS, mmap_mode="r+")
    labels_N = np.load(building / _LABELS, mmap_mode="r+")
    mine = list(range(rank, num_items, world))
    was_training = tokenizer.training
    tokenizer.eval()
    start = time.perf_counter()
    skipped = 0
    for variant, dataset in enumerate(variant_datasets):
        loader = DataLoader(  # an own generator: building a cache must not move the global RNG (VAR's init)
            Subset(dataset, mine),
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            worker_init_fn=ignore_stop_signals,
            generator=torch.Generator().manual_seed(0),
        )
        done = 0
        next_report = 0.1
        for batch in loader:
            img_B3HW = batch["image"].to(device, non_blocking=True)
            tokens_BL = encode_batch(tokenizer, img_B3HW).cpu().numpy()
            rows = mine[done : done + len(tokens_BL)]
            tokens_NAL[rows, variant] = tokens_BL.astype(spec.token_dtype)
            if variant == 0:
                labels_N[rows] = batch["label"].numpy()
            done += len(tokens_BL)
            if done >= next_report * len(mine):
                log.info(
                    "token cache %s: variant %s, %d/%d images (%.0f s)",
                    path.name,
                    spec.variants[variant],
                    done,
                    len(mine),
                    time.perf_counter() - start,
                )
                while next_report * len(mine) <= done:
                    next_report += 0.1
        skipped += int(getattr(dataset, "skipped_images", 0))
    tokenizer.train(was_training)
    tokens_NAL.flush()
    labels_N.flush()
    del tokens_NAL, labels_N
    if skipped:
        log.warning("token cache %s: %d unreadable image(s) replaced by the next readable one", path, skipped)
    dist.barrier()
    if rank == 0:
        meta = {
            "fingerprint": spec.fingerprint(),
            "num_items": num_items,
            "seq_len": spec.seq_len,
            "token_dtype": str(spec.token_dtype),
            "skipped_images_rank0": skipped,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        with open(building / _META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.rmtree(path)
        os.replace(building, path)
        log.info("token cache written: %s (%d images x %d variant(s))", path, num_items, len(spec.variants))
    dist.barrier()
    return TokenCache(path, num_classes=num_classes)


def ensure_token_cache(
    path: Path,
    spec: TokenCacheSpec,
    make_datasets: Callable[[], Sequence[Dataset[dict[str, torch.Tensor]]]],
    tokenizer: nn.Module,
    *,
    on_stale: Literal["rebuild", "refuse"],
    device: torch.device,
    batch_size: int = 64,
    num_workers: int = 0,
    num_classes: int | None = None,
) -> TokenCache:
    """Open the cache at `path` if its fingerprint matches `spec`; otherwise build it.

    Args:
        path: the cache directory.
        spec: the expected fingerprint.
        make_datasets: builds the variant datasets (only called when encoding is needed).
        tokenizer: the frozen VQVAE.
        on_stale: what to do with a cache built from something else: "rebuild" it, or "refuse" (UsageError).
        device: where to encode.
        batch_size: images per encoder call.
        num_workers: DataLoader workers while encoding.
        num_classes: the dataset's class count: the cache's labels must be below it.

    Raises:
        UsageError: a stale cache and `on_stale="refuse"`; a folder at `path` that holds other files than a cache's.
        DataError: token ids or labels out of range (a damaged or edited cache).
    """
    status, diffs = check_token_cache(path, spec)
    if status == "ok":
        log.info("token cache %s matches (tokenizer, patch_nums, dataset): using it", path)
        return TokenCache(path, num_classes=num_classes)
    _refuse_foreign(path)  # before encoding: a refusal costs nothing and deletes nothing
    if status == "stale":
        if on_stale == "refuse":
            raise UsageError(
                f"token cache {path} was built for something else (it differs in: {', '.join(diffs)}); "
                "delete it, pass another --token-cache-path, or add --token-cache-rebuild"
            )
        log.warning("token cache %s is stale (%s differ): rebuilding it", path, ", ".join(diffs))
    else:
        log.info("token cache %s not found: encoding the dataset once with the frozen tokenizer", path)
    return build_token_cache(
        path,
        spec,
        make_datasets(),
        tokenizer,
        device=device,
        batch_size=batch_size,
        num_workers=num_workers,
        num_classes=num_classes,
    )
