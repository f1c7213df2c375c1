"""No input file runs code: CIFAR-10 pickles go through the restricted unpickler, `.npz` members and token caches are
never unpickled, and every other reader of the package uses a loader that cannot run code (an `ast` audit).

Each payload is first shown to be live (plain `pickle.loads` creates the marker file), then handed to the reader:
the reader must refuse it with one line naming the file, and the marker must not appear.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from trainlab.cli import main
from trainlab.data.cifar import load_cifar10
from trainlab.data.fake_cifar import write_fake_cifar10
from trainlab.errors import UsageError
from trainlab.evaluate.image_sets import read_image_set

PACKAGE = Path(__file__).resolve().parents[1] / "trainlab"


class _Payload:
    """Unpickles to a call of `func(*args)`: creates `marker` when a reader runs code from the file."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, _Payload]:
    return {
        "os.system": _Payload(os.system, f"touch '{marker}'"),
        "exec": _Payload(exec, f"open({str(marker)!r}, 'w').close()"),
        "open": _Payload(open, str(marker), "w"),
    }


@pytest.fixture(params=["os.system", "exec", "open"])
def payload(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[_Payload, Path]:
    marker = tmp_path / "PWNED"
    live = _payloads(marker)[request.param]
    pickle.loads(pickle.dumps(live, protocol=2))  # the payload is real: plain pickle runs it
    assert marker.exists(), "the payload did not run under plain pickle: the test would prove nothing"
    marker.unlink()
    return live, marker


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# --------------------------------------------------------------------------------------------- CIFAR-10 pickles
@pytest.fixture
def cifar(tmp_path: Path) -> Path:
    return write_fake_cifar10(tmp_path / "cifar", num_train=20, num_test=10) / "cifar-10-batches-py"


def _batch(folder: Path, name: str) -> dict[str, Any]:
    with open(folder / name, "rb") as f:
        entry: dict[str, Any] = pickle.load(f, encoding="latin1")  # our own fixture, written just now
    return entry


def _write(folder: Path, name: str, obj: object, protocol: int = 2) -> None:
    with open(folder / name, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)


@pytest.mark.parametrize("name", ["data_batch_1", "test_batch", "batches.meta"])
@pytest.mark.parametrize("inside_valid_batch", [False, True])
def test_a_code_running_cifar_file_is_refused_and_runs_nothing(
    cifar: Path, payload: tuple[_Payload, Path], name: str, inside_valid_batch: bool
) -> None:
    live, marker = payload
    _write(cifar, name, {**_batch(cifar, name), "extra": live} if inside_valid_batch else live)
    splits = {"data_batch_1": [True], "test_batch": [False], "batches.meta": [True, False]}[name]
    for train in splits:  # every split that reads the file
        with pytest.raises(UsageError) as info:
            load_cifar10(cifar.parent, train=train)
        assert not marker.exists()
        message = _one_line(info.value)
        assert f"{cifar / name} holds something other than CIFAR-10 data" in message, message


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_payload_at_any_pickle_protocol_is_refused(
    cifar: Path, payload: tuple[_Payload, Path], protocol: int
) -> None:
    live, marker = payload
    _write(cifar, "data_batch_2", {**_batch(cifar, "data_batch_2"), "extra": live}, protocol=protocol)
    with pytest.raises(UsageError, match="holds something other than CIFAR-10 data"):
        load_cifar10(cifar.parent, train=True)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_the_release_layout_reads_at_every_protocol(cifar: Path, protocol: int) -> None:
    before = load_cifar10(cifar.parent, train=True)
    for i in range(1, 6):
        _write(cifar, f"data_batch_{i}", _batch(cifar, f"data_batch_{i}"), protocol=protocol)
    after = load_cifar10(cifar.parent, train=True)
    assert np.array_equal(before.data, after.data) and before.targets == after.targets


def test_the_batches_folder_itself_is_a_root_too(cifar: Path) -> None:
    assert cifar.name == "cifar-10-batches-py"
    inside = load_cifar10(cifar, train=False)
    assert np.array_equal(inside.data, load_cifar10(cifar.parent, train=False).data)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        ((b"\0" * 8, np.dtype(object), (1,), "C"), "of object"),
        (("text", np.dtype(np.uint8), (4,), "C"), "arguments other than"),
        ((b"\0" * 4, "u1", (4,), "C"), "arguments other than"),
        ((b"\0" * 4, np.dtype(np.uint8), [4], "C"), "of uint8"),
        ((b"\0" * 4, np.dtype(np.uint8), (4,), "X"), "with order"),
    ],
)
def test_the_protocol_5_array_builder_builds_only_plain_arrays(args: tuple[Any, ...], refusal: str) -> None:
    from trainlab.data import cifar as cifar_module

    with pytest.raises(pickle.UnpicklingError, match=refusal):
        cifar_module._array_from_buffer(*args)
    built = cifar_module._array_from_buffer(bytearray(range(6)), np.dtype(np.uint8), (2, 3), "F")
    assert np.array_equal(built, np.arange(6, dtype=np.uint8).reshape(2, 3, order="F"))


class _Python2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes what Python 2's cPickle wrote for the official files: `str` (here: bytes) as BINSTRING and numpy's
    `_reconstruct` under its numpy 1.x module name."""

    dispatch: ClassVar[dict[type, Any]] = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is np.zeros(0).__reduce__()[0]:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def _python2_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def test_python2_era_files_read_as_the_official_release_does(cifar: Path) -> None:
    expected = load_cifar10(cifar.parent, train=False)
    entry = _batch(cifar, "test_batch")
    py2 = _python2_bytes({k.encode(): v for k, v in entry.items() if k in ("data", "labels")})
    assert b"numpy.core.multiarray\n_reconstruct" in py2 and b"_codecs" not in py2
    (cifar / "test_batch").write_bytes(py2)
    got = load_cifar10(cifar.parent, train=False)
    assert np.array_equal(got.data, expected.data) and got.targets == expected.targets


def _replace(cifar: Path, name: str, **changes: Any) -> None:
    entry = _batch(cifar, name)
    entry.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del entry[key]
    _write(cifar, name, entry)


_DROP = object()


@pytest.mark.parametrize(
    ("name", "changes", "expected"),
    [
        ("data_batch_1", {"labels": [0.5, 1.5, 2.5, 3.5]}, "labels must be integers in [0, 10), found 0.5"),
        ("data_batch_1", {"labels": [True, 1, 2, 3]}, "labels must be integers in [0, 10), found True"),
        ("data_batch_1", {"labels": [0, 1, 2, 10]}, "labels must be integers in [0, 10), found 10"),
        ("data_batch_1", {"labels": [0, 1, 2, -1]}, "found -1"),
        ("data_batch_1", {"labels": np.array([0.0, 1.0, 2.0, 3.0])}, "'labels' is ndarray, expected a list"),
        ("data_batch_1", {"labels": [0, 1, 2]}, "4 images but 3 labels"),
        ("data_batch_1", {"data": np.zeros((4, 3072), dtype=np.float32)}, "'data' is float32 (4, 3072)"),
        ("data_batch_1", {"data": np.zeros((4, 3071), dtype=np.uint8)}, "expected uint8 (n, 3072)"),
        ("data_batch_1", {"data": np.array([[1, 2]], dtype=object)}, "'data' is object"),
        ("data_batch_1", {"data": [[0] * 3072] * 4}, "'data' is list"),
        ("data_batch_1", {"labels": _DROP}, "expected a dict with 'data' and 'labels'"),
        ("batches.meta", {"label_names": ["a", "b"]}, "expected 10 class names under 'label_names'"),
    ],
)
def test_foreign_content_is_one_line_naming_the_file(
    cifar: Path, name: str, changes: dict[str, Any], expected: str
) -> None:
    _replace(cifar, name, **changes)
    with pytest.raises(UsageError) as info:
        load_cifar10(cifar.parent, train=True)
    message = _one_line(info.value)
    assert f"CIFAR-10 file {cifar / name} holds something other than CIFAR-10 data" in message
    assert expected in message, message


def test_an_empty_split_is_refused(cifar: Path) -> None:
    _replace(cifar, "test_batch", data=np.zeros((0, 3072), dtype=np.uint8), labels=[])
    with pytest.raises(UsageError) as info:
        load_cifar10(cifar.parent, train=False)
    assert "has no test images (none in test_batch)" in _one_line(info.value)
    assert len(load_cifar10(cifar.parent, train=True)) == 20  # the training split is fine


def test_a_file_asking_for_another_codec_is_refused(cifar: Path) -> None:
    entry = _batch(cifar, "data_batch_1")
    stream = pickle.dumps(entry, protocol=2).replace(b"X\x06\x00\x00\x00latin1", b"X\x06\x00\x00\x00rot_13")
    assert b"rot_13" in stream
    (cifar / "data_batch_1").write_bytes(stream)
    with pytest.raises(UsageError, match=r"_codecs\.encode with 'rot_13'"):
        load_cifar10(cifar.parent, train=True)


@pytest.mark.parametrize(
    "argv",
    [
        [
            "train",
            "cifar",
            "--model",
            "cifar_vgg_debug",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "RUN",
        ],
        [
            "train",
            "moco",
            "--data.kind",
            "cifar10",
            "--model",
            "tv_resnet_debug",
            "--image-size",
            "16",
            "--device",
            "cpu",
            "RUN",
        ],
        ["eval", "knn", "--data.kind", "cifar10", "--features", "pixels", "--image-size", "32"],
        ["eval", "linear-probe", "--moco-weights", "", "--model", "tv_resnet_debug", "--data.kind", "cifar10", "RUN"],
    ],
    ids=["train-cifar", "train-moco", "eval-knn", "eval-linear-probe"],
)
def test_every_command_reading_cifar_refuses_a_poisoned_batch(
    tmp_path: Path, cifar: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "PWNED"
    _write(cifar, "data_batch_1", {**_batch(cifar, "data_batch_1"), "extra": _payloads(marker)["os.system"]})
    _write(cifar, "test_batch", {**_batch(cifar, "test_batch"), "extra": _payloads(marker)["exec"]})
    argv = [part for arg in argv for part in (["--run-dir", str(tmp_path / "run")] if arg == "RUN" else [arg])]
    code = main([*argv, "--data.root", str(cifar.parent)])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "holds something other than CIFAR-10 data" in errors[0], err
    assert "Traceback" not in err


# -------------------------------------------------------------------------------------------------------- .npz
def _npz(path: Path, compressed: bool = False, **arrays: Any) -> Path:
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def _images(n: int = 2) -> np.ndarray:
    return np.zeros((n, 8, 8, 3), dtype=np.uint8)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("member", ["arr_0", "arr_1"])
def test_an_npz_object_array_is_refused_and_runs_nothing(
    tmp_path: Path, payload: tuple[_Payload, Path], compressed: bool, member: str
) -> None:
    live, marker = payload
    arrays = {"arr_0": _images(), "arr_1": np.array([0, 1])}
    arrays[member] = np.array([live, live], dtype=object)
    path = _npz(tmp_path / "evil.npz", compressed, **arrays)
    with pytest.raises(UsageError) as info:
        read_image_set(path, flag="--samples")
    assert not marker.exists()
    message = _one_line(info.value)
    assert str(path) in message and member in message and "object array" in message, message


def test_reference_statistics_with_an_object_array_are_refused(tmp_path: Path, payload: tuple[_Payload, Path]) -> None:
    from trainlab.evaluate.fidelity import read_reference_mu_sigma

    live, marker = payload
    path = _npz(tmp_path / "ref.npz", arr_0=_images(), mu=np.array([live], dtype=object), sigma=np.eye(2))
    with pytest.raises(UsageError) as info:
        read_reference_mu_sigma(read_image_set(path, flag="--reference"))
    assert not marker.exists() and "mu is an object array" in _one_line(info.value)


def _doctor(path: Path, member: str, edit: Callable[[bytes], bytes]) -> Path:
    """Rewrite one member of an .npz archive (the archive stays a valid zip)."""
    with zipfile.ZipFile(path) as archive:
        contents = {info: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in contents.items():
            archive.writestr(info, edit(data) if info.filename == f"{member}.npy" else data)
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: _doctor(_npz(p, arr_0=_images()), "arr_0", lambda b: b"XXXXXX" + b[6:]), "magic string"),
        (lambda p: _doctor(_npz(p, arr_0=_images()), "arr_0", lambda b: b[: len(b) - 7]), "is truncated or damaged"),
        (
            lambda p: _doctor(_npz(p, True, arr_0=_images()), "arr_0", lambda b: b.replace(b"(2, 8,", b"(9, 8,")),
            "is truncated or damaged",
        ),
        (lambda p: _doctor(_npz(p, arr_0=_images()), "arr_0", lambda b: b[:5]), "arr_0 is not a readable"),
        (lambda p: (p.write_bytes(b"PK\x03\x04 not really a zip"), p)[1], "is not a readable .npz"),
        (lambda p: (p.write_bytes(_npz(p, arr_0=_images()).read_bytes()[:200]), p)[1], "is not a readable .npz"),
    ],
    ids=["bad-magic", "truncated-stored", "shape-larger-than-data", "header-cut", "not-a-zip", "archive-cut"],
)
def test_a_malformed_npz_is_one_line_naming_the_file(
    tmp_path: Path, make: Callable[[Path], Path], expected: str
) -> None:
    path = make(tmp_path / "bad.npz")
    with pytest.raises(UsageError) as info:
        read_image_set(path, flag="--samples")
    message = _one_line(info.value)
    assert str(path) in message and expected in message, message


def test_eval_judge_on_a_poisoned_npz_is_one_line_exit_2(
    tmp_path: Path, payload: tuple[_Payload, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from trainlab.models.digit_judge import DigitJudge, save_judge

    live, marker = payload
    save_judge(DigitJudge(resolution=8, width=4, feature_dim=8), tmp_path / "judge.safetensors")
    path = _npz(tmp_path / "evil.npz", True, arr_0=np.array([live], dtype=object))
    assert main(["eval", "judge", "--samples", str(path), "--judge-weights", str(tmp_path / "judge.safetensors")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert line.endswith(
        f": error: --samples {path}: arr_0 is an object array (pickled Python objects), which is never loaded; save "
        "plain numeric arrays (np.savez with numpy arrays of numbers)"
    ), line


# ------------------------------------------------------------------------------------------------- token cache
def test_a_token_cache_with_an_object_array_is_refused(tmp_path: Path, payload: tuple[_Payload, Path]) -> None:
    import json

    from trainlab.data.token_cache import TokenCache

    live, marker = payload
    cache = tmp_path / "cache"
    cache.mkdir()
    meta = {"num_items": 2, "seq_len": 3, "fingerprint": {"variants": ["plain"], "patch_nums": [1]}}
    (cache / "meta.json").write_text(json.dumps(meta))
    np.save(cache / "tokens.npy", np.zeros((2, 1, 3), dtype=np.int16))
    np.save(cache / "labels.npy", np.array([live, live], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError) as info:
        TokenCache(cache)
    assert not marker.exists()
    assert f"token cache file {cache / 'labels.npy'} is damaged" in _one_line(info.value)
    np.save(cache / "labels.npy", np.zeros(2, dtype=np.int64))
    np.save(cache / "tokens.npy", np.zeros((2, 1, 4), dtype=np.int16))
    with pytest.raises(UsageError, match=r"tokens.npy is damaged \(int16 \(2, 1, 4\), meta.json says int \(2, 1, 3\)"):
        TokenCache(cache)
    np.save(cache / "tokens.npy", np.zeros((2, 1, 3), dtype=np.int16))
    assert int(TokenCache(cache).tokens(1).sum()) == 0


# ----------------------------------------------------------------------------------------- audit of all readers
def _calls(path: Path) -> list[tuple[int, str, ast.Call]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                found.append((node.lineno, f"{func.value.id}.{func.attr}", node))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
                base = func.value
                if isinstance(base.value, ast.Name):
                    found.append((node.lineno, f"{base.value.id}.{base.attr}.{func.attr}", node))
    return found


def _keyword(call: ast.Call, name: str) -> object:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<expression>"
    return None


def test_every_reader_in_the_package_is_one_that_cannot_run_code() -> None:
    """torch.load only with weights_only=True, np.load never with allow_pickle, YAML only through safe_load, and
    no pickle.load / pickle.loads / Unpickler except the CIFAR reader's restricted unpickler."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        for line, name, call in _calls(path):
            where = f"{rel}:{line} {name}"
            if name == "torch.load" and _keyword(call, "weights_only") is not True:
                bad.append(f"{where} without weights_only=True")
            elif name in ("np.load", "numpy.load") and _keyword(call, "allow_pickle") not in (None, False):
                bad.append(f"{where} with allow_pickle")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
                bad.append(f"{where}: use yaml.safe_load")
            elif name in ("pickle.load", "pickle.loads", "marshal.loads", "shelve.open", "dill.load", "dill.loads"):
                bad.append(f"{where}: a plain unpickler runs code")
            elif name == "pickle.Unpickler" and rel.as_posix() != "trainlab/data/cifar.py":
                bad.append(f"{where}: only the CIFAR reader's restricted unpickler may unpickle")
        text = path.read_text()
        if "torchvision.datasets" in text and "CIFAR10" in text.split("torchvision.datasets", 1)[1][:200]:
            bad.append(f"{rel}: reads CIFAR-10 through torchvision (plain pickle); use trainlab.data.cifar")
    assert bad == []


def test_the_restricted_unpickler_admits_nothing_beyond_the_cifar_layout() -> None:
    from trainlab.data import cifar

    assert set(cifar._ALLOWED) == {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
        ("__builtin__", "bytes"),
        ("builtins", "bytes"),
    }
    for module, name in [("builtins", "eval"), ("posix", "system"), ("numpy", "load"), ("builtins", "getattr")]:
        stream = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
        with pytest.raises(pickle.UnpicklingError, match=f"asks for {module}.{name}"):
            cifar._CifarUnpickler(io.BytesIO(stream), encoding="latin1").load()


def test_a_downloaded_set_is_read_by_the_same_restricted_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "PWNED"

    def fake_download(url: str, root: Path, *, filename: str, md5: str) -> None:
        folder = write_fake_cifar10(root, num_train=10, num_test=10) / "cifar-10-batches-py"
        _write(folder, "data_batch_1", {**_batch(folder, "data_batch_1"), "extra": _payloads(marker)["exec"]})

    monkeypatch.setattr("trainlab.data.cifar.download_and_extract_archive", fake_download)
    with pytest.raises(UsageError, match="data_batch_1 holds something other than CIFAR-10 data"):
        load_cifar10(tmp_path / "data", train=True, download=True)
    assert not marker.exists()


@pytest.mark.parametrize("shape", [(4, 16, 0, 3), (4, 0, 16, 3), (0, 8, 8, 3)])
def test_an_npz_of_empty_images_is_refused(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """Zero images, or images of zero width or height: one line, not an IndexError from the feature extractor."""
    path = _npz(tmp_path / "empty.npz", False, arr_0=np.zeros(shape, dtype=np.uint8))
    with pytest.raises(UsageError, match=r"arr_0 holds (no images|images of \d+x\d+ pixels)"):
        read_image_set(path, flag="--samples")
