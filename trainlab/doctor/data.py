"""Data checks: the data root is readable, images per class, and how many image files cannot be decoded.

Layouts: an ImageNet-style folder (`root/train/<class>/*` and `root/val/<class>/*`, or the class folders directly
under `root`), listed by the recipes' own scanner (`trainlab.data.image_folder.scan_image_folder`) and decoded by
their own reader (`trainlab.data.images.read_image`: the same regular-file, format and size rules as training);
or CIFAR-10's python batches (`root/cifar-10-batches-py/`).

Decoding every file of ImageNet takes minutes, so by default an evenly spaced sample of `sample` images per split
is decoded (the listing is sorted by class, so the sample covers every class) and the unreadable ones among them
are counted and extrapolated; `sample=0` decodes every file.
"""

from __future__ import annotations

import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainlab.data.image_folder import FolderIndex, evenly_spaced, scan_image_folder
from trainlab.data.images import UnreadableImage, read_image
from trainlab.doctor.report import Check
from trainlab.errors import UsageError

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
UNREADABLE_FAIL_FRACTION = 0.5
SHOWN_EXAMPLES = 1


@dataclass(frozen=True)
class DecodeResult:
    """Images decoded from one split's listing."""

    listed: int
    decoded: int
    unreadable: tuple[str, ...]  # the reader's one-line message per unreadable file


def _decode(path: Path) -> str:
    try:
        read_image(path)
    except UnreadableImage as err:
        return str(err)
    return ""


def decode_sample(index: FolderIndex, sample: int, threads: int) -> DecodeResult:
    """Decode an evenly spaced sample of the listed images (every one with `sample=0`) with `threads` threads."""
    picks = evenly_spaced(len(index.files), sample)
    paths = [index.root / index.files[i][0] for i in picks]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        errors = [e for e in pool.map(_decode, paths) if e]
    return DecodeResult(listed=len(index.files), decoded=len(paths), unreadable=tuple(errors))


def splits_of(root: Path) -> list[tuple[str, Path]]:
    """(name, folder) of the image splits under `root`: train/ and val/ when present (a train/ or val/ that is not a
    folder too: its scan then fails as the training's would), else `root` itself."""
    found = [(name, root / name) for name in ("train", "val") if (root / name).exists()]
    return found or [(root.name or str(root), root)]


def check_split_listing(name: str, index: FolderIndex) -> Check:
    """Images per class of one split."""
    counts = [0] * len(index.classes)
    for _, class_id in index.files:
        counts[class_id] += 1
    empty = [index.classes[i] for i, n in enumerate(counts) if n == 0]
    detail = (
        f"{index.root}: {len(index.files)} images in {len(index.classes)} classes (per class {min(counts)} to "
        f"{max(counts)}, median {statistics.median(counts):g})"
    )
    notes = []
    if index.ignored_files:
        notes.append(f"{index.ignored_files} non-image file(s) ignored")
    left_out = sum(n for _, n in index.skipped)
    if left_out:
        notes.append(
            f"{left_out} entr{'y' if left_out == 1 else 'ies'} left out ({', '.join(r for r, _ in index.skipped)})"
        )
    if notes:
        detail += "; " + "; ".join(notes)
    values = {
        "images": len(index.files),
        "classes": len(index.classes),
        "min_per_class": min(counts),
        "max_per_class": max(counts),
    }
    if empty:
        shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        return Check(
            f"data-{name}",
            "WARN",
            detail + f"; {len(empty)} class folder(s) without images: {shown} (a label nothing trains)",
            "fill or remove the empty class folders (class ids are the sorted folder names)",
            values=values,
        )
    return Check(f"data-{name}", "PASS", detail, values=values)


def check_decoding(name: str, result: DecodeResult) -> Check:
    """How many sampled images the training reader refuses."""
    bad = len(result.unreadable)
    scope = (
        "every image" if result.decoded == result.listed else f"an even sample of {result.decoded} of {result.listed}"
    )
    values = {"listed": result.listed, "decoded": result.decoded, "unreadable": bad}
    check = f"data-{name}-decode"
    if bad == 0:
        return Check(check, "PASS", f"decoded {scope}: all readable", values=values)
    estimate = (
        "" if result.decoded == result.listed else f" (about {round(bad * result.listed / result.decoded)} in all)"
    )
    detail = f"decoded {scope}: {bad} unreadable{estimate}; first: {result.unreadable[0]}"
    if bad > UNREADABLE_FAIL_FRACTION * result.decoded:
        return Check(
            check, "FAIL", detail, "the data is damaged or not images: re-download or re-extract it", values=values
        )
    return Check(
        check,
        "WARN",
        detail + " (training skips each one, with a warning)",
        "delete or re-download those files" + ("; --data-sample 0 lists every one" if estimate else ""),
        values=values,
    )


def check_cifar(folder: Path) -> Check:
    """CIFAR-10's python batches present and readable."""
    missing = [f for f in CIFAR_FILES if not (folder / f).is_file()]
    if missing:
        return Check(
            "data-cifar10",
            "FAIL",
            f"{folder}: missing {', '.join(missing)}",
            "re-extract cifar-10-python.tar.gz there, or `trainlab train cifar --data.download true`",
        )
    unreadable = []
    total = 0
    for name in CIFAR_FILES:
        try:
            with open(folder / name, "rb") as f:
                f.read(1)
            total += (folder / name).stat().st_size
        except OSError as err:
            unreadable.append(f"{name} ({err.strerror})")
    if unreadable:
        return Check(
            "data-cifar10", "FAIL", f"{folder}: cannot read {', '.join(unreadable)}", "check the files' permissions"
        )
    return Check("data-cifar10", "PASS", f"{folder}: 5 training batches, test batch and meta ({total / 2**20:.0f} MiB)")


def check_data(root: Path, sample: int, threads: int | None = None) -> list[Check]:
    """Every data check of `root` (see the module docstring)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return [Check("data-root", "FAIL", f"{root} is not a directory", "pass --data.root with the training data")]
    if not os.access(root, os.R_OK | os.X_OK):
        return [Check("data-root", "FAIL", f"{root} cannot be read", "check its permissions (ls -ld)")]
    if (root / CIFAR_FOLDER).is_dir():
        return [check_cifar(root / CIFAR_FOLDER)]
    threads = threads or min(8, os.cpu_count() or 1)
    checks: list[Check] = []
    classes: dict[str, tuple[str, ...]] = {}
    for name, folder in splits_of(root):
        try:
            index = scan_image_folder(folder)
        except UsageError as err:
            checks.append(
                Check(f"data-{name}", "FAIL", str(err), "give --data.root the layout train/<class>/*, val/<class>/*")
            )
            continue
        classes[name] = index.classes
        checks.append(check_split_listing(name, index))
        checks.append(check_decoding(name, decode_sample(index, sample, threads)))
    if "train" in classes and "val" in classes and classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))
        only_val = sorted(set(classes["val"]) - set(classes["train"]))
        checks.append(
            Check(
                "data-classes",
                "FAIL",
                f"train/ has {len(classes['train'])} classes and val/ {len(classes['val'])}: class ids disagree "
                f"(only in train: {', '.join(only_train[:3]) or '-'}; only in val: {', '.join(only_val[:3]) or '-'})",
                "give train/ and val/ the same class folders",
            )
        )
    return checks
