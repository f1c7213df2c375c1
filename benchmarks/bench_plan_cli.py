"""Time the issue's `trainlab plan` cases end to end, as a user runs them (a fresh process, no weight files).

    .venv/bin/python benchmarks/bench_plan_cli.py [--cases seed,all] [--json auto]

    seed  trainlab plan var --config var_d16 --precision fp16-amp-scale --gpu L20-48GB --gpus 2    (bar: <= 15 s)
    all   trainlab plan var --config var_d16 --precision fp16-amp-scale --gpu all --dataset-size 1281167  (<= 60 s)
    seed-1, all-1: the same with --trace-processes 1 (every trace in the planner's process), side by side

Each case runs once in a child process: wall seconds, the child's CPU seconds (user + system: what the machine's
load does not change much; trace workers forked by the planner are counted with it, workers of a fork server, which
the planner uses where a forked child could not run autograd, are not) and the traced configurations the plan
reports. On a shared machine the wall time includes waiting for a core: compare CPU seconds between runs.
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time

from _env import environment, result_path, write_result

BASE = ["var", "--config", "var_d16", "--precision", "fp16-amp-scale"]
CASES = {
    "seed": [*BASE, "--gpu", "L20-48GB", "--gpus", "2"],
    "all": [*BASE, "--gpu", "all", "--dataset-size", "1281167"],
}
CASES |= {f"{name}-1": [*argv, "--trace-processes", "1"] for name, argv in list(CASES.items())}


def run_case(argv: list[str]) -> dict[str, object]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "trainlab", "plan", *argv], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    traced = re.search(r"\((\d+) traced configuration", done.stdout)
    return {
        "argv": argv,
        "exit_code": done.returncode,
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "traces": int(traced.group(1)) if traced else None,
        "stdout_tail": done.stdout.splitlines()[-60:],
        "stderr_tail": done.stderr.splitlines()[-5:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="seed,seed-1,all,all-1")
    parser.add_argument("--json", default="auto", help="result path ('auto': benchmarks/results/, '': none)")
    args = parser.parse_args()
    results = {name: run_case(CASES[name]) for name in args.cases.split(",")}
    for name, r in results.items():
        print(
            f"{name}: exit {r['exit_code']}, {r['wall_seconds']} s wall, {r['cpu_seconds']} s CPU, {r['traces']} traces"
        )
    write_result(result_path(args.json, "plan_cli", *results), {"cases": results, "environment": environment()})
    print(json.dumps({k: {"wall": v["wall_seconds"], "cpu": v["cpu_seconds"]} for k, v in results.items()}))


if __name__ == "__main__":
    main()
