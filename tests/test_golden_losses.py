"""Golden per-step losses of every recipe's debug variant: portable on any CPU, bit for bit where recorded.

The design and the tolerance are explained in `tests/golden.py`. After an intended change of behaviour regenerate
with `pytest tests/test_golden_losses.py --update-golden` and say in the commit message why the numbers moved.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from golden import (
    CASES,
    RECIPE_CASES,
    REFERENCE,
    REFERENCE_CASES,
    REFERENCE_RTOL,
    differences,
    load_json,
    machine_fingerprint,
    native_path,
    run_case,
    write_json,
)

from trainlab.recipes import list_recipes


def _check_shape(got: dict[str, Any]) -> None:
    assert all(len(v) >= 40 for v in got["losses"].values()), "each golden curve should cover ~50 steps"
    assert all(math.isfinite(float.fromhex(v)) for vals in got["losses"].values() for v in vals)


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_fp64_reference_run_matches_on_any_cpu(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    got = run_case(case, tmp_path / case, precision="fp64")
    _check_shape(got)
    reference = load_json(REFERENCE)
    if request.config.getoption("--update-golden"):
        reference.setdefault("cases", {})[case] = got
        reference["recorded_on"] = machine_fingerprint()
        reference["rtol"] = REFERENCE_RTOL
        write_json(REFERENCE, reference)
        return
    assert case in reference.get("cases", {}), f"no reference for {case!r}: run pytest {__file__} --update-golden"
    exact = reference.get("recorded_on") == machine_fingerprint()
    problems = differences(got, reference["cases"][case], 0.0 if exact else REFERENCE_RTOL)
    tier = "bit for bit (this machine recorded it)" if exact else f"to a relative {REFERENCE_RTOL:g}"
    assert not problems, f"{case} (fp64) does not match its reference {tier}: " + "; ".join(problems)


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_run_matches_bit_for_bit_where_recorded(
    case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = native_path()
    update = request.config.getoption("--update-golden")
    if not update and not path.is_file():
        machine = machine_fingerprint()
        pytest.skip(
            f"no native goldens for this machine ({machine['cpu'].get('model', '?')}, "
            f"{machine['aten_cpu_capability']} kernels; {path.name}): its floats are its own, the fp64 reference "
            "test checks it"
        )
    got = run_case(case, tmp_path / case)
    _check_shape(got)
    native = load_json(path)
    if update:
        native.setdefault("cases", {})[case] = got
        native["fingerprint"] = machine_fingerprint()
        write_json(path, native)
        return
    assert case in native.get("cases", {}), f"no native golden for {case!r} in {path.name}: --update-golden"
    problems = differences(got, native["cases"][case])
    assert not problems, f"{case} is not bit for bit its golden run on this machine: " + "; ".join(problems)


def test_every_recipe_has_a_golden_case() -> None:
    """A registered recipe without a golden run would change unguarded; a case of an unregistered one would be
    silently dropped from `CASES`."""
    assert sorted(set(list_recipes()) - {r for r, cases in RECIPE_CASES.items() if cases}) == []
    assert sorted(set(RECIPE_CASES) - set(list_recipes())) == []
    assert all(case.recipe == recipe for recipe, cases in RECIPE_CASES.items() for case in cases.values())


def test_a_requested_kernel_set_is_in_effect() -> None:
    """`ATEN_CPU_CAPABILITY=default ...` (make test's second golden pass) must really change the kernels, or that
    pass would only repeat the first."""
    requested = os.environ.get("ATEN_CPU_CAPABILITY")
    if requested is None:
        pytest.skip("no ATEN_CPU_CAPABILITY set: the machine's own kernels are in use")
    assert torch.backends.cpu.get_cpu_capability().lower() == requested.lower()
