"""Section `model` (verl's actor_rollout_ref.model.*): which weights and tokenizer a run loads."""

from __future__ import annotations

import dataclasses

from grpo_jax import model as model_lib
from grpo_jax.config.checks import Checks, positive
from grpo_jax.models import lora


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the random model of model.source="random" (tests, smoke runs)."""

    hidden_size: int = 64  # D
    intermediate_size: int = 128  # F
    num_layers: int = 2  # L
    num_heads: int = 4  # N
    num_kv_heads: int = 2  # K
    head_dim: int = 16  # H
    seed: int = 0  # init seed
    # > 0: a Qwen3-MoE instead of the dense Qwen2 layers, every layer a mixture of this many
    # experts of width moe_intermediate_size, num_experts_per_tok of them a token
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32

    def __post_init__(self):
        c = Checks("model.tiny")
        positive(c, self, "hidden_size", "intermediate_size", "num_layers", "num_heads")
        positive(c, self, "num_kv_heads", "head_dim")
        c.need(self.num_experts >= 0, "num_experts", self.num_experts, "must be >= 0 (0: dense)")
        if self.num_experts > 0:
            positive(c, self, "moe_intermediate_size")
            c.need(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                   self.num_experts_per_tok,
                   f"must be in [1, model.tiny.num_experts={self.num_experts}]")  # fmt: skip
        if self.num_heads >= 1 and self.num_kv_heads >= 1:
            c.need(
                self.num_heads % self.num_kv_heads == 0,
                "num_heads",
                self.num_heads,
                f"must be a multiple of model.tiny.num_kv_heads={self.num_kv_heads} (grouped-query "
                "attention)",
            )
        c.done()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Section `model`: which weights and tokenizer, and how the model computes."""

    path: str | None = None  # HF checkpoint dir, hub id, or a .gguf file (source "hf")
    source: str = "hf"  # "hf" (load model.path) | "random" (init model.tiny)
    tokenizer: str = "hf"  # "hf" (from model.path, GGUF included) | "char" (built-in)
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    param_dtype: str = "float32"  # parameter / optimizer dtype: "float32" | "bfloat16"
    enable_gradient_checkpointing: bool = False  # remat each layer in the update (verl name)
    # What a rematerialised layer keeps (model.REMAT_POLICIES): "nothing_saveable" (its input
    # only), "dots_with_no_batch_dims_saveable" (the projections; attention is recomputed),
    # "dots_except_mlp_in_saveable" (those but the MLP's gate/up), "dots_saveable" (every
    # matmul output).
    gradient_checkpointing_policy: str = "nothing_saveable"
    # How causal self-attention runs in the update and the log-prob passes
    # (grpo_jax/models/attention.py): "xla" (dense float32 scores, T^2 a row and head),
    # "blockwise" (online softmax over key blocks: memory linear in the row length), "cudnn"
    # (GPU, bf16/fp16), "splash" (TPU; Pallas interpret mode elsewhere, for tests), "auto"
    # (splash on TPU, cudnn on GPU where it can run, else blockwise; on the CPU blockwise for
    # rows of 2,048 tokens or more, else xla).
    attention_impl: str = "auto"
    # LoRA (grpo_jax/models/lora.py; verl's actor_rollout_ref.model.*): rank r of the adapters
    # trained on the frozen base; 0 = full fine-tuning. The reference is then the base, adapters
    # off.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    # "all-linear" (every projection but the output head, as PEFT) or comma-separated names out
    # of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    target_modules: str = "all-linear"
    tiny: TinyModelConfig = TinyModelConfig()

    def __post_init__(self):

        c = Checks("model")
        c.choice("source", self.source, ("hf", "random"))
        c.choice("tokenizer", self.tokenizer, ("hf", "char"))
        c.choice("dtype", self.dtype, ("float32", "bfloat16"))
        c.choice("param_dtype", self.param_dtype, ("float32", "bfloat16"))
        c.choice(
            "gradient_checkpointing_policy",
            self.gradient_checkpointing_policy,
            model_lib.REMAT_POLICIES,
        )
        c.choice("attention_impl", self.attention_impl, model_lib.ATTENTION_IMPLS)
        c.need(self.lora_rank >= 0, "lora_rank", self.lora_rank, "must be >= 0 (0 = no LoRA)")
        c.need(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        c.call(lora.parse_target_modules, self.target_modules)
        c.done()

    def check_source(self) -> None:
        """What loading needs (the loader and train.py call it; not needed for a given model)."""
        c = Checks("model")
        if "hf" in (self.source, self.tokenizer):
            c.need(
                bool(self.path),
                "path",
                self.path,
                "is required with model.source='hf' or "
                "model.tokenizer='hf' (an HF checkpoint dir, hub id or .gguf file)",
            )
        c.done()
