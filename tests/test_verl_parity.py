"""Parity of grpo_jax.advantage / loss / rollout_correction with verl 0.9.1 itself.

verl runs in its own venv (scripts/build_verl_venv.sh, with verl's pins), in the session's
reference worker (tests/reference.py); its functions get the same NumPy inputs as ours, and their
values, gradients (torch autograd) and metrics come back for comparison here. Without that venv
the module is skipped, except under CI=true, where every test fails. Inputs are finite and avoid
exact clip-bound ties, where torch and JAX may legitimately split a gradient differently. Values
and gradients with respect to log_prob (and logits) must agree to float32 rounding. Random
inputs come from fixed seeds (uneven, shuffled, non-contiguous groups with singletons and fully
masked rows); small guard tests check that they reach every branch being compared. clip_cov,
which verl samples with torch.randperm, is compared where the choice cannot differ (the budget
covers every candidate) and given verl's own draw (replayed from the same torch seed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from grpo_jax import advantage, loss, rollout_correction

CORE = "verl.trainer.ppo.core_algos:"
B, T = 12, 9
# XLA against torch on inputs of scale O(1) (log-probs -1 +- 0.5, advantages N(0, 1)): the sums
# run over at most B*T = 108 terms in another order, so the two differ by a few ulps of that scale;
# atol 2e-6 is 17 float32 ulps at 1.0 (tests/numerics.py's rule with the scale known to be 1), and
# rtol 2e-5 covers the elements and sums larger than 1. A wrong clip branch, mask or normaliser
# moves values by a percent of the scale or more.
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _inputs(seed):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-1.0, 0.5, (B, T)).astype(np.float32)
    # Wide spread of log-ratios so every clip branch, including the dual clip (ratio > 3), occurs.
    old = lp - rng.normal(0.0, 0.8, (B, T)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    ref = lp + rng.normal(0.0, 2.0, (B, T)).astype(np.float32)
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    mask[3] = 0.0  # one fully masked row
    weights = rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
    return lp, old, adv, ref, mask, weights


def _verl_value_and_grad(verl, expr, lp, *, key=None, cotangent=None):
    """verl's value (and aux) of `expr(log_prob)` and its gradient w.r.t. log_prob.

    `key` picks the differentiated part of a tuple value (0 for (loss, metrics))."""
    out = verl.run(expr(reference.grad(lp, "lp")), backward=[(key, cotangent)])
    if key is None:
        return out.value, out.grads["lp"], {}
    return out.value[0], out.grads["lp"], out.value[1]


def _actor_config(**kwargs):
    return reference.fn("verl.workers.config:ActorConfig")(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kwargs
    )


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_matches_verl_loop_and_vectorized(verl, norm):
    rng = np.random.default_rng(0)
    gid = np.array([3, 0, 3, 1, 0, 3, 2, 0, 3, 1, 4, 4], np.int32)  # uneven, non-contiguous
    gid[6] = 5  # group 5 is a singleton; group 2 becomes empty
    rewards = np.zeros((B, T), np.float32)
    rewards[np.arange(B), rng.integers(0, T, B)] = rng.normal(0, 1, B).astype(np.float32)
    rewards[:, -1] += 0.25  # junk in padded positions: verl sums it anyway
    mask = (rng.random((B, T)) > 0.2).astype(np.float32)
    ours, ret = advantage.compute_grpo_outcome_advantage(
        jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(gid), norm_adv_by_std_in_grpo=norm
    )
    index = reference.keep_numpy(np.array([f"uid{g}" for g in gid], dtype=object))
    loop = verl.run(
        reference.fn(CORE + "compute_grpo_outcome_advantage")(
            rewards, mask, index, norm_adv_by_std_in_grpo=norm
        )
    ).value[0]
    np.testing.assert_allclose(np.asarray(ours), loop, **TOL)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ret))
    if norm:  # the trainer path of grpo_vectorized always normalises
        vec = verl.run(
            reference.fn(CORE + "compute_grpo_vectorized_outcome_advantage")(rewards, mask, index)
        ).value[0]
        np.testing.assert_allclose(np.asarray(ours), vec, **TOL)


def test_rloo_advantage_matches_verl(verl):
    rng = np.random.default_rng(1)
    gid = np.array([0, 1, 0, 2, 1, 0, 3, 1, 1, 0, 2, 5], np.int32)  # group 3 and 5: singletons
    rewards = rng.normal(0, 1, (B, T)).astype(np.float32)
    mask = (rng.random((B, T)) > 0.2).astype(np.float32)
    ours, _ = advantage.compute_rloo_outcome_advantage(
        jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(gid)
    )
    index = reference.keep_numpy(np.array([f"uid{g}" for g in gid], dtype=object))
    ref = verl.run(reference.fn(CORE + "compute_rloo_outcome_advantage")(rewards, mask, index))
    np.testing.assert_allclose(np.asarray(ours), ref.value[0], **TOL)


@pytest.mark.parametrize("mode", loss.AGG_MODES)
@pytest.mark.parametrize(
    "global_info",
    [
        {},
        {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 30},
        {"loss_scale_factor": 64},
    ],
)
def test_agg_loss_matches_verl(verl, mode, global_info):
    _lp, _, adv, _, mask, _ = _inputs(2)
    ours, grad = jax.value_and_grad(
        lambda x: loss.agg_loss(x, jnp.asarray(mask), mode, **global_info)
    )(jnp.asarray(adv))
    ref, ref_grad, _ = _verl_value_and_grad(
        verl, lambda x: reference.fn(CORE + "agg_loss")(x, mask, mode, **global_info), adv
    )
    np.testing.assert_allclose(float(ours), float(ref), **TOL)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, **TOL)


@pytest.mark.parametrize("kl_type", [k for k in loss.KL_TYPES if not k.startswith("full")])
def test_kl_penalty_matches_verl(verl, kl_type):
    lp, _, _, ref, mask, _ = _inputs(3)
    ours, grad = jax.value_and_grad(
        lambda x: jnp.sum(loss.kl_penalty(x, jnp.asarray(ref), kl_type) * mask)
    )(jnp.asarray(lp))
    theirs, their_grad, _ = _verl_value_and_grad(
        verl,
        lambda x: reference.fn(CORE + "kl_penalty")(x, ref, kl_type),
        lp,
        cotangent=mask,
    )
    np.testing.assert_allclose(float(ours), float(np.sum(theirs * mask)), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)


# Non-default per-loss settings, as (our keywords, verl ActorConfig fields, verl PolicyLossConfig
# fields). clip_cov selects at random in verl and has its own tests below.
_MODE_SETTINGS = {
    "kl_cov": (
        {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.3},
        {},
        {"kl_cov_ratio": 0.05, "ppo_kl_coef": 0.3},
    ),
    "sapo": ({"tau_pos": 1.3, "tau_neg": 0.8}, {"tau_pos": 1.3, "tau_neg": 0.8}, {}),
    "dro": ({"dro_beta": 0.3}, {}, {"dro_beta": 0.3}),
}
_DETERMINISTIC_MODES = [m for m in loss.POLICY_LOSS_MODES if m != "clip_cov"]


def _mode_configs(mode, **actor_kwargs):
    ours, actor, policy = _MODE_SETTINGS.get(mode, ({}, {}, {}))
    config = _actor_config(
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        policy_loss=reference.fn("verl.workers.config:PolicyLossConfig")(**policy),
        **actor,
        **actor_kwargs,
    )
    return ours, config


def _ours_policy(lp, old, adv, mask, weights, **kwargs):
    """(value, metrics), grad wrt lp of compute_policy_loss with the parity clip settings."""
    return jax.value_and_grad(
        lambda x: loss.compute_policy_loss(
            jnp.asarray(old),
            x,
            jnp.asarray(adv),
            jnp.asarray(mask),
            clip_ratio_low=0.15,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            rollout_is_weights=None if weights is None else jnp.asarray(weights),
            **kwargs,
        ),
        has_aux=True,
    )(jnp.asarray(lp))


def _assert_metrics_equal(ours, theirs, tol=TOL):
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_allclose(float(ours[key]), value, err_msg=key, **tol)


@pytest.mark.parametrize("mode", _DETERMINISTIC_MODES)
@pytest.mark.parametrize("agg", loss.AGG_MODES)
def test_policy_loss_matches_verl(verl, mode, agg):
    lp, old, adv, _, mask, weights = _inputs(4)
    settings, config = _mode_configs(mode)
    (ours, metrics), grad = _ours_policy(
        lp, old, adv, mask, weights, loss_agg_mode=agg, policy_loss_mode=mode, **settings
    )
    theirs, their_grad, their_metrics = _verl_value_and_grad(
        verl,
        lambda x: reference.fn(CORE + "get_policy_loss_fn")(mode)(
            old_log_prob=old,
            log_prob=x,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode=agg,
            config=config,
            rollout_is_weights=weights,
        ),
        lp,
        key=0,
    )
    np.testing.assert_allclose(float(ours), float(theirs), **TOL)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)
    assert set(metrics) == set(their_metrics)
    for key, value in their_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, **TOL)


def test_vanilla_exercises_every_branch():
    """Guards the parity test above: its inputs must hit the clip and the dual clip."""
    lp, old, adv, _, mask, _ = _inputs(4)
    _, metrics = loss.compute_policy_loss(
        jnp.asarray(old), jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(mask)
    )
    assert 0.0 < float(metrics["actor/pg_clipfrac"]) < 1.0
    assert 0.0 < float(metrics["actor/pg_clipfrac_lower"]) < 1.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_verl(verl, temperature):
    rng = np.random.default_rng(5)
    vocab = 37
    logits = rng.normal(0, 2, (3, 5, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, (3, 5)).astype(np.int64)
    g_lp = rng.normal(0, 1, (3, 5)).astype(np.float32)
    g_ent = rng.normal(0, 1, (3, 5)).astype(np.float32)

    verl_f = "verl.utils.torch_functional:"
    scaled = reference.fn("torch:div")(reference.grad(logits, "logits"), temperature)
    theirs = verl.run(
        (
            reference.fn(verl_f + "logprobs_from_logits")(scaled, labels),
            reference.fn(verl_f + "entropy_from_logits")(scaled),
        ),
        backward=[(0, g_lp), (1, g_ent)],
    )

    def objective(z):
        lp, ent = loss.logprobs_and_entropy_chunked(
            z, jnp.asarray(labels), chunk_size=4, temperature=temperature
        )
        return jnp.sum(lp * g_lp) + jnp.sum(ent * g_ent), (lp, ent)

    (_, (lp, ent)), grad = jax.value_and_grad(objective, has_aux=True)(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(lp), theirs.value[0], **TOL)
    np.testing.assert_allclose(np.asarray(ent), theirs.value[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), theirs.grads["logits"], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# More policy losses: global-batch arguments, no IS weights, clip_cov's random selection.
# ------------------------------------------------------------------------------------------

_GLOBAL_INFO = {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 30}


@pytest.mark.parametrize("mode", _DETERMINISTIC_MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_loss_matches_verl_with_global_batch_info(verl, mode, agg, with_weights):
    lp, old, adv, _, mask, weights = _inputs(6)
    weights = weights if with_weights else None
    info = {**_GLOBAL_INFO, "loss_scale_factor": 5}
    settings, config = _mode_configs(mode, global_batch_info=info)
    (ours, metrics), grad = _ours_policy(
        lp, old, adv, mask, weights, loss_agg_mode=agg, policy_loss_mode=mode, **settings, **info
    )
    theirs, their_grad, their_metrics = _verl_value_and_grad(
        verl,
        lambda x: reference.fn(CORE + "get_policy_loss_fn")(mode)(
            old, x, adv, mask, agg, config, rollout_is_weights=weights
        ),
        lp,
        key=0,
    )
    np.testing.assert_allclose(float(ours), float(theirs), **TOL)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)
    _assert_metrics_equal(metrics, their_metrics)


def test_new_losses_exercise_their_branches():
    """Guards the parity tests: the inputs hit both sides of every mask and selection."""
    lp, old, adv, _, mask, _ = _inputs(4)
    args = [jnp.asarray(x) for x in (old, lp, adv, mask)]
    clips = {"clip_ratio_low": 0.15, "clip_ratio_high": 0.28}
    for mode in ("dppo_tv", "dppo_kl", "geo_mean"):
        _, m = loss.compute_policy_loss(*args, policy_loss_mode=mode, **clips)
        assert 0.0 < float(m["actor/pg_clipfrac"]) < 1.0, mode
        assert 0.0 < float(m["actor/pg_clipfrac_lower"]) < 1.0, mode
    # kl_cov penalises int(0.05 * N_tok) > 1 tokens: the loss moves by less than all of them.
    no_penalty = loss.compute_policy_loss(*args, policy_loss_mode="kl_cov", ppo_kl_coef=0.0)[0]
    penalty = loss.compute_policy_loss(*args, policy_loss_mode="kl_cov", kl_cov_ratio=0.05)[0]
    assert float(penalty) > float(no_penalty)


_CLIP_COV_WIDE = {"clip_cov_lb": 0.05, "clip_cov_ub": 0.8}


def _clip_cov_config(ratio, **actor_kwargs):
    policy = reference.fn("verl.workers.config:PolicyLossConfig")(
        clip_cov_ratio=ratio, **_CLIP_COV_WIDE
    )
    return _actor_config(
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        policy_loss=policy,
        **actor_kwargs,
    )


def _verl_clip_cov(verl, lp, old, adv, mask, weights, agg, config, seed):
    """verl's clip_cov after torch.manual_seed(seed): (value, grad, metrics)."""
    seeded = reference.after(
        reference.fn("torch:manual_seed")(seed),
        reference.fn(CORE + "compute_policy_loss_clip_cov")(
            old, reference.grad(lp, "lp"), adv, mask, agg, config, rollout_is_weights=weights
        ),
    )
    out = verl.run(seeded, backward=[(0, None)])
    return out.value[0], out.grads["lp"], out.value[1]


@pytest.mark.parametrize("agg", loss.AGG_MODES)
@pytest.mark.parametrize("use_rng", [False, True])
def test_clip_cov_matches_verl_when_the_budget_covers_every_candidate(verl, agg, use_rng):
    # clip_cov_ratio 1: the budget is N_tok, so every candidate is detached whoever picks.
    lp, old, adv, _, mask, weights = _inputs(7)
    config = _clip_cov_config(1.0)
    rng = jax.random.key(3) if use_rng else None
    (ours, metrics), grad = _ours_policy(
        lp,
        old,
        adv,
        mask,
        weights,
        loss_agg_mode=agg,
        policy_loss_mode="clip_cov",
        clip_cov_ratio=1.0,
        rng=rng,
        **_CLIP_COV_WIDE,
    )
    theirs, their_grad, their_metrics = _verl_clip_cov(
        verl, lp, old, adv, mask, weights, agg, config, seed=0
    )
    np.testing.assert_allclose(float(ours), float(theirs), **TOL)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)
    _assert_metrics_equal(metrics, their_metrics)
    assert 0.0 < float(metrics["actor/pg_clipfrac"]) < 0.5  # some, not all, tokens detached


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_detaches_as_many_tokens_as_verl(verl, seed):
    # Budget int(0.1 * N_tok) below the number of candidates: verl detaches perm[:budget] of
    # them, ours a random subset drawn from the key; whichever tokens, the count is the same
    # (pg_clipfrac = detached / N_tok), for every torch seed and every key.
    lp, old, adv, _, mask, weights = _inputs(10 + seed)
    kwargs = {"policy_loss_mode": "clip_cov", "clip_cov_ratio": 0.1, **_CLIP_COV_WIDE}
    _, _, their_metrics = _verl_clip_cov(
        verl, lp, old, adv, mask, weights, "token-mean", _clip_cov_config(0.1), seed
    )
    for key in range(3):
        (_, metrics), _ = _ours_policy(lp, old, adv, mask, weights, rng=jax.random.key(key),
                                       **kwargs)  # fmt: skip
        np.testing.assert_allclose(
            float(metrics["actor/pg_clipfrac"]), their_metrics["actor/pg_clipfrac"], **TOL
        )
    assert their_metrics["actor/pg_clipfrac"] * mask.sum() == pytest.approx(int(0.1 * mask.sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_verl_given_verls_random_selection(verl, seed, monkeypatch):
    # Budget int(0.1 * N_tok) below the number of candidates: verl draws them with
    # torch.randperm. Replay that draw (same seed, same candidate count), give our loss the same
    # tokens through its selection seam, and compare everything.
    lp, old, adv, _, mask, weights = _inputs(10 + seed)
    kwargs = {"policy_loss_mode": "clip_cov", "clip_cov_ratio": 0.1, **_CLIP_COV_WIDE}
    seen = {}

    def record(cov_BT, candidate_BT, budget, rng):
        seen["candidates"] = np.argwhere(np.asarray(candidate_BT))  # row-major, as torch.nonzero
        seen["budget"] = int(budget)
        return loss._top_k_mask(cov_BT, candidate_BT, budget)

    monkeypatch.setattr(loss, "_clip_cov_select", record)
    _ours_policy(lp, old, adv, mask, weights, **kwargs)
    num_candidates, budget = len(seen["candidates"]), seen["budget"]
    assert budget == int(0.1 * mask.sum()) and 1 < budget < num_candidates
    perm = verl.run(
        reference.after(
            reference.fn("torch:manual_seed")(seed), reference.fn("torch:randperm")(num_candidates)
        )
    ).value
    chosen = seen["candidates"][perm[:budget]]
    verl_selected = np.zeros(mask.shape, bool)
    verl_selected[chosen[:, 0], chosen[:, 1]] = True
    monkeypatch.setattr(loss, "_clip_cov_select", lambda *_: jnp.asarray(verl_selected))
    (ours, metrics), grad = _ours_policy(lp, old, adv, mask, weights, **kwargs)
    theirs, their_grad, their_metrics = _verl_clip_cov(
        verl, lp, old, adv, mask, weights, "token-mean", _clip_cov_config(0.1), seed
    )
    np.testing.assert_allclose(float(ours), float(theirs), **TOL)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)
    _assert_metrics_equal(metrics, their_metrics)


# ------------------------------------------------------------------------------------------
# Advantage estimators. Inputs: uneven, shuffled, non-contiguous groups (ids out of order with
# gaps), singletons, a fully masked row, masks with holes, rewards at random positions plus
# junk in padded positions (verl sums it).
# ------------------------------------------------------------------------------------------

NB = 16


def _grouped(seed, *, sizes=(4, 3, 3, 2, 1, 1, 2), binary=False, dense=False):
    rng = np.random.default_rng(seed)
    labels = np.array([2, 9, 5, 0, 11, 7, 3])[: len(sizes)]  # non-contiguous ids
    gid = rng.permutation(np.repeat(labels, sizes)).astype(np.int32)
    b = len(gid)
    if dense:
        rewards = rng.normal(0, 1, (b, T)).astype(np.float32)
    else:
        rewards = np.zeros((b, T), np.float32)
        values = rng.integers(0, 2, b) if binary else rng.normal(0, 1, b)
        rewards[np.arange(b), rng.integers(0, T, b)] = values
        rewards[:, -1] += 0.0 if binary else 0.125
    mask = (rng.random((b, T)) > 0.25).astype(np.float32)
    big = labels[int(np.argmax(sizes))]
    mask[np.flatnonzero(gid == big)[0]] = 0.0  # fully masked row inside the largest group
    index = reference.keep_numpy(np.array([f"uid{g}" for g in gid], dtype=object))
    return rewards, mask, gid, index, 12


def _algo(**kwargs):
    return reference.fn("verl.trainer.config:AlgoConfig")(**kwargs)


def _ours_adv(name, rewards, mask, gid, num_groups, **kwargs):
    adv, ret = advantage.compute_advantage(
        name,
        jnp.asarray(rewards),
        jnp.asarray(mask),
        jnp.asarray(gid),
        num_groups=num_groups,
        **kwargs,
    )
    return np.asarray(adv), np.asarray(ret)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_matches_verl(verl, seed, norm):
    rewards, mask, gid, index, ng = _grouped(seed)
    ours, ret = _ours_adv("grpo_vectorized", rewards, mask, gid, ng, norm_adv_by_std_in_grpo=norm)
    theirs = verl.run(
        reference.fn(CORE + "compute_grpo_vectorized_outcome_advantage")(
            rewards, mask, index, norm_adv_by_std_in_grpo=norm
        )
    ).value
    np.testing.assert_allclose(ours, theirs[0], **TOL)
    np.testing.assert_array_equal(ours, ret)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl(verl, binary, norm):
    rewards, mask, gid, index, ng = _grouped(2, sizes=(4, 3, 3, 2, 2, 2), binary=binary)
    ours, _ = _ours_adv("grpo_passk", rewards, mask, gid, ng, norm_adv_by_std_in_grpo=norm)
    theirs = verl.run(
        reference.fn(CORE + "compute_grpo_passk_outcome_advantage")(
            rewards, mask, index, config=_algo(norm_adv_by_std_in_grpo=norm)
        )
    ).value
    np.testing.assert_allclose(ours, theirs[0], **TOL)
    assert np.count_nonzero(ours.any(axis=1)) >= 1


@pytest.mark.parametrize("name, verl_fn", [
    ("rloo_vectorized", "compute_rloo_vectorized_outcome_advantage"),
    ("opo", "compute_opo_outcome_advantage"),
    ("gpg", "compute_gpg_outcome_advantage"),
    ("reinforce_plus_plus_baseline", "compute_reinforce_plus_plus_baseline_outcome_advantage"),
])  # fmt: skip
@pytest.mark.parametrize("seed", [3, 4])
def test_group_estimators_match_verl(verl, name, verl_fn, seed):
    rewards, mask, gid, index, ng = _grouped(seed)
    rewards[seed % 5] = 0.0  # a zero score (gpg's alpha counts the non-zero ones)
    ours, ret = _ours_adv(name, rewards, mask, gid, ng)
    theirs = verl.run(reference.fn(CORE + verl_fn)(rewards, mask, index, config=_algo())).value
    np.testing.assert_allclose(ours, theirs[0], **TOL)
    np.testing.assert_allclose(ret, theirs[1], **TOL)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", [5, 6])
def test_reinforce_plus_plus_matches_verl(verl, gamma, seed):
    # Dense rewards and masks with holes: 0.9.1 carries the running return through mask-0 spans.
    rewards, mask, gid, _, ng = _grouped(seed, dense=True)
    ours, ret = _ours_adv("reinforce_plus_plus", rewards, mask, gid, ng, gamma=gamma)
    theirs = verl.run(
        reference.fn(CORE + "compute_reinforce_plus_plus_outcome_advantage")(
            rewards, mask, config=_algo(gamma=gamma)
        )
    ).value
    np.testing.assert_allclose(ours, theirs[0], **TOL)
    np.testing.assert_allclose(ret, theirs[1], **TOL)


@pytest.mark.parametrize("seed", [7, 8])
def test_remax_matches_verl(verl, seed):
    rewards, mask, gid, _, ng = _grouped(seed, dense=True)
    baselines = np.random.default_rng(seed).normal(0, 1, len(gid)).astype(np.float32)
    ours, ret = _ours_adv("remax", rewards, mask, gid, ng, reward_baselines=jnp.asarray(baselines))
    theirs = verl.run(
        reference.fn(CORE + "compute_remax_outcome_advantage")(rewards, baselines, mask)
    ).value
    np.testing.assert_allclose(ours, theirs[0], **TOL)
    np.testing.assert_allclose(ret, theirs[1], **TOL)


def test_gdpo_without_components_matches_verl(verl):
    rewards, mask, gid, index, ng = _grouped(9)
    ours, _ = _ours_adv("gdpo", rewards, mask, gid, ng)
    theirs = verl.run(reference.fn(CORE + "compute_gdpo_outcome_advantage")(rewards, mask, index))
    np.testing.assert_allclose(ours, theirs.value[0], **TOL)


@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_gdpo_with_reward_components_matches_verl(verl, weights):
    # verl reads K per-sample component scores from non_tensor_batch under the keys
    # algorithm.gdpo_reward_keys, places each at the row's last response position, and weights
    # them with algorithm.gdpo_reward_weights.
    rewards, mask, gid, index, ng = _grouped(10)
    rng = np.random.default_rng(10)
    components = np.stack(
        [rng.normal(0, 1, len(gid)), rng.integers(0, 2, len(gid)), 5 * rng.normal(0, 1, len(gid))],
        axis=1,
    ).astype(np.float32)
    keys = ["acc", "format", "length"]
    ours, _ = _ours_adv(
        "gdpo",
        rewards,
        mask,
        gid,
        ng,
        reward_components=jnp.asarray(components),
        reward_weights=None if weights is None else jnp.asarray(weights),
    )
    prompt_width = 4
    batch = {
        "prompts": np.zeros((len(gid), prompt_width), np.int64),
        "attention_mask": np.concatenate([np.ones((len(gid), prompt_width)), mask], 1).astype(
            np.int64
        ),
    }
    non_tensor = {k: reference.keep_numpy(components[:, i]) for i, k in enumerate(keys)}
    config = _algo(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
    theirs = verl.run(
        reference.fn(CORE + "compute_gdpo_outcome_advantage")(
            rewards, mask, index, config=config, non_tensor_batch=non_tensor, batch=batch
        )
    )
    np.testing.assert_allclose(ours, theirs.value[0], **TOL)


def test_dispatcher_matches_verls_registry_names(verl):
    # Every built-in name is one of verl's registered estimators.
    theirs = verl.run(reference.fn("builtins:list")(reference.fn(CORE + "ADV_ESTIMATOR_REGISTRY")))
    assert set(advantage.ADV_ESTIMATORS) <= set(theirs.value)
    assert set(theirs.value) - set(advantage.ADV_ESTIMATORS) == {
        "gae",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
    }


def test_policy_loss_modes_match_verls_registry_names(verl):
    theirs = verl.run(reference.fn("builtins:list")(reference.fn(CORE + "POLICY_LOSS_REGISTRY")))
    assert set(loss.POLICY_LOSS_MODES) | {"bypass_mode"} == set(theirs.value)


# ------------------------------------------------------------------------------------------
# Rollout correction: IS weights, rejection sampling, bypass mode, metrics.
# ------------------------------------------------------------------------------------------

HELPER = "verl.trainer.ppo.rollout_corr_helper:"


def _rollout_inputs(seed, spread=0.3):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.6, (B, T)).astype(np.float32)
    rollout = old + rng.normal(0.0, spread, (B, T)).astype(np.float32)
    mask = (rng.random((B, T)) > 0.25).astype(np.float32)
    mask[4] = 0.0  # fully masked row
    mask[7, 1:] = 0.0  # one-token row
    return old, rollout, mask


_CORRECTIONS = [
    {},  # yaml defaults: metrics only
    {"rollout_is": "token"},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25"},  # IcePop
    {"rollout_is": "sequence"},
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.5_3.0",
        "rollout_is_batch_normalize": True,
    },
    {"rollout_is": "sequence", "rollout_is_batch_normalize": True},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.4"},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.05},
    {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.05},
    {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 1.5},  # single value: bounds 1/1.5, 1.5
    {"rollout_rs": "seq_sum_k2,seq_sum_k3", "rollout_rs_threshold": "0.4,0.3"},
    {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.95_1.05"},
    {"rollout_rs": "seq_mean_k2, seq_mean_k3", "rollout_rs_threshold": 0.04},
    {"rollout_rs": "seq_max_k2,seq_max_k3,token_k1", "rollout_rs_threshold": "0.2,0.15,0.5_2.0"},
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_rs": "token_k3,seq_mean_k1,token_k3",  # duplicate dropped
        "rollout_rs_threshold": "0.1,0.9_1.1",  # one per distinct option
    },
]


def _verl_correction(verl, old, rollout, mask, settings):
    call = reference.fn(HELPER + "compute_rollout_correction_and_rejection_mask")(
        old, rollout, mask, **settings
    )
    weights = None
    if settings.get("rollout_is") is not None:
        proto = reference.item(call, 0)
        weights = reference.item(reference.attr(proto, "batch"), "rollout_is_weights")
    return verl.run((weights, reference.item(call, 1), reference.item(call, 2))).value


@pytest.mark.parametrize("settings", _CORRECTIONS, ids=lambda s: ",".join(map(str, s.values())))
@pytest.mark.parametrize("seed", [0, 1])
def test_rollout_correction_matches_verl(verl, settings, seed):
    old, rollout, mask = _rollout_inputs(seed)
    weights, new_mask, metrics = rollout_correction.compute_rollout_correction(
        jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask), **settings
    )
    their_weights, their_mask, their_metrics = _verl_correction(verl, old, rollout, mask, settings)
    if their_weights is None:
        assert weights is None
    else:
        np.testing.assert_allclose(np.asarray(weights), their_weights, **TOL)
    np.testing.assert_array_equal(np.asarray(new_mask), their_mask)
    ours = {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}
    _assert_metrics_equal(ours, their_metrics, tol={"rtol": 5e-5, "atol": 2e-6})
    if "rollout_rs" in settings:  # the thresholds reject some tokens, not all
        assert 0 < np.count_nonzero(np.asarray(new_mask)) < np.count_nonzero(mask)


def test_rollout_correction_inputs_exercise_truncation_and_rejection():
    """Guards the parity test above: seed 0 truncates or zeroes weights in every IS setting."""
    old, rollout, mask = _rollout_inputs(0)
    for settings in _CORRECTIONS[1:6]:
        _, _, m = rollout_correction.compute_rollout_correction(old, rollout, mask, **settings)
        high = float(m["rollout_corr/rollout_is_ratio_fraction_high"])
        low = float(m["rollout_corr/rollout_is_ratio_fraction_low"])
        assert high + low > 0, settings


def test_rollout_correction_under_jit_matches_eager():
    old, rollout, mask = _rollout_inputs(2)
    settings = _CORRECTIONS[-1]
    fn = jax.jit(functools.partial(rollout_correction.compute_rollout_correction, **settings))
    eager = rollout_correction.compute_rollout_correction(old, rollout, mask, **settings)
    jitted = fn(old, rollout, mask)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _debug_metrics(verl, old, rollout, mask):
    proto = reference.fn("verl.protocol:DataProto.from_dict")(
        tensors={
            "rollout_log_probs": rollout,
            "old_log_probs": old,
            "response_mask": mask,
            "responses": np.zeros(mask.shape, np.int64),
        }
    )
    return verl.run(reference.fn("verl.utils.debug.metrics:calculate_debug_metrics")(proto)).value


@pytest.mark.parametrize("seed", [0, 3])
def test_rollout_probs_diff_metrics_match_verl(verl, seed):
    old, rollout, mask = _rollout_inputs(seed)
    ours = rollout_correction.compute_rollout_probs_diff_metrics(
        jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask)
    )
    _, _, metrics = rollout_correction.compute_rollout_correction(old, rollout, mask)
    assert {k: float(v) for k, v in ours.items()} == {
        k: float(v) for k, v in metrics.items() if k.startswith("training/")
    }
    _assert_metrics_equal(ours, _debug_metrics(verl, old, rollout, mask))


def test_rollout_probs_diff_metrics_without_valid_tokens_match_verl(verl):
    old, rollout, mask = _rollout_inputs(1)
    mask = np.zeros_like(mask)
    ours = rollout_correction.compute_rollout_probs_diff_metrics(old, rollout, mask)
    _assert_metrics_equal(ours, _debug_metrics(verl, old, rollout, mask))  # 0 and NaNs


_BYPASS = [
    {"loss_type": "ppo_clip"},
    {"loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05},
    {"loss_type": "reinforce"},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {
        "loss_type": "reinforce",
        "rollout_is": "token",
        "rollout_is_threshold": "0.8_1.25",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": "0.9_1.1",
        "rollout_is_batch_normalize": True,
    },
]


@pytest.mark.parametrize("settings", _BYPASS, ids=lambda s: ",".join(map(str, s.values())))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_loss_matches_verl(verl, settings, agg):
    # Bypass: old_log_prob is the rollout's; the weights and rejection come from the current
    # policy inside the loss.
    lp, rollout, mask = _rollout_inputs(5, spread=0.4)
    adv = np.random.default_rng(5).normal(0, 1, lp.shape).astype(np.float32)
    (ours, metrics), grad = jax.value_and_grad(
        lambda x: loss.compute_policy_loss_bypass_mode(
            jnp.asarray(rollout),
            x,
            jnp.asarray(adv),
            jnp.asarray(mask),
            loss_agg_mode=agg,
            clip_ratio_low=0.15,
            clip_ratio_high=0.28,
            **settings,
        ),
        has_aux=True,
    )(jnp.asarray(lp))
    corr = reference.fn("verl.trainer.config:RolloutCorrectionConfig")(
        **{"rollout_is": None, "bypass_mode": True, **settings}
    )
    config = _actor_config(
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        policy_loss=reference.fn("verl.workers.config:PolicyLossConfig")(rollout_correction=corr),
    )
    theirs, their_grad, their_metrics = _verl_value_and_grad(
        verl,
        lambda x: reference.fn(CORE + "compute_policy_loss_bypass_mode")(
            rollout, x, adv, mask, agg, config
        ),
        lp,
        key=0,
    )
    np.testing.assert_allclose(float(ours), float(theirs), **TOL)
    np.testing.assert_allclose(np.asarray(grad), their_grad, **TOL)
    _assert_metrics_equal(metrics, their_metrics, tol={"rtol": 5e-5, "atol": 2e-6})
