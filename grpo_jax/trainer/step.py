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
(grpo_jax/trainer/loop.py) adds validation, checkpoints and logging around it.

Rollout engines share one interface (`NativeEngine` for grpo_jax.sampler, `SidecarEngine` for
the vLLM server): start(params, version), sync(params, version) after each update,
sample(..., policy_version) -> sampler.Rollout, close(); a version is TrainState.step. With
LoRA the params they get are `lora.attach(base, adapters)` (`StepContext.policy`), and the
stages take the frozen base as `base_params` (TrainState.params are the adapters).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import advantage as advantage_lib
from grpo_jax import config as config_lib
from grpo_jax import distributed, registry, sampler, sharding
from grpo_jax import loss as loss_lib
from grpo_jax import model as model_lib
from grpo_jax import rollout_correction as rollout_correction_lib
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.models import lora
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool_lib
from grpo_jax.trainer import actor, packing, perf

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
    """grpo_jax.sampler on the trainer's own devices and params (nothing to start or sync).

    LoRA params (`lora.attach(base, adapters)`) are merged (`lora.merge`, W + scale * A @ B)
    before each call, so the sampler runs the base model's program: on SmolLM2-135M with r=32
    on all linear layers (8 prompts x 4 x 128 tokens, float32, CPU) that was ~6 % more tokens/s
    than base + adapter unmerged (75 vs 71 median, merge time of 0.4 s per call included;
    benchmarks/bench_lora.py, README "LoRA"). The merged kernels exist only during the call.

    With `own_params` (asynchronous rollouts) the engine samples with a copy of the weights of
    its own, placed on its `mesh` (the trainer's devices, or devices of its own) by `start` /
    `sync`, so the trainer can update (and donate) its params while this engine samples; like
    the vLLM sidecar it then checks that it holds the policy version a caller asks for.
    """

    def __init__(self, model_config: model_lib.ModelConfig, mesh, *, eos_ids, pad_id,
                 own_params: bool = False, rules=sharding.LOGICAL_RULES):
        self.model_config, self.mesh = model_config, mesh
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id
        self.own_params, self.rules = own_params, rules
        self.params, self.version = None, None

    def start(self, params, version: int = 0) -> None:
        if self.own_params:
            self._hold(params, version)

    def sync(self, params, version: int) -> float | None:
        """With own_params: copies `params` as policy `version` (seconds; None when held)."""
        if not self.own_params or version == self.version:
            return None
        t0 = time.perf_counter()
        self._hold(params, version)
        return time.perf_counter() - t0

    def _hold(self, params, version: int) -> None:
        if lora.split(params)[1] is not None:
            params = lora.merge(self.model_config, params)  # a new array per merged kernel
        shardings = sharding.param_shardings(self.model_config, self.mesh, self.rules)
        # A copy, on the engine's devices: the trainer donates its own buffers to the update.
        self.params = jax.block_until_ready(jax.device_put(params, shardings, may_alias=False))
        self.version = version

    def sample(self, params, prompt_ids_PT, prompt_mask_PT, rng, sp: SamplingParams,
               policy_version: int | None = None):
        if self.own_params:
            if policy_version is not None and policy_version != self.version:
                from grpo_jax.rollout import vllm_sidecar

                raise vllm_sidecar.StaleRolloutError(
                    f"the rollout engine holds policy version {self.version}, but version "
                    f"{policy_version} was asked for: sync the engine (engine.sync(params, "
                    "version)) before sampling"
                )
            params = self.params
            rng = jax.device_put(rng, sharding.replicated(self.mesh))  # the loop's key
        elif lora.split(params)[1] is not None:
            params = lora.merge(self.model_config, params)
        ids, mask = (x if isinstance(x, jax.Array) else distributed.to_device(x, self.mesh)
                     for x in (prompt_ids_PT, prompt_mask_PT))
        with sharding.use_mesh(self.mesh, self.rules):  # also from another thread (async)
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
        self.params = None


class SidecarEngine:
    """A vLLM server (grpo_jax.vllm_sidecar) fed the trainer's weights after every update.

    Policy versions are the trainer's (TrainState.step, optimizer steps taken): start and sync
    record which server weights version holds which policy version, and `sample` refuses a
    rollout whose weights are not the policy version the caller is about to update
    (vllm_sidecar.StaleRolloutError), e.g. after an update without a sync, or a server restarted
    from an older export.
    """

    mesh = None  # takes host prompts: the whole batch, in one process

    def __init__(self, sidecar, *, eos_ids, pad_id):
        self.sidecar = sidecar
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id
        self.policy_of: dict[int, int] = {}  # server weights version -> trainer policy version

    def start(self, params, version: int = 0) -> None:
        self.sidecar.start(params)
        self.policy_of[self.sidecar.weights_version] = version

    def sync(self, params, version: int) -> float | None:
        """Pushes `params` as policy `version`; None (nothing done) when the server has it."""
        if self.policy_of.get(self.sidecar.weights_version) == version:
            return None
        seconds = self.sidecar.push_weights(params)
        self.policy_of[self.sidecar.weights_version] = version
        return seconds

    def sample(self, params, prompt_ids_PT, prompt_mask_PT, rng, sp: SamplingParams,
               policy_version: int | None = None):
        del params  # the server holds the weights pushed by the last sync
        from grpo_jax.rollout import vllm_sidecar

        rollout = self.sidecar.sample(
            prompt_ids_PT,
            prompt_mask_PT,
            rng,
            eos_token_ids=self.eos_ids,
            pad_token_id=self.pad_id,
            **sp.kwargs(),
        )
        served = int(jax.device_get(rollout.weights_version))
        if policy_version is None:
            vllm_sidecar.check_fresh(rollout, self.sidecar.weights_version)
        elif self.policy_of.get(served) != policy_version:
            raise vllm_sidecar.StaleRolloutError(
                f"the vLLM server sampled with weights version {served} (trainer policy version "
                f"{self.policy_of.get(served)}), but the policy being updated is at version "
                f"{policy_version}: sync the engine after every update (engine.sync(params, "
                "version)) and sample again"
            )
        return rollout

    def close(self) -> None:
        self.sidecar.close()


# ---------------------------------------------------------------------------------------------
# Programs: the jitted device functions of a run


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run and the static sizes they were built for.

    Attributes:
      update: (state, batch, mini_batch_index, lr) -> (state, metrics), padded micro-batches of
        `micro_rows` sequences (actor.use_dynamic_bsz off); state donated.
      log_probs / log_probs_entropy: (params, batch) -> (log_probs_BT, entropy_BT or None),
        padded micro-batches of `logprob_rows` sequences; the second also returns the entropy
        (the old-log-prob pass logs it).
      packed_grads: (params, grads, micro, mini_batch) -> (grads, metrics) for one packed
        micro-batch (actor.use_dynamic_bsz); grads donated.
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
      update_tokens / logprob_tokens: the token budgets of a packed micro-batch (global).
      row_len: the packed row length (packing.row_length of the run's prompt + response).
      dp: the data devices (data x fsdp); packed rows per micro-batch are a multiple of it.
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


def make_programs(
    run: config_lib.RunConfig, model_config: model_lib.ModelConfig, tx, *, dp: int
) -> Programs:
    """Builds (does not compile) the jitted functions of `run` on `dp` = data x fsdp devices."""
    a, n, r = run.actor, run.rollout.n, run.rollout
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

    def log_probs_fn(calculate_entropy):
        return jax.jit(
            functools.partial(
                actor.compute_log_probs,
                model_config,
                micro_batch_size=logprob_rows,
                calculate_entropy=calculate_entropy,
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
        log_probs_entropy=log_probs_fn(True),
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
        update_tokens=a.ppo_max_token_len_per_gpu * dp,
        logprob_tokens=r.log_prob_max_token_len_per_gpu * dp,
        row_len=packing.row_length(
            run.data.max_prompt_length, run.data.max_response_length, a.ppo_max_token_len_per_gpu
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
            name, token_rewards_BT, response_mask_BT, group_ids_B, num_groups=num_groups,
            **kwargs, **extras,
        )

    return advantage


@dataclasses.dataclass(frozen=True)
class HostRollout:
    """The rollout's tokens on the host, unbucketed: what packing reads (B = P * n rows)."""

    prompt_ids_BP: np.ndarray
    prompt_mask_BP: np.ndarray
    response_ids_BT: np.ndarray
    response_mask_BT: np.ndarray

    def rows(self, start: int, stop: int) -> HostRollout:
        return HostRollout(*(x[start:stop] for x in dataclasses.astuple(self)))

    def pack(self, max_tokens: int, programs: Programs) -> packing.Packed:
        return packing.pack(
            self.prompt_ids_BP,
            self.prompt_mask_BP,
            self.response_ids_BT,
            self.response_mask_BT,
            max_tokens=max_tokens,
            row_multiple=programs.dp,
            row_len=programs.row_len,
        )


def _micro(packed: packing.Packed, m: int, mesh) -> actor.PackedMicro:
    return actor.PackedMicro(
        **{k: distributed.to_device(v, mesh) for k, v in packed.micro(m).items()}
    )


# ---------------------------------------------------------------------------------------------
# Stages


def generate(engine, params, prompts: prompts_lib.PromptBatch, rng, sp: SamplingParams, *,
             policy_version: int | None = None):
    """Stage 1: n completions per prompt (a sampler.Rollout, B = P * n rows).

    `policy_version` (TrainState.step of `params`) lets an engine that holds its own copy of the
    weights refuse a rollout sampled under other ones. A batch of which this process holds
    only its rows (`prompts.rows`, several processes) becomes one global batch first.
    """
    ids, mask = prompts.prompt_ids_PT, prompts.prompt_mask_PT
    if prompts.rows is not None:
        if engine.mesh is None:
            raise ValueError(
                f"rollout engine {type(engine).__name__} samples a whole batch in one process; "
                f"with {jax.process_count()} JAX processes use rollout.name=jax (the native "
                "sampler on the global mesh)"
            )
        shd = sharding.batch_sharding(engine.mesh, 2)
        ids, mask = distributed.to_global(ids, shd), distributed.to_global(mask, shd)
    return engine.sample(params, ids, mask, rng, sp, policy_version)


def full_prompts(prompts: prompts_lib.PromptBatch) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of all P prompts on this host (gathered from every process with `rows`)."""
    if prompts.rows is None:
        return prompts.prompt_ids_PT, prompts.prompt_mask_PT
    return (distributed.gather_rows(prompts.prompt_ids_PT),
            distributed.gather_rows(prompts.prompt_mask_PT))


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
    result: reward_fns.RewardResult
    response_ids_BT: np.ndarray  # host copies, for packing, lengths and metrics
    response_mask_BT: np.ndarray


def score(
    reward_fn: reward_fns.RewardFn,
    tokenizer,
    rollout: sampler.Rollout,
    prompts: prompts_lib.PromptBatch,
    *,
    n: int,
    pool: reward_pool_lib.Pool | None = None,
) -> Scored:
    """Stage 2: decode every completion and score it against its prompt's example.

    With several processes (`prompts.rows`), each decodes and scores the completions of its own
    prompts, and only the reward results are exchanged: `texts` holds this process's
    completions and None for the others'.
    """
    ids, mask = (
        distributed.to_host(rollout.response_ids),
        distributed.to_host(rollout.response_mask),
    )
    start, stop = (0, len(prompts.examples)) if prompts.rows is None else prompts.rows
    texts = decode(tokenizer, ids[start * n : stop * n], mask[start * n : stop * n])
    examples = [ex for ex in prompts.examples[start:stop] for _ in range(n)]
    result = reward_fns.score_batch(reward_fn, texts, examples, pool=pool)
    if prompts.rows is not None:
        result = reward_fns.RewardResult.concat(distributed.gather_objects([result]))
        texts = [None] * (start * n) + texts + [None] * (len(ids) - stop * n)
    return Scored(texts, result, ids, mask)


def train_batch(rollout: sampler.Rollout, *, prompt_width: int, bucket: int) -> actor.TrainBatch:
    """The update's model input: prompt + response, advantages still zero.

    The update's prompt columns are the last bucket_length(prompt_width, bucket) of the
    rollout's (the dropped ones are all padding, and a narrower rollout is left-padded), so
    short prompts do not pay for the sampler's bucket and the compiled shapes stay few.
    """
    width = sampler.bucket_length(prompt_width, bucket)
    short = max(0, width - rollout.prompt_ids.shape[1])  # e.g. batches joined by concat()

    def prompt_columns(x):
        return jnp.pad(x, ((0, 0), (short, 0)))[:, -width:]

    mask = rollout.response_mask
    return actor.TrainBatch(
        input_ids_BS=jnp.concatenate([prompt_columns(rollout.prompt_ids), rollout.response_ids], 1),
        attention_mask_BS=jnp.concatenate([prompt_columns(rollout.prompt_mask), mask], 1),
        response_ids_BT=rollout.response_ids,
        response_mask_BT=mask,
        advantages_BT=jnp.zeros(mask.shape, jnp.float32),
    )


def log_probs(
    programs: Programs,
    run: config_lib.RunConfig,
    state: actor.TrainState,
    ref_params,
    batch: actor.TrainBatch,
    host: HostRollout,
    mesh,
    timing: dict,
    *,
    rollout_log_probs_BT=None,
    base_params=None,
) -> tuple[actor.TrainBatch, dict]:
    """Stage 3: the old log-probs (when the run needs them) and the reference log-probs.

    With LoRA, `base_params` is the frozen base and state.params the adapters: the old pass
    runs base + adapters, and `ref_params` is the base itself (adapters disabled, verl's LoRA
    reference), not a copy.

    With rollout.log_prob_use_dynamic_bsz both passes run over packed token-budget
    micro-batches (packing.py), otherwise over padded micro-batches. With
    algorithm.rollout_correction.bypass_mode the old log-probs are the engine's
    (`rollout_log_probs_BT`) and there is no old pass. Returns the batch with them and the
    metrics of the old pass (verl logs `actor/entropy` there, before the update, over the whole
    batch).
    """
    needed = run.needs_old_log_probs or ref_params is not None
    if run.algorithm.rollout_correction.bypass_mode:
        if rollout_log_probs_BT is None:
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode=True takes the rollout engine's "
                "log-probs as the old ones, but this rollout has none"
            )
        batch = batch.replace(old_log_probs_BT=rollout_log_probs_BT)
    packed = None
    if run.rollout.log_prob_use_dynamic_bsz and needed:
        packed = host.pack(programs.logprob_tokens, programs)

    def run_pass(params, with_entropy):
        if packed is None:
            fn = programs.log_probs_entropy if with_entropy else programs.log_probs
            return fn(params, batch)
        fn = programs.packed_log_probs_entropy if with_entropy else programs.packed_log_probs
        lp_BT = jnp.zeros(batch.response_mask_BT.shape, jnp.float32)
        ent_BT = jnp.zeros_like(lp_BT)
        for m in range(packed.num_micro):
            lp_BT, ent_BT = fn(params, _micro(packed, m, mesh), lp_BT, ent_BT)
        return lp_BT, ent_BT if with_entropy else None

    metrics = {}
    old_BT, ref_BT = batch.old_log_probs_BT, None
    if run.needs_old_log_probs:
        policy = actor.policy_params(base_params, state.params)
        old_BT, ent_BT = _timed(timing, "old_log_prob", run_pass, policy, True)
        metrics["actor/entropy"] = float(
            loss_lib.agg_loss(
                ent_BT,
                batch.response_mask_BT,
                run.actor.loss_agg_mode,
                loss_scale_factor=run.actor.loss_scale_factor,
            )
        )
    if ref_params is not None:
        ref_BT, _ = _timed(timing, "ref", run_pass, ref_params, False)
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


def next_kl_coef(kl_ctrl: config_lib.KLCtrlConfig, kl_coef: float, current_kl: float,
                 n_steps: int) -> float:
    """algorithm.kl_ctrl after a step: "fixed" keeps the coefficient; "adaptive" is verl's
    AdaptiveKLController, beta * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n / horizon)
    with n the step's sequences."""
    if kl_ctrl.type == "fixed":
        return kl_coef
    error = float(np.clip(current_kl / kl_ctrl.target_kl - 1.0, -0.2, 0.2))
    return kl_coef * (1.0 + error * n_steps / kl_ctrl.horizon)


def rollout_correction_settings(run: config_lib.RunConfig) -> dict:
    """algorithm.rollout_correction as rollout_correction.compute_rollout_correction's kwargs."""
    rc = run.algorithm.rollout_correction
    return {f.name: getattr(rc, f.name) for f in dataclasses.fields(rc)}


def advantages(
    programs: Programs,
    run: config_lib.RunConfig,
    batch: actor.TrainBatch,
    rollout: sampler.Rollout,
    scores_B: Sequence[float],
    mesh,
    timing: dict,
    *,
    kl_coef: float | None = None,
    extras: dict | None = None,
) -> tuple[actor.TrainBatch, dict]:
    """Stage 4 (verl's _compute_advantage): token-level rewards (minus the in-reward KL at
    `kl_coef`, default algorithm.kl_ctrl.kl_coef), then rollout correction against the engine's
    log-probs (weights and rejection mask, whenever the old log-probs were recomputed), then the
    estimator's advantages. `extras`: the estimator's per-batch inputs (make_advantage)."""
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
            beta=run.algorithm.kl_ctrl.kl_coef if kl_coef is None else kl_coef,
            kl_penalty=run.algorithm.kl_penalty,
        )
    bypass = run.algorithm.rollout_correction.bypass_mode
    if not bypass and batch.old_log_probs_BT is not None and rollout.log_probs is not None:
        weights_BT, mask_BT, corr = _timed(
            timing, "rollout_correction", programs.rollout_correction,
            batch.old_log_probs_BT, rollout.log_probs, mask_BT,
        )
        metrics |= {k: float(v) for k, v in jax.device_get(corr).items()}
        batch = batch.replace(response_mask_BT=mask_BT, rollout_is_weights_BT=weights_BT)
    adv_BT, returns_BT = _timed(
        timing, "adv", programs.advantage, rewards_BT, mask_BT, rollout.group_ids, extras or {}
    )
    valid = distributed.to_host(mask_BT).astype(bool)
    metrics |= _stats("critic/advantages", distributed.to_host(adv_BT)[valid])
    metrics |= _stats("critic/returns", distributed.to_host(returns_BT)[valid])
    metrics |= _stats("critic/rewards", distributed.to_host(jnp.sum(rewards_BT, 1)))
    old = None if run.on_policy and not bypass else batch.old_log_probs_BT
    return batch.replace(advantages_BT=adv_BT, old_log_probs_BT=old), metrics


def update(
    programs: Programs,
    run: config_lib.RunConfig,
    state: actor.TrainState,
    batch: actor.TrainBatch,
    lr,
    host: HostRollout,
    mesh,
    *,
    base_params=None,
) -> tuple[actor.TrainState, dict]:
    """Stage 5: actor.ppo_epochs x mini-batches of optimizer steps; metrics averaged.

    With actor.use_dynamic_bsz each mini-batch is packed into token-budget micro-batches whose
    gradients are summed (one compiled shape per packed shape, however many micro-batches),
    otherwise it runs as padded micro-batches inside one jitted step. With LoRA, `base_params`
    is the frozen base (state.params, the gradients and the optimizer state: the adapters only).
    """
    base = () if base_params is None else (base_params,)
    updates = []
    mini = programs.mini_rows
    packs = {}
    lr = jnp.float32(lr)
    for _ in range(run.actor.ppo_epochs):
        for i in range(run.mini_batches_per_step):
            if not run.actor.use_dynamic_bsz:
                index = jnp.int32(i)
                state, m = programs.update(state, batch, index, lr, *base)
                updates.append(m)
                continue
            if i not in packs:  # mini-batches are the same slices in every epoch
                rows = host.rows(i * mini, (i + 1) * mini)
                packs[i] = rows.pack(programs.update_tokens, programs)
            packed = packs[i]
            mini_batch = jax.tree.map(lambda x, i=i: x[i * mini : (i + 1) * mini], batch)
            grads = jax.tree.map(jnp.zeros_like, state.params)
            summed = {}
            for m in range(packed.num_micro):
                micro = _micro(packed, m, mesh)
                grads, metrics = programs.packed_grads(
                    state.params, grads, micro, mini_batch, *base
                )
                summed = metrics if not summed else jax.tree.map(jnp.add, summed, metrics)
            state, opt_metrics = programs.apply(state, grads, summed["actor/loss"], lr)
            updates.append({**summed, **opt_metrics, "actor/micro_batches": packed.num_micro})
    updates = jax.device_get(updates)
    record = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
    record["actor/update_skipped"] = sum(float(u["actor/update_skipped"]) for u in updates)
    # verl's model FLOPs of every sequence, once per epoch (perf.estimate_flops)
    seqlens = host.prompt_mask_BP.sum(1) + host.response_mask_BT.sum(1)
    record["perf/actor_flops"] = run.actor.ppo_epochs * perf.estimate_flops(
        programs.model_config, seqlens
    )
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
    reward_fn: reward_fns.RewardFn
    mesh: Any
    pool: reward_pool_lib.Pool | None = None
    base_params: Any = None  # LoRA: the frozen base (TrainState.params are the adapters)

    def policy(self, state: actor.TrainState):
        """The params the policy samples and scores with (with LoRA: base + adapters)."""
        return actor.policy_params(self.base_params, state.params)


@dataclasses.dataclass(frozen=True)
class Sampled:
    """Stages 1-2 of a step: the rollout (device), its tokens, texts and rewards (host).

    B rows in groups of `group_size` adjacent samples of one prompt. Several generation batches
    (DAPO's dynamic sampling) concatenate into one, with the groups renumbered 0...
    """

    rollout: sampler.Rollout
    host: HostRollout
    texts: list[str]
    examples: list[prompts_lib.Example]  # per row
    result: reward_fns.RewardResult
    group_size: int
    num_gen_batches: int = 1
    num_filtered_groups: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.texts) // self.group_size


def rollout_sampling(run: config_lib.RunConfig) -> SamplingParams:
    """The training rollout's sampling settings (rollout.*)."""
    r = run.rollout
    return SamplingParams(r.n, run.data.max_response_length, r.temperature, r.top_p, r.top_k)


def overlong_penalty(lengths_B, *, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """DAPO's soft overlong penalty (verl's DAPO reward manager): 0 up to max - buffer_len
    tokens, then -penalty_factor x excess / buffer_len (reaching -penalty_factor at max)."""
    excess_B = np.asarray(lengths_B, np.float64) - (max_response_length - buffer_len)
    return np.minimum(-excess_B / buffer_len * penalty_factor, 0.0)


def sample_and_score(
    ctx: StepContext, params, prompts: prompts_lib.PromptBatch, rng, timing: dict, *,
    policy_version: int | None = None,
) -> Sampled:
    """Stages 1 and 2: n completions per prompt, decoded and scored (plus DAPO's overlong
    penalty with reward.overlong_buffer.enable)."""
    run, sp = ctx.run, rollout_sampling(ctx.run)
    rollout = _timed(timing, "gen", generate, ctx.engine, params, prompts, rng, sp, add=True,
                     policy_version=policy_version)
    t0 = time.perf_counter()
    scored = score(ctx.reward_fn, ctx.tokenizer, rollout, prompts, n=sp.n, pool=ctx.pool)
    _add(timing, "timing_s/reward", time.perf_counter() - t0)
    result = scored.result
    ob = run.reward.overlong_buffer
    if ob.enable:
        penalty_B = overlong_penalty(
            scored.response_mask_BT.sum(1),
            max_response_length=sp.max_new_tokens,
            buffer_len=ob.len,
            penalty_factor=ob.penalty_factor,
        )
        extras = dict(result.extras)
        if "acc" not in extras:  # verl's DAPO reward manager: "acc" = the unpenalised score
            extras["acc"] = list(result.scores_B)
        if ob.log:
            extras |= {"overlong_reward": penalty_B.tolist(), "overlong": (penalty_B < 0).tolist()}
        result = dataclasses.replace(
            result,
            scores_B=[s + float(p) for s, p in zip(result.scores_B, penalty_B, strict=True)],
            extras=extras,
        )
    prompt_ids, prompt_mask = full_prompts(prompts)
    host = HostRollout(
        np.repeat(prompt_ids, sp.n, axis=0),
        np.repeat(prompt_mask, sp.n, axis=0),
        scored.response_ids_BT,
        scored.response_mask_BT,
    )
    examples = [ex for ex in prompts.examples for _ in range(sp.n)]
    return Sampled(rollout, host, scored.texts, examples, result, sp.n)


def group_values(sampled: Sampled, metric: str) -> np.ndarray:
    """[groups, n] values of DAPO's filter metric (config.FilterGroupsConfig.metric)."""
    if metric in ("seq_reward", "seq_final_reward") or (
        metric == "acc" and "acc" not in sampled.result.extras
    ):
        values = sampled.result.scores_B
    elif metric in sampled.result.extras:
        values = sampled.result.extras[metric]
        if any(v is None for v in values):
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r}: some samples' scores lack that key"
            )
    else:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is neither 'acc', 'seq_reward', "
            "'seq_final_reward' nor a key of the "
            f"scorer's outputs ({sorted(sampled.result.extras) or 'it returns plain floats'})"
        )
    return np.asarray(values, np.float64).reshape(sampled.num_groups, sampled.group_size)


def informative_groups(values_GN: np.ndarray) -> np.ndarray:
    """DAPO: whether each group's metric differs between its samples (bool [groups]).

    A group is uniform when its values differ by at most 1e-6 x max(1, |mean|), so float noise
    (a sum of rewards that should be equal) does not make it informative.
    """
    spread_G = values_GN.max(1) - values_GN.min(1)
    return spread_G > 1e-6 * np.maximum(1.0, np.abs(values_GN.mean(1)))


def select_groups(sampled: Sampled, groups: Sequence[int], mesh) -> Sampled:
    """The rows of `groups` (renumbered 0..), device and host sides alike."""
    n = sampled.group_size
    rows = np.concatenate([np.arange(g * n, (g + 1) * n) for g in groups]).astype(np.int32)
    host = HostRollout(*(x[rows] for x in dataclasses.astuple(sampled.host)))
    return _rebuild(sampled, host, _take_rows(sampled.result, rows),
                    [sampled.texts[i] for i in rows], [sampled.examples[i] for i in rows],
                    distributed.to_host(sampled.rollout.log_probs)[rows], mesh)


def _take_rows(res: reward_fns.RewardResult, rows) -> reward_fns.RewardResult:
    return reward_fns.RewardResult(
        [res.scores_B[i] for i in rows],
        {k: [v[i] for i in rows] for k, v in res.per_fn.items()},
        {k: [v[i] for i in rows] for k, v in res.extras.items()},
        res.num_errors,
        res.num_lost,
    )


def _rebuild(like: Sampled, host: HostRollout, result, texts, examples, log_probs_BT, mesh,
             **counts) -> Sampled:
    """A Sampled over `host`'s rows, the rollout re-placed from the host arrays."""
    put = functools.partial(distributed.to_device, mesh=mesh)
    n = like.group_size
    rollout = like.rollout.replace(
        prompt_ids=put(host.prompt_ids_BP),
        prompt_mask=put(host.prompt_mask_BP),
        response_ids=put(host.response_ids_BT),
        response_mask=put(host.response_mask_BT),
        log_probs=put(np.asarray(log_probs_BT, np.float32)),
        group_ids=put(np.repeat(np.arange(len(texts) // n, dtype=np.int32), n)),
    )
    return dataclasses.replace(like, rollout=rollout, host=host, texts=texts, examples=examples,
                               result=result, **counts)


def concat(parts: Sequence[Sampled], mesh) -> Sampled:
    """Generation batches into one (prompts left-padded to the widest), groups renumbered."""
    width = max(p.host.prompt_ids_BP.shape[1] for p in parts)

    def left_pad(x):
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)))

    host = HostRollout(
        np.concatenate([left_pad(p.host.prompt_ids_BP) for p in parts]),
        np.concatenate([left_pad(p.host.prompt_mask_BP) for p in parts]),
        np.concatenate([p.host.response_ids_BT for p in parts]),
        np.concatenate([p.host.response_mask_BT for p in parts]),
    )
    res = [p.result for p in parts]
    keys = dict.fromkeys(k for r in res for k in r.extras)
    result = reward_fns.RewardResult(
        [s for r in res for s in r.scores_B],
        {k: [v for r in res for v in r.per_fn[k]] for k in res[0].per_fn},
        {k: [v for r in res for v in r.extras.get(k, [None] * len(r.scores_B))] for k in keys},
        sum(r.num_errors for r in res),
        sum(r.num_lost for r in res),
    )
    log_probs = np.concatenate([distributed.to_host(p.rollout.log_probs) for p in parts])
    return _rebuild(
        parts[0], host, result, [t for p in parts for t in p.texts],
        [e for p in parts for e in p.examples], log_probs, mesh,
        num_gen_batches=sum(p.num_gen_batches for p in parts),
        num_filtered_groups=sum(p.num_filtered_groups for p in parts),
    )


def dynamic_sample(ctx: StepContext, params, next_prompts, rng, timing: dict, *,
                   policy_version: int | None = None) -> Sampled:
    """DAPO's dynamic sampling (algorithm.filter_groups): generation batches of
    data.gen_batch_size prompts until data.train_batch_size informative groups are kept; the
    surplus is dropped, as verl's DAPO trainer does.

    Raises:
      RuntimeError: algorithm.filter_groups.max_num_gen_batches batches did not give enough.
    """
    run, fg = ctx.run, ctx.run.algorithm.filter_groups
    want, kept, filtered, have = run.data.train_batch_size, [], 0, 0
    for i in itertools.count():
        if fg.max_num_gen_batches and i >= fg.max_num_gen_batches:
            raise RuntimeError(
                f"DAPO dynamic sampling kept {have} of data.train_batch_size={want} groups after "
                f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation "
                f"batches (the other {filtered} groups scored the same on all their samples): "
                "raise the limit (0 = none), raise data.gen_batch_size, or check the reward"
            )
        part = sample_and_score(
            ctx, params, next_prompts(run.gen_batch_size), jax.random.fold_in(rng, i), timing,
            policy_version=policy_version,
        )
        keep = np.flatnonzero(informative_groups(group_values(part, fg.metric)))
        filtered += part.num_groups - len(keep)
        if len(keep):
            kept.append(select_groups(part, keep, ctx.mesh) if len(keep) < part.num_groups
                        else part)
            have += len(keep)
        if have >= want:
            break
    batch = concat(kept, ctx.mesh) if len(kept) > 1 else kept[0]
    if batch.num_groups > want:
        batch = select_groups(batch, range(want), ctx.mesh)
    return dataclasses.replace(batch, num_gen_batches=i + 1, num_filtered_groups=filtered)


def greedy_baselines(ctx: StepContext, params, sampled: Sampled, rng, timing: dict, *,
                     policy_version: int | None = None) -> np.ndarray:
    """ReMax's baselines [B]: the score of one greedy (temperature 0) completion of each
    prompt, repeated over the prompt's samples (verl's reward_baselines)."""
    n = sampled.group_size
    first = np.arange(0, len(sampled.texts), n)
    rows = distributed.process_rows(len(first)) if jax.process_count() > 1 else None
    held = first if rows is None else first[rows[0] : rows[1]]
    prompts = prompts_lib.PromptBatch(
        sampled.host.prompt_ids_BP[held],
        sampled.host.prompt_mask_BP[held],
        tuple(sampled.examples[i] for i in first),
        tuple(int(i) for i in first),
        rows,
    )
    sp = SamplingParams(1, ctx.run.data.max_response_length, 0.0)
    greedy = _timed(timing, "gen_max", generate, ctx.engine, params, prompts, rng, sp,
                    policy_version=policy_version)
    scored = score(ctx.reward_fn, ctx.tokenizer, greedy, prompts, n=1, pool=ctx.pool)
    return np.repeat(np.asarray(scored.result.scores_B, np.float32), n)


def estimator_extras(ctx: StepContext, params, sampled: Sampled, rng, timing: dict, *,
                     policy_version: int | None = None) -> dict:
    """The per-batch inputs of algorithm.adv_estimator beyond the token rewards (or {})."""
    alg, mesh = ctx.run.algorithm, ctx.mesh
    if alg.adv_estimator == "remax":
        baselines = greedy_baselines(ctx, params, sampled, rng, timing,
                                     policy_version=policy_version)
        return {"reward_baselines": distributed.to_device(baselines, mesh)}
    if alg.adv_estimator != "gdpo":
        return {}
    keys = registry.split_list(alg.gdpo_reward_keys)
    result = sampled.result
    if keys:
        missing = [k for k in keys if k not in result.extras
                   or any(v is None for v in result.extras[k])]
        if missing:
            raise ValueError(
                f"algorithm.gdpo_reward_keys: {missing} are not returned for every sample by "
                f"the reward function (its dict keys: {sorted(result.extras) or 'none'})"
            )
        columns = [result.extras[k] for k in keys]
        weights = alg.gdpo_weight_values or (1.0,) * len(keys)
    elif len(result.per_fn) > 1:  # one component per reward function
        columns = [result.per_fn[name] for name in ctx.reward_fn.names]
        weights = ctx.reward_fn.weights
    else:
        return {}
    components_BK = np.asarray(columns, np.float32).T
    return {
        "reward_components": distributed.to_device(components_BK, mesh),
        "reward_weights": jnp.asarray(weights, jnp.float32),
    }


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Stages 1-2 of a step, ready for the update: what `rollout_stage` returns (and what an
    asynchronous run samples one step ahead).

    Attributes:
      sampled: the completions and their rewards.
      extras: the estimator's per-batch inputs (estimator_extras: remax's greedy baselines...).
      timing: the seconds of sampling and scoring (timing_s/gen, reward, ...).
      policy_version: TrainState.step of the params that sampled it (the behaviour policy).
      sampled_at: the loop step (0-based) whose params sampled it; the step that updates with it
        is sampled_at + its staleness.
    """

    sampled: Sampled
    extras: dict
    timing: dict
    policy_version: int
    sampled_at: int = 0


def on_mesh(batch: RolloutBatch, mesh) -> RolloutBatch:
    """`batch` with its device arrays on `mesh` (a batch sampled on devices of its own): arrays
    with a row per sample split over the batch axes, the others replicated."""
    rows = len(batch.sampled.texts)

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        if x.ndim and x.shape[0] == rows:
            return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))
        return jax.device_put(x, sharding.replicated(mesh))

    sampled = dataclasses.replace(batch.sampled, rollout=jax.tree.map(put, batch.sampled.rollout))
    return dataclasses.replace(batch, sampled=sampled, extras=jax.tree.map(put, batch.extras))


def rollout_stage(
    ctx: StepContext,
    policy,
    next_prompts: Callable[[int], prompts_lib.PromptBatch],
    rng,
    *,
    policy_version: int,
    sampled_at: int = 0,
) -> RolloutBatch:
    """Stages 1-2 (and the estimator's extra rollouts): the step's prompts, n completions each,
    their rewards. `policy` are the params that sample (an engine with its own copy checks
    that it holds `policy_version`)."""
    run, timing = ctx.run, {}
    if run.algorithm.filter_groups.enable:
        sampled = dynamic_sample(ctx, policy, next_prompts, rng, timing,
                                 policy_version=policy_version)
    else:
        prompts = next_prompts(run.data.train_batch_size)
        sampled = sample_and_score(ctx, policy, prompts, rng, timing,
                                   policy_version=policy_version)
    extras = estimator_extras(ctx, policy, sampled, jax.random.fold_in(rng, 1 << 30), timing,
                              policy_version=policy_version)
    return RolloutBatch(sampled, extras, timing, policy_version, sampled_at)


def run_step(
    ctx: StepContext,
    state: actor.TrainState,
    ref_params,
    next_prompts: Callable[[int], prompts_lib.PromptBatch],
    rng,
    lr,
    *,
    kl_coef: float | None = None,
) -> tuple[actor.TrainState, dict]:
    """Stages 1-5 on one step's prompts; returns the new state and the step's metrics.

    Args:
      next_prompts: count -> the next `count` prompts of the data order. Called once with
        data.train_batch_size, or (algorithm.filter_groups) once per generation batch of
        data.gen_batch_size prompts.
      kl_coef: the in-reward KL coefficient of this step (algorithm.kl_ctrl's current value;
        None = kl_ctrl.kl_coef).
    """
    version = int(jax.device_get(state.step))  # the policy version being updated
    batch = rollout_stage(ctx, ctx.policy(state), next_prompts, rng, policy_version=version)
    return train_stage(ctx, state, ref_params, batch, lr, kl_coef=kl_coef)


def train_stage(
    ctx: StepContext,
    state: actor.TrainState,
    ref_params,
    rollout_batch: RolloutBatch,
    lr,
    *,
    kl_coef: float | None = None,
) -> tuple[actor.TrainState, dict]:
    """Stages 3-5 on a sampled batch: old and reference log-probs under `state` (the policy
    being updated, whatever policy sampled the batch), advantages, the update; returns the new
    state and the step's metrics."""
    run, timing = ctx.run, dict(rollout_batch.timing)
    sampled, extras = rollout_batch.sampled, rollout_batch.extras
    rollout, host = sampled.rollout, sampled.host
    batch = train_batch(
        rollout,
        prompt_width=int(host.prompt_mask_BP.sum(1).max()),
        bucket=run.data.prompt_length_bucket,
    )
    batch, old_metrics = log_probs(
        ctx.programs, run, state, ref_params, batch, host, ctx.mesh, timing,
        rollout_log_probs_BT=rollout.log_probs,
        base_params=ctx.base_params,
    )
    batch, adv_metrics = advantages(
        ctx.programs, run, batch, rollout, sampled.result.scores_B, ctx.mesh, timing,
        kl_coef=kl_coef, extras=extras,
    )
    t0 = time.perf_counter()
    state, record = update(
        ctx.programs, run, state, batch, lr, host, ctx.mesh, base_params=ctx.base_params
    )
    timing["timing_s/update_actor"] = time.perf_counter() - t0
    # verl: actor/entropy is the pre-update policy's, from the old-log-prob pass (or, on-policy
    # without that pass, from the update's own forward); the update pass's value is
    # actor/entropy_loss, logged with actor.calculate_entropy.
    update_entropy = record.pop("actor/entropy", None)
    if run.actor.calculate_entropy and update_entropy is not None:
        record["actor/entropy_loss"] = update_entropy
    entropy = old_metrics.get("actor/entropy", update_entropy)
    if entropy is not None:
        record["actor/entropy"] = entropy
    record |= adv_metrics | reward_metrics(sampled.result)
    record |= length_metrics(
        host.response_mask_BT,
        host.prompt_mask_BP,
        max_response_length=run.data.max_response_length,
        max_prompt_length=run.data.max_prompt_length,
    )
    if run.algorithm.filter_groups.enable:
        record["train/num_gen_batches"] = sampled.num_gen_batches
        record["train/num_filtered_groups"] = sampled.num_filtered_groups
    prompt_B, response_B = host.prompt_mask_BP.sum(1), host.response_mask_BT.sum(1)
    record |= perf.timing_per_token(timing, prompt_tokens=int(prompt_B.sum()),
                                    response_tokens=int(response_B.sum()))
    record |= perf.global_seqlen(prompt_B + response_B, ctx.programs.dp)
    record |= perf.memory()
    record |= perf.mfu(
        record.pop("perf/actor_flops"), timing["timing_s/update_actor"],
        devices=jax.device_count(),
        peak_flops=perf.peak_flops_per_device(run.trainer.device_peak_tflops),
    )
    return state, record | timing


def reward_metrics(result: reward_fns.RewardResult) -> dict[str, float]:
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
    response_mask_BT, prompt_mask_BP, *, max_response_length, max_prompt_length
) -> dict[str, float]:
    """verl's response_length/* and prompt_length/* metrics, plus the token count."""
    lengths = np.asarray(response_mask_BT).sum(1)
    prompt_lengths = np.asarray(prompt_mask_BP).sum(1)
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


def _add(timing: dict, key: str, seconds: float) -> None:
    timing[key] = timing.get(key, 0.0) + seconds


def _timed(timing: dict, key: str, fn, *args, add: bool = False, **kw):
    """fn(*args, **kw) to completion; its time under timing_s/<key> (summed with `add`)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kw))
    seconds = time.perf_counter() - t0
    if add:
        _add(timing, f"timing_s/{key}", seconds)
    else:
        timing[f"timing_s/{key}"] = seconds
    return out
