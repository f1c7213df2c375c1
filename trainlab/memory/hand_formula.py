"""The seed's hand estimate (shared/seeds/000, first section), computed as written, to set beside the trace.

As written in the seed: N(d) = 73728 d^2 parameters (from 18 d w^2 with w = 64 d; that is 73728 d^3), 2 bytes per
parameter in 16-bit precision and 4 in fp32, gradients the same, AdamW states 2 bytes per parameter ("Adam x 8,
AdamW x 2"), activations 1-3 x the parameter memory, the batch (B x 3 x H x W x bytes), 300 MB - 2 GB of framework
overhead, then 10-20 % fragmentation. Each rule's error is named in `HandEstimate.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1000**3
MB = 1000**2


@dataclass
class HandEstimate:
    parameters: int  # the parameter count the formula uses
    low_bytes: int
    high_bytes: int
    parts_low: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def seed_parameter_count(depth: int) -> int:
    """N(d) = 73728 d^2, as the seed writes it."""
    return 73728 * depth**2


def hand_estimate(
    *,
    parameters: int,
    sixteen_bit: bool,
    optimizer: str,
    batch_size: int,
    input_elements: int,
    depth: int | None,
) -> HandEstimate:
    """The seed's formula for one GPU's batch.

    Args:
        parameters: the real parameter count (used when `depth` is None).
        sixteen_bit: the run trains in fp16/bf16 (the seed counts 2 bytes per parameter for weights and gradients).
        optimizer: "adamw", "adam" or "sgd" (the seed's table).
        batch_size: samples on one GPU.
        input_elements: elements of one input sample (3 x H x W).
        depth: VAR depth, for the seed's N(d) (None: other recipes use the real count).
    """
    n = seed_parameter_count(depth) if depth is not None else parameters
    per_param = 2 if sixteen_bit else 4
    weights = n * per_param
    grads = n * per_param
    states = {"adamw": 2, "adam": 8, "sgd": 0}.get(optimizer, 2) * n
    data = batch_size * input_elements * per_param
    low_parts = {"weights": weights, "gradients": grads, "optimizer": states, "activations": weights, "data": data}
    low = int((sum(low_parts.values()) + 300 * MB) * 1.10)
    high = int((weights * 2 + states + 3 * weights + data + 2 * GB) * 1.20)
    return HandEstimate(parameters=n, low_bytes=low, high_bytes=high, parts_low=low_parts)
