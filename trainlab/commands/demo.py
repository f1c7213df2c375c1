"""`trainlab demo [--quick] [--run-dir runs/demo]`: train a tokenizer and a VAR on bundled digits, then judge them.

The run directory is checked and locked before anything is trained (a second demo on it stops at once); its stages
(tokenizer/, var/) are run directories of their own, locked by their trainers.
"""

from __future__ import annotations

import sys

from trainlab.config import parse
from trainlab.engine.run_lock import RunDirLock
from trainlab.errors import check_output_path


def main(argv: list[str]) -> int:
    from trainlab.demo.pipeline import DemoConfig, DemoInterrupted, render_markdown, run_demo

    config = parse(DemoConfig, argv, prog="trainlab demo")
    check_output_path("--run-dir", config.run_dir, is_dir=True)
    try:
        with RunDirLock(config.run_dir):
            report = run_demo(config)
    except DemoInterrupted as stop:
        print(f"trainlab demo: {stop}", file=sys.stderr)
        return 130
    print(render_markdown(report), end="")
    print(f"wrote {config.run_dir}/report.json, report.md and figures")
    return 0
