"""MoCo v3 on the engine: equal to the official training loop bit for bit (with and without accumulation, the
momentum update once per optimizer step), bit-exact resume through --debug, the kNN monitor, seeded views."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trainlab.data.transforms import TwoViews, two_views
from trainlab.engine.debug import debug_run_config, run_debug_check
from trainlab.engine.loop import Trainer
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.evaluate.knn import knn_accuracy, knn_predict
from trainlab.models.moco import MoCo
from trainlab.optim import LARS
from trainlab.optim.config import OptimConfig
from trainlab.optim.momentum import cosine_momentum
from trainlab.recipes.moco import MocoConfig, MocoRecipe


def _config(run_dir: Path, **kw: object) -> MocoConfig:
    cfg = debug_run_config(MocoRecipe(MocoConfig()))
    return dataclasses.replace(cfg, run_dir=run_dir, tensorboard=False, progress=False, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_engine_equals_official_loop(tmp_path: Path, accumulation: int) -> None:
    """The official loop (forward(x1, x2, m): queries, momentum update, keys; LARS step) on the engine's batches
    gives the engine's per-step losses and final weights exactly. With accumulation and micro-batch keys the reference
    runs the update once per optimizer step, in the first micro-batch, and averages the micro-batch losses (full-batch
    keys: tests/test_moco_batch_keys.py)."""
    cfg = _config(
        tmp_path / "a",
        epochs=1,
        grad_accumulation=accumulation,
        moco_keys="micro-batch",
        schedule=ScheduleConfig(kind="constant"),
    )
    probe = Trainer(MocoRecipe(cfg))
    model = copy.deepcopy(probe.parts.models["moco"])
    assert isinstance(model, MoCo)
    probe.sampler.set_epoch(0)
    probe.train_dataset.set_epoch(0)  # type: ignore[attr-defined]
    batches = list(probe.loader)
    total = probe.length.total_steps
    optimizer = LARS(
        [p for p in model.parameters() if p.requires_grad],
        cfg.optim.base_learning_rate * cfg.batch_size / 256,  # the official linear scaling, written out
        weight_decay=cfg.optim.weight_decay,
        momentum=cfg.optim.momentum,
    )
    reference: list[float] = []
    updates = 0
    for step in range(total):
        step_loss = torch.zeros(())
        for i, batch in enumerate(batches[step * accumulation : (step + 1) * accumulation]):
            momentum = cosine_momentum(step, total, cfg.momentum) if i == 0 else None
            updates += momentum is not None
            loss = model(batch["view1"], batch["view2"], momentum)
            (loss / accumulation).backward()
            step_loss = step_loss + loss.detach() / accumulation
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.append(float(step_loss))
    assert updates == total

    engine = Trainer(MocoRecipe(dataclasses.replace(cfg, run_dir=tmp_path / "b")))
    engine.fit()
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["kind"] == "train"]
    assert losses == reference
    for (name, a), b in zip(engine.parts.models["moco"].state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert [row for row in rows if row["kind"] == "eval"][-1]["knn_accuracy"] > 0.0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tv_resnet18_cifar", "moco_vit_small"])
def test_debug_resume_is_bit_exact(tmp_path: Path, arch: str) -> None:
    vit = arch.startswith("moco_vit")
    extra = {"optim": OptimConfig(name="adamw", base_learning_rate=0.6), "stop_grad_conv1": True} if vit else {}
    recipe = MocoRecipe(MocoConfig(model=arch, tensorboard=False, progress=False, **extra))  # type: ignore[arg-type]
    report = run_debug_check(MocoRecipe, recipe, tmp_path / "debug")
    assert report.passed and report.max_loss_difference == 0.0 and report.weights_identical


def test_views_are_a_function_of_seed_epoch_index() -> None:
    img = torch.rand(3, 20, 20)
    spec = TwoViews(image_size=16, crop_min=0.2, blur=True)
    a = two_views(img, spec, seed=1, epoch=2, index=3)
    b = two_views(img, spec, seed=1, epoch=2, index=3)
    c = two_views(img, spec, seed=1, epoch=3, index=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])
    assert a[0].shape == (3, 16, 16)


def test_knn_weighted_vote() -> None:
    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    queries = torch.tensor([[1.0, 0.05], [0.1, 1.0]])
    assert knn_predict(queries, bank, labels, num_classes=2, k=2, temperature=0.1).tolist() == [0, 1]
    # k=3: query 2's single class-1 neighbour (sim ~1) outweighs two class-0 neighbours (sims ~0.1, 0.2)
    assert knn_accuracy(queries, torch.tensor([0, 1]), bank, labels, num_classes=2, k=3, temperature=0.1) == 1.0
    with pytest.raises(UsageError, match="k=4 must be between 1 and the bank size 3"):
        knn_predict(queries, bank, labels, num_classes=2, k=4)


def _image_folder(root: Path, splits: dict[str, tuple[str, ...]], per_class: int = 3) -> Path:
    from PIL import Image

    for split, classes in splits.items():
        for c, name in enumerate(classes):
            for i in range(per_class):
                (root / split / name).mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (20, 18), (40 * c, 30 * i, 90)).save(root / split / name / f"{i}.png")
    return root


@pytest.mark.parametrize(
    ("splits", "knn_k", "refusal"),
    [
        ({"train": ("a", "b"), "val": ("a", "c")}, 1, "different class folders"),
        ({"train": ("a", "b")}, 1, "needs held-out images"),
        ({"train": ("a", "b"), "val": ("a", "b")}, 7, "bank size 6 "),
    ],
)
def test_the_knn_monitor_is_refused_before_the_first_epoch(
    tmp_path: Path, splits: dict[str, tuple[str, ...]], knn_k: int, refusal: str
) -> None:
    """What the monitor's first evaluation would refuse after a whole epoch (a folder's val/ missing or with other
    classes, k above the bank: here 6 training images under --data.eval-limit 100) is refused by build_data."""
    root = _image_folder(tmp_path / "data", splits)
    cfg = _config(tmp_path / "run", knn_k=knn_k, image_size=16)
    recipe = MocoRecipe(
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, kind="image-folder", root=root, eval_limit=100))
    )
    parts = recipe.build(torch.device("cpu"))
    with pytest.raises(UsageError, match=refusal):
        recipe.build_data(parts, torch.device("cpu"))
    ok = MocoRecipe(dataclasses.replace(recipe.config, data=dataclasses.replace(recipe.config.data, eval_limit=0)))
    assert len(ok.build_data(parts, torch.device("cpu"))) == 6  # the monitor off: nothing to refuse


def test_the_knn_bound_names_the_commands_own_flag() -> None:
    bank_MF, labels_M = torch.randn(3, 4), torch.tensor([0, 1, 0])
    with pytest.raises(UsageError, match=r"bank size 3; lower --k$"):  # `eval knn` spells it --k
        knn_predict(torch.randn(2, 4), bank_MF, labels_M, num_classes=2, k=5, k_flag="--k")
    with pytest.raises(UsageError, match=r"bank size 3; lower --knn-k$"):
        knn_predict(torch.randn(2, 4), bank_MF, labels_M, num_classes=2, k=5)
