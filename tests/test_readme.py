"""The README's Python snippets run as written (on tiny weights of the official format), so the documented API
cannot break silently when a module moves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import REPO

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_snippets() -> None:
    assert SNIPPETS


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainlab.models.var.convert import export_official
    from trainlab.models.var.transformer import VAR, VARConfig
    from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

    torch.manual_seed(0)  # tiny stand-ins under the official file names
    export_official(VQVAE(VQVAEConfig.debug()), tmp_path / "vae_ch160v4096z32.pth")
    export_official(VAR(VARConfig(**{**vars(VARConfig.debug()), "num_classes": 1000})), tmp_path / "var_d16.pth")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(SNIPPETS[index], f"README.md python snippet {index}", "exec"), namespace)
    images = namespace.get("images_B3HW")
    if isinstance(images, torch.Tensor):
        assert images.shape[0] == 3 and float(images.min()) >= 0.0 and float(images.max()) <= 1.0
