"""What the plan says for MoCo v3 under accumulation: whether it keeps the loss, and the two buffers it adds.

A MoCo step split into k micro-batches (per process) with `--moco-keys full-batch` keeps the large batch's loss: each
query is scored against the keys of the whole optimizer batch. It then holds, for the whole step,

    the keys buffer      2 views x M keys x D x 4 bytes on the device (fp32, normalised; M = the global batch), in
                         the traced step (the first pass runs there) and counted again here by formula;
    the held micro-batches  k x b x 2 views x 3 x S x S x 4 bytes of host memory per process (the step runner's host
                         copies, replayed for the queries' pass; the GPU holds one micro-batch at a time).

With `--moco-keys micro-batch` accumulation changes the loss: each query sees the b - 1 other keys of its
micro-batch instead of M - 1 (and with several processes, no gather). Shape legend: M keys (global batch), D
projection width, b micro-batch, S image side.
"""

from __future__ import annotations

from typing import Any

FP32_BYTES = 4


def keys_bytes(global_batch: int, projection_dim: int) -> int:
    """The device bytes of the optimizer batch's keys: 2 views x M x D fp32."""
    return 2 * global_batch * projection_dim * FP32_BYTES


def held_micro_batches_bytes(per_process_batch: int, image_size: int) -> int:
    """The host bytes of one process's micro-batches kept between the passes: b x k images x 2 views x 3 x S x S."""
    return per_process_batch * 2 * 3 * image_size * image_size * FP32_BYTES


def accumulation_effect(config: Any, gpus: int, accumulation: int) -> str:
    """Whether splitting the global batch into `gpus` x `accumulation` keeps MoCo's loss, in a few words."""
    if gpus * accumulation == 1:
        return "MoCo: one batch, the large batch's loss"
    micro = config.batch_size // (gpus * accumulation)
    if config.moco_keys == "full-batch":
        return f"MoCo --moco-keys full-batch: the same loss (every query against all {config.batch_size} keys)"
    return (
        f"MoCo --moco-keys micro-batch: a different loss (each query against the {micro} keys of its micro-batch, "
        f"not {config.batch_size}); --moco-keys full-batch keeps it"
    )


def accumulation_lever_effect(config: Any, gpus: int, accumulation: int) -> str:
    """What accumulation as a lever changes for MoCo's contrastive loss: the negatives (kept by --moco-keys
    full-batch) and the BatchNorm batches (always the micro-batch's)."""
    micro = config.batch_size // (gpus * accumulation)
    per_gpu = config.batch_size // gpus
    if config.moco_keys == "full-batch":
        negatives = f"keeps the negatives (--moco-keys full-batch: every query against all {config.batch_size} keys)"
    else:
        negatives = (
            f"changes the negatives (--moco-keys micro-batch: each query against the {micro} keys of its micro-batch, "
            f"not {per_gpu if gpus > 1 else config.batch_size}; --moco-keys full-batch keeps them)"
        )
    return f"MoCo: {negatives}; changes the BatchNorm batches (statistics of {micro} samples, not {per_gpu})"


def moco_plan_notes(config: Any, gpus: int, accumulation: int, micro: int) -> list[str]:
    """The plan's MoCo lines: the effect on the loss, the keys buffer and the held micro-batches, BatchNorm."""
    notes = [accumulation_effect(config, gpus, accumulation)]
    if config.moco_keys == "full-batch" and accumulation > 1:
        device = keys_bytes(config.batch_size, config.projection_dim)
        host = held_micro_batches_bytes(micro * accumulation, config.image_size)
        notes.append(
            f"keys buffer {device / 2**20:,.2f} MiB on each GPU (in the traced step); held micro-batches "
            f"{host / 2**20:,.1f} MiB of host memory per process (not on the GPU)"
        )
    if gpus * accumulation > 1:
        notes.append(
            f"BatchNorm normalises each micro-batch of {micro} by its own statistics (the official SyncBatchNorm: "
            f"the global batch of {config.batch_size}); the logits are the large batch's up to that"
        )
    return notes
