"""Zero-shot VAR editing: kept tokens are the image's on every scale, the empty / full mask limits are exact, the
KV-cache path agrees with a teacher-forcing forward over the edited tokens, the mask-reduction rule, and
`trainlab edit` end to end on tiny official-format weights, including its one-line errors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from trainlab import cli
from trainlab.models.var.convert import export_official
from trainlab.models.var.edit import edit_images, edit_tokens, encode_tokens, kept_token_maps
from trainlab.models.var.sample import generate, sample_images, sample_tokens
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, VQVAEConfig

# Shape legend: B images, H/W image side (16), h latent side (4), pn side of one scale, L tokens of all scales,
# V vocab.

SAMPLING: dict[str, Any] = dict(cfg=2.0, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def models() -> tuple[VQVAE, VAR]:
    torch.manual_seed(0)
    return VQVAE(VQVAEConfig.debug()).freeze(), VAR(VARConfig.debug()).eval()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _bottom_half(B: int) -> torch.Tensor:
    mask_B1HW = torch.zeros(B, 1, 16, 16, dtype=torch.bool)
    mask_B1HW[:, :, 8:] = True
    return mask_B1HW


# ----------------------------------------------------------------------------------------------- exact limits
@pytest.mark.parametrize("more_smooth", [False, True])
def test_tokens_outside_the_mask_are_the_image_tokens_on_every_scale(
    models: tuple[VQVAE, VAR], images: torch.Tensor, more_smooth: bool
) -> None:
    vqvae, var = models
    result = edit_images(var, vqvae, images, _bottom_half(3), [1, 7, 1000], seed=3, more_smooth=more_smooth, **SAMPLING)
    truth = encode_tokens(vqvae, images)
    assert [int(k.sum()) for k in result.kept] == [0, 3 * 2, 3 * 3, 3 * 8]  # 1x1 never, 2x2 top row, ...
    for keep_Bl, got_Bl, truth_Bl in zip(result.kept, result.tokens, truth):
        assert torch.equal(got_Bl[keep_Bl], truth_Bl[keep_Bl])
    regenerated = torch.cat([(got != ref)[~keep] for keep, got, ref in zip(result.kept, result.tokens, truth)])
    assert regenerated.float().mean() > 0.5  # inside the mask the tokens are sampled, not copied
    assert (
        result.images.shape == (3, 3, 16, 16) and 0.0 <= float(result.images.min()) <= float(result.images.max()) <= 1
    )


@pytest.mark.parametrize("more_smooth", [False, True])
def test_an_empty_mask_gives_exactly_the_image_tokens_and_reconstruction(
    models: tuple[VQVAE, VAR], images: torch.Tensor, more_smooth: bool
) -> None:
    vqvae, var = models
    empty = torch.zeros(1, 1, 16, 16, dtype=torch.bool)  # a batch of one mask applies to every image
    result = edit_images(var, vqvae, images, empty, [0, 4, 1000], seed=9, more_smooth=more_smooth, **SAMPLING)
    truth = encode_tokens(vqvae, images)
    assert all(torch.equal(got, ref) for got, ref in zip(result.tokens, truth))
    assert torch.equal(result.f_hat, vqvae.quantize.idx_to_fhat(truth))  # kept positions use the hard codes
    with torch.inference_mode():  # the decoder's in-place path, as `edit_images` decodes (rounding differs)
        recon_B3HW = vqvae.idx_to_img(truth).add(1).mul(0.5)
    assert torch.equal(result.images, recon_B3HW)


@pytest.mark.parametrize("more_smooth", [False, True])
def test_a_full_mask_is_plain_sampling_with_the_same_seed(
    models: tuple[VQVAE, VAR], images: torch.Tensor, more_smooth: bool
) -> None:
    vqvae, var = models
    full = torch.ones(3, 1, 16, 16, dtype=torch.bool)
    labels = [2, 2, 9]
    result = edit_images(var, vqvae, images, full, labels, seed=5, more_smooth=more_smooth, **SAMPLING)
    plain = generate(var, vqvae, labels, seed=5, more_smooth=more_smooth, **SAMPLING)
    assert all(torch.equal(got, ref) for got, ref in zip(result.tokens, plain.tokens))
    assert torch.equal(result.f_hat, plain.f_hat)
    if not more_smooth:
        assert all(
            torch.equal(a, b) for a, b in zip(result.tokens, sample_tokens(var, vqvae, labels, seed=5, **SAMPLING))
        )
        assert torch.equal(result.images, sample_images(var, vqvae, labels, seed=5, **SAMPLING))


def _teacher_forced_guided_logits(
    var: VAR, vqvae: VQVAE, tokens: list[torch.Tensor], labels_B: list[int]
) -> torch.Tensor:
    """Guided logits (B, L, V) of a teacher-forcing forward over `tokens`: cond and null-class rows, then
    (1 + t) cond - t uncond with t = cfg * si / (K - 1) per scale, as the sampler mixes them."""
    B, K = len(labels_B), len(var.patch_nums)
    labels_2B = torch.tensor([*labels_B, *[var.num_classes] * B])
    x_BLCv = vqvae.quantize.idx_to_var_input(tokens)
    with torch.no_grad():
        logits_2BLV = var(labels_2B, torch.cat([x_BLCv, x_BLCv]))
    parts = []
    for si, (start, end) in enumerate(zip((0, *var.scale_ends[:-1]), var.scale_ends)):
        t = SAMPLING["cfg"] * si / (K - 1)
        parts.append((1 + t) * logits_2BLV[:B, start:end] - t * logits_2BLV[B:, start:end])
    return torch.cat(parts, dim=1)


def test_the_kv_cache_path_equals_teacher_forcing_over_the_edited_tokens(
    models: tuple[VQVAE, VAR], images: torch.Tensor
) -> None:
    vqvae, var = models
    labels = [3, 1000, 6]
    mask_B1HW = _bottom_half(3)
    mask_B1HW[1, :, :, :5] = True  # a different mask per image
    truth = encode_tokens(vqvae, images)
    kept = kept_token_maps(mask_B1HW, var.patch_nums)
    guided: dict[int, torch.Tensor] = {}
    samples = edit_tokens(
        var,
        vqvae,
        truth,
        kept,
        labels,
        seed=11,
        logits_hook=lambda si, x: guided.__setitem__(si, x.clone()),
        **SAMPLING,
    )
    cached_BLV = torch.cat([guided[si] for si in range(len(var.patch_nums))], dim=1)
    forced_BLV = _teacher_forced_guided_logits(var, vqvae, samples.tokens, labels)
    error = float((cached_BLV - forced_BLV).abs().max())
    assert error <= 1e-5  # measured ~4e-8 on logits of size ~2e-2
    # the check can fail: without the overwrite (plain sampling's tokens) the teacher-forced logits differ
    plain = generate(var, vqvae, labels, seed=11, **SAMPLING)
    assert (cached_BLV - _teacher_forced_guided_logits(var, vqvae, plain.tokens, labels)).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------- mask rule
def _grid(kept_Bl: torch.Tensor, pn: int) -> list[list[int]]:
    return kept_Bl.view(pn, pn).int().tolist()


def test_mask_reduction_keeps_a_token_only_if_its_cell_is_entirely_outside_the_mask() -> None:
    patch_nums = (1, 2, 3, 4)
    one_pixel = torch.zeros(1, 1, 16, 16, dtype=torch.bool)
    one_pixel[0, 0, 5, 14] = True  # latent cell (row 1, col 3)
    kept = kept_token_maps(one_pixel, patch_nums)
    assert _grid(kept[0], 1) == [[0]]
    assert _grid(kept[1], 2) == [[1, 0], [1, 1]]
    # 3 cells on 4 latent rows (non-dividing): cell i covers rows [floor(4i/3), ceil(4(i+1)/3)) = [0,2), [1,3), [2,4)
    assert _grid(kept[2], 3) == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert _grid(kept[3], 4) == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    row2 = torch.zeros(1, 1, 16, 16, dtype=torch.bool)
    row2[0, 0, 8:12] = True  # latent row 2 only: the overlap of cells 1 and 2
    assert _grid(kept_token_maps(row2, patch_nums)[2], 3) == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert all(bool(k.all()) for k in kept_token_maps(torch.zeros(2, 1, 16, 16), patch_nums))
    assert not any(bool(k.any()) for k in kept_token_maps(torch.ones(2, 1, 16, 16), patch_nums))
    # a non-dividing pixel grid (18 px on 4 latent cells) uses the same floor/ceil cells: pixels [0,5),[4,9),...
    edge = torch.zeros(1, 1, 18, 18, dtype=torch.bool)
    edge[0, 0, 4, 0] = True  # pixel row 4 lies in latent rows 0 and 1
    assert _grid(kept_token_maps(edge, patch_nums)[3], 4) == [[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]


def test_kept_cells_are_those_the_quantizer_pools_without_masked_features() -> None:
    """Property: on every scale a token is kept iff the tokenizer's area pooling of the latent mask is 0 there."""
    gen = torch.Generator().manual_seed(0)
    patch_nums = (1, 2, 3, 5, 6, 8, 10, 13, 16)  # non-dividing sides of a 16-cell latent
    for _ in range(5):
        latent_B1hw = torch.rand(4, 1, 16, 16, generator=gen) < 0.02
        mask_B1HW = latent_B1hw.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # 64 px, downsample 4
        for pn, kept_Bl in zip(patch_nums, kept_token_maps(mask_B1HW, patch_nums)):
            pooled_Bl = F.interpolate(latent_B1hw.float(), size=(pn, pn), mode="area").reshape(4, pn * pn)
            assert torch.equal(kept_Bl, pooled_Bl == 0), pn


# ----------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def files(tmp_path: Path, models: tuple[VQVAE, VAR]) -> dict[str, Path]:
    vqvae, var = models
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / "in.png")
    mask = np.zeros((20, 24), dtype=np.uint8)
    mask[10:, :] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    Image.fromarray(np.zeros((20, 24), dtype=np.uint8)).save(tmp_path / "black.png")
    Image.fromarray(np.kron(mask[::2, ::2], np.ones((4, 4), dtype=np.uint8))).save(tmp_path / "big_mask.png")
    return {
        "vae": export_official(vqvae, tmp_path / "vae.safetensors"),
        "var": export_official(var, tmp_path / "var.pth"),
        "image": tmp_path / "in.png",
        "mask": tmp_path / "mask.png",
        "black": tmp_path / "black.png",
        "big_mask": tmp_path / "big_mask.png",
        "dir": tmp_path,
    }


def _base(files: dict[str, Path]) -> list[str]:
    weights = ["--tokenizer-weights", str(files["vae"]), "--var-weights", str(files["var"])]
    return ["edit", *weights, "--image", str(files["image"])]


def test_cli_inpaint_grid_tokens_and_seam_log(
    files: dict[str, Path], models: tuple[VQVAE, VAR], caplog: pytest.LogCaptureFixture
) -> None:
    from trainlab.commands.edit import EditConfig, load_inputs
    from trainlab.config import parse

    vqvae, var = models
    out, tokens_path = files["dir"] / "grid.png", files["dir"] / "t.pt"
    argv = [*_base(files), "--mask", str(files["mask"]), "--class", "4", "--num-results", "3", "--seed", "7"]
    argv += ["--guidance", "2", "--top-k", "20", "--top-p", "0.9", "--out", str(out), "--save-tokens", str(tokens_path)]
    with caplog.at_level(logging.INFO):
        assert cli.main([*argv, "--device", "cpu"]) == 0
    assert Image.open(out).size == (2 + 5 * 18, 2 + 18)  # original, mask overlay, 3 results
    assert "seam bleed" in caplog.text and "kept tokens per scale" in caplog.text
    tokens = torch.load(tokens_path, weights_only=True)
    assert [tuple(t.shape) for t in tokens] == [(3, pn, pn) for pn in var.patch_nums]
    # result i is `edit_images` on the preprocessed image with seed + i, alone
    config = parse(EditConfig, argv[1:], prog="trainlab edit")
    img_13HW, mask_11HW = load_inputs(config, 16)
    expected_HW = torch.zeros(16, 16, dtype=torch.bool)
    expected_HW[8:] = True  # rows 10..19 of 20 -> (resize 18, crop 1) rows 8..15: exactly the bottom half
    assert torch.equal(mask_11HW[0, 0], expected_HW)
    for i in range(3):
        expected = edit_images(var, vqvae, img_13HW, mask_11HW, [4], seed=7 + i, **SAMPLING)
        assert all(torch.equal(t[i].flatten(), e[0]) for t, e in zip(tokens, expected.tokens))


@pytest.mark.parametrize(
    "extra",
    [
        ["--box", "0", "0", "12", "10"],
        ["--mode", "outpaint", "--pad", "3"],
        ["--mode", "edit", "--class", "2", "--box", "4", "4", "20", "16", "--more-smooth"],
    ],
)
def test_cli_box_outpaint_and_edit_modes(files: dict[str, Path], extra: list[str]) -> None:
    out = files["dir"] / "grid.png"
    assert cli.main([*_base(files), *extra, "--num-results", "1", "--out", str(out), "--device", "cpu"]) == 0
    assert Image.open(out).size == (2 + 3 * 18, 2 + 18)


def test_cli_outpaint_mask_is_the_new_border(files: dict[str, Path]) -> None:
    from trainlab.commands.edit import EditConfig, load_inputs
    from trainlab.config import parse

    argv = [*_base(files)[1:], "--mode", "outpaint", "--pad", "3", "--out", "g.png"]
    img_13HW, mask_11HW = load_inputs(parse(EditConfig, argv, prog="trainlab edit"), 16)
    assert int(mask_11HW.sum()) == 16 * 16 - 10 * 10 and not bool(mask_11HW[0, 0, 3:13, 3:13].any())
    assert torch.equal(img_13HW[..., :3, 3:13], img_13HW[..., 3:4, 3:13].expand(-1, -1, 3, -1))  # edge repeated


def test_cli_mask_of_another_size_is_resized_with_a_warning(
    files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    out = files["dir"] / "grid.png"
    with caplog.at_level(logging.WARNING):
        assert cli.main([*_base(files), "--mask", str(files["big_mask"]), "--num-results", "1", "--out", str(out)]) == 0
    assert "--mask is 48x40 but the image is 24x20: resizing the mask" in caplog.text


def _other_vae(files: dict[str, Path], **changes: Any) -> Path:
    torch.manual_seed(0)
    vqvae = VQVAE(VQVAEConfig(**{**vars(VQVAEConfig.debug()), **changes}))
    return export_official(vqvae, files["dir"] / f"other_{'_'.join(changes)}.safetensors")


def test_cli_bad_input_is_one_line_and_exit_code_2(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = str(files["dir"] / "g.png")
    base, mask = _base(files), ["--mask", str(files["mask"])]
    vae, var = ["--tokenizer-weights", str(files["vae"])], ["--var-weights", str(files["var"])]
    image = ["--image", str(files["image"])]
    grid = ["--out", out]
    cases = [
        (
            [*base, "--mask", str(files["black"]), "--out", out],
            "all black after resizing and cropping: nothing to edit",
        ),
        ([*base, *mask, "--class", "1000", "--out", out], "--class 1000 is out of range: use 0..999"),
        ([*base, *mask, "--class", "-1", "--out", out], "--class must be >= 0, got -1"),
        ([*base, *mask, "--mode", "edit", "--out", out], "--mode edit regenerates the masked region as a class"),
        ([*base, "--out", out], "nothing marks the region to regenerate"),
        ([*base, *mask, "--box", "0", "0", "4", "4", "--out", out], "either --mask or --box"),
        ([*base, "--box", "0", "0", "30", "4", "--out", out], "is not inside the 24x20 image"),
        ([*base, "--mode", "outpaint", "--pad", "8", "--out", out], "leaves no image"),
        ([*base, "--pad", "2", "--out", out], "use it with --mode outpaint"),
        ([*base, *mask, "--out", str(files["dir"] / "g.jpg")], "--out must be a .png"),
        (["edit", *vae, *var, "--image", str(files["dir"] / "nope.png"), *mask, "--out", out], "nope.png not found"),
        (["edit", *vae, *var, *image, "--mask", str(files["dir"] / "nope.png"), "--out", out], "nope.png not found"),
        (["edit", *vae, "--var-weights", str(files["dir"] / "nope.pth"), *image, *mask, "--out", out], "not found"),
        (["edit", "--tokenizer-weights", str(files["var"]), *var, *image, *mask, "--out", out], "not a VQVAE"),
        (
            ["edit", "--tokenizer-weights", str(_other_vae(files, vocab_size=32)), *var, *image, *mask, "--out", out],
            "does not fit",
        ),
        (
            ["edit", "--tokenizer-weights", str(_other_vae(files, patch_nums=(1, 2, 4))), *var, *image, *mask, *grid],
            "was built for 3 scales but --var",
        ),
        ([*base, *mask, "--top-p", "0", "--out", out], "--top-p must be in (0, 1], got 0"),
    ]
    capsys.readouterr()
    for argv, expected in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("trainlab edit: error: "), err
        assert expected in err[0], (expected, err[0])
