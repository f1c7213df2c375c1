"""The planner's independent traces side by side, one per worker process.

A plan traces a few configurations whose list is known before the first one runs (the configured run, the two points
of the micro-batch fit, the levers' runs); each trace is seconds of single-threaded Python on fake tensors, so on a
machine with several cores they run at once. Workers are forked from the planner's process (POSIX), which has
torch, trainlab and the recipe's modules imported already: a worker starts in milliseconds. Autograd refuses to run in
a child forked after the parent has run a backward pass (its engine threads do not survive a fork), which is the case
of a planner called from a program that trained or traced before (`trainlab plan` has not: its first trace is a
forward only); a throw-away child that runs one backward tells (`fork_runs_autograd`), and where it cannot, the
workers come from a fork server instead: a clean process that imports torch and trainlab once (seconds) and forks a
worker per process wanted. Each job sends the recipe's class and config and gets back the `TracedRun` (a list of
records and events): the same trace as in the planner's process, the same code on the same fake tensors, seeded the
same way (`trace_training`). Where neither exists, or the recipe cannot be sent (a class defined where a worker
cannot import it), the planner traces in its own process and says so. A forked worker runs one thread
(`_forked_worker`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from trainlab.engine.recipe import Recipe
from trainlab.memory.log_once import MessageKey, emitted_elsewhere, message_key
from trainlab.memory.trace import PlanDevice, TracedRun, trace_training

log = logging.getLogger(__name__)

MAX_WORKERS = 4  # planning is a few traces: more workers than that would sit idle
PROBE_SECONDS = 10.0  # `fork_runs_autograd`'s child answers in milliseconds


@dataclass(frozen=True)
class TraceJob:
    """One traced configuration: `trace_training` of the recipe with this precision and checkpointing."""

    micro_batch: int
    grad_accumulation: int
    precision: str
    checkpointing: bool
    count_flops: bool
    repeat_last_step: bool = False  # `trace_training`'s: the last step copied (the micro-batch fit's points)
    # what comes back beside the trace, not part of the configuration (a job is found by the fields above): the FSDP
    # layout of its build (`trace_training(layout=True)`), and the recipe's facts logged by its build in a forked
    # worker (which otherwise logs warnings only), so that the planner's process need not build the recipe itself
    layout: bool = dataclasses.field(default=False, compare=False)
    logs_facts: bool = dataclasses.field(default=False, compare=False)


def trace_job(recipe: Recipe[Any], device: PlanDevice, job: TraceJob) -> TracedRun:
    """Trace `job` (the recipe rebuilt with the job's precision and checkpointing where they differ)."""
    cfg = recipe.config
    if job.precision != cfg.precision or job.checkpointing != cfg.activation_checkpointing:
        config = dataclasses.replace(cfg, precision=job.precision, activation_checkpointing=job.checkpointing)
        recipe = type(recipe)(config)
    return trace_training(
        recipe,
        device=device,
        micro_batch=job.micro_batch,
        grad_accumulation=job.grad_accumulation,
        count_flops=job.count_flops,
        repeat_last_step=job.repeat_last_step,
        layout=job.layout,
    )


def auto_workers() -> int:
    """The cores this process may use, at most `MAX_WORKERS`; 1 where there is no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


def fork_runs_autograd() -> bool:
    """Whether a child forked from this process now can run a backward pass: one throw-away child tries (a tiny
    backward on real tensors) and exits with the answer. False where `fork` does not exist, or where the child has not
    answered within `PROBE_SECONDS` (it is killed)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            leaf = torch.ones(1, requires_grad=True)
            (leaf * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)  # stuck (a lock another thread held at the fork): no forked workers, then
    os.waitpid(pid, 0)
    return False


def _forked_worker() -> None:
    """A forked worker runs one thread: the OpenMP pool the parent used does not survive the fork (a parallel region
    in the child, real tensor work a recipe does while it is built, would wait for it forever), and a trace on fake
    tensors is single-threaded Python. It logs warnings only: the recipe's facts (logged again by each trace's build)
    are logged once, by the one job that says so (`TraceJob.logs_facts`)."""
    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool ends its workers with SIGTERM: not the CLI's handler


class _Recorded(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[MessageKey] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.keys.append(message_key(record))


def _run_sent(
    recipe_class: type[Recipe[Any]], config: Any, device: PlanDevice, job: TraceJob
) -> tuple[TracedRun, list[MessageKey]]:
    """The job's trace, and the messages it logged (`TraceJob.logs_facts`: they count as logged in the planner's
    process too, `log_once.emitted_elsewhere`)."""
    if not job.logs_facts:
        return trace_job(recipe_class(config), device, job), []
    disabled, recorded = logging.root.manager.disable, _Recorded()
    logging.disable(logging.NOTSET)
    logging.getLogger().addHandler(recorded)
    try:
        return trace_job(recipe_class(config), device, job), recorded.keys
    finally:
        logging.getLogger().removeHandler(recorded)
        logging.disable(disabled)


class TraceWorkers:
    """Start `jobs` in at most `workers` processes at once; `take(job)` waits for one (raising what its trace raised).

    One process per job, each with a pipe of its own for its result, started in the jobs' order as slots free up
    (while the planner waits in `take`). Not `multiprocessing.Pool`: its idle workers wait for the next task holding
    the shared task queue's lock, so a worker killed there (a SIGTERM to the whole process group: `timeout`, a batch
    scheduler, `docker stop`) leaves the lock held and `Pool.terminate` waits for it forever. Here nothing is shared:
    `close` kills what still runs."""

    def __init__(
        self,
        recipe: Recipe[Any],
        device: PlanDevice,
        jobs: Sequence[TraceJob],
        workers: int,
        forks: bool | None = None,
    ) -> None:
        """`forks`: whether the workers may be forked from this process (None: `fork_runs_autograd` tells)."""
        self.start_method = ""  # "fork" or "forkserver" once started; "" when tracing in this process
        self._waiting: list[TraceJob] = []  # not started yet, in order
        self._running: dict[TraceJob, tuple[BaseProcess, Connection]] = {}
        self._finished: dict[TraceJob, tuple[bool, Any]] = {}
        self._workers = max(1, min(workers, len(jobs)))
        self._sent = (type(recipe), recipe.config, device)
        try:
            pickle.dumps(self._sent)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            log.info("tracing in this process: the recipe cannot be sent to a worker (%s)", err)
            return
        if fork_runs_autograd() if forks is None else forks:
            self.start_method = "fork"
            self._context: Any = multiprocessing.get_context("fork")
        else:
            self.start_method = "forkserver"
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload([__name__, type(recipe).__module__])  # imported once, before forks
        log.debug("trace workers: %d, started by %s", self._workers, self.start_method)
        self._waiting = list(dict.fromkeys(jobs))
        self._start_waiting()

    def has(self, job: TraceJob) -> bool:
        return job in self._finished or job in self._running or job in self._waiting

    def started(self) -> list[TraceJob]:
        """The jobs not taken yet."""
        return [*self._finished, *self._running, *self._waiting]

    def take(self, job: TraceJob) -> TracedRun:
        if not self.has(job):
            raise KeyError(f"{job} was not started")
        while job not in self._finished:
            self._start_waiting()
            self._collect(wait([reader for _, reader in self._running.values()]))
        ok, value = self._finished.pop(job)
        self._start_waiting()
        if not ok:
            raise value
        run, logged = value
        emitted_elsewhere(logged)
        return run

    def close(self) -> None:
        """Stop the workers (a trace still running is abandoned)."""
        for process, reader in self._running.values():
            process.kill()
            process.join()
            reader.close()
        self._running.clear()
        self._waiting.clear()
        self._finished.clear()

    def _start_waiting(self) -> None:
        while self._waiting and len(self._running) < self._workers:
            job = self._waiting.pop(0)
            reader, writer = self._context.Pipe(duplex=False)
            forked = self.start_method == "fork"
            process = self._context.Process(target=_worker, args=(writer, *self._sent, job, forked), daemon=True)
            process.start()
            writer.close()  # the child's copy is its own: end of file here once it exits
            self._running[job] = (process, reader)

    def _collect(self, ready: list[Any]) -> None:
        """Read the result of each job whose pipe is readable (a result, or end of file: the worker died)."""
        for job, (process, reader) in list(self._running.items()):
            if reader not in ready:
                continue
            try:
                answer = reader.recv()
            except EOFError:  # killed (the OOM killer, a signal) before it could answer
                answer = None
            reader.close()
            process.join()
            if answer is None:
                answer = (False, RuntimeError(f"a planner worker tracing {job} died (exit code {process.exitcode})"))
            self._finished[job] = answer
            del self._running[job]


def _worker(
    writer: Connection,
    recipe_class: type[Recipe[Any]],
    config: Any,
    device: PlanDevice,
    job: TraceJob,
    forked: bool,
) -> None:
    """A worker process: trace one job and send (True, (run, logged)) or (False, the exception) through `writer`."""
    if forked:
        _forked_worker()
    try:
        answer: tuple[bool, Any] = (True, _run_sent(recipe_class, config, device, job))
    except Exception as err:  # raised again in the planner, as a trace in its own process would raise it
        answer = (False, err)
    try:
        writer.send(answer)
    except Exception as err:  # an exception that does not pickle: its type and text
        writer.send((False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]} ({err})")))
    writer.close()
