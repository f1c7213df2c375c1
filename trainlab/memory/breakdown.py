"""What the bytes at the peak are: a pass over a trace's events, by category, plus the allocator's reserved peak.

Categories of a storage, in order of precedence: "recipe_state" for a parameter or buffer that the recipe's
`after_optimizer_step` writes in place (a momentum encoder, EMA weights or codebooks), its label (parameter, buffer,
gradient, optimizer_state, frozen), then "recipe_state" (alive before the steady-state window and still alive at
the end: EMA / momentum copies, the loss scale), then by where it was allocated: "batch", "autocast_copies" (a
parameter cast to 16 bits inside the forward), "activations" (the rest of the forward: what autograd saves and the
forward's outputs), "temporaries" (backward, unscale / clip, optimizer and after-step work).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainlab.memory.allocator import replay, round_size
from trainlab.memory.collector import paused
from trainlab.memory.trace import TracedRun
from trainlab.memory.tracer import StorageRecord

CATEGORIES = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "frozen",
    "recipe_state",
    "activations",
    "batch",
    "temporaries",
    "autocast_copies",
)


@dataclass
class Breakdown:
    """Bytes of one traced configuration (on CUDA: allocator block sizes, 512-byte rounded).

    Attributes:
        parameters_bytes: trained models' parameters (exact).
        gradients_bytes: gradients of one optimizer step.
        optimizer_states_bytes: optimizer states after the steps (exact).
        activations_bytes: peak of live forward allocations (what backward needs) in the steady state.
        peak_allocated_bytes: peak of live tensor bytes in the steady-state steps.
        peak_reserved_bytes: the allocator model's reserved peak (CPU: equal to peak_allocated_bytes).
        at_peak: bytes per category at the moment of peak_allocated_bytes.
    """

    device: str
    micro_batch: int
    grad_accumulation: int
    parameters: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_states_bytes: int
    activations_bytes: int
    frozen_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    at_peak: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    uses_convolution: bool = False
    optimizers: list[str] = field(default_factory=list)


def _category(record: StorageRecord, persistent: set[int]) -> str:
    if record.label in ("parameter", "buffer") and record.written_by_recipe_hook:
        return "recipe_state"
    if record.label:
        return record.label
    if record.index in persistent:
        return "recipe_state"
    if record.region == "batch":
        return "batch"
    if record.autocast_copy:
        return "autocast_copies"
    if record.region == "forward":
        return "activations"
    return "temporaries"


@paused()
def breakdown(run: TracedRun) -> Breakdown:
    """Walk the trace once: live bytes per category, the steady-state peak, then the allocator replay."""
    trace = run.trace
    records = trace.records
    size: Callable[[int], int] = (lambda n: round_size(n) if n > 0 else 0) if run.device == "cuda" else (lambda n: n)
    sizes = [size(r.nbytes) for r in records]
    window = trace.step_starts[1] if len(trace.step_starts) > 1 else 0
    alive_at_window: set[int] = set()
    alive: set[int] = set()
    for position, (kind, index) in enumerate(trace.events):
        if position == window:
            alive_at_window = set(alive)
        if kind > 0:
            alive.add(index)
        else:
            alive.discard(index)
    persistent = alive_at_window & alive  # survived every steady-state step: model or recipe state
    categories = [_category(r, persistent) for r in records]
    live = dict.fromkeys(CATEGORIES, 0)
    total = peak = activation_peak = 0
    at_peak: dict[str, int] = dict(live)
    last_step = len(trace.step_starts) - 1
    gradients_last_step = 0
    for position, (kind, index) in enumerate(trace.events):
        category = categories[index]
        delta = kind * sizes[index]
        live[category] += delta
        total += delta
        if kind > 0 and category == "gradient" and records[index].step == last_step:
            gradients_last_step += sizes[index]
        if position >= window:
            if total > peak:
                peak, at_peak = total, dict(live)
            activation_peak = max(activation_peak, live["activations"])
    states = sum(sizes[i] for i in alive if categories[i] == "optimizer_state")
    if run.device == "cuda":
        stats = replay(trace.events, [r.nbytes for r in records])
        reserved, segments = stats.peak_reserved_bytes, stats.segments_allocated
    else:
        reserved, segments = peak, 0
    return Breakdown(
        device=run.device,
        micro_batch=run.micro_batch,
        grad_accumulation=run.grad_accumulation,
        parameters=run.parameters,
        parameters_bytes=run.parameters_bytes,
        gradients_bytes=gradients_last_step,
        optimizer_states_bytes=states,
        activations_bytes=activation_peak,
        frozen_bytes=run.frozen_bytes,
        peak_allocated_bytes=peak,
        peak_reserved_bytes=reserved,
        at_peak=at_peak,
        segments=segments,
        uses_convolution=run.uses_convolution,
        optimizers=run.optimizers,
    )
