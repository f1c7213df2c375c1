"""MoCo v3 keys gathered across 2 real gloo processes (torchrun): 2 x B/2 gives the loss and the gradients of 1 x B,
and so does 2 processes x 2 accumulated micro-batches of B/4 with the keys of the whole optimizer batch (last test).

What is compared, and why it is well defined: the real `MoCo` module (tv_resnet_debug and moco_vit_debug, projector and
predictor included) with every BatchNorm in eval mode, so each sample's features depend on that sample only (fixed
running statistics) and not on how the batch is split over processes; in train mode each rank normalises by its
own half-batch, and the two settings are different computations (the official code then needs SyncBatchNorm). On
fixed inputs of a global batch B = 8, each of the 2 ranks computes `model(x1[rank half], x2[rank half])` with
`gather_keys = dist.gather_keys` inside DistributedDataParallel; the mean of the two ranks' losses and the
DDP-averaged gradients of every trained parameter must equal the single-process loss and gradients on the whole
batch (keys not gathered). The same ranks without the gather (local keys, offset 0) must give a different loss, so
the test fails if the gather or the rank offset of the labels is lost.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from trainlab.models.moco import MoCo

ARCHS = ("tv_resnet_debug", "moco_vit_debug")
GLOBAL_BATCH = 8
IMAGE = 16

WORKER = """
import sys
import torch
from torch.nn.parallel import DistributedDataParallel
from trainlab import dist
from trainlab.models.moco import MoCo
from trainlab.losses.infonce import local_keys

out_dir = sys.argv[1]
dist.init("cpu")
assert dist.world_size() == 2
rank, half = dist.rank(), {batch} // 2
for arch in {archs!r}:
    torch.manual_seed(0)
    model = MoCo(arch, dim=16, mlp_dim=32, temperature=0.2, image_size={image}).eval()
    x1, x2 = torch.randn(2, {batch}, 3, {image}, {image}).unbind(0)
    x1, x2 = x1[rank * half : (rank + 1) * half], x2[rank * half : (rank + 1) * half]
    with torch.no_grad():
        model.gather_keys = local_keys
        local_loss = model(x1, x2)
    model.gather_keys = dist.gather_keys
    ddp = DistributedDataParallel(model)
    loss = ddp(x1, x2)
    loss.backward()  # DDP averages the gradients over the 2 ranks
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss)
    grads = {{n: p.grad for n, p in model.named_parameters() if p.requires_grad}}
    torch.save(
        {{"loss": loss.detach(), "mean_loss": mean_loss / 2, "local_loss": local_loss, "grads": grads}},
        f"{{out_dir}}/{{arch}}_rank{{rank}}.pt",
    )
del ddp, model  # DDP holds the process group: drop it first, then meet the other rank before tearing down
dist.cleanup(synchronize=True)
"""


def _one_process(arch: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MoCo(arch, dim=16, mlp_dim=32, temperature=0.2, image_size=IMAGE).eval()  # type: ignore[arg-type]
    x1, x2 = torch.randn(2, GLOBAL_BATCH, 3, IMAGE, IMAGE).unbind(0)
    loss = model(x1, x2)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}  # type: ignore[misc]


def test_two_processes_with_gathered_keys_equal_one_process(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(batch=GLOBAL_BATCH, archs=ARCHS, image=IMAGE))
    launched = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    for arch in ARCHS:
        loss_1, grads_1 = _one_process(arch)
        ranks = [torch.load(tmp_path / f"{arch}_rank{r}.pt", weights_only=True) for r in (0, 1)]
        # the rank losses differ (different queries), their mean is the global-batch loss
        assert not torch.equal(ranks[0]["loss"], ranks[1]["loss"])
        torch.testing.assert_close(ranks[0]["mean_loss"], loss_1, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ranks[1]["mean_loss"], loss_1, rtol=1e-6, atol=1e-6)
        # without the gather each rank sees only its own keys: a different (smaller-batch) loss
        local_mean = (ranks[0]["local_loss"] + ranks[1]["local_loss"]) / 2
        assert abs(float(local_mean) - float(loss_1)) > 1e-3, arch
        assert grads_1.keys() == ranks[0]["grads"].keys()
        nonzero = 0
        for name, grad in grads_1.items():
            # split over ranks the sums run in another order: equal to rounding, measured against the tensor's own
            # scale (a small gradient such as the ViT's cls token has no meaningful absolute floor)
            atol = 1e-5 * float(grad.abs().max())
            for rank in ranks:  # DDP leaves the same averaged gradient on both ranks
                torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-5, atol=atol, msg=f"{arch} {name}")
            nonzero += bool(grad.abs().max() > 0)
        assert nonzero > len(grads_1) // 2, (arch, nonzero)  # the comparison is not between zeros


@pytest.mark.parametrize("arch", ARCHS)
def test_eval_mode_loss_does_not_depend_on_the_batch_split(arch: str) -> None:
    """The premise of the test above, in one process: in eval mode the per-sample forward does not depend on which
    samples share the batch (in train mode it does: BatchNorm statistics of the batch)."""
    torch.manual_seed(0)
    model = MoCo(arch, dim=16, mlp_dim=32, temperature=0.2, image_size=IMAGE)  # type: ignore[arg-type]
    x = torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE)
    with torch.no_grad():
        model.eval()
        whole, halves = (
            model.predictor(model.base_encoder(x)),
            [model.predictor(model.base_encoder(h)) for h in x.chunk(2)],
        )
        torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-6)
        model.train()
        whole = model.predictor(model.base_encoder(x))
        halves = [model.predictor(model.base_encoder(h)) for h in x.chunk(2)]
        assert not torch.allclose(torch.cat(halves), whole, atol=1e-3)


WORKER_ACCUMULATION = """
import contextlib
import sys
import torch
from torch.nn.parallel import DistributedDataParallel
from trainlab import dist
from trainlab.models.moco import MoCo
from trainlab.models.moco.batch_keys import local_keys, optimizer_batch_keys

out_dir = sys.argv[1]
dist.init("cpu")
rank, half, micro = dist.rank(), {batch} // 2, {batch} // 4
torch.manual_seed(0)
model = MoCo({arch!r}, dim=16, mlp_dim=32, temperature=0.2, image_size={image}).eval()
x1, x2 = torch.randn(2, {batch}, 3, {image}, {image}).unbind(0)
x1, x2 = x1[rank * half : (rank + 1) * half], x2[rank * half : (rank + 1) * half]
micro_batches = [(x1[i * micro : (i + 1) * micro], x2[i * micro : (i + 1) * micro]) for i in range(2)]
ddp = DistributedDataParallel(model)
out = {{}}
for keys_kind, gather in (("micro-batch", local_keys), ("full-batch", dist.gather_keys)):
    keys = optimizer_batch_keys(model.momentum_encoder, micro_batches, gather)
    step_loss = torch.zeros(())
    for i, (a, b) in enumerate(micro_batches):
        if keys_kind == "micro-batch":  # each micro-batch against its own keys only
            keys = optimizer_batch_keys(model.momentum_encoder, [(a, b)], local_keys)
        with ddp.no_sync() if i == 0 else contextlib.nullcontext():  # as the engine's micro-steps
            loss = ddp(a, b, keys=keys.of_micro_batch(0 if keys_kind == "micro-batch" else i))
            (loss / 2).backward()
        step_loss += loss.detach() / 2
    torch.distributed.all_reduce(step_loss)
    out[keys_kind] = {{"loss": step_loss / 2, "grads": {{n: p.grad.clone() for n, p in model.named_parameters()
                                                      if p.requires_grad}}}}
    model.zero_grad(set_to_none=True)
torch.save(out, f"{{out_dir}}/accumulation_rank{{rank}}.pt")
del ddp, model
dist.cleanup(synchronize=True)
"""


def test_two_processes_times_accumulation_two_with_full_batch_keys_equal_one_batch(
    tmp_path: Path, python: str, run_env: dict[str, str]
) -> None:
    """2 processes x 2 micro-batches of B/4 (eval-mode BatchNorm), keys of the whole optimizer batch gathered once
    (`--moco-keys full-batch`): the loss and the DDP-averaged gradients of one batch B. With micro-batch keys (each
    micro-batch against its own B/4 keys, no gather) the loss differs: the control."""
    batch = 16
    script = tmp_path / "worker.py"
    script.write_text(WORKER_ACCUMULATION.format(batch=batch, image=IMAGE, arch=ARCHS[0]))
    launched = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    torch.manual_seed(0)
    model = MoCo(ARCHS[0], dim=16, mlp_dim=32, temperature=0.2, image_size=IMAGE).eval()  # type: ignore[arg-type]
    x1, x2 = torch.randn(2, batch, 3, IMAGE, IMAGE).unbind(0)
    loss = model(x1, x2)
    loss.backward()
    loss_1 = loss.detach()
    grads_1 = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ranks = [torch.load(tmp_path / f"accumulation_rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank in ranks:
        full = rank["full-batch"]
        assert abs(float(full["loss"]) - float(loss_1)) <= 1e-6 * abs(float(loss_1))
        assert abs(float(rank["micro-batch"]["loss"]) - float(loss_1)) > 1e-2  # 3 negatives per query, not 15
        nonzero = 0
        for name, grad in grads_1.items():
            if grad is None or grad.norm() == 0:  # behind a zero-initialised residual BatchNorm weight
                continue
            nonzero += 1
            rel = (full["grads"][name] - grad).norm() / grad.norm()
            assert rel <= 1e-6, (name, float(rel))
        assert nonzero > len(grads_1) // 2
