"""Sections `actor` (verl's actor_rollout_ref.actor.*: the optimizer, the policy loss, router
replay) and `ref` (actor_rollout_ref.ref.*: the reference policy's log-prob pass)."""

from __future__ import annotations

import dataclasses
import math

from grpo_jax import loss
from grpo_jax.config.checks import Checks, positive
from grpo_jax.trainer import actor as actor_lib


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Section `actor.optim`: AdamW and its learning-rate schedule."""

    lr: float = 1e-6  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (b1, b2)
    weight_decay: float = 0.01  # decoupled weight decay
    lr_warmup_steps: int = -1  # linear warm-up steps; <= 0 = use lr_warmup_steps_ratio (verl)
    lr_warmup_steps_ratio: float = 0.0  # warm-up as a fraction of the total training steps
    lr_scheduler_type: str = "constant"  # "constant" | "cosine" (after the warm-up)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr

    def __post_init__(self):
        c = Checks("actor.optim")
        c.need(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be finite and > 0")
        c.need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            self.betas,
            "must be two values in [0, 1)",
        )
        c.need(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        c.choice("lr_scheduler_type", self.lr_scheduler_type, actor_lib.LR_SCHEDULES)
        for name in ("lr_warmup_steps_ratio", "min_lr_ratio"):
            c.need(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        c.done()

    def warmup_steps(self, total_steps: int) -> int:
        """verl: lr_warmup_steps when > 0, else lr_warmup_steps_ratio * total_steps."""
        if self.lr_warmup_steps > 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * total_steps)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Section `actor.policy_loss` (verl's PolicyLossConfig): the loss and its own settings."""

    # loss.POLICY_LOSS_MODES, a name given to loss.register_policy_loss, or "module:function"
    # (imported when the loss is first computed).
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance window
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: float | None = None  # dro: the quadratic penalty's beta (required for dro)

    def __post_init__(self):

        c = Checks("actor.policy_loss")
        c.call(loss.check_policy_loss_mode, "loss_mode", self.loss_mode)
        c.need(self.loss_mode != "dro" or (self.dro_beta or 0) > 0, "dro_beta", self.dro_beta,
               "must be > 0 for loss_mode='dro'")
        c.done()


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclasses.dataclass(frozen=True)
class RouterReplayConfig:
    """Section `actor.router_replay` (verl 0.9.1's engine RouterReplayConfig, there under
    actor.megatron / actor.veomni): which recorded experts a mixture-of-experts model's passes
    route to, instead of the routers' own top-k (docs/models.md, "Router replay").

    mode:
      "disabled": every pass routes by its own router.
      "R2": the old-log-prob pass records its routing and the update replays it (the reference
        pass routes by its own router, as verl's). Without an old-log-prob pass (on-policy,
        one mini-batch) the update's policy is the recording one, so it routes natively.
      "R3": the rollout records each token's experts (rollout.enable_rollout_routing_replay)
        and the old-log-prob pass and the update replay them (the reference pass does not).
    verl's record_file / replay_file are not mirrored: its engines read neither.
    """

    mode: str = "disabled"  # ROUTER_REPLAY_MODES

    def __post_init__(self):
        c = Checks("actor.router_replay")
        c.choice("mode", self.mode, ROUTER_REPLAY_MODES)
        c.done()


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """Section `actor`: the update (mini/micro-batches, PPO clip, KL loss, entropy, optimizer).

    Paper symbols: clip_ratio_low/high = epsilon_low/high (DAPO clip-higher when they differ),
    kl_loss_coef = beta (GRPO eq. 3 uses k3 = "low_var_kl"), clip_ratio_c = dual-clip c.
    """

    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per device per accumulation step
    use_dynamic_bsz: bool = False  # pack sequences into token-budget micro-batches instead
    # that budget, tokens per device (grpo_jax/trainer/packing.py)
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1  # passes over the batch (mu)
    # Ulysses sequence parallelism (verl's name; 1 = off): each row's tokens are split over
    # this many devices (the mesh's "sequence" axis) for the update and the log-prob passes,
    # attention splitting the heads instead (grpo_jax/sharding.py). As in verl, the token
    # budget ppo_max_token_len_per_gpu is per device, so a row may hold sp times as many.
    ulysses_sequence_parallel_size: int = 1
    # Each ppo epoch, the batch's rows are shuffled before being cut into mini-batches, within
    # each data-parallel block as verl's per-rank dataloader (train_stage.mini_batch_order); the
    # draws are seeded by data_loader_seed and the block, the same every step (verl).
    shuffle: bool = False
    data_loader_seed: int = 42
    clip_ratio: float = 0.2  # epsilon; verl's ActorConfig sets low/high explicitly (below)
    # epsilon_low / epsilon_high (DAPO clip-higher: high 0.28). verl's default is 0.2 each, not
    # clip_ratio; None (verl's YAML null) means clip_ratio, as every verl policy loss reads it.
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0  # dual-clip c (> 1), negative advantages only
    tau_pos: float = 1.0  # sapo: the gate's temperature for positive advantages
    tau_neg: float = 1.05  # sapo: ... for negative advantages
    loss_agg_mode: str = "token-mean"  # loss.AGG_MODES
    loss_scale_factor: float | None = None  # Dr.GRPO constant of seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # entropy bonus weight
    calculate_entropy: bool = False  # also compute the update pass's entropy (actor/entropy_loss)
    use_kl_loss: bool = False  # add beta * KL(policy || ref) to the loss (GRPO paper)
    kl_loss_coef: float = 0.001  # beta
    kl_loss_type: str = "low_var_kl"  # kl | abs | mse | low_var_kl, "+" variants
    grad_clip: float = 1.0  # global grad-norm clip; a non-finite norm skips the update
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    optim: OptimConfig = OptimConfig()
    router_replay: RouterReplayConfig = RouterReplayConfig()  # MoE models

    def __post_init__(self):
        c = Checks("actor")
        positive(c, self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs")
        positive(c, self, "ppo_max_token_len_per_gpu", "ulysses_sequence_parallel_size")
        c.need(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")
        c.need(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        c.need(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "loss_scale_factor",
            self.loss_scale_factor,
            "must be > 0 or None",
        )
        c.need(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "must be > 0")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            c.need(value is None or value > 0, name, value, "must be > 0 or None (clip_ratio)")

        kwargs = self._loss_kwargs()
        try:
            loss.check_policy_loss_mode("loss_mode", kwargs["policy_loss_mode"])
        except ValueError:
            kwargs["policy_loss_mode"] = "vanilla"  # section actor.policy_loss reported it
        c.call(actor_lib.check_loss_settings, **kwargs)
        c.done()

    def _loss_kwargs(self) -> dict:
        return dict(
            policy_loss_mode=self.policy_loss.loss_mode,
            loss_agg_mode=self.loss_agg_mode,
            clip_ratio_c=self.clip_ratio_c,
            kl_loss_type=self.kl_loss_type,
        )

    def _loss_config(self, *, temperature: float):
        """The actor section's part of the update's LossConfig (RunConfig.loss_config completes
        it)."""

        pl = self.policy_loss
        extra = {"clip_cov_ratio": pl.clip_cov_ratio, "clip_cov_lb": pl.clip_cov_lb,
                 "clip_cov_ub": pl.clip_cov_ub, "kl_cov_ratio": pl.kl_cov_ratio,
                 "ppo_kl_coef": pl.ppo_kl_coef, "tau_pos": self.tau_pos, "tau_neg": self.tau_neg,
                 "dro_beta": pl.dro_beta}
        return actor_lib.LossConfig(
            **self._loss_kwargs(),
            policy_loss_kwargs=tuple(sorted(extra.items())),
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            entropy_coeff=self.entropy_coeff,
            calculate_entropy=self.calculate_entropy,
            use_kl_loss=self.use_kl_loss,
            kl_loss_coef=self.kl_loss_coef,
            loss_scale_factor=self.loss_scale_factor,
            temperature=temperature,
        )


@dataclasses.dataclass(frozen=True)
class RefConfig:
    """Section `ref` (verl's actor_rollout_ref.ref): the reference policy's log-prob pass."""

    # None = the actor's (verl's ${oc.select:actor_rollout_ref.actor.ulysses_...}). grpo_jax
    # runs every pass on one mesh, so a value must equal the actor's (docs/verl-differences.md).
    ulysses_sequence_parallel_size: int | None = None

    def __post_init__(self):
        c = Checks("ref")
        sp = self.ulysses_sequence_parallel_size
        c.need(sp is None or sp >= 1, "ulysses_sequence_parallel_size", sp,
               "must be >= 1 or None (the actor's)")  # fmt: skip
        c.done()
