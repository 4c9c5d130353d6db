"""How a config section reports its problems: `ConfigError`, and `Checks`, which collects a
section's problems and raises them together (or hands them to `dicts.from_dict`)."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from grpo_jax import errors


class ConfigError(errors.InputError):
    """An invalid config; `problems` lists each one as 'dotted.field=value: why'."""

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


class Checks:
    """Collects the problems of one section; `done()` raises them together."""

    def __init__(self, section: str):
        self.section, self.problems = section, []

    def need(self, ok: bool, field: str, value: Any, why: str) -> None:
        if not ok:
            self.problems.append(f"{self.section}.{field}={value!r} {why}")

    def choice(self, field: str, value: Any, allowed: Sequence[Any]) -> None:
        self.need(value in allowed, field, value, f"must be one of {list(allowed)}")

    def call(self, fn, *args, **kwargs) -> Any:
        """Runs a library validator; its ValueError ('name=value ...') is prefixed by section."""
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            self.problems.append(f"{self.section}.{e}")
            return None

    def done(self) -> None:
        collector = COLLECTOR.get()
        if collector is not None:  # inside from_dict: gather, raise once at the end
            collector += self.problems
        elif self.problems:
            raise ConfigError(self.problems)


# While `from_dict` builds a config, sections add their problems here instead of raising, so
# the checks across sections still run and every problem is reported in one error.
COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("collector", default=None)


def positive(checks: Checks, obj, *names: str) -> None:
    for name in names:
        checks.need(getattr(obj, name) >= 1, name, getattr(obj, name), "must be >= 1")
