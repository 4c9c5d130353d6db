r"""GRPO on GSM8K + MATH with verl's recipe (examples/grpo_trainer/run_qwen2-7b_math.sh).

Run:
  python train.py --config=configs/math.py --config.model.path=/models/Qwen2-7B-Instruct \
      --config.mesh.shape="(1,-1,1)" --config.model.dtype=bfloat16
  python train.py --config=configs/math.py:smoke     # tiny random model, 2 steps, CPU

Expects on disk (verl's layout, as verl's preprocessing writes it):
  ~/data/gsm8k/{train,test}.parquet   examples/data_preprocess/gsm8k.py (data_source
                                      "openai/gsm8k", reward_model.ground_truth = the number)
  ~/data/math/{train,test}.parquet    examples/data_preprocess/math_dataset.py (data_source
                                      "DigitalLearningGmbH/MATH-lighteval", the problem + " Let's
                                      think step by step and output the final answer within
                                      \boxed{}.", ground truth = the \boxed{} of the solution)
Override data.path / data.val_path (comma-separated) for other places; raw GSM8K jsonl works
too. Scoring is verl's default_compute_score by data_source: GSM8K's strict "####" scorer, and
for MATH the \boxed{} answer normalised (Hendrycks' strip_string) and compared as verl does;
validation logs val-core/openai/gsm8k/acc/mean@1 and
val-core/DigitalLearningGmbH/MATH-lighteval/acc/mean@1 (a float score is verl's "acc").

Recipe: rollout.n 5, use_kl_loss 0.001 low_var_kl, token-mean, lr 1e-6, prompts and responses
1024 tokens, 1024 prompts per step, mini-batch 256, gradient checkpointing, 15 epochs, validate
every 5 steps, save every 20. Expected: no published number for this recipe (verl's
docs/algo/baseline.md lists none for MATH at this size); not yet run with grpo_jax.
"""

import os

from configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, smoke=False)
    c = common.grpo_config()
    home = os.path.expanduser("~/data")
    c.data.source = "files"
    c.data.path = f"{home}/gsm8k/train.parquet,{home}/math/train.parquet"
    c.data.val_path = f"{home}/gsm8k/test.parquet,{home}/math/test.parquet"
    c.data.train_batch_size = 1024
    c.data.max_prompt_length = 1024
    c.data.max_response_length = 1024
    c.data.filter_overlong_prompts = True
    c.data.truncation = "error"
    c.actor.optim.lr = 1e-6
    c.actor.ppo_mini_batch_size = 256
    c.actor.ppo_micro_batch_size_per_gpu = 16
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.entropy_coeff = 0.0
    c.model.enable_gradient_checkpointing = True
    c.rollout.log_prob_micro_batch_size_per_gpu = 16
    c.rollout.n = 5
    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False
    c.trainer.save_freq = 20
    c.trainer.test_freq = 5
    c.trainer.total_epochs = 15
    c.trainer.default_local_dir = "runs/math"
    if arg.smoke:
        common.make_smoke(c)
    return c
