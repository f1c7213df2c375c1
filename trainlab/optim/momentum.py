"""The momentum-encoder coefficient schedule of MoCo v3 (facebookresearch/moco-v3 main_moco.py
`adjust_moco_momentum`; BYOL's schedule): m rises from m0 to 1 along a half cosine over the run's iterations.

The update it feeds, theta_k <- m theta_k + (1 - m) theta_q, is the model's own (`MoCo.update_momentum_encoder`);
the recipe applies it once per optimizer step.
"""

from __future__ import annotations

import math


def cosine_momentum(step: int, total_steps: int, base_momentum: float) -> float:
    """m at iteration `step` of `total_steps`: 1 - (1 + cos(pi * step / total)) / 2 * (1 - m0), from m0 to 1."""
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * step / max(total_steps, 1))) * (1.0 - base_momentum)
