"""`trainlab train RECIPE --debug` for every recipe and precision on one device: which combinations run, and which
repeat and resume to the bit (the debug check trains straight through, then again stopped half-way and resumed, and
compares losses, weights, optimizer and recipe state and the last evaluation).

    python benchmarks/bench_gpu_debug.py                                  # every recipe x precision on cuda
    python benchmarks/bench_gpu_debug.py --recipes toy,var --precisions bf16-amp --jobs 2
    python benchmarks/bench_gpu_debug.py --smoke                          # cpu, toy, fp32: checks the plumbing

Rows: each recipe (`trainlab train --help`) at each precision in --precisions, plus `--compile true` at bf16-amp for
the recipes in --compile-recipes. Each row is one `trainlab train RECIPE --debug --device D --precision P --run-dir
$WORK/RECIPE_P` in its own process, --jobs at a time, killed after --timeout seconds. A row's status:
  PASS     exit 0 and the last output line that starts `debug PASS`
  FAIL     the check ran and found a difference (`debug FAIL: ...`); on cuda the row is run again with
           `--deterministic true` as a second row (kernels that accumulate with atomics do not repeat to the bit)
  refused  exit 2 with a one-line error: the recipe or the device does not offer that precision
  ERROR    any other nonzero exit (the row keeps the last 20 lines of stderr)
  TIMEOUT  killed after --timeout seconds
A row that goes wrong is recorded and the next runs; the result file is rewritten after every row, so a run cut
short keeps what it finished. A compact table is printed at the end.
"""

# Legend: none (no tensors are named here).

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _env import environment, result_path, settings, write_result

RECIPES = ("cifar", "judge", "linear-probe", "moco", "tokenizer", "toy", "var")
PRECISIONS = ("fp32", "bf16-amp", "fp16-amp-scale", "bf16")
COMPILE_RECIPES = ("toy", "cifar", "var")
COMPILE_PRECISION = "bf16-amp"
DEBUG_LINE = re.compile(r"^debug (PASS|FAIL)\b.*$", re.MULTILINE)
STDERR_TAIL = 20


@dataclass(frozen=True)
class Job:
    recipe: str
    precision: str
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The run folder's name: RECIPE_PRECISION, plus the extra flags' values (`toy_bf16-amp_compile`)."""
        tags = [flag.lstrip("-") for flag, value in zip(self.extra[::2], self.extra[1::2]) if value == "true"]
        return "_".join([self.recipe, self.precision, *tags])


class Runner:
    """Runs the jobs' processes, each in its own process group (its data-loader workers die with it); kills them all
    when the benchmark is interrupted."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.live: set[subprocess.Popen[bytes]] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def argv(self, job: Job) -> list[str]:
        return [
            sys.executable, "-m", "trainlab", "train", job.recipe, "--debug", "--device", self.args.device,
            "--precision", job.precision, "--run-dir", str(self.work / job.name), *job.extra,
        ]  # fmt: skip

    def shown(self, argv: list[str]) -> str:
        """The command as a user types it, the work folder written $WORK."""
        return shlex.join(["trainlab", *argv[3:]]).replace(str(self.work), "$WORK")

    def run(self, job: Job) -> dict[str, Any]:
        argv = self.argv(job)
        row: dict[str, Any] = {
            "recipe": job.recipe,
            "precision": job.precision,
            "extra": " ".join(job.extra),
            "command": self.shown(argv),
            "exit_code": None,
            "seconds": 0.0,
            "status": "ERROR",
            "debug_line": "",
            "message": "",
        }
        logs = self.work / "logs"
        out_path, err_path = logs / f"{job.name}.out", logs / f"{job.name}.err"
        t0 = time.perf_counter()
        try:
            logs.mkdir(parents=True, exist_ok=True)
            with out_path.open("wb") as out, err_path.open("wb") as err:
                with self.lock:
                    if self.stopping:
                        row["message"] = "not started: the benchmark was interrupted"
                        return row
                    proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                            start_new_session=True)  # fmt: skip
                    self.live.add(proc)
                try:
                    row["exit_code"] = proc.wait(timeout=self.args.timeout)
                except subprocess.TimeoutExpired:
                    kill_group(proc)
                    row["status"] = "TIMEOUT"
                finally:
                    with self.lock:
                        self.live.discard(proc)
        except Exception as exc:  # a row that cannot start is recorded, never fatal
            row["message"] = f"could not run: {type(exc).__name__}: {exc}"
            row["seconds"] = round(time.perf_counter() - t0, 1)
            return row
        row["seconds"] = round(time.perf_counter() - t0, 1)
        stdout, stderr = read_text(out_path), read_text(err_path)
        row.update(classify(row["exit_code"], stdout, stderr, timed_out=row["status"] == "TIMEOUT"))
        if row["status"] == "TIMEOUT":
            row["message"] = f"killed after {self.args.timeout:g} s; " + row["message"]
        return row

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in list(self.live):
                kill_group(proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a job's process and everything it started (it leads its own process group)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return ""


def tail(text: str, n: int) -> str:
    """The last `n` non-blank lines of `text`."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-n:])


def classify(exit_code: int | None, stdout: str, stderr: str, timed_out: bool = False) -> dict[str, Any]:
    """status, debug line and message of one finished (or killed) `trainlab train --debug` process."""
    matches = list(DEBUG_LINE.finditer(stdout + "\n" + stderr))
    debug_line = matches[-1].group(0).strip() if matches else ""
    verdict = matches[-1].group(1) if matches else ""
    if timed_out:
        return {"status": "TIMEOUT", "debug_line": debug_line, "message": tail(stderr, 3)}
    if exit_code == 0 and verdict == "PASS":
        return {"status": "PASS", "debug_line": debug_line, "message": ""}
    if verdict == "FAIL":
        return {"status": "FAIL", "debug_line": debug_line, "message": ""}
    err_lines = [line for line in stderr.splitlines() if line.strip()]
    if exit_code == 2 and "Traceback" not in stderr and err_lines:
        return {"status": "refused", "debug_line": debug_line, "message": err_lines[-1].strip()}
    message = tail(stderr, STDERR_TAIL)
    if exit_code == 0:
        message = "exit 0 without a `debug PASS` line\n" + message
    return {"status": "ERROR", "debug_line": debug_line, "message": message}


def plan(args: argparse.Namespace) -> list[Job]:
    jobs = [Job(r, p) for r in args.recipes for p in args.precisions]
    jobs += [Job(r, COMPILE_PRECISION, ("--compile", "true")) for r in args.compile_recipes if r in args.recipes]
    return jobs


def gpu_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return re.sub(r"[^A-Za-z0-9.]+", "-", torch.cuda.get_device_name(0)).strip("-")
    return device.replace(":", "")


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row: recipe, precision, flags, status, seconds and the part of the debug line or message that
    says why."""
    head = f"{'recipe':<13}{'precision':<16}{'flags':<23}{'status':<9}{'s':>7}  detail"
    out = [head, "-" * len(head)]
    for r in rows:
        if r["status"] in ("PASS", "FAIL"):
            detail = r["debug_line"].split(": ", 1)[-1]
        else:
            detail = (r["message"].strip().splitlines() or [""])[-1]
        out.append(
            f"{r['recipe']:<13}{r['precision']:<16}{r['extra']:<23}{r['status']:<9}{r['seconds']:>7.1f}  {detail[:140]}"
        )
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "refused", "ERROR", "TIMEOUT")}
    out.append("  ".join(f"{k} {v}" for k, v in counts.items()))
    return "\n".join(out)


def csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--recipes", type=csv_list, default=list(RECIPES), help="comma-separated (default: all)")
    parser.add_argument("--precisions", type=csv_list, default=list(PRECISIONS), help="comma-separated")
    parser.add_argument(
        "--compile-recipes",
        type=csv_list,
        default=list(COMPILE_RECIPES),
        help=f"recipes (of --recipes) that get a `--compile true` row at {COMPILE_PRECISION} ('' for none)",
    )
    parser.add_argument("--jobs", type=int, default=4, help="runs at once")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run before it is killed")
    parser.add_argument("--work-dir", default="", help="keep runs and logs here (default: a temporary folder)")
    parser.add_argument("--json", default="auto", help="result file ('auto': results/gpu_debug_<gpu>_<date>.json)")
    parser.add_argument("--label", default="", help="what distinguishes this run, in the auto name")
    parser.add_argument("--smoke", action="store_true", help="cpu, toy, fp32, no compile row: checks the plumbing")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.recipes, args.precisions, args.compile_recipes, args.jobs = "cpu", ["toy"], ["fp32"], [], 1
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        print(f"note: {', '.join(unknown)} not in the known recipes {', '.join(RECIPES)}; running them anyway")
    jobs = plan(args)
    env = environment()
    out_path = result_path(args.json, "gpu_debug", gpu_name(args.device), "smoke" if args.smoke else "", args.label)
    tmp = None if args.work_dir else tempfile.mkdtemp(prefix="gpu_debug_")
    work = Path(args.work_dir or str(tmp)).resolve()
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, work)
    rows: dict[Job, list[dict[str, Any]]] = {}
    result: dict[str, Any] = {"environment": env, "config": settings(args), "runs": []}

    def save(final: bool) -> None:
        result["runs"] = [row for job in jobs for row in rows.get(job, [])]
        result["complete"] = final
        if final:
            write_result(out_path, result)
        elif out_path is not None:
            with contextlib.suppress(OSError):
                out_path.parent.mkdir(parents=True, exist_ok=True)
                out_path.write_text(json.dumps(result, indent=1) + "\n")

    def run_job(job: Job) -> list[dict[str, Any]]:
        first = runner.run(job)
        out = [first]
        if first["status"] == "FAIL" and args.device.startswith("cuda"):
            out.append(runner.run(Job(job.recipe, job.precision, (*job.extra, "--deterministic", "true"))))
        return out

    print(f"{len(jobs)} runs on {args.device}, {args.jobs} at a time, timeout {args.timeout:g} s; work folder {work}")
    started = time.perf_counter()
    order = sorted(jobs, key=lambda j: (not j.extra, j.recipe != "var"))  # compiled and VAR runs are the longest
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        futures = {pool.submit(run_job, job): job for job in order}
        for future in as_completed(futures):
            job = futures[future]
            try:
                rows[job] = future.result()
            except Exception as exc:  # recorded, never fatal
                rows[job] = [{"recipe": job.recipe, "precision": job.precision, "extra": " ".join(job.extra),
                              "command": "", "exit_code": None, "seconds": 0.0, "status": "ERROR", "debug_line": "",
                              "message": f"{type(exc).__name__}: {exc}"}]  # fmt: skip
            for row in rows[job]:
                print(f"[{time.perf_counter() - started:7.1f} s] {row['status']:<8} {row['command']}", flush=True)
            save(final=False)
    except KeyboardInterrupt:
        print("interrupted: killing the runs in progress; the result keeps the rows that finished", file=sys.stderr)
        runner.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        save(final=True)
        print(table(result["runs"]))
        raise SystemExit(130) from None
    pool.shutdown(wait=True)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    save(final=True)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(result["runs"]))


if __name__ == "__main__":
    main()
