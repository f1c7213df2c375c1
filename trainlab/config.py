"""Typed configs: dataclasses are the single source of truth; the CLI and YAML files are generated from them.

A config is a `@dataclass(kw_only=True)` whose fields carry a `help` string (via `option`; no default means
required). Nested dataclasses become dotted flags (`--optimizer.learning-rate 0.1`); `option(..., positional=True)`
makes a positional argument instead. A list field takes one or more values. A `Literal[...]` field accepts only its
values (argparse choices on the command line, listed by `--help`; checked again in YAML). Resolution order: dataclass
defaults, then `--config file.yaml` (a path, or the name of a shipped config: `--config var_d16`), then flags. Unknown
keys or flags (with a "did you mean" suggestion), missing required fields, wrong types, bad values and unreadable
files are `UsageError`s (one line, exit code 2). `--print-config` prints the resolved config as YAML (loadable with
`--config`) and exits 0 without running anything. A command may let a top-level field also take the word `auto`
(`parse(..., auto={"grad_accumulation": Auto(help, resolve)})`): the field keeps its type, `resolve(config)` turns
`auto` into a value before `validate()` and `--print-config`, so the resolved value is what runs and is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, get_args, get_origin

import yaml

from trainlab.errors import UsageError

T = TypeVar("T")


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    positional: bool = False,
    metavar: str | None = None,
    aliases: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """A dataclass field with a help string (shown by `--help`). Mutable defaults are copied per instance.

    Args:
        default: the value when neither `--config` nor a flag sets one; leave it out for a required field.
        help: one line for `--help`.
        positional: a positional command-line argument instead of a `--flag` (top-level fields only).
        metavar: the placeholder `--help` shows for the value (`PATH`, `N`, ...).
        aliases: extra flag spellings, e.g. `("--cfg",)` for a field named `guidance`.
        **kwargs: passed on to `dataclasses.field`.
    """
    metadata = {"help": help, "positional": positional, "metavar": metavar, "aliases": tuple(aliases)}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return dataclasses.field(default_factory=lambda: dataclasses.replace(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


@dataclass(frozen=True)
class Auto(Generic[T]):
    """A top-level config field that also accepts the word `auto` (on the command line or in YAML).

    Attributes:
        help: what `auto` does, appended to the field's `--help` line.
        resolve: called with the config built with the field at its default; returns the value `auto` stands for.
    """

    help: str
    resolve: Callable[[T], Any]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_list(tp: Any) -> bool:
    return get_origin(tp) in (tuple, list)


def _item_type(tp: Any) -> Any:
    return (get_args(tp) or (str,))[0]


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """` (did you mean X?)` for the closest candidate, or '' when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


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
            if value in choices:
                return value
            same_text = [c for c in choices if str(c) == str(value)]  # a CLI string for a non-string literal
            if same_text:
                return same_text[0]
            raise UsageError(f"{where}: {value!r} is not one of: {', '.join(map(str, choices))}")
        if origin in (tuple, list):
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            converted = [_convert(v, _item_type(tp), where) for v in items]
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
        if tp in (int, float, str, Path) and isinstance(value, (bool, dict, list, tuple)):
            raise TypeError  # YAML `true`, a mapping or a list where one number / text is expected
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
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f) for f in dataclasses.fields(cls)]


def _is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _missing(cls: type, data: dict[str, Any], prefix: str = "") -> list[tuple[str, dataclasses.Field[Any]]]:
    """(dotted name, field) of every required field that `data` leaves unset."""
    missing = []
    for name, tp, f in _fields(cls):
        if name not in data:
            if _is_required(f):
                missing.append((prefix + name, f))
        elif dataclasses.is_dataclass(tp) and isinstance(data[name], dict):
            missing += _missing(tp, data[name], f"{prefix}{name}.")  # type: ignore[arg-type]
    return missing


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Build a dataclass from a (possibly partial, possibly nested) dict, validating every key.

    Args:
        cls: the config dataclass.
        data: field name -> value (a nested dict for a nested dataclass); missing fields take their defaults.
        where: how error messages name the source (`config`, a file name, ...).

    Raises:
        UsageError: unknown key, missing required key, wrong type or a value the config's `validate()` refuses.
    """
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {name: (tp, f) for name, tp, f in _fields(cls)}
    unknown = sorted(set(data) - set(known), key=str)
    if unknown:
        named = ", ".join(f"{key}{_did_you_mean(str(key), list(known))}" for key in unknown)
        raise UsageError(f"{where}: unknown key(s) {named}; valid keys: {', '.join(known)}")
    required = [name for name, (_, f) in known.items() if _is_required(f) and name not in data]
    if required:
        raise UsageError(f"{where}: missing required key(s) {', '.join(required)}")
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
    """A YAML-safe dict of a dataclass (paths as strings, tuples as lists); `from_dict` reads it back."""

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


def _shown_default(f: dataclasses.Field[Any]) -> str:
    if _is_required(f):
        return "required"
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    return f"default: {shown}"


def _choices(tp: Any, optional: bool) -> list[str] | None:
    """The command-line spellings of a Literal's values (plus `none` when the field is optional)."""
    if get_origin(tp) is not Literal:
        return None
    return [str(c) for c in get_args(tp)] + (["none"] if optional else [])


def _add_arguments(
    parser: argparse.ArgumentParser, cls: type, prefix: str = "", auto: Mapping[str, Auto[Any]] | None = None
) -> None:
    for name, tp, f in _fields(cls):
        dotted = prefix + name
        if dataclasses.is_dataclass(tp):
            _add_arguments(parser, tp, dotted + ".")  # type: ignore[arg-type]
            continue
        base, optional = _strip_optional(tp)
        is_list = _is_list(base)
        choices = _choices(_item_type(base) if is_list else base, optional)
        help_text = f"{f.metadata.get('help', '')} ({_shown_default(f)})"
        metavar = f.metadata.get("metavar")
        if not prefix and auto and name in auto:
            help_text += f"; auto: {auto[name].help}"
        if f.metadata.get("positional"):
            if prefix:
                raise TypeError(f"{dotted}: only top-level fields can be positional")
            parser.add_argument(
                name,
                nargs="*" if is_list else "?",
                default=argparse.SUPPRESS,
                choices=choices,
                metavar=metavar or name.upper(),
                help=help_text,
            )
            continue
        nargs: str | None = "+" if is_list else None
        const = None
        if base is bool:  # `--debug` alone means true; `--debug false` is accepted too
            nargs, const, metavar = "?", "true", metavar or "true|false"
        parser.add_argument(
            _flag(dotted),
            *f.metadata.get("aliases", ()),
            dest=dotted,
            default=argparse.SUPPRESS,
            nargs=nargs,
            const=const,
            choices=choices,
            metavar=metavar,
            help=help_text,
        )


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def resolve_config(name: str | Path) -> Path:
    """The YAML file `--config NAME` means: an existing path, else the shipped config of that name (`var_d16`,
    `var_d16.yaml`; see `trainlab.configs`).

    Raises:
        UsageError: neither a file nor a shipped name; the message lists the shipped configs.
    """
    from trainlab.configs import config_path, list_configs

    path = Path(name)
    if path.is_file():
        return path
    shipped = config_path(str(name))
    if shipped is not None:
        return shipped
    names = list_configs()
    raise UsageError(
        f"config file {path} not found and no shipped config is named {str(name)!r}{_did_you_mean(str(name), names)}; "
        f"pass a YAML file or one of: {', '.join(names)}"
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file (a path, or a shipped config's name: see `resolve_config`) into a dict; a missing,
    non-UTF-8 or malformed file, or one that is not a mapping, is a one-line UsageError naming the file."""
    path = resolve_config(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise UsageError(
            f"config file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8 YAML or pass another file"
        ) from None
    except OSError as err:
        raise UsageError(f"config file {path} cannot be read ({err.strerror}); check its permissions") from None
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else "syntax error"
        raise UsageError(f"config file {path} is not valid YAML ({first}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of field: value")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge (nested dicts are merged key by key); `override` wins."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
            words = message.split(":", 1)[1].split()
            hints = [f"did you mean {c}?" for w in words if w.startswith("--") for c in _close_flag(w, known)]
            message += "; " + " ".join(hints) if hints else ""
        raise UsageError(f"{message}; see `{self.prog} --help`")


def _close_flag(word: str, known: Sequence[str]) -> list[str]:
    """The known flag closest to `word` (`--learnig-rate` -> `--learning-rate`; `--lr=3` is compared as `--lr`)."""
    return difflib.get_close_matches(word.split("=", 1)[0], list(known), n=1, cutoff=0.8)


def build_parser(
    cls: type, prog: str, description: str, epilog: str = "", auto: Mapping[str, Auto[Any]] | None = None
) -> argparse.ArgumentParser:
    """An argparse parser with one flag (or positional) per (nested) dataclass field, plus `--config` and
    `--print-config`. Parse errors raise `UsageError` instead of exiting. `auto` adds its help to those fields."""
    parser = _Parser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE|NAME",
        help="YAML file with field values, or a shipped config's name (trainlab/configs, e.g. var_d16); flags win",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit without running"
    )
    _add_arguments(parser, cls, auto=auto)
    return parser


def _command_line_name(dotted: str, f: dataclasses.Field[Any]) -> str:
    """How the user spells a field: `RUN_DIR`, `--seed`, or `--var-weights/--var` with its aliases."""
    if f.metadata.get("positional"):
        return str(f.metadata.get("metavar") or dotted.upper())
    return "/".join([_flag(dotted), *f.metadata.get("aliases", ())])


def parse(
    cls: type[T],
    argv: Sequence[str],
    prog: str,
    description: str = "",
    epilog: str = "",
    auto: Mapping[str, Auto[T]] | None = None,
) -> T:
    """Parse `argv` into `cls`: defaults < `--config` YAML < flags, then the config's `validate()`.

    With `--print-config`, prints the resolved config as YAML to stdout and raises `SystemExit(0)` (as `--help`
    does), so the command runs nothing.

    Args:
        cls: the config dataclass.
        argv: the command-line arguments after the command name.
        prog: the command as the user typed it (`trainlab sample`), for usage and error messages.
        description: the `--help` summary; defaults to the first line of `cls`'s docstring.
        epilog: text shown after the options by `--help` (kept as written).
        auto: top-level field name -> `Auto`: the field also accepts `auto`, resolved before `--print-config`.

    Raises:
        UsageError: a bad flag, value, key or config file, or a missing required field.
    """
    parser = build_parser(cls, prog, description or (cls.__doc__ or "").strip().splitlines()[0], epilog, auto)
    namespace = vars(parser.parse_args(list(argv)))
    config_path = namespace.pop("config")
    print_config = namespace.pop("print_config")
    data: dict[str, Any] = load_yaml(config_path) if config_path is not None else {}
    overrides: dict[str, Any] = {}
    for dotted, value in namespace.items():
        _set_dotted(overrides, dotted, value)
    merged = merge(data, overrides)
    missing = [_command_line_name(dotted, f) for dotted, f in _missing(cls, merged)]
    if missing:
        raise UsageError(
            f"missing required {', '.join(missing)} (on the command line or in the --config file); see `{prog} --help`"
        )
    wants_auto = [name for name in auto or {} if str(merged.get(name, "")).lower() == "auto"]
    config = from_dict(cls, {k: v for k, v in merged.items() if k not in wants_auto})
    if wants_auto:
        assert auto is not None
        hints = typing.get_type_hints(cls)
        resolved = {name: _convert(auto[name].resolve(config), hints[name], f"auto {name}") for name in wants_auto}
        config = dataclasses.replace(config, **resolved)  # type: ignore[type-var]
        _validate(config)
    if print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        raise SystemExit(0)
    return config
