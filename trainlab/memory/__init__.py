"""GPU memory planning: trace a recipe's real training step on fake tensors and replay it through an allocator model.

    tracer.py      StorageTracer: every storage allocation and free, in order, with where it happened
    trace.py       trace_training: the engine's StepRunner on fake tensors (no data, no real memory)
    breakdown.py   bytes by category at the peak, the steady-state peak, the allocator's reserved peak
    allocator.py   a model of PyTorch's CUDA caching allocator (512 B blocks, pools, segments, best fit, split/merge)
    gpus.py        GPU profiles (memory, context and workspace estimates); add a row to GPU_PROFILES
    planner.py     the largest micro-batch that fits, accumulation, GPUs needed, levers, the --gpu all table
    batch_fit.py   a trace at any micro-batch from two traces (bytes affine in the micro-batch), checked by a third
    accumulation_fit.py  accumulation 1 from accumulation 2's traces; step_repeat.py: the last traced step copied
    fake_memo.py   repeated fake-tensor ops answered by their inputs' metadata; fake_shape_rules.py: the outputs of
                   ops torch answers on fake tensors with a long Python decomposition (upsample_bicubic2d)
    trace_workers.py  the planner's traces side by side in forked worker processes
    collector.py   the garbage collector paused around bulk bookkeeping; log_once.py: each planner message once
    fsdp_memory.py  one FSDP2 rank's memory from the traced step; measure.py: --measure, the real step timed
    flop_counter.py  FLOPs and bytes of the traced step (forward, backward, optimizer) over the tracer's dispatch
    flops.py       count_step_flops, estimate_step_seconds (FLOPs / (peak x efficiency))
    run_cost.py    step time, run time, GPU-hours, cost, data-pipeline cores of a planned run
    efficiency.py  the assumed MFU per recipe family and the store of measured ones
    hand_formula.py  the seed's hand estimate, for comparison

    cuda_autocast.py  CUDA autocast's fp32 cast policy where it differs from CPU's (layer_norm, softmax, sum, ...)

Known gaps for `--device cuda` (the CPU plan is the tested one): CUDA autocast's cast policy is substituted only for
the ops listed in `cuda_autocast.py`; cuDNN / cuBLAS workspaces, the CUDA context and NCCL come from per-GPU
constants that are estimates until measured.

SDPA is traced as the CPU kernel runs it (`_scaled_dot_product_flash_attention_for_cpu`, which takes VAR's additive
mask too), and not substituted, because what it keeps for backward is what CUDA's choice keeps: for 16-bit inputs
without a mask CUDA picks flash attention, otherwise (fp32, or VAR's masked segment) memory-efficient attention
(head dim a multiple of 8); all three save the output (the inputs' dtype and shape) and a float32 logsumexp per
query row, (B, H, L). The one difference is that memory-efficient attention pads the logsumexp to a multiple of 32
rows: at most 31 x 4 bytes per (batch, head) per call, about 3 MiB over VAR-d16's 32 calls at micro-batch 48, far
below the plan's resolution. CUDA's math fallback, which would save the (B, H, L, S) attention weights, is taken by
none of trainlab's attention calls.
"""
