"""grpo_jax: JAX-native GRPO post-training of LLMs with verl's semantics.

Submodules are imported explicitly (``from grpo_jax import loss``); this package file imports
nothing, so ``grpo_jax.loss`` and ``grpo_jax.advantage`` stay free of flax, transformers,
tensorflow-datasets and vllm.
"""
