"""How long a run is, in optimizer steps: the one definition the Trainer, the memory planner and `trainlab runs` use.

    total_steps = epochs x steps_per_epoch     the schedule's horizon (learning rate, and what recipes read from
                                               `StepInfo.total_steps`: momentum or progressive schedules)
    stop_step   = min(total_steps, max_steps)  where training stops (`--max-steps`; -1: at total_steps)

`--max-steps` only stops early: the schedule is that of the whole run, so a run stopped by it and resumed without it
continues the same curve. No torch here: `trainlab runs` reads it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLength:
    """A run's length (see the module docstring).

    Attributes:
        steps_per_epoch: optimizer steps in one epoch.
        epochs: epochs of the run (`--epochs`).
        total_steps: the schedule's horizon, epochs x steps_per_epoch (`--max-steps` does not shorten it).
        stop_step: the optimizer step at which training stops: total_steps, or `--max-steps` when that is smaller.
    """

    steps_per_epoch: int
    epochs: int
    total_steps: int
    stop_step: int

    def reached_end(self, step: int) -> bool:
        """Whether `step` optimizer steps complete the run (all epochs, or `--max-steps`)."""
        return step >= self.stop_step


def run_length(steps_per_epoch: int, *, epochs: int, max_steps: int) -> RunLength:
    """The length of a run of `epochs` epochs of `steps_per_epoch` optimizer steps, stopped at `max_steps` (> 0)."""
    total = steps_per_epoch * epochs
    stop = min(total, max_steps) if max_steps > 0 else total
    return RunLength(steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=total, stop_step=stop)
