"""Subcommands of the `trainlab` CLI; each exposes `main(argv) -> int`."""
