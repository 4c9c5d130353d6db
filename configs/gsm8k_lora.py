r"""GRPO-LoRA on GSM8K: verl's published LoRA baseline (docs/algo/baseline.md).

Run:
  python train.py --config=configs/gsm8k_lora.py:model=qwen2.5-0.5b \
      --config.trainer.default_local_dir=runs/gsm8k_lora_qwen05
  python train.py --config=configs/gsm8k_lora.py:smoke   # tiny random model + LoRA, 2 steps, CPU

Expected (verl docs/algo/baseline.md, log Qwen2.5-0.5B-bsz64_2-prompt512-resp1024-lorarank32-
score0.543 in eric-haibin-lin/verl-data): Qwen2.5-0.5B-Instruct 49.6 -> 54.3 % val/gsm8k/acc
after 1 epoch on 2 GPUs (1.5B: 77.9, 3B: 86.1, 7B: 93.4 with the same settings); not yet
reproduced with grpo_jax.

Recipe (that log's command): configs/gsm8k.py's GRPO (rollout.n 5, low_var_kl KL loss 0.001,
token-mean, clip 0.2, prompts 512 / responses 1024 tokens) with LoRA rank 32, alpha 32 on all
linear layers (model.lora_rank / lora_alpha / target_modules, verl's names), lr 3e-5 (verl's
LoRA advice: an order of magnitude above full fine-tuning's 1e-6; its example script
run_qwen2_5-3b_gsm8k_grpo_lora.sh uses rank 64 / lr 3e-6 for 3B), 64 prompts per step and per
mini-batch (one update per step, on-policy), entropy_coeff 0.001, 1 epoch. verl's
ppo_micro_batch_size=64 (global, 2 GPUs) is 32 sequences per device here.

What LoRA changes (grpo_jax/models/lora.py): only the adapters train and only they have Adam state;
the base stays frozen and is also the KL reference (adapters switched off, no copy). The native
sampler samples from the merged weights; with rollout.name="vllm", rollout.vllm.lora_sync picks
"merged" pushes or "adapter" (PEFT files + vLLM's runtime LoRA loading; verl syncs adapters).
"""

from configs import common, gsm8k


def get_config(arg=None):
    c = gsm8k.get_config(arg)
    smoke = common.parse_arg(arg, model="", smoke=False).smoke  # gsm8k.py's variants
    c.model.lora_rank = 32
    c.model.lora_alpha = 32.0
    c.model.target_modules = "all-linear"
    c.actor.optim.lr = 3e-5
    c.actor.entropy_coeff = 0.001
    if not smoke:  # the smoke variant keeps common.make_smoke's tiny batches
        c.data.train_batch_size = 64
        c.actor.ppo_mini_batch_size = 64
        c.actor.ppo_micro_batch_size_per_gpu = 32
        c.rollout.log_prob_micro_batch_size_per_gpu = 32
        # That log's command gives micro-batch sizes, not token budgets: padded micro-batches.
        c.actor.use_dynamic_bsz = False
        c.rollout.log_prob_use_dynamic_bsz = False
        c.trainer.total_epochs = 1
        c.trainer.default_local_dir = "runs/gsm8k_lora"
    else:
        c.model.lora_rank = 4  # the tiny model's D = 32: rank 32 would not be low-rank
        c.model.lora_alpha = 4.0
    return c
