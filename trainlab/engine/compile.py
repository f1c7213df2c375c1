"""`--compile`: the trained models' training forward through `torch.compile` (TorchInductor).

What is compiled: each trained model as `train_step` receives it (under DDP the DDP wrapper is compiled, the order
torch documents for DDP; tests/test_engine_distributed.py runs it in 2 gloo processes with accumulation under
`no_sync`). Evaluation, exports and frozen models run the plain eager modules. The first step of each distinct input
shape compiles (tens of seconds on a CPU); later steps run the fused kernels.

What it changes: float arithmetic is reordered and fused, so losses differ from eager within float rounding
(tests/test_engine_compile.py measures it). Random ops (dropout, DropPath, class dropout) keep eager's RNG stream
(`fallback_random`), so a compiled run draws the same masks as the eager one, and the kernels are deterministic
(`deterministic_inductor`), so a compiled run repeats and resumes to the bit like an eager one.

Toolchain, checked before anything is built: Inductor writes C++ on the CPU (needs a C++ compiler on PATH) and
Triton kernels on CUDA (needs the `triton` package, which CUDA wheels of torch install).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch import nn

from trainlab.errors import UsageError

CPP_COMPILERS = ("g++", "c++", "clang++")


def check_compile_toolchain(device: torch.device) -> str:
    """What `--compile` will use on `device`, or a one-line UsageError naming what is missing and the fix."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UsageError(
                "--compile on CUDA needs Triton, which is not installed: `pip install triton` (matching your torch) "
                "or drop --compile"
            )
        return "torch.compile (inductor, Triton kernels)"
    if device.type == "cpu":
        wanted = os.environ.get("CXX")
        found = shutil.which(wanted) if wanted else next(filter(None, map(shutil.which, CPP_COMPILERS)), None)
        if found is None:
            missing = f"CXX={wanted!r}" if wanted else " or ".join(CPP_COMPILERS)
            raise UsageError(
                f"--compile on the CPU needs a C++ compiler ({missing} not found on PATH): install one "
                "(e.g. `apt install g++`) or drop --compile"
            )
        return f"torch.compile (inductor, C++ kernels built with {found})"
    raise UsageError(f"--compile supports cpu and cuda devices, not {device.type}; drop --compile")


def compile_for_training(module: nn.Module) -> nn.Module:
    """`module` (a model or its DDP wrapper) compiled for training steps with `deterministic_inductor`."""
    compiled: nn.Module = torch.compile(module, backend=deterministic_inductor, dynamic=False)  # type: ignore[assignment]
    return compiled


def deterministic_inductor(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """TorchInductor, lowering forward and backward at once with torch's deterministic algorithms on and eager's
    random ops.

    Inductor turns scatter-adds (the backward of an embedding or of indexing with repeated indices) into atomic adds
    whose order depends on thread timing, so two runs would differ in the last bits; in deterministic mode it calls
    aten's ordered kernel instead. The mode is read while lowering, so the backward is lowered now (not lazily at the
    first backward) inside the same context; the rest of the process keeps its own setting.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    was_on, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        with (
            functorch_config.patch(force_non_lazy_backward_lowering=True),
            inductor_config.patch(fallback_random=True),
        ):
            return compile_fx(graph, example_inputs)
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)
