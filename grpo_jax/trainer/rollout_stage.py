"""Stages 1-2 of a GRPO step: sample n completions per prompt, decode and score them.

    batch = rollout_stage(ctx, policy, next_prompts, rng, policy_version=v)

`generate` samples (engines.Engine), `score` decodes and rewards, `sample_and_score` does both
for one generation batch (plus DAPO's overlong penalty); with algorithm.filter_groups,
`dynamic_sample` refills the filtered groups as verl 0.9.1's Sync DAPO does until enough groups
are kept; `estimator_extras` adds what the estimator needs beyond the rewards (remax's greedy
baselines, gdpo's reward components). The result is a `batch.RolloutBatch`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import distributed, registry, sharding
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import genrm
from grpo_jax.rewards import pool as reward_pool_lib
from grpo_jax.rewards import reward_model as reward_model_lib
from grpo_jax.rollout import engines, paged
from grpo_jax.trainer import batch as batch_lib
from grpo_jax.trainer import perf, programs


def generate(
    engine: engines.Engine,
    params,
    prompts: prompts_lib.PromptBatch,
    rng,
    sp: engines.SamplingParams,
    *,
    policy_version: int | None = None,
    finished: paged.Finished | None = None,
):
    """Stage 1: n completions per prompt (a sampler.Rollout, B = P * n rows).

    `policy_version` (TrainState.step of `params`) lets an engine that holds its own copy of the
    weights refuse a rollout sampled under other ones. A batch of which this process holds
    only its rows (`prompts.rows`, several processes) becomes one global batch first.
    `finished` (engines.NativeEngine only) hears of each row as soon as it is done.
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
    if finished is not None:
        return engine.sample(params, ids, mask, rng, sp, policy_version, finished=finished)
    return engine.sample(params, ids, mask, rng, sp, policy_version)


def sample_rollout(
    engine: engines.Engine,
    params,
    prompts: prompts_lib.PromptBatch,
    rng,
    sp: engines.SamplingParams,
    *,
    agent=None,
    policy_version: int | None = None,
    finished: paged.Finished | None = None,
):
    """Stage 1, single-turn (`generate`, whose `finished` hook hears of each row when it is
    done) or with tools (`agent`, a multi_turn.Agent): (rollout, the B rows' examples, per-row
    multi-turn stats or {}). A multi-turn row's example carries its tool results in extra_info,
    for the reward."""
    if agent is not None:
        if finished is not None:
            raise ValueError("multi-turn rollouts report no finished rows (see streams_rewards)")
        out = agent.sample(engine, params, prompts, rng, sp, policy_version=policy_version)
        return out.rollout, list(out.examples), out.row_stats
    hook = {} if finished is None else {"finished": finished}
    rollout = generate(engine, params, prompts, rng, sp, policy_version=policy_version, **hook)
    return rollout, [ex for ex in prompts.examples for _ in range(sp.n)], {}


def full_prompts(prompts: prompts_lib.PromptBatch) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of all P prompts on this host (gathered from every process with `rows`)."""
    if prompts.rows is None:
        return prompts.prompt_ids_PT, prompts.prompt_mask_PT
    return (
        distributed.gather_rows(prompts.prompt_ids_PT),
        distributed.gather_rows(prompts.prompt_mask_PT),
    )


def decode(tokenizer, response_ids_BT: np.ndarray, response_mask_BT: np.ndarray) -> list[str]:
    """Valid response tokens -> text (special tokens such as EOS skipped, as verl)."""
    lengths = response_mask_BT.sum(1)
    return tokenizer.batch_decode(
        [row[:n] for row, n in zip(response_ids_BT, lengths, strict=True)],
        skip_special_tokens=True,
    )


def score(
    reward_fn: reward_fns.RewardFn,
    tokenizer,
    response_ids_BT: np.ndarray,
    response_mask_BT: np.ndarray,
    prompts: prompts_lib.PromptBatch,
    *,
    n: int,
    pool: reward_pool_lib.Pool | None = None,
    examples: Sequence[prompts_lib.Example] | None = None,
) -> tuple[list[str | None], reward_fns.RewardResult]:
    """Stage 2: decode every completion (host tokens, B = P * n rows) and score it against its
    prompt's example (or `examples[b]`, one per row: a multi-turn rollout's, with its tool
    results in extra_info). Returns (texts, rewards).

    With several processes (`prompts.rows`), each decodes and scores the completions of its own
    prompts, and only the reward results are exchanged: `texts` holds this process's
    completions and None for the others'.
    """
    texts, lo, hi = _own_texts(tokenizer, response_ids_BT, response_mask_BT, prompts, n)
    if examples is None:
        examples = [ex for ex in prompts.examples for _ in range(n)]
    result = reward_fns.score_batch(reward_fn, texts, examples[lo:hi], pool=pool)
    if prompts.rows is not None:
        result = reward_fns.RewardResult.concat(distributed.gather_objects([result]))
    return [None] * lo + texts + [None] * (len(response_ids_BT) - hi), result


def streams_rewards(ctx: programs.StepContext, prompts: prompts_lib.PromptBatch) -> bool:
    """Whether a generation batch scores each row as soon as the engine reports it done
    (reward.overlap_with_rollout, `RowScorer`): function rewards only (a reward model or judge
    scores the whole batch on the mesh), single-turn (a multi-turn row's reward needs the tool
    results its agent adds to the example), one JAX process (each process scores its own rows,
    then they are exchanged) and the native engine (the vLLM sidecar returns the batch whole)."""
    return (
        ctx.run.reward.overlap_with_rollout
        and ctx.reward_model is None
        and ctx.agent is None
        and prompts.rows is None
        and jax.process_count() == 1
        and isinstance(ctx.engine, engines.NativeEngine)
    )


class RowScorer:
    """`score` streamed: the engine's `finished` hook (`paged.Finished`) decodes each finished
    row and submits its reward calls at once (`functions.Scoring.add`), while the other rows
    decode; `result` scores the rows not reported (all of them when the grouped sampler ran)
    and waits for every call. The (texts, rewards) equal `score`'s."""

    def __init__(self, reward_fn: reward_fns.RewardFn, tokenizer, examples_B, *, pool=None):
        self.tokenizer = tokenizer
        self.scoring = reward_fns.Scoring(reward_fn, examples_B, pool=pool)

    def __call__(self, row: int, response_ids: np.ndarray) -> None:
        ids_1T = np.asarray(response_ids)[None]
        (text,) = decode(self.tokenizer, ids_1T, np.ones_like(ids_1T))
        self.scoring.add(row, text)

    def result(self, response_ids_BT: np.ndarray, response_mask_BT: np.ndarray):
        """(texts, rewards) of the whole batch (host arrays)."""
        texts = decode(self.tokenizer, response_ids_BT, response_mask_BT)
        return texts, self.scoring.result(texts)


def _own_texts(tokenizer, response_ids_BT, response_mask_BT, prompts, n: int):
    """(texts, lo, hi): this process's completions, rows [lo, hi) of the batch, decoded."""
    start, stop = (0, len(prompts.examples)) if prompts.rows is None else prompts.rows
    lo, hi = start * n, stop * n
    return decode(tokenizer, response_ids_BT[lo:hi], response_mask_BT[lo:hi]), lo, hi


def score_with_model(
    reward_fn: reward_fns.RewardFn,
    tokenizer,
    response_ids_BT: np.ndarray,
    response_mask_BT: np.ndarray,
    prompts: prompts_lib.PromptBatch,
    *,
    n: int,
    rm: reward_model_lib.RewardModel | genrm.Judge,
    host: batch_lib.HostRollout,
    rng,
    pool: reward_pool_lib.Pool | None = None,
    examples: Sequence[prompts_lib.Example] | None = None,
) -> tuple[list[str | None], reward_fns.RewardResult]:
    """`score` with the reward model (reward_model.enable): the rule functions when reward.fn
    lists any besides it, and the model's score of every row (all processes run the scoring
    program on the whole batch), combined by reward_model.combine. `rng`: a judge's sampling."""
    if examples is None:
        examples = [ex for ex in prompts.examples for _ in range(n)]
    if rm.with_rules:
        texts, result = score(reward_fn, tokenizer, response_ids_BT, response_mask_BT, prompts,
                              n=n, pool=pool, examples=examples)  # fmt: skip
    else:  # verl: the reward model's score replaces the rule reward
        texts, lo, hi = _own_texts(tokenizer, response_ids_BT, response_mask_BT, prompts, n)
        texts = [None] * lo + texts + [None] * (len(response_ids_BT) - hi)
        result = None
    scores_B, extras = model_scores(
        rm, tokenizer, host.prompt_ids_BP, host.prompt_mask_BP, response_ids_BT,
        response_mask_BT, examples, rng,
    )  # fmt: skip
    return texts, reward_model_lib.combine(result, scores_B, rm.weight, extras)


def model_scores(
    rm: reward_model_lib.RewardModel | genrm.Judge,
    tokenizer,
    prompt_ids_BP: np.ndarray,
    prompt_mask_BP: np.ndarray,
    response_ids_BT: np.ndarray,
    response_mask_BT: np.ndarray,
    examples: Sequence[prompts_lib.Example],
    rng,
) -> tuple[np.ndarray, dict[str, list]]:
    """The reward model's scores [B] of B rollouts (host arrays, the whole batch: every process
    runs the same programs) and its per-sample extras: a classifier's score of the rollout
    (reward_model.input_rows), or a judge's parsed verdict on the decoded response (genrm)."""
    if isinstance(rm, genrm.Judge):
        solutions = decode(tokenizer, response_ids_BT, response_mask_BT)
        return genrm.score(rm, solutions, examples, rng)
    rows = reward_model_lib.input_rows(
        rm, tokenizer, prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT, examples
    )
    return reward_model_lib.score_rows(rm, rows), {}


# Folded into a step's rollout key for the judge's sampling (apart from the policy's draws).
JUDGE_RNG_SALT = 0x6A756467


def rollout_sampling(run: config_lib.RunConfig) -> engines.SamplingParams:
    """The training rollout's sampling settings (rollout.*)."""
    r = run.rollout
    return engines.SamplingParams(
        r.n, run.data.max_response_length, r.temperature, r.top_p, r.top_k,
        record_routing=r.enable_rollout_routing_replay,
    )  # fmt: skip


def overlong_penalty(
    lengths_B, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> np.ndarray:
    """DAPO's soft overlong penalty (verl's DAPO reward manager): 0 up to max - buffer_len
    tokens, then -penalty_factor x excess / buffer_len (reaching -penalty_factor at max)."""
    excess_B = np.asarray(lengths_B, np.float64) - (max_response_length - buffer_len)
    return np.minimum(-excess_B / buffer_len * penalty_factor, 0.0)


def with_overlong_penalty(
    result: reward_fns.RewardResult,
    lengths_B,
    overlong_buffer: config_lib.OverlongBufferConfig,
    *,
    max_response_length: int,
) -> reward_fns.RewardResult:
    """`result` with DAPO's overlong penalty added to every score when
    reward.overlong_buffer.enable (else `result` itself), as verl 0.9.1's DAPO reward manager
    does in training and validation alike (experimental/reward_loop/reward_manager/dapo.py:
    run_single): "acc" keeps the unpenalised score, and reward.overlong_buffer.log adds the
    "overlong_reward" and "overlong" keys.

    Args:
      result: the scores of B responses.
      lengths_B: their lengths in tokens.
      overlong_buffer: the reward.overlong_buffer section.
      max_response_length: data.max_response_length.
    """
    ob = overlong_buffer
    if not ob.enable:
        return result
    penalty_B = overlong_penalty(
        lengths_B,
        max_response_length=max_response_length,
        buffer_len=ob.len,
        penalty_factor=ob.penalty_factor,
    )
    extras = dict(result.extras)
    if "acc" not in extras:  # verl's DAPO reward manager: "acc" = the unpenalised score
        extras["acc"] = (
            reward_fns.reward_extra_info(result, "acc")
            if len(result.per_fn) == 1
            else list(result.scores_B)
        )
    if ob.log:
        extras |= {"overlong_reward": penalty_B.tolist(), "overlong": (penalty_B < 0).tolist()}
    return dataclasses.replace(
        result,
        scores_B=[s + float(p) for s, p in zip(result.scores_B, penalty_B, strict=True)],
        extras=extras,
    )


def sample_and_score(
    ctx: programs.StepContext,
    params,
    prompts: prompts_lib.PromptBatch,
    rng,
    timing: dict,
    *,
    policy_version: int | None = None,
) -> batch_lib.RolloutBatch:
    """Stages 1 and 2: n completions per prompt, decoded and scored (plus DAPO's overlong
    penalty with reward.overlong_buffer.enable). Rows are scored as they finish when
    `streams_rewards` (timing_s/reward is then the wait after generation, and
    timing_s/reward_overlapped the seconds of generation during which some of its rows'
    reward calls were queued or running)."""
    run, sp = ctx.run, rollout_sampling(ctx.run)
    streamed = None
    if streams_rewards(ctx, prompts):
        streamed = RowScorer(ctx.reward_fn, ctx.tokenizer,
                             [ex for ex in prompts.examples for _ in range(sp.n)], pool=ctx.pool)
    rollout, examples, row_stats = perf.timed(
        timing, "gen", sample_rollout, ctx.engine, params, prompts, rng, sp, add=True,
        agent=ctx.agent, policy_version=policy_version, finished=streamed,
    )  # fmt: skip
    generated_at = time.perf_counter()
    prompt_ids, prompt_mask = full_prompts(prompts)
    host = batch_lib.HostRollout(
        np.repeat(prompt_ids, sp.n, axis=0),
        np.repeat(prompt_mask, sp.n, axis=0),
        distributed.to_host(rollout.response_ids),
        distributed.to_host(rollout.response_mask),
        None if rollout.loss_mask is None else distributed.to_host(rollout.loss_mask),
    )
    if streamed is not None:  # timing_s/reward: only the wait after generation
        texts, result = perf.timed(timing, "reward", streamed.result, host.response_ids_BT,
                                   host.response_mask_BT, add=True)  # fmt: skip
        key = "timing_s/reward_overlapped"
        timing[key] = timing.get(key, 0.0) + streamed.scoring.overlapped_s(generated_at)
    else:
        texts, result = perf.timed(
            timing,
            "reward",
            score_with_model if ctx.reward_model is not None else score,
            ctx.reward_fn,
            ctx.tokenizer,
            host.response_ids_BT,
            host.response_mask_BT,
            prompts,
            n=sp.n,
            pool=ctx.pool,
            add=True,
            examples=examples,
            **({} if ctx.reward_model is None else {
                "rm": ctx.reward_model, "host": host,
                "rng": jax.random.fold_in(rng, JUDGE_RNG_SALT)
            }),
        )
    result = with_overlong_penalty(
        result,
        host.response_mask_BT.sum(1),
        run.reward.overlong_buffer,
        max_response_length=sp.max_new_tokens,
    )
    return batch_lib.RolloutBatch(rollout, host, texts, examples, result, sp.n,
                                  row_stats=row_stats)


def group_values(
    result: reward_fns.RewardResult, metric: str, *, group_size: int
) -> np.ndarray:
    """[groups, n] values of DAPO's filter metric (config.FilterGroupsConfig.metric), as verl
    0.9.1's ReplayBuffer._dapo_filtered_keys reads them: "reward" is the sequence reward as
    verl's float32 rm_scores hold it, any other name that key of reward_extra_info.

    Raises:
      ValueError: some sample lacks `metric` (verl raises a RuntimeError too).
    """
    if metric == "reward":
        values = np.asarray(result.scores_B, np.float32)
    else:
        values = reward_fns.reward_extra_info(result, metric)
        if any(v is None for v in values):
            keys = [k for k in ("score", "acc") if k not in result.extras] + sorted(result.extras)
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r}: some samples lack that key of "
                "reward_extra_info (the reward function's dict keys; 'acc' for a plain score); "
                f"'reward' or one of {keys} (where every sample has it)"
            )
    return np.asarray(values, np.float64).reshape(-1, group_size)


def filtered_groups(values_GN: np.ndarray) -> np.ndarray:
    """DAPO: whether each group's metric is the same on all its samples (bool [groups]).

    verl's rule exactly (ReplayBuffer._dapo_filtered_keys): `len(values) > 1 and
    np.std(values) == 0.0` in float64, so a one-sample group is never filtered, and a group of
    equal values whose float mean rounds (three 0.1s) is not filtered either.
    """
    return np.array([len(v) > 1 and float(np.std(v)) == 0.0 for v in values_GN], bool)


def select_groups(
    batch: batch_lib.RolloutBatch, groups: Sequence[int], mesh
) -> batch_lib.RolloutBatch:
    """The rows of `groups` (renumbered 0..), device and host sides alike."""
    n = batch.group_size
    rows = np.concatenate([np.arange(g * n, (g + 1) * n) for g in groups]).astype(np.int32)
    stats = {k: np.asarray(v)[rows] for k, v in batch.row_stats.items()}
    return dataclasses.replace(_rebuild(
        batch,
        batch.host.take(rows),
        batch.result.take(rows),
        [batch.texts[i] for i in rows],
        [batch.examples[i] for i in rows],
        distributed.to_host(batch.rollout.log_probs)[rows],
        mesh,
        _host_or_none(batch.rollout.num_turns, rows),
        _routing_or_none(batch, rows),
    ), row_stats=stats)


def _host_or_none(x, rows=slice(None)):
    return None if x is None else distributed.to_host(x)[rows]


def _routing_or_none(batch: batch_lib.RolloutBatch, rows=slice(None), width: int | None = None):
    """The rollout's recorded experts (Rollout.routed_experts) of `rows` on the host, their
    prompt columns cut or left-padded to `width` (default: the host prompts'), or None."""
    routed = _host_or_none(batch.rollout.routed_experts, rows)
    if routed is None:
        return None
    width = batch.host.prompt_ids_BP.shape[1] if width is None else width
    num_prompt = routed.shape[2] - batch.host.response_ids_BT.shape[1]
    prompt_BLPA, response_BLRA = routed[:, :, :num_prompt], routed[:, :, num_prompt:]
    # the dropped columns are left padding; new ones route by their own router (moe.no_route,
    # the dtype's largest value)
    pad = ((0, 0), (0, 0), (max(0, width - num_prompt), 0), (0, 0))
    prompt_BLPA = np.pad(prompt_BLPA, pad, constant_values=np.iinfo(routed.dtype).max)
    return np.concatenate([prompt_BLPA[:, :, -width:], response_BLRA], axis=2)


def _rebuild(
    like: batch_lib.RolloutBatch,
    host: batch_lib.HostRollout,
    result,
    texts,
    examples,
    log_probs_BT,
    mesh,
    num_turns_B=None,
    routed_BLSA=None,
) -> batch_lib.RolloutBatch:
    """A RolloutBatch over `host`'s rows, the rollout re-placed from the host arrays (with
    `routed_BLSA`, the recorded experts over host's prompt columns and the responses)."""
    put = functools.partial(distributed.to_device, mesh=mesh)
    n = like.group_size
    rollout = like.rollout.replace(
        prompt_ids=put(host.prompt_ids_BP),
        prompt_mask=put(host.prompt_mask_BP),
        response_ids=put(host.response_ids_BT),
        response_mask=put(host.response_mask_BT),
        log_probs=put(np.asarray(log_probs_BT, np.float32)),
        group_ids=put(np.repeat(np.arange(len(texts) // n, dtype=np.int32), n)),
        loss_mask=None if host.loss_mask_BT is None else put(host.loss_mask_BT),
        num_turns=None if num_turns_B is None else put(np.asarray(num_turns_B, np.int32)),
        routed_experts=None if routed_BLSA is None else put(routed_BLSA),
    )
    return dataclasses.replace(
        like, rollout=rollout, host=host, texts=texts, examples=examples, result=result
    )


def concat(parts: Sequence[batch_lib.RolloutBatch], mesh) -> batch_lib.RolloutBatch:
    """Generation batches into one (prompts left-padded to the widest), groups renumbered."""
    width = max(p.host.prompt_ids_BP.shape[1] for p in parts)

    def left_pad(x):
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)))

    host = batch_lib.HostRollout(
        np.concatenate([left_pad(p.host.prompt_ids_BP) for p in parts]),
        np.concatenate([left_pad(p.host.prompt_mask_BP) for p in parts]),
        np.concatenate([p.host.response_ids_BT for p in parts]),
        np.concatenate([p.host.response_mask_BT for p in parts]),
        None if parts[0].host.loss_mask_BT is None else
        np.concatenate([p.host.loss_mask_BT for p in parts]),
    )
    result = reward_fns.RewardResult.concat([p.result for p in parts])
    log_probs = np.concatenate([distributed.to_host(p.rollout.log_probs) for p in parts])
    turns = None if parts[0].rollout.num_turns is None else np.concatenate(
        [_host_or_none(p.rollout.num_turns) for p in parts])
    stats = {k: np.concatenate([np.asarray(p.row_stats[k]) for p in parts])
             for k in parts[0].row_stats}
    routed = None if parts[0].rollout.routed_experts is None else np.concatenate(
        [_routing_or_none(p, width=width) for p in parts])
    return dataclasses.replace(_rebuild(
        parts[0],
        host,
        result,
        [t for p in parts for t in p.texts],
        [e for p in parts for e in p.examples],
        log_probs,
        mesh,
        turns,
        routed,
    ), row_stats=stats)


def sample_size(count: int, *, unit: int, train_batch_size: int, cap: int) -> int:
    """Prompts to sample for `count` wanted (the rest repeat the last one: sampled and scored,
    not kept): the smallest of unit x 2^k and the multiples of train_batch_size up to `cap`
    that holds them.

    DAPO's refills want any number of prompts; the sampler needs a multiple of `unit` (its
    data devices and processes, which divide train_batch_size) and compiles once per size, so
    a step compiles at most log2(cap / unit) + cap / train_batch_size sampler shapes.
    """
    sizes = {m * train_batch_size for m in range(1, cap // train_batch_size + 1)}
    sizes |= {unit << k for k in range(cap.bit_length()) if unit << k < cap}
    return min(s for s in sizes if s >= count)


def dynamic_sample(
    ctx: programs.StepContext,
    params,
    next_prompts,
    rng,
    timing: dict,
    *,
    policy_version: int | None = None,
) -> batch_lib.RolloutBatch:
    """DAPO's dynamic sampling (algorithm.filter_groups) as verl 0.9.1's Sync DAPO
    (verl/trainer/ppo/v1/replay_buffer.py: ReplayBuffer.sample, trainer_base.py: prepare_step).

    verl submits data.train_batch_size prompts, then polls the finished groups: each filtered
    group (`filtered_groups`) is evicted and earns two refill credits, and credits are sampled
    as prompts, at most max_inflight_gen_batches x train_batch_size pending or running at
    once, until train_batch_size groups are kept; the surplus is discarded once nothing is in
    flight. Here every round of prompts finishes before the next is sent (one of the orders of
    verl's polling), so a round is min(credits, that bound) prompts, read from the data order one
    at a time (verl's gen_batch_size 1). verl keeps the oldest groups, in no set order among
    one step's; here the first ones sampled. verl 0.9.1 has no limit on the rounds
    (max_num_gen_batches is ignored): a metric that never varies within a group samples on.

    The step's metrics, in `filter_metrics`, are verl's: training/filter_groups/evicted_samples
    (groups filtered) and discarded_surplus_samples (kept groups dropped), each only when
    non-zero.
    """
    run, fg = ctx.run, ctx.run.algorithm.filter_groups
    want, n = run.data.train_batch_size, run.rollout.n
    cap = fg.max_inflight_gen_batches * want
    unit = math.lcm(ctx.programs.dp, run.rollout.num_devices or 1, jax.process_count())
    count, credit, kept, have, evicted = want, 0, [], 0, 0
    for i in itertools.count():
        size = sample_size(count, unit=unit, train_batch_size=want, cap=cap)
        part = sample_and_score(
            ctx,
            params,
            next_prompts(count, pad_to=size),
            jax.random.fold_in(rng, i),
            timing,
            policy_version=policy_version,
        )
        values = group_values(part.result.take(range(count * n)), fg.metric, group_size=n)
        keep = np.flatnonzero(~filtered_groups(values))
        evicted += count - len(keep)
        if len(keep):
            whole = len(keep) == part.num_groups
            kept.append(part if whole else select_groups(part, keep, ctx.mesh))
            have += len(keep)
        if have >= want:
            break
        credit += 2 * (count - len(keep))
        count = min(credit, cap)  # >= 1: credit exceeds the groups still missing
        credit -= count
    batch = concat(kept, ctx.mesh) if len(kept) > 1 else kept[0]
    surplus = batch.num_groups - want
    if surplus:
        batch = select_groups(batch, range(want), ctx.mesh)
    filter_metrics = {}
    if evicted:
        filter_metrics["training/filter_groups/evicted_samples"] = evicted
    if surplus:
        filter_metrics["training/filter_groups/discarded_surplus_samples"] = surplus
    return dataclasses.replace(batch, filter_metrics=filter_metrics)


def greedy_baselines(
    ctx: programs.StepContext,
    params,
    batch: batch_lib.RolloutBatch,
    rng,
    timing: dict,
    *,
    policy_version: int | None = None,
) -> np.ndarray:
    """ReMax's baselines [B]: the score of one greedy (temperature 0) completion of each
    prompt, repeated over the prompt's samples (verl's reward_baselines)."""
    n = batch.group_size
    first = np.arange(0, len(batch.texts), n)
    rows = distributed.process_rows(len(first)) if jax.process_count() > 1 else None
    held = first if rows is None else first[rows[0] : rows[1]]
    prompts = prompts_lib.PromptBatch(
        batch.host.prompt_ids_BP[held],
        batch.host.prompt_mask_BP[held],
        tuple(batch.examples[i] for i in first),
        tuple(int(i) for i in first),
        rows,
    )
    sp = engines.SamplingParams(1, ctx.run.data.max_response_length, 0.0)
    greedy = perf.timed(
        timing,
        "gen_max",
        generate,
        ctx.engine,
        params,
        prompts,
        rng,
        sp,
        policy_version=policy_version,
    )
    _, result = score(
        ctx.reward_fn,
        ctx.tokenizer,
        distributed.to_host(greedy.response_ids),
        distributed.to_host(greedy.response_mask),
        prompts,
        n=1,
        pool=ctx.pool,
    )
    return np.repeat(np.asarray(result.scores_B, np.float32), n)


def estimator_extras(
    ctx: programs.StepContext,
    params,
    batch: batch_lib.RolloutBatch,
    rng,
    timing: dict,
    *,
    policy_version: int | None = None,
) -> dict:
    """The per-batch inputs of algorithm.adv_estimator beyond the token rewards (or {})."""
    alg, mesh = ctx.run.algorithm, ctx.mesh
    if alg.adv_estimator == "remax":
        baselines = greedy_baselines(ctx, params, batch, rng, timing, policy_version=policy_version)
        return {"reward_baselines": distributed.to_device(baselines, mesh)}
    if alg.adv_estimator != "gdpo":
        return {}
    keys = registry.split_list(alg.gdpo_reward_keys)
    result = batch.result
    if keys:
        missing = [
            k for k in keys if k not in result.extras or any(v is None for v in result.extras[k])
        ]
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


def rollout_stage(
    ctx: programs.StepContext,
    policy,
    next_prompts: Callable[[int], prompts_lib.PromptBatch],
    rng,
    *,
    policy_version: int,
    sampled_at: int = 0,
) -> batch_lib.RolloutBatch:
    """Stages 1-2 (and the estimator's extra rollouts): the step's prompts, n completions each,
    their rewards. `policy` are the params that sample (an engine with its own copy checks
    that it holds `policy_version`); `next_prompts(count)` gives the next prompts of the data
    order (called once, or once per generation batch with algorithm.filter_groups)."""
    run, timing = ctx.run, {}
    if run.algorithm.filter_groups.enable:
        batch = dynamic_sample(
            ctx, policy, next_prompts, rng, timing, policy_version=policy_version
        )
    else:
        prompts = next_prompts(run.data.train_batch_size)
        batch = sample_and_score(ctx, policy, prompts, rng, timing, policy_version=policy_version)
    extras = estimator_extras(
        ctx, policy, batch, jax.random.fold_in(rng, 1 << 30), timing, policy_version=policy_version
    )
    return dataclasses.replace(
        batch, extras=extras, timing=timing, policy_version=policy_version, sampled_at=sampled_at
    )
