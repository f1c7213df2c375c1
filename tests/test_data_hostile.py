"""Hostile image folders and image files: one scanner and one reader with the same rules for every recipe and command.

A FIFO named `*.png` is left out by the scanner and refused by the reader without blocking; a symbolic-link loop
lists each image once; corrupt images and decompression bombs are skipped and counted by every folder dataset
(VAR / tokenizer, MoCo, linear probe) and are one line (exit code 2) for commands that read a named image (`edit`,
`eval judge`); an error raised inside a DataLoader worker reaches the user as the same one line as without workers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from trainlab.cli import main
from trainlab.data.errors import DataError, worker_message
from trainlab.data.image_folder import (
    SKIP_BROKEN,
    SKIP_DUPLICATE_FILE,
    SKIP_NOT_REGULAR,
    SKIP_REVISITED_DIR,
    ImageFolderDataset,
    scan_image_folder,
)
from trainlab.data.images import MAX_IMAGE_PIXELS, UnreadableImage, read_image, read_image_size
from trainlab.data.loader_options import LoaderOptions
from trainlab.data.resized_crops import ResizedCropFolder
from trainlab.data.ssl_views import FolderTwoViews
from trainlab.data.transforms import TwoViews
from trainlab.engine.sampler import StepBatchSampler, build_loader
from trainlab.errors import UsageError
from trainlab.evaluate.image_sets import read_image_set

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
needs_symlinks = pytest.mark.skipif(os.name == "nt", reason="needs POSIX symbolic links")


def _png(path: Path, seed: int, size: tuple[int, int] = (20, 16)) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG that declares width x height 1-bit pixels: all a decoder sees before it allocates (a bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.parent.mkdir(parents=True, exist_ok=True)
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )
    return path


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ----------------------------------------------------------------------------------------------- the one reader
def test_valid_images_decode_exactly_as_pillow_does(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for suffix in (".png", ".jpg", ".bmp", ".ppm", ".tiff", ".webp", ".gif"):
        path = tmp_path / f"a{suffix}"
        Image.fromarray(rng.integers(0, 256, (13, 17, 3), dtype=np.uint8)).save(path)
        with Image.open(path) as img:
            expected = np.asarray(img.convert("RGB"))
        assert np.array_equal(np.asarray(read_image(path)), expected), suffix
        assert read_image(path).mode == "RGB" and read_image_size(path) == (17, 13)
    Image.fromarray(rng.integers(0, 256, (5, 7), dtype=np.uint8)).save(tmp_path / "g.pgm")
    with Image.open(tmp_path / "g.pgm") as img:
        assert np.array_equal(np.asarray(read_image(tmp_path / "g.pgm", "L")), np.asarray(img.convert("L")))


def _hostile_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the one-line error says about it)."""
    good = _png(tmp_path / "good.png", seed=0)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:70])
    (tmp_path / "empty.png").write_bytes(b"")
    eps = tmp_path / "vector.png"  # PostScript under an image name: Pillow would hand it to Ghostscript
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    files = {
        "truncated": (truncated, "truncated"),
        "empty": (tmp_path / "empty.png", "not an image of a supported format"),
        "eps": (eps, "not an image of a supported format"),
        "bomb": (_png_header(tmp_path / "bomb.png", 20000, 20000), f"over the limit of {MAX_IMAGE_PIXELS} pixels"),
        "just-over": (
            _png_header(tmp_path / "over.png", 9500, 9500),
            f"9500x9500 = 90250000 pixels, over the limit of {MAX_IMAGE_PIXELS} pixels",
        ),
        "missing": (tmp_path / "missing.png", "No such file or directory"),
        "directory": (tmp_path, "not a regular file (a directory)"),
    }
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.png")
        files["fifo"] = (tmp_path / "fifo.png", "not a regular file (a FIFO)")
    if os.name != "nt":
        (tmp_path / "broken.png").symlink_to(tmp_path / "nowhere.png")
        files["broken-link"] = (tmp_path / "broken.png", "No such file or directory")
    return files


@pytest.mark.timeout(60)
def test_every_unreadable_file_is_one_typed_error_naming_it(tmp_path: Path) -> None:
    assert _png_header(tmp_path / "ok.png", 9000, 9000) and read_image_size(tmp_path / "ok.png") == (9000, 9000)
    for name, (path, reason) in _hostile_files(tmp_path).items():
        for read in (read_image, read_image_size):
            if name == "truncated" and read is read_image_size:
                assert read(path) == (20, 16)  # the header is intact: only decoding finds the cut
                continue
            with pytest.raises(UnreadableImage) as info:  # a FIFO without a writer would block a plain open forever
                read(path)
            message = _one_line(info.value)
            assert message.startswith(f"{path} is not a readable image: ") and reason in message, (name, message)
    assert isinstance(UnreadableImage("x"), UsageError)


# ---------------------------------------------------------------------------------------------- the one scanner
def _old_listing(root: Path) -> list[tuple[str, int]]:
    """The listing of the scanner this one replaced (os.walk), for folders without links or special files."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files = []
    for class_id, name in enumerate(classes):
        found = []
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found += [
                os.path.relpath(os.path.join(dirpath, f), root)
                for f in filenames
                if not f.startswith(".") and f.lower().endswith((".jpg", ".png"))
            ]
        files += [(rel, class_id) for rel in sorted(found)]
    return files


def test_a_plain_folder_lists_as_before_and_hashes_as_before(tmp_path: Path) -> None:
    for rel in ["b/2.png", "b/sub/0.png", "b/sub/deeper/1.JPG", "a/9.png", "a/10.png", "a/.hidden.png", "c/x.jpg"]:
        _png(tmp_path / rel, seed=len(rel))
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / ".cache").mkdir()
    index = scan_image_folder(tmp_path)
    assert list(index.files) == _old_listing(tmp_path) and index.classes == ("a", "b", "c")
    assert index.ignored_files == 1 and index.skipped == ()
    old = hashlib.sha256()
    for name in index.classes:
        old.update(b"c" + name.encode() + b"\0")
    for rel, cls in index.files:
        old.update(f"{cls}:{rel}".encode() + b"\0")
    assert index.listing_sha256() == old.hexdigest()  # token caches built before stay valid


@needs_fifo
@pytest.mark.timeout(60)
def test_a_fifo_named_png_is_left_out_and_never_blocks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for i in range(3):
        _png(tmp_path / "c0" / f"{i}.png", seed=i)
    os.mkfifo(tmp_path / "c0" / "1b.png")
    with caplog.at_level(logging.WARNING):
        index = scan_image_folder(tmp_path)
    assert [rel for rel, _ in index.files] == ["c0/0.png", "c0/1.png", "c0/2.png"]
    assert dict(index.skipped) == {SKIP_NOT_REGULAR: 1}
    assert f"left out 1 entry: 1 {SKIP_NOT_REGULAR}" in caplog.text
    # A file swapped for a FIFO after the scan is skipped by the reader, not waited on.
    (tmp_path / "c0" / "1.png").unlink()
    os.mkfifo(tmp_path / "c0" / "1.png")
    data = ImageFolderDataset(tmp_path, image_size=8, train=False, index=index)
    samples = [data[i] for i in range(len(data))]
    assert data.skipped_images == 1 and torch.equal(samples[1]["image"], samples[2]["image"])


@needs_symlinks
def test_symlinks_are_followed_but_each_file_and_directory_listed_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "train"
    for name in ("c0", "c1"):
        for i in range(3):
            _png(root / name / f"{i}.png", seed=i)
    _png(root / "c0" / "sub" / "s.png", seed=7)
    _png(tmp_path / "elsewhere" / "e.png", seed=8)
    (root / "c0" / "loop").symlink_to("..")  # back to the root: every class again, recursively
    (root / "c0" / "self").symlink_to(".")
    (root / "c0" / "sub" / "up").symlink_to("../..")
    (root / "c1" / "a_link_to_c0").symlink_to("../c0")  # sorts before c1's own files
    (root / "c1" / "a_copy.png").symlink_to("../c0/0.png")  # a second path to a listed file
    (root / "c1" / "broken.png").symlink_to("nowhere.png")
    (root / "c1" / "ext").symlink_to(tmp_path / "elsewhere")  # a directory outside the tree: listed once
    (root / "c2").symlink_to(root / "c1")  # a class folder that is another class folder
    with caplog.at_level(logging.WARNING):
        index = scan_image_folder(root)
    assert index.classes == ("c0", "c1", "c2")
    assert list(index.files) == [
        ("c0/0.png", 0),
        ("c0/1.png", 0),
        ("c0/2.png", 0),
        ("c0/sub/s.png", 0),
        ("c1/0.png", 1),
        ("c1/1.png", 1),
        ("c1/2.png", 1),
        ("c1/ext/e.png", 1),
    ]
    assert dict(index.skipped) == {SKIP_REVISITED_DIR: 5, SKIP_DUPLICATE_FILE: 1, SKIP_BROKEN: 1}
    assert "left out 7 entries" in caplog.text
    assert scan_image_folder(root).files == index.files  # deterministic


@needs_symlinks
def test_a_symlink_loop_does_not_multiply_a_folder(tmp_path: Path) -> None:
    """The hostile case: 18 images and a loop once listed 738 training images."""
    for c in range(3):
        for i in range(6):
            _png(tmp_path / f"c{c}" / f"{i}.png", seed=i)
        (tmp_path / f"c{c}" / "again").symlink_to("..")
        (tmp_path / f"c{c}" / "deeper").mkdir()
        (tmp_path / f"c{c}" / "deeper" / "loop").symlink_to("../../c0")
    assert len(scan_image_folder(tmp_path).files) == 18


def test_a_file_name_that_is_not_utf8_is_listed_and_hashed(tmp_path: Path) -> None:
    if os.name == "nt" or os.uname().sysname == "Darwin":
        pytest.skip("needs a file system that stores arbitrary bytes in names")
    _png(tmp_path / "c0" / "a.png", seed=0)
    name = os.fsdecode(b"\xff\xfe.png")
    _png(tmp_path / "c0" / name, seed=1)
    index = scan_image_folder(tmp_path)
    assert len(index.files) == 2 and len(index.listing_sha256()) == 64


# ------------------------------------------------------------------------------------ skipping in every dataset
@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """train/c0: 0.png bad.jpg(corrupt) 2.png; train/c1: 0.png bomb.png(20000x20000) 2.png; val/ the same, clean."""
    root = tmp_path / "damaged"
    for split in ("train", "val"):
        for c in ("c0", "c1"):
            for i in (0, 2):
                _png(root / split / c / f"{i}.png", seed=10 * i + len(c), size=(20, 16))
    (root / "train" / "c0" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG after all")
    _png_header(root / "train" / "c1" / "bomb.png", 20000, 20000)
    return root


def test_moco_skips_and_counts_corrupt_images_and_bombs(damaged: Path, caplog: pytest.LogCaptureFixture) -> None:
    views = FolderTwoViews(damaged / "train", TwoViews(image_size=8, blur=False), seed=0)
    assert [rel for rel, _ in views.index.files][2:5] == ["c0/bad.jpg", "c1/0.png", "c1/2.png"]
    with caplog.at_level(logging.WARNING):
        samples = [views[i] for i in range(len(views))]
    assert views.skipped_images == 2
    assert "c0/bad.jpg is not a readable image" in caplog.text and "bomb.png is not a readable image" in caplog.text
    assert [int(s["label"]) for s in samples] == [0, 0, 1, 1, 1, 0]  # bad.jpg -> c1/0.png; bomb.png (last) -> c0/0.png
    assert all(s["view1"].shape == (3, 8, 8) and torch.isfinite(s["view2"]).all() for s in samples)
    with caplog.at_level(logging.WARNING):
        views.set_epoch(1)
    assert "epoch 0 replaced 2 unreadable image(s)" in caplog.text and views.skipped_images == 0


def test_the_linear_probe_and_var_folders_skip_the_same_files(damaged: Path) -> None:
    norm = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    for data in (
        ResizedCropFolder(damaged / "train", image_size=8, train=True, **norm),
        ImageFolderDataset(damaged / "train", image_size=8, train=True),
    ):
        labels = [int(data[i]["label"]) for i in range(len(data))]
        assert data.skipped_images == 2 and labels == [0, 0, 1, 1, 1, 0], type(data)


def _unreadable_folder(root: Path, n: int = 5) -> Path:
    for i in range(n):
        (root / "c0").mkdir(parents=True, exist_ok=True)
        (root / "c0" / f"{i}.png").write_bytes(b"not a png")
    return root


def test_a_folder_without_one_readable_image_is_one_line(tmp_path: Path) -> None:
    root = _unreadable_folder(tmp_path / "bad")
    for data in (
        ImageFolderDataset(root, image_size=8, train=False),
        FolderTwoViews(root, TwoViews(image_size=8), seed=0),
    ):
        with pytest.raises(DataError) as info:
            data[3]
        message = _one_line(info.value)
        assert message.startswith(f"none of the 5 images in {root} is readable (the last one tried: ") and (
            "check the dataset copy" in message
        )


# ------------------------------------------------------------------------------- errors from loader workers
def test_worker_message_keeps_only_the_original_line() -> None:
    text = (
        "Caught DataError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n    raise DataError("inner: not this one")\n'
        "trainlab.data.errors.DataError: inner: not this one\n\nThe above exception was the direct cause ...\n"
        "trainlab.data.errors.DataError: the message: with a colon\n"
    )
    assert worker_message(text, DataError) == "the message: with a colon"
    assert worker_message("plain text\nkept", DataError) == "plain text\nkept"
    assert str(DataError(text)) == "the message: with a colon"


def _first_batch_error(loader: DataLoader[Any]) -> BaseException:
    """The error of the loader's first batch; the workers are shut down before returning (no frame keeps them)."""
    iterator = iter(loader)
    try:
        next(iterator)
    except Exception as err:
        return err.with_traceback(None)
    finally:
        del iterator
    raise AssertionError("the first batch loaded")


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_inside_a_loader_worker_is_the_same_one_line(tmp_path: Path, workers: int) -> None:
    root = _unreadable_folder(tmp_path / "bad")
    messages = []
    for data in (
        ImageFolderDataset(root, image_size=8, train=False),
        FolderTwoViews(root, TwoViews(image_size=8), seed=0),
    ):
        sampler = StepBatchSampler(len(data), batch_size=5, accumulation=1, rank=0, world=1, seed=0, shuffle=False)
        err = _first_batch_error(build_loader(data, sampler, options=LoaderOptions(num_workers=workers), seed=0))
        assert isinstance(err, DataError)
        messages.append(_one_line(err))
    assert messages[0] == messages[1] and messages[0].startswith(f"none of the 5 images in {root} is readable")
    _png(tmp_path / "set" / "000000_c0001.png", seed=0)
    _png(tmp_path / "set" / "000001_c0002.png", seed=1)
    images = read_image_set(tmp_path / "set")
    (tmp_path / "set" / "000001_c0002.png").write_bytes(b"damaged after the scan")
    err = _first_batch_error(
        DataLoader(range(2), batch_size=2, num_workers=workers, collate_fn=lambda ix: [images.image(i) for i in ix])
    )
    assert isinstance(err, UnreadableImage)
    assert _one_line(err).startswith(f"{tmp_path / 'set' / '000001_c0002.png'} is not a readable image")


def test_all_corrupt_images_with_two_workers_is_one_line_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    for split in ("train", "val"):
        _unreadable_folder(root / split, n=8)
    argv = ["train", "moco", "--model", "tv_resnet_debug", "--data.kind", "image-folder", "--image-size", "16"]
    argv += ["--batch-size", "4", "--epochs", "1", "--device", "cpu", "--data.eval-limit", "4", "--knn-k", "3"]
    argv += ["--data.root", str(root), "--run-dir", str(tmp_path / "run"), "--num-workers", "2", "--progress", "false"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err and "DataLoader worker" not in err, err
    assert f": error: none of the 8 images in {root / 'train'} is readable (the last one tried: " in errors[0]
    assert errors[0].endswith("; check the dataset copy"), errors[0]


# ------------------------------------------------------------------------- commands that read a named image
def test_eval_judge_on_a_folder_with_a_bomb_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainlab.models.digit_judge import DigitJudge, save_judge

    save_judge(DigitJudge(resolution=16, width=4, feature_dim=8), tmp_path / "judge.safetensors")
    samples = tmp_path / "samples"
    _png(samples / "000000_c0001.png", seed=0, size=(16, 16))
    bomb = _png_header(samples / "000001_c0002.png", 20000, 20000)
    judge = ["--judge-weights", str(tmp_path / "judge.safetensors")]
    assert main(["eval", "judge", "--samples", str(samples), *judge]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert "Traceback" not in err
    assert line.endswith(
        f": error: {bomb} is not a readable image: over the limit of {MAX_IMAGE_PIXELS} pixels (a decompression "
        "bomb?); delete or replace it"
    ), line


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from trainlab.models.var.convert import export_official
    from trainlab.models.var.transformer import VAR, VARConfig
    from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    return {
        "vae": export_official(VQVAE(VQVAEConfig.debug()).freeze(), folder / "vae.safetensors"),
        "var": export_official(VAR(VARConfig.debug()).eval(), folder / "var.pth"),
    }


@pytest.mark.parametrize("flag", ["--image", "--mask"])
def test_edit_with_a_bomb_is_one_line_exit_2(
    tmp_path: Path, weights: dict[str, Path], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    image = _png(tmp_path / "in.png", seed=0)
    bomb = _png_header(tmp_path / "bomb.png", 20000, 20000)
    files = {"--image": image, "--mask": image} | {flag: bomb}
    argv = ["edit", "--tokenizer-weights", str(weights["vae"]), "--var-weights", str(weights["var"]), "--device", "cpu"]
    argv += ["--image", str(files["--image"]), "--mask", str(files["--mask"]), "--out", str(tmp_path / "out.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert "Traceback" not in err and not (tmp_path / "out.png").exists()
    assert line.endswith(
        f": error: {flag} {bomb} is not a readable image: over the limit of {MAX_IMAGE_PIXELS} pixels (a "
        "decompression bomb?); pass a PNG or JPEG image"
    ), line


# ----------------------------------------------------------------------------------- wide pixels, GIFs, limits
@pytest.mark.parametrize(
    ("pixels", "expected"),
    [
        (np.array([[0, 257, 40000, 65535]], dtype=np.uint16), [0, 1, 156, 255]),  # 16-bit: / 257
        (np.array([[0.0, 0.25, 0.5, 1.0]], dtype=np.float32), [0, 64, 128, 255]),  # float in [0, 1]: x 255
        (np.array([[0.0, 3.0, 100.0, 255.0]], dtype=np.float32), [0, 3, 100, 255]),  # float in [0, 255]: kept
        (np.array([[0, 3, 100, 255]], dtype=np.int32), [0, 3, 100, 255]),  # 32-bit holding 8-bit values: kept
    ],
)
def test_grey_images_of_more_than_8_bits_are_scaled_not_clipped(
    tmp_path: Path, pixels: np.ndarray, expected: list[int]
) -> None:
    """Pillow's convert("RGB") clips them: a 16-bit PNG comes out white, a float TIFF in [0, 1] black."""
    path = tmp_path / ("grey.png" if pixels.dtype == np.uint16 else "grey.tiff")
    Image.fromarray(pixels).save(path)
    assert np.asarray(read_image(path))[0, :, 0].tolist() == expected
    assert np.asarray(read_image(path, "L"))[0].tolist() == expected
    from trainlab.data.images import read_image_pixels

    assert read_image_pixels(path)[1, 0].tolist() == expected


@pytest.mark.parametrize("pixels", [np.full((2, 2), -1.0, np.float32), np.full((2, 2), np.nan, np.float32)])
def test_grey_images_of_no_known_range_are_unreadable(tmp_path: Path, pixels: np.ndarray) -> None:
    Image.fromarray(pixels).save(tmp_path / "grey.tiff")
    with pytest.raises(UnreadableImage, match=r"grey\.tiff is not a readable image: F grey pixels"):
        read_image(tmp_path / "grey.tiff")


def test_gif_images_in_a_folder_are_images(tmp_path: Path) -> None:
    _png(tmp_path / "a" / "0.png", seed=0)
    (tmp_path / "b").mkdir()
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(tmp_path / "b" / "0.gif", save_all=True, append_images=frames[1:])  # animated
    index = scan_image_folder(tmp_path)
    assert [name for name, _ in index.files] == ["a/0.png", "b/0.gif"]
    assert np.asarray(read_image(tmp_path / "b" / "0.gif"))[0, 0].tolist() == [255, 0, 0]  # the first frame


@pytest.mark.parametrize(("num_items", "limit"), [(9, 5), (3000, 1001), (10, 4), (10, 10), (7, 0), (5, 9)])
def test_a_limit_keeps_positions_spread_over_the_whole_listing(num_items: int, limit: int) -> None:
    from trainlab.data.image_folder import evenly_spaced

    kept = evenly_spaced(num_items, limit)
    assert len(kept) == (min(limit, num_items) if limit > 0 else num_items)
    assert list(kept) == sorted(set(kept)) and kept[0] == 0 and kept[-1] >= num_items - -(-num_items // len(kept))
    classes = [position * 3 // num_items for position in kept]  # a listing of 3 equal classes
    assert set(classes) == {0, 1, 2} or len(kept) < 3


def test_the_eval_centre_crop_of_a_very_long_image_needs_no_large_buffer() -> None:
    from trainlab.data.transforms import resize_center_crop

    stats = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
    line_31W = torch.randint(0, 256, (3, 1, 4_000_000), dtype=torch.uint8)  # resized whole: 15 GB
    assert resize_center_crop(line_31W, 16, **stats).shape == (3, 16, 16)
    photo_3HW = torch.randint(0, 256, (3, 30, 400), dtype=torch.uint8)  # 13:1, under the cut: unchanged numerics
    import torchvision.transforms.v2.functional as TF2

    expected = TF2.center_crop(TF2.resize(photo_3HW.float() / 255, [18], antialias=True), [16, 16])
    assert torch.allclose(resize_center_crop(photo_3HW, 16, **stats), (expected.clamp(0, 1) - 0.5) / 0.5)
