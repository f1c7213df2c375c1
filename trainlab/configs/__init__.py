"""Shipped run configurations (papers' settings as YAML), selectable by name: `--config var_d16`.

Each file's header says where every setting comes from. `config_path(name)` resolves a name to its file.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def list_configs() -> list[str]:
    """Names of the shipped configurations (file names without `.yaml`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_path(name: str) -> Path | None:
    """The shipped file for `name` (with or without `.yaml`), or None when there is no such config."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = CONFIG_DIR / f"{stem}.yaml"
    return path if "/" not in stem and path.is_file() else None
