"""Named user extensions: the registry behind `advantage.register_adv_est` and
`loss.register_policy_loss` (verl's `register_adv_est` / `register_policy_loss`).

The built-in estimators and losses are dispatched with a plain `match` in their modules; a
`Registry` only holds what users add, by name, so a config can name it. Standard library only:
`grpo_jax.loss` and `grpo_jax.advantage` stay free of heavy imports.
"""

from collections.abc import Callable


class Registry:
    """User functions of one kind ("advantage estimator", "policy loss"), by name."""

    def __init__(self, kind: str, builtins: tuple[str, ...]):
        self.kind, self.builtins = kind, builtins
        self._fns: dict[str, Callable] = {}

    def names(self) -> tuple[str, ...]:
        """The built-in names, then the registered ones, in registration order."""
        return self.builtins + tuple(self._fns)

    def __contains__(self, name) -> bool:
        return name in self._fns

    def __getitem__(self, name: str) -> Callable:
        return self._fns[name]

    def decorator(self, name: str, *, caller: str) -> Callable[[Callable], Callable]:
        """`@decorator(name)`: adds fn under name and returns fn unchanged.

        Raises:
          ValueError: the name is empty, built in, or taken by another function (registering
            the same function again under the same name is a no-op).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{caller} needs a non-empty string name, got {name!r}")
        if name in self.builtins:
            raise ValueError(f"{self.kind} {name!r} is built in; pick another name")

        def register(fn: Callable) -> Callable:
            existing = self._fns.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered: {existing!r}")
            self._fns[name] = fn
            return fn

        return register
