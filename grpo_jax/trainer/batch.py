"""The step's batch between its stages: `RolloutBatch` (stages 1-2 out) and `HostRollout`.

A step's data passes through four containers: the engine's `sampler.Rollout` (device tokens,
masks, log-probs), a `RolloutBatch` (that rollout with its host tokens, texts, rewards and the
estimator's extras: what an asynchronous run samples one step ahead), the update's
`actor.TrainBatch` (model inputs, advantages, old / reference log-probs) and the metrics row.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax import sampler, sharding
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.trainer import packing


@dataclasses.dataclass(frozen=True)
class HostRollout:
    """The rollout's tokens on the host, unbucketed: what packing reads (B = P * n rows).

    response_mask_BT marks the valid tokens; `loss_mask_BT` (multi-turn rollouts, else None)
    the ones the policy sampled (sampler.Rollout.loss_mask)."""

    prompt_ids_BP: np.ndarray
    prompt_mask_BP: np.ndarray
    response_ids_BT: np.ndarray
    response_mask_BT: np.ndarray
    loss_mask_BT: np.ndarray | None = None

    def seq_lengths_B(self) -> np.ndarray:
        """Each row's valid tokens, prompt and response (verl's seq_len)."""
        return self.prompt_mask_BP.sum(1) + self.response_mask_BT.sum(1)

    def rows(self, start: int, stop: int) -> HostRollout:
        return self.take(slice(start, stop))

    def take(self, rows) -> HostRollout:
        return HostRollout(*(None if x is None else x[rows] for x in dataclasses.astuple(self)))

    def pack(
        self, max_tokens: int, *, row_multiple: int, row_len: int, routing_BLSA=None
    ) -> packing.Packed:
        """packing.pack of these rows (`routing_BLSA`: their recorded experts, router replay)."""
        return packing.pack(
            self.prompt_ids_BP,
            self.prompt_mask_BP,
            self.response_ids_BT,
            self.response_mask_BT,
            max_tokens=max_tokens,
            row_multiple=row_multiple,
            row_len=row_len,
            routing_BLSA=routing_BLSA,
        )


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Stages 1-2 of a step, ready for the update: the completions, their rewards and what the
    estimator needs besides (what `rollout_stage` returns, and what an asynchronous run samples
    one step ahead).

    B rows in groups of `group_size` adjacent samples of one prompt. Several generation batches
    (DAPO's dynamic sampling) concatenate into one, with the groups renumbered 0...

    Attributes:
      rollout: the engine's output (device arrays): tokens, masks, log-probs, group ids.
      host: the same tokens on the host.
      texts: the completions (None for the rows of other processes).
      examples: the example of each row.
      result: the rewards.
      group_size: samples per prompt (rollout.n).
      extras: the estimator's per-batch inputs (rollout_stage.estimator_extras: remax's greedy
        baselines, gdpo's reward components), or {}.
      timing: the seconds of sampling and scoring (timing_s/gen, reward, ...).
      policy_version: TrainState.step of the params that sampled it (the behaviour policy).
      sampled_at: the loop step (0-based) whose params sampled it; the step that updates with it
        is sampled_at + its staleness.
      filter_metrics: DAPO's dynamic sampling metrics (verl's training/filter_groups/*), or {}.
      row_stats: a multi-turn rollout's per-row counts (multi_turn.AgentRollout.row_stats:
        turns, tool calls, errors, ...), or {}.
    """

    rollout: sampler.Rollout
    host: HostRollout
    texts: list[str | None]
    examples: list[prompts_lib.Example]
    result: reward_fns.RewardResult
    group_size: int
    extras: dict = dataclasses.field(default_factory=dict)
    timing: dict = dataclasses.field(default_factory=dict)
    policy_version: int = 0
    sampled_at: int = 0
    filter_metrics: dict = dataclasses.field(default_factory=dict)
    row_stats: dict = dataclasses.field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.texts) // self.group_size


def on_mesh(batch: RolloutBatch, mesh) -> RolloutBatch:
    """`batch` with its device arrays on `mesh` (a batch sampled on devices of its own): arrays
    with a row per sample split over the batch axes, the others replicated."""
    rows = len(batch.texts)

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        if x.ndim and x.shape[0] == rows:
            return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
        return jax.device_put(x, sharding.replicated(mesh))

    return dataclasses.replace(
        batch, rollout=jax.tree.map(put, batch.rollout), extras=jax.tree.map(put, batch.extras)
    )
