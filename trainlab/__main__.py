"""`python -m trainlab ...` (what `torchrun -m trainlab` runs)."""

from trainlab.cli import run

run()
