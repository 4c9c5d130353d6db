r"""GRPO on programming problems scored by running the code: verl's code reward (prime_code).

Data: verl-layout parquets (as PRIME's Eurus-2-RL-Data code rows): data_source one of
"codecontests", "apps", "codeforces", "taco"; prompt a chat list; reward_model.ground_truth the
JSON text of {"inputs": [...], "outputs": [...]} for stdin/stdout problems, with "fn_name" for
call-based ones; extra_info a dict. verl's default_compute_score (reward.fn's default) runs the
completion's last python block on the tests in grpo_jax's sandbox (grpo_jax/rewards/code.py:
verl's 5 s first pass over all tests, then 10 s per test over the first 10 for partial credit),
or on a SandboxFusion service with --config.reward.sandbox_fusion.url=http://host:8080/run_code
(grpo_jax/rewards/sandbox_fusion.py). docs/data-and-rewards.md ("Code execution") lists the
rules and where grpo_jax differs from verl.

Run:
  python train.py --config=configs/code.py --config.model.path=Qwen/Qwen2.5-Coder-1.5B-Instruct
      (reads ~/data/code/{train,test}.parquet; override data.path / data.val_path)
  python scripts/prepare_code_data.py data/code   # 8 hand-written problems, verl's layout
  python train.py --config=configs/code.py:tiny     # random model on them, CPU

Recipe: rollout.n 8, 64 prompts a step in 4 mini-batches, lr 1e-6, no KL term, prompts 1024 and
responses 2048 tokens, token-mean, gradient checkpointing; 8 reward workers (each runs a
completion's tests, up to 10 sandboxes at once) with a 60 s limit per completion (a completion
that fails takes up to ~20 s: verl's two passes). Not yet run with grpo_jax at this scale, and
verl publishes no number for it.

The `:tiny` variant: a random 2-layer model with the character tokenizer on the problems of
scripts/prepare_code_data.py, a 60-step supervised warm-up on their reference programs (so the
model writes programs at all), then GRPO with rewards from running what it writes; 2 steps.
"""

import os

from configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, tiny=False)
    c = common.grpo_config()
    c.data.source = "files"
    home = os.path.expanduser("~/data")
    c.data.path = f"{home}/code/train.parquet"
    c.data.val_path = f"{home}/code/test.parquet"
    c.data.max_prompt_length = 1024
    c.data.max_response_length = 2048
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 64
    c.actor.ppo_mini_batch_size = 16
    c.actor.optim.lr = 1e-6
    c.actor.use_kl_loss = False
    c.actor.loss_agg_mode = "token-mean"
    c.model.enable_gradient_checkpointing = True
    c.rollout.n = 8
    c.algorithm.adv_estimator = "grpo"
    c.reward.fn = "grpo_jax.rewards.scorers:default_compute_score"
    c.reward.num_workers = 8
    c.reward.timeout_s = 60.0
    c.trainer.total_epochs = 5
    c.trainer.test_freq = 10
    c.trainer.save_freq = 50
    c.trainer.default_local_dir = "runs/code"
    if arg.tiny:
        _tiny(c)
    return c


def _tiny(c):
    """Random model, char tokenizer, scripts/prepare_code_data.py's problems (data/code)."""
    c.data.path = "data/code/train.parquet"
    c.data.val_path = "data/code/test.parquet"
    c.model.source = "random"
    c.model.tokenizer = "char"
    c.model.path = None
    c.model.enable_gradient_checkpointing = False
    common.two_layer_model(c)
    c.data.max_prompt_length = 96
    c.data.prompt_length_bucket = 16
    c.data.max_response_length = 48  # the longest reference program is 37 characters
    c.data.train_batch_size = 4
    c.data.val_batch_size = 8
    c.rollout.n = 4
    c.actor.ppo_mini_batch_size = 4
    c.actor.ppo_micro_batch_size_per_gpu = 16
    c.rollout.log_prob_micro_batch_size_per_gpu = 16
    c.actor.optim.lr = 1e-4
    c.actor.optim.weight_decay = 0.0
    c.warmup.steps = 60
    c.warmup.batch_size = 8  # every problem
    c.warmup.lr = 3e-3
    c.reward.num_workers = 2
    c.trainer.total_training_steps = 2
    c.trainer.test_freq = 2
    c.trainer.save_freq = -1
    c.trainer.default_local_dir = "runs/code_tiny"
