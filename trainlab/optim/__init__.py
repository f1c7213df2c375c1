"""Optimizer helpers shared by recipes: parameter groups and no-weight-decay rules."""
