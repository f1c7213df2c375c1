"""Load and export the official VAR checkpoints: `vae_ch160v4096z32.pth` + `var_d16.pth` ... `var_d36.pth`.

The released files are plain state_dicts (name -> tensor, buffers included, no prefix). `load_official` reads them
with `weights_only=True`, infers both architectures from the key shapes and loads with strict key matching;
`export_official` writes a model back in the same format (.pth / .pt via `torch.save`, or .safetensors).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainlab.errors import UsageError
from trainlab.models.names import FORMER_VQVAE_NAMES, VQVAE_NAMES
from trainlab.models.var.transformer import VAR, VARConfig
from trainlab.models.var.vqvae import VQVAE, infer_vqvae_config, vqvae_config
from trainlab.user_files import check_state_dict, load_user_file, refuse_hollow_tensors, weights_needed

log = logging.getLogger(__name__)

Unwrap = Callable[[Any, Path], Any]
"""A caller's unwrapping of a container this module does not know (a training run's checkpoint): (the loaded file,
its path) -> the object inside it to read as weights, or the loaded file unchanged."""

# Shape legend: L tokens (all scales), C width, K number of scales.

_VAR_KEYS = ("pos_1LC", "class_emb.weight", "word_embed.weight", "head.weight", "blocks.0.attn.mat_qkv.weight")
_VQVAE_KEYS = ("encoder.conv_in.weight", "decoder.conv_out.weight", "quantize.embedding.weight")
_SUFFIXES = (".pth", ".pt", ".safetensors")
VAR_EXPORT_PTH = "var_export.pth"  # what `trainlab train var` writes into its run directory
VAR_EXPORT_SAFETENSORS = "var_export.safetensors"
_OFFICIAL_FILES = "huggingface.co/FoundationVision/var"

# The tensors the architecture is inferred from, with the rank each must have (key pattern -> rank): checked before
# any shape is unpacked, so a malformed file is one line, not an unpacking error inside the inference.
_VAR_INFERENCE_RANKS = {
    r"word_embed\.weight": 2,
    r"class_emb\.weight": 2,
    r"head\.weight": 2,
    r"lvl_1L": 2,
    r"blocks\.\d+\.attn\.scale_mul_1H11": 4,
    r"blocks\.\d+\.ffn\.fc1\.weight": 2,
}
_VQVAE_INFERENCE_RANKS = {
    r"encoder\.conv_in\.weight": 4,
    r"encoder\.down\.\d+\.block\.\d+\.conv1\.weight": 4,
    r"quantize\.embedding\.weight": 2,
    r"quantize\.ema_vocab_hit_SV": 2,
    r"quantize\.quant_resi\.qresi_ls\.\d+\.weight": 4,
}
NEG_INF_BUFFERS = ("attn_bias_for_masking",)  # VAR's block-causal mask: -inf by design, constant per patch_nums


def _check_inference_keys(state_dict: Mapping[str, Any], ranks: Mapping[str, int], source: str) -> None:
    """Refuse a tensor the architecture is inferred from when its rank is not the model's or a side is 0."""
    for key, value in state_dict.items():
        rank = next((r for pattern, r in ranks.items() if re.fullmatch(pattern, key)), None)
        if rank is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"{source}: {key} holds a {type(value).__name__}, not a tensor; pass a weights file")
        if value.ndim != rank or 0 in value.shape:
            shape = tuple(int(side) for side in value.shape)
            raise UsageError(
                f"{source}: {key} has shape {shape} where the model keeps a {rank}-d tensor with no empty side: a "
                "damaged or foreign file; pass the original weights"
            )


def read_state_dict(
    path: str | os.PathLike[str], what: str, *, unwrap: Unwrap | None = None
) -> dict[str, torch.Tensor]:
    """Read a flat name -> tensor mapping from .pth/.pt (`weights_only=True`) or .safetensors, on CPU.

    An official training checkpoint (`ar-ckpt-*.pth`: {'trainer': {'var_wo_ddp', 'vae_local', ...}}) is unwrapped to
    the model of the kind named by `what` ("VAR" or "VQVAE"); other containers by the caller's `unwrap` (a trainlab
    run's `ckpt/last.pt`: `trainlab.engine.checkpoint.weights_in_checkpoint`).

    Raises:
        UsageError: missing, unreadable, or not a state_dict.
    """
    path = Path(path)
    if path.suffix not in _SUFFIXES and path.is_file():
        raise UsageError(f"{what} checkpoint {path} must end in .pth, .pt or .safetensors")
    obj = load_user_file(
        path, f"{what} checkpoint", fix=f"pass a complete weights file (official files: {_OFFICIAL_FILES})"
    )
    if unwrap is not None:
        obj = unwrap(obj, path)
    if isinstance(obj, Mapping) and isinstance(obj.get("trainer"), Mapping):
        obj = obj["trainer"].get("var_wo_ddp" if what == "VAR" else "vae_local", obj)
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"{path} is not a plain state_dict (name -> tensor); pass an official {what} weights file")
    refuse_hollow_tensors(obj, f"{what} checkpoint {path}", "pass the original weights")
    return dict(obj)


def _check_kind(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike[str], what: str) -> None:
    is_var = all(k in state_dict for k in _VAR_KEYS)
    is_vqvae = all(k in state_dict for k in _VQVAE_KEYS)
    if what == "VAR" and not is_var:
        hint = "it is a VQVAE checkpoint: pass it as --tokenizer-weights" if is_vqvae else "its keys are not a VAR's"
        raise UsageError(f"{path} is not a VAR checkpoint ({hint}); --var-weights expects var_d16.pth ... var_d36.pth")
    if what == "VQVAE" and not is_vqvae:
        hint = "it is a VAR checkpoint: pass it as --var-weights" if is_var else "its keys are not those of a VQVAE"
        raise UsageError(
            f"{path} is not a VQVAE checkpoint ({hint}); --tokenizer-weights expects vae_ch160v4096z32.pth"
        )


def infer_var_config(
    state_dict: Mapping[str, torch.Tensor], patch_nums: Sequence[int] | None = None, *, source: str = "the state_dict"
) -> VARConfig:
    """Infer the VAR architecture from an official-format state_dict.

    depth, width, heads, MLP ratio, shared AdaLN, cosine attention, classes, vocab and code width come from the
    shapes; patch_nums from `lvl_1L` (scale index per position: scale si has pn^2 positions), e.g. L=680 is the
    256 px set and L=2240 the 512 px set.

    Raises:
        UsageError: not a VAR state_dict, or shapes that match no VAR configuration.
    """
    _check_kind(state_dict, source, "VAR")
    _check_inference_keys(state_dict, _VAR_INFERENCE_RANKS, source)
    depth = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k)))
    C, Cv = (int(s) for s in state_dict["word_embed.weight"].shape)
    scale_key = "blocks.0.attn.scale_mul_1H11"
    attn_l2_norm = scale_key in state_dict
    num_heads = int(state_dict[scale_key].shape[1]) if attn_l2_norm else max(C // 64, 1)
    fc1 = state_dict.get("blocks.0.ffn.fc1.weight")
    mlp_ratio = fc1.shape[0] / C if fc1 is not None else 4.0
    lvl_1L = state_dict.get("lvl_1L")
    if patch_nums is None:
        if lvl_1L is None or lvl_1L.ndim != 2 or lvl_1L.is_floating_point():
            raise UsageError(f"cannot infer patch_nums ({source} has no int lvl_1L buffer); pass patch_nums")
        counts = Counter(int(v) for v in lvl_1L.flatten().tolist())
        sides = [math.isqrt(counts.get(si, 0)) for si in range(len(counts))]
        if any(s * s != counts.get(si, -1) or s == 0 for si, s in enumerate(sides)):
            raise UsageError(f"{source}: lvl_1L does not describe square token maps ({dict(counts)})")
        patch_nums = sides
    try:
        cfg = VARConfig(
            depth=depth,
            embed_dim=C,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            shared_adaln="shared_ada_lin.1.weight" in state_dict,
            attn_l2_norm=attn_l2_norm,
            num_classes=int(state_dict["class_emb.weight"].shape[0]) - 1,
            patch_nums=tuple(patch_nums),
            vocab_size=int(state_dict["head.weight"].shape[0]),
            vae_embed_dim=Cv,
        )
    except UsageError as err:
        raise UsageError(f"{source}: its shapes match no known configuration: {err}") from None
    return cfg


def build_var(
    state_dict: Mapping[str, torch.Tensor],
    patch_nums: Sequence[int] | None = None,
    *,
    skip_init: bool | None = None,
    source: str = "the VAR checkpoint",
) -> VAR:
    """Build a VAR whose architecture is inferred from `state_dict` and load it strictly (floating tensors cast to
    float32). Returned in training mode, like any new module.

    Args:
        state_dict: an official-format VAR state_dict.
        patch_nums: token-map sides; inferred from `lvl_1L` when omitted.
        skip_init: build on the meta device and adopt the checkpoint tensors, so no random init is computed (worth
            it for real sizes: initialising d16 on a CPU takes seconds; the meta path costs a one-off import of
            torch._dynamo instead). None: only above 50 M checkpoint elements.
        source: the file, as error messages name it.

    Raises:
        UsageError: keys, shapes, dtypes or values (NaN / inf) that do not fit the inferred architecture.
    """
    cfg = infer_var_config(state_dict, patch_nums, source=source)
    if skip_init is None:
        skip_init = sum(v.numel() for v in state_dict.values()) > 50_000_000
    with torch.device("meta") if skip_init else contextlib.nullcontext():
        model = VAR(cfg)
    check_state_dict(state_dict, model.state_dict(), source=source, neg_inf_ok=NEG_INF_BUFFERS)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    return model


def _vqvae_expected(model: VQVAE, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The VQVAE's state dict as a file for it may hold it: `VQVAE.load_state_dict` keeps its own
    `quantize.ema_vocab_hit_SV` when the file's has another number of scales (rows) of the same vocabulary (the
    official behaviour: a tokenizer serves several patch_nums sets), so that buffer is expected at the file's
    shape."""
    expected = dict(model.state_dict())
    key, own = "quantize.ema_vocab_hit_SV", model.quantize.ema_vocab_hit_SV
    theirs = state_dict.get(key)
    if isinstance(theirs, torch.Tensor) and theirs.ndim == 2 and theirs.shape[1:] == own.shape[1:]:
        expected[key] = torch.empty(theirs.shape, dtype=own.dtype, device="meta")
    return expected


def build_vqvae(state_dict: Mapping[str, torch.Tensor], patch_nums: Sequence[int], *, source: str) -> VQVAE:
    """Build a VQVAE whose architecture is inferred from `state_dict` and load it strictly (in training mode).

    Raises:
        UsageError: keys, shapes, dtypes or values (NaN / inf) that do not fit the inferred architecture.
    """
    _check_inference_keys(state_dict, _VQVAE_INFERENCE_RANKS, source)
    model = VQVAE(infer_vqvae_config(state_dict, patch_nums))
    check_state_dict(state_dict, _vqvae_expected(model, state_dict), source=source)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}, strict=True)
    return model


def load_official(
    vae_path: str | os.PathLike[str],
    var_path: str | os.PathLike[str],
    *,
    patch_nums: Sequence[int] | None = None,
    unwrap_vae: Unwrap | None = None,
    unwrap_var: Unwrap | None = None,
) -> tuple[VQVAE, VAR]:
    """Load an official tokenizer + transformer pair (both on CPU, float32, eval mode; the VQVAE frozen).

    Args:
        vae_path: `vae_ch160v4096z32.pth` (or an export of ours), .pth/.pt/.safetensors.
        var_path: `var_d16.pth` ... `var_d36.pth`, .pth/.pt/.safetensors.
        patch_nums: token-map sides; inferred from the VAR checkpoint when omitted.
        unwrap_vae, unwrap_var: the caller's unwrapping of containers of the two files (see `read_state_dict`).

    Raises:
        UsageError: missing/unreadable files, a checkpoint of the wrong kind, shapes that match no configuration, or
            a tokenizer that does not fit the transformer.
    """
    var_sd = read_state_dict(var_path, "VAR", unwrap=unwrap_var)
    vae_sd = read_state_dict(vae_path, "VQVAE", unwrap=unwrap_vae)
    _check_kind(var_sd, var_path, "VAR")
    _check_kind(vae_sd, vae_path, "VQVAE")
    var = build_var(var_sd, patch_nums, source=f"VAR checkpoint {var_path}")
    _check_inference_keys(vae_sd, _VQVAE_INFERENCE_RANKS, f"VQVAE checkpoint {vae_path}")
    vae_cfg = infer_vqvae_config(vae_sd, var.patch_nums)
    if (vae_cfg.vocab_size, vae_cfg.z_channels) != (var.vocab_size, var.cfg.vae_embed_dim):
        raise UsageError(
            f"VQVAE {vae_path} (V={vae_cfg.vocab_size}, Cv={vae_cfg.z_channels}) does not fit VAR {var_path} "
            f"(V={var.vocab_size}, Cv={var.cfg.vae_embed_dim}); use the tokenizer the VAR was trained with"
        )
    # not on the meta device: for the 109 M-parameter VQVAE its torch._dynamo import costs more than the init it
    # saves (1.2 s against 0.7 s for build + load, measured on the 2-core CPU)
    vae = build_vqvae(vae_sd, var.patch_nums, source=f"VQVAE checkpoint {vae_path}")
    return vae.freeze(), var.eval()


def export_official(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write `model.state_dict()` in the official format: a plain name -> tensor dict (.pth / .pt via `torch.save`)
    or a .safetensors file. Tensors are written as they are (dtype kept), moved to CPU; the write is atomic, and the
    temp file of an export killed mid-write (`<name>*.tmp` beside it) is removed by the next one.

    Raises:
        UsageError: an unsupported suffix.
    """
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise UsageError(f"export path {path} must end in .pth, .pt or .safetensors")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{glob.escape(path.name)}*.tmp"):  # an export killed mid-write left it
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_tokenizer(
    path: str, model: str, patch_nums: Sequence[int], *, seed: int = 0, unwrap: Unwrap | None = None
) -> VQVAE:
    """The frozen tokenizer: eval mode, requires_grad False, float32 on CPU.

    Args:
        path: weights file; '' only with model "vqvae_debug" (a seeded random tiny VQVAE, for tests and --debug).
        model: "auto" (architecture inferred from the weights) or a VQVAE registry name (`VQVAE_NAMES`:
            "vqvae_official" = vae_ch160v4096z32, "vqvae_digits", "vqvae_debug").
        patch_nums: the token-map sides VAR is trained on.
        seed: seed of the random debug tokenizer.
        unwrap: the caller's unwrapping of a container of the file (see `read_state_dict`).

    Raises:
        UsageError: missing or unreadable file, or weights that do not fit the architecture.
    """
    patch_nums = tuple(int(pn) for pn in patch_nums)
    preset = FORMER_VQVAE_NAMES.get(path, path)
    if preset in VQVAE_NAMES and not Path(path).exists():  # `--tokenizer official`: an architecture, not a file
        path, model = "", preset
    if not weights_needed():  # the planner: shapes only, no weight value is used
        return _tokenizer_for_shapes(path, model, patch_nums, unwrap)
    if not path:
        if model != "vqvae_debug":
            raise UsageError(
                "--tokenizer-weights is required: download vae_ch160v4096z32.pth from "
                "huggingface.co/FoundationVision/var (or export a trainlab tokenizer) and pass its path"
            )
        with torch.random.fork_rng(devices=[]):  # leaves the global RNG (VAR's init) untouched
            torch.manual_seed(seed + 7919)
            tokenizer = VQVAE(vqvae_config("vqvae_debug", patch_nums))
            with torch.no_grad():  # spread-out codes, so that images use many of them
                tokenizer.quantize.embedding.weight.normal_(0.0, 0.5)
        log.warning("tokenizer: a RANDOM debug VQVAE (no --tokenizer-weights given); only for tests and --debug")
        return tokenizer.freeze()
    state = read_state_dict(path, "VQVAE", unwrap=unwrap)
    _check_kind(state, path, "VQVAE")
    source = f"tokenizer weights {path}"
    if model == "auto":
        _check_inference_keys(state, _VQVAE_INFERENCE_RANKS, source)
        vq_cfg = infer_vqvae_config(state, patch_nums)
    else:
        vq_cfg = vqvae_config(model, patch_nums)
    tokenizer = VQVAE(vq_cfg)
    expected = _vqvae_expected(tokenizer, state)
    if set(state) != set(expected) or any(tuple(state[k].shape) != tuple(v.shape) for k, v in expected.items()):
        raise UsageError(
            f"tokenizer weights {path} do not fit --tokenizer-model {model} (other keys or shapes); try "
            "--tokenizer-model auto"
        )
    check_state_dict(state, expected, source=source)  # dtypes and finite values
    tokenizer.load_state_dict(state)
    log.info("tokenizer: %s (%s, V=%d, Cv=%d, ch=%d)", path, model, vq_cfg.vocab_size, vq_cfg.z_channels, vq_cfg.ch)
    return tokenizer.freeze()


def _tokenizer_for_shapes(path: str, model: str, patch_nums: tuple[int, ...], unwrap: Unwrap | None) -> VQVAE:
    """The tokenizer's architecture (from `model`, or from the names and shapes of the file at `path`), its weights
    left at their initialisation: inside `shapes_only()` no value is read."""
    if path:
        state = read_state_dict(path, "VQVAE", unwrap=unwrap)  # memory-mapped: only the header is read
        _check_kind(state, path, "VQVAE")
        vq_cfg = infer_vqvae_config(state, patch_nums) if model == "auto" else vqvae_config(model, patch_nums)
    elif model == "auto":
        raise UsageError(
            "--tokenizer-model auto needs the weights file to infer the architecture; pass --tokenizer-model "
            "vqvae_official (no file needed to plan) or --tokenizer-weights PATH"
        )
    else:
        vq_cfg = vqvae_config(model, patch_nums)
    return VQVAE(vq_cfg).freeze()


def load_official_into_(var: VAR, path: Path, *, unwrap: Unwrap | None = None) -> None:
    """Strictly load official `var_d*.pth` weights into `var` (fine-tuning; one-line UsageError when they do not fit,
    naming the `trainlab train var` flag to change). `unwrap`: see `read_state_dict`."""

    state = read_state_dict(path, "VAR", unwrap=unwrap)
    found = infer_var_config(state, var.cfg.patch_nums, source=f"--init-from {path}")
    for field in ("depth", "embed_dim", "num_heads", "shared_adaln", "num_classes", "vocab_size", "vae_embed_dim"):
        have, want = getattr(found, field), getattr(var.cfg, field)
        if have != want:
            flag = "--" + field.replace("_", "-")
            raise UsageError(f"--init-from {path} has {field}={have} but this run builds {want}; set {flag} {have}")
    try:
        check_state_dict(state, var.state_dict(), source=f"--init-from {path}", neg_inf_ok=NEG_INF_BUFFERS)
    except UsageError as err:
        raise UsageError(f"{err} (check --patch-nums)") from None
    var.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    log.info("initialised VAR from %s (strict load)", path)


def export_var(var: VAR, run_dir: Path) -> tuple[Path, Path]:
    """Write `var_export.pth` and `var_export.safetensors` (official state_dict format, atomic) into `run_dir`.

    Both load with `trainlab.models.var.convert.load_official` / `trainlab sample` and the official code.

    Returns:
        The two paths.
    """
    run_dir = Path(run_dir)
    paths = export_official(var, run_dir / VAR_EXPORT_PTH), export_official(var, run_dir / VAR_EXPORT_SAFETENSORS)
    log.info("exported VAR weights: %s, %s", *paths)
    return paths
