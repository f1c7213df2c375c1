"""Version checks: Python, torch, torchvision, the CUDA the wheel was built for, the driver, cuDNN, NCCL, trainlab.

What each one catches:
- torchvision missing, or built for another torch (its C++ operators do not load) or another CUDA;
- a torch wheel without CUDA on a machine meant to train on GPUs (`torch.version.cuda` is None);
- a driver older than the wheel's CUDA: `torch.version.cuda` is the CUDA the wheel was *built* with (its runtime
  libraries ship inside the wheel), not what the machine runs. The driver must support that CUDA: an older major
  version cannot run it at all (CUDA is then "not available"); an older minor version of the same major runs it
  under CUDA's minor-version compatibility, except kernels that need a newer driver (PTX compiled at load time);
- cuDNN and NCCL as bundled with the wheel (a cuDNN that does not initialise is found by `gpu.py`'s convolution).

`CudaIntent` says how hard to judge: "required" (`--device cuda`, or `auto` on a machine whose driver lists GPUs),
"optional" (`auto` without GPUs: CUDA problems are reported as skipped, with the reason) or "off" (`--device cpu`).
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import torch

import trainlab
from trainlab.doctor.report import Check, Status
from trainlab.errors import first_line

CudaIntent = Literal["required", "optional", "off"]

WHEEL_INDEX = "https://download.pytorch.org/whl"
MIN_PYTHON = (3, 10)


def _missing(intent: CudaIntent) -> Status:
    """The status of a CUDA prerequisite that is missing: a failure when CUDA is required, else a skip."""
    return "FAIL" if intent == "required" else "SKIP"


def _why_off(intent: CudaIntent) -> str:
    return "--device cpu: CUDA is not checked" if intent == "off" else ""


def parse_version(text: str | None) -> tuple[int, int] | None:
    """`"12.4"` -> (12, 4); None for None or an unparsable text."""
    if not text:
        return None
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def cuda_text(value: str | int | None) -> str | None:
    """A CUDA version as `major.minor`: torchvision reports its CUDA as an integer (`13000` for 13.0)."""
    if value is None or str(value) == "":
        return None
    text = str(value)
    if text.isdigit() and len(text) >= 4:
        major, minor = cuda_api_version(int(text))
        return f"{major}.{minor}"
    return text


def cuda_api_version(encoded: int) -> tuple[int, int]:
    """`cuDriverGetVersion`'s integer (12040) as (12, 4)."""
    return encoded // 1000, (encoded % 1000) // 10


def cudnn_version_text(encoded: int) -> str:
    """`torch.backends.cudnn.version()` as text: 92400 -> 9.24.0 (cuDNN 9), 8907 -> 8.9.7 (cuDNN 8)."""
    if encoded >= 90000:
        return f"{encoded // 10000}.{encoded % 10000 // 100}.{encoded % 100}"
    return f"{encoded // 1000}.{encoded % 1000 // 100}.{encoded % 100}"


# ------------------------------------------------------------------------------------------------ gathering
@dataclass(frozen=True)
class DriverInfo:
    """What the NVIDIA driver says, read without creating a CUDA context.

    Attributes:
        cuda: the newest CUDA the driver supports, (major, minor), from `libcuda`'s `cuDriverGetVersion`; None when
            the library cannot be loaded.
        version: the driver's own version (`nvidia-smi`), '' when unknown.
        gpus: the GPUs the driver lists (names, whatever CUDA_VISIBLE_DEVICES says), None without `nvidia-smi`.
        problem: why the driver could not be read ('' when it could).
    """

    cuda: tuple[int, int] | None
    version: str = ""
    gpus: tuple[str, ...] | None = None
    problem: str = ""


def gather_driver() -> DriverInfo:
    """Ask `libcuda.so.1` for the CUDA version it supports and `nvidia-smi` for the driver version and GPU names."""
    if platform.system() != "Linux":
        return DriverInfo(None, problem=f"driver checks are written for Linux, not {platform.system()}")
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return DriverInfo(None, problem="libcuda.so.1 not found: no NVIDIA driver on this machine (or not mounted)")
    encoded = ctypes.c_int(0)
    code = lib.cuDriverGetVersion(ctypes.byref(encoded))
    if code != 0:
        return DriverInfo(None, problem=f"cuDriverGetVersion failed with CUDA error {code}")
    version, gpus = "", None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]
        gpus = tuple(row[0] for row in rows)
        version = rows[0][1] if rows and len(rows[0]) > 1 else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return DriverInfo(cuda_api_version(encoded.value), version, gpus)


# ------------------------------------------------------------------------------------------------ checks
def check_python(version: tuple[int, int, int] | None = None) -> Check:
    v = version or (sys.version_info[0], sys.version_info[1], sys.version_info[2])
    text = ".".join(map(str, v))
    if v[:2] < MIN_PYTHON:
        return Check("python", "FAIL", f"{text} (trainlab needs 3.10 or newer)", "use Python 3.10+ (a new venv)")
    return Check("python", "PASS", text, values={"version": text})


def check_torch(version: str, cuda: str | None, intent: CudaIntent) -> Check:
    """The torch wheel and the CUDA it was built for (None: a CPU-only wheel)."""
    values = {"version": version, "built_for_cuda": cuda}
    if cuda is not None:
        return Check("torch", "PASS", f"{version}, built for CUDA {cuda}", values=values)
    detail = f"{version}, a CPU-only wheel (torch.version.cuda is None)"
    if intent == "required":
        return Check(
            "torch",
            "FAIL",
            detail,
            f"install a CUDA wheel: pip install torch torchvision --index-url {WHEEL_INDEX}/cu128 (pick the CUDA your "
            "driver supports)",
            values=values,
        )
    return Check("torch", "PASS", detail, values=values)


def judge_torchvision(
    version: str | None, built_for_cuda: str | None, ops_error: str, torch_version: str, torch_cuda: str | None
) -> Check:
    """torchvision installed, its C++ operators load (it was built for this torch), and built for the same CUDA.

    Args:
        version: torchvision's version, None when it is not installed.
        built_for_cuda: `torchvision.version.cuda`.
        ops_error: why `torch.ops.torchvision.nms` is unavailable ('' when it loads).
        torch_version: torch's version.
        torch_cuda: the CUDA torch was built for.
    """
    release = torch_version.split("+")[0]
    same = f"pip install torchvision matching torch {release} (pytorch.org/get-started/previous-versions)"
    if version is None:
        return Check("torchvision", "FAIL", "not installed (the data pipeline and FID need it)", same)
    built_for_cuda = cuda_text(built_for_cuda)
    values = {"version": version, "built_for_cuda": built_for_cuda}
    if ops_error:
        return Check(
            "torchvision", "FAIL", f"{version}: its C++ operators do not load ({ops_error})", same, values=values
        )
    if parse_version(built_for_cuda) != parse_version(torch_cuda):
        return Check(
            "torchvision",
            "FAIL",
            f"{version} is built for CUDA {built_for_cuda or 'none (CPU)'}, torch for "
            f"CUDA {torch_cuda or 'none (CPU)'}",
            same + ", from the same index URL as torch",
            values=values,
        )
    return Check("torchvision", "PASS", version, values=values)


def check_torchvision() -> Check:
    try:
        import torchvision
    except ImportError:
        return judge_torchvision(None, None, "", torch.__version__, torch.version.cuda)
    except Exception as err:  # a torchvision built for another torch can fail while importing
        return judge_torchvision("?", None, first_line(err), torch.__version__, torch.version.cuda)
    try:
        torch.ops.torchvision.nms  # noqa: B018 - resolving the operator loads torchvision's C++ library
        ops_error = ""
    except (AttributeError, RuntimeError) as err:
        ops_error = first_line(err)
    return judge_torchvision(
        torchvision.__version__, torchvision.version.cuda, ops_error, torch.__version__, torch.version.cuda
    )


def check_driver(driver: DriverInfo, torch_cuda: str | None, intent: CudaIntent) -> Check:
    """The driver supports the CUDA the wheel was built for (see the module docstring)."""
    if intent == "off":
        return Check("nvidia-driver", "SKIP", _why_off(intent))
    if driver.cuda is None:
        status = _missing(intent)
        fix = "install the NVIDIA driver (or run the container with --gpus all)" if status == "FAIL" else ""
        return Check("nvidia-driver", status, driver.problem, fix)
    supports = f"{driver.cuda[0]}.{driver.cuda[1]}"
    detail = f"{driver.version or 'version unknown (no nvidia-smi)'}, supports CUDA up to {supports}"
    values = {"version": driver.version, "supports_cuda": supports, "gpus": list(driver.gpus or ())}
    wheel = parse_version(torch_cuda)
    if wheel is None:
        return Check("nvidia-driver", "PASS", detail + "; the torch wheel has no CUDA", values=values)
    fix = (
        f"update the driver to one for CUDA {torch_cuda}, or install torch built for CUDA {supports} or older: "
        f"pip install torch torchvision --index-url {WHEEL_INDEX}/cu{driver.cuda[0]}{driver.cuda[1]}"
    )
    if driver.cuda[0] < wheel[0]:
        return Check(
            "nvidia-driver", "FAIL", detail + f": too old for this wheel's CUDA {torch_cuda}", fix, values=values
        )
    if driver.cuda < wheel:
        return Check(
            "nvidia-driver",
            "WARN",
            detail + f", the wheel is built for {torch_cuda}: runs under minor-version compatibility (no PTX JIT)",
            fix,
            values=values,
        )
    return Check("nvidia-driver", "PASS", detail + f" (the wheel needs {torch_cuda})", values=values)


def check_cudnn(encoded: int | None, intent: CudaIntent) -> Check:
    """The cuDNN bundled with the wheel (whether it initialises on a GPU is `gpu.py`'s convolution check)."""
    if encoded is None:
        if intent == "off":
            return Check("cudnn", "SKIP", "not in this torch build; --device cpu does not use it")
        status: Status = "FAIL" if intent == "required" else "SKIP"
        fix = f"install a CUDA torch wheel ({WHEEL_INDEX}/cu128), which bundles cuDNN" if status == "FAIL" else ""
        return Check("cudnn", status, "not available in this torch build", fix)
    text = cudnn_version_text(encoded)
    return Check("cudnn", "PASS", f"{text} (bundled with torch)", values={"version": text})


def check_nccl(version: tuple[int, ...] | None, available: bool, intent: CudaIntent, processes: int) -> Check:
    """NCCL in the wheel: what multi-GPU training on one or several machines uses."""
    values = {"version": ".".join(map(str, version)) if version else None, "available": available}
    if available and version:
        return Check("nccl", "PASS", f"{values['version']} (bundled with torch)", values=values)
    why = "torch.distributed has no NCCL backend in this build"
    if intent == "required" and processes > 1:
        return Check(
            "nccl",
            "FAIL",
            why + f"; the run asks for {processes} processes on GPUs",
            "install a CUDA wheel of torch for Linux",
            values=values,
        )
    return Check("nccl", "SKIP", why + ("; a single process does not need it" if processes == 1 else ""), values=values)


def gather_nccl() -> tuple[tuple[int, ...] | None, bool]:
    """(NCCL version, whether torch.distributed offers the backend)."""
    available = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    try:
        version = tuple(torch.cuda.nccl.version()) if available else None
    except (RuntimeError, AttributeError, TypeError):
        version = None
    return version, available


def check_trainlab() -> Check:
    from trainlab.engine.runinfo import git_sha

    sha = git_sha()
    return Check(
        "trainlab", "PASS", f"{trainlab.__version__} ({sha})", values={"version": trainlab.__version__, "git_sha": sha}
    )


def version_checks(driver: DriverInfo, intent: CudaIntent, processes: int) -> list[Check]:
    """Every version check of this machine."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl_version, nccl_available = gather_nccl()
    return [
        check_python(),
        check_torch(torch.__version__, torch.version.cuda, intent),
        check_torchvision(),
        check_driver(driver, torch.version.cuda, intent),
        check_cudnn(cudnn, intent),
        check_nccl(nccl_version, nccl_available, intent, processes),
        check_trainlab(),
    ]
