"""One check's result, and the two ways `trainlab doctor` shows results: a line per check, or JSON.

Statuses: PASS (fine), WARN (the run works, but something costs time or will bite later), FAIL (the run will not
work as asked), SKIP (not applicable here, with the reason: the CUDA checks on a machine without a usable GPU). A
WARN or FAIL always carries its fix, printed on the same line. The command exits 1 when a check failed, else 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
STATUSES: tuple[Status, ...] = ("PASS", "WARN", "FAIL", "SKIP")
NAME_WIDTH = 22


@dataclass(frozen=True)
class Check:
    """The result of one check.

    Attributes:
        name: a stable identifier ("torch", "gpu0-arch", "shm", "data-train"), the same in text and JSON.
        status: PASS, WARN, FAIL or SKIP.
        detail: what was found, one line (for SKIP: why the check did not apply).
        fix: what to do, one line; required for WARN and FAIL.
        values: the measured values behind the verdict (versions, byte counts), for `--json`.
    """

    name: str
    status: Status
    detail: str
    fix: str = ""
    values: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status
        assert self.fix or self.status in ("PASS", "SKIP"), f"{self.name}: a {self.status} must say how to fix it"
        assert "\n" not in self.detail + self.fix, f"{self.name}: one line"

    def line(self) -> str:
        """`STATUS  name  detail; fix: ...` (the fix only for WARN / FAIL)."""
        text = f"{self.status:<4}  {self.name:<{NAME_WIDTH}} {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix and self.status in ("WARN", "FAIL") else text

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix, **self.values}


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0 (warnings and skips do not fail)."""
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def summary_line(checks: Sequence[Check]) -> str:
    """`12 passed, 2 warnings, 0 failed, 7 skipped`."""
    n = Counter(c.status for c in checks)
    return f"{n['PASS']} passed, {n['WARN']} warning(s), {n['FAIL']} failed, {n['SKIP']} skipped"


def render_text(checks: Sequence[Check]) -> str:
    """One line per check, then the summary."""
    return "\n".join([*(c.line() for c in checks), summary_line(checks)])


def render_json(checks: Sequence[Check]) -> dict[str, Any]:
    """Every check as an object, the counts per status and the exit code."""
    counts = Counter(c.status for c in checks)
    return {
        "checks": [c.to_json() for c in checks],
        "counts": {status: counts[status] for status in STATUSES},
        "exit_code": exit_code(checks),
    }
