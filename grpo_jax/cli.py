"""What train.py and plan.py share at the command line: absl's app.run, where an override of a
field the config does not have is one line naming the field and its closest match, and an input
error (`errors.InputError`: a config field, a data, model or checkpoint file) ends the program
with its message alone and exit status 1. Any other exception is a crash and keeps its traceback.
"""

import re

from absl import app, flags

from grpo_jax import errors

CONFIG_DOC = "grpo_jax/config.py and docs/training.md"  # where the fields are listed


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


def parse_flags(argv):
    """absl flag parsing that turns an unknown `--config.a.b` override into one clear line."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
        raise SystemExit(unknown_field_message(e, argv)) from None


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
