"""Metrics for generated and reconstructed images.

- `digit_classifier`: `DigitJudge`, a small CNN trained only on real digits; its accuracy on samples tells whether a
  class-conditional generator draws the class it was asked for, and its penultimate features feed FID.
- `fid`: Fréchet distance between two sets of feature vectors.
- `psnr`: peak signal-to-noise ratio for images in [-1, 1].
"""
