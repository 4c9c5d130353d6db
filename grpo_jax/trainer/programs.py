"""The jitted programs of a run, and the context every step reads.

`make_programs(run, model_config, tx, dp=...)` builds (does not compile) every device function a
step calls: the padded and packed updates, the log-prob passes, the optimizer step, the
advantage estimator and the rollout correction. grpo_jax/planner/ compiles the same functions
for its memory plan. `StepContext` bundles them with the engine, tokenizer, reward and mesh:
what the stages (rollout_stage.py, train_stage.py) read and nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from grpo_jax import advantage as advantage_lib
from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax import rollout_correction as rollout_correction_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool_lib
from grpo_jax.rollout import engines
from grpo_jax.trainer import actor, packing


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run and the static sizes they were built for.

    Attributes:
      update: (state, batch, mini_batch_index, lr, rng=key) -> (state, metrics), padded
        micro-batches of `micro_rows` sequences (actor.use_dynamic_bsz off); state donated;
        key = actor.update_key(trainer.seed, state.step).
      log_probs / log_probs_entropy: (params, batch) -> (log_probs_BT, entropy_BT or None),
        padded micro-batches of `logprob_rows` sequences; the second also returns the entropy
        (the old-log-prob pass logs it), and with actor.router_replay.mode="R2" a third, the
        experts it routed every token to (actor.compute_log_probs(record_routing=True)).
      packed_grads: (params, grads, micro, mini_batch, rng=key) -> (grads, metrics) for one
        packed micro-batch (actor.use_dynamic_bsz); grads donated; key = fold_in(update key, m)
        for micro-batch m.
      apply: (state, grads, loss, lr) -> (state, metrics): the optimizer step after the packed
        micro-batches; state donated.
      packed_log_probs / packed_log_probs_entropy: (params, micro, lp_BT, ent_BT) -> (lp_BT,
        ent_BT) adding one packed micro-batch (rollout.log_prob_use_dynamic_bsz); the [B, T]
        accumulators donated.
      advantage: (token_level_rewards_BT, response_mask_BT, group_ids_B, extras) ->
        advantages_BT (make_advantage).
      rollout_correction: (old_log_probs_BT, rollout_log_probs_BT, response_mask_BT) ->
        (weights_BT or None, response_mask_BT, metrics) of algorithm.rollout_correction.
      mini_rows / micro_rows / logprob_rows: sequences per mini-batch, padded micro-batch,
        padded log-prob micro-batch (global, over all data devices).
      update_tokens / logprob_tokens: the token budgets of a packed micro-batch (global: per
        device x dp x actor.ulysses_sequence_parallel_size).
      row_len: the packed row length (packing.row_length of the run's prompt + response).
      dp: the data devices (data x fsdp); packed rows per micro-batch are a multiple of it.
      precompiled: the packed programs already compiled for every micro-batch shape of the run
        (train_stage.compile_packed_shapes; filled by the first step).
    """

    model_config: model_lib.ModelConfig
    loss_config: actor.LossConfig
    update: Callable
    log_probs: Callable
    log_probs_entropy: Callable
    packed_grads: Callable
    apply: Callable
    packed_log_probs: Callable
    packed_log_probs_entropy: Callable
    advantage: Callable
    rollout_correction: Callable
    mini_rows: int
    micro_rows: int
    logprob_rows: int
    update_tokens: int
    logprob_tokens: int
    row_len: int
    dp: int
    precompiled: set = dataclasses.field(default_factory=set, compare=False, repr=False)


def make_programs(
    run: config_lib.RunConfig, model_config: model_lib.ModelConfig, tx, *, dp: int
) -> Programs:
    """Builds (does not compile) the jitted functions of `run` on `dp` = data x fsdp devices."""
    a, n, r = run.actor, run.rollout.n, run.rollout
    # verl's token budgets are per device: a sequence-parallel group of sp devices packs sp
    # times the tokens of one, and its rows may be sp times as long.
    sp = a.ulysses_sequence_parallel_size
    loss_config = run.loss_config()
    mini_rows = a.ppo_mini_batch_size * n
    micro_rows = min(a.ppo_micro_batch_size_per_gpu * dp, mini_rows)
    logprob_rows = min(r.log_prob_micro_batch_size_per_gpu * dp, run.data.train_batch_size * n)

    def update_for(mc, **jit_kw):
        return jax.jit(
            functools.partial(
                actor.train_step, model_config=mc, loss_config=loss_config, tx=tx,
                mini_batch_size=mini_rows, micro_batch_size=micro_rows,
            ),
            **jit_kw,
        )  # fmt: skip

    def packed_grads_for(mc, **jit_kw):
        return jax.jit(
            functools.partial(actor.packed_micro_grads, model_config=mc, loss_config=loss_config),
            **jit_kw,
        )

    update = update_for(model_config, donate_argnums=0)
    common = dict(temperature=r.temperature, chunk_size=loss_config.chunk_size)

    def log_probs_fn(calculate_entropy, record_routing=False):
        return jax.jit(
            functools.partial(
                actor.compute_log_probs,
                model_config,
                micro_batch_size=logprob_rows,
                calculate_entropy=calculate_entropy,
                record_routing=record_routing,
                **common,
            )
        )

    def packed_log_probs_fn(calculate_entropy):
        return jax.jit(
            functools.partial(
                actor.packed_log_probs_into,
                model_config,
                calculate_entropy=calculate_entropy,
                **common,
            ),
            donate_argnums=(2, 3),
        )

    packed_grads = packed_grads_for(model_config, donate_argnums=1)
    apply = jax.jit(functools.partial(actor.apply_gradients, tx=tx), donate_argnums=0)

    advantage = make_advantage(run)
    return Programs(
        model_config=model_config,
        loss_config=loss_config,
        update=update,
        log_probs=log_probs_fn(False),
        # router replay R2 records the routing in the old-log-prob pass
        log_probs_entropy=log_probs_fn(True, a.router_replay.mode == "R2"),
        packed_grads=packed_grads,
        apply=apply,
        packed_log_probs=packed_log_probs_fn(False),
        packed_log_probs_entropy=packed_log_probs_fn(True),
        advantage=advantage,
        rollout_correction=jax.jit(
            functools.partial(
                rollout_correction_lib.compute_rollout_correction,
                **{k: v for k, v in rollout_correction_settings(run).items() if k != "bypass_mode"},
            )
        ),
        mini_rows=mini_rows,
        micro_rows=micro_rows,
        logprob_rows=logprob_rows,
        update_tokens=a.ppo_max_token_len_per_gpu * dp * sp,
        logprob_tokens=run.log_prob_max_token_len_per_gpu * dp * sp,
        row_len=packing.row_length(
            run.data.max_prompt_length,
            run.data.max_response_length,
            a.ppo_max_token_len_per_gpu * sp,
        ),
        dp=dp,
    )


def estimator_kwargs(run: config_lib.RunConfig) -> dict:
    """The settings verl 0.9.1's trainer hands `run`'s estimator (advantage.compute_advantage):
    norm_adv_by_std_in_grpo only to grpo and grpo_passk, gamma only to reinforce_plus_plus."""
    alg = run.algorithm
    if alg.adv_estimator in ("grpo", "grpo_passk"):
        return {"norm_adv_by_std_in_grpo": alg.norm_adv_by_std_in_grpo}
    if alg.adv_estimator == "reinforce_plus_plus":
        return {"gamma": alg.gamma}
    return {}


def make_advantage(run: config_lib.RunConfig) -> Callable:
    """jit((token_level_rewards_BT, response_mask_BT, group_ids_B, extras) -> (advantages_BT,
    returns_BT)) of algorithm.adv_estimator; `extras` holds the per-batch inputs some estimators need
    (reward_baselines for remax, reward_components / reward_weights for gdpo), else {}."""
    name, kwargs = run.algorithm.adv_estimator, estimator_kwargs(run)
    num_groups = run.data.train_batch_size

    @jax.jit
    def advantage(token_rewards_BT, response_mask_BT, group_ids_B, extras):
        return advantage_lib.compute_advantage(
            name,
            token_rewards_BT,
            response_mask_BT,
            group_ids_B,
            num_groups=num_groups,
            **kwargs,
            **extras,
        )

    return advantage


def rollout_correction_settings(run: config_lib.RunConfig) -> dict:
    """algorithm.rollout_correction as rollout_correction.compute_rollout_correction's kwargs."""
    rc = run.algorithm.rollout_correction
    return {f.name: getattr(rc, f.name) for f in dataclasses.fields(rc)}


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every step reads and nothing changes (built once by the loop)."""

    run: config_lib.RunConfig
    programs: Programs
    engine: engines.Engine
    tokenizer: Any
    reward_fn: reward_fns.RewardFn
    mesh: Any
    pool: reward_pool_lib.Pool | None = None
    base_params: Any = None  # LoRA: the frozen base (TrainState.params are the adapters)
    agent: Any = None  # rollout.multi_turn: a rollout.multi_turn.Agent
    # reward_model.enable: a rewards.reward_model.RewardModel, or with reward_model.genrm.enable
    # a rewards.genrm.Judge
    reward_model: Any = None

    def policy(self, state: actor.TrainState):
        """The params the policy samples and scores with (with LoRA: base + adapters)."""
        return actor.policy_params(self.base_params, state.params)
