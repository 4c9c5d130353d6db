"""Named user extensions: the registry behind `advantage.register_adv_est` and
`loss.register_policy_loss` (verl's `register_adv_est` / `register_policy_loss`), and how a
config names a user function ("module:function", `import_callable`).

The built-in estimators and losses are dispatched with a plain `match` in their modules; a
`Registry` only holds what users add, by name, so a config can name it. Standard library only:
`grpo_jax.loss` and `grpo_jax.advantage` stay free of heavy imports.
"""

import importlib
from collections.abc import Callable, Sequence

# Modules of grpo_jax 0.1's flat layout, by their new names: a spec written for the old layout
# ("grpo_jax.reward_score:gsm8k_score", in a config or a checkpoint's config.json) still resolves.
MOVED_MODULES = {
    "grpo_jax.data": "grpo_jax.data.prompts",
    "grpo_jax.dataset": "grpo_jax.data.readers",
    "grpo_jax.demo_task": "grpo_jax.data.demo_task",
    "grpo_jax.rewards": "grpo_jax.rewards.functions",
    "grpo_jax.reward_score": "grpo_jax.rewards.scorers",
    "grpo_jax.reward_pool": "grpo_jax.rewards.pool",
}


def split_list(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A comma-separated string (or a sequence of strings) -> stripped, non-empty items."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(s.strip() for s in items if s.strip())


def import_callable(spec: str, *, what: str = "reward function") -> Callable:
    """Imports the callable a config names as "module:function" (a dotted attribute path after
    the colon is followed). `what` names it in errors (a reward function, a policy loss...).

    Raises:
      ValueError: the spec is malformed, the module does not import, or the name is missing
        or not callable.
    """
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} must be 'module:function', got {spec!r}")
    module_name = MOVED_MODULES.get(module_name, module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r} is not callable")
    return fn


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
        """The function registered as `name`; a "module:function" name is imported at its first
        use and kept under that name (a config can name a user function without registering
        it)."""
        if name not in self._fns and isinstance(name, str) and ":" in name:
            self._fns[name] = import_callable(name, what=self.kind)
        return self._fns[name]

    def check(self, field: str, name) -> None:
        """Raises ValueError('field=name ...') unless `name` is built in, registered, or a
        "module:function" that imports (it is not registered by the check)."""
        if name in self.builtins or name in self._fns:
            return
        if isinstance(name, str) and ":" in name:
            try:
                import_callable(name, what=self.kind)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
            return
        raise ValueError(
            f"{field}={name!r} must be one of {list(self.names())} or a 'module:function'"
        )

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
