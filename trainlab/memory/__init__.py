"""GPU memory planning: trace a recipe's real training step on fake tensors and replay it through an allocator model.

    tracer.py      StorageTracer: every storage allocation and free, in order, with where it happened
    trace.py       trace_training: the engine's StepRunner on fake tensors (no data, no real memory)
    breakdown.py   bytes by category at the peak, the steady-state peak, the allocator's reserved peak
    allocator.py   a model of PyTorch's CUDA caching allocator (512 B blocks, pools, segments, best fit, split/merge)
    gpus.py        GPU profiles (memory, context and workspace estimates); add a row to GPU_PROFILES
    planner.py     the largest micro-batch that fits, accumulation, GPUs needed, levers
    hand_formula.py  the seed's hand estimate, for comparison

    cuda_autocast.py  CUDA autocast's fp32 cast policy where it differs from CPU's (layer_norm, softmax, sum, ...)

Known gaps for `--device cuda` (the CPU plan is the tested one): CUDA autocast's cast policy is substituted only for
the ops listed in `cuda_autocast.py`; the SDPA backend CUDA would pick is not substituted (the CPU flash kernel's
saved tensors are traced); cuDNN / cuBLAS workspaces, the CUDA context and NCCL come from per-GPU constants that are
estimates until measured.
"""
