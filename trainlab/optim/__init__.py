"""Optimizer helpers shared by recipes: parameter groups and no-weight-decay rules."""

from trainlab.optim.lars import LARS

__all__ = ["LARS"]
