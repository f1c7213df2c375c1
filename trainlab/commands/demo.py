"""`trainlab demo [--quick] [--run-dir runs/demo]`: train a tokenizer and a VAR on bundled digits, then judge them."""

from __future__ import annotations

import sys

from trainlab.config import parse


def main(argv: list[str]) -> int:
    from trainlab.demo.pipeline import DemoConfig, DemoInterrupted, render_markdown, run_demo

    config = parse(DemoConfig, argv, prog="trainlab demo")
    try:
        report = run_demo(config)
    except DemoInterrupted as stop:
        print(f"trainlab demo: {stop}", file=sys.stderr)
        return 130
    print(render_markdown(report), end="")
    print(f"wrote {config.run_dir}/report.json, report.md and figures")
    return 0
