"""Transport options from plain values: what a node's ``--kv-transfer-config`` (JSON) becomes, field
by field, each value checked against its field's type, and the checks the options dataclasses run on
themselves (``require``). Imports nothing of ``kv_transfer``: every options module may use it."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping


def require(options: object, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the first field of ``options`` out of its range: ``positive`` ones
    must be > 0, ``non_negative`` ones >= 0; floats also finite (0 and a NaN, the usual mistakes,
    would otherwise hang or spin a transport rather than fail at start)."""
    for names, low, words in ((positive, 0, "> 0"), (non_negative, None, ">= 0")):
        for name in names:
            value = getattr(options, name)
            ok = math.isfinite(value) and (value > 0 if low is not None else value >= 0)
            if not ok:
                raise ValueError(f"{type(options).__name__}.{name} must be {words}, got {value!r}")


def from_mapping(cls: type, values: object, where: str):
    """An options dataclass ``cls`` with the fields ``values`` (a mapping, as JSON gives it) names,
    the others at their defaults; nested options dataclasses from nested mappings. ``where`` names
    the place in the config for errors. Raises ValueError for an unknown field, a value of the wrong
    type (no silent conversions: an int where a float goes is fine, a string or a bool where a
    number goes is not) or out of range (the class's own checks)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be a JSON object of {cls.__name__}'s fields, got {values!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise ValueError(f"{where}: unknown option {names} ({cls.__name__} has {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _value(hints[name], value, f"{where}.{name}") for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _value(hint: type, value: object, where: str):
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"{where}: options of type {hint} cannot be given in a config")
    if not ok:
        raise ValueError(f"{where} must be {hint.__name__}, got {value!r}")
    return value
