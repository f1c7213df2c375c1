"""Typed configs: dataclasses are the single source of truth; the CLI and YAML files are generated from them.

A config is a `@dataclass(kw_only=True)` whose fields carry a `help` string (via `option`). Nested dataclasses
become dotted flags (`--optimizer.learning-rate 0.1`). Resolution order: dataclass defaults, then `--config
file.yaml`, then flags. Unknown keys or flags, wrong types and bad values are `UsageError`s (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from trainlab.errors import UsageError

T = TypeVar("T")


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a help string (shown by `--help`). Mutable defaults are copied per instance."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return dataclasses.field(default_factory=lambda: dataclasses.replace(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value or CLI string to `tp`, raising a one-line UsageError on mismatch."""
    tp, optional = _strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UsageError(f"{where}: a value is required (got none)")
    origin = get_origin(tp)
    try:
        if origin is Literal:
            choices = get_args(tp)
            if value not in choices:
                raise UsageError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
            return value
        if origin in (tuple, list):
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            item_tp = (get_args(tp) or (str,))[0]
            converted = [_convert(v, item_tp, where) for v in items]
            return tuple(converted) if origin is tuple else converted
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise UsageError(f"{where}: expected true/false, got {value!r}")
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if tp is Path:
            return Path(value)
    except (TypeError, ValueError):
        name = getattr(tp, "__name__", str(tp))
        raise UsageError(f"{where}: expected {name}, got {value!r}") from None
    return value


def _fields(cls: type) -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    hints = _resolved_hints(cls)
    return [(f.name, hints[f.name], f) for f in dataclasses.fields(cls)]


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Build a dataclass from a (possibly partial, possibly nested) dict, validating every key."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {name: (tp, f) for name, tp, f in _fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; valid keys: {', '.join(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp, _ = known[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, f"{where}.{name}")  # type: ignore[arg-type]
        else:
            kwargs[name] = _convert(value, tp, f"{where}.{name}")
    obj = cls(**kwargs)
    _validate(obj)
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    """A YAML-safe dict of a dataclass (paths as strings, tuples as lists)."""

    def clean(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return clean(dataclasses.asdict(obj))


def _validate(obj: Any) -> None:
    check = getattr(obj, "validate", None)
    if callable(check):
        check()


def _add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    for name, tp, f in _fields(cls):
        dotted = prefix + name
        if dataclasses.is_dataclass(tp):
            _add_arguments(parser, tp, dotted + ".")  # type: ignore[arg-type]
            continue
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        base, _ = _strip_optional(tp)
        meta = None
        if get_origin(base) is Literal:
            meta = "{" + ",".join(map(str, get_args(base))) + "}"
        nargs: str | None = "+" if get_origin(base) in (tuple, list) else None
        const = None
        if base is bool:  # `--debug` alone means true; `--debug false` is accepted too
            nargs, const, meta = "?", "true", "[true|false]"
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        parser.add_argument(
            _flag(dotted),
            dest=dotted,
            default=argparse.SUPPRESS,
            nargs=nargs,
            const=const,
            metavar=meta,
            help=f"{help_text} (default: {shown})",
        )


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML config file; a missing or malformed file is a UsageError."""
    if not path.is_file():
        raise UsageError(f"config file {path} not found; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else "syntax error"
        raise UsageError(f"config file {path} is not valid YAML ({first}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of field: value")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `override` wins."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{message}; see `{self.prog} --help`")


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per (nested) dataclass field, plus `--config`."""
    parser = _Parser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML file with field values (flags override it)")
    _add_arguments(parser, cls)
    return parser


def parse(cls: type[T], argv: Sequence[str], prog: str, description: str = "") -> T:
    """Parse `argv` into `cls`: defaults < `--config` YAML < flags."""
    parser = build_parser(cls, prog, description or (cls.__doc__ or "").strip().splitlines()[0])
    namespace = vars(parser.parse_args(list(argv)))
    config_path = namespace.pop("config")
    data: dict[str, Any] = load_yaml(config_path) if config_path is not None else {}
    overrides: dict[str, Any] = {}
    for dotted, value in namespace.items():
        _set_dotted(overrides, dotted, value)
    return from_dict(cls, merge(data, overrides))
