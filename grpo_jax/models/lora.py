"""LoRA (Hu et al. 2021, arXiv 2106.09685): low-rank adapters trained on a frozen base model.

This module owns the adapters as a pytree of their own and everything done to them outside the
forward pass:

  * `configure` / `parse_target_modules`: verl's `model.lora_rank`, `model.lora_alpha` and
    `model.target_modules` ("all-linear" or projection names) onto `model.ModelConfig`'s LoRA
    fields (the shapes; static under jit).
  * `init_adapters`: PEFT's default initialisation (`init_lora_weights=True`, what verl uses):
    A [*in, r] kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and
    B [r, *out] zeros, so an untrained adapter leaves the model exactly the base. float32,
    whatever the base's param_dtype.
  * `attach` / `split`: the params the model runs with are the base dict plus the adapters
    under ``params["lora"]`` (a shallow dict: nothing is copied). model.py's projections then
    add scale * (x @ A) @ B, scale = alpha / r, without merging; the base alone (adapters
    disabled) is the reference policy, as in verl.
  * `merge`: the base with W + scale * A @ B folded into every targeted kernel (computed in
    float32, stored in the base's dtype): what an HF export and a vLLM weight push of the merged
    model get.

Shapes (per layer, stacked on L like the kernels; model.abstract_adapters lists them): a kernel
[*in, *out] (q_proj [D, N, H], o_proj [N, H, D], down_proj [F, D], ...) gets A [*in, r] with the
kernel's logical axes on `in` and B [r, *out] with them on `out`; the rank axis is replicated.
So under FSDP / tensor parallelism the adapters split exactly like their kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from grpo_jax.models import config as config_lib
from grpo_jax.models import transformer

ALL_LINEAR = "all-linear"  # PEFT / verl: every linear layer except the output head
ADAPTERS = config_lib.ADAPTERS


def parse_target_modules(value: str | Sequence[str]) -> tuple[str, ...]:
    """verl's target_modules: "all-linear", or projection names (a comma-separated string or a
    list) out of model.LORA_TARGETS, in that order.

    Raises:
      ValueError: 'target_modules=<value> why' (empty, unknown or repeated names).
    """
    if isinstance(value, str) and value.strip() == ALL_LINEAR:
        return config_lib.LORA_TARGETS
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(s).strip() for s in items if str(s).strip()]
    unknown = [n for n in names if n not in config_lib.LORA_TARGETS]
    if not names or unknown or len(set(names)) < len(names):
        why = (
            f"names unknown projections {unknown}" if unknown
            else "repeats a name" if names else "is empty"
        )  # fmt: skip
        raise ValueError(
            f"target_modules={value!r} {why}: use {ALL_LINEAR!r} or comma-separated names out "
            f"of {list(config_lib.LORA_TARGETS)}"
        )
    return tuple(n for n in config_lib.LORA_TARGETS if n in names)


def configure(
    config: config_lib.ModelConfig, *, rank: int, alpha: float, target_modules: str | Sequence[str]
) -> config_lib.ModelConfig:
    """`config` with the LoRA adapters of rank `rank` (0 = none) on `target_modules`."""
    if rank == 0:
        return dataclasses.replace(config, lora_rank=0, lora_targets=())
    return dataclasses.replace(
        config,
        lora_rank=rank,
        lora_alpha=float(alpha),
        lora_targets=parse_target_modules(target_modules),
    )


def attach(base, adapters) -> dict:
    """The params that run base + adapters (unmerged): the base dict plus ``"lora": adapters``."""
    if ADAPTERS in base:
        raise ValueError(f"the base params already carry adapters (params[{ADAPTERS!r}])")
    return {**base, ADAPTERS: adapters}


def split(params) -> tuple[dict, dict | None]:
    """(base, adapters or None): the inverse of `attach` (no adapters: the params themselves)."""
    if not isinstance(params, Mapping) or ADAPTERS not in params:
        return params, None
    return {k: v for k, v in params.items() if k != ADAPTERS}, params[ADAPTERS]


def _targets(config: config_lib.ModelConfig, tree):
    """(group, projection, node) of every adapted projection in a params-shaped `tree`."""
    for group, node in tree["layers"].items():
        for name in sorted(node):
            if name in config.lora_targets:
                yield group, name, node[name]


def init_adapters(config: config_lib.ModelConfig, rng, *, shardings=None) -> dict:
    """Fresh adapters (PEFT's default: A kaiming-uniform, B zeros), float32.

    Args:
      config: a ModelConfig with lora_rank > 0.
      rng: a jax.random key.
      shardings: optional pytree of shardings (sharding.adapter_shardings): the adapters are
        then created in place on their devices.

    Returns:
      The adapters pytree (structure and shapes: model.abstract_adapters).
    """
    fn = jax.jit(functools.partial(_init_adapters, config), out_shardings=shardings)
    return fn(rng)


def _init_adapters(config: config_lib.ModelConfig, rng) -> dict:
    abstract = transformer.abstract_adapters(config)
    out: dict = {"layers": {}}
    for i, (group, name, node) in enumerate(_targets(config, abstract)):
        a, b = node["lora_a"], node["lora_b"]
        fan_in = math.prod(a.shape[1:-1])  # [L, *in, r]: PEFT's lora_A is Linear(fan_in, r)
        bound = 1.0 / math.sqrt(fan_in)
        key = jax.random.fold_in(rng, i)
        out["layers"].setdefault(group, {})[name] = {
            "lora_a": jax.random.uniform(key, a.shape, jnp.float32, -bound, bound),
            "lora_b": jnp.zeros(b.shape, jnp.float32),
        }
    return out


def delta(a, b, scale: float):
    """scale * A @ B of one stacked adapter, [L, *in, r] x [L, r, *out] -> [L, *in, *out] f32."""
    num_layers, rank = a.shape[0], a.shape[-1]
    a_LIR = a.astype(jnp.float32).reshape(num_layers, -1, rank)
    b_LRO = b.astype(jnp.float32).reshape(num_layers, rank, -1)
    d_LIO = jnp.einsum("LIR,LRO->LIO", a_LIR, b_LRO, precision=jax.lax.Precision.HIGHEST)
    return (d_LIO * scale).reshape(*a.shape[:-1], *b.shape[2:])


def merge(config: config_lib.ModelConfig, params) -> dict:
    """The base params with the adapters folded in: kernel + scale * A @ B per target.

    Args:
      config: the ModelConfig with the adapters' rank, alpha and targets.
      params: `attach(base, adapters)`.

    Returns:
      Params of the base's structure and dtypes (no "lora" entry). Only the targeted kernels are
      new arrays; every other leaf is the base's own (no copy). The sum is taken in float32 and
      rounded once to the kernel's dtype (with bfloat16 base weights that rounding can swallow
      part of a small update; base + adapter unmerged keeps it).
    """
    base, adapters = split(params)
    if adapters is None:
        raise ValueError(f"merge needs params with adapters (lora.attach); got no {ADAPTERS!r}")
    kernels = {
        (group, name): base["layers"][group][name]["kernel"]
        for group, name, _ in _targets(config, adapters)
    }
    merged = _merged_kernels(config, kernels, adapters)
    layers = {group: dict(node) for group, node in base["layers"].items()}
    for (group, name), kernel in merged.items():
        layers[group][name] = {**layers[group][name], "kernel": kernel}
    return {**base, "layers": layers}


@functools.partial(jax.jit, static_argnums=0)
def _merged_kernels(config: config_lib.ModelConfig, kernels: dict, adapters) -> dict:
    out = {}
    for group, name, node in _targets(config, adapters):
        kernel = kernels[(group, name)]
        d = delta(node["lora_a"], node["lora_b"], config.lora_scale)
        out[(group, name)] = (kernel.astype(jnp.float32) + d).astype(kernel.dtype)
    return out


def num_params(config: config_lib.ModelConfig) -> int:
    """Trainable parameters of the adapters (r x (fan_in + fan_out) per target and layer)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(transformer.abstract_adapters(config)))
