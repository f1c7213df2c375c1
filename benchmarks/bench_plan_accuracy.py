"""The CPU accuracy table of `trainlab plan`: predicted vs measured peak of live tensor bytes, per case.

    .venv/bin/python benchmarks/bench_plan_accuracy.py [--cases var-fp32,tokenizer]

The cases, the independent measurement (a real `Trainer` on CPU, live storages counted over optimizer steps 2-4)
and the prediction (`trace_training` + `breakdown` at the same micro-batch and accumulation) are those of
`tests/test_memory_accuracy.py`, imported from it, so the table is what the test asserts (|error| <= 3 %).
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _env import environment, result_path, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_memory_accuracy import CASES, _recipe, measure_real_peak

from trainlab.memory.breakdown import breakdown
from trainlab.memory.trace import trace_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", default="auto", help="result path ('auto': benchmarks/results/, '': none)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            name, overrides = CASES[case]
            recipe = _recipe(name, Path(folder) / case, **overrides)
            cfg = recipe.config
            micro = cfg.batch_size // cfg.grad_accumulation
            start = time.perf_counter()
            predicted = breakdown(
                trace_training(recipe, device="cpu", micro_batch=micro, grad_accumulation=cfg.grad_accumulation)
            ).peak_allocated_bytes
            seconds = time.perf_counter() - start
            measured = measure_real_peak(_recipe(name, Path(folder) / case / "real", **overrides))
            error = (predicted - measured) / measured
            rows.append(
                {
                    "case": case,
                    "micro_batch": micro,
                    "grad_accumulation": cfg.grad_accumulation,
                    "predicted_bytes": predicted,
                    "measured_bytes": measured,
                    "error": error,
                    "plan_seconds": seconds,
                }
            )
    print("| case | micro-batch x accumulation | predicted peak (B) | measured peak (B) | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['micro_batch']} x {r['grad_accumulation']} | {r['predicted_bytes']:,} | "
            f"{r['measured_bytes']:,} | {r['error']:+.2%} |"
        )
    write_result(result_path(args.json, "plan_accuracy_cpu"), {"cases": rows, "environment": environment()})


if __name__ == "__main__":
    main()
