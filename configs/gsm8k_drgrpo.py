r"""Dr. GRPO on GSM8K (Liu et al. 2025, "Understanding R1-Zero-Like Training").

Run:
  python train.py --config=configs/gsm8k_drgrpo.py:model=qwen2.5-0.5b

Same recipe as configs/gsm8k.py except the two biases Dr. GRPO removes: the advantage is not
divided by the group std (algorithm.norm_adv_by_std_in_grpo=False) and the loss is
"seq-mean-token-sum-norm" with a constant loss_scale_factor (= max_response_length) instead
of dividing by each completion's own length; no KL term (use_kl_loss=False).
"""

from configs import gsm8k


def get_config(arg=None):
    c = gsm8k.get_config(arg)
    c.algorithm.norm_adv_by_std_in_grpo = False
    c.actor.loss_agg_mode = "seq-mean-token-sum-norm"
    c.actor.loss_scale_factor = float(c.data.max_response_length)
    c.actor.use_kl_loss = False
    c.trainer.default_local_dir = "runs/gsm8k_drgrpo"
    return c
