"""Section `algorithm` (verl's algorithm.*): the advantage estimator, the in-reward KL and its
controller, DAPO's group filter and rollout correction."""

from __future__ import annotations

import dataclasses

from grpo_jax import advantage, loss, registry
from grpo_jax import rollout_correction as rc
from grpo_jax.config.checks import Checks


@dataclasses.dataclass(frozen=True)
class KLCtrlConfig:
    """Section `algorithm.kl_ctrl`: the coefficient of the in-reward KL penalty.

    "fixed" keeps kl_coef; "adaptive" is verl's AdaptiveKLController (Ziegler et al. 2019):
    after each step beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * B / horizon, B the
    step's sequences. Its value is checkpointed, so a resumed run continues it exactly.
    """

    type: str = "fixed"  # "fixed" | "adaptive"
    kl_coef: float = 0.001  # beta of the in-reward KL (the adaptive controller's start)
    horizon: int = 10000  # adaptive: sequences over which beta can move by ~20 %
    target_kl: float = 0.1  # adaptive: the KL it steers towards

    def __post_init__(self):
        c = Checks("algorithm.kl_ctrl")
        c.choice("type", self.type, ("fixed", "adaptive"))
        c.need(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        c.need(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")
        c.need(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig:
    """Section `algorithm.filter_groups`: DAPO's dynamic sampling (arXiv 2503.14476), as verl
    0.9.1's Sync DAPO replay buffer (verl/trainer/ppo/v1/replay_buffer.py: ReplayBuffer.sample).

    A group is filtered when its `metric` has the same value on all its samples, verl's
    `len(values) > 1 and np.std(values) == 0.0` (so a one-sample group never is). Each
    filtered group earns two more prompts; they are sampled, at most max_inflight_gen_batches
    x data.train_batch_size at a time, until data.train_batch_size groups are kept; the surplus
    of the last round is dropped. rollout_stage.dynamic_sample says how that follows verl.
    """

    enable: bool = False
    # "reward": the sequence reward, overlong penalty included (verl's rm_scores summed, in
    # float32); any other name: that key of verl's reward_extra_info, i.e. a key of the
    # scorer's dict ("score", "acc", ...), "acc" for a scorer returning a plain number (its
    # score before the overlong penalty), "overlong_reward" / "overlong" with
    # reward.overlong_buffer.log (rewards/functions.py: reward_extra_info).
    metric: str = "reward"
    max_num_gen_batches: int = 0  # ignored, with a warning, as verl 0.9.1 does
    # Prompts sampled at once for the refills, in units of data.train_batch_size (verl's bound
    # on the Sync DAPO prompts pending or running)
    max_inflight_gen_batches: int = 1

    def __post_init__(self):
        c = Checks("algorithm.filter_groups")
        c.need(not self.enable or bool(self.metric), "metric", self.metric,
               "must be set when group filtering is enabled")
        c.need(not self.enable or self.max_inflight_gen_batches >= 1,
               "max_inflight_gen_batches", self.max_inflight_gen_batches,
               "must be a positive integer")
        c.done()


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Section `algorithm.rollout_correction` (verl 0.9.1; grpo_jax/rollout_correction.py).

    Compares the rollout engine's log-probs with the trainer's recomputed old log-probs:
    importance weights (`rollout_is` token or sequence, truncated at `rollout_is_threshold`)
    multiply the policy loss, rejection (`rollout_rs` with `rollout_rs_threshold`) masks tokens
    or sequences. `bypass_mode` (verl 0.9.1's v1 trainer) skips the old-log-prob pass and
    the correction, takes the engine's log-probs as the old ones and keeps
    actor.policy_loss.loss_mode; loss_mode="bypass_mode" selects verl's bypass loss instead,
    which computes weights / rejection against the current policy inside the loss and reads
    `loss_type`. The `rollout_corr/*` and `training/rollout_probs_diff_*` metrics are logged
    whenever the old log-probs are recomputed (verl: by default, rollout.calculate_log_probs).
    """

    rollout_is: str | None = None  # None | "token" | "sequence"
    rollout_is_threshold: float | None = 2.0  # TIS upper bound (the library takes "lo_hi" too)
    rollout_is_batch_normalize: bool = False  # weights to batch mean 1
    rollout_rs: str | None = None  # rejection options, comma-separated (rollout_correction.py)
    # required with rollout_rs: one value or one per option; k1 options take "lower_upper"
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False  # old log-probs = the engine's (no recomputation)
    loss_type: str = "ppo_clip"  # the bypass_mode loss's: "ppo_clip" | "reinforce"

    def __post_init__(self):

        c = Checks("algorithm.rollout_correction")
        if self.rollout_is is not None:
            c.choice("rollout_is", self.rollout_is, rc.ROLLOUT_IS_LEVELS)
        c.choice("loss_type", self.loss_type, rc.LOSS_TYPES)
        if self.rollout_is_threshold is not None:
            c.call(rc.parse_rollout_is_threshold, self.rollout_is_threshold)
        if self.rollout_rs is not None:
            options = c.call(rc.parse_rollout_rs, self.rollout_rs)
            c.need(self.rollout_rs_threshold is not None, "rollout_rs_threshold",
                   self.rollout_rs_threshold, "is required with rollout_rs")
            if options and self.rollout_rs_threshold is not None:
                c.call(rc.parse_rollout_rs_thresholds, options, self.rollout_rs_threshold)
        c.done()

    @property
    def active(self) -> bool:
        """Whether anything changes the loss (weights, rejection or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Section `algorithm`: the advantage estimator, the KL-in-reward penalty, DAPO's dynamic
    sampling and rollout correction."""

    # advantage.ADV_ESTIMATORS, a name given to advantage.register_adv_est, or "module:function"
    # (imported and registered under that name).
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide by the group std (False = Dr.GRPO)
    gamma: float = 1.0  # reinforce_plus_plus's discount
    # gdpo: the reward components, keys of the scorer's dict outputs (comma-separated); "" =
    # one component per function of reward.fn (with reward.weights), or the score alone.
    gdpo_reward_keys: str = ""
    gdpo_reward_weights: str = ""  # gdpo: comma-separated weights of those keys; "" = ones
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(old || ref) from the reward
    kl_penalty: str = "kl"  # estimator of the in-reward KL (actor.kl_loss_type names)
    kl_ctrl: KLCtrlConfig = KLCtrlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()

    def __post_init__(self):

        c = Checks("algorithm")
        c.call(advantage.check_adv_estimator, "adv_estimator", self.adv_estimator)
        c.call(
            loss.check_choice,
            "kl_penalty",
            self.kl_penalty,
            [k for k in loss.KL_TYPES if "full" not in k],
        )
        try:
            weights = self.gdpo_weight_values
        except ValueError:
            c.need(False, "gdpo_reward_weights", self.gdpo_reward_weights,
                   "must be comma-separated floats")
        else:
            keys = registry.split_list(self.gdpo_reward_keys)
            c.need(not weights or len(weights) == len(keys), "gdpo_reward_weights",
                   self.gdpo_reward_weights,
                   f"has {len(weights)} weights for {len(keys)} gdpo_reward_keys")
        c.done()

    @property
    def gdpo_weight_values(self) -> tuple[float, ...]:
        return tuple(float(w) for w in registry.split_list(self.gdpo_reward_weights))

    @property
    def uses_groups(self) -> bool:
        """Whether the estimator's baseline comes from the other samples of a group."""
        return self.adv_estimator not in ("reinforce_plus_plus", "remax")
