"""One GRPO step, as its stages (verl-semantics.md section 1, verl 0.9.1's v1 trainer):

    rollout  = generate(engine, params, prompts, rng, ...)   # 1. sample n completions per prompt
    result   = score(reward_fn, tokenizer, rollout, prompts)  # 2. decode and reward
    batch    = train_batch(rollout, ...)                      #    the update's model inputs
    batch    = log_probs(programs, state, ref_params, batch)  # 3. old / reference log-probs
    batch    = advantages(programs, batch, scores, ...)       # 4. token rewards -> advantages
    state, m = update(programs, state, batch, lr)             # 5. ppo_epochs x mini-batches

Each stage is a top-level function that a test can call alone. The device work of stages 3-5 is
in `Programs`, the jitted functions of a run, built once by `make_programs` (plan.py compiles the
same ones). `run_step` chains the stages and returns the step's verl-named metrics; the loop
(grpo_jax/loop.py) adds validation, checkpoints and logging around it.

Rollout engines share one interface (`NativeEngine` for grpo_jax.sampler, `SidecarEngine` for
the vLLM server): start(params), sync(params) after each update, sample(...) -> sampler.Rollout,
close().
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import advantage as advantage_lib
from grpo_jax import config as config_lib
from grpo_jax import data, distributed, rewards, sampler, trainer
from grpo_jax import loss as loss_lib
from grpo_jax import model as model_lib
from grpo_jax import reward_pool as reward_pool_lib

# ---------------------------------------------------------------------------------------------
# Rollout engines


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one generate call samples with (rollout.* or rollout.val_kwargs.*)."""

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self):
        sampler.check_sampling_settings(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )

    def kwargs(self) -> dict:
        greedy = self.temperature == 0
        return dict(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=-1 if greedy else self.top_k,
        )


class NativeEngine:
    """grpo_jax.sampler on the trainer's own devices and params (nothing to start or sync)."""

    def __init__(self, model_config: model_lib.ModelConfig, mesh, *, eos_ids, pad_id):
        self.model_config, self.mesh = model_config, mesh
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id

    def start(self, params) -> None:
        del params

    def sync(self, params) -> float | None:
        del params
        return None

    def sample(self, params, prompt_ids_PT, prompt_mask_PT, rng, sp: SamplingParams):
        ids = distributed.to_device(prompt_ids_PT, self.mesh)
        mask = distributed.to_device(prompt_mask_PT, self.mesh)
        return sampler.sample(
            self.model_config,
            params,
            ids,
            mask,
            rng,
            eos_token_ids=self.eos_ids,
            pad_token_id=self.pad_id,
            **sp.kwargs(),
        )

    def close(self) -> None:
        pass


class SidecarEngine:
    """A vLLM server (grpo_jax.vllm_sidecar) fed the trainer's weights after every update."""

    def __init__(self, sidecar, *, eos_ids, pad_id):
        self.sidecar = sidecar
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id

    def start(self, params) -> None:
        self.sidecar.start(params)

    def sync(self, params) -> float:
        return self.sidecar.push_weights(params)

    def sample(self, params, prompt_ids_PT, prompt_mask_PT, rng, sp: SamplingParams):
        del params  # the server holds the weights pushed by the last sync
        from grpo_jax import vllm_sidecar

        rollout = self.sidecar.sample(
            prompt_ids_PT,
            prompt_mask_PT,
            rng,
            eos_token_ids=self.eos_ids,
            pad_token_id=self.pad_id,
            **sp.kwargs(),
        )
        vllm_sidecar.check_fresh(rollout, self.sidecar.weights_version)
        return rollout

    def close(self) -> None:
        self.sidecar.close()


# ---------------------------------------------------------------------------------------------
# Programs: the jitted device functions of a run


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run and the static sizes they were built for.

    Attributes:
      update: (state, batch, mini_batch_index, lr) -> (state, metrics); state donated.
      log_probs: (params, batch) -> (log_probs_BT, entropy_BT or None); `with_entropy` says
        whether it returns the entropy (only the old-log-prob pass logs it).
      advantage: (token_level_rewards_BT, response_mask_BT, group_ids_B) -> advantages_BT.
      mini_rows / micro_rows / logprob_rows: sequences per mini-batch, micro-batch, log-prob
        micro-batch (global, over all data devices).
    """

    model_config: model_lib.ModelConfig
    loss_config: trainer.LossConfig
    update: Callable
    log_probs: Callable
    log_probs_entropy: Callable
    advantage: Callable
    mini_rows: int
    micro_rows: int
    logprob_rows: int


def make_programs(
    run: config_lib.RunConfig, model_config: model_lib.ModelConfig, tx, *, dp: int
) -> Programs:
    """Builds (does not compile) the jitted functions of `run` on `dp` = data x fsdp devices."""
    a, n = run.actor, run.rollout.n
    loss_config = a.loss_config(temperature=run.rollout.temperature)
    mini_rows = a.ppo_mini_batch_size * n
    micro_rows = min(a.ppo_micro_batch_size_per_gpu * dp, mini_rows)
    logprob_rows = min(
        run.rollout.log_prob_micro_batch_size_per_gpu * dp, run.data.train_batch_size * n
    )
    update = jax.jit(
        functools.partial(
            trainer.train_step,
            model_config=model_config,
            loss_config=loss_config,
            tx=tx,
            mini_batch_size=mini_rows,
            micro_batch_size=micro_rows,
        ),
        donate_argnums=0,
    )

    def log_probs_fn(calculate_entropy):
        return jax.jit(
            functools.partial(
                trainer.compute_log_probs,
                model_config,
                micro_batch_size=logprob_rows,
                temperature=run.rollout.temperature,
                chunk_size=loss_config.chunk_size,
                calculate_entropy=calculate_entropy,
            )
        )

    alg = run.algorithm
    if alg.adv_estimator == "grpo":
        estimator = functools.partial(
            advantage_lib.compute_grpo_outcome_advantage,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
    else:
        estimator = advantage_lib.compute_rloo_outcome_advantage
    num_groups = run.data.train_batch_size

    @jax.jit
    def advantage(token_rewards_BT, response_mask_BT, group_ids_B):
        return estimator(token_rewards_BT, response_mask_BT, group_ids_B, num_groups=num_groups)[0]

    return Programs(
        model_config,
        loss_config,
        update,
        log_probs_fn(False),
        log_probs_fn(True),
        advantage,
        mini_rows,
        micro_rows,
        logprob_rows,
    )


# ---------------------------------------------------------------------------------------------
# Stages


def generate(engine, params, prompts: data.PromptBatch, rng, sp: SamplingParams):
    """Stage 1: n completions per prompt (a sampler.Rollout, B = P * n rows)."""
    return engine.sample(params, prompts.prompt_ids_PT, prompts.prompt_mask_PT, rng, sp)


def decode(tokenizer, response_ids_BT: np.ndarray, response_mask_BT: np.ndarray) -> list[str]:
    """Valid response tokens -> text (special tokens such as EOS skipped, as verl)."""
    lengths = response_mask_BT.sum(1)
    return tokenizer.batch_decode(
        [row[:n] for row, n in zip(response_ids_BT, lengths, strict=True)],
        skip_special_tokens=True,
    )


@dataclasses.dataclass(frozen=True)
class Scored:
    """Stage 2's output: the completions as text and their rewards (host side)."""

    texts: list[str]
    result: rewards.RewardResult
    response_mask_BT: np.ndarray  # host copy, for lengths and metrics


def score(
    reward_fn: rewards.RewardFn,
    tokenizer,
    rollout: sampler.Rollout,
    prompts: data.PromptBatch,
    *,
    n: int,
    pool: reward_pool_lib.Pool | None = None,
) -> Scored:
    """Stage 2: decode every completion and score it against its prompt's example."""
    ids, mask = (
        distributed.to_host(rollout.response_ids),
        distributed.to_host(rollout.response_mask),
    )
    texts = decode(tokenizer, ids, mask)
    examples = [ex for ex in prompts.examples for _ in range(n)]
    return Scored(texts, rewards.score_batch(reward_fn, texts, examples, pool=pool), mask)


def train_batch(rollout: sampler.Rollout, *, prompt_width: int, bucket: int) -> trainer.TrainBatch:
    """The update's model input: prompt + response, advantages still zero.

    The sampler's prompt columns are bucketed to its own multiple; the update keeps only the last
    bucket_length(prompt_width, bucket) of them (the dropped ones are all padding), so short
    prompts do not pay for the sampler's bucket.
    """
    width = min(rollout.prompt_ids.shape[1], sampler.bucket_length(prompt_width, bucket))
    mask = rollout.response_mask
    return trainer.TrainBatch(
        input_ids_BS=jnp.concatenate([rollout.prompt_ids[:, -width:], rollout.response_ids], 1),
        attention_mask_BS=jnp.concatenate([rollout.prompt_mask[:, -width:], mask], 1),
        response_ids_BT=rollout.response_ids,
        response_mask_BT=mask,
        advantages_BT=jnp.zeros(mask.shape, jnp.float32),
    )


def log_probs(
    programs: Programs,
    run: config_lib.RunConfig,
    state: trainer.TrainState,
    ref_params,
    batch: trainer.TrainBatch,
    timing: dict,
) -> tuple[trainer.TrainBatch, dict]:
    """Stage 3: the old log-probs (when the run needs them) and the reference log-probs.

    Returns the batch with them and the metrics of the old pass (verl logs `actor/entropy` there,
    before the update, over the whole batch).
    """
    metrics = {}
    old_BT = ref_BT = None
    if run.needs_old_log_probs:
        old_BT, ent_BT = _timed(
            timing, "old_log_prob", programs.log_probs_entropy, state.params, batch
        )
        metrics["actor/entropy"] = float(
            loss_lib.agg_loss(
                ent_BT,
                batch.response_mask_BT,
                run.actor.loss_agg_mode,
                loss_scale_factor=run.actor.loss_scale_factor,
            )
        )
    if ref_params is not None:
        ref_BT, _ = _timed(timing, "ref", programs.log_probs, ref_params, batch)
    return batch.replace(old_log_probs_BT=old_BT, ref_log_probs_BT=ref_BT), metrics


def token_level_scores(scores_B: jax.Array, response_mask_BT: jax.Array) -> jax.Array:
    """verl's token_level_scores: each sequence score at its last valid response token."""
    length_B = jnp.sum(response_mask_BT, axis=1)
    last_BT = jax.nn.one_hot(
        jnp.maximum(length_B - 1, 0), response_mask_BT.shape[1], dtype=jnp.float32
    )
    return scores_B.astype(jnp.float32)[:, None] * last_BT


def kl_in_reward(
    scores_BT, old_BT, ref_BT, response_mask_BT, *, beta: float, kl_penalty: str
) -> tuple[jax.Array, dict]:
    """verl's apply_kl_penalty: token rewards = scores - beta * KL(old || ref) on the response."""
    kld_BT = loss_lib.kl_penalty(old_BT, ref_BT, kl_penalty) * response_mask_BT
    length_B = jnp.sum(response_mask_BT, axis=1)
    current_kl = jnp.mean(jnp.sum(kld_BT, 1) / jnp.maximum(length_B, 1))
    metrics = {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": beta}
    return scores_BT - beta * kld_BT, metrics


def advantages(
    programs: Programs,
    run: config_lib.RunConfig,
    batch: trainer.TrainBatch,
    rollout: sampler.Rollout,
    scores_B: Sequence[float],
    mesh,
    timing: dict,
) -> tuple[trainer.TrainBatch, dict]:
    """Stage 4: token-level rewards (plus the in-reward KL) -> group advantages."""
    mask_BT = batch.response_mask_BT
    scores = distributed.to_device(np.asarray(scores_B, np.float32), mesh)
    rewards_BT = token_level_scores(scores, mask_BT)
    metrics = {}
    if run.algorithm.use_kl_in_reward:
        rewards_BT, metrics = kl_in_reward(
            rewards_BT,
            batch.old_log_probs_BT,
            batch.ref_log_probs_BT,
            mask_BT,
            beta=run.algorithm.kl_ctrl.kl_coef,
            kl_penalty=run.algorithm.kl_penalty,
        )
    adv_BT = _timed(timing, "adv", programs.advantage, rewards_BT, mask_BT, rollout.group_ids)
    valid = distributed.to_host(mask_BT).astype(bool)
    metrics |= _stats("critic/advantages", distributed.to_host(adv_BT)[valid])
    metrics |= _stats("critic/returns", distributed.to_host(adv_BT)[valid])
    metrics |= _stats("critic/rewards", distributed.to_host(jnp.sum(rewards_BT, 1)))
    old = None if run.on_policy else batch.old_log_probs_BT
    return batch.replace(advantages_BT=adv_BT, old_log_probs_BT=old), metrics


def update(
    programs: Programs, run: config_lib.RunConfig, state: trainer.TrainState, batch, lr
) -> tuple[trainer.TrainState, dict]:
    """Stage 5: actor.ppo_epochs x mini-batches of the jitted update; metrics averaged."""
    updates = []
    for _ in range(run.actor.ppo_epochs):
        for i in range(run.mini_batches_per_step):
            state, m = programs.update(state, batch, jnp.int32(i), jnp.float32(lr))
            updates.append(m)
    updates = jax.device_get(updates)
    record = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    record["actor/update_skipped"] = sum(float(u["actor/update_skipped"]) for u in updates)
    return state, record


# ---------------------------------------------------------------------------------------------
# The whole step


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every step reads and nothing changes (built once by the loop)."""

    run: config_lib.RunConfig
    programs: Programs
    engine: Any
    tokenizer: Any
    reward_fn: rewards.RewardFn
    mesh: Any
    pool: reward_pool_lib.Pool | None = None


def run_step(
    ctx: StepContext, state: trainer.TrainState, ref_params, prompts: data.PromptBatch, rng, lr
) -> tuple[trainer.TrainState, dict]:
    """Stages 1-5 on one prompt batch; returns the new state and the step's metrics."""
    run, timing = ctx.run, {}
    sp = SamplingParams(
        run.rollout.n,
        run.data.max_response_length,
        run.rollout.temperature,
        run.rollout.top_p,
        run.rollout.top_k,
    )
    rollout = _timed(timing, "gen", generate, ctx.engine, state.params, prompts, rng, sp)
    t0 = time.perf_counter()
    scored = score(ctx.reward_fn, ctx.tokenizer, rollout, prompts, n=sp.n, pool=ctx.pool)
    timing["timing_s/reward"] = time.perf_counter() - t0
    batch = train_batch(
        rollout, prompt_width=prompts.prompt_ids_PT.shape[1], bucket=run.data.prompt_length_bucket
    )
    batch, old_metrics = log_probs(ctx.programs, run, state, ref_params, batch, timing)
    batch, adv_metrics = advantages(
        ctx.programs, run, batch, rollout, scored.result.scores_B, ctx.mesh, timing
    )
    t0 = time.perf_counter()
    state, record = update(ctx.programs, run, state, batch, lr)
    timing["timing_s/update_actor"] = time.perf_counter() - t0
    if "actor/entropy" in old_metrics:  # verl: the pre-update value of the old-log-prob pass
        record["actor/entropy"] = old_metrics["actor/entropy"]
    record |= adv_metrics | reward_metrics(scored.result)
    record |= length_metrics(
        scored.response_mask_BT,
        prompts.prompt_mask_PT,
        n=sp.n,
        max_response_length=sp.max_new_tokens,
        max_prompt_length=run.data.max_prompt_length,
    )
    return state, record | timing


def reward_metrics(result: rewards.RewardResult) -> dict[str, float]:
    """critic/score/*, the per-function means, extra keys, errors and timeouts."""
    out = _stats("critic/score", result.scores_B)
    if len(result.per_fn) > 1:
        out |= {f"reward/{name}/mean": float(np.mean(v)) for name, v in result.per_fn.items()}
    for key, values in result.extras.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number))]
        if numeric:
            out[f"reward_extra/{key}/mean"] = float(np.mean(numeric))
    out["reward/num_errors"] = result.num_errors
    out["reward/num_lost"] = result.num_lost  # timed out or worker died
    return out


def length_metrics(
    response_mask_BT, prompt_mask_PT, *, n, max_response_length, max_prompt_length
) -> dict[str, float]:
    """verl's response_length/* and prompt_length/* metrics, plus the token count."""
    lengths = np.asarray(response_mask_BT).sum(1)
    prompt_lengths = np.repeat(np.asarray(prompt_mask_PT).sum(1), n)
    out = _stats("response_length", lengths) | _stats("prompt_length", prompt_lengths)
    out["response_length/clip_ratio"] = float(np.mean(lengths == max_response_length))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_lengths == max_prompt_length))
    out["perf/total_num_tokens"] = int(lengths.sum() + prompt_lengths.sum())
    return out


def _stats(prefix: str, x) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def _timed(timing: dict, key: str, fn, *args, **kw):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kw))
    timing[f"timing_s/{key}"] = time.perf_counter() - t0
    return out
