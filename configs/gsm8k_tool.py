r"""GRPO on GSM8K with a tool: verl's multi-turn GSM8K recipe
(examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh with config/gsm8k_multiturn_grpo.yaml
and config/tool_config/gsm8k_tool_config.yaml).

The model may call `calc_gsm8k_reward` (configs/tools/gsm8k_tool.yaml, grpo_jax/tools/gsm8k.py)
to check its answer before writing it after "####"; the trajectory (its turns as sampled, the
tool's responses as context under loss mask 0) is scored by verl's GSM8K scorer.

Data: verl's preprocessed rows (examples/data_preprocess/gsm8k_multiturn_w_tool.py: a system
prompt asking for the tool, extra_info.tools_kwargs with the ground truth). Make them from raw
GSM8K with
  python scripts/prepare_gsm8k_tool.py ../shared/data/gsm8k/train.jsonl data/gsm8k_tool/train.jsonl
  python scripts/prepare_gsm8k_tool.py ../shared/data/gsm8k/test.jsonl data/gsm8k_tool/test.jsonl
Run:
  python train.py --config=configs/gsm8k_tool.py:model=qwen2.5-3b
  python train.py --config=configs/gsm8k_tool.py:smoke   # tiny random model, 2 steps, CPU

Recipe: rollout.n 16, 256 prompts a step in one mini-batch (on-policy), lr 1e-6, KL loss 0.001
(low_var_kl), prompts and responses up to 1024 tokens, at most 5 model turns, the hermes
format, gradient checkpointing. verl's arguments reach the tool unchecked
(rollout.multi_turn.validate_tool_arguments=False here; grpo_jax's default checks them).
Not yet reproduced with grpo_jax at the recipe's scale.
"""

from configs import common
from configs.gsm8k import MODELS

TOOL_CONFIG = "configs/tools/gsm8k_tool.yaml"


def get_config(arg=None):
    arg = common.parse_arg(arg, model="qwen2.5-3b", smoke=False)
    c = common.grpo_config()
    c.data.source = "files"
    c.data.path = "data/gsm8k_tool/train.jsonl"
    c.data.val_path = "data/gsm8k_tool/test.jsonl"
    c.data.max_prompt_length = 1024
    c.data.max_response_length = 1024
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 256
    c.actor.ppo_mini_batch_size = 256
    c.actor.ppo_micro_batch_size_per_gpu = 32
    c.rollout.log_prob_micro_batch_size_per_gpu = 32
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.optim.lr = 1e-6
    c.model.enable_gradient_checkpointing = True
    c.rollout.n = 16
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.max_assistant_turns = 5
    c.rollout.multi_turn.format = "hermes"
    c.rollout.multi_turn.tool_config_path = TOOL_CONFIG
    c.rollout.multi_turn.validate_tool_arguments = False
    c.algorithm.adv_estimator = "grpo"
    c.trainer.total_epochs = 15
    c.trainer.test_freq = 20
    c.trainer.save_freq = -1
    c.trainer.default_local_dir = "runs/gsm8k_tool"
    if arg.model not in MODELS:
        raise ValueError(
            f"configs/gsm8k_tool.py:model must be one of {sorted(MODELS)}, got {arg.model!r}"
        )
    c.model.path = MODELS[arg.model]
    if arg.smoke:
        common.make_smoke(c)
        c.data.max_prompt_length = 64
        c.data.max_response_length = 32
        c.rollout.multi_turn.max_assistant_turns = 2
        c.rollout.n = 4
        c.actor.ppo_micro_batch_size_per_gpu = 4
        c.rollout.log_prob_micro_batch_size_per_gpu = 8
        c.trainer.default_local_dir = "runs/smoke_tool"
    return c
