"""Start-up: what needs no model imports no torch (the import graph, not the clock).

`trainlab --help`, `trainlab runs`, `trainlab report` and usage errors (a bad flag, a value out of range, a missing
file) run in a fresh interpreter here; each must leave torch (and the other heavy libraries) unimported. Where a
command cannot yet parse its flags without torch, the test names the module that imports it and why (its config
class lives beside torch code): a meta-path finder records the trainlab modules on the stack when torch is first
looked for, so a new import of torch anywhere else fails. Timings are not asserted: they depend on the
machine's load, the import graph does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO

HEAVY = ("torch", "torchvision", "timm", "matplotlib", "tensorboard", "wandb", "torch_fidelity", "scipy", "PIL")

PROBE = f"""
import json, sys


class WhoImportsTorch:
    \"\"\"A meta-path finder that finds nothing: it records the trainlab modules on the stack when torch is first
    looked for (outermost first), then lets the import go on.\"\"\"

    chain = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and WhoImportsTorch.chain is None:
            modules, frame = [], sys._getframe(1)
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("trainlab") and (not modules or modules[-1] != module):
                    modules.append(module)
                frame = frame.f_back
            WhoImportsTorch.chain = modules[::-1]
        return None


sys.meta_path.insert(0, WhoImportsTorch())
from trainlab.cli import main

try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
recipes = sorted(m for m in sys.modules if m.startswith("trainlab.recipes."))
result = {{"code": code, "loaded": loaded, "recipes": recipes, "torch_via": WhoImportsTorch.chain or []}}
print("PROBE " + json.dumps(result))
"""


def _probe(argv: list[str], cwd: Path) -> dict[str, Any]:
    """Run `trainlab ARGV` in a fresh interpreter: its exit code, the heavy modules and recipes it imported, and the
    trainlab modules on the stack when torch was first imported (outermost first; [] when it was not)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("PROBE ") :])
    result["stdout"], result["stderr"] = proc.stdout, proc.stderr
    return result


def _culprit(chain: list[str]) -> str | None:
    """The first module of an import chain below the CLI, the command and the recipe registry: what imported torch."""
    below = [
        m for m in chain if m not in ("trainlab.cli", "trainlab.recipes") and not m.startswith("trainlab.commands")
    ]
    return below[0] if below else None


def _run_dir(root: Path, name: str, step: int, finished: bool) -> Path:
    """A run directory as the engine writes it: config.yaml, metrics.jsonl and a checkpoint holding tensors."""
    run = root / name
    (run / "ckpt").mkdir(parents=True)
    (run / "config.yaml").write_text(f"# recipe: toy\n# command: trainlab train toy --run-dir {run}\nepochs: 1\n")
    rows = [{"kind": "train", "step": s, "epoch": 0, "loss": 1.0 / s} for s in range(1, step + 1)]
    rows.append({"kind": "eval", "step": step, "epoch": 0, "accuracy": 0.5})
    if finished:
        rows.append({"kind": "summary", "step": step, "epoch": 1, "best_accuracy": 0.5, "seconds_per_epoch": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = {"format": "trainlab-checkpoint", "recipe": "toy", "step": step, "epoch": int(finished)}
    state |= {"step_in_epoch": 0 if finished else step, "best_score": 0.5, "models": {"m": {"w": torch.zeros(8)}}}
    torch.save(state, run / "ckpt" / "last.pt")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup") / "runs"
    for i, finished in enumerate((True, False, False, True)):
        _run_dir(root, f"r{i}", step=4 + i, finished=finished)
    return root


NO_TORCH = [
    (["--help"], 0),
    (["frobnicate"], 2),
    (["launch", "--help"], 0),
    (["train"], 2),
    (["train", "--help"], 0),
    (["train", "no-such-recipe"], 2),
    (["plan"], 2),
    (["plan", "no-such-recipe"], 2),
    (["report", "/nonexistent-run"], 2),
    (["report"], 2),
    (["runs", "/nonexistent-folder"], 2),
    (["sample", "--no-such-flag"], 2),
    (["sample"], 2),
    (["sample", "--tokenizer-weights", "t.pth", "--var-weights", "v.pth", "--classes", "1"], 2),  # nothing to write
    (["sample", "--tokenizer-weights", "t", "--var-weights", "v", "--classes", "1", "--top-p", "2", "--out", "g.png"],
     2),  # out of range
    (["sample", "--help"], 0),
    (["edit", "--no-such-flag"], 2),
    (["edit", "--tokenizer-weights", "t", "--var-weights", "v", "--image", "missing.png", "--box", "0", "0", "1", "1",
      "--out", "g.png"], 2),  # a missing file
    (["bench"], 2),
    (["bench", "precision", "--epochs", "0"], 2),
    (["bench", "precision", "--modes", "fp99"], 2),
    (["bench", "precision", "--help"], 0),
    (["doctor", "--help"], 0),
    (["doctor", "--no-such-flag"], 2),
    (["doctor", "--num-workers", "-1"], 2),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "code"), NO_TORCH, ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_help_and_usage_errors_import_no_torch(argv: list[str], code: int, tmp_path: Path) -> None:
    result = _probe(argv, tmp_path)
    assert result["code"] == code, result["stderr"][-2000:]
    assert result["loaded"] == [] and result["recipes"] == [], (result["loaded"], result["torch_via"])


def test_runs_lists_runs_with_checkpoints_without_torch(runs: Path, tmp_path: Path) -> None:
    result = _probe(["runs", str(runs), "--json"], tmp_path)
    assert result["code"] == 0 and result["loaded"] == [] and result["recipes"] == [], result["torch_via"]
    states = json.loads(result["stdout"].split("PROBE ")[0])
    assert [(s["status"], s["checkpoint_step"]) for s in states] == [
        ("finished", 4),
        ("interrupted", 5),
        ("interrupted", 6),
        ("finished", 7),
    ]
    assert [s["eval_metric"] for s in states] == ["accuracy"] * 4


def test_report_on_a_run_imports_no_torch(runs: Path, tmp_path: Path) -> None:
    result = _probe(["report", str(runs / "r0"), "--out-dir", str(tmp_path / "report")], tmp_path)
    assert result["code"] == 0, result["stderr"][-2000:]
    assert "torch" not in result["loaded"] and result["recipes"] == [], result["torch_via"]
    assert (tmp_path / "report" / "results.md").is_file()


@pytest.mark.parametrize(
    ("argv", "via"),
    [
        (["train", "toy", "--lr", "0.1"], "trainlab.recipes.toy"),
        (["train", "var", "--depth", "0"], "trainlab.recipes.var"),
        (["plan", "toy", "--gpus", "0"], None),  # the plan's own flags are checked before the recipe is imported
        (["plan", "toy", "--dropout", "2"], "trainlab.recipes.toy"),
        (["eval", "--help"], "trainlab.models.backbones.vit"),
        (["eval", "fid", "--no-such-flag"], "trainlab.models.backbones.vit"),
        (["demo", "--no-such-flag"], "trainlab.demo.pipeline"),
    ],
)
def test_what_imports_torch_before_a_usage_error_and_why(argv: list[str], via: str | None, tmp_path: Path) -> None:
    """Where torch is still imported before a usage error, and why: a recipe's flags are parsed by its config class,
    which lives in the recipe module beside its torch code; `eval`'s module takes the ViT patch-size check from
    `trainlab.models.backbones.vit` (beside timm's ViT; the backbone names are torch-free, in `trainlab.models.names`)
    and the probe's data group from the linear-probe recipe; the demo's config lives in its pipeline.
    Anything else importing torch first fails here."""
    result = _probe(argv, tmp_path)
    assert result["code"] in (0, 2), result["stderr"][-2000:]
    assert _culprit(result["torch_via"]) == via, result["torch_via"]
    assert ("torch" in result["loaded"]) == (via is not None)


def test_culprit_skips_the_cli_the_command_and_the_registry() -> None:
    chain = ["trainlab.cli", "trainlab.commands.train", "trainlab.recipes", "trainlab.recipes.toy", "trainlab.data"]
    assert _culprit(chain) == "trainlab.recipes.toy"
    assert _culprit(["trainlab.cli", "trainlab.commands.runs"]) is None and _culprit([]) is None
