"""trainlab: reproduce vision papers' training on rented GPUs without losing a week to plumbing."""

__version__ = "0.1.0"
