"""Parity of grpo_jax.advantage / grpo_jax.loss with verl 0.9.1 itself.

verl runs in its own venv (scripts/build_verl_venv.sh, with verl's pins), in the session's
reference worker (tests/reference.py); its functions get the same NumPy inputs as ours, and their
values, gradients (torch autograd) and metrics come back for comparison here. Without that venv
the module is skipped, except under CI=true, where every test fails. Inputs are finite and avoid
exact clip-bound ties, where torch and JAX may legitimately split a gradient differently. Values
and gradients with respect to log_prob (and logits) must agree to float32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from grpo_jax import advantage, loss

CORE = "verl.trainer.ppo.core_algos:"
B, T = 12, 9
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


@pytest.mark.parametrize("mode", loss.POLICY_LOSS_MODES)
@pytest.mark.parametrize("agg", loss.AGG_MODES)
def test_policy_loss_matches_verl(verl, mode, agg):
    lp, old, adv, _, mask, weights = _inputs(4)
    config = _actor_config(
        clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    (ours, metrics), grad = jax.value_and_grad(
        lambda x: loss.compute_policy_loss(
            jnp.asarray(old),
            x,
            jnp.asarray(adv),
            jnp.asarray(mask),
            loss_agg_mode=agg,
            clip_ratio_low=0.15,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            rollout_is_weights=jnp.asarray(weights),
            policy_loss_mode=mode,
        ),
        has_aux=True,
    )(jnp.asarray(lp))
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
