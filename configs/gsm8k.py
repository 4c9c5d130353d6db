r"""GRPO on GSM8K with verl's recipe (examples/grpo_trainer/run_qwen2-7b_seq_balance.sh et al.).

Run:
  python train.py --config=configs/gsm8k.py:model=qwen2.5-0.5b \
      --config.trainer.default_local_dir=runs/gsm8k_qwen05
  python train.py --config=configs/gsm8k.py --config.model.path=/path/to/hf_dir \
      --config.data.source=files --config.data.path=train.jsonl --config.data.val_path=test.jsonl
  python train.py --config=configs/gsm8k.py:smoke      # tiny random model, 2 steps, < 60 s CPU

Expected (verl docs/algo/baseline.md): Qwen2.5-0.5B-Instruct 49.6 -> ~54-57 % val/gsm8k/acc
(strict "####" extraction) after 15 epochs on 8 GPUs; not yet reproduced with grpo_jax.

Recipe: rollout.n 5, use_kl_loss with kl_loss_coef 0.001 (low_var_kl), token-mean, clip 0.2,
lr 1e-6, prompts 512 / responses 1024 tokens, 1024 prompts per step, mini-batch 256 prompts,
token-budget micro-batches of 24000 tokens per device (use_dynamic_bsz, which verl's log-prob
passes inherit) and gradient checkpointing, as run_qwen2-7b_seq_balance.sh sets them.
Deviations from the GRPO paper (verl's choices, kept): token-mean aggregation instead of the
paper's per-sequence mean; the KL term is k3 ("low_var_kl") with verl's clamps.
"""

from configs import common

# `:model=<name>` -> Hugging Face hub id (downloaded to the HF cache on first use).
MODELS = {
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
}


def get_config(arg=None):
    arg = common.parse_arg(arg, model="", smoke=False)
    c = common.grpo_config()
    c.data.source = "tfds"  # GSM8K from tensorflow-datasets; data.source=files reads data.path
    c.data.max_prompt_length = 512
    c.data.max_response_length = 1024
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 1024
    c.actor.ppo_mini_batch_size = 256
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.loss_agg_mode = "token-mean"
    c.actor.optim.lr = 1e-6
    c.actor.use_dynamic_bsz = True
    c.actor.ppo_max_token_len_per_gpu = 24000
    # The log-prob passes follow the actor (rollout.log_prob_use_dynamic_bsz and
    # log_prob_max_token_len_per_gpu left None, verl's interpolation): packed, 24000 tokens.
    c.model.enable_gradient_checkpointing = True
    c.rollout.n = 5
    c.algorithm.adv_estimator = "grpo"
    c.trainer.total_epochs = 15
    c.trainer.test_freq = 5
    c.trainer.save_freq = 20
    c.trainer.default_local_dir = "runs/gsm8k"
    if arg.model:
        if arg.model not in MODELS:
            raise ValueError(
                f"configs/gsm8k.py:model must be one of {sorted(MODELS)}, got {arg.model!r}"
            )
        c.model.path = MODELS[arg.model]
    if arg.smoke:
        common.make_smoke(c)
    return c
