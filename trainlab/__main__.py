"""`python -m trainlab ...` (what `torchrun -m trainlab` runs)."""

import sys

from trainlab.cli import main

sys.exit(main())
