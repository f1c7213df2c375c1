"""A trace at any micro-batch from traces at two: every storage's bytes are affine in the micro-batch.

The training step runs the same ops at every micro-batch; only the sizes change, and (for the recipes whose every
op works per sample) each storage's bytes are a + b x micro-batch: parameters, gradients and optimizer states have
b = 0, activations a = 0. Two traces at micro-batches m1 < m2 with the same events in the same order give a and b
per storage; a third trace checks the fit byte for byte before it is used, so a recipe where the fit does not hold
(MoCo's B x B logits are quadratic; an op that allocates only at some sizes changes the events) is traced as before.
A trace costs seconds on fake tensors; the fitted trace at another micro-batch costs a list of sizes.

Where the affine fit fails, a storage's bytes may still be a polynomial of degree 2 in the micro-batch (MoCo's
B x B logits, attention over the batch): `fit_quadratic` fits a + b m + c m^2 through three traces (integer
coefficients, as a tensor's element count is a product of sizes affine in the micro-batch) and checks a fourth the
same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from fractions import Fraction

from trainlab.memory.collector import paused
from trainlab.memory.trace import TracedRun

FittedRun = Callable[[int], TracedRun]


def _canonical(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The events with each run of consecutive frees in index order: storages that die together (one tensor's
    release frees several) are released in an order that can differ between traces, and the allocator's state after
    the whole run of frees does not depend on it (free blocks merge the same way)."""
    out: list[tuple[int, int]] = []
    frees: list[tuple[int, int]] = []
    for event in events:
        if event[0] < 0:
            frees.append(event)
            continue
        out += sorted(frees)
        frees = []
        out.append(event)
    return out + sorted(frees)


def _same_structure(a: TracedRun, b: TracedRun) -> bool:
    ta, tb = a.trace, b.trace
    if ta.step_starts != tb.step_starts or len(ta.records) != len(tb.records):
        return False
    if ta.events != tb.events and _canonical(ta.events) != _canonical(tb.events):
        return False
    return all(
        (ra.region, ra.step, ra.label, ra.autocast_copy, ra.written_by_recipe_hook)
        == (rb.region, rb.step, rb.label, rb.autocast_copy, rb.written_by_recipe_hook)
        for ra, rb in zip(ta.records, tb.records, strict=True)
    )


def fit_micro_batch(low: TracedRun, high: TracedRun, check: TracedRun) -> FittedRun | None:
    """The trace at any micro-batch, fitted through `low` and `high` (same accumulation, different micro-batches),
    or None when the structures differ or the fit does not give `check`'s bytes exactly."""
    if not _same_structure(low, check):
        return None
    at = affine_through(low, high)
    return None if at is None else _checked(at, check)


def _checked(at: FittedRun, check: TracedRun) -> FittedRun | None:
    """`at`, where it gives every storage of `check` its traced bytes; else None."""
    predicted = at(check.micro_batch).trace.records
    if any(p.nbytes != r.nbytes for p, r in zip(predicted, check.trace.records, strict=True)):
        return None
    return at


def _resized(run: TracedRun, micro_batch: int, nbytes: Iterable[int]) -> TracedRun:
    """`run` at `micro_batch`, its storages of `nbytes` (a fitted trace: no FLOP count of its own)."""
    with paused():
        records = [r.with_bytes(n) for r, n in zip(run.trace.records, nbytes)]
    return dataclasses.replace(
        run, trace=dataclasses.replace(run.trace, records=records), micro_batch=micro_batch, flops=None
    )


def affine_through(low: TracedRun, high: TracedRun) -> FittedRun | None:
    """The affine fit through `low` and `high` unchecked (the caller checks it some other way), or None when the
    structures differ or a storage's bytes do not change by a whole number per sample."""
    m1, m2 = low.micro_batch, high.micro_batch
    if m1 == m2 or not _same_structure(low, high):
        return None
    slopes: list[int] = []
    for ra, rb in zip(low.trace.records, high.trace.records, strict=True):
        delta = rb.nbytes - ra.nbytes
        if delta % (m2 - m1):
            return None
        slopes.append(delta // (m2 - m1))

    def at(micro_batch: int) -> TracedRun:
        m = micro_batch - m1
        return _resized(low, micro_batch, (r.nbytes + slope * m for r, slope in zip(low.trace.records, slopes)))

    return at


def fit_quadratic(points: list[TracedRun], check: TracedRun) -> FittedRun | None:
    """The trace at any micro-batch as a polynomial of degree 2 per storage through the three `points` (same
    accumulation, different micro-batches), or None when the structures differ, a coefficient is not a whole number of
    bytes, or the fit does not give `check`'s bytes exactly."""
    first = points[0]
    if len({p.micro_batch for p in points}) != 3 or not all(_same_structure(first, p) for p in [*points[1:], check]):
        return None
    (m0, m1, m2) = (p.micro_batch for p in points)
    laws: list[tuple[int, int, int]] = []
    for b0, b1, b2 in zip(*([r.nbytes for r in p.trace.records] for p in points), strict=True):
        d01, d12 = Fraction(b1 - b0, m1 - m0), Fraction(b2 - b1, m2 - m1)
        c = (d12 - d01) / (m2 - m0)
        b = d01 - c * (m0 + m1)
        a = b0 - b * m0 - c * m0 * m0
        if any(x.denominator != 1 for x in (a, b, c)):
            return None
        laws.append((int(a), int(b), int(c)))

    def at(micro_batch: int) -> TracedRun:
        m = micro_batch
        return _resized(first, m, (a + b * m + c * m * m for a, b, c in laws))

    return _checked(at, check)
