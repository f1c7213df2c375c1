"""The digit judge: an independent classifier of the bundled real digits that judges generated samples.

`trainlab train judge` trains `trainlab.models.digit_judge` (`digit_judge` in the registry, ~0.1 M parameters at
16 px) on the 4,000 real "train" digits of the bundled set (split seed 0, the split `trainlab demo` holds out its
1,000 "heldout" digits from) and evaluates its accuracy on the held-out ones. The demo trains it with this recipe,
then uses its accuracy on samples (conditional accuracy) and its features (FID) to measure VAR.

Training: AdamW (lr 3e-3, weight decay 5e-4), batch 128, 10 epochs; learning rate warmed up linearly from 4 % of the
peak over the first 30 % of the steps, then cosine to 0 (the shape of a one-cycle schedule); light random affine +
blur views (`trainlab.data.digit_views`, a pure function of seed, epoch and sample). The last epoch's judge is the
result (no best-epoch pick: that would choose on the held-out digits); it is written to `judge.safetensors`.

Shape legend: B batch, K classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainlab.config import option
from trainlab.data.config import (
    DataConfig,
    download_option,
    eval_limit_option,
    fake_size_option,
    kind_option,
    root_option,
    train_limit_option,
)
from trainlab.data.digit_views import DigitViews
from trainlab.data.digits import DigitsData, load_digits_dataset
from trainlab.dtypes import at_least_float32
from trainlab.engine.recipe import Batch, Phase, Recipe, StepInfo, TrainConfig, TrainParts, unwrap_model
from trainlab.engine.schedule import ScheduleConfig
from trainlab.errors import UsageError
from trainlab.evaluate.judge_accuracy import accuracy
from trainlab.models.digit_judge import RESOLUTIONS, DigitJudge, save_judge
from trainlab.models.registry import create_model
from trainlab.optim.config import OptimConfig

JUDGE_FILE = "judge.safetensors"

JudgeKind = Literal["digits"]


@dataclasses.dataclass(kw_only=True)
class JudgeData(DataConfig):
    """The judge's images: the bundled real digits only (4,000 train / 1,000 held-out), what it judges samples of."""

    kind: JudgeKind = kind_option("digits", JudgeKind)
    root: Path = root_option(Path("data/digits"), JudgeKind)
    train_limit: int = train_limit_option()
    eval_limit: int = eval_limit_option(0, "held-out digits")
    fake_size: int = fake_size_option()
    download: bool = download_option()


@dataclasses.dataclass(kw_only=True)
class JudgeConfig(TrainConfig):
    """Train the digit judge (an independent classifier of the bundled real digits) that scores generated samples."""

    run_dir: Path = option(
        Path("runs/judge"), "the run's folder: config, metrics, checkpoints; launched again, it resumes", metavar="DIR"
    )
    data: JudgeData = option(JudgeData(), "which images (the bundled digits)")
    image_size: int = option(16, "side of the digits and of the judge's input: 8, 16 or 32", ge=1)
    width: int = option(16, "channels of the judge's stem (the next stages have 2x and 4x)", ge=1)
    feature_dim: int = option(64, "width of the penultimate features (the FID features)", ge=1)
    augment: bool = option(True, "random affine + blur training views (trainlab.data.digit_views)")
    epochs: int = option(10, "number of epochs", ge=1)
    batch_size: int = option(128, "global batch per optimizer step", gt=0)
    optim: OptimConfig = option(
        OptimConfig(name="adamw", learning_rate=3e-3, weight_decay=5e-4), "AdamW, peak lr 3e-3, weight decay 5e-4"
    )
    schedule: ScheduleConfig = option(
        ScheduleConfig(kind="cosine", warmup_fraction=0.3, warmup_start_ratio=0.04),
        "linear warm-up from 4 % of the peak over 30 % of the steps, then cosine to 0 (a one-cycle shape)",
    )
    export: str = option("", "write the trained judge to this safetensors file ('': run_dir/judge.safetensors)")

    def validate(self) -> None:
        super().validate()
        if self.image_size not in RESOLUTIONS:
            raise UsageError(f"--image-size {self.image_size}: the judge takes 8, 16 or 32 px digits")

    def export_path(self) -> Path:
        """Where the trained judge is written."""
        return Path(self.export) if self.export else self.run_dir / JUDGE_FILE


def _first(limit: int, data: DigitsData) -> DigitsData:
    return data.subset(torch.arange(min(limit, len(data)))) if limit > 0 else data


class JudgeRecipe(Recipe[JudgeConfig]):
    name = "judge"
    config_class = JudgeConfig
    resume_may_change = ("export",)

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__(config)
        self._heldout: DigitsData | None = None

    def build(self, device: torch.device) -> TrainParts:
        c = self.config
        judge = create_model("digit_judge", resolution=c.image_size, width=c.width, feature_dim=c.feature_dim)
        judge = judge.to(device)
        optimizer = c.optim.build(judge.parameters(), batch_size=c.batch_size, device=device)
        return TrainParts(models={"judge": judge}, phases=[Phase("main", optimizer, ["judge"])])

    def build_data(self, parts: TrainParts, device: torch.device) -> Dataset[Batch]:
        c = self.config
        train = _first(c.data.train_limit, load_digits_dataset(resolution=c.image_size, split="train"))
        self._heldout = _first(c.data.eval_limit, load_digits_dataset(resolution=c.image_size, split="heldout"))
        return DigitViews(train.images_N3HW, train.labels_N, augment=c.augment, seed=c.seed)

    def example_batch(self, batch_size: int) -> Batch:
        side = self.config.image_size
        return {"image": torch.zeros(batch_size, 3, side, side), "label": torch.zeros(batch_size, dtype=torch.long)}

    def train_step(self, models: Mapping[str, nn.Module], batch: Batch, phase: str, info: StepInfo) -> dict[str, Any]:
        img_B3HW, label_B = batch["image"], batch["label"]
        logits_BK = models["judge"](img_B3HW)
        loss = F.cross_entropy(at_least_float32(logits_BK), label_B)
        return {"loss": loss, "accuracy": (logits_BK.argmax(-1) == label_B).float().mean()}

    def evaluate(self, models: Mapping[str, nn.Module], device: torch.device, epoch: int) -> dict[str, float]:
        assert self._heldout is not None
        judge = unwrap_model(models["judge"])
        assert isinstance(judge, DigitJudge)
        return {"heldout_accuracy": accuracy(judge, self._heldout.images_N3HW, self._heldout.labels_N)}

    def on_fit_end(self, models: Mapping[str, nn.Module]) -> None:
        judge = unwrap_model(models["judge"])
        assert isinstance(judge, DigitJudge)
        path = self.config.export_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_judge(judge, path)

    def debug_config(self) -> JudgeConfig:
        """256 training digits, batch 32: 8 steps per epoch, 2 epochs; 200 held-out digits."""
        return dataclasses.replace(
            self.config,
            data=dataclasses.replace(self.config.data, train_limit=256, eval_limit=200),
            batch_size=32,
            epochs=2,
            max_steps=-1,
            log_every=1,
            export="",
            debug=False,
        )
