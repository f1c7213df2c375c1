"""Optimizer helpers shared by recipes: parameter groups and no-weight-decay rules, LARS, and the momentum-encoder
schedule."""

from trainlab.optim.lars import LARS

__all__ = ["LARS"]
