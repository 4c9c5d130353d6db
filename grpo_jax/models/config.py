"""The hyper-parameters of one decoder-only transformer (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama 3.x).

`ModelConfig` is frozen and hashable (a valid `jax.jit` static argument); `ModelConfig.from_hf`
reads a transformers config.json (both its transformers 5 and older layouts) and refuses what
the model does not implement; `ModelConfig.tiny()` is the test-size model; `to_hf_dict()` writes
the config.json transformers and vLLM load.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


ARCH_TO_HF = {arch: hf for hf, arch in ARCHITECTURES.items()}

# Reward models (grpo_jax/models/reward_head.py): the same decoder with a score head instead of
# the LM head; hf.load_hf_sequence_classifier reads them.
SEQUENCE_CLASSIFIERS = {
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "LlamaForSequenceClassification": "llama",
}


_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


REMAT_POLICIES = (
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "dots_except_mlp_in_saveable",
)


# model.attention_impl: how causal self-attention runs (grpo_jax/models/attention.py).
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")

# The sampler's KV cache (decode.cache_dtype says what "auto" stores).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


# The projections LoRA can adapt (HF module names; PEFT's "all-linear" is all of them: the
# output head is excluded, as PEFT does).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The params key of the LoRA adapters (a separate subtree, grpo_jax/models/lora.py).
ADAPTERS = "lora"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder; frozen and hashable, so it is a valid ``jit`` static arg.

    Dimension letters (house style): V vocab_size, D hidden_size, F intermediate_size, L num_layers,
    N num_heads, K num_kv_heads, H head_dim.

    Attributes:
      arch: "qwen2" (q/k/v bias), "qwen3" (q/k RMSNorm), "qwen3_moe" (Qwen3 with
        mixture-of-experts layers, grpo_jax/models/moe.py) or "llama" (Llama 3.x, SmolLM2).
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
      attention_impl: causal self-attention's implementation, one of ATTENTION_IMPLS
        ("auto", "xla": dense float32 scores, "blockwise": memory linear in the row length,
        "cudnn": cuDNN's fused attention on NVIDIA GPUs, "splash": Pallas splash attention
        on TPUs (interpret mode elsewhere); ``attention.resolve`` says what "auto" runs).
      kv_cache_dtype: what the sampler's KV cache (grouped or paged) stores, one of
        KV_CACHE_DTYPES (its decode attention computes in the wider of it and `dtype`); "auto"
        is the compute dtype, except float32 for a bfloat16 model on XLA:CPU
        (``decode.cache_dtype`` says why).
      eos_token_ids: every EOS id from config.json (an int or list there).
      lora_rank: r of the LoRA adapters (grpo_jax/models/lora.py) the projections in `lora_targets`
        take when the params carry them (``params["lora"]``); 0 = no adapters. The adapters
        add (alpha / r) * (x @ A) @ B to each targeted projection; params without them run the
        base model, whatever these fields say.
      lora_alpha: LoRA's alpha (scale alpha / r).
      lora_targets: projection names in LORA_TARGETS (HF names: q_proj, ..., down_proj).
      num_experts: E, the routed experts of a mixture-of-experts layer (arch "qwen3_moe";
        0 for dense archs). HF's names from here on (Qwen3MoeConfig).
      num_experts_per_tok: k, the experts each token is routed to (top-k of the router).
      moe_intermediate_size: each expert's SwiGLU width (``intermediate_size`` is the dense
        layers' width).
      norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE: true).
      decoder_sparse_step: layer i is a MoE layer when (i + 1) % decoder_sparse_step == 0 and i
        is not in `mlp_only_layers` (HF's rule); the others are dense.
      mlp_only_layers: layer indices that stay dense.
      router_aux_loss_coef: the coefficient of the load-balancing loss (HF's
        ``load_balancing_loss_func``; grpo_jax/models/moe.py) in the actor loss.
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
    attention_impl: str = "auto"
    kv_cache_dtype: str = "auto"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if self.arch not in ARCH_TO_HF:
            raise ValueError(
                f"ModelConfig.arch={self.arch!r} is not supported; expected one of "
                f"{sorted(ARCH_TO_HF)}"
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
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention_impl={self.attention_impl!r}; expected one of "
                f"{ATTENTION_IMPLS}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"ModelConfig.kv_cache_dtype={self.kv_cache_dtype!r}; expected one of "
                f"{KV_CACHE_DTYPES}"
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
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        self._check_moe()
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"ModelConfig: rope_type={rope_type!r} is not supported for arch={self.arch!r}; "
                f"expected one of {_SUPPORTED_ROPE_TYPES}"
            )

    def _check_moe(self) -> None:
        if self.arch != "qwen3_moe":
            if self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts={self.num_experts} needs arch='qwen3_moe' "
                    f"(arch={self.arch!r} is dense); set num_experts=0"
                )
            return
        if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ValueError(
                f"ModelConfig(arch='qwen3_moe'): num_experts={self.num_experts} and "
                f"moe_intermediate_size={self.moe_intermediate_size} must be positive"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"ModelConfig.decoder_sparse_step={self.decoder_sparse_step} must be >= 1"
            )
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"ModelConfig.mlp_only_layers={self.mlp_only_layers} must be layer indices in "
                f"[0, num_layers={self.num_layers})"
            )
        if self.router_aux_loss_coef < 0:
            raise ValueError(
                f"ModelConfig.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0"
            )
        attention_only = {"q_proj", "k_proj", "v_proj", "o_proj"}
        if self.lora_rank and not set(self.lora_targets) <= attention_only:
            raise ValueError(
                f"ModelConfig.lora_targets={self.lora_targets}: on arch='qwen3_moe' LoRA adapts "
                f"the attention projections only ({sorted(attention_only)}); drop the MLP ones"
            )

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a mixture-of-experts layer (HF Qwen3MoeDecoderLayer's rule)."""
        return tuple(
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def ffn_row(self, layer: int) -> int:
        """Layer `layer`'s row in its feed-forward stack: ``layers/moe`` (MoE layers, in order)
        or ``layers/mlp`` (the dense ones)."""
        kinds = self.moe_layers
        return sum(1 for i in range(layer) if kinds[i] == kinds[layer])

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
            archs = [ARCH_TO_HF.get(hf.model_type, f"<model_type {hf.model_type!r}>")]
        known = ARCHITECTURES | SEQUENCE_CLASSIFIERS
        if archs[0] not in known:
            raise ValueError(
                f"Unsupported architecture {archs[0]!r}; grpo_jax.model supports "
                f"{sorted(known)}"
            )
        arch = known[archs[0]]
        if getattr(hf, "use_sliding_window", False):
            raise ValueError(
                f"{archs[0]}: sliding-window attention (use_sliding_window) is unsupported"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"{archs[0]}: hidden_act={hf.hidden_act!r} is unsupported (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{archs[0]}: mlp_bias=True is unsupported")
        if arch == "qwen3_moe" and getattr(hf, "shared_expert_intermediate_size", 0):
            raise ValueError(f"{archs[0]}: shared experts are unsupported")
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
        moe = {}
        if arch == "qwen3_moe":
            moe = {
                "num_experts": hf.num_experts,
                "num_experts_per_tok": hf.num_experts_per_tok,
                "moe_intermediate_size": hf.moe_intermediate_size,
                "norm_topk_prob": bool(hf.norm_topk_prob),
                "decoder_sparse_step": hf.decoder_sparse_step,
                "mlp_only_layers": tuple(hf.mlp_only_layers or ()),
                "router_aux_loss_coef": float(hf.router_aux_loss_coef),
            }
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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=getattr(hf, "pad_token_id", None),
            initializer_range=getattr(hf, "initializer_range", 0.02),
            **moe,
        )

    def to_hf_dict(self, *, untie_embeddings: bool = False) -> dict[str, Any]:
        """config.json contents (transformers 5 layout) that transformers and vLLM load."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta} | self.rope_scaling_dict
        out = {
            "architectures": [ARCH_TO_HF[self.arch]],
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
        if self.arch in ("qwen2", "qwen3", "qwen3_moe"):
            out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 0}
        if self.arch == "qwen3_moe":
            out |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
            }
        if self.arch in ("llama", "qwen3", "qwen3_moe"):
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
