"""The layering rules of the design, enforced by an `ast` scan of every module's imports.

models/ never import the engine, recipes, commands or torch.distributed; the engine never imports recipes nor names
one; data/ never imports models or recipes; nothing below the demo (recipes, engine, models, data, evaluate, losses,
optim) imports `trainlab.demo`. Imports point down: cli -> commands / demo -> recipes -> engine/models/data.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainlab"

# folder -> module prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models": (
        "trainlab.engine",
        "trainlab.recipes",
        "trainlab.commands",
        "trainlab.cli",
        "torch.distributed",
        "trainlab.dist",
        "trainlab.demo",
    ),
    "engine": ("trainlab.recipes", "trainlab.commands", "trainlab.cli", "trainlab.demo"),
    "data": ("trainlab.models", "trainlab.recipes", "trainlab.commands", "trainlab.engine.loop", "trainlab.demo"),
    "losses": ("trainlab.engine", "trainlab.recipes", "trainlab.commands", "torch.distributed", "trainlab.demo"),
    "evaluate": ("trainlab.recipes", "trainlab.commands", "trainlab.cli", "trainlab.demo"),
    "optim": ("trainlab.recipes", "trainlab.commands", "trainlab.cli", "trainlab.demo"),
    # the demo sits on top (it runs recipes and reads evaluations): nothing below it imports it
    "recipes": ("trainlab.commands", "trainlab.cli", "trainlab.demo"),
}


def _modules(folder: str, root: Path = PACKAGE) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def imported_names(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """Every module name `path` imports (absolute; relative imports resolved), with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append((node.lineno, arg.value))
    return names


def _violations(folder: str, root: Path = PACKAGE) -> list[str]:
    bad = []
    for path in _modules(folder, root):
        for line, name in imported_names(path, root):
            if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layer_imports_point_down(folder: str) -> None:
    if not (PACKAGE / folder).is_dir():
        pytest.skip(f"trainlab/{folder} does not exist yet")
    assert _violations(folder) == []


def test_models_do_not_use_distributed_or_print() -> None:
    bad = []
    for path in _modules("models"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{path.name}:{node.lineno} calls print")
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                bad.append(f"{path.name}:{node.lineno} uses torch.distributed")
    assert bad == []


def test_engine_never_names_a_recipe() -> None:
    from trainlab.recipes import list_recipes

    names = set(list_recipes())
    bad = []
    for path in _modules("engine"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                bad.append(f"{path.name}:{node.lineno} names recipe {node.value!r}")
    assert bad == []


def test_the_scan_sees_a_violation(tmp_path: Path) -> None:
    """The scanner itself: a relative import of the engine from a models file is found."""
    root = tmp_path / "trainlab"
    (root / "models" / "var").mkdir(parents=True)
    (root / "models" / "var" / "probe.py").write_text("from ...engine import loop\nimport torch.distributed as dist\n")
    found = _violations("models", root)
    assert any("trainlab.engine" in v for v in found) and any("torch.distributed" in v for v in found)
