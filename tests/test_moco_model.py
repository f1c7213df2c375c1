"""MoCo v3 model parity: the loss against its closed form, the exact momentum update, the official forward, and
official checkpoints through load_official / export_official (bytes identical), plus the bad-input messages."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch

from trainlab.errors import UsageError
from trainlab.losses.infonce import infonce_loss
from trainlab.models.moco import MoCo, export_official, infer_arch, load_official

# Shape legend: B batch, D width, M keys.


def _official_forward(model: MoCo, x1: torch.Tensor, x2: torch.Tensor, m: float) -> torch.Tensor:
    """facebookresearch/moco-v3 moco/builder.py MoCo.forward + contrastive_loss, world size 1, written out."""

    def ctr(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(k, dim=1)
        logits = torch.einsum("nc,mc->nm", [q, k]) / model.temperature
        labels = torch.arange(logits.shape[0], dtype=torch.long) + logits.shape[0] * 0
        return torch.nn.CrossEntropyLoss()(logits, labels) * (2 * model.temperature)

    q1 = model.predictor(model.base_encoder(x1))
    q2 = model.predictor(model.base_encoder(x2))
    with torch.no_grad():
        for param_b, param_m in zip(model.base_encoder.parameters(), model.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1.0 - m)
        k1 = model.momentum_encoder(x1)
        k2 = model.momentum_encoder(x2)
    return ctr(q1, k2) + ctr(q2, k1)


def _debug(arch: str, seed: int = 0) -> MoCo:
    torch.manual_seed(seed)
    return MoCo(arch, dim=16, mlp_dim=32, temperature=0.2, image_size=16)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.2, 1.0])
def test_loss_closed_form_orthonormal(temperature: float) -> None:
    batch = 5
    q_BD = torch.eye(batch, 8) * 3.0  # normalisation removes the scale
    # q == k, orthonormal: logits are 1/T on the diagonal, 0 elsewhere
    expected = -math.log(math.exp(1 / temperature) / (math.exp(1 / temperature) + batch - 1)) * 2 * temperature
    assert infonce_loss(q_BD, q_BD.clone(), temperature) == pytest.approx(expected, rel=1e-6)


def test_loss_equals_manual_sum_and_offset() -> None:
    g = torch.Generator().manual_seed(0)
    q_BD, k_MD = torch.randn(4, 6, generator=g), torch.randn(12, 6, generator=g)
    temperature, offset = 0.5, 4
    manual = 0.0
    qn, kn = q_BD / q_BD.norm(dim=1, keepdim=True), k_MD / k_MD.norm(dim=1, keepdim=True)
    for i in range(4):
        logits = [float(qn[i] @ kn[j]) / temperature for j in range(12)]
        manual += -(logits[i + offset] - math.log(sum(math.exp(v) for v in logits))) / 4
    got = infonce_loss(q_BD, k_MD[offset : offset + 4], temperature, gather_keys=lambda k: (kn, offset))
    assert torch.allclose(kn[offset : offset + 4], torch.nn.functional.normalize(k_MD[offset : offset + 4], dim=1))
    assert float(got) == pytest.approx(manual * 2 * temperature, rel=1e-5)


@pytest.mark.parametrize("arch", ["tv_resnet_debug", "moco_vit_debug"])
def test_momentum_update_exact_parameters_only(arch: str) -> None:
    model = _debug(arch)
    with torch.no_grad():
        for p in model.base_encoder.parameters():
            p.add_(torch.randn_like(p))
        for b in model.momentum_encoder.buffers():
            if b.is_floating_point():
                b.add_(1.0)
    before_k = {n: p.clone() for n, p in model.momentum_encoder.named_parameters()}
    buffers_k = {n: b.clone() for n, b in model.momentum_encoder.named_buffers()}
    q = dict(model.base_encoder.named_parameters())
    model.update_momentum_encoder(0.9)
    for name, p in model.momentum_encoder.named_parameters():
        assert torch.equal(p, before_k[name] * 0.9 + q[name] * (1.0 - 0.9)), name
        assert not p.requires_grad
    frozen = [n for n, p in model.base_encoder.named_parameters() if not p.requires_grad]
    if arch == "moco_vit_debug":
        assert "pos_embed" in frozen  # the fixed table is averaged too (it stays equal: same on both sides)
    for name, b in model.momentum_encoder.named_buffers():
        assert torch.equal(b, buffers_k[name]), name


@pytest.mark.parametrize("arch", ["tv_resnet_debug", "moco_vit_debug"])
def test_forward_with_momentum_equals_official(arch: str) -> None:
    model = _debug(arch)
    with torch.no_grad():
        for p in model.base_encoder.parameters():
            p.add_(0.01 * torch.randn_like(p))
    reference = copy.deepcopy(model)
    x1, x2 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)
    ours = model(x1, x2, 0.99)
    theirs = _official_forward(reference, x1, x2, 0.99)
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name  # momentum encoder and its BN statistics moved the same way
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


def test_stop_grad_conv1_and_sincos() -> None:
    torch.manual_seed(0)
    model = MoCo("moco_vit_debug", dim=16, mlp_dim=32, image_size=16, stop_grad_conv1=True)
    proj = model.base_encoder.patch_embed.proj
    assert not proj.weight.requires_grad and not proj.bias.requires_grad
    pos = model.base_encoder.pos_embed
    assert not pos.requires_grad and torch.equal(pos[0, 0], torch.zeros(32))
    # token (row 1 + i*4 + j) at grid (w=i, h=j) of the official meshgrid: sin(w * omega_0) is its first entry
    assert float(pos[0, 1 + 2 * 4 + 1, 0]) == pytest.approx(math.sin(2.0))
    assert float(pos[0, 1 + 2 * 4 + 1, 16]) == pytest.approx(math.sin(1.0))


def _official_file(model: MoCo, path: Path) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16), 0.99).backward()
    optimizer.step()
    state = {"module." + k: v for k, v in model.state_dict().items()}
    torch.save(
        {"epoch": 3, "arch": "vit_small", "state_dict": state, "optimizer": optimizer.state_dict(), "scaler": {}}, path
    )
    return model.state_dict()


def _bytes(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("arch", ["tv_resnet_debug", "moco_vit_debug"])
def test_official_checkpoint_round_trip(arch: str, tmp_path: Path) -> None:
    original = _official_file(_debug(arch), tmp_path / "checkpoint_0002.pth.tar")
    model = load_official(tmp_path / "checkpoint_0002.pth.tar", temperature=0.2)
    assert model.backbone == arch
    exported = export_official(model)
    assert list(exported) == list(original)
    assert next(iter(exported)) == "base_encoder." + next(iter(model.base_encoder.state_dict()))
    assert list(exported)[-1].startswith("predictor.")  # the official module order
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    assert _bytes(exported) == _bytes({k: v.clone() for k, v in original.items()})
    # the loaded model computes the loss of the saved one
    x1, x2 = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    saved = _debug(arch, seed=1)
    saved.load_state_dict(original)
    assert torch.equal(model(x1, x2, 0.99), _official_forward(saved, x1, x2, 0.99))


def test_unknown_architecture_names_what_it_found() -> None:
    state = _debug("moco_vit_debug").state_dict()
    state = {k: v for k, v in state.items() if ".blocks.1." not in k}
    with pytest.raises(UsageError, match=r"unknown ViT \(embedding width 32, 1 blocks, patch 4"):
        infer_arch(state)
    state = {k: v for k, v in _debug("tv_resnet_debug").state_dict().items() if ".layer4." not in k}
    with pytest.raises(
        UsageError, match=r"unknown architecture \(ResNet with 3x3 stem of width 8, stages \[1, 1, 1, 0\]"
    ):
        infer_arch(state)


def test_linear_probe_checkpoint_is_named(tmp_path: Path) -> None:
    state = _debug("tv_resnet_debug").state_dict()
    backbone = {k[len("base_encoder.") :]: v for k, v in state.items() if "base_enc" in k}
    backbone = {k: v for k, v in backbone.items() if not k.startswith("fc.")}
    backbone.update({"fc.weight": torch.zeros(10, 64), "fc.bias": torch.zeros(10)})
    path = tmp_path / "model_best.pth.tar"
    torch.save(
        {
            "epoch": 90,
            "arch": "resnet50",
            "state_dict": {"module." + k: v for k, v in backbone.items()},
            "best_acc1": torch.tensor(71.5),
            "optimizer": {},
        },
        path,
    )
    with pytest.raises(UsageError, match="linear-classification checkpoint"):
        load_official(path, temperature=1.0)
    torch.save({"state_dict": {"module." + k: v for k, v in backbone.items()}}, path)  # without best_acc1
    with pytest.raises(UsageError, match="linear-classification checkpoint"):
        load_official(path, temperature=1.0)


def test_vit_image_size_must_divide_by_patch() -> None:
    with pytest.raises(UsageError, match="does not divide by the patch size 4"):
        MoCo("moco_vit_debug", dim=16, mlp_dim=32, image_size=18)


def test_features_are_backbone_width() -> None:
    assert _debug("tv_resnet_debug").features(torch.randn(2, 3, 16, 16)).shape == (2, 64)
    assert _debug("moco_vit_debug").features(torch.randn(2, 3, 16, 16)).shape == (2, 32)
