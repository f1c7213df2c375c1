"""VAR's progressive training (official `--pg`): train on a growing prefix of the scales, newest scale's loss weight
ramped, as a pure function of the optimizer step (so resumes are exact). See `trainlab.recipes.var`.
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass(frozen=True)
class ProgressiveSchedule:
    """Official progressive training as a pure function of the optimizer step (see the module docstring).

    Attributes:
        num_scales: K.
        start_scale: last scale index of the first stage (official pg0).
        warmup_steps: steps of the lr warm-up (stage one lasts at least this long).
        end_step: step from which all scales are trained (progressive_until x total steps).
        stage_warmup_steps: steps over which a new scale's loss weight ramps from 0.01 to 1 (official prog_wp_it).
    """

    num_scales: int
    start_scale: int
    warmup_steps: int
    end_step: float
    stage_warmup_steps: float

    def scale(self, step: int) -> int:
        """Index of the last trained scale at `step` (official prog_si before its "-1 = all" rewrite)."""
        last = self.num_scales - 1
        if step <= self.warmup_steps:
            return self.start_scale
        if step >= self.end_step:
            return last
        progress = min(max((step - self.warmup_steps) / (self.end_step - self.warmup_steps), 0.0), 1.0)
        return self.start_scale + round(progress * (last - self.start_scale))

    def stage_start(self, step: int) -> int:
        """First step of the stage containing `step` (scale() is non-decreasing, so a bisection finds it)."""
        target = self.scale(step)
        return bisect.bisect_left(range(step + 1), target, key=self.scale)

    def weight(self, step: int) -> float:
        """Loss weight of the newest scale (official prog_wp): 1 in the first stage, else a 0.01 -> 1 ramp."""
        if self.scale(step) == self.scale(0):
            return 1.0
        it = step - self.stage_start(step) + 1
        return max(min(it / max(self.stage_warmup_steps, 1e-8), 1.0), 0.01)
