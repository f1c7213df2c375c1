"""A trace at accumulation 1 from one at accumulation 2: the second micro-batch's events cut out.

At accumulation 2 each optimizer step runs the first micro-batch exactly as accumulation 1 does (forward, the loss
divided by the count, backward into fresh gradients), then the second one (its own forward and backward, gradients
accumulated), then the same unscale, clip and optimizer step. Cutting the second micro-batch out leaves the step at
accumulation 1, except where the second micro-batch replaced something the first one kept (a running loss sum, a
gradient accumulated out of place): the replacement lives on in its place, so the first one's record takes over the
replacement's free and its label. What does not pair up one to one with equal bytes gives no trace (None).

The planner uses the derived traces only as the two points of the micro-batch fit (`memory.batch_fit`), checked byte
for byte against a real trace at accumulation 1: where the derivation is wrong the check fails, and the planner traces
accumulation 1 itself. The same check covers the fit at accumulation 2 where each step's second micro-batch allocates
what its first one did, in the same order and bytes (`second_micro_batches_repeat_first`): every record of the
accumulation-2 trace is then either in the derived trace or of the bytes of one that is.
"""

from __future__ import annotations

import bisect
import dataclasses

from trainlab.memory.trace import TracedRun
from trainlab.memory.tracer import Trace


def _windows(trace: Trace) -> list[tuple[int, int]] | None:
    """The event span of each step's second micro-batch (None where the trace does not have that shape)."""
    steps = len(trace.step_starts)
    starts, ends = trace.micro_step_starts, trace.micro_steps_ends
    if trace.first_pass or len(starts) != 2 * steps or len(ends) != steps:
        return None
    windows = [(starts[2 * s + 1], ends[s]) for s in range(steps)]
    bounds = [*trace.step_starts[1:], trace.end]
    for s, (a, b) in enumerate(windows):
        if not trace.step_starts[s] <= starts[2 * s] <= a <= b <= bounds[s]:
            return None
    return windows


def first_micro_batch_only(run: TracedRun) -> TracedRun | None:
    """The run at accumulation 1 derived from `run` at accumulation 2 (see the module docstring), or None."""
    trace = run.trace
    windows = _windows(trace) if run.grad_accumulation == 2 else None
    if windows is None:
        return None
    events = trace.events
    born_at = {index: position for position, (kind, index) in enumerate(events) if kind > 0}
    cut: set[int] = set()  # records allocated by a second micro-batch
    takes_over: dict[int, int] = {}  # a second micro-batch's surviving record -> the first's record it replaced
    for a, b in windows:
        born = [index for kind, index in events[a:b] if kind > 0]
        died = {index for kind, index in events[a:b] if kind < 0}
        survivors = [index for index in born if index not in died]
        replaced = sorted(
            takes_over.get(index, index) for kind, index in events[a:b] if kind < 0 and born_at[index] < a
        )
        if len(survivors) != len(replaced):
            return None
        for new, old in zip(survivors, replaced, strict=True):
            if trace.records[new].nbytes != trace.records[old].nbytes:
                return None
            takes_over[new] = old
        cut.update(born)
    inside = [False] * len(events)
    for a, b in windows:
        inside[a:b] = [True] * (b - a)
    kept = [record for record in trace.records if record.index not in cut]
    renumber = {record.index: i for i, record in enumerate(kept)}
    records = [dataclasses.replace(record, index=renumber[record.index]) for record in kept]
    for new, old in takes_over.items():
        later = trace.records[new]
        records[renumber[old]] = dataclasses.replace(
            records[renumber[old]], label=later.label, written_by_recipe_hook=later.written_by_recipe_hook
        )
    kept_positions: list[int] = []
    derived_events: list[tuple[int, int]] = []
    for position, (kind, index) in enumerate(events):
        if inside[position]:
            continue
        kept_positions.append(position)
        derived_events.append((kind, renumber[takes_over.get(index, index)]))

    def moved(position: int) -> int:  # an event position of `trace` in the derived events
        return bisect.bisect_left(kept_positions, position)

    derived = Trace(
        records=records,
        events=derived_events,
        step_starts=[moved(p) for p in trace.step_starts],
        end=moved(trace.end),
        micro_step_starts=[moved(p) for p in trace.micro_step_starts[::2]],
        micro_steps_ends=[moved(p) for p in trace.micro_steps_ends],
    )
    return dataclasses.replace(run, trace=derived, grad_accumulation=1, flops=None)


def second_micro_batches_repeat_first(low: TracedRun, high: TracedRun) -> bool:
    """Whether, in every step of `low` and `high` (accumulation 2, the same structure at two micro-batches), what the
    second micro-batch allocates is what its first one allocated, in the same order and bytes, less what the first
    one allocates only because its gradients are new (a gradient autograd cannot keep is copied once): the same
    forward and backward, the second's gradients accumulated into the first's. Matched in the same places in both,
    each storage of a second micro-batch then has the bytes of one of the first micro-batch at both micro-batches."""
    matches = [_second_in_first(run) for run in (low, high)]
    return matches[0] is not None and matches[0] == matches[1]


def _second_in_first(run: TracedRun) -> list[list[int]] | None:
    """Per step, the position among the first micro-batch's allocations that each of the second's matches (in order,
    by bytes), or None where the second's are not a subsequence of the first's."""
    trace = run.trace
    windows = _windows(trace) if run.grad_accumulation == 2 else None
    if windows is None:
        return None
    starts = trace.micro_step_starts

    def born(a: int, b: int) -> list[int]:
        return [trace.records[index].nbytes for kind, index in trace.events[a:b] if kind > 0]

    matches: list[list[int]] = []
    for s, (a, b) in enumerate(windows):
        first, positions = born(starts[2 * s], a), []
        position = 0
        for nbytes in born(a, b):
            while position < len(first) and first[position] != nbytes:
                position += 1
            if position == len(first):
                return None
            positions.append(position)
            position += 1
        matches.append(positions)
    return matches
