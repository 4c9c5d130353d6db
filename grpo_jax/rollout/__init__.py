"""Rollout engines beyond the native sampler: the vLLM sidecar (vllm_sidecar, vllm_pool), weight
transfer to it (nccl_transfer), and rollouts one step ahead of the update (async_rollout)."""
