"""torch-fidelity's InceptionV3 (2048-d pool features) from a LOCAL weights file, for FID-style metrics.

Nothing is downloaded: pass `pt_inception-2015-12-05` (torch-fidelity's file) by path. Shapes: B images, D = 2048.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from trainlab.errors import UsageError, missing_file
from trainlab.user_files import check_state_dict, load_user_file, refuse_hollow_tensors

log = logging.getLogger(__name__)


def load_inception(path: Path, features: Sequence[str] = ("2048",)) -> nn.Module:
    """torch-fidelity's FeatureExtractorInceptionV3 ("inception-v3-compat") returning `features` (feature layer
    names and/or "logits_unbiased"; default the 2048-d pool features) with local weights.

    Raises:
        UsageError: missing file, torch-fidelity not installed, not a plain state_dict, or weights that do not fit.
    """
    if not path.is_file():
        raise UsageError(f"--inception-weights {path} {missing_file(path)}: pass a local pt_inception-2015-12-05 file")
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError:
        raise UsageError(
            "--inception-weights needs torch-fidelity: pip install 'trainlab[rfid]' (or drop the flag)"
        ) from None
    fix = "pass a local pt_inception-2015-12-05 file"
    state = load_user_file(path, "--inception-weights", fix=fix)  # read as data, never as code
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"--inception-weights {path} is not a plain state_dict of tensors; {fix}")
    refuse_hollow_tensors(state, f"--inception-weights {path}", fix)
    # torch-fidelity reads the weights from a path with weights_only=False: hand it our own copy of the tensors just
    # checked, in a folder of ours, never the user's file again (which could be swapped between the two reads)
    with tempfile.TemporaryDirectory(prefix="trainlab-inception-") as folder:
        checked = Path(folder) / "weights.pth"
        torch.save({k: v.contiguous() for k, v in state.items()}, checked)
        try:
            extractor = FeatureExtractorInceptionV3(
                "inception-v3-compat", list(features), feature_extractor_weights_path=str(checked)
            )
        except RuntimeError as err:
            first = str(err).splitlines()[0][:160]
            raise UsageError(
                f"--inception-weights {path} does not fit torch-fidelity's InceptionV3 ({first}); {fix}"
            ) from None
    check_state_dict(state, extractor.state_dict(), source=f"--inception-weights {path}")
    log.info("torch-fidelity InceptionV3 (%s) from %s", ", ".join(features), path)
    module: nn.Module = extractor
    return module


def to_uint8(img_B3HW: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] to uint8 [0, 255] (what the Inception extractor takes)."""
    return ((img_B3HW.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def inception_features(inception: nn.Module, img_B3HW: torch.Tensor) -> torch.Tensor:
    """2048-d pool features (B, D) of images in [-1, 1], float64 on the CPU (autocast off)."""
    with torch.autocast(device_type=img_B3HW.device.type, enabled=False):
        (feats_BD,) = inception(to_uint8(img_B3HW))
    return feats_BD.double().cpu()
