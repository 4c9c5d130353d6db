r"""GRPO with Qwen3-8B: verl 0.9.1's examples/grpo_trainer/run_qwen3_8b_fsdp.sh (GPU, vLLM).

Needs 8 GPUs on one host (the script's trainer.n_gpus_per_node=8, nnodes=1) and a vLLM venv
(README "vLLM sidecar", GPU setup):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 python train.py --config=configs/gsm8k_qwen3_8b.py \
      --config.rollout.vllm.python=$HOME/vllm-venv/bin/python
  python train.py --config=configs/gsm8k_qwen3_8b.py:jax      # native JAX sampler (TPU)
  python train.py --config=configs/gsm8k_qwen3_8b.py:smoke    # tiny random model, 2 steps, CPU
Does it fit? (README "Memory planner"; simulates the 8 devices on a CPU):
  python plan.py --config=configs/gsm8k_qwen3_8b.py --model=qwen3-8b --device=h200 --devices=8
  python plan.py --config=configs/gsm8k_qwen3_8b.py:jax --model=qwen3-8b --device=v5p --devices=8
As the script sets it, the recipe fits JAX's 40 % of an H200 (docs/scaling.md: the update at
24576 tokens a device peaks at 43.1 GiB of 47.3 on FSDP 8, 39.1 on FSDP 4 x tensor 2, with the
GPUs' linear-memory attention). On a TPU v5p-16 (8 chips), `:jax` samples with the paged
engine, 32 rows in flight a chip (rollout.max_num_seqs=32: 76.5 GiB of a chip's 85.5 on FSDP 8;
the planner fits at most 48 there, 96 on FSDP 4 x tensor 2; verl's default of 256 would need
276 GiB): the recipe's 1024 prompts x 5 a step, unchanged (docs/scaling.md).

Data as in the script: GSM8K and MATH in verl's parquet layout (configs/math.py, whose recipe
this extends), ~/data/{gsm8k,math}/{train,test}.parquet; for GSM8K alone set data.path and
data.val_path to the gsm8k files. Expected: the script publishes no number; not yet run with
grpo_jax.

Recipe (the script's GPU defaults): rollout.n 5, 1024 prompts per step in mini-batches of 256
(4 optimizer steps per batch, so old log-probs are recomputed), prompts 1024 / responses 2048
tokens, lr 1e-6, use_kl_loss with kl_loss_coef 0.001 (low_var_kl = k3), entropy_coeff 0,
gradient checkpointing, token-budget micro-batches (actor.use_dynamic_bsz,
ppo_max_token_len_per_gpu 24576; rollout.log_prob_use_dynamic_bsz with the same budget for the
old and reference passes), vLLM rollout with tensor_model_parallel_size 2 and
gpu_memory_utilization 0.6, 15 epochs, validate every 5 steps, save every 20. FSDP over all 8
devices: mesh (1, -1, 1), parameters and Adam state in float32, compute in bfloat16 (verl's FSDP
mixed precision); the other mesh is (1, -1, 2), FSDP 4 x tensor 2 (README "Mesh").

Knobs of the script that grpo_jax does not have:
  * actor.fsdp_config.param_offload / optimizer_offload (False in the script): nothing is
    offloaded here either. ref.fsdp_config.param_offload=True: the reference copy stays on
    the devices (4 GB a device at FSDP 8, float32), there is no offload.
  * ref.log_prob_use_dynamic_bsz / ref.log_prob_max_token_len_per_gpu: rollout.log_prob_*
    serve both the old and the reference pass.
  * model.use_remove_padding: packing (README "Packed sequences") removes the padding and
    fills every micro-batch to its token budget. trainer.balance_batch is verl's (True, its
    default): the mini-batches of a step are cut from the 8 ranks' balanced parts as verl's.
  * fsdp_config.ulysses_sequence_parallel_size (sp_size 1 in the script): no sequence
    parallelism.
  * The rollout engine: verl puts vLLM to sleep while the actor trains; grpo_jax's sidecar
    stays resident, so on its GPUs JAX has only 1 - gpu_memory_utilization of the memory (cap
    it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.4; plan.py budgets with it). Like verl's 8 / TP =
    4 replicas, rollout.vllm.num_servers = 4 servers of TP 2 GPUs each (server i on GPUs 2i and
    2i + 1, grpo_jax/rollout/vllm_pool.py) split every batch's prompts.
"""

import os

from configs import common
from configs import math as math_config

MODEL = "Qwen/Qwen3-8B"


def get_config(arg=None):
    arg = common.parse_arg(arg, rollout="vllm", smoke=False)
    if arg.rollout not in ("vllm", "jax"):
        raise ValueError(
            f"configs/gsm8k_qwen3_8b.py:rollout must be vllm or jax, not {arg.rollout!r}"
        )
    c = math_config.get_config()
    c.model.path = MODEL
    c.model.dtype = "bfloat16"
    c.data.max_response_length = 2048
    c.actor.use_dynamic_bsz = True
    c.actor.ppo_max_token_len_per_gpu = 24576
    c.rollout.log_prob_use_dynamic_bsz = True
    c.rollout.log_prob_max_token_len_per_gpu = 24576
    c.rollout.name = arg.rollout
    if arg.rollout == "jax":  # the paged engine's slots a chip that fit a v5p (docstring)
        c.rollout.max_num_seqs = 32
    c.rollout.tensor_model_parallel_size = 2
    c.rollout.vllm.gpu_memory_utilization = 0.6
    c.rollout.vllm.num_servers = 4  # verl: 8 GPUs / TP 2 replicas, each on GPUs of its own
    # The interpreter of the README's GPU setup (`python -m venv ~/vllm-venv`).
    c.rollout.vllm.python = os.path.expanduser("~/vllm-venv/bin/python")
    c.mesh.shape = (1, -1, 1)
    c.trainer.balance_batch = True
    c.trainer.default_local_dir = "runs/gsm8k_qwen3_8b"
    if arg.smoke:  # the same code path on CPU: tiny random model, native sampler
        common.make_smoke(c)
        c.rollout.name = "jax"
    return c
