"""`trainlab sample` refuses before sampling: a CUDA device that is not there, an output it cannot write, and a
--tokenizer-weights other than the tokenizer a trainlab VAR checkpoint was trained with (one line each, exit code 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainlab.cli import main as cli_main
from trainlab.commands.sample import main
from trainlab.data.token_cache import tokenizer_sha256
from trainlab.errors import UsageError
from trainlab.models.var.convert import export_official, load_official, load_tokenizer
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig


def _vqvae(seed: int) -> VQVAE:
    torch.manual_seed(seed)
    return VQVAE(VQVAEConfig.debug()).freeze()


@pytest.fixture(scope="module")
def var_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A VAR run checkpoint in trainlab's format (as `trainlab train var` writes it), its tokenizer and another."""
    root = tmp_path_factory.mktemp("var_run")
    torch.manual_seed(0)
    var = VAR(VARConfig.debug()).eval()
    trained_with, other = _vqvae(1), _vqvae(2)
    vae_path = export_official(trained_with, root / "tokenizer.pth")
    other_path = export_official(other, root / "other_tokenizer.safetensors")
    (root / "ckpt").mkdir()
    ckpt = root / "ckpt" / "last.pt"
    torch.save(
        {
            "format": "trainlab-checkpoint",
            "version": 1,
            "recipe": "var",
            "models": {"var": var.state_dict()},
            "step": 4,
            "recipe_state": {"tokenizer_sha256": tokenizer_sha256(trained_with)},
        },
        ckpt,
    )
    return {"ckpt": ckpt, "vae": vae_path, "other": other_path, "var_export": export_official(var, root / "v.pth")}


def test_a_mismatched_tokenizer_is_refused_naming_both(var_run: dict[str, Any], tmp_path: Path) -> None:
    base = ["--var-weights", str(var_run["ckpt"]), "--classes", "1", "--device", "cpu"]
    base += ["--out", str(tmp_path / "g.png")]
    with pytest.raises(UsageError) as info:
        main([*base, "--tokenizer-weights", str(var_run["other"])])
    message = str(info.value)
    assert str(var_run["ckpt"]) in message and str(var_run["other"]) in message and "\n" not in message
    expected = tokenizer_sha256(_vqvae(1))[:12]
    found = tokenizer_sha256(_vqvae(2))[:12]
    assert f"trained with tokenizer sha256 {expected}" in message and f"has sha256 {found}" in message
    assert not (tmp_path / "g.png").exists()
    assert main([*base, "--tokenizer-weights", str(var_run["vae"])]) == 0  # the tokenizer the run used
    assert (tmp_path / "g.png").is_file()
    # official weights and exports record no tokenizer: nothing to check
    export = ["--var-weights", str(var_run["var_export"]), "--tokenizer-weights", str(var_run["other"])]
    assert main([*export, "--classes", "1", "--device", "cpu", "--out", str(tmp_path / "h.png")]) == 0


def test_sample_hashes_the_tokenizer_as_the_var_recipe_does(var_run: dict[str, Any]) -> None:
    """The recipe hashes the tokenizer it loads with `load_tokenizer`; `trainlab sample` the one `load_official`
    builds from --vae: the same weights must give the same SHA-256."""
    trained = load_tokenizer(str(var_run["vae"]), "auto", VARConfig.debug().patch_nums)
    sampled, _ = load_official(var_run["vae"], var_run["var_export"])
    assert tokenizer_sha256(trained) == tokenizer_sha256(sampled) == tokenizer_sha256(_vqvae(1))


def test_cuda_without_cuda_is_one_line(
    var_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    argv = ["sample", "--tokenizer-weights", str(var_run["vae"]), "--var-weights", str(var_run["ckpt"])]
    argv += ["--classes", "1", "--out", str(tmp_path / "g.png"), "--device", "cuda"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err == "trainlab sample: error: --device cuda: CUDA is not available here; use --device cpu (or auto)\n"


@pytest.mark.parametrize(
    ("flag", "where", "message"),
    [
        ("--out", "a_file/grid.png", "is not a directory"),
        ("--out-dir", "a_file/samples", "is not a directory"),
        ("--out-dir", "a_file", "is a file"),
        ("--save-tokens", "/proc/trainlab-test/tokens.pt", "cannot be written"),
        ("--out", "/proc/trainlab-test/grid.png", "cannot be written"),
    ],
)  # fmt: skip
def test_unwritable_outputs_fail_before_sampling(
    var_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, where: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("a_file").write_text("x")
    import trainlab.models.var.convert as loading

    monkeypatch.setattr(loading, "load_official", lambda *a: pytest.fail("loaded weights before checking outputs"))
    argv = ["--tokenizer-weights", str(var_run["vae"]), "--var-weights", str(var_run["ckpt"]), "--classes", "1"]
    argv += ["--device", "cpu"]
    with pytest.raises(UsageError, match=message) as info:
        main([*argv, flag, where])
    assert flag in str(info.value) and "\n" not in str(info.value)
