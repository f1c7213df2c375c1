"""The last traced optimizer step once more, without tracing it: a copy of its events on new storages.

In the steady state every optimizer step runs the same ops on the same sizes, and what a step leaves alive for the
next (the loss kept for logging, a scale) is what the step before left for it. So the third traced step of a run is
the second one again, on its own storages: each storage the second step allocates is allocated again (a new record,
the same bytes, region and label), each one it frees is freed again; and where the second step frees a storage the
first one left alive, the third frees the one the second left alive in its place (paired in the order they were
allocated, and required to be alike in all but the step).

Not every run has that shape: a step that frees something older than the step before it, a different count or kind
of storages left alive, gives no copy (None), and the caller traces the step. Where the shape holds but the step still
differs (a recipe doing something at one step only), the copy is wrong: the planner uses copied steps only in the
micro-batch fit's two points, whose fit is checked byte for byte, events included, against a trace of three real
steps before it is used (`memory.planner`), and traces the points again in full where that check fails.
"""

from __future__ import annotations

import dataclasses

from trainlab.memory.tracer import StorageRecord, Trace


def _alike(a: StorageRecord, b: StorageRecord) -> bool:
    return (a.nbytes, a.region, a.label, a.autocast_copy, a.written_by_recipe_hook) == (
        b.nbytes,
        b.region,
        b.label,
        b.autocast_copy,
        b.written_by_recipe_hook,
    )


def repeat_last_step(trace: Trace) -> Trace | None:
    """`trace` (two traced steps; its events end where the second does) with a third step copied from the second, or
    None where the second step does not have the shape a copy needs (see the module docstring)."""
    if len(trace.step_starts) != 2:
        return None
    events, records = trace.events, trace.records
    first, last = trace.step_starts
    end = len(events)
    born: dict[int, int] = {}
    for position, (kind, index) in enumerate(events):
        if kind > 0:
            born[index] = position
    step_events = events[last:end]
    freed = {index for kind, index in step_events if kind < 0}
    left_alive = [index for kind, index in step_events if kind > 0 and index not in freed]  # in allocation order
    older = [index for kind, index in step_events if kind < 0 and born.get(index, -1) < last]
    if any(born.get(index, -1) < first for index in older) or len(older) != len(left_alive):
        return None  # it frees something older than the step before it, or leaves a different count alive
    replaced = dict(zip(sorted(older, key=born.__getitem__), left_alive, strict=True))
    if not all(_alike(records[old], records[new]) for old, new in replaced.items()):
        return None
    new_records = list(records)
    new_events = list(events)
    copies: dict[int, int] = {}
    for kind, index in step_events:
        if kind > 0:
            copy = dataclasses.replace(records[index], index=len(new_records), step=records[index].step + 1)
            copies[index] = copy.index
            new_records.append(copy)
            new_events.append((1, copy.index))
        else:
            new_events.append((-1, copies[index] if index in copies else replaced[index]))
    shift = end - last

    def copied(positions: list[int]) -> list[int]:
        return positions + [p + shift for p in positions if last <= p < end]

    return dataclasses.replace(
        trace,
        records=new_records,
        events=new_events,
        step_starts=[first, last, end],
        end=len(new_events),
        micro_step_starts=copied(trace.micro_step_starts),
        micro_steps_ends=copied(trace.micro_steps_ends),
    )
