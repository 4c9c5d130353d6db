"""Shared config pieces: big_vision's `parse_arg` and the full GRPO config with verl's defaults.

Every knob of train.py is declared once, with a comment, in grpo_jax/config.py (the dataclasses
the library takes); `grpo_config()` turns them into the ml_collections tree. Config files
(gsm8k.py, gsm8k_drgrpo.py, demo.py) start from it and only override. Field names follow
verl 0.9.1 (`actor_rollout_ref.actor.X` -> `actor.X`, `actor_rollout_ref.rollout.X` ->
`rollout.X`, `data.X`, `algorithm.X`, `trainer.X`) so a verl run script ports line by line;
see README "verl override mapping".
"""

import ml_collections
from ml_collections import config_dict

from grpo_jax import config as config_lib
from grpo_jax.data import readers

VERL_GSM8K_INSTRUCTION = readers.VERL_GSM8K_INSTRUCTION


def _autotype(value: str, default):
    """Converts a `:key=value` string to the type of its default (bool accepts True/False/1/0)."""
    if isinstance(default, bool):
        if value in ("True", "true", "1"):
            return True
        if value in ("False", "false", "0"):
            return False
        raise ValueError(f"expected a bool (True/False), got {value!r}")
    if default is None:
        return value
    return type(default)(value)


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
    """Parses a config-file argument `cfg.py:a=1,b,c=x` (big_vision semantics).

    A bare word is `word=True` when `word` is a spec key, else the value of the first spec key
    (so `:smoke` sets smoke and `:qwen2.5-0.5b` would set the first key). Unknown keys raise.

    Args:
      arg: the string after the colon, or None.
      **spec: key -> default; the default's type converts the string.

    Returns:
      A ConfigDict with every spec key.
    """
    arg = arg or ""
    if arg and "," not in arg and "=" not in arg:
        arg = f"{arg}=True" if arg in spec else f"{next(iter(spec))}={arg}"
    raw = {}
    for item in filter(None, arg.split(",")):
        key, _, value = item.partition("=")
        raw[key] = value if "=" in item else "True"
    unknown = sorted(set(raw) - set(spec))
    if unknown:
        raise ValueError(f"unknown config arg(s) {unknown}; allowed: {sorted(spec)}")
    out = {k: _autotype(raw[k], d) if k in raw else d for k, d in spec.items()}
    return ml_collections.ConfigDict(out)


def grpo_config() -> ml_collections.ConfigDict:
    """The full config tree: grpo_jax.config.RunConfig's sections, fields and defaults.

    grpo_jax/config.py declares every field once, with its comment and its checks; this turns
    the defaults into the locked ml_collections tree that `--config.X=...` overrides. A field
    whose default is None becomes a typed placeholder, so an override is still type-checked.
    """
    return _config_dict(config_lib.defaults_with_types(config_lib.RunConfig))


def _config_dict(tree: dict) -> ml_collections.ConfigDict:
    out = ml_collections.ConfigDict()
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _config_dict(value)
        elif isinstance(value, tuple) and len(value) == 2 and value[0] == "placeholder":
            out[key] = config_dict.placeholder(value[1])
        else:
            out[key] = value
    return out


def use_builtin_task(c: ml_collections.ConfigDict) -> None:
    """Switches `c` to the shipped arithmetic task, char tokenizer and a random tiny model."""
    c.data.source = "arithmetic"
    c.data.path = c.data.val_path = None  # the recipe's files are not read
    c.data.prompt_suffix = ""
    c.model.source = "random"
    c.model.tokenizer = "char"
    c.model.path = None
    c.reward.fn = "grpo_jax.rewards.functions:gsm8k_score"  # verl's strict "####" scorer


def two_layer_model(c: ml_collections.ConfigDict) -> None:
    """The random model of the CPU demos (demo.py:tiny, code.py:tiny): 2 layers of width 64."""
    c.model.tiny.hidden_size = 64
    c.model.tiny.intermediate_size = 256
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 4
    c.model.tiny.num_kv_heads = 2
    c.model.tiny.head_dim = 16


def make_smoke(c: ml_collections.ConfigDict) -> None:
    """The `:smoke` variant: same code path, tiny random model, synthetic prompts, 2 steps."""
    use_builtin_task(c)
    c.data.arithmetic.num_train = 64
    c.data.arithmetic.num_val = 8
    c.data.train_batch_size = 4
    c.data.val_batch_size = 8
    c.data.max_prompt_length = 32
    c.data.max_response_length = 8
    c.actor.ppo_mini_batch_size = 2
    c.actor.ppo_micro_batch_size_per_gpu = 5  # rollout.n = 5 (recipe): 2 micro-batches
    c.rollout.log_prob_micro_batch_size_per_gpu = 10
    # Token budgets (where the recipe packs) of 4 rows of 128 tokens: several micro-batches.
    c.actor.ppo_max_token_len_per_gpu = 512
    c.rollout.log_prob_max_token_len_per_gpu = 512
    c.trainer.total_training_steps = 2
    c.trainer.test_freq = -1
    c.trainer.save_freq = 1
    c.trainer.default_local_dir = "runs/smoke"
