"""Decoder-only transformers (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3.x): the face of grpo_jax/models/.

What users and the rest of grpo_jax call on ``grpo_jax.model``; each name lives in one file of
grpo_jax/models/:

  config       ``ModelConfig`` (hyper-parameters, HF config.json in and out)
  transformer  the Flax NNX modules used functionally: ``forward``, ``hidden_states``,
               ``hidden_states_packed``, ``hidden_states_and_routing`` (MoE router stats),
               ``unembed``; params (``init_params``,
               ``abstract_params``, ``logical_axes``, LoRA adapter shapes); the remat policy
  attention    grouped-query softmax attention (``CAUSAL_BLOCK``: its causal block size)
  moe          Qwen3-MoE's routing, grouped experts and load-balancing loss
  decode       KV caches (``KVCache``, ``GroupKVCache``, ``DecodeParams``), ``prefill``,
               ``decode_step`` (and their ``_and_routing`` forms: the MoE experts chosen)
  reward_head  the sequence-classification (reward model) head: ``scores``
  hf           HF safetensors: ``load_hf_checkpoint``, ``load_hf_sequence_classifier``,
               ``save_hf_checkpoint``,
               ``to_hf_state_dict``, ``HF_TO_JAX`` (the name and layout table)
  gguf         llama.cpp GGUF files: ``load_gguf``
  lora         LoRA adapters (configure, init, attach, merge)

``load(path)`` reads either checkpoint kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from grpo_jax.models import gguf, hf
from grpo_jax.models.attention import CAUSAL_BLOCK, MAX_CAUSAL_BLOCKS  # noqa: F401
from grpo_jax.models.config import (  # noqa: F401
    ADAPTERS,
    ARCHITECTURES,
    ATTENTION_IMPLS,
    KV_CACHE_DTYPES,
    LORA_TARGETS,
    REMAT_POLICIES,
    ModelConfig,
)
from grpo_jax.models.decode import (  # noqa: F401
    DECODE_BLOCK,
    MAX_DECODE_BLOCKS,
    DecodeParams,
    GroupKVCache,
    KVCache,
    cache_dtype,
    decode_blocks,
    decode_params,
    decode_step,
    decode_step_and_routing,
    group_cache,
    init_cache,
    prefill,
    prefill_and_routing,
    take_rows,
)
from grpo_jax.models.hf import (  # noqa: F401
    HF_TO_JAX,
    load_hf_checkpoint,
    load_hf_sequence_classifier,
    place,
    to_hf_state_dict,
)
from grpo_jax.models.hf import save as save_hf_checkpoint  # noqa: F401
from grpo_jax.models.transformer import (  # noqa: F401
    MLP,
    Attention,
    Decoder,
    DecoderLayer,
    LoraParam,
    MoE,
    RMSNorm,
    abstract_adapters,
    abstract_params,
    adapter_logical_axes,
    check_adapters,
    check_params,
    forward,
    hidden_states,
    hidden_states_and_routing,
    hidden_states_packed,
    hidden_states_packed_and_routing,
    init_params,
    logical_axes,
    remat_policy_fn,
    unembed,
)

load_gguf = gguf.load


def load(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[ModelConfig, Any], Any] | None = None,
) -> tuple[ModelConfig, dict]:
    """``load_gguf`` for a path ending in ``.gguf``, ``load_hf_checkpoint`` (dir or hub id) else.

    Args:
      dtype: param and compute dtype of the returned config; weights are cast to it.
      shardings: optional ``(config, abstract_params) -> pytree of jax.sharding.Sharding``; each
        param is placed in its sharding as soon as it is read.
    """
    if os.fspath(path).lower().endswith(".gguf"):
        return gguf.load(path, dtype=dtype, shardings=shardings)
    return hf.load_hf_checkpoint(path, dtype=dtype, shardings=shardings)
