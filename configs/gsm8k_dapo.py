r"""DAPO on GSM8K (Yu et al. 2025, arXiv 2503.14476; verl's recipe/dapo, test_dapo_7b_math.sh).

Run:
  python train.py --config=configs/gsm8k_dapo.py:model=qwen2.5-0.5b
  python train.py --config=configs/gsm8k_dapo.py:smoke      # tiny random model, 2 steps, CPU

DAPO's four changes to GRPO, with verl's names:
  * clip-higher: actor.clip_ratio_low 0.2, actor.clip_ratio_high 0.28;
  * dynamic sampling: algorithm.filter_groups (enable, metric, max_num_gen_batches 10) drops the
    groups whose samples all score the same and samples data.gen_batch_size (3 x
    train_batch_size) prompts at a time until train_batch_size informative groups remain;
  * token-level loss: actor.loss_agg_mode "token-mean";
  * overlong reward shaping: reward.overlong_buffer (len 256 of the 1024-token responses,
    penalty_factor 1.0); no KL term at all (use_kl_loss and use_kl_in_reward off).
Other recipe values: rollout.n 16, lr 1e-6 with 10 warm-up steps, weight decay 0.1, grad clip
1.0, 512 prompts per step in mini-batches of 32. The filter metric is "acc", as in the recipe:
GSM8K's verl scorer returns a plain 0/1 score, which verl's DAPO reward manager (and grpo_jax)
takes as "acc". Expected: no published DAPO number for GSM8K at this size; not yet run with
grpo_jax. The :smoke variant warms the random model up on the reference answers first, so
that some groups mix right and wrong answers.
"""

from configs import gsm8k


def get_config(arg=None):
    c = gsm8k.get_config(arg)
    smoke = c.trainer.default_local_dir == "runs/smoke"
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.loss_agg_mode = "token-mean"
    c.actor.use_kl_loss = False
    c.actor.kl_loss_coef = 0.0
    c.algorithm.use_kl_in_reward = False
    c.algorithm.filter_groups.enable = True
    c.algorithm.filter_groups.metric = "acc"
    c.algorithm.filter_groups.max_num_gen_batches = 10
    c.reward.overlong_buffer.enable = True
    c.reward.overlong_buffer.penalty_factor = 1.0
    c.reward.overlong_buffer.log = True
    if smoke:  # gsm8k's :smoke sizes; a warmed-up model, so that some groups are informative
        c.reward.overlong_buffer.len = 4
        c.data.gen_batch_size = 8
        c.warmup.steps = 40
        c.algorithm.filter_groups.max_num_gen_batches = 20
        c.trainer.default_local_dir = "runs/smoke_dapo"
        return c
    c.reward.overlong_buffer.len = 256
    c.rollout.n = 16
    c.data.train_batch_size = 512
    c.data.gen_batch_size = 3 * 512
    c.actor.ppo_mini_batch_size = 32
    c.actor.optim.lr = 1e-6
    c.actor.optim.lr_warmup_steps = 10
    c.actor.optim.weight_decay = 0.1
    c.actor.grad_clip = 1.0
    c.rollout.val_kwargs.top_p = 0.7
    c.trainer.default_local_dir = "runs/gsm8k_dapo"
    return c
