"""The limits training health is judged by (`engine.health` warns past them; `trainlab report`'s health plot draws
them). No torch: the report reads them without importing training code."""

from __future__ import annotations

DEAD_FRACTION_WARN = 0.5  # a ReLU whose share of units that never fire exceeds this draws a warning
USUAL_UPDATE_RATIO = 1e-3  # per optimizer step: the usual size of ||W_after - W_before|| / ||W_before||
UPDATE_RATIO_HIGH = 0.1
UPDATE_RATIO_LOW = 1e-7
