"""What trainlab prints or writes as JSON is valid JSON (RFC 8259 has no NaN or Infinity, and `json.loads` of other
languages refuses them): a non-finite float is written as the string "nan", "inf" or "-inf", as metrics.jsonl
stores it (a diverged run's loss stays visible instead of breaking the reader)."""

from __future__ import annotations

import json
import math
from typing import Any


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float inside (dicts, lists, tuples) replaced by its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


def dumps_json(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite_json(value)`, refusing what still is not JSON (`allow_nan=False`)."""
    return json.dumps(finite_json(value), allow_nan=False, **kwargs)
