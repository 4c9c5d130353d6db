"""Decoder-only transformers (Qwen2/Qwen2.5, Qwen3, Llama 3.x) and their Hugging Face checkpoints.

This module owns the policy/reference model of grpo_jax: the Flax NNX modules, the functional
facade the trainer and the sampler call (``forward``, ``hidden_states``, ``unembed``, ``prefill``,
``decode_step``), the KV cache pytree, and the mapping to and from Hugging Face safetensors.

Design:
  * The modules are Flax NNX, used functionally: the module tree is built once (abstractly) per
    ``ModelConfig``, and every public function takes the parameters as a plain nested dict of
    arrays (``params``) and merges them into the module graph inside the trace. So params are an
    ordinary pytree for optax, orbax and ``jax.jit``.
  * The decoder layers are stacked on a leading ``L`` axis and run with ``jax.lax.scan`` (one layer
    is compiled once, whatever the depth). Optional per-layer rematerialisation wraps the scan body
    in ``jax.checkpoint``. Decode loops (the sampler) use a per-layer form instead: the cache as
    ``GroupKVCache`` (per-layer buffers, each prompt stored once per group) and the weights as
    ``DecodeParams``, layers unrolled, so that a decode step copies neither the cache nor the
    weights (see there).
  * Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
    ``head_dim``, ``mlp``; the stacked layer axis is ``None``) as ``nnx.with_partitioning``
    metadata; ``logical_axes(config)`` exposes them as a pytree of ``PartitionSpec``.
  * Positions come from the attention mask (cumsum - 1), so a left-padded row gives exactly the
    logits of the unpadded row on its real tokens.
  * Activations carry ``nn.with_logical_constraint`` annotations at five points (embedding out,
    queries, attention out, MLP hidden, logits). They are no-ops unless the caller activates logical
    axis rules (``nn.logical_axis_rules``) under a mesh; the mesh and rules belong to sharding.py.
  * Computation happens in ``config.dtype`` (float32 unless the caller asks otherwise); softmax,
    RMSNorm statistics and the logits are always float32.

Params structure (``N`` query heads, ``K`` kv heads, ``H`` head dim, ``F`` MLP width)::

    embed/embedding                [V, D]        (vocab, embed)
    layers/input_norm/scale        [L, D]        (None, embed)
    layers/attn/q_proj/kernel      [L, D, N, H]  (None, embed, heads, head_dim)
    layers/attn/q_proj/bias        [L, N, H]     only when config.qkv_bias
    layers/attn/k_proj/kernel      [L, D, K, H]  (None, embed, kv_heads, head_dim)  (+ bias)
    layers/attn/v_proj/kernel      [L, D, K, H]  (+ bias)
    layers/attn/o_proj/kernel      [L, N, H, D]  (None, heads, head_dim, embed)
    layers/attn/q_norm/scale       [L, H]        only when config.qk_norm (Qwen3)
    layers/attn/k_norm/scale       [L, H]
    layers/post_attn_norm/scale    [L, D]
    layers/mlp/gate_proj/kernel    [L, D, F]     (None, embed, mlp)
    layers/mlp/up_proj/kernel      [L, D, F]
    layers/mlp/down_proj/kernel    [L, F, D]     (None, mlp, embed)
    final_norm/scale               [D]
    lm_head/kernel                 [D, V]        only when not config.tie_word_embeddings
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
_ARCH_TO_HF = {arch: hf for hf, arch in ARCHITECTURES.items()}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = (
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "dots_except_mlp_in_saveable",
)
# The projections LoRA can adapt (HF module names; PEFT's "all-linear" is all of them: the
# output head is excluded, as PEFT does).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The params key of the LoRA adapters (a separate subtree, grpo_jax/lora.py).
ADAPTERS = "lora"


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder; frozen and hashable, so it is a valid ``jit`` static arg.

    Dimension letters (house style): V vocab_size, D hidden_size, F intermediate_size, L num_layers,
    N num_heads, K num_kv_heads, H head_dim.

    Attributes:
      arch: "qwen2" (q/k/v bias), "qwen3" (q/k RMSNorm) or "llama" (Llama 3.x, SmolLM2).
      rope_scaling: None, or the HF ``rope_scaling`` dict as a sorted tuple of (key, value) pairs
        (a dict passed here is converted). Supported ``rope_type``: default, linear, llama3.
      dtype: compute dtype (activations, matmul inputs). float32 unless asked otherwise.
      param_dtype: storage dtype of the parameters.
      remat: rematerialise each decoder layer in the backward pass (``jax.checkpoint``).
      remat_policy: what a rematerialised layer keeps, a ``jax.checkpoint_policies`` name:
        "nothing_saveable" (only the layer inputs; the most recompute), "dots_saveable" (every
        matmul output), "dots_with_no_batch_dims_saveable" (the projections, not attention's
        batched matmuls: the attention scores are recomputed, the rest is kept),
        "dots_except_mlp_in_saveable" (those projections but the MLP's gate and up, the
        largest: MaxText's "save_dot_except_mlpwi"; see ``remat_policy_fn``).
      eos_token_ids: every EOS id from config.json (an int or list there).
      lora_rank: r of the LoRA adapters (grpo_jax/lora.py) the projections in `lora_targets`
        take when the params carry them (``params["lora"]``); 0 = no adapters. The adapters
        add (alpha / r) * (x @ A) @ B to each targeted projection; params without them run the
        base model, whatever these fields say.
      lora_alpha: LoRA's alpha (scale alpha / r).
      lora_targets: projection names in LORA_TARGETS (HF names: q_proj, ..., down_proj).
    """

    arch: str = "qwen2"
    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False
    remat_policy: str = "nothing_saveable"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.arch not in _ARCH_TO_HF:
            raise ValueError(
                f"ModelConfig.arch={self.arch!r} is not supported; expected one of "
                f"{sorted(_ARCH_TO_HF)}"
            )
        # Normalise to hashable, comparable values (np.dtype, tuples).
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "param_dtype", np.dtype(self.param_dtype))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)} is not supported; "
                    "expected float32 or bfloat16"
                )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat_policy={self.remat_policy!r}; expected one of {REMAT_POLICIES}"
            )
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank={self.lora_rank} must be >= 0 (0 = no LoRA)")
        if self.lora_rank:
            unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
            if (
                not self.lora_targets
                or unknown
                or len(set(self.lora_targets)) < len(self.lora_targets)
            ):
                raise ValueError(
                    f"ModelConfig.lora_targets={self.lora_targets} must name each of "
                    f"{LORA_TARGETS} at most once, at least one of them"
                )
            if not self.lora_alpha > 0:
                raise ValueError(f"ModelConfig.lora_alpha={self.lora_alpha} must be > 0")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"ModelConfig: rope_type={rope_type!r} is not supported for arch={self.arch!r}; "
                f"expected one of {_SUPPORTED_ROPE_TYPES}"
            )

    @property
    def lora_scale(self) -> float:
        """LoRA's scale alpha / r (0 without adapters)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        """rope_scaling as a plain dict ({} when there is none)."""
        return {k: _thaw(v) for k, v in (self.rope_scaling or ())}

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """The test model: L=2, D=32, N=4, K=2, H=8, F=64, V=128 (Qwen2-style, tied)."""
        return cls(**overrides)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any] | Any) -> ModelConfig:
        """Builds the config from a HF checkpoint dir, a config.json dict or a PretrainedConfig.

        The config is read through ``transformers.AutoConfig``, which understands both config.json
        layouts: transformers 5 (``rope_parameters``, ``dtype``) and the older hub one (top-level
        ``rope_theta``/``rope_scaling``, ``torch_dtype``, Qwen2 without ``head_dim``). The
        checkpoint's ``torch_dtype`` is ignored: the compute and param dtypes stay float32 unless
        changed with ``dataclasses.replace``.

        Raises:
          ValueError: unknown architecture, or a feature this model does not implement (sliding
            window attention, o_proj / MLP biases, activations other than SiLU).
        """
        import transformers  # Deferred: only checkpoint IO needs it.

        if isinstance(path_or_dict, transformers.PretrainedConfig):
            hf = path_or_dict
        elif isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
            if "model_type" not in raw:
                raise ValueError("ModelConfig.from_hf: config dict has no 'model_type'")
            hf = transformers.AutoConfig.for_model(**raw)
        else:
            hf = transformers.AutoConfig.from_pretrained(os.fspath(path_or_dict))
        archs = list(getattr(hf, "architectures", None) or [])
        if not archs:  # Our arch names are HF model_type names.
            archs = [_ARCH_TO_HF.get(hf.model_type, f"<model_type {hf.model_type!r}>")]
        if archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {archs[0]!r}; grpo_jax.model supports "
                f"{sorted(ARCHITECTURES)}"
            )
        arch = ARCHITECTURES[archs[0]]
        if getattr(hf, "use_sliding_window", False):
            raise ValueError(
                f"{archs[0]}: sliding-window attention (use_sliding_window) is unsupported"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"{archs[0]}: hidden_act={hf.hidden_act!r} is unsupported (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{archs[0]}: mlp_bias=True is unsupported")
        if arch == "qwen2":
            qkv_bias = True  # Qwen2 always has q/k/v bias and no o_proj bias.
        else:
            if getattr(hf, "attention_bias", False):
                raise ValueError(f"{archs[0]}: attention_bias=True (o_proj bias) is unsupported")
            qkv_bias = False
        rope = _rope_from_hf(hf)
        rope_theta = float(rope.pop("rope_theta"))
        if rope.get("rope_type", "default") == "default":
            rope_scaling = None
        else:
            rope_scaling = rope
        eos = hf.eos_token_id
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=arch == "qwen3",
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=getattr(hf, "pad_token_id", None),
            initializer_range=getattr(hf, "initializer_range", 0.02),
        )

    def to_hf_dict(self, *, untie_embeddings: bool = False) -> dict[str, Any]:
        """config.json contents (transformers 5 layout) that transformers and vLLM load."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta} | self.rope_scaling_dict
        out = {
            "architectures": [_ARCH_TO_HF[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            # Older readers (vLLM, transformers 4) look here.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict or None,
            "tie_word_embeddings": self.tie_word_embeddings and not untie_embeddings,
            "initializer_range": self.initializer_range,
            "dtype": self.param_dtype.name,
            "torch_dtype": self.param_dtype.name,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_ids)
                if len(self.eos_token_ids) > 1
                else (self.eos_token_ids[0] if self.eos_token_ids else None)
            ),
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.arch in ("qwen2", "qwen3"):
            out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}
        if self.arch in ("llama", "qwen3"):
            out["attention_bias"] = False
        if self.arch == "llama":
            out["mlp_bias"] = False
        return out


def _freeze(d: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    def freeze_value(v):
        if isinstance(v, Mapping):
            return _freeze(v)
        if isinstance(v, list):
            return tuple(freeze_value(x) for x in v)
        return v

    return tuple(sorted((str(k), freeze_value(v)) for k, v in d.items()))


def _thaw(v):
    return list(v) if isinstance(v, tuple) else v


def _rope_from_hf(hf) -> dict[str, Any]:
    """{rope_theta, rope_type, ...scaling keys} from either config layout."""
    params = getattr(hf, "rope_parameters", None)
    if params:  # transformers 5 (also what AutoConfig builds from the older layout).
        rope = dict(params)
        if "full_attention" in rope and isinstance(rope["full_attention"], Mapping):
            rope = dict(rope["full_attention"])
    else:
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope["rope_theta"] = hf.rope_theta
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    return rope


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _param(rngs, init, shape, axes, dtype) -> nnx.Param:
    """A parameter with logical axis names as metadata (not sharded here: names are logical)."""
    init = nnx.with_partitioning(init, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), eager_sharding=False)


class RMSNorm(nnx.Module):
    """HF LlamaRMSNorm: float32 statistics, then the weight times the input-dtype result."""

    def __init__(self, dim: int, axis: str, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, nnx.initializers.ones, (dim,), (axis,), param_dtype)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(self.dtype)
        return y.astype(self.dtype) * scale.reshape((1,) * (y.ndim - 1) + scale.shape)


class Attention(nnx.Module):
    """Grouped-query self-attention projections (with Qwen2 bias, Qwen3 q/k norm)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        w_init = nnx.initializers.normal(c.initializer_range)
        pdt = c.param_dtype
        q_axes, kv_axes, bias = (
            ("embed", "heads", "head_dim"),
            ("embed", "kv_heads", "head_dim"),
            c.qkv_bias,
        )
        lora = functools.partial(_lora_args, c)
        self.q_proj = _Proj(rngs, w_init, (D, N, H), q_axes, pdt, bias=bias, **lora("q_proj"))
        self.k_proj = _Proj(rngs, w_init, (D, K, H), kv_axes, pdt, bias=bias, **lora("k_proj"))
        self.v_proj = _Proj(rngs, w_init, (D, K, H), kv_axes, pdt, bias=bias, **lora("v_proj"))
        o_axes = ("heads", "head_dim", "embed")
        self.o_proj = _Proj(rngs, w_init, (N, H, D), o_axes, pdt, num_in=2, **lora("o_proj"))
        if c.qk_norm:
            kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": pdt, "rngs": rngs}
            self.q_norm = RMSNorm(H, "head_dim", **kw)
            self.k_norm = RMSNorm(H, "head_dim", **kw)
        self.config = config

    def qkv(self, x_BTD, cos_BTH, sin_BTH):
        """Rotary-embedded queries [B,T,N,H] and keys/values [B,T,K,H]."""
        dt = self.config.dtype
        q_BTNH = self.q_proj("BTD,DNH->BTNH", x_BTD, dt)
        k_BTKH = self.k_proj("BTD,DKH->BTKH", x_BTD, dt)
        v_BTKH = self.v_proj("BTD,DKH->BTKH", x_BTD, dt)
        if self.config.qk_norm:  # Qwen3: per-head RMSNorm before RoPE.
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        return _rope(q_BTNH, cos_BTH, sin_BTH), _rope(k_BTKH, cos_BTH, sin_BTH), v_BTKH

    def out(self, o_BTNH):
        return self.o_proj("BTNH,NHD->BTD", o_BTNH, self.config.dtype)


class LoraParam(nnx.Variable):
    """A LoRA adapter matrix (grpo_jax/lora.py): float32 and trained, while every `nnx.Param`
    (the base weights) stays frozen. A separate Variable type, so the base params and the
    adapters split into two pytrees (``abstract_params`` / ``abstract_adapters``)."""


def _lora_param(rngs, shape, axes) -> LoraParam:
    init = nnx.with_partitioning(nnx.initializers.zeros, axes)
    return LoraParam(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


def _lora_args(config: ModelConfig, name: str) -> dict:
    """The LoRA settings of projection `name`: rank 0 (none) unless it is a target."""
    rank = config.lora_rank if name in config.lora_targets else 0
    return {"lora_rank": rank, "lora_scale": config.lora_scale}


class _Proj(nnx.Module):
    """A projection contracting the input's last axes with the kernel's first ones (the einsum
    `spec` documents which); the optional (zero-initialised) bias spans the output axes.

    The contraction runs as one 2-D matmul, [tokens, in] x [in, out], with the kernel and input
    reshaped (free: both are contiguous): XLA:CPU's dot for the 3- and 4-D einsums took 30 %
    longer in the forward and backward at training shapes.

    With `lora_rank` r > 0 the projection also holds LoRA adapters (Hu et al. 2021) A [*in, r]
    and B [r, *out] (`LoraParam`, logical axes those of the kernel's in / out axes, the rank axis
    replicated) and adds scale * (x @ A) @ B, as PEFT's Linear does, without merging them into
    the kernel. `num_in` is the kernel's number of input axes (2 for o_proj's [N, H, D]).
    """

    def __init__(
        self, rngs, init, shape, axes, param_dtype, *, bias: bool = False, num_in: int = 1,
        lora_rank: int = 0, lora_scale: float = 0.0,
    ):  # fmt: skip
        self.kernel = _param(rngs, init, shape, axes, param_dtype)
        self.use_bias = bias
        if bias:
            self.bias = _param(rngs, nnx.initializers.zeros, shape[1:], axes[1:], param_dtype)
        self.lora_rank, self.lora_scale = lora_rank, lora_scale
        if lora_rank:
            r = lora_rank
            self.lora_a = _lora_param(rngs, (*shape[:num_in], r), (*axes[:num_in], None))
            self.lora_b = _lora_param(rngs, (r, *shape[num_in:]), (None, *axes[num_in:]))

    def __call__(self, spec: str, x, dtype):
        inputs, out = spec.split("->")
        x_letters, k_letters = inputs.split(",")
        c = (len(x_letters) + len(k_letters) - len(out)) // 2  # contracted axes
        kernel = self.kernel[...].astype(dtype)
        fan_in = math.prod(kernel.shape[:c])
        x_2d = x.astype(dtype).reshape(-1, fan_in)
        y = jnp.dot(x_2d, kernel.reshape(fan_in, -1))
        if self.lora_rank:  # base + adapter, unmerged: x @ W + scale * (x @ A) @ B
            a = self.lora_a[...].astype(dtype).reshape(fan_in, self.lora_rank)
            b = self.lora_b[...].astype(dtype).reshape(self.lora_rank, -1)
            y = y + jnp.dot(jnp.dot(x_2d, a), b) * self.lora_scale
        y = y.reshape(*x.shape[: x.ndim - c], *kernel.shape[c:])
        if self.use_bias:
            bias = self.bias[...].astype(dtype)
            y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
        return y


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        D, F, pdt = config.hidden_size, config.intermediate_size, config.param_dtype
        w_init = nnx.initializers.normal(config.initializer_range)
        lora = functools.partial(_lora_args, config)
        self.gate_proj = _Proj(rngs, w_init, (D, F), ("embed", "mlp"), pdt, **lora("gate_proj"))
        self.up_proj = _Proj(rngs, w_init, (D, F), ("embed", "mlp"), pdt, **lora("up_proj"))
        self.down_proj = _Proj(rngs, w_init, (F, D), ("mlp", "embed"), pdt, **lora("down_proj"))
        self.dtype = config.dtype

    def __call__(self, x_BTD):
        dt = self.dtype
        h_BTF = jax.nn.silu(self.gate_proj("BTD,DF->BTF", x_BTD, dt))
        h_BTF = h_BTF * self.up_proj("BTD,DF->BTF", x_BTD, dt)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "seq", "act_mlp"))
        return self.down_proj("BTF,FD->BTD", h_BTF, dt)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": c.param_dtype, "rngs": rngs}
        self.input_norm = RMSNorm(c.hidden_size, "embed", **kw)
        self.attn = Attention(c, rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, "embed", **kw)
        self.mlp = MLP(c, rngs=rngs)


class Decoder(nnx.Module):
    """Embedding, L stacked decoder layers (scanned) and the final norm / unembedding."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.embed = nnx.Module()
        self.embed.embedding = _param(
            rngs,
            nnx.initializers.normal(c.initializer_range),
            (c.vocab_size, c.hidden_size),
            ("vocab", "embed"),
            c.param_dtype,
        )

        # The stacked layer axis gets the logical name None (replicated, never sharded).
        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make_layers(rngs):
            return DecoderLayer(c, rngs=rngs)

        self.layers = make_layers(rngs)
        kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": c.param_dtype, "rngs": rngs}
        self.final_norm = RMSNorm(c.hidden_size, "embed", **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Module()
            self.lm_head.kernel = _param(
                rngs,
                nnx.initializers.normal(c.initializer_range),
                (c.hidden_size, c.vocab_size),
                ("embed", "vocab"),
                c.param_dtype,
            )
        self.config = config

    def __call__(self, ids_BT, positions_BT, visible_BTS, kv=None, index=None):
        """Final-normed hidden states [B,T,D], and the updated (k_LBKHS, v_LBKSH) with a cache.

        Args:
          ids_BT: token ids.
          positions_BT: rotary position of each token.
          visible_BTS: bool, query t may attend to key slot s (S = T without a cache, and then
            causal: no query sees a later key, which `_attend_causal` relies on).
          kv: optional (k_LBKHS, v_LBKSH) cache; the new keys/values are written at slots
            [index, index + T) before attending.
          index: int32 scalar write slot (with kv).
        """
        c = self.config
        x_BTD = jnp.take(self.embed.embedding[...], ids_BT, axis=0).astype(c.dtype)
        x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "seq", "act_embed"))
        cos_BTH, sin_BTH = _rope_tables(c, positions_BT)
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x_BTD, kv = carry
            state, layer_idx = xs
            layer = nnx.merge(layer_def, state)
            q_BTNH, k_BTKH, v_BTKH = layer.attn.qkv(layer.input_norm(x_BTD), cos_BTH, sin_BTH)
            q_BTNH = nn.with_logical_constraint(q_BTNH, ("batch", "seq", "act_heads", None))
            # Keys are kept transposed, [.., H, S]: the scores then read each key block with
            # the slot axis contiguous, 3x faster on XLA:CPU than [.., S, H] at decode.
            k_BKHT, v_BKTH = k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3)
            if kv is None:
                k_BKHS, v_BKSH = k_BKHT, v_BKTH
            else:
                # The whole stack stays in the scan carry: inside the sampler's while_loop XLA
                # updates it in place, whereas per-layer xs/ys slices copied it every step.
                k_LBKHS, v_LBKSH = kv
                k_LBKHS = jax.lax.dynamic_update_slice(
                    k_LBKHS, k_BKHT[None].astype(k_LBKHS.dtype), (layer_idx, 0, 0, 0, index)
                )
                v_LBKSH = jax.lax.dynamic_update_slice(
                    v_LBKSH, v_BKTH[None].astype(v_LBKSH.dtype), (layer_idx, 0, 0, index, 0)
                )
                k_BKHS, v_BKSH = k_LBKHS[layer_idx], v_LBKSH[layer_idx]
                kv = (k_LBKHS, v_LBKSH)
            if kv is None:  # self-attention over T: causal, so key blocks past a query's skip
                o_BTNH = _attend_causal(q_BTNH, k_BKHS.astype(c.dtype), v_BKSH.astype(c.dtype),
                                        visible_BTS)  # fmt: skip
            else:
                o_BTNH = _attend(
                    q_BTNH, k_BKHS.astype(c.dtype), v_BKSH.astype(c.dtype), visible_BTS
                )
            o_BTD = nn.with_logical_constraint(
                layer.attn.out(o_BTNH), ("batch", "seq", "act_embed")
            )
            x_BTD = x_BTD + o_BTD
            x_BTD = x_BTD + layer.mlp(layer.post_attn_norm(x_BTD))
            return (x_BTD, kv), None

        if c.remat:
            body = jax.checkpoint(body, policy=remat_policy_fn(c))
        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x_BTD, kv), _ = jax.lax.scan(body, (x_BTD, kv), (layer_state, layer_ids))
        return self.final_norm(x_BTD), kv

    def unembed(self, h_xD):
        c = self.config
        if c.tie_word_embeddings:
            w_VD = self.embed.embedding[...].astype(c.dtype)
            logits_xV = jnp.einsum(
                "...D,VD->...V", h_xD.astype(c.dtype), w_VD, preferred_element_type=jnp.float32
            )
        else:
            w_DV = self.lm_head.kernel[...].astype(c.dtype)
            logits_xV = jnp.einsum(
                "...D,DV->...V", h_xD.astype(c.dtype), w_DV, preferred_element_type=jnp.float32
            )
        if logits_xV.ndim == 3:
            logits_xV = nn.with_logical_constraint(logits_xV, ("batch", "seq", "act_vocab"))
        return logits_xV


def remat_policy_fn(config: ModelConfig):
    """The ``jax.checkpoint`` policy of ``config.remat_policy``.

    "dots_except_mlp_in_saveable" keeps what "dots_with_no_batch_dims_saveable" keeps except
    the MLP's input projections (gate and up, the matmuls whose kernel is [D, F]), the largest
    outputs: SmolLM2 saves 2,112 instead of 5,184 floats per token and layer, and its backward
    recomputes 2 of the layer's 7 matmuls. SmolLM2, a 4,096-token packed micro-batch: XLA's
    temporaries 3.3 -> 1.9 GiB (plan.py).
    """
    if config.remat_policy != "dots_except_mlp_in_saveable":
        return getattr(jax.checkpoint_policies, config.remat_policy)
    no_batch_dims = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    mlp_in = (config.hidden_size, config.intermediate_size)

    def policy(prim, *avals, **params):
        if prim is jax.lax.dot_general_p and len(avals) == 2 and avals[1].shape == mlp_in:
            return False
        return no_batch_dims(prim, *avals, **params)

    return policy


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _rope(x_BTnH, cos_BTH, sin_BTH):
    """HF apply_rotary_pos_emb on one of q [B,T,N,H] / k [B,T,K,H] (tables cast to x's dtype)."""
    cos_BT1H = cos_BTH[:, :, None, :].astype(x_BTnH.dtype)
    sin_BT1H = sin_BTH[:, :, None, :].astype(x_BTnH.dtype)
    return x_BTnH * cos_BT1H + _rotate_half(x_BTnH) * sin_BT1H


def _inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [H/2] (float32), with HF's "linear" / "llama3" scaling."""
    H = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / H)
    )
    inv_freq = inv_freq.astype(np.float32)
    rope = config.rope_scaling_dict
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope["factor"])
    elif rope_type == "llama3":
        # transformers _compute_llama3_parameters: keep high frequencies, divide low frequencies
        # by `factor`, and interpolate smoothly in between.
        factor = rope["factor"]
        low_freq_factor = rope["low_freq_factor"]
        high_freq_factor = rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def _rope_tables(config: ModelConfig, positions_BT):
    """cos/sin [B,T,H] in float32 (HF layout: the H/2 frequencies repeated twice)."""
    inv_freq = jnp.asarray(_inv_freq(config))
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    emb_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    return jnp.cos(emb_BTH), jnp.sin(emb_BTH)


def _attend(q_BTNH, k_BKHS, v_BKSH, visible_BTS):
    """Softmax attention with GQA (query head n uses kv head n // R); float32 softmax.

    The R = N/K query heads of one kv head and the T queries are folded into one query axis, so
    both products are plain batched matmuls over (B, K) that read the cache in its stored
    layouts, keys [B,K,H,S] and values [B,K,S,H] (XLA CPU emits slow loops for the 5-d GQA
    einsum, and decode is T=1). Fully masked rows (padding queries) get a uniform distribution
    instead of NaN.
    """
    B, T, N, H = q_BTNH.shape
    K, S = k_BKHS.shape[1], k_BKHS.shape[3]
    R = N // K
    q_BKRTH = q_BTNH.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4)
    q_BKQH = q_BKRTH.reshape(B, K, R * T, H)  # Q = R*T query rows per kv head
    batch_dims = ((0, 1), (0, 1))
    s_BKQS = jax.lax.dot_general(
        q_BKQH, k_BKHS, (((3,), (2,)), batch_dims), preferred_element_type=jnp.float32
    ) * (H**-0.5)
    s_BKRTS = s_BKQS.reshape(B, K, R, T, S)
    s_BKRTS = jnp.where(visible_BTS[:, None, None], s_BKRTS, jnp.finfo(jnp.float32).min)
    p_BKQS = jax.nn.softmax(s_BKRTS, axis=-1).astype(v_BKSH.dtype).reshape(B, K, R * T, S)
    o_BKQH = jax.lax.dot_general(p_BKQS, v_BKSH, (((3,), (2,)), batch_dims))
    o_BTKRH = o_BKQH.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)
    return o_BTKRH.reshape(B, T, N, H)


CAUSAL_BLOCK = 128  # query block of _attend_causal (tokens); at most MAX_CAUSAL_BLOCKS blocks
MAX_CAUSAL_BLOCKS = 16


def _attend_causal(q_BTNH, k_BKHS, v_BKSH, visible_BTS):
    """`_attend` for causal self-attention (S = T, no query sees a later key): query block i of
    b tokens attends to keys [0, (i + 1) b) only, so the scores, the softmax and both products
    skip the key blocks above the diagonal, (n - 1) / 2n of the work for n blocks. The result is
    `_attend`'s exactly: the skipped keys are the ones `visible_BTS` masks anyway.

    On SmolLM2 rows of 768 tokens (GSM8K packing) the attention's forward + backward per layer
    took 411 -> 224 ms on the 2-core CPU. b = max(CAUSAL_BLOCK, T / MAX_CAUSAL_BLOCKS) bounds the
    unrolled blocks a layer compiles.
    """
    T = q_BTNH.shape[1]
    b = max(CAUSAL_BLOCK, -(-T // MAX_CAUSAL_BLOCKS))
    if T <= b:
        return _attend(q_BTNH, k_BKHS, v_BKSH, visible_BTS)
    outs = []
    for start in range(0, T, b):
        end = min(T, start + b)
        outs.append(
            _attend(
                q_BTNH[:, start:end],
                k_BKHS[..., :end],
                v_BKSH[:, :, :end],
                visible_BTS[:, start:end, :end],
            )
        )
    return jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------------------------
# Functional facade
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _skeleton(config: ModelConfig):
    """(graphdef, abstract Param state[, abstract LoraParam state]) of the module tree, built
    once per config; the third entry only when config.lora_rank > 0."""
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    if config.lora_rank:
        return nnx.split(abstract, nnx.Param, LoraParam)
    return nnx.split(abstract, nnx.Param)[:2]


def _base_config(config: ModelConfig) -> ModelConfig:
    """`config` without adapters: the module tree of the base params."""
    return dataclasses.replace(config, lora_rank=0, lora_targets=()) if config.lora_rank else config


def _merge(config: ModelConfig, params) -> Decoder:
    """The Decoder module holding `params` (called inside a trace; checks the structure).

    With LoRA adapters under ``params["lora"]`` (grpo_jax/lora.py) the targeted projections
    apply them unmerged; without them the module is the base model (adapters disabled).
    """
    adapters = params.get(ADAPTERS) if isinstance(params, Mapping) else None
    if adapters is None:
        graphdef, abstract_state = _skeleton(_base_config(config))
        check_params(config, params)
        state = jax.tree.map(lambda x: x, abstract_state)  # Fresh Variables; the cache stays clean.
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)
    if not config.lora_rank:
        raise ValueError(
            f"params carry LoRA adapters (params[{ADAPTERS!r}]) but ModelConfig.lora_rank=0"
        )
    base = {k: v for k, v in params.items() if k != ADAPTERS}
    check_params(config, base)
    check_adapters(config, adapters)
    graphdef, abstract_state, abstract_lora = _skeleton(config)
    state, lora_state = jax.tree.map(lambda x: x, (abstract_state, abstract_lora))
    nnx.replace_by_pure_dict(state, base)
    nnx.replace_by_pure_dict(lora_state, adapters)
    return nnx.merge(graphdef, state, lora_state)


def check_params(config: ModelConfig, params) -> None:
    """Raises ValueError naming the first missing, unexpected or mis-shaped base param."""
    _check_tree("param", abstract_params(config), params, config)


def check_adapters(config: ModelConfig, adapters) -> None:
    """Raises ValueError unless `adapters` has the structure and shapes of abstract_adapters."""
    _check_tree("LoRA adapter", abstract_adapters(config), adapters, config)


def _check_tree(what: str, expected, got_tree, config: ModelConfig) -> None:
    want = dict(_flatten(expected))
    got = dict(_flatten(got_tree))
    if want.keys() != got.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        noun = "params" if what == "param" else f"{what}s"
        raise ValueError(
            f"{noun} do not match arch={config.arch!r}: missing {missing}, unexpected {extra}"
        )
    for name, spec in want.items():
        if tuple(got[name].shape) != tuple(spec.shape):
            raise ValueError(
                f"{what} {name!r} has shape {tuple(got[name].shape)}, expected "
                f"{tuple(spec.shape)} for arch={config.arch!r}"
            )


def _flatten(tree, prefix: str = ""):
    for key in sorted(tree):
        value = tree[key]
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from _flatten(value, name)
        else:
            yield name, value


def init_params(config: ModelConfig, rng) -> dict:
    """Random parameters (normal(initializer_range) weights, zero biases, unit norms).

    Returns:
      Nested dict of arrays in ``config.param_dtype`` (structure in the module docstring).
    """
    return _init_params(config, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: ModelConfig, rng) -> dict:
    # One normal draw sliced into every weight: a single threefry call compiles in about a second,
    # where one draw per (vmapped) parameter took over 10 s to compile on a 2-core CPU.
    shapes = dict(_flatten(abstract_params(config)))
    sizes = {name: math.prod(s.shape) for name, s in shapes.items() if _init_kind(name) == "normal"}
    noise = jax.random.normal(rng, (sum(sizes.values()),), jnp.float32) * config.initializer_range
    flat, offset = {}, 0
    for name, spec in shapes.items():
        match _init_kind(name):
            case "normal":
                value = noise[offset : offset + sizes[name]].reshape(spec.shape)
                offset += sizes[name]
            case "zeros":
                value = jnp.zeros(spec.shape)
            case "ones":
                value = jnp.ones(spec.shape)
        flat[name] = value.astype(spec.dtype)
    return _unflatten(flat)


def _init_kind(name: str) -> str:
    """Initialiser of a flat param name: unit norm scales, zero biases, normal weights."""
    if name.endswith("/scale"):
        return "ones"
    if name.endswith("/bias"):
        return "zeros"
    return "normal"


def _unflatten(flat: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def abstract_params(config: ModelConfig) -> dict:
    """Shapes and dtypes of the params (jax.ShapeDtypeStruct leaves), without allocating."""
    return _abstract_params(config)


@functools.lru_cache(maxsize=64)
def _abstract_params(config: ModelConfig) -> dict:
    _, abstract_state = _skeleton(_base_config(config))
    return nnx.to_pure_dict(abstract_state)


def logical_axes(config: ModelConfig) -> dict:
    """PartitionSpecs of logical axis names, same structure as the params."""
    _, abstract_state = _skeleton(_base_config(config))
    return nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))


def _lora_skeleton(config: ModelConfig):
    if not config.lora_rank:
        raise ValueError("ModelConfig.lora_rank=0: this model has no LoRA adapters")
    return _skeleton(config)[2]


def abstract_adapters(config: ModelConfig) -> dict:
    """Shapes of the LoRA adapters (float32 ShapeDtypeStructs), per target projection::

        layers/attn/q_proj/lora_a   [L, D, r]       (None, embed, None)
        layers/attn/q_proj/lora_b   [L, r, N, H]    (None, None, heads, head_dim)
        layers/attn/o_proj/lora_a   [L, N, H, r]    (None, heads, head_dim, None)
        layers/mlp/down_proj/lora_b [L, r, D]       (None, None, embed)   ...

    Raises:
      ValueError: config.lora_rank is 0.
    """
    return nnx.to_pure_dict(_lora_skeleton(config))


def adapter_logical_axes(config: ModelConfig) -> dict:
    """PartitionSpecs of logical axis names of the LoRA adapters (``abstract_adapters``)."""
    return nnx.to_pure_dict(nnx.get_partition_spec(_lora_skeleton(config)))


def _check_inputs(input_ids, attention_mask):
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B,T] and attention_mask the same shape; got "
            f"input_ids{tuple(input_ids.shape)}, attention_mask{tuple(attention_mask.shape)}"
        )


def _positions(attention_mask_BT):
    """Position ids cumsum(mask) - 1 (0 on left padding, which is masked out anyway)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=1) - 1, 0)


@functools.partial(jax.jit, static_argnums=0)
def hidden_states(config: ModelConfig, params, input_ids, attention_mask):
    """Final-normed hidden states h_BTD in config.dtype (``forward == unembed(hidden_states)``).

    Args:
      input_ids: [B,T] int token ids; ids under mask 0 are ignored.
      attention_mask: [B,T], 1 for real tokens and 0 for padding (left or right).
    """
    _check_inputs(input_ids, attention_mask)
    T = input_ids.shape[1]
    mask_BT = attention_mask.astype(bool)
    causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))
    visible_BTS = causal_TT[None] & mask_BT[:, None, :]
    h_BTD, _ = _merge(config, params)(input_ids, _positions(attention_mask), visible_BTS)
    return h_BTD


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_packed(
    config: ModelConfig, params, tokens_RL, positions_RL, segments_RL, prefixes_RL=None
):
    """Hidden states of rows that pack several sequences each (grpo_jax/packing.py).

    A token attends to the earlier tokens of its own segment and of its prefix segment (the
    prompt a response continues), never to another segment, and padding (segment 0) is seen by
    nobody: each sequence gets exactly the hidden states it would get alone, with its prompt
    shared by the responses of its group.

    Args:
      tokens_RL: [R, L] int token ids.
      positions_RL: [R, L] int rotary positions (0.. within each sequence).
      segments_RL: [R, L] int, 1.. per segment of a row, 0 on padding.
      prefixes_RL: [R, L] int, the segment each token continues (a prompt's for its responses,
        the token's own otherwise); None = each segment is a whole sequence.

    Returns:
      h_RLD in config.dtype.
    """
    _check_inputs(tokens_RL, segments_RL)
    L = tokens_RL.shape[1]
    causal_LL = jnp.tril(jnp.ones((L, L), dtype=bool))
    seg = segments_RL.astype(jnp.int32)
    pre = seg if prefixes_RL is None else prefixes_RL.astype(jnp.int32)
    key_seg = seg[:, None, :]
    same = (seg[:, :, None] == key_seg) | (pre[:, :, None] == key_seg)
    visible_RLL = causal_LL[None] & same & (key_seg > 0)
    h_RLD, _ = _merge(config, params)(tokens_RL, positions_RL.astype(jnp.int32), visible_RLL)
    return h_RLD


@functools.partial(jax.jit, static_argnums=0)
def unembed(config: ModelConfig, params, h_xD):
    """Logits [..., V] in float32 from hidden states [..., D] (tied or untied head)."""
    return _merge(config, params).unembed(h_xD)


@functools.partial(jax.jit, static_argnums=0)
def forward(config: ModelConfig, params, input_ids, attention_mask):
    """Logits [B,T,V] float32 of every position (see ``hidden_states`` for the arguments)."""
    return unembed(config, params, hidden_states(config, params, input_ids, attention_mask))


# ----------------------------------------------------------------------------------------------
# KV cache and incremental decoding
# ----------------------------------------------------------------------------------------------


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values for incremental decoding (a pytree, passed in and returned).

    Attributes:
      k_LBKHS: keys [L,B,K,H,S] in the cache dtype, rotary-embedded, transposed (``_attend``
        reads directly, so a decode step never transposes the cache).
      v_LBKSH: values [L,B,K,S,H].
      mask_BS: int32 [B,S], 1 where slot s holds a real token of row b.
      pos_B: int32 [B], the position id the next token of row b gets.
      index: int32 scalar, the next slot to write (shared by all rows).
    """

    k_LBKHS: jax.Array
    v_LBKSH: jax.Array
    mask_BS: jax.Array
    pos_B: jax.Array
    index: jax.Array


@flax.struct.dataclass
class GroupKVCache:
    """The decode loop's cache for GRPO groups: each prompt once, each response in blocks.

    Why: the n samples of a prompt share its keys and values, so a cache of P * n full rows
    reads every prompt n times per decode step; and a cache sized for the longest response
    reads its unwritten slots too. Here each prompt's keys and values are stored once ([P, ...],
    the prefill's) and attended by all n rows of its group in one product with n * R query rows
    per kv head; each row's response keys and values live in NB blocks of C slots, and a step
    reads only the blocks written so far (``lax.switch`` on ``index // C``). SmolLM2-135M, 8
    GSM8K prompts x 4 x 256 tokens: the attention reads 1,536 prompt + on average 4,600
    response slot-rows per layer and step instead of 32 x 447 = 14,304.

    Every array is its own buffer (one per layer and block), so a decode loop reads and updates
    them in place: slices of a stacked cache are copied by XLA:CPU before a product reads them
    (the whole cache once more per step).

    Rows (B here, the sampler's slots) are a subset of the P * n rollout rows, in any order:
    ``row_B`` names each one's rollout row (group-major, so its prompt is ``row_B // n``), which
    lets a sampler drop finished rows (``take_rows``) while the prompts stay where they are.

    Attributes:
      prompt_k_PKHT: L arrays [P,K,H,T], the prompts' rotary-embedded keys (transposed, as
        ``KVCache``).
      prompt_v_PKTH: L arrays [P,K,T,H].
      prompt_mask_PT: int32 [P,T], 1 on real prompt tokens (prompts are left-padded).
      k_BKHC: L tuples of NB arrays [B,K,H,C]: response slot j of row b is block j // C,
        column j % C.
      v_BKCH: L tuples of NB arrays [B,K,C,H].
      row_B: int32 [B], the rollout row each cache row decodes (prompt row_B // n).
      pos_B: int32 [B], the position id the next token of row b gets.
      index: int32 scalar, the response slots written so far (shared by all rows).
      n: static, the rows per prompt of the rollout (GRPO's group size).
    """

    prompt_k_PKHT: tuple[jax.Array, ...]
    prompt_v_PKTH: tuple[jax.Array, ...]
    prompt_mask_PT: jax.Array
    k_BKHC: tuple[tuple[jax.Array, ...], ...]
    v_BKCH: tuple[tuple[jax.Array, ...], ...]
    row_B: jax.Array
    pos_B: jax.Array
    index: jax.Array
    n: int = flax.struct.field(pytree_node=False)


MAX_DECODE_BLOCKS = 8  # response blocks of a GroupKVCache: bounds the branches each layer compiles
DECODE_BLOCK = 64  # response slots per block, until MAX_DECODE_BLOCKS would be exceeded


def decode_blocks(response_slots: int) -> tuple[int, int]:
    """(NB, C): the blocks and block length of a ``GroupKVCache`` holding ``response_slots``.

    Rule: blocks of DECODE_BLOCK slots, at most MAX_DECODE_BLOCKS of them (longer responses get
    longer blocks), the slots split evenly: 255 -> (4, 64), 1023 -> (8, 128), 47 -> (1, 47).
    A step reads ceil(written / C) blocks, so at most C - 1 unwritten slots per row.
    """
    slots = max(int(response_slots), 1)
    num_blocks = min(MAX_DECODE_BLOCKS, -(-slots // DECODE_BLOCK))
    return num_blocks, -(-slots // num_blocks)


def group_cache(cache: KVCache, *, n: int, response_slots: int) -> GroupKVCache:
    """The ``GroupKVCache`` of P prefilled prompts, for n rows each (adjacent), empty responses.

    Args:
      cache: the prefill's ``KVCache`` of the P prompts, every slot written (index == S).
      n: rows per prompt.
      response_slots: the response tokens the rows will feed back (the sampler's
        max_new_tokens - 1: the last drawn token is never fed).

    Returns:
      A cache of P * n rows, row b decoding prompt b // n.
    """
    num_layers, P, K, H, _ = cache.k_LBKHS.shape
    num_blocks, C = decode_blocks(response_slots)
    B, dtype = P * n, cache.k_LBKHS.dtype
    return GroupKVCache(
        prompt_k_PKHT=tuple(cache.k_LBKHS[i] for i in range(num_layers)),
        prompt_v_PKTH=tuple(cache.v_LBKSH[i] for i in range(num_layers)),
        prompt_mask_PT=cache.mask_BS,
        k_BKHC=tuple(
            tuple(jnp.zeros((B, K, H, C), dtype) for _ in range(num_blocks))
            for _ in range(num_layers)
        ),
        v_BKCH=tuple(
            tuple(jnp.zeros((B, K, C, H), dtype) for _ in range(num_blocks))
            for _ in range(num_layers)
        ),
        row_B=jnp.arange(B, dtype=jnp.int32),
        pos_B=jnp.repeat(cache.pos_B, n, axis=0),
        index=jnp.zeros((), jnp.int32),
        n=n,
    )


def take_rows(cache: GroupKVCache, keep_B: jax.Array) -> GroupKVCache:
    """The cache of rows ``keep_B`` only (a gather of the response blocks; prompts stay).

    It must drop rows: a cache of all P * n rows is taken to hold them in order (the prompt
    attention then skips its scatter), which a permutation of all of them would break.
    """
    total = cache.prompt_mask_PT.shape[0] * cache.n
    if keep_B.shape[0] >= total:
        raise ValueError(f"take_rows keeps {keep_B.shape[0]} of {total} rows; it must drop some")
    return dataclasses.replace(
        cache,
        k_BKHC=tuple(tuple(jnp.take(k, keep_B, axis=0) for k in ks) for ks in cache.k_BKHC),
        v_BKCH=tuple(tuple(jnp.take(v, keep_B, axis=0) for v in vs) for vs in cache.v_BKCH),
        row_B=cache.row_B[keep_B],
        pos_B=cache.pos_B[keep_B],
    )


def init_cache(config: ModelConfig, batch_size: int, max_len: int, *, dtype=None) -> KVCache:
    """An empty cache of ``max_len`` slots (dtype defaults to the compute dtype)."""
    dtype = config.dtype if dtype is None else dtype
    shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        k_LBKHS=jnp.zeros((*shape[:3], shape[4], shape[3]), dtype),
        v_LBKSH=jnp.zeros(shape, dtype),
        mask_BS=jnp.zeros((batch_size, max_len), jnp.int32),
        pos_B=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=0)
def prefill(config: ModelConfig, params, input_ids_BT, attention_mask_BT, cache: KVCache):
    """Runs T tokens through the model, writing slots [index, index + T) of the cache.

    The input is left-padded, so column T-1 is each row's last real token. Positions continue from
    ``cache.pos_B`` (cumsum of the mask), so prefilling in chunks equals one prefill. The caller
    keeps ``index + T <= S``: the write is a ``dynamic_update_slice``, which clamps rather than
    raising when it would run past the end.

    Returns:
      (logits_BV float32 at the last column, updated cache).
    """
    _check_inputs(input_ids_BT, attention_mask_BT)
    T, S = input_ids_BT.shape[1], cache.mask_BS.shape[1]
    if T > S:
        raise ValueError(f"prefill of T={T} tokens does not fit a KV cache of S={S} slots")
    if (
        cache.k_LBKHS.shape[0] != config.num_layers
        or cache.mask_BS.shape[0] != input_ids_BT.shape[0]
    ):
        raise ValueError(
            f"KV cache k_LBKHS{tuple(cache.k_LBKHS.shape)} does not match L={config.num_layers}, "
            f"B={input_ids_BT.shape[0]}"
        )
    mask_BT = attention_mask_BT.astype(jnp.int32)
    positions_BT = cache.pos_B[:, None] + _positions(mask_BT)
    mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, mask_BT, (0, cache.index))
    query_slot_T = cache.index + jnp.arange(T, dtype=jnp.int32)
    key_slot_S = jnp.arange(S, dtype=jnp.int32)
    visible_BTS = (key_slot_S[None, :] <= query_slot_T[:, None])[None] & (mask_BS[:, None, :] > 0)
    model = _merge(config, params)
    h_BTD, (k_LBKHS, v_LBKSH) = model(
        input_ids_BT, positions_BT, visible_BTS, (cache.k_LBKHS, cache.v_LBKSH), cache.index
    )
    logits_BV = model.unembed(h_BTD[:, -1])
    new_cache = KVCache(
        k_LBKHS=k_LBKHS,
        v_LBKSH=v_LBKSH,
        mask_BS=mask_BS,
        pos_B=cache.pos_B + jnp.sum(mask_BT, axis=1),
        index=cache.index + T,
    )
    return logits_BV, new_cache


@functools.partial(jax.jit, static_argnums=0)
def decode_step(config: ModelConfig, params, tokens_B, cache: KVCache | GroupKVCache):
    """Feeds one token per row (a real token, mask 1) at slot ``cache.index``.

    Takes and returns either cache form, with the same logits up to float rounding. A decode
    loop should use ``GroupKVCache`` (``group_cache``) and ``decode_params`` weights built
    before the loop: see ``GroupKVCache`` and ``DecodeParams`` for why (with a
    ``GroupKVCache``, plain ``params`` are converted on every call).

    Returns:
      (logits_BV float32 for the next token, updated cache).
    """
    if tokens_B.ndim != 1:
        raise ValueError(f"decode_step expects tokens_B of shape [B], got {tuple(tokens_B.shape)}")
    tokens_B1 = tokens_B[:, None]
    if isinstance(cache, KVCache):
        return prefill(config, params, tokens_B1, jnp.ones_like(tokens_B1, jnp.int32), cache)
    if not isinstance(params, DecodeParams):
        params = decode_params(config, params)
    return _decode_layers(config, params, tokens_B, cache)


@flax.struct.dataclass
class DecodeParams:
    """The weights in the layout of the per-layer decode (``decode_params``; decode loops).

    Activations of the per-layer decode are feature-major, [features, rows], and every
    projection is one matmul ``W_OI @ x_IB`` with the kernel stored as [out, in]: at decode
    shapes (a few dozen rows) XLA:CPU runs that 1.3-1.6x faster than ``x_BI @ W_IO`` (measured on
    SmolLM2-135M's projections, 32 rows). The layers are separate buffers, so a decode loop reads
    every weight in place (slices of the stacked params are copied each step, as a scan over
    stacked cache layers would copy the cache; see ``GroupKVCache``). Building it copies the
    layer weights once.

    Attributes:
      embed_VD: the token embedding (config.dtype cast at lookup, as ``Decoder``).
      head_VD: the output head as [V, D] in config.dtype: the embedding when tied, else the
        transposed ``lm_head/kernel``.
      final_norm_D: the final RMSNorm scale.
      layers: L dicts of arrays: ``input_norm`` / ``post_attn_norm`` [D]; kernels (config.dtype)
        ``q`` [N*H, D], ``k`` / ``v`` [K*H, D], ``o`` [D, N*H], ``gate`` / ``up`` [F, D], ``down``
        [D, F]; optional ``{q,k,v}_bias`` [n*H], ``q_norm`` / ``k_norm`` [H], and the LoRA
        adapters ``{proj}_lora_a`` [r, in] / ``{proj}_lora_b`` [out, r] of targeted projections.
    """

    embed_VD: jax.Array
    head_VD: jax.Array
    final_norm_D: jax.Array
    layers: tuple[dict[str, jax.Array], ...]


# (DecodeParams name, params group, projection, number of kernel input axes)
_DECODE_PROJ = (
    ("q", "attn", "q_proj", 1),
    ("k", "attn", "k_proj", 1),
    ("v", "attn", "v_proj", 1),
    ("o", "attn", "o_proj", 2),
    ("gate", "mlp", "gate_proj", 1),
    ("up", "mlp", "up_proj", 1),
    ("down", "mlp", "down_proj", 1),
)


def decode_params(config: ModelConfig, params) -> DecodeParams:
    """The weights of ``params`` (base, plus LoRA adapters if attached) as ``DecodeParams``.

    Build it once, outside a decode loop, and pass it to ``decode_step`` with a ``GroupKVCache``.
    """
    c = config
    adapters = params.get(ADAPTERS)
    base = {k: v for k, v in params.items() if k != ADAPTERS}
    check_params(c, base)
    if adapters is not None:
        if not c.lora_rank:
            raise ValueError(
                f"params carry LoRA adapters (params[{ADAPTERS!r}]) but ModelConfig.lora_rank=0"
            )
        check_adapters(c, adapters)
    dt = c.dtype

    def out_in(x, num_in):  # [*in, *out] -> [out, in]
        return x.reshape(math.prod(x.shape[:num_in]), -1).T.astype(dt)

    lp = base["layers"]
    layers = []
    for i in range(c.num_layers):
        layer = {
            "input_norm": lp["input_norm"]["scale"][i],
            "post_attn_norm": lp["post_attn_norm"]["scale"][i],
        }
        for name, group, proj, num_in in _DECODE_PROJ:
            node = lp[group][proj]
            layer[name] = out_in(node["kernel"][i], num_in)
            if "bias" in node:
                layer[f"{name}_bias"] = node["bias"][i].reshape(-1).astype(dt)
            lora = None if adapters is None else adapters["layers"].get(group, {}).get(proj)
            if lora is not None:
                layer[f"{name}_lora_a"] = out_in(lora["lora_a"][i], num_in)
                layer[f"{name}_lora_b"] = out_in(lora["lora_b"][i], 1)
        if c.qk_norm:
            layer["q_norm"] = lp["attn"]["q_norm"]["scale"][i]
            layer["k_norm"] = lp["attn"]["k_norm"]["scale"][i]
        layers.append(layer)
    embed_VD = base["embed"]["embedding"]
    head_VD = embed_VD if c.tie_word_embeddings else base["lm_head"]["kernel"].T
    return DecodeParams(
        embed_VD=embed_VD,
        head_VD=head_VD.astype(dt),
        final_norm_D=base["final_norm"]["scale"],
        layers=tuple(layers),
    )


def _decode_layers(config: ModelConfig, params: DecodeParams, tokens_B, cache: GroupKVCache):
    """``decode_step`` on a ``GroupKVCache``: layers unrolled, activations feature-major.

    The same computation as ``prefill`` at T = 1 (``Decoder`` modules: RMSNorm, rotary q/k with
    optional bias and q/k norm, GQA attention over the cache, SwiGLU MLP, LoRA unmerged), with
    the rows on the minor axis so each projection is ``W_OI @ x_IB`` (see ``DecodeParams``).
    The attention is ``_attend_group``'s.
    """
    c = config
    dt = c.dtype
    B = tokens_B.shape[0]
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    R = N // K
    if len(params.layers) != c.num_layers or len(cache.k_BKHC) != c.num_layers:
        raise ValueError(
            f"{len(params.layers)} layers of weights and {len(cache.k_BKHC)} of KV cache do not "
            f"match L={c.num_layers}"
        )
    if cache.row_B.shape[0] != B:
        raise ValueError(f"KV cache of {cache.row_B.shape[0]} rows for {B} tokens")
    index = cache.index
    cos_BTH, sin_BTH = _rope_tables(c, cache.pos_B[:, None])
    cos_HB, sin_HB = cos_BTH[:, 0].T, sin_BTH[:, 0].T
    x_DB = jnp.take(params.embed_VD, tokens_B, axis=0).astype(dt).T
    x_DB = nn.with_logical_constraint(x_DB, ("act_embed", "batch"))

    def proj(w, name, x_IB):  # as _Proj: x @ W (+ LoRA, unmerged) + bias, transposed
        y_OB = jnp.dot(w[name], x_IB.astype(dt))
        if f"{name}_lora_a" in w:
            lora_OB = jnp.dot(w[f"{name}_lora_b"], jnp.dot(w[f"{name}_lora_a"], x_IB.astype(dt)))
            y_OB = y_OB + lora_OB * c.lora_scale
        if f"{name}_bias" in w:
            y_OB = y_OB + w[f"{name}_bias"][:, None]
        return y_OB

    def rope(x_nHB):  # as _rope, with the head dim on axis 1
        x1, x2 = jnp.split(x_nHB, 2, axis=1)
        rotated = jnp.concatenate([-x2, x1], axis=1)
        cos_1HB, sin_1HB = cos_HB[None].astype(x_nHB.dtype), sin_HB[None].astype(x_nHB.dtype)
        return x_nHB * cos_1HB + rotated * sin_1HB

    new_k, new_v = [], []
    for layer, w in enumerate(params.layers):
        h_DB = _rms_norm_fm(x_DB, w["input_norm"], c.rms_norm_eps, dt, axis=0)
        q_NHB = proj(w, "q", h_DB).reshape(N, H, B)
        k_KHB = proj(w, "k", h_DB).reshape(K, H, B)
        v_KHB = proj(w, "v", h_DB).reshape(K, H, B)
        if c.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q_NHB = _rms_norm_fm(q_NHB, w["q_norm"], c.rms_norm_eps, dt, axis=1)
            k_KHB = _rms_norm_fm(k_KHB, w["k_norm"], c.rms_norm_eps, dt, axis=1)
        q_NHB = nn.with_logical_constraint(rope(q_NHB), ("act_heads", None, "batch"))
        k_KHB = rope(k_KHB)
        k_BKHC = _write_block(cache.k_BKHC[layer], k_KHB.transpose(2, 0, 1)[..., None], index, 3)
        v_BKCH = _write_block(cache.v_BKCH[layer], v_KHB.transpose(2, 0, 1)[:, :, None], index, 2)
        q_BKRH = q_NHB.transpose(2, 0, 1).reshape(B, K, R, H)
        o_BKRH = _attend_group(
            q_BKRH,
            cache.prompt_k_PKHT[layer].astype(dt),
            cache.prompt_v_PKTH[layer].astype(dt),
            cache.prompt_mask_PT,
            tuple(k.astype(dt) for k in k_BKHC),
            tuple(v.astype(dt) for v in v_BKCH),
            row_B=cache.row_B,
            n=cache.n,
            index=index,
        )
        o_DB = proj(w, "o", o_BKRH.reshape(B, N * H).T)
        x_DB = x_DB + nn.with_logical_constraint(o_DB, ("act_embed", "batch"))
        h_DB = _rms_norm_fm(x_DB, w["post_attn_norm"], c.rms_norm_eps, dt, axis=0)
        a_FB = jax.nn.silu(proj(w, "gate", h_DB)) * proj(w, "up", h_DB)
        a_FB = nn.with_logical_constraint(a_FB, ("act_mlp", "batch"))
        x_DB = x_DB + proj(w, "down", a_FB)
        new_k.append(k_BKHC)
        new_v.append(v_BKCH)
    # h back to [rows, D] for the head (as ``Decoder.unembed``). The barrier keeps XLA from
    # folding the transpose into the head's dot: XLA:CPU has no bf16 kernel for that form.
    h_BD = jax.lax.optimization_barrier(
        _rms_norm_fm(x_DB, params.final_norm_D, c.rms_norm_eps, dt, axis=0).T
    )
    logits_BV = jnp.einsum(
        "BD,VD->BV", h_BD.astype(dt), params.head_VD, preferred_element_type=jnp.float32
    )
    new_cache = dataclasses.replace(
        cache, k_BKHC=tuple(new_k), v_BKCH=tuple(new_v), pos_B=cache.pos_B + 1, index=index + 1
    )
    return logits_BV, new_cache


def _write_block(blocks, new, index, axis: int):
    """Writes ``new`` (size 1 on ``axis``) at response slot ``index`` of NB blocks of C slots.

    Every block takes a one-slot update at its clamped offset, with its old value except in
    block index // C: an in-place one-slot write per block and step, where choosing the block
    dynamically (a ``lax.switch`` returning the blocks) would copy them.
    """
    C = blocks[0].shape[axis]
    out = []
    for j, block in enumerate(blocks):
        start = [0] * block.ndim
        start[axis] = jnp.clip(index - j * C, 0, C - 1)
        old = jax.lax.dynamic_slice(block, start, new.shape)
        out.append(
            jax.lax.dynamic_update_slice(
                block, jnp.where(index // C == j, new.astype(block.dtype), old), start
            )
        )
    return tuple(out)


_BATCH_KV = ((0, 1), (0, 1))  # dot_general batch dims: (row or prompt, kv head)


def _softmax_parts(s_xkQS, v_xkSH):
    """Unnormalised softmax attention over one key range: (max [x,k,Q,1], sum [x,k,Q,1],
    out [x,k,Q,H]), merged across ranges by ``_attend_group`` (log-sum-exp). ``v_xkSH`` is a
    tuple of blocks splitting S (one product each: concatenating them would copy the cache)."""
    m = jnp.max(s_xkQS, axis=-1, keepdims=True)
    e = jnp.exp(s_xkQS - m)
    o, start = 0.0, 0
    for v in v_xkSH:
        size = v.shape[2]
        e_block = e[..., start : start + size].astype(v.dtype)
        o = o + jax.lax.dot_general(
            e_block, v, (((3,), (2,)), _BATCH_KV), preferred_element_type=jnp.float32
        )
        start += size
    return m, jnp.sum(e, axis=-1, keepdims=True), o


def _attend_group(q_BKRH, k_PKHT, v_PKTH, mask_PT, k_BKHC, v_BKCH, *, row_B, n: int, index):
    """GQA attention of B decode rows over their prompt (shared per group) and their response.

    Equals ``_attend`` over the row's whole sequence (prompt, then the index + 1 response slots
    written, the current one included), up to float rounding: the two key ranges are softmaxed
    separately and merged by log-sum-exp.

    Prompt part: the rows are placed at their rollout rows (a [P * n] scatter, skipped when the
    B rows are all of them in order, as before any row is dropped), so each prompt's keys are
    read once for its n rows: one product per (prompt, kv head) with n * R query rows.
    Response part: ``lax.switch`` on the written blocks, so unwritten blocks are not read.

    Args:
      q_BKRH: queries, R = N / K query heads per kv head.
      k_PKHT, v_PKTH, mask_PT: the prompts (``GroupKVCache``), float in the compute dtype.
      k_BKHC, v_BKCH: the NB response blocks of this layer.
      row_B: the rollout row of each row; n: rows per prompt; index: the current slot.

    Returns:
      o_BKRH float32.
    """
    B, K, R, H = q_BKRH.shape
    P = mask_PT.shape[0]
    scale = H**-0.5
    neg = jnp.finfo(jnp.float32).min
    dims = (((3,), (2,)), _BATCH_KV)
    identity = B == P * n  # rows are only ever dropped, so all P * n rows are in order
    q_PnKRH = (
        q_BKRH if identity else jnp.zeros((P * n, K, R, H), q_BKRH.dtype).at[row_B].set(q_BKRH)
    )
    # [P*n, K, R, H] -> [P, K, n*R, H]: the n rows of a prompt are query rows of one product.
    q_PKQH = q_PnKRH.reshape(P, n, K, R, H).transpose(0, 2, 1, 3, 4).reshape(P, K, n * R, H)
    s_PKQT = jax.lax.dot_general(q_PKQH, k_PKHT, dims, preferred_element_type=jnp.float32) * scale
    s_PKQT = jnp.where(mask_PT[:, None, None, :] > 0, s_PKQT, neg)

    def to_rows(x_PKQX):  # [P, K, n*R, X] -> [B, K, R, X]
        X = x_PKQX.shape[-1]
        x_PnKRX = x_PKQX.reshape(P, K, n, R, X).transpose(0, 2, 1, 3, 4).reshape(P * n, K, R, X)
        return x_PnKRX if identity else x_PnKRX[row_B]

    m_p, l_p, o_p = (to_rows(x) for x in _softmax_parts(s_PKQT, (v_PKTH,)))

    C = k_BKHC[0].shape[3]

    def response(num_blocks):  # the first num_blocks blocks: slots [0, num_blocks * C)
        def attend(q_BKRH, k_BKHC, v_BKCH, index):
            s_BKRS = (
                jnp.concatenate(
                    [
                        jax.lax.dot_general(q_BKRH, k, dims, preferred_element_type=jnp.float32)
                        for k in k_BKHC[:num_blocks]
                    ],
                    axis=-1,
                )
                * scale
            )
            s_BKRS = jnp.where(jnp.arange(num_blocks * C) <= index, s_BKRS, neg)
            return _softmax_parts(s_BKRS, v_BKCH[:num_blocks])

        return attend

    branches = [response(j + 1) for j in range(len(k_BKHC))]
    m_r, l_r, o_r = jax.lax.switch(index // C, branches, q_BKRH, k_BKHC, v_BKCH, index)
    m = jnp.maximum(m_p, m_r)
    a_p, a_r = jnp.exp(m_p - m), jnp.exp(m_r - m)
    return (o_p * a_p + o_r * a_r) / (l_p * a_p + l_r * a_r)


def _rms_norm_fm(x, scale, eps: float, dtype, *, axis: int):
    """``RMSNorm`` over ``axis`` (float32 statistics), the scale broadcast along that axis."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return y.astype(dtype) * scale.astype(dtype).reshape(shape)


def repeat_cache(cache: KVCache, n: int) -> KVCache:
    """Each row repeated n times with copies adjacent (row b becomes rows b*n .. b*n+n-1)."""
    return KVCache(
        k_LBKHS=jnp.repeat(cache.k_LBKHS, n, axis=1),
        v_LBKSH=jnp.repeat(cache.v_LBKSH, n, axis=1),
        mask_BS=jnp.repeat(cache.mask_BS, n, axis=0),
        pos_B=jnp.repeat(cache.pos_B, n, axis=0),
        index=cache.index,
    )


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ----------------------------------------------------------------------------------------------

# (HF tensor name, params path, layout). "{i}" is the layer index: those params are stacked on L.
# Layouts (HF torch Linear weights are [out, in]):
#   same:       identical shape (embedding, norm scales)
#   bias:       HF [n*H]     <-> params [n, H]
#   linear:     HF [out, in] <-> params [in, *out]   (q/k/v [D,n,H], gate/up [D,F], lm_head [D,V])
#   linear_out: HF [out, in] <-> params [*in, out]   (o_proj [N,H,D], down [F,D])
HF_TO_JAX = (
    ("model.embed_tokens.weight", "embed/embedding", "same"),
    ("model.norm.weight", "final_norm/scale", "same"),
    ("lm_head.weight", "lm_head/kernel", "linear"),
    ("model.layers.{i}.input_layernorm.weight", "layers/input_norm/scale", "same"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers/post_attn_norm/scale", "same"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers/attn/q_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers/attn/k_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers/attn/v_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers/attn/q_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers/attn/k_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers/attn/v_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers/attn/o_proj/kernel", "linear_out"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers/attn/q_norm/scale", "same"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers/attn/k_norm/scale", "same"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers/mlp/gate_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers/mlp/up_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers/mlp/down_proj/kernel", "linear_out"),
)
# Checkpoint entries that carry no weights of their own (HF recomputes them or ties them).
_IGNORED_HF = re.compile(r"(.*\.rotary_emb\.inv_freq)$")


def _hf_regex(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


def _hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape of a (per-layer) param of `shape`."""
    match layout:
        case "same":
            return shape
        case "bias":
            return (math.prod(shape),)
        case "linear":
            return (math.prod(shape[1:]), shape[0])
        case "linear_out":
            return (shape[-1], math.prod(shape[:-1]))
    raise ValueError(f"unknown HF layout {layout!r}")


def _from_hf(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("linear", "linear_out"):
        x = x.T
    return x.reshape(shape)


def _to_hf(layout: str, y: np.ndarray) -> np.ndarray:
    match layout:
        case "same":
            return y
        case "bias":
            return y.reshape(-1)
        case "linear":
            return np.ascontiguousarray(y.reshape(y.shape[0], -1).T)
        case "linear_out":
            return np.ascontiguousarray(y.reshape(-1, y.shape[-1]).T)
    raise ValueError(f"unknown HF layout {layout!r}")


def _resolve_checkpoint_dir(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"HF checkpoint path {path!r} is a file; pass the directory")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        # A hub id: download config and safetensors (needs network access).
        import huggingface_hub

        return huggingface_hub.snapshot_download(
            path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]
        )
    raise ValueError(f"HF checkpoint {path!r} is neither a local directory nor a hub id")


def _safetensors_files(ckpt_dir: str) -> list[str]:
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(ckpt_dir, n) for n in names]
    names = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no *.safetensors weights in HF checkpoint {ckpt_dir!r}")
    return [os.path.join(ckpt_dir, n) for n in names]


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[ModelConfig, Any], Any] | None = None,
) -> tuple[ModelConfig, dict]:
    """Reads a HF Qwen2/Qwen3/Llama checkpoint (config.json + safetensors) into params.

    Args:
      path: local directory (single ``model.safetensors`` or sharded with
        ``model.safetensors.index.json``), or a hub id resolved with huggingface_hub.
      dtype: param and compute dtype of the returned config; weights are cast to it.
      shardings: optional ``(config, abstract_params) -> pytree of jax.sharding.Sharding``. Each
        param is then placed with ``jax.device_put(x, sharding)`` as soon as it is read, so the
        model never sits whole on one device. Host memory holds one (layer-stacked) param at a
        time.

    Returns:
      (config, params).

    Raises:
      ValueError: unsupported architecture, a missing or unexpected tensor, or a shape mismatch.
    """
    from safetensors import safe_open  # Deferred: only checkpoint IO needs it.

    ckpt_dir = _resolve_checkpoint_dir(path)
    config = ModelConfig.from_hf(ckpt_dir)
    config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
    abstract = abstract_params(config)
    flat_abstract = dict(_flatten(abstract))
    flat_shardings = dict(_flatten(shardings(config, abstract))) if shardings else {}
    hf_arch = _ARCH_TO_HF[config.arch]

    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(f, framework="numpy"))
            for f in _safetensors_files(ckpt_dir)
        ]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (safe_open handle, not a dict)
        # Which checkpoint tensors feed which param (and layer).
        sources: dict[str, dict[int, str]] = {}
        unexpected = []
        for key in where:
            for template, jax_name, _ in HF_TO_JAX:
                m = _hf_regex(template).match(key)
                if m and jax_name in flat_abstract:
                    sources.setdefault(jax_name, {})[int(m.group(1)) if m.groups() else -1] = key
                    break
            else:
                tied_head = key == "lm_head.weight" and config.tie_word_embeddings
                if not (tied_head or _IGNORED_HF.match(key)):
                    unexpected.append(key)
        if unexpected:
            raise ValueError(
                f"{hf_arch} checkpoint {ckpt_dir!r} has unexpected tensors {unexpected[:8]}"
            )

        flat = {}
        for template, jax_name, layout in HF_TO_JAX:
            if jax_name not in flat_abstract:
                continue
            spec = flat_abstract[jax_name]
            layered = "{i}" in template
            indices = range(config.num_layers) if layered else [-1]
            shape = spec.shape[1:] if layered else spec.shape
            parts = []
            for i in indices:
                key = sources.get(jax_name, {}).get(i)
                if key is None:
                    missing = template.format(i=i)
                    raise ValueError(
                        f"{hf_arch} checkpoint {ckpt_dir!r} is missing tensor {missing!r}"
                    )
                x = where[key].get_tensor(key)
                if tuple(x.shape) != _hf_shape(layout, shape):
                    raise ValueError(
                        f"{hf_arch} tensor {key!r} has shape {tuple(x.shape)}, expected "
                        f"{_hf_shape(layout, shape)} from config.json"
                    )
                parts.append(_from_hf(layout, x, shape).astype(spec.dtype))
            flat[jax_name] = place(
                np.stack(parts) if layered else parts[0], flat_shardings.get(jax_name)
            )
            del parts
    return config, _unflatten(flat)


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[ModelConfig, Any], Any] | None = None,
) -> tuple[ModelConfig, dict]:
    """Reads a llama.cpp GGUF checkpoint (Llama/SmolLM2, Qwen2, Qwen3) into params, without torch.

    The hyper-parameters come from the GGUF metadata. Quantised tensors (Q4_0, Q4_1, Q8_0,
    K-quants, F16, BF16, ...) are dequantised in numpy with ``gguf.quants.dequantize`` and cast
    to ``dtype``, so the params are an ordinary float model holding the file's rounded weights.
    The implementation lives in grpo_jax/gguf_checkpoint.py.

    Args:
      path: the ``.gguf`` file.
      dtype: param and compute dtype of the returned config; weights are cast to it.
      shardings: as in ``load_hf_checkpoint``: each param is placed with ``jax.device_put`` as
        soon as it is built.

    Returns:
      (config, params).

    Raises:
      ValueError: unsupported architecture or feature, or a missing, unexpected or mis-shaped
        tensor (named).
    """
    from grpo_jax import gguf_checkpoint  # Deferred: needs the gguf package.

    return gguf_checkpoint.load(path, dtype=dtype, shardings=shardings)


def load(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[ModelConfig, Any], Any] | None = None,
) -> tuple[ModelConfig, dict]:
    """``load_gguf`` for a path ending in ``.gguf``, ``load_hf_checkpoint`` (dir or hub id) else."""
    if os.fspath(path).lower().endswith(".gguf"):
        return load_gguf(path, dtype=dtype, shardings=shardings)
    return load_hf_checkpoint(path, dtype=dtype, shardings=shardings)


def place(value: np.ndarray, sharding=None) -> jax.Array:
    """A host array on its devices: split by `sharding` when given (the loaders' last step)."""
    return jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)


def to_hf_state_dict(config: ModelConfig, params, *, untie_embeddings: bool = False) -> dict:
    """Params as a dict of HF tensor names -> host numpy arrays in the params' dtype.

    Args:
      untie_embeddings: for a tied model, also emit ``lm_head.weight`` (a copy of the embedding),
        as vLLM's weight reload expects.
    """
    check_params(config, params)
    flat = dict(_flatten(params))
    out = {}
    for template, jax_name, layout in HF_TO_JAX:
        if jax_name not in flat:
            continue
        host = np.asarray(jax.device_get(flat[jax_name]))
        if "{i}" in template:
            for i in range(config.num_layers):
                out[template.format(i=i)] = _to_hf(layout, host[i])
        else:
            out[template] = _to_hf(layout, host)
    if config.tie_word_embeddings and untie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].copy()
    return out


def save_hf_checkpoint(
    config: ModelConfig, params, path: str | os.PathLike, *, untie_embeddings: bool = False
) -> None:
    """Writes HF safetensors (params dtype, lossless) and ``config.json`` into ``path``.

    transformers' ``AutoModelForCausalLM.from_pretrained(path)`` and vLLM load the result. With
    ``untie_embeddings`` a tied model is written untied (``lm_head.weight`` plus
    ``tie_word_embeddings: false``). It is grpo_jax/hf_export.py's sharded, tensor-by-tensor
    writer, so it works on params split across processes: there it is a collective, and every
    process must call it (only process 0 writes).
    """
    from grpo_jax import hf_export  # deferred: hf_export imports this module

    hf_export.save(config, params, path, untie_embeddings=untie_embeddings)
