"""The CLI's host allocator policy: `reuse` keeps freed blocks for the next step (no new page faults), `system` leaves
glibc's defaults; a bad TRAINLAB_HOST_ALLOCATOR is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainlab.errors import UsageError
from trainlab.host_memory import _glibc, configure_host_allocator

# Allocates, touches and frees a 64 MiB tensor, then counts the minor page faults of doing it again: with glibc's
# defaults the block is its own mapping, unmapped on free and faulted in again (one fault per 4 KiB page);
# with `reuse` the second allocation gets the same memory back.
_PROBE = """
import json, resource, sys
import torch
from trainlab.host_memory import configure_host_allocator
line = configure_host_allocator(sys.argv[1])
def touch():
    x = torch.empty(16 * 2**20)  # 64 MiB of float32
    x.fill_(1.0)
    del x
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "line": line}))
"""


def _second_touch_faults(policy: str) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE, policy], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return int(result["faults"]), str(result["line"])


@pytest.mark.skipif(_glibc() is None, reason="the reuse policy applies to glibc only")
def test_reuse_keeps_freed_memory_and_system_gives_it_back() -> None:
    pages = 64 * 2**20 // 4096
    system_faults, system_line = _second_touch_faults("system")
    reuse_faults, reuse_line = _second_touch_faults("reuse")
    assert system_faults > pages // 2, (system_faults, system_line)  # mapped and faulted in again
    assert reuse_faults < pages // 20, (reuse_faults, reuse_line)  # the freed block came back
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
