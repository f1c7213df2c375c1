"""Metrics for generated and reconstructed images.

- `fid`: Fréchet distance between two sets of feature vectors.
- `psnr`: peak signal-to-noise ratio for images in [-1, 1].
"""
