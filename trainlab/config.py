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

Numbers carry their range next to the field: `option(0.0, "dropout", ge=0, lt=1)`, `option(-1, "...", ge=1,
sentinels=(-1,))` (a value outside the range with a documented meaning). Every `float` must be finite (unless the
field says `allow_inf=True`) and fit a float32; every `int` a signed 64-bit integer. `from_dict`, the one path YAML
and flags go through, refuses anything else with a one-line UsageError naming the flag, the range and the value
(`--dropout must be in [0, 1), got 1.5`) before `validate()` runs, and `--help` shows the range after the default.
`validate()` is left with the rules that tie several fields together.

Renamed settings keep their old spelling for one release: `option(..., deprecated=("--old-flag",))` accepts the old
flag (hidden from `--help`) and the old YAML key, and `deprecated_values={"old": "new"}` an old value of a Literal
field; each use prints one warning naming the new spelling. Flags users bring from other libraries (`--lr`,
`--mixed-precision bf16`, `--output-dir`, ...) are answered with "did you mean" naming the trainlab flag
(`FOREIGN_FLAGS`), never silently reinterpreted.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, get_args, get_origin

import yaml

from trainlab.errors import UsageError, first_line, missing_file

T = TypeVar("T")
log = logging.getLogger(__name__)

TRUE_WORDS = ("1", "true", "yes", "on")  # how a boolean setting is spelled on the command line or in YAML
FALSE_WORDS = ("0", "false", "no", "off")

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: every float setting ends up in float32 arithmetic somewhere."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a non-zero setting below it would become 0 (or lose its precision) in float32."""
INT64_LIMIT = 2**63
"""Every int setting must lie in [-2**63, 2**63) (torch's int64; seeds stay below it so seed + i fits torch's
generators, which take seeds below 2**64)."""


def _number(x: float) -> str:
    """A bound or value as a person writes it: 1 not 1.0, 2**63 not 9223372036854775808, 1e-08, nan, inf."""
    if isinstance(x, int):
        if abs(x) >= 2**32 and abs(x) & (abs(x) - 1) == 0:
            return f"{'-' if x < 0 else ''}2**{abs(x).bit_length() - 1}"
        return str(x)
    value = float(x)
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


@dataclass(frozen=True)
class Range:
    """The values a numeric field (or each item of a list field) admits, declared with `option(..., ge=...)`.

    Attributes:
        ge / gt / le / lt: inclusive / exclusive lower and upper bounds (None: unbounded on that side).
        sentinels: values admitted outside the bounds because they carry a documented meaning (`-1`: all).
        allow_inf: a float field may also be infinite (e.g. a clamp that inf switches off); NaN never is.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    sentinels: tuple[float, ...] = ()
    allow_inf: bool = False

    def __post_init__(self) -> None:
        if (self.ge is not None and self.gt is not None) or (self.le is not None and self.lt is not None):
            raise TypeError("give one lower bound (ge or gt) and one upper bound (le or lt)")

    def admits(self, x: float) -> bool:
        """Whether `x` is a sentinel or lies within the bounds (NaN never does)."""
        if x in self.sentinels:
            return True
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le)
            and (self.lt is None or x < self.lt)
        )

    def core(self) -> str:
        """`[0, 1)`, `> 0`, `>= 1 or -1`: the range as `--help` shows it."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            opening, closing = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            text = f"{opening}{_number(low)}, {_number(high)}{closing}"
        else:
            pairs = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            text = " and ".join(f"{op} {_number(v)}" for op, v in pairs if v is not None) or "any number"
        if self.sentinels:
            text += "".join(f" or {_number(v)}" for v in self.sentinels)
        if self.allow_inf:
            text += " (inf allowed)"
        return text

    def words(self) -> str:
        """The range in an error message: `positive`, `>= 0`, `in [0, 1)`, `>= 1 or -1`."""
        if self.gt == 0 and self.ge is None and self.le is None and self.lt is None and not self.sentinels:
            return "positive"
        bounded_both = (self.ge is not None or self.gt is not None) and (self.le is not None or self.lt is not None)
        return f"in {self.core()}" if bounded_both else self.core()


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    positional: bool = False,
    metavar: str | None = None,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    sentinels: Sequence[float] = (),
    allow_inf: bool = False,
    deprecated: Sequence[str] = (),
    deprecated_values: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """A dataclass field with a help string (shown by `--help`). Mutable defaults are copied per instance.

    Args:
        default: the value when neither `--config` nor a flag sets one; leave it out for a required field.
        help: one line for `--help`.
        positional: a positional command-line argument instead of a `--flag` (top-level fields only).
        metavar: the placeholder `--help` shows for the value (`PATH`, `N`, ...).
        flag: the flag's spelling when the field's name cannot be it (`--class` for a field named `label`: `class`
            is a Python keyword); YAML keeps the field's name. Top-level fields only.
        aliases: extra flag spellings shown by `--help` beside the flag. A setting has one name: give a former
            spelling as `deprecated`, another library's as `FOREIGN_FLAGS` / `FOREIGN_ALIASES`.
        ge, gt, le, lt: bounds of a numeric field (of each item of a list field): >=, >, <=, <.
        sentinels: values admitted outside the bounds, each with a meaning the help string gives (`-1: all`).
        allow_inf: a float field may be infinite (floats are finite otherwise).
        deprecated: former flag spellings of this field (`--dataset`, or `--data-root` for a field now nested as
            `data.root`): still accepted on the command line and, as keys (`dataset`, `data_root`), in YAML, each use
            with a warning; not shown by `--help`.
        deprecated_values: former values of a Literal field -> their current spelling, accepted with a warning.
        **kwargs: passed on to `dataclasses.field`.

    Raises:
        TypeError: contradictory bounds, or a default outside the declared range (a programming error).
    """
    bounds = None
    if any(b is not None for b in (ge, gt, le, lt)) or sentinels or allow_inf:
        bounds = Range(ge=ge, gt=gt, le=le, lt=lt, sentinels=tuple(sentinels), allow_inf=allow_inf)
        defaults = default if isinstance(default, (list, tuple)) else [default]
        for value in defaults:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not bounds.admits(value):
                raise TypeError(f"default {value!r} is outside the declared range {bounds.core()}")
    metadata = {
        "help": help,
        "positional": positional,
        "metavar": metavar,
        "flag": flag,
        "aliases": tuple(aliases),
        "range": bounds,
        "deprecated": tuple(deprecated),
        "deprecated_values": dict(deprecated_values or {}),
    }
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


def field_flag(dotted: str, f: dataclasses.Field[Any]) -> str:
    """The flag of a field: `--dotted-name`, or the spelling it declares with `option(..., flag=...)`."""
    return str(f.metadata.get("flag") or _flag(dotted))


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


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_SHORT.maxlevel = 2


def _shown(value: Any) -> str:
    """A value in an error message: its repr, shortened (a deep or huge YAML value stays one short line)."""
    return _SHORT.repr(value)


def _key(key: Any) -> str:
    """A mapping key in an error message: as written when it is short text, else shortened."""
    return key if isinstance(key, str) and len(key) <= 60 else _shown(key)


_SCALARS = (str, int, float)  # what YAML or a flag may give for one number or one piece of text


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value or CLI string to `tp`, raising a one-line UsageError on mismatch.

    Only a scalar is accepted where the field holds one: a mapping, a list, `!!binary` bytes, a date or a bool where
    a number, a path or text is expected is refused, not turned into its repr.
    """
    tp, optional = _strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UsageError(f"{where}: a value is required (got none)")
    origin = get_origin(tp)
    try:
        if origin is Literal:
            choices = get_args(tp)
            if isinstance(value, _SCALARS):
                if value in choices:
                    return value
                same_text = [c for c in choices if str(c) == str(value)]  # a CLI string for a non-string literal
                if same_text:
                    return same_text[0]
            raise UsageError(f"{where}: {_shown(value)} is not one of: {', '.join(map(str, choices))}")
        if origin in (tuple, list):
            if isinstance(value, (list, tuple)):
                items = list(value)
            elif isinstance(value, str):
                items = value.replace(",", " ").split()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                items = [value]  # YAML `patch_nums: 4`: a one-item list
            else:
                raise TypeError
            converted = [_convert(v, _item_type(tp), where) for v in items]
            return tuple(converted) if origin is tuple else converted
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower() if isinstance(value, (str, int)) else ""
            if text in TRUE_WORDS:
                return True
            if text in FALSE_WORDS:
                return False
            raise UsageError(f"{where}: expected true/false, got {_shown(value)}")
        if tp in (int, float, str, Path):
            accepted = (*_SCALARS, Path) if tp in (str, Path) else _SCALARS
            if isinstance(value, bool) or not isinstance(value, accepted):
                raise TypeError  # YAML `true`, a mapping, a list, bytes or a date where one number / text is expected
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if tp is Path:
            if not str(value).strip():  # `--run-dir "$RUN"` with RUN unset: not the current folder by accident
                raise UsageError(f"{where}: an empty path; pass a path (`.` for the current folder)")
            return Path(value)
    except (TypeError, ValueError, OverflowError):
        name = getattr(tp, "__name__", str(tp))
        raise UsageError(f"{where}: expected {name}, got {_shown(value)}") from None
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
    """Build a dataclass from a (possibly partial, possibly nested) dict, validating every key and value.

    Args:
        cls: the config dataclass.
        data: field name -> value (a nested dict for a nested dataclass); missing fields take their defaults.
        where: how error messages name the source (`config`, a file name, ...).

    Raises:
        UsageError: unknown key, missing required key, wrong type, a number outside its field's range (see
            `check_ranges`) or a value the config's `validate()` refuses.
    """
    obj = _build(cls, upgrade_keys(cls, data, where) if isinstance(data, dict) else data, where)
    check_ranges(obj, where)
    _validate_tree(obj)
    return obj


def _build(cls: type[T], data: dict[str, Any], where: str) -> T:
    """`from_dict` without the range and `validate()` checks: keys and types only."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {name: (tp, f) for name, tp, f in _fields(cls)}
    unknown = sorted(set(data) - set(known), key=str)
    if unknown:
        named = ", ".join(f"{_key(key)}{_did_you_mean(str(key), list(known))}" for key in unknown)
        raise UsageError(f"{where}: unknown key(s) {named}; valid keys: {', '.join(known)}")
    required = [name for name, (_, f) in known.items() if _is_required(f) and name not in data]
    if required:
        raise UsageError(f"{where}: missing required key(s) {', '.join(required)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp, f = known[name]
        if dataclasses.is_dataclass(tp):
            default = _default_group(f)  # a partial group keeps the field's own defaults for what it leaves out
            if isinstance(value, dict) and default is not None:
                value = merge(to_dict(default), value)
            kwargs[name] = _build(tp, value, f"{where}.{name}")  # type: ignore[arg-type]
        else:
            kwargs[name] = _convert(_upgrade_value(value, f, f"{where}.{name}"), tp, f"{where}.{name}")
    return cls(**kwargs)


def _default_group(f: dataclasses.Field[Any]) -> Any:
    """The default instance of a nested-config field (`option(ScheduleConfig(kind="cosine"), ...)`), or None."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


# ------------------------------------------------------------------------------------------ renamed settings
def deprecated_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Former key path (dotted, as YAML nests it: `data_root`, `dataset`) -> the field's current dotted path."""
    renames: dict[str, str] = {}
    for name, tp, f in _fields(cls):
        dotted = prefix + name
        if dataclasses.is_dataclass(tp):
            renames.update(deprecated_keys(tp, dotted + "."))  # type: ignore[arg-type]
            continue
        for flag in f.metadata.get("deprecated", ()):
            key = flag.lstrip("-").replace("-", "_")
            # `--label` before `flag="--class"`, or a group's former flat key with the group read on its own: the
            # YAML key is still the field's own name, nothing to rename
            if key != dotted:
                renames[key] = dotted
    return renames


_ABSENT = object()


def _get_dotted(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return _ABSENT
        data = data[key]
    return data


def upgrade_keys(cls: type, data: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """`data` with every former key of `cls`'s fields moved to the field's current place, each with a warning.

    A former key that is now the name of a group (`data: cifar10` before `data: {kind: cifar10}`) is upgraded only
    when it holds a plain value. Used for YAML files, command lines and the configs stored in older checkpoints.

    Raises:
        UsageError: a setting is given under both its former and its current name.
    """
    renames = deprecated_keys(cls)
    if not renames:
        return data
    out = merge({}, data)  # a copy, nested dicts included
    for old, new in renames.items():
        value = _get_dotted(out, old)
        if value is _ABSENT or (isinstance(value, dict) and new.startswith(old + ".")):
            continue
        if _get_dotted(out, new) is not _ABSENT and not new.startswith(old + "."):
            raise UsageError(f"{where}: both {old} (its former name) and {new} are set; keep {new} only")
        parent = out
        *path, last = old.split(".")
        for key in path:
            parent = parent[key]
        del parent[last]
        _set_dotted(out, new, value)
        log.warning("%s: '%s' is the former name of '%s' (accepted until the next release); rename it", where, old, new)
    return out


def _upgrade_value(value: Any, f: dataclasses.Field[Any], where: str) -> Any:
    """A former value of a Literal field (`deprecated_values`) as its current spelling, with a warning."""
    renamed: dict[str, str] = f.metadata.get("deprecated_values") or {}
    if not renamed:
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_upgrade_value(v, f, where) for v in value)
    if isinstance(value, str) and value in renamed:
        log.warning(
            "%s: '%s' is the former spelling of '%s' (accepted until the next release)", where, value, renamed[value]
        )
        return renamed[value]
    return value


class _DeprecatedFlag(argparse.Action):
    """Stores like the field's own flag and warns that the spelling is a former one."""

    replacement = ""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        log.warning(
            "%s is the former spelling of %s (accepted until the next release); use %s",
            option_string,
            self.replacement,
            self.replacement,
        )
        setattr(namespace, self.dest, values)


def _numeric_type(tp: Any) -> type | None:
    """int or float for a numeric field (optional, or a list of numbers), else None."""
    base, _ = _strip_optional(tp)
    if _is_list(base):
        base, _ = _strip_optional(_item_type(base))
    return base if base in (int, float) else None


def field_range(f: dataclasses.Field[Any]) -> Range | None:
    """The range a field declared with `option(..., ge=..., ...)`, or None."""
    bounds = f.metadata.get("range")
    return bounds if isinstance(bounds, Range) else None


def range_error(value: Any, tp: Any, bounds: Range | None) -> str | None:
    """Why `value` is not a valid value of a field of type `tp` with range `bounds` (None when it is), as the end of
    a sentence that starts with the field's name: `must be in [0, 1), got 1.5`.

    A float must be finite (unless `bounds.allow_inf`) and fit a float32 (neither overflow nor turn into 0 or a
    denormal); an int must fit a signed 64-bit integer;
    either must lie within `bounds` or be one of its sentinels. A list is checked item by item.
    """
    kind = _numeric_type(tp)
    if kind is None or value is None:
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = range_error(item, kind, bounds)
            if problem is not None:
                return f"(each value) {problem}"
        return None
    words = bounds.words() if bounds is not None else ""
    shown = str(value) if isinstance(value, int) else _number(value) if isinstance(value, float) else _shown(value)
    if kind is float:
        allow_inf = bounds is not None and bounds.allow_inf
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            exact = bounds.core() if bounds is not None and words == "positive" else words  # `> 0`, not `positive`
            return f"must be a {'' if allow_inf else 'finite '}number{' ' + exact if exact else ''}, got {shown}"
        if math.isfinite(value) and (abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_TINY):
            limit = f"{words} and " if words else ""
            return f"must be {limit}within float32's range (0 or magnitude in [1.2e-38, 3.4e38]), got {shown}"
    if bounds is not None and not bounds.admits(value):
        return f"must be {words}, got {shown}"
    if kind is int and not -INT64_LIMIT <= value < INT64_LIMIT:
        return f"must be {words + ' and ' if words else ''}fit a 64-bit integer ([-2**63, 2**63)), got {shown}"
    return None


def check_ranges(obj: Any, where: str = "config", prefix: str = "") -> None:
    """Check every numeric field of a config (nested configs included) against its declared range.

    Args:
        obj: a config dataclass instance.
        where: the source of the values; `config` (the command line and `--config`) names only the flag, anything
            else (a file name) is put in front of the message.
        prefix: the dotted name of `obj` inside the top-level config ('' at the top).

    Raises:
        UsageError: one line naming the flag as the user spells it, the allowed range and the value, e.g.
            `--dropout must be in [0, 1), got 1.5`.
    """
    for name, tp, f in _fields(type(obj)):
        value = getattr(obj, name)
        if dataclasses.is_dataclass(tp):
            check_ranges(value, where, f"{prefix}{name}.")
            continue
        bounds = field_range(f)
        if bounds is not None and _numeric_type(tp) is None:
            raise TypeError(f"{type(obj).__name__}.{name}: a range is declared on a field that holds no number")
        problem = range_error(value, tp, bounds)
        if problem is not None:
            source = "" if where == "config" else f"{where}: "
            raise UsageError(f"{source}{_command_line_name(prefix + name, f)} {problem}")


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


def _validate_tree(obj: Any) -> None:
    """Run `validate()` (cross-field rules) of every nested config, then of `obj` itself."""
    for name, tp, _ in _fields(type(obj)):
        if dataclasses.is_dataclass(tp):
            _validate_tree(getattr(obj, name))
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
        former_values = list(f.metadata.get("deprecated_values") or {})
        if choices is not None and former_values:  # accepted with a warning, not listed by --help
            metavar = metavar or "{" + ",".join(choices) + "}"
            choices = [*choices, *former_values]
        if not prefix and auto and name in auto:
            help_text += f"; auto: {auto[name].help}"
        bounds = field_range(f)
        if bounds is not None:
            help_text += f"; range: {bounds.core()}"
        if prefix and f.metadata.get("flag"):
            raise TypeError(f"{dotted}: only top-level fields can declare their own flag")
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
            field_flag(dotted, f),
            *f.metadata.get("aliases", ()),
            dest=dotted,
            default=argparse.SUPPRESS,
            nargs=nargs,
            const=const,
            choices=choices,
            metavar=metavar,
            help=help_text,
        )
        for former in f.metadata.get("deprecated", ()):
            # a group's former flat flag, the group parsed on its own, is the field's own flag (`--label` before
            # `flag="--class"` is not: the field's flag is `--class`)
            if former == field_flag(dotted, f):
                continue
            parser.add_argument(
                former,
                dest=dotted,
                default=argparse.SUPPRESS,
                nargs=nargs,
                const=const,
                choices=choices,
                metavar=metavar,
                help=argparse.SUPPRESS,
                action=type("_Deprecated", (_DeprecatedFlag,), {"replacement": field_flag(dotted, f)}),
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
        f"config file {path} {missing_file(path)} and no shipped config is named {str(name)!r}"
        f"{_did_you_mean(str(name), names)}; pass a YAML file or one of: {', '.join(names)}"
    )


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a key written twice in one mapping (PyYAML keeps the last one silently: a
    copy-paste slip would drop a setting without a word). Keys brought in by a merge (`<<: *base`) may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is written twice in one mapping", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _safe_load(text: str) -> Any:
    """`yaml.safe_load(text)` through `_ConfigLoader`."""
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file (a path, or a shipped config's name: see `resolve_config`) into a dict; a missing,
    non-UTF-8 or malformed file (a key written twice, a number of thousands of digits), or one that is not a mapping,
    is a one-line UsageError naming the file."""
    path = resolve_config(path)
    try:
        data = _safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise UsageError(
            f"config file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8 YAML or pass another file"
        ) from None
    except OSError as err:
        raise UsageError(f"config file {path} cannot be read ({err.strerror}); check its permissions") from None
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else "syntax error"
        raise UsageError(f"config file {path} is not valid YAML ({first}); fix the file") from None
    except RecursionError:
        raise UsageError(
            f"config file {path} is nested too deeply to be a config (a config is a mapping of field: value, with "
            "one level per nested section); fix the file"
        ) from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts (4300): no setting takes one
        what = "an integer of thousands of digits" if "integer string conversion" in str(err) else first_line(err)
        raise UsageError(f"config file {path} holds a value no setting takes ({what}); fix the file") from None
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


# Flags of other training libraries (timm, Accelerate, Lightning, HF Trainer, the official research scripts) ->
# the trainlab flags that hold the same setting, in order of preference; a parser suggests the first it has. They are
# answered, not accepted: the meaning differs (trainlab's --batch-size is the global batch, --lr is per 256 images in
# some recipes, --max-steps does not shorten the schedule) or depends on the command (--output-dir is a run's folder
# for `train`, an output folder for `sample`), so the user picks the trainlab flag knowingly.
FOREIGN_FLAGS: dict[str, tuple[str, ...]] = {
    "--lr": ("--learning-rate", "--base-learning-rate", "--optim.learning-rate", "--optim.base-learning-rate"),
    "--blr": ("--base-learning-rate", "--optim.base-learning-rate"),
    "--wd": ("--weight-decay", "--optim.weight-decay"),
    "--mixed-precision": ("--precision",),
    "--amp": ("--precision",),
    "--amp-dtype": ("--precision",),
    "--fp16": ("--precision",),
    "--bf16": ("--precision",),
    "--output-dir": ("--run-dir", "--out-dir", "--out"),
    "--output": ("--run-dir", "--out-dir", "--out"),
    "--save-dir": ("--run-dir", "--out-dir"),
    "--log-dir": ("--run-dir",),
    "--default-root-dir": ("--run-dir",),
    "--experiment": ("--run-dir",),
    "--resume-from-checkpoint": ("--resume", "--moco-weights"),
    "--ckpt-path": ("--resume", "--moco-weights", "--var-weights"),
    "--checkpoint-path": ("--resume", "--moco-weights", "--var-weights"),
    "--ckpt": ("--resume", "--moco-weights", "--var-weights"),
    "--pretrained": ("--init-from", "--moco-weights"),
    "--initial-checkpoint": ("--init-from", "--moco-weights"),
    "--vae": ("--tokenizer-weights",),
    "--vae-ckpt": ("--tokenizer-weights",),
    "--var-ckpt": ("--var-weights",),
    "--max-train-steps": ("--max-steps",),
    "--per-device-train-batch-size": ("--batch-size",),
    "--train-batch-size": ("--batch-size",),
    "--warmup-epochs": ("--schedule.warmup-fraction",),
    "--warmup-steps": ("--schedule.warmup-fraction",),
    "--sched": ("--schedule.kind",),
    "--lr-scheduler-type": ("--schedule.kind",),
    "--opt": ("--optimizer", "--optim.name"),
    "--data-dir": ("--data-root", "--data.root"),
    "--data-path": ("--data-root", "--data.root"),
    "--dataset": ("--data.kind", "--data"),
    "--model": ("--model", "--arch"),
    "--arch": ("--arch", "--model"),
    "--log-interval": ("--log-every",),
    "--log-every-n-steps": ("--log-every",),
    "--save-every": ("--checkpoint-every",),
    "--save-steps": ("--checkpoint-every",),
    "--log-wandb": ("--wandb",),
    "--report-to": ("--wandb", "--tensorboard"),
    "--gpus": ("--device",),
    "--devices": ("--device",),
    "--accelerator": ("--device",),
}
_FOREIGN_NOTES = {
    "--lr": "(per 256 images in recipes with --optim.base-learning-rate; the peak rate otherwise)",
    "--mixed-precision": "(Accelerate's no / fp16 / bf16 are --precision fp32 / fp16-amp-scale / bf16-amp)",
    "--amp": "(autocast is --precision bf16-amp or fp16-amp-scale)",
    "--amp-dtype": "(timm's float16 / bfloat16 autocast are --precision fp16-amp-scale / bf16-amp)",
    "--fp16": "(--precision fp16-amp-scale: autocast with loss scaling)",
    "--bf16": "(--precision bf16-amp)",
    "--batch-size": "(trainlab's is the global batch of one optimizer step)",
    "--per-device-train-batch-size": "(trainlab's is the global batch of one optimizer step, all processes together)",
    "--train-batch-size": "(trainlab's is the global batch of one optimizer step, all processes together)",
    "--max-train-steps": "(it stops the run early; the schedule still spans --epochs)",
    "--warmup-epochs": "(a fraction of the run's optimizer steps)",
    "--warmup-steps": "(a fraction of the run's optimizer steps)",
    "--log-wandb": "(--wandb online or offline)",
    "--gpus": "(one process per GPU under `trainlab launch --nproc-per-node N`; --device cuda)",
    "--devices": "(one process per GPU under `trainlab launch --nproc-per-node N`; --device cuda)",
    "--accelerator": "(--device cpu, cuda or auto)",
    "--vae": "(the VQVAE weights, e.g. vae_ch160v4096z32.pth)",
}

# Flags of other libraries that mean exactly what a trainlab flag means: accepted as that flag where the command has
# it (not shown by --help; one line names the trainlab spelling), never where the meaning would shift.
FOREIGN_ALIASES: dict[str, tuple[str, str]] = {
    "--max-epochs": ("--epochs", "Lightning's"),
    "--num-epochs": ("--epochs", "a common"),
    "--num-train-epochs": ("--epochs", "the HF Trainer's"),
    "--gradient-accumulation-steps": ("--grad-accumulation", "Accelerate's"),
    "--accumulate-grad-batches": ("--grad-accumulation", "Lightning's"),
    "--accum-iter": ("--grad-accumulation", "MAE's"),
    "--workers": ("--num-workers", "timm's"),
    "--dataloader-num-workers": ("--num-workers", "the HF Trainer's"),
    "--clip-grad": ("--clip-grad-norm", "timm's"),
    "--gradient-clip-val": ("--clip-grad-norm", "Lightning's"),
    "--max-grad-norm": ("--clip-grad-norm", "the HF Trainer's"),
    "--torch-compile": ("--compile", "the HF Trainer's"),
}

# Values other libraries give a precision setting -> the trainlab mode that computes the same, answered with "did you
# mean" (Lightning's `--precision bf16-mixed`, Accelerate's `no`, timm's `--amp-dtype bfloat16`).
FOREIGN_VALUES: dict[str, tuple[str, str]] = {
    "bf16-mixed": ("bf16-amp", "Lightning's bf16-mixed: autocast bf16, fp32 weights"),
    "16-mixed": ("fp16-amp-scale", "Lightning's 16-mixed: autocast fp16, fp32 weights, loss scaling"),
    "16": ("fp16-amp-scale", "Lightning's 16: autocast fp16, fp32 weights, loss scaling"),
    "bf16-true": ("bf16", "Lightning's bf16-true: bf16 weights"),
    "16-true": ("fp16", "Lightning's 16-true: fp16 weights"),
    "32-true": ("fp32", "Lightning's 32-true"),
    "32": ("fp32", "Lightning's 32"),
    "64-true": ("fp64", "Lightning's 64-true"),
    "64": ("fp64", "Lightning's 64"),
    "no": ("fp32", "Accelerate's no"),
    "float32": ("fp32", "float32 throughout"),
    "float64": ("fp64", "float64 throughout"),
    "bfloat16": ("bf16-amp", "autocast bf16; pure bf16 weights are bf16"),
    "float16": ("fp16-amp-scale", "autocast fp16 with loss scaling; pure fp16 weights are fp16"),
}


def foreign_flag_hint(word: str, known: Sequence[str]) -> str:
    """'did you mean ...?' for a flag spelled as another library spells it, or '' (see `FOREIGN_FLAGS`).

    Args:
        word: the unrecognized word (`--lr`, `--lr=3`, `--batch_size`).
        known: the flags the parser shows (its current spellings).
    """
    flag = word.split("=", 1)[0]
    dashed = "--" + flag.lstrip("-").replace("_", "-")
    if dashed != flag and dashed in known:
        return f"did you mean {dashed}?"
    candidates = [c for c in FOREIGN_FLAGS.get(dashed, ()) if c in known and c != flag]
    if not candidates:
        return ""
    note = _FOREIGN_NOTES.get(dashed, _FOREIGN_NOTES.get(candidates[0], ""))
    return f"did you mean {candidates[0]}?" + (f" {note}" if note else "")


def foreign_value_hint(value: str, choices: Sequence[str]) -> str:
    """'did you mean bf16-amp? (...)' for a precision value spelled as another library spells it (`FOREIGN_VALUES`),
    or '' when it is none or its trainlab mode is not among `choices`."""
    target, note = FOREIGN_VALUES.get(value, ("", ""))
    return f"did you mean {target}? ({note})" if target in choices else ""


def _flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every `--flag` the parser accepts -> the spelling `--help` shows for its setting (a former or foreign spelling
    maps to the current one, so a near miss is never answered with a spelling on its way out)."""
    names: dict[str, str] = {}
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags:
            continue
        current = getattr(action, "replacement", "") or flags[0]
        names.update({flag: current for flag in flags})
    return names


# What argparse should read as a (negative) number value, not as a flag: argparse's own rule (Python 3.11) knows
# `-5` and `-.5` only, so `--init-std -1e-3` or `--x -inf` would be "expected one argument".
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER  # no flag of ours starts with a digit or inf / nan

    def error(self, message: str) -> typing.NoReturn:
        names = _flag_names(self)
        shown = sorted(set(names.values()))
        if message.startswith("unrecognized arguments:"):
            words = [w for w in message.split(":", 1)[1].split() if w.startswith("-")]
            hints = []
            for word in words:
                hint = foreign_flag_hint(word, shown)
                close = _close_flag(word, list(names))
                hints.append(
                    f"{word.split('=', 1)[0]}: {hint}" if hint else f"did you mean {names[close[0]]}?" if close else ""
                )
            hints = [h for h in hints if h]
            message += "; " + " ".join(hints) if hints else ""
        elif "invalid choice:" in message:
            value = message.split("invalid choice:", 1)[1].strip().split(" (choose from", 1)[0].strip("'\"")
            choices = message.split("(choose from", 1)[1] if "(choose from" in message else ""
            hint = foreign_value_hint(value, [c.strip(" '\")") for c in choices.split(",")])
            message += f"; {hint}" if hint else ""
        raise UsageError(f"{message}; see `{self.prog} --help`")


def _close_flag(word: str, known: Sequence[str]) -> list[str]:
    """The known flag closest to `word` (`--learnig-rate` -> `--learning-rate`; `--lr=3` is compared as `--lr`)."""
    return difflib.get_close_matches(word.split("=", 1)[0], list(known), n=1, cutoff=0.8)


class _ForeignFlag(argparse.Action):
    """Stores like the trainlab flag of the same meaning and says, in one line, how trainlab spells it."""

    replacement = ""
    origin = ""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        log.info("%s (%s spelling) is read as %s", option_string, self.origin, self.replacement)
        setattr(namespace, self.dest, values)


def _add_foreign_aliases(parser: argparse.ArgumentParser) -> None:
    """Accept `FOREIGN_ALIASES` where the parser has their trainlab flag (hidden from --help)."""
    by_flag = {s: action for action in parser._actions for s in action.option_strings}
    for alias, (target, origin) in FOREIGN_ALIASES.items():
        action = by_flag.get(target)
        if action is None or alias in by_flag:
            continue
        parser.add_argument(
            alias,
            dest=action.dest,
            default=argparse.SUPPRESS,
            nargs=action.nargs,
            const=action.const,
            choices=action.choices,
            metavar=action.metavar,
            help=argparse.SUPPRESS,
            action=type("_Foreign", (_ForeignFlag,), {"replacement": target, "origin": origin}),
        )


def build_parser(
    cls: type,
    prog: str,
    description: str,
    epilog: str = "",
    auto: Mapping[str, Auto[Any]] | None = None,
    usage: str | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag (or positional) per (nested) dataclass field, plus `--config` and
    `--print-config`. Parse errors raise `UsageError` instead of exiting. `auto` adds its help to those fields;
    `usage` replaces argparse's generated usage line. Flags of other libraries that mean the same as one of the
    parser's (`FOREIGN_ALIASES`) are accepted as it, hidden from `--help`."""
    parser = _Parser(
        prog=prog,
        usage=usage,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--epoch` is not silently `--epochs`: a near miss is answered with "did you mean"
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
    _add_foreign_aliases(parser)
    return parser


def flags_help(cls: type) -> str:
    """The `--help` lines of `cls`'s flags alone (no usage line, no --config / --print-config): for a command that
    shows its own flags above another config's (`trainlab plan RECIPE --help`)."""
    parser = argparse.ArgumentParser(add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser, cls)
    options = parser.format_help().split("\n\n", 1)[1]  # after the usage line: `options:` and the flags
    return options.split("\n", 1)[1].rstrip()


def _command_line_name(dotted: str, f: dataclasses.Field[Any]) -> str:
    """How the user spells a field: `RUN_DIR`, `--seed`, or `--var-weights/--var` with its aliases."""
    if f.metadata.get("positional"):
        return str(f.metadata.get("metavar") or dotted.upper())
    return "/".join([field_flag(dotted, f), *f.metadata.get("aliases", ())])


def parse(
    cls: type[T],
    argv: Sequence[str],
    prog: str,
    description: str = "",
    epilog: str = "",
    auto: Mapping[str, Auto[T]] | None = None,
    usage: str | None = None,
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
        usage: the `--help` usage line, instead of argparse's list of every flag.

    Raises:
        UsageError: a bad flag, value, key or config file, or a missing required field.
    """
    parser = build_parser(cls, prog, description or (cls.__doc__ or "").strip().splitlines()[0], epilog, auto, usage)
    namespace = vars(parser.parse_args(list(argv)))
    config_path = namespace.pop("config")
    print_config = namespace.pop("print_config")
    data: dict[str, Any] = load_yaml(config_path) if config_path is not None else {}
    if data:
        data = upgrade_keys(cls, data, str(config_path))
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
        check_ranges(config)
        _validate_tree(config)
    if print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        raise SystemExit(0)
    return config
