"""Config dataclasses to and from nested dicts: `from_dict` (collects every section's problems
into one ConfigError), `to_dict`, and the typed defaults configs/common.py builds its
ml_collections tree from."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from grpo_jax.config.checks import COLLECTOR, ConfigError
from grpo_jax.config.run import RunConfig


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def from_dict(cls, values: Mapping[str, Any], *, section: str = ""):
    """Builds dataclass `cls` from nested dicts (e.g. `ConfigDict.to_dict()`).

    Unknown keys are problems; the problems of every section, and those across sections, are
    collected and raised together as one ConfigError. Lists become tuples.
    """
    if COLLECTOR.get() is None:
        problems: list[str] = []
        token = COLLECTOR.set(problems)
        try:
            built = from_dict(cls, values, section=section)
        finally:
            COLLECTOR.reset(token)
        if problems:
            raise ConfigError(problems)
        return built
    problems = []
    kwargs = {}
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            problems.append(f"{section}{key}: unknown field (allowed: {sorted(names)})")
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, tp = values[f.name], hints[f.name]
        if _is_dataclass_type(tp):
            if not isinstance(value, Mapping):
                problems.append(f"{section}{f.name}: expected a section, got {value!r}")
                continue
            kwargs[f.name] = from_dict(tp, value, section=f"{section}{f.name}.")
            continue
        kwargs[f.name] = _to_tuples(value)
    COLLECTOR.get().extend(problems)
    return cls(**kwargs)


def _to_tuples(value):
    if isinstance(value, (list, tuple)):
        return tuple(_to_tuples(v) for v in value)
    return value


def to_dict(obj) -> dict:
    """The nested-dict form of a config dataclass (tuples kept), e.g. for workdir/config.json."""
    return {
        f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
        for f in dataclasses.fields(obj)
    }


def accepts_none(path: str, cls=None) -> bool | None:
    """Whether the field at dotted `path` of `cls` (default RunConfig) may be None (verl's
    `null`): its annotation includes None. None when `path` names no field."""
    tp = cls or RunConfig
    for name in path.split("."):
        if not _is_dataclass_type(tp):
            return None
        hints = _field_types(tp)
        if name not in hints:
            return None
        tp = hints[name]
    if _is_dataclass_type(tp):
        return None
    return type(None) in typing.get_args(tp)


def defaults_with_types(cls) -> dict[str, Any]:
    """{field: default or ("placeholder", type)} for `cls` and its sections, recursively.

    configs/common.py builds the ml_collections tree from this; a None default comes with the
    type its annotation allows, so an override is type-checked.
    """
    return _defaults_of(cls())


def _defaults_of(instance) -> dict[str, Any]:
    out = {}
    hints = _field_types(type(instance))
    for f in dataclasses.fields(instance):
        value, tp = getattr(instance, f.name), hints[f.name]
        if _is_dataclass_type(tp):
            out[f.name] = _defaults_of(value)
        elif value is None:
            out[f.name] = ("placeholder", _first_concrete_type(tp))
        else:
            out[f.name] = value
    return out


def _first_concrete_type(tp):
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) else ()
    for arg in args or (tp,):
        origin = typing.get_origin(arg) or arg
        if origin is not type(None):
            return origin
    raise TypeError(f"no concrete type in {tp}")
