"""Metrics for learned features and for generated and reconstructed images.

- `features`: the one `extract_features` (a feature map over a set of images, in batches).
- `knn`: weighted kNN accuracy of frozen features.
- `frechet`: Fréchet distance between two sets of feature vectors (FID on any features).
- `fidelity`, `inception`: FID, Inception Score and precision/recall through torch-fidelity's Inception.
- `judge_accuracy`: the digit judge's predictions and accuracy on labelled images.
- `image_sets`, `psnr`: labelled image folders / .npz sets; peak signal-to-noise ratio for images in [-1, 1].
"""
