r"""DAPO on GSM8K (Yu et al. 2025, arXiv 2503.14476; verl's recipe/dapo, test_dapo_7b_math.sh).

Run:
  python train.py --config=configs/gsm8k_dapo.py:model=qwen2.5-0.5b
  python train.py --config=configs/gsm8k_dapo.py:smoke      # tiny random model, 2 steps, CPU

DAPO's four changes to GRPO, with verl's names:
  * clip-higher: actor.clip_ratio_low 0.2, actor.clip_ratio_high 0.28;
  * dynamic sampling: algorithm.filter_groups (enable, metric) drops the groups whose samples
    all score the same and samples two new prompts for each (at most max_inflight_gen_batches
    x train_batch_size at a time) until train_batch_size groups remain, as verl 0.9.1's Sync
    DAPO does. The recipe's max_num_gen_batches 10 and gen_batch_size 3 x train_batch_size are
    left out: verl 0.9.1 ignores the first and overrides the second to 1 (with warnings);
  * token-level loss: actor.loss_agg_mode "token-mean";
  * overlong reward shaping: reward.overlong_buffer (len 256 of the 1024-token responses,
    penalty_factor 1.0); no KL term at all (use_kl_loss and use_kl_in_reward off).
Other recipe values: rollout.n 16, lr 1e-6 with 10 warm-up steps, weight decay 0.1, grad clip
1.0, 512 prompts per step in mini-batches of 32. The filter metric is "acc", as in the recipe
(verl's default is "reward", which includes the overlong penalty): GSM8K's verl scorer returns
a plain 0/1 score, which verl's reward managers (and grpo_jax) take as "acc". Expected: no
published DAPO number for GSM8K at this size; not yet run with grpo_jax.

The :smoke variant warms the random model up on the reference answers first, so that some
completions end early; it filters on verl's default metric "reward", whose overlong penalty
then varies within groups (the warmed-up model rarely gets a sum right, so nearly every "acc"
group is uniform and a step would refill thousands of them). Its warm-up batches of 20 split
into the 5-row micro-batches of gsm8k's :smoke.
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
    c.reward.overlong_buffer.enable = True
    c.reward.overlong_buffer.penalty_factor = 1.0
    c.reward.overlong_buffer.log = True
    if smoke:  # gsm8k's :smoke sizes; a warmed-up model, so that some groups are informative
        c.reward.overlong_buffer.len = 4
        c.algorithm.filter_groups.metric = "reward"
        c.warmup.steps = 40
        c.warmup.batch_size = 20
        c.trainer.default_local_dir = "runs/smoke_dapo"
        return c
    c.reward.overlong_buffer.len = 256
    c.rollout.n = 16
    c.data.train_batch_size = 512
    c.actor.ppo_mini_batch_size = 32
    c.actor.optim.lr = 1e-6
    c.actor.optim.lr_warmup_steps = 10
    c.actor.optim.weight_decay = 0.1
    c.actor.grad_clip = 1.0
    c.rollout.val_kwargs.top_p = 0.7
    c.trainer.default_local_dir = "runs/gsm8k_dapo"
    return c
