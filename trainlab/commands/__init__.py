"""Subcommands of the `trainlab` CLI; each exposes `main(argv) -> int`.

A command parses its flags before it imports torch (or numpy, PIL, matplotlib): those are imported inside the
functions that use them, so `--help` and a usage error answer at once (`tests/test_cli_startup.py`). Flags follow
the one command-line vocabulary of `trainlab/vocabulary.py`.
"""
