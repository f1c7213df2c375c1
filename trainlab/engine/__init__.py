"""The shared training engine: precision, accumulation, DDP, checkpoints, logging, signals. Never names a recipe."""
