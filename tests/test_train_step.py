"""train_step invariants: exact micro-batch accumulation, REINFORCE gradient, skipped updates.

Also the update stage (train_stage.update, padded and packed micro-batches) on a rollout-shaped
batch: clip_cov's random draws come from trainer.seed and the optimizer step.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import optax
import pytest

from grpo_jax import config, loss, model, sampler, sharding
from grpo_jax.trainer import actor, balance, programs, setup, train_stage
from grpo_jax.trainer import batch as batch_lib

CFG = model.ModelConfig.tiny()
# Gradients of the same loss computed in another order (micro-batches, a jax.grad of the
# formula, a sharded step), in ulps of each tensor's scale (tests/numerics.py).
GRAD_ULPS = 512


def _batch(rng=0, *, B=8, Tp=3, T=5):
    """A batch with ragged response masks (lengths 1..5) and distinct advantages per row."""
    r = np.random.default_rng(rng)
    prompt_BP = r.integers(1, CFG.vocab_size, (B, Tp)).astype(np.int32)
    prompt_mask_BP = np.ones((B, Tp), np.int32)
    prompt_mask_BP[::2, 0] = 0  # some left padding
    resp_BT = r.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    lengths_B = 1 + np.arange(B) % T
    mask_BT = (np.arange(T)[None] < lengths_B[:, None]).astype(np.int32)
    adv_B = np.linspace(-1.0, 1.5, B).astype(np.float32)
    return actor.TrainBatch(
        input_ids_BS=jnp.asarray(np.concatenate([prompt_BP, resp_BT], 1)),
        attention_mask_BS=jnp.asarray(np.concatenate([prompt_mask_BP, mask_BT], 1)),
        response_ids_BT=jnp.asarray(resp_BT),
        response_mask_BT=jnp.asarray(mask_BT),
        advantages_BT=jnp.asarray(adv_B[:, None] * mask_BT),
    )


def _step(
    state, batch, *, micro, mini=8, index=0, lr=1e-2, loss_config=None, tx=None, rng=None
):
    return _jit_step(
        state,
        batch,
        jnp.int32(index),
        jnp.float32(lr),
        rng,
        loss_config=loss_config or actor.LossConfig(calculate_entropy=True),
        tx=tx or _ADAM,
        mini_batch_size=mini,
        micro_batch_size=micro,
    )


_ADAM = actor.make_optimizer(grad_clip=1e9, betas=(0.9, 0.999), weight_decay=0.0)


@functools.partial(
    jax.jit, static_argnames=("loss_config", "tx", "mini_batch_size", "micro_batch_size")
)
def _jit_step(
    state, batch, index, lr, rng, *, loss_config, tx, mini_batch_size, micro_batch_size
):
    return actor.train_step(
        state,
        batch,
        index,
        lr,
        rng=rng,
        model_config=CFG,
        loss_config=loss_config,
        tx=tx,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
    )


_SGD = optax.identity()


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.key(0))


# The SGD learning rate that recovers gradients: p1 = p0 - lr g rounds at an ulp of p1, so
# (p0 - p1) / lr carries an error of eps |p0| / lr; with lr = 2^10 that is far below an ulp of g
# even where |g| << |p0| (the norms' scales are 1, their gradients ~1e-3), and the division by a
# power of two is exact.
SGD_LR = 2.0**10


def _grads_via_sgd(params, batch, **kw):
    """Gradient recovered from one SGD step (no clip, no Adam): g = (p0 - p1) / SGD_LR."""
    tx = _SGD
    state = actor.init_state(params, tx)
    new, metrics = _step(state, batch, lr=SGD_LR, tx=tx, **kw)
    return _recovered(params, new.params), metrics


def _recovered(p0, p1):
    return jax.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / SGD_LR, p0, p1)


def test_micro_batches_give_the_exact_mini_batch_token_mean(params):
    # token-mean over the mini-batch: sum of all masked token losses / all valid tokens. With
    # per-micro-batch normalisation (legacy verl) 4 micro-batches of unequal token counts would
    # give a different gradient; with global counts the sum over micro-batches is exact.
    batch = _batch()
    g1, m1 = _grads_via_sgd(params, batch, micro=8)
    g4, m4 = _grads_via_sgd(params, batch, micro=2)
    numerics.assert_trees_close(g4, g1, ulps=GRAD_ULPS, err_msg="grad")
    # The loss's terms are A * ratio with |A| <= 1.5 (pg) and entropies of ~log(V) = 4.9: their
    # sums over 24 tokens in another order differ by a few ulps of that scale.
    numerics.assert_close(m4["actor/pg_loss"], m1["actor/pg_loss"], ulps=64, scale=1.5)
    numerics.assert_close(m4["actor/entropy"], m1["actor/entropy"], ulps=64, scale=5.0)


def test_on_policy_gradient_is_reinforce(params):
    # ratio = 1, beta = 0, token-mean: L = -sum_bt m A logp / sum m, so the gradient is the
    # REINFORCE one; compare with jax.grad of that formula written directly from the logits.
    batch = _batch(1)
    g, metrics = _grads_via_sgd(params, batch, micro=4)

    def reinforce(p):
        logits_BSV = model.forward(CFG, p, batch.input_ids_BS, batch.attention_mask_BS)
        logits_BTV = logits_BSV[:, 2:-1]  # Tp=3: column 2 predicts response token 0
        lp_BT = jnp.take_along_axis(
            jax.nn.log_softmax(logits_BTV), batch.response_ids_BT[..., None], -1
        )[..., 0]
        m_BT = batch.response_mask_BT
        return -jnp.sum(m_BT * batch.advantages_BT * lp_BT) / jnp.sum(m_BT)

    expected = jax.grad(reinforce)(params)
    numerics.assert_trees_close(g, expected, ulps=GRAD_ULPS, err_msg="grad")
    assert float(metrics["actor/pg_clipfrac"]) == 0.0  # ratio exactly 1


def test_off_policy_old_log_probs_equal_to_current_match_on_policy(params):
    batch = _batch(2)
    lp_BT, _ = actor.compute_log_probs(
        CFG,
        params,
        batch,
        micro_batch_size=4,
        temperature=1.0,
        chunk_size=16,
        calculate_entropy=False,
    )
    off = batch.replace(old_log_probs_BT=lp_BT)
    g_on, _ = _grads_via_sgd(params, batch, micro=8)
    g_off, m_off = _grads_via_sgd(params, off, micro=8)
    numerics.assert_trees_close(g_off, g_on, ulps=GRAD_ULPS, err_msg="grad")
    assert abs(float(m_off["actor/ppo_kl"])) < 1e-6


def test_mini_batch_index_selects_rows(params):
    # Mini-batch 1 of size 4 of the batch == mini-batch 0 of the batch's second half.
    batch = _batch(3)
    half = jax.tree.map(lambda x: x[4:], batch)
    g_a, _ = _grads_via_sgd(params, batch, micro=4, mini=4, index=1)
    g_b, _ = _grads_via_sgd(params, half, micro=4, mini=4, index=0)
    for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
        np.testing.assert_array_equal(a, b)


def test_non_finite_update_is_skipped(params):
    batch = _batch(4)
    bad = batch.replace(advantages_BT=batch.advantages_BT.at[0, 0].set(jnp.nan))
    tx = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.01)
    state = actor.init_state(params, tx)
    new, metrics = _step(state, bad, micro=8, tx=tx)
    assert float(metrics["actor/update_skipped"]) == 1.0
    assert not np.isfinite(float(metrics["actor/grad_norm"]))
    assert int(new.step) == 1
    for a, b in zip(
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((new.params, new.opt_state)),
    ):
        np.testing.assert_array_equal(a, b)
    _, ok = _step(state, batch, micro=8, tx=tx)
    assert float(ok["actor/update_skipped"]) == 0.0


def test_adamw_first_step_by_hand():
    # Adam's first step is m_hat / sqrt(v_hat) = g / |g| = sign(g) (eps 1e-8 negligible), then
    # decoupled decay: p1 = p0 - lr * (sign(g) + wd * p0) = 2 - 0.1 * (1 + 0.01 * 2) = 1.898.
    tx = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.01)
    state = actor.init_state({"w": jnp.float32(2.0)}, tx)
    new, m = actor.apply_gradients(state, {"w": jnp.float32(0.5)}, jnp.float32(0.0), 0.1, tx)
    np.testing.assert_allclose(float(new.params["w"]), 1.898, rtol=1e-6)
    np.testing.assert_allclose(float(m["actor/grad_norm"]), 0.5)
    # Clipping: g = 4 with clip 1 -> clipped to 1, the first Adam step is still sign(g).
    new, m = actor.apply_gradients(state, {"w": jnp.float32(-4.0)}, jnp.float32(0.0), 0.1, tx)
    np.testing.assert_allclose(float(new.params["w"]), 2 - 0.1 * (-1 + 0.02), rtol=1e-6)
    np.testing.assert_allclose(float(m["actor/grad_norm"]), 4.0)


def test_lr_schedule_values():
    s = actor.lr_schedule(lr=1.0, warmup_steps=4, total_steps=12, kind="cosine")
    # warm-up: 0, 0.25, 0.5, 0.75; then cosine over 8 steps: step 8 is halfway -> 0.5.
    np.testing.assert_allclose(
        [float(s(i)) for i in (0, 2, 4, 8, 12)], [0, 0.5, 1, 0.5, 0], atol=1e-6
    )
    c = actor.lr_schedule(lr=1e-6, warmup_steps=0, total_steps=5, kind="constant")
    assert float(c(3)) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match=r"constant.*cosine.*'linear'"):
        actor.lr_schedule(lr=1.0, warmup_steps=0, total_steps=1, kind="linear")


@pytest.mark.parametrize(
    "epochs, total_training_steps, want_steps, want_total",
    [
        # 23 prompts, 5 a batch: 4 full batches an epoch (the last 3 prompts dropped).
        (2, None, 8, 8),  # epochs x batches per epoch
        (2, 3, 3, 3),  # total_training_steps below the epochs' 8 steps: it ends the run
        (2, 8, 8, 8),
        # Above them the epochs end the run (verl's loop also stops when its epoch count,
        # (global_steps - 1) // steps_per_epoch, reaches total_epochs), but 100 stays the
        # learning-rate schedule's horizon and the step verl counts as the last.
        (2, 100, 8, 100),
    ],
)
def test_run_length_is_verls(epochs, total_training_steps, want_steps, want_total):
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=5),
        actor=config.ActorConfig(ppo_mini_batch_size=5),
        trainer=config.TrainerConfig(
            total_epochs=epochs, total_training_steps=total_training_steps
        ),
    )
    assert setup.total_steps(run, 23) == want_steps
    assert setup.total_training_steps(run, 23) == want_total


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(loss_agg_mode="mean"), r"loss_agg_mode='mean' must be one of .*token-mean"),
        (dict(kl_loss_type="k4"), r"kl_loss_type='k4' must be one of .*low_var_kl"),
        (dict(kl_loss_type="full"), r"kl_loss_type='full': 'full' needs full reference logits"),
        (dict(policy_loss_mode="ppo"), r"policy_loss.loss_mode='ppo' must be one of .*vanilla"),
        (dict(clip_ratio_c=1.0), r"clip_ratio_c=1.0 must be > 1"),
        (dict(temperature=0.0), r"temperature=0.0 must be > 0"),
    ],
)
def test_loss_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        actor.LossConfig(**kw)


def test_sharded_step_matches_single_device(params):
    # The same step on a (data 2, fsdp 2, tensor 2) mesh, params sharded by the logical rules
    # and the batch split over data x fsdp, gives the single-device gradient (compared through
    # one SGD step: Adam's first step is ~sign(g), which would amplify float reduction-order
    # noise in near-zero gradient entries).
    from grpo_jax import sharding

    mesh = sharding.make_mesh((2, 2, 2))
    batch = _batch(5)
    state = actor.init_state(params, _SGD)
    want, want_m = _step(state, batch, micro=4, lr=SGD_LR, tx=_SGD)
    p_sh = sharding.param_shardings(CFG, mesh)
    sharded_state = state.replace(params=jax.device_put(params, p_sh))
    sharded_batch = jax.tree.map(
        lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch
    )
    got, got_m = _step(sharded_state, sharded_batch, micro=4, lr=SGD_LR, tx=_SGD)
    assert got.params["embed"]["embedding"].sharding.spec != jax.sharding.PartitionSpec()
    numerics.assert_trees_close(_recovered(params, got.params), _recovered(params, want.params),
                                ulps=GRAD_ULPS, err_msg="grad")  # fmt: skip
    numerics.assert_close(got_m["actor/pg_loss"], want_m["actor/pg_loss"], ulps=64, scale=1.5)


# ------------------------------------------------------------------------------------------
# clip_cov's random pick (verl: torch.randperm over the candidates) inside the update.

# Every valid token is a candidate (the window is wide and the ratio is 1, so nothing is
# clipped); 30 % of each micro-batch's tokens are detached: 3 of 10 and 3 of 11 for _batch().
_CLIP_COV = {"clip_cov_lb": -10.0, "clip_cov_ratio": 0.3, "clip_cov_ub": 10.0}
_CLIP_COV_LOSS = actor.LossConfig(
    policy_loss_mode="clip_cov", policy_loss_kwargs=tuple(sorted(_CLIP_COV.items()))
)


def test_clip_cov_update_detaches_the_tokens_its_key_draws(params):
    # Two micro-batches of 4 rows: micro-batch m draws with fold_in(rng, m), and the gradient is
    # that of clip_cov's loss with those keys, normalised by the mini-batch's 21 tokens.
    batch = _batch(6)
    state = actor.init_state(params, _SGD)
    with pytest.raises(ValueError, match="needs rng"):
        _step(state, batch, micro=4, loss_config=_CLIP_COV_LOSS, tx=_SGD)

    def reference(p, key):
        total = 0.0
        for m in range(2):
            micro = jax.tree.map(lambda x, m=m: x[4 * m : 4 * m + 4], batch)
            lp_BT, _ = actor.response_log_probs(
                CFG, p, micro.input_ids_BS, micro.attention_mask_BS, micro.response_ids_BT,
                temperature=1.0, chunk_size=1024, calculate_entropy=False,
            )  # fmt: skip
            total += loss.compute_policy_loss(
                jax.lax.stop_gradient(lp_BT), lp_BT, micro.advantages_BT,
                micro.response_mask_BT, policy_loss_mode="clip_cov",
                batch_num_tokens=jnp.sum(batch.response_mask_BT), global_batch_size=8,
                rng=jax.random.fold_in(key, m), **_CLIP_COV,
            )[0]  # fmt: skip
        return total

    key = jax.random.key(11)
    g, metrics = _grads_via_sgd(params, batch, micro=4, loss_config=_CLIP_COV_LOSS, rng=key)
    numerics.assert_trees_close(g, jax.grad(reference)(params, key), ulps=GRAD_ULPS)
    # 3 of micro-batch 0's 10 tokens and 3 of micro-batch 1's 11 are detached; verl averages
    # the micro-batches' fractions with equal weights (not 6 / 21)
    np.testing.assert_allclose(float(metrics["actor/pg_clipfrac"]), (3 / 10 + 3 / 11) / 2,
                               rtol=1e-6)  # fmt: skip
    # Another key detaches other tokens: the check has teeth.
    other = jax.grad(reference)(params, jax.random.key(12))
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), g, other)
    assert max(jax.tree.leaves(moved)) > 1e-4


TP, TR = 4, 40  # prompt and response widths of the update-stage batches


def _stage_batch(seed=0, *, groups=2, n=4):
    """(TrainBatch, HostRollout) of `groups` x n rows: a left-padded prompt per group, responses
    of 30..40 tokens (a group needs two packed rows of 128), one advantage per row."""
    r = np.random.default_rng(seed)
    rows = groups * n
    p_len = np.repeat(r.integers(1, TP + 1, groups), n)
    prompt = np.repeat(r.integers(1, CFG.vocab_size, (groups, TP)), n, 0).astype(np.int32)
    prompt_mask = (np.arange(TP)[None] >= TP - p_len[:, None]).astype(np.int32)
    prompt[prompt_mask == 0] = 0
    r_len = r.integers(30, TR + 1, rows)
    resp = r.integers(1, CFG.vocab_size, (rows, TR)).astype(np.int32)
    resp_mask = (np.arange(TR)[None] < r_len[:, None]).astype(np.int32)
    resp[resp_mask == 0] = 0
    adv = r.normal(size=(rows, 1)).astype(np.float32) * resp_mask
    batch = actor.TrainBatch(
        input_ids_BS=jnp.asarray(np.concatenate([prompt, resp], 1)),
        attention_mask_BS=jnp.asarray(np.concatenate([prompt_mask, resp_mask], 1)),
        response_ids_BT=jnp.asarray(resp),
        response_mask_BT=jnp.asarray(resp_mask),
        advantages_BT=jnp.asarray(adv),
    )
    return batch, batch_lib.HostRollout(prompt, prompt_mask, resp, resp_mask)


def _stage_run(*, dynamic_bsz, seed=0, loss_mode="vanilla", mini_batch_size=1, shuffle=False,
               balance_batch=False, loss_agg_mode="token-mean", loss_scale_factor=None,
               **sections):  # fmt: skip
    """Two prompts x 4, `mini_batch_size` prompts a mini-batch, micro-batches of 2 rows or 128
    tokens."""
    return config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=TP, max_response_length=TR),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=8),
        actor=config.ActorConfig(
            ppo_mini_batch_size=mini_batch_size, ppo_micro_batch_size_per_gpu=2,
            use_dynamic_bsz=dynamic_bsz, shuffle=shuffle, loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            ppo_max_token_len_per_gpu=128, optim=config.OptimConfig(lr=1e-3),
            policy_loss=config.PolicyLossConfig(loss_mode=loss_mode, **_CLIP_COV),
        ),
        trainer=config.TrainerConfig(seed=seed, balance_batch=balance_batch),
        **sections,
    )  # fmt: skip


_STAGE_TX = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.01)


_MESH = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _placed(tree):
    """`tree` on _MESH, as the loop places the state and the batch (setup.init_state): an update
    of uncommitted arrays compiles its first step for them and its next step again for the
    placed state that step returns, one whole program more per update."""
    return jax.device_put(tree, sharding.replicated(_MESH))


def _fresh_state(params, tx=_STAGE_TX):
    """A new TrainState of a copy of `params` (the update donates it), placed on _MESH."""
    return _placed(actor.init_state(jax.tree.map(jnp.copy, params), tx))


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_update_stage_draws_clip_cov_from_the_seed_and_the_step(params, dynamic_bsz):
    # The trainer's update (train_stage.update) hands every optimizer step the key
    # actor.update_key(trainer.seed, state.step), micro-batch m of it fold_in(that, m): a resumed
    # run (state.step restored) draws the same tokens. Here the state resumes at step 3.
    run = _stage_run(dynamic_bsz=dynamic_bsz, seed=5, loss_mode="clip_cov")
    progs = programs.make_programs(run, CFG, _STAGE_TX, dp=1)
    name = "packed_grads" if dynamic_bsz else "update"
    real, seen = getattr(progs, name), []

    def spy(*args, rng, **kwargs):
        seen.append(rng)
        return real(*args, rng=rng, **kwargs)

    progs = dataclasses.replace(progs, **{name: spy})
    progs.precompiled.add("packed_grads")  # the spy has no .lower; shapes compile on first use
    batch, host = _stage_batch(1)
    state = actor.init_state(jax.tree.map(jnp.copy, params), _STAGE_TX)  # the update donates it
    state = _placed(state.replace(step=jnp.int32(3)))
    with sharding.use_mesh(_MESH):
        new, record = train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)
    assert int(new.step) == 5 and record["actor/update_skipped"] == 0
    want = []
    for i, step in enumerate((3, 4)):
        key = actor.update_key(5, step)
        if not dynamic_bsz:
            want.append(key)
            continue
        packed = host.rows(4 * i, 4 * i + 4).pack(
            progs.update_tokens, row_multiple=1, row_len=progs.row_len
        )
        assert packed.num_micro == 2  # micro-batch 1 draws with fold_in(key, 1)
        want += [jax.random.fold_in(key, m) for m in range(packed.num_micro)]
    assert len(seen) == len(want)
    for got, expected in zip(seen, want):
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(expected))


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _max_moved(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params))
    )


def _assert_is_the_update_of_the_reordered_batch(update, batch, host, order):
    """update(True, ...) equals update(False, ...) of the batch taken in `order`, metrics too,
    and differs from update(False, ...) of the batch as it is."""
    changed, record = update(True, batch, host)
    index = jnp.asarray(order)
    reordered, want = update(False, jax.tree.map(lambda x: x[index], batch), host.take(order))
    plain, _ = update(False, batch, host)
    _assert_same_params(changed, reordered)
    assert record == want
    assert _max_moved(changed, plain) > 0


def test_mini_batch_order_shuffles_within_data_parallel_blocks():
    # verl 0.9.1 (engine_workers.train_mini_batch, tensordict_utils.make_iterator): each dp rank
    # shuffles its own rows with a generator seeded data_loader_seed + rank, a new permutation
    # per ppo epoch and the same ones every step; mini-batch k takes each rank's k-th slice.
    order = train_stage.mini_batch_order(16, mini_rows=8, dp=2, epoch=0, seed=42)
    assert sorted(order.tolist()) == list(range(16))
    for k in range(2):  # 4 rows of each block in each mini-batch
        mini = order[8 * k : 8 * k + 8]
        assert sorted(mini // 8) == [0] * 4 + [1] * 4
    again = train_stage.mini_batch_order(16, mini_rows=8, dp=2, epoch=0, seed=42)
    np.testing.assert_array_equal(order, again)  # the same every step
    later = train_stage.mini_batch_order(16, mini_rows=8, dp=2, epoch=1, seed=42)
    assert sorted(later.tolist()) == list(range(16)) and later.tolist() != order.tolist()
    other = train_stage.mini_batch_order(16, mini_rows=8, dp=2, epoch=0, seed=7)
    assert other.tolist() != order.tolist()
    with pytest.raises(ValueError, match=r"actor.shuffle=True .* 3 data-parallel blocks"):
        train_stage.mini_batch_order(16, mini_rows=8, dp=3, epoch=0, seed=42)


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_actor_shuffle_is_the_update_of_the_reordered_batch(params, dynamic_bsz):
    # actor.shuffle only changes which rows form each mini-batch: the shuffled update equals
    # the unshuffled one of the batch taken in mini_batch_order, and (two mini-batches here)
    # differs from the unshuffled update of the batch as it is.
    batch, host = _stage_batch(1)
    order = train_stage.mini_batch_order(8, mini_rows=4, dp=1, epoch=0, seed=42)

    def update(shuffle, batch, host):
        run = _stage_run(dynamic_bsz=dynamic_bsz, shuffle=shuffle)
        progs = programs.make_programs(run, CFG, _STAGE_TX, dp=1)
        state = _fresh_state(params)
        with sharding.use_mesh(_MESH):
            return train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)

    _assert_is_the_update_of_the_reordered_batch(update, batch, host, order)


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_sum_norm_without_a_scale_factor_divides_by_the_response_budget(params, dynamic_bsz):
    # Deliberate difference (docs/verl.md): seq-mean-token-sum-norm without
    # actor.loss_scale_factor divides by the batch's response width, data.max_response_length
    # (the rollout pads to it), in every micro-batch and packed or not; verl 0.9.1's engine
    # divides by each micro-batch's padded width, its longest response. Here micro-batches of
    # 2 rows whose longest responses are shorter than TR.
    batch, host = _stage_batch(3)
    assert host.response_mask_BT.shape[1] == TR
    longest = [host.response_mask_BT[i : i + 2].sum(1).max() for i in range(0, 8, 2)]
    assert max(longest) < TR

    def update(factor):
        run = _stage_run(dynamic_bsz=dynamic_bsz, loss_agg_mode="seq-mean-token-sum-norm",
                         loss_scale_factor=factor)  # fmt: skip
        progs = programs.make_programs(run, CFG, _STAGE_TX, dp=1)
        state = _fresh_state(params)
        with sharding.use_mesh(_MESH):
            return train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)[0]

    default, budget = update(None), update(float(TR))
    _assert_same_params(default, budget)
    other = update(float(max(longest)))
    assert _max_moved(default, other) > 0


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_balance_batch_is_the_update_of_verls_mini_batches(params, dynamic_bsz):
    # trainer.balance_batch on 2 data devices: the update equals the plain one of the batch
    # taken in verl's order (each rank's balanced part, mini-batch k its k-th slice), and moves
    # rows between the mini-batches, so it differs from the plain update of the batch.
    batch, host = _stage_batch(2)
    parts = balance.rank_parts(host.seq_lengths_B(), 2)
    order = train_stage.mini_batch_order(
        8, mini_rows=4, dp=2, epoch=0, seed=42, parts=parts, shuffle=False
    )
    assert set(order[:4].tolist()) != {0, 1, 2, 3}
    mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])

    def update(balanced, batch, host):
        run = _stage_run(dynamic_bsz=dynamic_bsz, balance_batch=balanced)
        progs = programs.make_programs(run, CFG, _STAGE_TX, dp=2)
        state = jax.device_put(
            actor.init_state(jax.tree.map(jnp.copy, params), _STAGE_TX), sharding.replicated(mesh)
        )
        batch = jax.tree.map(
            lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch
        )
        with sharding.use_mesh(mesh):
            return train_stage.update(progs, run, state, batch, 1e-3, host, mesh)

    _assert_is_the_update_of_the_reordered_batch(update, batch, host, order)


# ------------------------------------------------------------------------------------------
# token-mean under rollout rejection sampling (algorithm.rollout_correction.rollout_rs).


def _rejected(params, *, dynamic_bsz, mini_batch_size, reject_rows=()):
    """A batch after train_stage.advantages with token_k1 rejection: the engine's log-probs are
    the recomputed ones + N(0, 0.3) (ratio bounds 0.8..1.25 reject about half the tokens), and
    exp(-5) times them on `reject_rows` (every token rejected). Returns (run, progs, batch,
    host, rollout_log_probs_BT, response mask as sampled)."""
    correction = config.RolloutCorrectionConfig(rollout_rs="token_k1",
                                                rollout_rs_threshold="0.8_1.25")  # fmt: skip
    run = _stage_run(dynamic_bsz=dynamic_bsz, mini_batch_size=mini_batch_size,
                     algorithm=config.AlgorithmConfig(rollout_correction=correction))  # fmt: skip
    progs = programs.make_programs(run, CFG, _STAGE_TX, dp=1)
    batch, host = _stage_batch(2)
    r = np.random.default_rng(3)
    old_BT, _ = actor.compute_log_probs(CFG, params, batch, micro_batch_size=8, temperature=1.0,
                                        chunk_size=1024, calculate_entropy=False)  # fmt: skip
    mask_BT = host.response_mask_BT
    rollout_BT = np.asarray(old_BT) + r.normal(0, 0.3, mask_BT.shape).astype(np.float32)
    rollout_BT[list(reject_rows)] += 5.0
    rollout_BT = (rollout_BT * mask_BT).astype(np.float32)
    rollout = sampler.Rollout(
        prompt_ids=jnp.asarray(host.prompt_ids_BP), prompt_mask=jnp.asarray(host.prompt_mask_BP),
        response_ids=batch.response_ids_BT, response_mask=batch.response_mask_BT,
        log_probs=jnp.asarray(rollout_BT), group_ids=jnp.repeat(jnp.arange(2, dtype=jnp.int32), 4),
        weights_version=jnp.int32(0),
    )  # fmt: skip
    scores_B = r.integers(0, 2, 8).astype(np.float32)
    with sharding.use_mesh(_MESH):
        batch, _ = train_stage.advantages(
            progs, run, batch.replace(old_log_probs_BT=old_BT), rollout, scores_B, _MESH, {}
        )
    kept = np.asarray(batch.response_mask_BT)
    assert 0 < kept.sum() < mask_BT.sum()
    np.testing.assert_array_equal(np.asarray(batch.loss_mask_BT), mask_BT)
    return run, progs, batch, host, rollout_BT, old_BT


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_token_mean_with_rejection_divides_by_verls_tokens_before_rejection(
    verl, params, dynamic_bsz
):
    # verl 0.9.1 (v1 trainer, engine workers): each sample is stored with loss_mask =
    # response_mask when generated (trainer/ppo/v1/agent_loop_tq.py); rejection sampling
    # (rollout_corr_helper.compute_rollout_correction_and_add_to_batch) rewrites response_mask
    # only; the engine sets batch_num_tokens = all-reduced loss_mask.sum() of the mini-batch
    # (workers/engine/fsdp/transformer_impl.py forward_backward_batch) and ppo_loss divides the
    # sum over the rewritten response_mask by it. One mini-batch of both prompts, on-policy
    # (ratio 1): verl's pg_loss is then -sum(A * kept) / (tokens as sampled). Dividing by the
    # kept tokens instead makes the loss and the gradient larger by about 2x here.
    import reference

    run, progs, batch, host, rollout_BT, old_BT = _rejected(
        params, dynamic_bsz=dynamic_bsz, mini_batch_size=2
    )
    mask_BT = host.response_mask_BT.astype(np.float32)
    call = reference.fn("verl.trainer.ppo.rollout_corr_helper:"
                        "compute_rollout_correction_and_rejection_mask")(
        np.asarray(old_BT), rollout_BT, mask_BT, rollout_rs="token_k1",
        rollout_rs_threshold="0.8_1.25",
    )  # fmt: skip
    their_mask = verl.run(reference.item(call, 1)).value
    np.testing.assert_array_equal(np.asarray(batch.response_mask_BT), their_mask)
    config_ = reference.fn("verl.workers.config:ActorConfig")(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        global_batch_info={"dp_size": 1, "batch_num_tokens": float(mask_BT.sum()),
                           "global_batch_size": 8},
    )  # fmt: skip
    lp = np.asarray(old_BT)
    theirs = verl.run(
        reference.fn("verl.trainer.ppo.core_algos:compute_policy_loss_vanilla")(
            lp, lp, np.asarray(batch.advantages_BT), their_mask, "token-mean", config_
        )
    ).value[0]
    state = _fresh_state(params)
    with sharding.use_mesh(_MESH):
        _, record = train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)
    np.testing.assert_allclose(record["actor/pg_loss"], float(theirs), rtol=1e-5, atol=1e-7)
    assert abs(float(theirs)) > 1e-3  # not trivially zero


# The test's own tree arithmetic, jitted: run eagerly, each op compiles again for every one of
# the model's tensor shapes (369 small programs, 14 s of the test).
_tree_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


@jax.jit
def _moving_adam_state(params):
    """An optimizer state whose Adam moments move the params without a gradient."""
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    state, _ = actor.apply_gradients(actor.init_state(params, _STAGE_TX), grads, 0.0, 1e-3,
                                     _STAGE_TX)  # fmt: skip
    return state


@jax.jit
def _adamw_step_on_zero_gradients(state):
    """optax's update of `state` with zero gradients at lr 1e-3: (params, opt_state)."""
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, opt_state = _STAGE_TX.update(zeros, state.opt_state, state.params)
    return jax.tree.map(lambda p, u: p - 1e-3 * u, state.params, updates), opt_state


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_a_fully_rejected_mini_batch_takes_an_adamw_step_on_zero_loss(params, dynamic_bsz):
    # Mini-batch 1 (rows 4..7) is rejected whole. verl divides its zero sum by its tokens as
    # sampled: loss 0, gradient 0, a finite norm, so torch's AdamW steps: decoupled weight decay
    # plus the Adam moments' momentum, and the step count advances. optax's update of the same
    # state with zero gradients is the expected result.
    run, progs, batch, host, _, _ = _rejected(
        params, dynamic_bsz=dynamic_bsz, mini_batch_size=1, reject_rows=range(4, 8)
    )
    assert not np.asarray(batch.response_mask_BT)[4:].any()
    state = _moving_adam_state(params)
    name = "apply" if dynamic_bsz else "update"
    real, steps = getattr(progs, name), []

    def spy(state, *args, **kwargs):
        before = _tree_copy(state)  # `state` is donated
        after, metrics = real(state, *args, **kwargs)
        steps.append((before, after, metrics, args))
        return after, metrics

    progs = dataclasses.replace(progs, **{name: spy})
    with sharding.use_mesh(_MESH):
        _, record = train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)
    assert record["actor/update_skipped"] == 0
    before, after, metrics, args = steps[1]
    if dynamic_bsz:  # apply(state, grads, loss, lr): the summed micro-batch gradients
        assert all(not np.asarray(g).any() for g in jax.tree.leaves(args[0]))
        assert float(args[1]) == 0.0
    else:
        assert float(metrics["actor/loss"]) == 0.0 and float(metrics["actor/pg_loss"]) == 0.0
    assert float(metrics["actor/grad_norm"]) == 0.0
    assert float(metrics["actor/update_skipped"]) == 0.0
    assert int(after.step) == int(before.step) + 1
    want, opt_state = _adamw_step_on_zero_gradients(before)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), want,
                         before.params)  # fmt: skip
    assert min(jax.tree.leaves(moved)) > 0  # every tensor moves
    numerics.assert_trees_close(after.params, want, ulps=4)
    numerics.assert_trees_close(after.opt_state, opt_state, ulps=4)


# ------------------------------------------------------------------------------------------
# The update's actor/* metrics, reduced over micro-batches and mini-batches as verl 0.9.1 does.


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_update_metrics_are_verls_reduction_over_micro_and_mini_batches(
    verl, params, dynamic_bsz
):
    # verl 0.9.1: ppo_loss (workers/utils/losses.py) reports pg_loss as a partial sum of the
    # mini-batch loss (Metric SUM) and pg_clipfrac / ppo_kl / pg_clipfrac_lower as masked means
    # over each micro-batch's own tokens (Metric MEAN: a plain mean over micro-batches, not
    # weighted by their tokens); the trainer then averages over mini-batches. Two mini-batches
    # of 4 sequences (30..40 tokens each), two micro-batches each (2 rows, or packed under a
    # 128-token budget), off-policy so the clip is live. The tests/verl_metrics.py helper runs
    # verl's ppo_loss on the same log-probs and reduces its Metric objects with verl's code.
    import reference

    run = _stage_run(dynamic_bsz=dynamic_bsz)
    progs = programs.make_programs(run, CFG, _STAGE_TX, dp=1)
    batch, host = _stage_batch(4)
    r = np.random.default_rng(7)
    lp0, _ = actor.compute_log_probs(CFG, params, batch, micro_batch_size=8, temperature=1.0,
                                     chunk_size=1024, calculate_entropy=False)  # fmt: skip
    old = np.asarray(lp0) + r.normal(0, 0.3, lp0.shape).astype(np.float32)
    batch = batch.replace(old_log_probs_BT=jnp.asarray(old * host.response_mask_BT))
    name = "packed_grads" if dynamic_bsz else "update"
    real, real_apply, calls = getattr(progs, name), progs.apply, []

    def spy(*args, **kwargs):
        if dynamic_bsz:  # (params, grads, micro, mini_batch, ...): this micro-batch's rows
            slot_bt = np.asarray(args[2].slot_bt_GN)
            rows = np.unique(slot_bt[slot_bt < 4 * TR] // TR)
            calls.append((jax.tree.map(jnp.copy, args[0]), rows))  # apply donates the state
        else:  # (state, batch, mini_batch_index, ...): the state is donated
            calls.append((jax.tree.map(jnp.copy, args[0].params), int(args[2])))
        return real(*args, **kwargs)

    def apply_spy(*args, **kwargs):  # the packed path's optimizer step ends a mini-batch
        calls.append(None)
        return real_apply(*args, **kwargs)

    progs = dataclasses.replace(progs, **{name: spy, "apply": apply_spy})
    progs.precompiled.add("packed_grads")  # the spy has no .lower; shapes compile on first use
    state = _fresh_state(params)
    with sharding.use_mesh(_MESH):
        _, record = train_stage.update(progs, run, state, _placed(batch), 1e-3, host, _MESH)

    def sample(p, b):
        n = int(host.response_mask_BT[b].sum())
        lp_BT, _ = actor.compute_log_probs(CFG, p, batch, micro_batch_size=8, temperature=1.0,
                                           chunk_size=1024, calculate_entropy=False)  # fmt: skip
        return {"prompt_len": int(host.prompt_mask_BP[b].sum()),
                "log_probs": np.asarray(lp_BT)[b, :n].tolist(),
                "old_log_probs": old[b, :n].tolist(),
                "advantages": np.asarray(batch.advantages_BT)[b, :n].tolist(),
                "response_mask": [1.0] * n}  # fmt: skip

    minis = [[], []]
    if dynamic_bsz:  # packed micro-batches, then the mini-batch's optimizer step
        i = 0
        for call in calls:
            if call is None:
                i += 1
                continue
            p, rows = call
            minis[i].append([sample(p, 4 * i + b) for b in rows])
        assert i == 2
    else:
        for p, i in calls:
            minis[i] += [[sample(p, 4 * i + 2 * m + b) for b in range(2)] for m in range(2)]
    assert all(len(m) >= 2 for m in minis)
    theirs = verl.run(reference.fn("verl_metrics:actor_update_metrics")(
        minis, actor_kwargs={"loss_agg_mode": "token-mean"})).value  # fmt: skip
    assert set(theirs) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                           "actor/pg_clipfrac_lower"}  # fmt: skip
    assert theirs["actor/pg_clipfrac"] > 0  # the clip is live
    for k, v in theirs.items():
        np.testing.assert_allclose(record[k], v, rtol=2e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("settings", [
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1", "rollout_is": "token",
     "rollout_is_threshold": 2.0},
], ids=["token_k1", "seq_mean_k1+is"])  # fmt: skip
def test_token_mean_under_rejection_is_verls_on_generated_batches(verl, seed, settings):
    # Generated batches of 8 responses (1..10 tokens, some rejected whole), two mini-batches of
    # two micro-batches: verl's rejection mask and IS weights (rollout_corr_helper), then verl's
    # ppo_loss with batch_num_tokens = the mini-batch's loss_mask (as sampled) sum, reduced as
    # the engine does (tests/verl_metrics.py), against the actor loss with
    # actor.batch_num_tokens of a TrainBatch carrying loss_mask_BT.
    import reference

    from grpo_jax import rollout_correction

    r = np.random.default_rng(seed)
    B, T = 8, 10
    lengths = r.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    lp = (r.normal(-1.5, 0.5, (B, T)) * mask).astype(np.float32)
    old = (lp + r.normal(0, 0.2, (B, T)) * mask).astype(np.float32)
    rollout = (old + r.normal(0, 0.2, (B, T)) * mask).astype(np.float32)
    adv = (r.choice([-1.0, 0.0, 1.0], (B, 1)) * mask).astype(np.float32)
    call = reference.fn("verl.trainer.ppo.rollout_corr_helper:"
                        "compute_rollout_correction_and_rejection_mask")(
        old, rollout, mask, **settings)  # fmt: skip
    their_w = None
    if "rollout_is" in settings:
        their_w = reference.item(reference.attr(reference.item(call, 0), "batch"),
                                 "rollout_is_weights")  # fmt: skip
    their_w, kept = verl.run((their_w, reference.item(call, 1))).value
    weights, ours_kept, _ = rollout_correction.compute_rollout_correction(
        jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask), **settings
    )
    np.testing.assert_array_equal(np.asarray(ours_kept), kept)
    assert 0 < kept.sum() < mask.sum()  # rejection is live
    batch = actor.TrainBatch(
        input_ids_BS=None, attention_mask_BS=None, response_ids_BT=None,
        response_mask_BT=jnp.asarray(kept), advantages_BT=jnp.asarray(adv),
        old_log_probs_BT=jnp.asarray(old), rollout_is_weights_BT=weights,
        loss_mask_BT=jnp.asarray(mask),
    )  # fmt: skip
    pg_losses, minis = [], []
    for i in range(2):
        mini = jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], batch)
        total, micros = 0.0, []
        for m in range(2):
            rows = slice(2 * m, 2 * m + 2)
            micro = jax.tree.map(lambda x, rows=rows: x[rows], mini)
            total += float(loss.actor_loss(
                micro.old_log_probs_BT, jnp.asarray(lp[4 * i:][rows]), micro.advantages_BT,
                micro.response_mask_BT, rollout_is_weights=micro.rollout_is_weights_BT,
                batch_num_tokens=actor.batch_num_tokens(mini), global_batch_size=4,
            )[0])  # fmt: skip
            micros.append([{
                "prompt_len": 1, "log_probs": lp[b, :n].tolist(),
                "old_log_probs": old[b, :n].tolist(), "advantages": adv[b, :n].tolist(),
                "response_mask": kept[b, :n].tolist(), "loss_mask": mask[b, :n].tolist(),
                **({} if their_w is None else {"rollout_is_weights": their_w[b, :n].tolist()}),
            } for b in range(4 * i + 2 * m, 4 * i + 2 * m + 2) for n in [lengths[b]]])  # fmt: skip
        pg_losses.append(total)
        minis.append(micros)
    theirs = verl.run(reference.fn("verl_metrics:actor_update_metrics")(
        minis, actor_kwargs={"loss_agg_mode": "token-mean"})).value  # fmt: skip
    np.testing.assert_allclose(np.mean(pg_losses), theirs["actor/pg_loss"], rtol=1e-5,
                               atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("dynamic_bsz", [False, True])
def test_update_stage_is_the_same_with_every_cpu_attention_impl(params, dynamic_bsz):
    # model.attention_impl changes how attention runs, not what the update computes: one
    # update stage (two mini-batches, padded micro-batches or packed rows with shared prompts)
    # with the blockwise kernel and with splash (Pallas interpret mode) gives the gradients and
    # the metrics of the dense XLA one. SGD at SGD_LR recovers each step's gradient.
    batch, host = _stage_batch(2)

    def update(impl):
        run = _stage_run(dynamic_bsz=dynamic_bsz, mini_batch_size=1)
        cfg = dataclasses.replace(CFG, attention_impl=impl)
        progs = programs.make_programs(run, cfg, _SGD, dp=1)
        state = _fresh_state(params, _SGD)
        with sharding.use_mesh(_MESH):
            return train_stage.update(progs, run, state, _placed(batch), SGD_LR, host, _MESH)

    want, want_record = update("xla")
    want_g = _recovered(params, want.params)
    assert _max_moved(want, actor.init_state(params, _SGD)) > 0
    for impl in ("blockwise", "splash"):
        got, record = update(impl)
        numerics.assert_trees_close(_recovered(params, got.params), want_g, ulps=GRAD_ULPS,
                                    err_msg=impl)  # fmt: skip
        assert record.keys() == want_record.keys()
        for key, value in want_record.items():
            numerics.assert_close(record[key], value, ulps=GRAD_ULPS,
                                  scale=max(abs(value), 1.0), err_msg=f"{impl} {key}")  # fmt: skip
