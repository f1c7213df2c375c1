"""The CLI's host allocator policy: `reuse` keeps freed blocks for the next step (no new page faults), `system` leaves
glibc's defaults; a bad TRAINLAB_HOST_ALLOCATOR is one line and exit code 2."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from trainlab.engine.host_allocator import _glibc, configure_host_allocator
from trainlab.errors import UsageError

# A small training step (an MLP on a 4096-row batch: 32 MiB hidden activations and their gradients), 16 times; the
# minor page faults of each step. With glibc's defaults the large blocks are mappings of their own, unmapped when
# freed and faulted in again every step; with `reuse` the later steps get the freed blocks back.
_PROBE = """
import json, resource, sys
import torch
from trainlab.engine.host_allocator import configure_host_allocator
line = configure_host_allocator(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
x = torch.randn(4096, 256)
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x).square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "line": line}))
"""


def _step_faults(policy: str) -> tuple[list[int], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE, policy], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return [int(f) for f in result["faults"]], str(result["line"])


@pytest.mark.skipif(_glibc() is None, reason="the reuse policy applies to glibc only")
def test_reuse_keeps_freed_memory_and_system_gives_it_back() -> None:
    hidden_pages = 4096 * 2048 * 4 // 4096  # one hidden activation
    system_faults, system_line = _step_faults("system")
    reuse_faults, reuse_line = _step_faults("reuse")
    # with the defaults every step faults its activations in again; with reuse the heap grows for the first few
    # steps (until freed blocks fit the requests), then most steps fault nothing at all (a step now and then still
    # faults a few pages: the heap growing once more, or the kernel reclaiming a cold page)
    assert min(system_faults[2:]) > hidden_pages, (system_faults, system_line)
    assert sum(reuse_faults[2:]) < sum(system_faults[2:]) / 8, (reuse_faults, system_faults)
    assert statistics.median(reuse_faults[-10:]) == 0, (reuse_faults, reuse_line)
    assert "keeps freed memory for reuse" in reuse_line and "defaults" in system_line


def test_bad_policy_is_a_usage_error_naming_the_fix() -> None:
    with pytest.raises(UsageError, match=r"TRAINLAB_HOST_ALLOCATOR='fast' is not a host allocator policy.*reuse, sys"):
        configure_host_allocator("fast")


def test_cli_reports_a_bad_policy_in_one_line_with_exit_code_2() -> None:
    env = {**os.environ, "TRAINLAB_HOST_ALLOCATOR": "fast"}
    done = subprocess.run([sys.executable, "-m", "trainlab", "runs", "."], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "trainlab runs: error: TRAINLAB_HOST_ALLOCATOR='fast' is not a host allocator policy; set it to one of: "
        "reuse, system"
    ]


def test_cpu_auto_accumulation_leaves_room_for_the_reuse_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil
    import torch

    from trainlab.commands import train as train_command

    class Memory:
        available = 8 * 2**30

    monkeypatch.setattr(psutil, "virtual_memory", Memory)
    monkeypatch.setattr(train_command, "reuses_freed_memory", lambda: True)
    free, meaning = train_command.free_memory(torch.device("cpu"))
    assert free == int(8 * 2**30 * 0.75) and "75% of the RAM available" in meaning
    monkeypatch.setattr(train_command, "reuses_freed_memory", lambda: False)
    assert train_command.free_memory(torch.device("cpu"))[0] == 8 * 2**30
