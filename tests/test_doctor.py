"""`trainlab doctor`: every host check on this CPU, and each judgement on simulated inputs (a 64 MiB /dev/shm, a full
disk, a GPU the wheel was not built for, a stale CUDA_VISIBLE_DEVICES, a damaged image folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from trainlab.cli import main
from trainlab.commands import doctor as doctor_command
from trainlab.data.image_folder import evenly_spaced
from trainlab.doctor import host
from trainlab.doctor.collective import probe_all_reduce
from trainlab.doctor.data import check_data
from trainlab.doctor.gpu import (
    GpuFacts,
    arch_coverage,
    check_arch,
    check_precision,
    check_processes,
    check_visible_devices,
    cuda_usable,
    visible_entries,
)
from trainlab.doctor.report import Check, exit_code, render_json
from trainlab.doctor.versions import DriverInfo, check_driver, check_torch, cudnn_version_text, judge_torchvision

MIB, GIB = 2**20, 2**30
HOST_CHECKS = ("cpu-cores", "shm", "open-files", "disk")
CUDA_CHECKS = ("cuda", "gpu-arch", "gpu-precision", "gpu-sdpa", "gpu-cudnn-conv", "gpu-memory", "nccl-all-reduce")


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, dict[str, object]]]:
    code = main(["doctor", *argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == code
    return code, {c["name"]: c for c in out["checks"]}


# ------------------------------------------------------------------------------------------------ the command
def test_doctor_on_this_cpu_runs_every_host_check_and_says_why_cuda_was_skipped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, checks = _run_json(capsys, ["--device", "cpu", "--run-dir", str(tmp_path / "run"), "--num-workers", "0"])
    assert code == 0
    for name in (*HOST_CHECKS, "python", "torch", "torchvision", "cudnn", "nccl", "trainlab"):
        assert name in checks, name
    for name in HOST_CHECKS:
        assert checks[name]["status"] in ("PASS", "WARN"), checks[name]
    for name in CUDA_CHECKS:
        assert checks[name]["status"] == "SKIP" and "--device cpu" in str(checks[name]["detail"]), checks[name]
    assert checks["disk"]["free_bytes"] > 0


def test_text_output_is_one_line_per_check_with_the_fix_on_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["doctor", "--device", "cpu", "--run-dir", str(tmp_path), "--data.root", str(tmp_path / "missing")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1  # the data root does not exist
    data = next(line for line in lines if line.split()[1] == "data-root")
    assert data.startswith("FAIL") and "; fix: pass --data.root" in data
    assert lines[-1].endswith("skipped") and "1 failed" in lines[-1]
    assert all(line.split()[0] in ("PASS", "WARN", "FAIL", "SKIP") for line in lines[:-1])


def test_a_small_shm_and_a_full_disk_fail_the_planned_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host, "gather_shm", lambda path="/dev/shm": (64 * MIB, 64 * MIB))
    monkeypatch.setattr(host, "gather_disk", lambda run_dir: (10_000, ""))
    # a toy run whose micro-batch is 256 x 50,000 float32 inputs + 256 int64 labels = 48.8 MiB, with 2 loader
    # workers: 5 batches in flight
    argv = ["toy", "--num-features", "50000", "--batch-size", "256", "--num-workers", "2", "--device", "cpu"]
    code, checks = _run_json(capsys, [*argv, "--run-dir", str(tmp_path)])
    assert code == 1
    batch_bytes = 256 * 50_000 * 4 + 256 * 8
    assert checks["planned-run"]["status"] == "PASS" and checks["planned-run"]["batch_bytes"] == batch_bytes
    shm = checks["shm"]
    assert shm["status"] == "FAIL" and shm["shm_needed_bytes"] == 5 * batch_bytes
    assert "--shm-size" in str(shm["fix"]) and "--num-workers 0" in str(shm["fix"])
    disk = checks["disk"]
    parameters = 50_000 * 32 + 32 + 32 * 4 + 4  # the toy MLP; SGD momentum doubles it
    assert disk["status"] == "FAIL" and disk["checkpoint_bytes"] == 2 * 4 * parameters
    assert disk["needed_bytes"] == (2 + 2) * disk["checkpoint_bytes"]  # keep 2 + best + one being written


def test_recipe_mode_keeps_doctor_flags_apart_from_train_flags() -> None:
    mine, rest = doctor_command.split_doctor_flags(
        ["--batch-size", "8", "--json", "--data.root=/d", "--nproc-per-node", "4", "--json", "false", "--seed", "1"]
    )
    assert mine == ["--json", "--nproc-per-node", "4", "--json", "false"]
    assert rest == ["--batch-size", "8", "--data.root=/d", "--seed", "1"]  # the recipe's data group


def test_recipe_mode_checks_the_folder_of_the_recipes_data_group() -> None:
    from trainlab.recipes.moco import MocoConfig, MocoData

    folder = MocoConfig(data=MocoData(kind="image-folder", root=Path("/d")))
    digits = MocoConfig(data=MocoData(kind="digits", root=Path("/d")), image_size=16)
    assert doctor_command._recipe_data_root(folder) == Path("/d")
    assert doctor_command._recipe_data_root(digits) is None  # the bundled digits read no folder


def test_a_batch_that_does_not_split_over_the_processes_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, checks = _run_json(capsys, ["toy", "--batch-size", "30", "--nproc-per-node", "4", "--run-dir", str(tmp_path)])
    assert code == 1 and checks["planned-run"]["status"] == "FAIL"
    assert "does not split into 1 accumulation step(s) x 4 process(es)" in str(checks["planned-run"]["detail"])


def test_a_warning_or_failure_must_carry_its_fix() -> None:
    with pytest.raises(AssertionError, match="must say how to fix it"):
        Check("x", "WARN", "something")
    assert exit_code([Check("a", "PASS", "ok"), Check("b", "WARN", "meh", "do this")]) == 0
    assert exit_code([Check("a", "FAIL", "no", "do that")]) == 1
    assert render_json([Check("a", "SKIP", "why")])["counts"] == {"PASS": 0, "WARN": 0, "FAIL": 0, "SKIP": 1}


# ------------------------------------------------------------------------------------------------ host
def test_shm_need_counts_every_batch_in_flight() -> None:
    demand = host.LoaderDemand(num_workers=8, processes=8, batch_bytes=72 * MIB)
    assert demand.batches_in_shm() == 8 * (8 * 2 + 1)
    docker_default = host.check_shm((64 * MIB, 64 * MIB), demand)
    assert docker_default.status == "FAIL" and "--shm-size" in docker_default.fix
    assert host.check_shm((16 * GIB, 10 * GIB), demand).status == "WARN"  # 9.6 GiB: most of it
    assert host.check_shm((64 * GIB, 64 * GIB), demand).status == "PASS"
    assert host.check_shm((64 * MIB, 64 * MIB), host.LoaderDemand(0)).status == "PASS"  # no workers, no shm
    unknown = host.check_shm((64 * MIB, 64 * MIB), host.LoaderDemand(4))
    assert unknown.status == "WARN" and "64 MiB" in unknown.detail
    assert host.check_shm(None, demand).status == "FAIL"


def test_disk_need_is_the_kept_checkpoints_plus_best_plus_one_being_written() -> None:
    run = Path("/runs/x")
    assert host.checkpoint_disk_need(GIB, keep=2) == 4 * GIB
    full = host.check_disk(run, free=3 * GIB, problem="", checkpoint_bytes=GIB, keep=2)
    assert full.status == "FAIL" and "--run-dir" in full.fix and "--keep-checkpoints 1" in full.fix
    assert host.check_disk(run, 6 * GIB, "", GIB, 2).status == "WARN"
    assert host.check_disk(run, 100 * GIB, "", GIB, 2).status == "PASS"
    assert host.check_disk(run, 100 * GIB, "--run-dir /x cannot be written", GIB, 2).status == "FAIL"
    assert host.check_disk(run, GIB, "", None, 2).status == "WARN"  # size unknown, little room
    assert host.check_disk(run, 100 * GIB, "", None, 2).status == "PASS"


def test_an_unwritable_run_dir_is_found(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    free, problem = host.gather_disk(blocker / "run")
    assert free > 0 and "is not a directory" in problem


def test_cpu_cores_count_a_container_quota_and_oversubscription() -> None:
    assert host.usable_cpus(64, "200000 100000") == (2, "container CPU quota 200000/100000 us (affinity: 64)")
    assert host.usable_cpus(8, "max 100000")[0] == 8
    assert host.usable_cpus(8, None)[0] == 8
    busy = host.check_cpu_cores(16, "test", host.LoaderDemand(num_workers=8, processes=4), "cuda")
    assert busy.status == "WARN" and busy.fix.startswith("--num-workers 3")
    idle_gpu = host.check_cpu_cores(16, "test", host.LoaderDemand(num_workers=0, processes=1), "cuda")
    assert idle_gpu.status == "WARN" and "--num-workers 8" in idle_gpu.fix
    assert host.check_cpu_cores(16, "test", host.LoaderDemand(num_workers=0), "cpu").status == "PASS"
    crowded = host.check_cpu_cores(2, "test", host.LoaderDemand(num_workers=0, processes=100000), "cpu")
    assert crowded.status == "WARN" and crowded.fix.startswith("--nproc-per-node 2 or fewer")  # no workers to drop


def test_open_file_limits() -> None:
    workers = host.LoaderDemand(num_workers=8)
    low = host.check_open_files(1024, 1_048_576, workers)
    assert low.status == "WARN" and low.fix.startswith("`ulimit -n 65536`")
    capped = host.check_open_files(128, 128, workers)
    assert capped.status == "FAIL" and "--ulimit nofile" in capped.fix
    assert host.check_open_files(1024, 4096, host.LoaderDemand(0)).status == "PASS"
    assert host.check_open_files(65536, 65536, workers).status == "PASS"


# ------------------------------------------------------------------------------------------------ versions
def test_driver_against_the_wheels_cuda() -> None:
    old_major = check_driver(DriverInfo((12, 4), "550.54"), "13.0", "required")
    assert old_major.status == "FAIL" and "cu124" in old_major.fix
    assert check_driver(DriverInfo((12, 2), "535.1"), "12.4", "required").status == "WARN"
    assert check_driver(DriverInfo((12, 8), "570.1"), "12.4", "required").status == "PASS"
    none = DriverInfo(None, problem="libcuda.so.1 not found")
    assert check_driver(none, "12.4", "required").status == "FAIL"
    skipped = check_driver(none, "12.4", "optional")
    assert skipped.status == "SKIP" and "libcuda.so.1" in skipped.detail
    assert check_torch("2.5.0+cpu", None, "required").status == "FAIL"
    assert check_torch("2.5.0+cpu", None, "optional").status == "PASS"
    assert cudnn_version_text(92400) == "9.24.0" and cudnn_version_text(8907) == "8.9.7"


def test_torchvision_for_another_torch_or_cuda() -> None:
    assert judge_torchvision(None, None, "", "2.5.0", "12.4").status == "FAIL"
    assert judge_torchvision("0.20.0", "12040", "", "2.5.0", "12.4").status == "PASS"  # torchvision says 12040
    other_cuda = judge_torchvision("0.20.0", "11080", "", "2.5.0", "12.4")
    assert other_cuda.status == "FAIL" and "CUDA 11.8" in other_cuda.detail
    broken = judge_torchvision(
        "0.15.0", "12040", "RuntimeError: operator torchvision::nms does not exist", "2.5.0", "12.4"
    )
    assert broken.status == "FAIL" and "C++ operators" in broken.detail


# ------------------------------------------------------------------------------------------------ GPUs (simulated)
WHEEL = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]


def _gpu(capability: tuple[int, int], free: int = 80 * GIB) -> GpuFacts:
    return GpuFacts(0, "Test GPU", 80 * GIB, free, capability)


def test_arch_coverage_follows_cuda_compatibility() -> None:
    assert arch_coverage((8, 6), WHEEL) == ("native", "sm_86")
    assert arch_coverage((8, 9), WHEEL) == ("compatible", "sm_86")  # sm_86 code runs on 8.9
    assert arch_coverage((12, 0), WHEEL) == ("ptx", "compute_90")
    assert arch_coverage((12, 0), WHEEL[:-1]) == ("none", "")
    assert arch_coverage((9, 0), ["sm_90a"]) == ("native", "sm_90a")
    assert arch_coverage((10, 0), ["sm_90a"]) == ("none", "")
    assert check_arch(_gpu((12, 0)), WHEEL[:-1], "12.4").status == "FAIL"
    assert check_arch(_gpu((8, 0)), WHEEL, "12.4").status == "PASS"


def test_precision_and_processes_against_the_gpus() -> None:
    assert check_precision(_gpu((7, 5)), "bf16-amp").status == "FAIL"
    assert check_precision(_gpu((7, 5)), "fp16-amp-scale").status == "PASS"
    assert check_precision(_gpu((8, 0)), "bf16").status == "PASS"
    assert check_processes(8, 4).status == "FAIL"
    assert check_processes(4, 8).status == "PASS"


def test_cuda_visible_devices_against_what_torch_sees() -> None:
    assert visible_entries("0,1", 8) == (["0", "1"], "")
    assert visible_entries("0,4,1", 2) == (["0"], "4")  # CUDA stops at the first entry it does not know
    assert visible_entries("GPU-abc,0", None) == (["GPU-abc", "0"], "")
    assert visible_entries("", 2) == ([], "")
    set_late = check_visible_devices("0,1", torch_count=8, driver_count=8)
    assert set_late.status == "FAIL" and "after CUDA was initialised" in set_late.detail
    assert check_visible_devices("0,4", 1, 2).status == "FAIL"
    assert check_visible_devices("2,3", 2, 8).status == "PASS"
    assert check_visible_devices(None, 8, 8).status == "PASS"
    assert check_visible_devices(None, 7, 8).status == "WARN"


def test_cuda_unusable_is_a_skip_unless_cuda_is_required() -> None:
    no_driver = DriverInfo(None, problem="libcuda.so.1 not found")
    usable, check = cuda_usable("optional", "12.4", no_driver, 0)
    assert not usable and check.status == "SKIP" and "libcuda.so.1" in check.detail
    usable, check = cuda_usable("required", None, no_driver, 0)
    assert not usable and check.status == "FAIL" and "CUDA wheel" in check.fix
    assert cuda_usable("required", "12.4", DriverInfo((12, 4), gpus=("H100",)), 1)[0]


def test_an_all_reduce_across_two_processes_is_checked() -> None:
    ok, detail = probe_all_reduce(2, "gloo", timeout_s=120)
    assert ok, detail
    assert "correct sum" in detail


# ------------------------------------------------------------------------------------------------ data
def _image(path: Path, colour: str = "red") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def test_data_root_counts_images_per_class_and_unreadable_files(tmp_path: Path) -> None:
    for i in range(3):
        _image(tmp_path / "train" / "cat" / f"{i}.png")
        _image(tmp_path / "train" / "dog" / f"{i}.png")
    (tmp_path / "train" / "dog" / "broken.png").write_bytes(b"not an image")
    (tmp_path / "train" / "notes.txt").write_text("")  # not a class, not an image
    _image(tmp_path / "val" / "cat" / "0.png")
    _image(tmp_path / "val" / "dog" / "0.png")
    checks = {c.name: c for c in check_data(tmp_path, sample=0, threads=2)}
    assert (
        checks["data-train"].status == "PASS"
        and "7 images in 2 classes (per class 3 to 4" in checks["data-train"].detail
    )
    decode = checks["data-train-decode"]
    assert decode.status == "WARN" and decode.values["unreadable"] == 1 and "broken.png" in decode.detail
    assert checks["data-val-decode"].status == "PASS"
    assert "data-classes" not in checks


def test_data_root_with_mismatched_classes_or_empty_ones(tmp_path: Path) -> None:
    _image(tmp_path / "train" / "cat" / "0.png")
    (tmp_path / "train" / "empty").mkdir()
    _image(tmp_path / "val" / "cat" / "0.png")
    _image(tmp_path / "val" / "dog" / "0.png")
    checks = {c.name: c for c in check_data(tmp_path, sample=0, threads=1)}
    assert checks["data-train"].status == "WARN" and "empty" in checks["data-train"].detail
    assert checks["data-classes"].status == "FAIL"
    for i in range(4):
        (tmp_path / "train" / "cat" / f"bad{i}.png").write_bytes(b"")
    checks = {c.name: c for c in check_data(tmp_path, sample=0, threads=1)}
    assert checks["data-train-decode"].status == "FAIL"  # 4 of 5 unreadable


def test_a_decoding_sample_is_spread_over_the_listing() -> None:
    assert evenly_spaced(10, 0) == tuple(range(10))
    assert evenly_spaced(10, 4) == (0, 2, 5, 7)
    assert evenly_spaced(3, 5) == (0, 1, 2)


def test_cifar_layout(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"x")
    checks = check_data(tmp_path, sample=0)
    assert [c.status for c in checks] == ["FAIL"] and "data_batch_2" in checks[0].detail


def test_a_train_split_that_is_a_file_fails(tmp_path: Path) -> None:
    """`trainlab train` refuses a data root whose train/ is a file: doctor must not pass it."""
    (tmp_path / "train").write_text("not a folder")
    (tmp_path / "val" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "cat" / "0.png")
    checks = {c.name: c for c in check_data(tmp_path, sample=0, threads=1)}
    assert checks["data-train"].status == "FAIL" and "not found" in checks["data-train"].detail


def test_a_recipe_with_batchnorm_in_training_is_sized(tmp_path: Path) -> None:
    """MoCo's projector has BatchNorm1d: a micro-batch of one has one value per channel, which it refuses."""
    from trainlab.commands.doctor import plan_from_recipe

    run = plan_from_recipe("moco", ["--config", "moco_v3_digits", "--device", "cpu", "--run-dir", str(tmp_path)], 1)
    (note,) = [c for c in run.notes if c.name == "planned-run"]
    assert note.status == "PASS" and run.checkpoint_bytes > 0, note
