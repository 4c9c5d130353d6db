"""Stages 3-5 of a GRPO step: log-probs, advantages, the update.

    state, row = train_stage(ctx, state, ref_params, batch, lr, kl_coef=...)

`train_batch` lays a `batch.RolloutBatch` out as the update's model inputs; `log_probs` computes
the old log-probs (when the run needs them) and the reference's; `advantages` turns the rewards
into token rewards (minus the in-reward KL), applies rollout correction and the estimator;
`update` runs actor.ppo_epochs x mini-batches of optimizer steps (padded micro-batches inside one
jitted step, or packed token-budget micro-batches). The stages' device work is in
`programs.Programs`; their scalar metrics are computed on the device and fetched once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import distributed, sampler
from grpo_jax import loss as loss_lib
from grpo_jax.rollout import multi_turn
from grpo_jax.trainer import actor, balance, metrics, packing, perf, programs
from grpo_jax.trainer import batch as batch_lib


def train_batch(rollout: sampler.Rollout, *, prompt_width: int, bucket: int) -> actor.TrainBatch:
    """The update's model input: prompt + response, advantages still zero.

    The update's prompt columns are the last bucket_length(prompt_width, bucket) of the
    rollout's (the dropped ones are all padding, and a narrower rollout is left-padded), so
    short prompts do not pay for the sampler's bucket and the compiled shapes stay few.
    """
    width = sampler.bucket_length(prompt_width, bucket)
    short = max(0, width - rollout.prompt_ids.shape[1])  # e.g. batches joined by concat()

    def prompt_columns(x, axis=1, fill=0):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (short, 0)
        return jax.lax.slice_in_dim(jnp.pad(x, pad, constant_values=fill), -width, None, axis=axis)

    valid = rollout.response_mask
    # the loss's tokens: those the policy sampled (multi-turn: not the tool responses)
    mask = valid if rollout.loss_mask is None else valid * rollout.loss_mask
    routing = None
    if rollout.routed_experts is not None:  # router replay R3: the prompt's columns as the ids'
        num_prompt = rollout.prompt_ids.shape[1]
        fill = jnp.iinfo(rollout.routed_experts.dtype).max  # moe.no_route
        routing = jnp.concatenate([
            prompt_columns(rollout.routed_experts[:, :, :num_prompt], axis=2, fill=fill),
            rollout.routed_experts[:, :, num_prompt:],
        ], axis=2)  # fmt: skip
    return actor.TrainBatch(
        input_ids_BS=jnp.concatenate([prompt_columns(rollout.prompt_ids), rollout.response_ids], 1),
        attention_mask_BS=jnp.concatenate([prompt_columns(rollout.prompt_mask), valid], 1),
        response_ids_BT=rollout.response_ids,
        response_mask_BT=mask,
        advantages_BT=jnp.zeros(mask.shape, jnp.float32),
        routed_experts_BLSA=routing,
    )


def _micro(packed: packing.Packed, m: int, mesh) -> actor.PackedMicro:
    return actor.PackedMicro(
        **{k: distributed.to_device(v, mesh) for k, v in packed.micro(m).items()}
    )


def _micro_like(micro: actor.PackedMicro, rows: int, row_len: int) -> actor.PackedMicro:
    """The abstract packed micro-batch of `rows` rows with `micro`'s dtypes and shardings."""
    groups = micro.slot_pos_GN.shape[0]
    shapes = {"RL": (rows, row_len), "GN": (groups, rows // groups * row_len)}

    def like(name):
        x = getattr(micro, name)
        if x is None:
            return None
        if name == "routing_RLmLA":
            shape = (rows, x.shape[1], row_len, x.shape[3])
        else:
            shape = shapes[name[-2:]]
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    return actor.PackedMicro(**{f.name: like(f.name) for f in dataclasses.fields(micro)})


def compile_packed_shapes(
    progs: programs.Programs,
    name: str,
    fn,
    micro: actor.PackedMicro,
    args_with,
    *,
    max_tokens,
    kwargs=None,
) -> None:
    """Compiles `fn` for every packed micro-batch shape the run can make, the first time it
    runs: the rows of packing.row_options under the budget `max_tokens` (the slots follow
    from the rows). The later steps meet no new packed shape, so they compile nothing, and
    with the persistent compilation cache a later run reads them all in its first step.

    Args:
      name: the program's key in progs.precompiled (once per run).
      micro: the micro-batch about to run (its dtypes and shardings are the template).
      args_with: (abstract micro) -> the positional arguments of `fn` (the others real arrays:
        lowering neither runs nor donates them).
      kwargs: keyword arguments of `fn` (real arrays), or None.
    """
    if name in progs.precompiled:
        return
    progs.precompiled.add(name)
    cap = packing.micro_cap(max_tokens, progs.row_len, progs.dp)
    for rows in packing.row_options(cap, progs.dp):
        if rows != micro.tokens_RL.shape[0]:
            like = _micro_like(micro, rows, progs.row_len)
            fn.lower(*args_with(like), **(kwargs or {})).compile()


def log_probs(
    progs: programs.Programs,
    run: config_lib.RunConfig,
    state: actor.TrainState,
    ref_params,
    batch: actor.TrainBatch,
    host: batch_lib.HostRollout,
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
    record = run.actor.router_replay.mode == "R2" and run.needs_old_log_probs
    if run.algorithm.rollout_correction.bypass_mode:
        if rollout_log_probs_BT is None:
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode=True takes the rollout engine's "
                "log-probs as the old ones, but this rollout has none"
            )
        batch = batch.replace(old_log_probs_BT=rollout_log_probs_BT)
    packs = {}

    def packed_for(replay: bool) -> packing.Packed:
        # router replay: the policy's pass packs the recorded experts, the reference's none
        if replay not in packs:
            routing = distributed.to_host(batch.routed_experts_BLSA) if replay else None
            packs[replay] = host.pack(progs.logprob_tokens, row_multiple=progs.dp,
                                      row_len=progs.row_len, routing_BLSA=routing)  # fmt: skip
        return packs[replay]

    def run_pass(params, with_entropy):
        # with_entropy: the old-log-prob pass (the policy's: router replay applies); else the
        # reference's, which routes by its own routers (verl)
        replay = with_entropy and batch.routed_experts_BLSA is not None
        if not (run.log_prob_use_dynamic_bsz and needed):
            if with_entropy:
                return progs.log_probs_entropy(params, batch)
            return progs.log_probs(params, batch.replace(routed_experts_BLSA=None))
        packed = packed_for(replay)
        fn = progs.packed_log_probs_entropy if with_entropy else progs.packed_log_probs
        lp_BT = jnp.zeros(batch.response_mask_BT.shape, jnp.float32)
        ent_BT = jnp.zeros_like(lp_BT)
        for m in range(packed.num_micro):
            micro = _micro(packed, m, mesh)
            compile_packed_shapes(
                progs,
                f"packed_log_probs/{with_entropy}",
                fn,
                micro,
                lambda like: (params, like, lp_BT, ent_BT),  # noqa: B023 - called at once
                max_tokens=progs.logprob_tokens,
            )
            lp_BT, ent_BT = fn(params, micro, lp_BT, ent_BT)
        return lp_BT, ent_BT if with_entropy else None

    out = {}
    old_BT, ref_BT = batch.old_log_probs_BT, None
    if run.needs_old_log_probs:
        policy = actor.policy_params(base_params, state.params)
        old_BT, ent_BT, *routed = perf.timed(timing, "old_log_prob", run_pass, policy, True)
        if record:  # router replay R2: the update replays the old pass's routing
            batch = batch.replace(routed_experts_BLSA=routed[0])
        out["actor/entropy"] = float(
            loss_lib.agg_loss(
                ent_BT,
                batch.response_mask_BT,
                run.actor.loss_agg_mode,
                loss_scale_factor=run.actor.loss_scale_factor,
            )
        )
    if ref_params is not None:
        ref_BT, _ = perf.timed(timing, "ref", run_pass, ref_params, False)
    return batch.replace(old_log_probs_BT=old_BT, ref_log_probs_BT=ref_BT), out


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
    """verl's apply_kl_penalty: token rewards = scores - beta * KL(old || ref) on the response.
    Returns them and the metrics (the mean KL a device scalar)."""
    kld_BT = loss_lib.kl_penalty(old_BT, ref_BT, kl_penalty) * response_mask_BT
    length_B = jnp.sum(response_mask_BT, axis=1)
    current_kl = jnp.mean(jnp.sum(kld_BT, 1) / jnp.maximum(length_B, 1))
    return scores_BT - beta * kld_BT, {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": beta,
    }


def next_kl_coef(
    kl_ctrl: config_lib.KLCtrlConfig, kl_coef: float, current_kl: float, n_steps: int
) -> float:
    """algorithm.kl_ctrl after a step: "fixed" keeps the coefficient; "adaptive" is verl's
    AdaptiveKLController, beta * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n / horizon)
    with n the step's sequences."""
    if kl_ctrl.type == "fixed":
        return kl_coef
    error = float(np.clip(current_kl / kl_ctrl.target_kl - 1.0, -0.2, 0.2))
    return kl_coef * (1.0 + error * n_steps / kl_ctrl.horizon)


def advantages(
    progs: programs.Programs,
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
    # verl: the score sits on the last valid response token (a multi-turn rollout's may be a
    # tool response's, outside the loss mask: GRPO sums the token rewards regardless)
    rewards_BT = token_level_scores(scores, rollout.response_mask)
    device = {}  # scalar metrics, fetched from the device once at the end
    if run.algorithm.use_kl_in_reward:
        rewards_BT, device = kl_in_reward(
            rewards_BT,
            batch.old_log_probs_BT,
            batch.ref_log_probs_BT,
            mask_BT,
            beta=run.algorithm.kl_ctrl.kl_coef if kl_coef is None else kl_coef,
            kl_penalty=run.algorithm.kl_penalty,
        )
    bypass = run.algorithm.rollout_correction.bypass_mode
    if not bypass and batch.old_log_probs_BT is not None and rollout.log_probs is not None:
        weights_BT, mask_BT, corr = perf.timed(
            timing,
            "rollout_correction",
            progs.rollout_correction,
            batch.old_log_probs_BT,
            rollout.log_probs,
            mask_BT,
        )
        device |= corr
        # Rejection rewrites the response mask only: token-mean keeps dividing by the tokens
        # as sampled (verl's loss_mask, actor.batch_num_tokens).
        batch = batch.replace(
            response_mask_BT=mask_BT,
            loss_mask_BT=batch.response_mask_BT,
            rollout_is_weights_BT=weights_BT,
        )
    adv_BT, returns_BT = perf.timed(
        timing, "adv", progs.advantage, rewards_BT, mask_BT, rollout.group_ids, extras or {}
    )
    # verl: advantages and returns over the response mask after rejection, sequence rewards
    # over the samples whose response is not empty (as sampled)
    device |= metrics.advantage_stats(
        adv_BT, returns_BT, rewards_BT, mask_BT, rollout.response_mask
    )
    scalars = {k: float(v) for k, v in jax.device_get(device).items()}
    old = None if run.on_policy and not bypass else batch.old_log_probs_BT
    return batch.replace(advantages_BT=adv_BT, old_log_probs_BT=old), scalars


def mini_batch_order(
    num_rows: int,
    *,
    mini_rows: int,
    dp: int,
    epoch: int,
    seed: int,
    parts: list[np.ndarray] | None = None,
    shuffle: bool = True,
) -> np.ndarray:
    """The row order of ppo epoch `epoch` whose consecutive `mini_rows` slices are its
    mini-batches, laid out as verl 0.9.1's engine worker does (train_mini_batch: each
    data-parallel rank iterates a dataloader over its own rows).

    The B rows are dp parts, one per data-parallel rank: `parts` (trainer.balance_batch,
    balance.rank_parts), else dp consecutive blocks. With `shuffle` (actor.shuffle) part r's
    rows are permuted by the epoch-th draw of a generator seeded with seed + r (fresh every
    step, as verl seeds the dataloader's generator at every update); mini-batch k takes the
    k-th mini_rows / dp of each part's rows. verl draws with torch.randperm, here numpy's: the
    same structure, not the same permutations.
    """
    if num_rows % dp or mini_rows % dp:
        what = "actor.shuffle=True shuffles" if shuffle else "trainer.balance_batch=True balances"
        raise ValueError(
            f"{what} the rows of each of the {dp} data-parallel blocks: "
            f"the batch of {num_rows} rows and its mini-batches of {mini_rows} must split over "
            "them"
        )
    local, local_mini = num_rows // dp, mini_rows // dp
    if parts is None:
        parts = list(np.arange(num_rows, dtype=np.int64).reshape(dp, local))
    blocks = []
    for r, part in enumerate(parts):
        if shuffle:
            rng = np.random.default_rng(seed + r)
            for _ in range(epoch):
                rng.permutation(local)
            part = part[rng.permutation(local)]
        blocks.append(part)
    minis = range(local // local_mini)
    return np.concatenate([b[k * local_mini : (k + 1) * local_mini] for k in minis for b in blocks])


def _take_rows(batch: actor.TrainBatch, host: batch_lib.HostRollout, order: np.ndarray):
    """The batch with its rows in `order` (device arrays keep their shardings)."""
    index = jnp.asarray(order)
    moved = jax.tree.map(lambda x: jax.device_put(x[index], x.sharding), batch)
    return moved, host.take(order)


def update(
    progs: programs.Programs,
    run: config_lib.RunConfig,
    state: actor.TrainState,
    batch: actor.TrainBatch,
    lr,
    host: batch_lib.HostRollout,
    mesh,
    *,
    base_params=None,
) -> tuple[actor.TrainState, dict]:
    """Stage 5: actor.ppo_epochs x mini-batches of optimizer steps; metrics averaged.

    verl reduces a mini-batch's micro-batch metrics with actor.combine_micro_metrics and then
    reduces every metric over the mini-batches of all epochs with metrics.reduce_metrics (the
    mean, or the max / min of a key naming one; actor/update_skipped, grpo_jax's, is their
    count).

    With actor.use_dynamic_bsz each mini-batch is packed into token-budget micro-batches whose
    gradients are summed (one compiled shape per packed shape, however many micro-batches),
    otherwise it runs as padded micro-batches inside one jitted step. With LoRA, `base_params`
    is the frozen base (state.params, the gradients and the optimizer state: the adapters only).
    Each optimizer step draws from actor.update_key(trainer.seed, state.step), micro-batch m
    from its fold_in with m (clip_cov). With actor.shuffle each epoch first reorders the rows
    (`mini_batch_order`).
    """
    base = () if base_params is None else (base_params,)
    updates = []
    mini = progs.mini_rows
    packs = {}
    routing = None  # router replay: the batch's recorded experts on the host, for packing
    lr = jnp.float32(lr)
    unshuffled = batch, host
    parts = None
    if run.trainer.balance_batch and run.mini_batches_per_step > 1:
        # one mini-batch holds every row whatever the parts: nothing to reorder
        parts = balance.rank_parts(host.seq_lengths_B(), progs.dp)
    for epoch in range(run.actor.ppo_epochs):
        if run.actor.shuffle or (parts is not None and epoch == 0):
            order = mini_batch_order(
                len(host.response_mask_BT), mini_rows=mini, dp=progs.dp, epoch=epoch,
                seed=run.actor.data_loader_seed, parts=parts, shuffle=run.actor.shuffle,
            )  # fmt: skip
            batch, host = _take_rows(*unshuffled, order)
            packs, routing = {}, None
        for i in range(run.mini_batches_per_step):
            key = actor.update_key(run.trainer.seed, state.step)
            if not run.actor.use_dynamic_bsz:
                index = jnp.int32(i)
                state, m = progs.update(state, batch, index, lr, *base, rng=key)
                updates.append(m)
                continue
            if i not in packs:  # the same slices in every epoch (unless shuffled)
                rows = host.rows(i * mini, (i + 1) * mini)
                if routing is None and batch.routed_experts_BLSA is not None:
                    routing = distributed.to_host(batch.routed_experts_BLSA)
                packs[i] = rows.pack(
                    progs.update_tokens, row_multiple=progs.dp, row_len=progs.row_len,
                    routing_BLSA=None if routing is None else routing[i * mini : (i + 1) * mini],
                )  # fmt: skip
            packed = packs[i]
            # The [B, T] fields only: the packed micro-batches carry the tokens, so the
            # program's shapes do not depend on the prompt width.
            mini_batch = jax.tree.map(
                lambda x, i=i: x[i * mini : (i + 1) * mini],
                batch.replace(input_ids_BS=None, attention_mask_BS=None, routed_experts_BLSA=None),
            )
            grads = jax.tree.map(jnp.zeros_like, state.params)
            micro_metrics, loss = [], jnp.zeros((), jnp.float32)
            for m in range(packed.num_micro):
                micro = _micro(packed, m, mesh)
                micro_key = jax.random.fold_in(key, m)
                compile_packed_shapes(
                    progs,
                    "packed_grads",
                    progs.packed_grads,
                    micro,
                    lambda like: (state.params, grads, like, mini_batch, *base),  # noqa: B023
                    max_tokens=progs.update_tokens,
                    kwargs={"rng": micro_key},
                )
                grads, m = progs.packed_grads(
                    state.params, grads, micro, mini_batch, *base, rng=micro_key
                )
                micro_metrics.append(m)
                # Added from zeros even for one micro-batch: the same programs every step.
                loss = loss + m["actor/loss"]
            state, opt_metrics = progs.apply(state, grads, loss, lr)
            # combined on the host below: stacking a step's micro-batch count of scalars on the
            # device would compile a program per count
            updates.append(
                (micro_metrics, {**opt_metrics, "actor/micro_batches": packed.num_micro})
            )
    updates = [_mini_batch_metrics(u) for u in jax.device_get(updates)]
    record = metrics.reduce_metrics({k: [u[k] for u in updates] for k in updates[0]})
    record["actor/update_skipped"] = sum(float(u["actor/update_skipped"]) for u in updates)
    # verl's model FLOPs of every sequence, once per epoch (perf.estimate_flops)
    host = unshuffled[1]
    seqlens = host.prompt_mask_BP.sum(1) + host.response_mask_BT.sum(1)
    record["perf/actor_flops"] = run.actor.ppo_epochs * perf.estimate_flops(
        progs.model_config, seqlens
    )
    return state, record


def _mini_batch_metrics(update) -> dict:
    """An optimizer step's metrics (host values): the padded step's own, or a packed step's
    micro-batch metrics combined as verl (actor.combine_micro_metrics) and its own."""
    if isinstance(update, dict):
        return update
    micro_metrics, own = update
    stacked = {k: np.stack([m[k] for m in micro_metrics]) for k in micro_metrics[0]}
    return actor.combine_micro_metrics(stacked) | own


def train_stage(
    ctx: programs.StepContext,
    state: actor.TrainState,
    ref_params,
    rollout_batch: batch_lib.RolloutBatch,
    lr,
    *,
    kl_coef: float | None = None,
) -> tuple[actor.TrainState, dict]:
    """Stages 3-5 on a sampled batch: old and reference log-probs under `state` (the policy
    being updated, whatever policy sampled the batch), advantages, the update; returns the new
    state and the step's metrics."""
    run, timing = ctx.run, dict(rollout_batch.timing)
    rollout, host = rollout_batch.rollout, rollout_batch.host
    # Padded passes take the prompt columns of the longest prompt's bucket (less to compute);
    # packed ones read the real tokens whatever the width, so they keep the rollout's (one width
    # a run under data.prompt_padding="dataset": no new program when a batch's prompts differ).
    if run.actor.use_dynamic_bsz and run.log_prob_use_dynamic_bsz:
        width, bucket = rollout.prompt_ids.shape[1], 1
    else:
        width, bucket = int(host.prompt_mask_BP.sum(1).max()), run.data.prompt_length_bucket
    batch = train_batch(rollout, prompt_width=width, bucket=bucket)
    batch, old_metrics = log_probs(
        ctx.programs,
        run,
        state,
        ref_params,
        batch,
        host,
        ctx.mesh,
        timing,
        rollout_log_probs_BT=rollout.log_probs,
        base_params=ctx.base_params,
    )
    batch, adv_metrics = advantages(
        ctx.programs,
        run,
        batch,
        rollout,
        rollout_batch.result.scores_B,
        ctx.mesh,
        timing,
        kl_coef=kl_coef,
        extras=rollout_batch.extras,
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
    record |= adv_metrics
    record |= metrics.data_metrics(
        rollout_batch.result,
        host.response_mask_BT,
        host.prompt_mask_BP,
        max_response_length=run.data.max_response_length,
        max_prompt_length=run.data.max_prompt_length,
        num_turns_B=None if rollout.num_turns is None else distributed.to_host(rollout.num_turns),
    )
    record |= rollout_batch.filter_metrics
    if rollout_batch.row_stats:
        record |= multi_turn.metrics(rollout_batch.row_stats)
    prompt_B, response_B = host.prompt_mask_BP.sum(1), host.response_mask_BT.sum(1)
    record |= perf.timing_per_token(
        timing, prompt_tokens=int(prompt_B.sum()), response_tokens=int(response_B.sum())
    )
    record |= perf.global_seqlen(prompt_B + response_B, ctx.programs.dp)
    if run.trainer.balance_batch:  # the update's parts again (26 ms at 5,120 rows)
        parts = balance.rank_parts(prompt_B + response_B, ctx.programs.dp)
        record |= balance.balanced_seqlen(prompt_B + response_B, parts)
    record |= perf.memory()
    record |= perf.mfu(
        record.pop("perf/actor_flops"),
        timing["timing_s/update_actor"],
        devices=jax.device_count(),
        peak_flops=perf.peak_flops_per_device(run.trainer.device_peak_tflops),
    )
    return state, record | timing
