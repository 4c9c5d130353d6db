r"""The embedded demo: GRPO teaches a tiny random transformer to add, on a laptop CPU.

Run (README's first command; downloads nothing):
  python train.py --config=configs/demo.py
  python scripts/check_demo.py          # runs it and asserts the learning criterion

Expected (default seed, measured with scripts/check_demo.py on 2 shared CPU cores under a load
average of ~10): greedy accuracy 0.29 after the 70-step supervised warm-up (the first eval,
before any GRPO step), then 0.54 / 0.62 / 0.66 / 0.85 / 0.85 / 0.85 at GRPO steps
50 / 100 / 150 / 200 / 250 / 300; 360 s wall time including compilation: +0.56 (2.9x) from
GRPO with a 0/1 reward only. (Longer supervised training would also learn this 25-question
table; the demo shows the RL loop learning it from rewards.)

Task: "a+b" with a, b in [0, 4] (25 questions, so the validation questions repeat training
ones: this measures learning the table, not generalisation), answer in GSM8K's raw format
("#### c"), so the run goes through the same data pipeline, chat template, verl GSM8K
scorer (strict "####" extraction), sampler, advantage, loss, checkpoints and eval as
configs/gsm8k.py. Tokenizer: one token per character (grpo_jax/demo_task.py).
Deviations from the gsm8k recipe (for speed on a tiny model): lr 1e-3 instead of 1e-6 (a
random 2-layer model needs large steps), no KL term (there is no meaningful reference policy
to stay close to), rollout.n 8.
"""

from configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, steps=300, seed=0)
    c = common.grpo_config()
    common.use_builtin_task(c)
    c.data.arithmetic.num_train = 4000
    c.data.arithmetic.num_val = 100
    c.data.arithmetic.max_operand = 4  # 25 questions, answers 0..8: one digit
    c.data.train_batch_size = 16
    c.data.val_batch_size = 100
    c.data.max_prompt_length = 16
    c.data.prompt_length_bucket = 8
    c.data.max_response_length = 8  # "#### 7" + EOS, room for 1 more
    c.model.tiny.hidden_size = 64
    c.model.tiny.intermediate_size = 256
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 4
    c.model.tiny.num_kv_heads = 2
    c.model.tiny.head_dim = 16
    c.model.tiny.seed = arg.seed
    c.rollout.n = 8
    c.actor.ppo_mini_batch_size = 16
    c.actor.ppo_micro_batch_size_per_gpu = 128
    c.rollout.log_prob_micro_batch_size_per_gpu = 128
    c.actor.use_kl_loss = False
    c.actor.optim.lr = 1e-3
    c.actor.optim.weight_decay = 0.0
    c.warmup.steps = 70
    c.warmup.batch_size = 64
    c.warmup.lr = 3e-3
    c.trainer.total_training_steps = arg.steps
    c.trainer.test_freq = 50
    c.trainer.save_freq = 50
    c.trainer.seed = arg.seed
    c.trainer.default_local_dir = "runs/demo"
    c.checkpoint.max_to_keep = 1
    return c
