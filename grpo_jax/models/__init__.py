"""The Transformer family behind grpo_jax.model: LoRA adapters (lora), HF safetensors I/O (hf)
and GGUF files (gguf)."""
