"""Former name of `trainlab.models.var.convert` (official VAR / VQVAE checkpoints in and out), kept for one release.

`from trainlab.models.var.loading import load_official` keeps working with a DeprecationWarning; import from
`trainlab.models.var.convert` instead.
"""

from __future__ import annotations

import warnings

from trainlab.models.var.convert import (
    VAR_EXPORT_PTH,
    VAR_EXPORT_SAFETENSORS,
    build_var,
    build_vqvae,
    export_official,
    export_var,
    infer_var_config,
    load_official,
    load_official_into_,
    load_tokenizer,
    read_state_dict,
)

warnings.warn(
    "trainlab.models.var.loading is the former name of trainlab.models.var.convert (kept until the next release); "
    "import from trainlab.models.var.convert",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "VAR_EXPORT_PTH",
    "VAR_EXPORT_SAFETENSORS",
    "build_var",
    "build_vqvae",
    "export_official",
    "export_var",
    "infer_var_config",
    "load_official",
    "load_official_into_",
    "load_tokenizer",
    "read_state_dict",
]
