"""What train.py and plan.py share at the command line: absl's app.run, where an override of a
field the config does not have is one line naming the field and its closest match, and an input
error (`errors.InputError`: a config field, a data, model or checkpoint file) ends the program
with its message alone and exit status 1. Any other exception is a crash and keeps its traceback.
"""

import re

from absl import app, flags

from grpo_jax import errors

CONFIG_DOC = "grpo_jax/config/ and docs/training.md"  # where the fields are listed


def unknown_field_message(error: Exception, argv) -> str:
    """One line for an override of a field the config does not have: ml_collections' error
    (`'\\'clip_ration\\'\\nDid you mean "clip_ratio" ...'`) names the missing key and maybe a
    close match; the flag names the path to it."""
    text = str(error).encode().decode("unicode_escape")  # ml_collections escapes its message
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
    key = names[0] if names else text
    guess = re.search(r'Did you mean "([^"]+)"', text)
    for arg in argv[1:]:
        parts = arg.split("=", 1)[0].removeprefix("--config.").split(".")
        if arg.startswith("--config.") and key in parts:
            path = ".".join(parts[: parts.index(key) + 1])
            if guess:
                near = ".".join(parts[: parts.index(key)] + [guess.group(1)])
                return f"unknown config field {path} (did you mean {near}?)"
            return f"unknown config field {path} (see {CONFIG_DOC} for the fields)"
    return f"unknown config field {key!r} (see {CONFIG_DOC} for the fields)"


NULLS = ("None", "null")  # verl's Hydra spelling and Python's


def _null_overrides(argv) -> tuple[list, list[str]]:
    """(argv without them, paths): the `--config.a.b=None` / `=null` overrides whose path is
    not set again later. ml_collections parses an override by the field's type, so it cannot
    give a float or str field None; these are applied after parsing (`_apply_nulls`)."""
    last = {arg.partition("=")[0]: i for i, arg in enumerate(argv)}  # flag -> its last index
    keep, paths = [], []
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if not (flag.startswith("--config.") and value in NULLS):
            keep.append(arg)
        elif last[flag] == i:
            paths.append(flag.removeprefix("--config."))
    return keep, paths


def _apply_nulls(paths, argv) -> None:
    """Sets each path of the parsed --config to None, where the field allows it."""
    from grpo_jax import config as config_lib

    if not paths:
        return
    tree = flags.FLAGS["config"].value
    for path in paths:
        *parents, leaf = path.split(".")
        node = tree
        try:
            for name in parents:
                node = node[name]
            node[leaf]  # noqa: B018 - raises for a field the config does not have
        except (AttributeError, KeyError) as e:
            raise SystemExit(unknown_field_message(e, argv)) from None
        if config_lib.accepts_none(path) is False:
            raise SystemExit(
                f"error: --config.{path} cannot be None or null (grpo_jax/config/ declares "
                "it without None; give a value)"
            )
        node[leaf] = None


def parse_flags(argv):
    """absl flag parsing that turns an unknown `--config.a.b` override into one clear line, and
    takes `--config.a.b=None` (or verl's `null`) for the fields that may be None."""
    kept, nulls = _null_overrides(argv)
    try:
        rest = flags.FLAGS(kept)
    except (AttributeError, KeyError) as e:
        raise SystemExit(unknown_field_message(e, argv)) from None
    _apply_nulls(nulls, argv)
    return rest


def run(main_fn, argv=None) -> None:
    """app.run, with input errors (errors.InputError: a config field, a data or model file)
    ending the CLI with their message alone and exit status 1; other exceptions are crashes and
    keep their traceback."""

    def guarded(args):
        try:
            return main_fn(args)
        except errors.InputError as e:
            raise SystemExit(f"error: {e}") from None

    app.run(guarded, argv=argv, flags_parser=parse_flags)
