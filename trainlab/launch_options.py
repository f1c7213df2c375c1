"""torchrun's options checked before `trainlab launch` starts anything: what torchrun would refuse with a traceback,
or wait on forever (a contradiction such as `--standalone --nnodes 2`, a host that does not resolve, a rendezvous
port in use), is one `UsageError` line naming the option as the user gave it (or the PET_ variable torchrun read it
from). torchrun's own parsers are used where it has them; a few of its registries are private, and where a torch
release lacks one the check it serves is skipped (torchrun then reports the problem itself)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shlex
import socket

from trainlab.errors import UsageError


def as_given(flag: str, value: object = None, *, dest: str | None = None) -> str:
    """An option as the user gave it: `--flag value` (quoted as a shell would need it), or the PET_ variable that
    torchrun read it from (`PET_{dest}`, dest: the option's long name; a flag when `value` is None)."""
    variable = "PET_" + (dest or flag.lstrip("-").replace("-", "_")).upper()
    set_there = os.environ.get(variable, "").strip()
    if set_there and (set_there != "0" if value is None else set_there == str(value)):
        return f"{variable}={shlex.quote(os.environ[variable])} ({flag})"
    return flag if value is None else f"{flag} {shlex.quote(str(value))}"


def check_options(args: argparse.Namespace) -> None:
    """Refuse what torchrun would refuse with a traceback, or wait on forever, before anything starts.

    Raises:
        UsageError: one line naming the option (or its PET_ variable), what is wrong and the fix.
    """
    from torch.distributed import run as torchrun

    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        min_nodes, max_nodes = 0, 0
    if not 0 < min_nodes <= max_nodes:
        raise UsageError(f"{as_given('--nnodes', args.nnodes)} is not a node count; pass N or MIN:MAX, 1 <= MIN <= MAX")
    if args.standalone and max_nodes > 1:
        raise UsageError(
            f"--standalone runs on this one node, but {as_given('--nnodes', args.nnodes)} asks for {max_nodes}; drop "
            "--nnodes, or drop --standalone and pass --rdzv-backend c10d --rdzv-endpoint HOST:PORT for several nodes"
        )
    if not 0 <= args.node_rank < max_nodes:
        raise UsageError(
            f"{as_given('--node-rank', args.node_rank)} is not a node of the run ({as_given('--nnodes', args.nnodes)}: "
            f"node ranks 0 to {max_nodes - 1}); give each node its own rank in that range"
        )
    _check_workers(args)
    _check_supervision(args)
    _check_rendezvous(args, max_nodes)


def _check_workers(args: argparse.Namespace) -> int:
    """The number of workers on this node (`--nproc-per-node`), with the options that depend on it checked."""
    from torch.distributed import run as torchrun

    given = as_given("--nproc-per-node", args.nproc_per_node)
    fix = "pass the number of workers per node (1 or more), or auto, cpu or gpu (one per CPU or GPU)"
    try:
        workers: int = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as err:  # a word torchrun does not know, or "gpu" without one
        raise UsageError(f"{given} cannot be used ({str(err).rstrip('.')}); {fix}") from None
    if workers < 1:
        raise UsageError(f"{given} starts no worker; {fix}")
    if args.local_ranks_filter:
        ranks = args.local_ranks_filter.split(",")
        if not all(rank.strip().isdigit() and int(rank) < workers for rank in ranks):
            raise UsageError(
                f"{as_given('--local-ranks-filter', args.local_ranks_filter)} is not a list of local ranks below "
                f"{workers} (the workers per node); pass e.g. 0 or 0,1"
            )
    if args.numa_binding is not None:
        import torch

        gpus = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
        if gpus < workers:
            raise UsageError(
                f"--numa-binding {args.numa_binding} binds each worker to the CPUs near its GPU, but this node has "
                f"{gpus} GPU(s) for {workers} worker(s); drop --numa-binding or start one worker per GPU"
            )
    return workers


def _check_supervision(args: argparse.Namespace) -> None:
    """How torchrun watches, restarts and stops the workers, and where their output goes."""
    from importlib.metadata import entry_points

    from torch.distributed.elastic.events import handlers
    from torch.distributed.elastic.multiprocessing.api import Std

    if args.max_restarts < 0:
        raise UsageError(f"{as_given('--max-restarts', args.max_restarts)} is negative; pass 0 (the default) or more")
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        given = as_given("--monitor-interval", args.monitor_interval)
        raise UsageError(f"{given} is not a time; pass a number of seconds above 0 (default 0.1)")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        given = as_given("--shutdown-timeout", args.shutdown_timeout)
        raise UsageError(f"{given} is negative; pass the seconds to wait for the workers before SIGKILL (0 or more)")
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(value)
        except ValueError:
            raise UsageError(
                f"{as_given(flag, value)} is not a choice of streams; pass 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                "or one per local rank as 0:3,1:1"
            ) from None
    known_handlers = getattr(handlers, "_log_handlers", None)  # private: skipped where a torch release lacks it
    if known_handlers is not None and args.event_log_handler not in known_handlers:
        raise UsageError(
            f"{as_given('--event-log-handler', args.event_log_handler)} is not an event log handler; pass one of: "
            f"{', '.join(known_handlers)}"
        )
    if args.logs_specs is not None and args.logs_specs not in entry_points(group="torchrun.logs_specs").names:
        raise UsageError(
            f"--logs-specs {args.logs_specs}: no installed package provides torchrun.logs_specs entry point of that "
            "name; drop it, or install the package that provides it"
        )


# Rendezvous settings (--rdzv-conf) that torch reads as whole numbers above 0 (seconds, or a count of attempts).
_RDZV_COUNTS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "timeout",
)
_RDZV_BOOLS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # RendezvousParameters.get_as_bool's words


def _check_rendezvous(args: argparse.Namespace, max_nodes: int) -> None:
    """Where the nodes meet: the backend, its settings and its endpoint (the hosts must resolve, else the launcher
    retries forever; the port the first node serves on must be free)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry, utils
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    parse_config = getattr(utils, "_parse_rendezvous_config", None)  # private: the checks that need it are skipped

    given = as_given("--rdzv-conf", args.rdzv_conf)
    try:
        conf = parse_config(args.rdzv_conf) if parse_config is not None else {}
    except ValueError:
        raise UsageError(f"{given} is not KEY=VALUE,...; pass e.g. join_timeout=900,read_timeout=60") from None
    for key, value in conf.items():
        if key in _RDZV_COUNTS and not (value.isdigit() and int(value) > 0):
            raise UsageError(f"{given}: {key} must be a whole number above 0; pass e.g. {key}=60")
        if key == "is_host" and value.lower() not in _RDZV_BOOLS:
            raise UsageError(f"{given}: is_host must be true or false")
        if key == "store_type" and value.lower() not in ("tcp", "file"):
            raise UsageError(f"{given}: store_type must be tcp or file")
    if args.master_port is not None and not 0 <= args.master_port < 2**16:
        raise UsageError(f"{as_given('--master-port', args.master_port)} is not a port; pass a free port below 65536")
    if args.local_addr is not None:
        _check_host(as_given("--local-addr", args.local_addr), args.local_addr)
    local = args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and max_nodes == 1
    )
    if local:  # torchrun's own rendezvous on a free local port (`torch.distributed.run.run`)
        return
    backends = getattr(rendezvous_handler_registry, "_registry", None)  # private: skipped where absent
    if backends is not None and args.rdzv_backend not in backends:
        given = as_given("--rdzv-backend", args.rdzv_backend)
        raise UsageError(f"{given} is not a rendezvous backend; pass one of: {', '.join(backends)}")
    if args.rdzv_backend.startswith("etcd") and importlib.util.find_spec("etcd") is None:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend} needs the python-etcd package; install it, or use c10d")
    if args.rdzv_endpoint:
        given, endpoint = as_given("--rdzv-endpoint", args.rdzv_endpoint), args.rdzv_endpoint
        fix = "pass HOST:PORT of the node that serves the rendezvous, e.g. node0:29400"
    else:
        given, endpoint = (
            as_given("--master-addr", args.master_addr),
            f"{args.master_addr}:{args.master_port or 29500}",
        )
        fix = "pass the host name or address of node 0"
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError as err:
        raise UsageError(f"{given} cannot be used ({str(err).rstrip('.')}); {fix}") from None
    _check_host(given, host)
    if args.rdzv_backend == "static" and args.node_rank == 0 and port != 0:  # this node serves the rendezvous
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError as err:
                flag = "--rdzv-endpoint" if args.rdzv_endpoint else "--master-port"
                raise UsageError(
                    f"{flag}: node 0 cannot serve the rendezvous on port {port} ({err.strerror}: another run?); pass "
                    "a free port"
                ) from None


def _check_host(given: str, host: str) -> None:
    """Refuse a host name that does not resolve: torchrun would retry it until its timeout (minutes, or forever)."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as err:
        reason = err.strerror if isinstance(err, socket.gaierror) else "not a host name"
        raise UsageError(
            f"{given}: the host {host!r} cannot be found ({reason}); pass a host name or address"
        ) from None
