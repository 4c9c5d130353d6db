"""Tests for grpo_jax.rollout_correction: hand-derived weights, masks and metrics, invariants.

rho = pi_old / pi_rollout; the inputs give log_ratio = log rho directly (old = log rho,
rollout = 0) unless stated. Parity with verl itself is in test_verl_parity.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import loss, rollout_correction

NAN = float("nan")


def _f(metrics):
    return {k: float(v) for k, v in metrics.items()}


# ------------------------------------------------------------------------------------------
# Token TIS. rho = (0.5, 1, 3, pad) on one row, threshold 2 (lower for metrics: 1/2):
#   weights min(rho, 2) = (0.5, 1, 2, 0); mean 3.5/3; max 2, min 0.5;
#   fraction_high = #{rho > 2} / 3 = 1/3; fraction_low = #{rho < 0.5} = 0.
#   std over clamp(w, 0, 2) = w: E[w^2] = 5.25/3 = 1.75, E[w]^2 = 49/36 -> sqrt(1.75 - 49/36).
#   ESS = 1 / E[(w / E[w])^2] = E[w]^2 / E[w^2] = (49/36) / 1.75.
# ------------------------------------------------------------------------------------------
TOKEN_RHO = np.array([[0.5, 1.0, 3.0, 1.0]])
TOKEN_MASK = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)


def _weights(rho, mask, **kwargs):
    log_ratio = jnp.asarray(np.log(rho), jnp.float32)
    w, m = rollout_correction.compute_rollout_correction_weights(
        log_ratio, jnp.asarray(mask), **kwargs
    )
    return np.asarray(w), _f(m)


def test_token_tis_hand_derived():
    w, m = _weights(TOKEN_RHO, TOKEN_MASK, rollout_is="token", rollout_is_threshold=2.0)
    np.testing.assert_allclose(w, [[0.5, 1.0, 2.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_mean"], 3.5 / 3, rtol=1e-6)
    assert m["rollout_is_max"] == 2.0 and m["rollout_is_min"] == 0.5
    np.testing.assert_allclose(m["rollout_is_ratio_fraction_high"], 1 / 3, rtol=1e-6)
    assert m["rollout_is_ratio_fraction_low"] == 0.0
    np.testing.assert_allclose(m["rollout_is_std"], math.sqrt(1.75 - 49 / 36), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_is_eff_sample_size"], (49 / 36) / 1.75, rtol=1e-5)
    # One row: the per-sequence mean is the token mean; raw mean (0.5 + 1 + 3)/3 = 1.5 < 2.
    np.testing.assert_allclose(m["rollout_is_seq_mean"], 3.5 / 3, rtol=1e-6)
    assert m["rollout_is_seq_std"] == 0.0 and m["rollout_is_seq_fraction_high"] == 0.0
    assert "rollout_is_oob_ratio" not in m and "rollout_is_batch_norm_factor" not in m


def test_token_icepop_hand_derived():
    # "0.6_2.5": keep rho in [0.6, 2.5], else weight 0 -> (0, 1, 0, 0); out of bounds 2/3.
    w, m = _weights(TOKEN_RHO, TOKEN_MASK, rollout_is="token", rollout_is_threshold="0.6_2.5")
    np.testing.assert_allclose(w, [[0.0, 1.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_oob_ratio"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_ratio_fraction_low"], 1 / 3, rtol=1e-6)


def test_token_batch_normalize_hand_derived():
    # Mean 3.5/3 over valid tokens -> weights / (3.5/3); the metrics stay pre-normalisation.
    w, m = _weights(TOKEN_RHO, TOKEN_MASK, rollout_is="token", rollout_is_batch_normalize=True)
    np.testing.assert_allclose(w, np.array([[0.5, 1.0, 2.0, 0.0]]) * 3 / 3.5, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_batch_norm_factor"], 3.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_mean"], 3.5 / 3, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Sequence IS. Row 0: rho (2, 2, pad) -> product 4 -> min(4, 2) = 2 on both tokens.
#   Row 1: rho (0.5, 1, 1) -> 0.5 on all three. Row 2 fully masked -> weight 0.
#   max/min are taken in log space over every row (row 2's log-ratio sum is 0): e^ln4 = 4 and
#   min(ln 4, ln 0.5, 0) -> 0.5; fraction_high = rows with log-sum > ln 2 = 1/3; fraction_low
#   = rows with log-sum < ln 0.5 = 0 (row 1 is on the bound).
#   Batch normalisation uses the mean over non-empty rows, (2 + 0.5) / 2 = 1.25, not the token
#   mean (2 + 2 + 3 * 0.5) / 5 = 1.1.
# ------------------------------------------------------------------------------------------
SEQ_RHO = np.array([[2.0, 2.0, 1.0], [0.5, 1.0, 1.0], [3.0, 3.0, 3.0]])
SEQ_MASK = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], np.float32)


def test_sequence_is_hand_derived():
    w, m = _weights(SEQ_RHO, SEQ_MASK, rollout_is="sequence", rollout_is_threshold=2.0)
    np.testing.assert_allclose(w, [[2, 2, 0], [0.5, 0.5, 0.5], [0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_max"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_is_ratio_fraction_high"], 1 / 3, rtol=1e-6)
    assert m["rollout_is_ratio_fraction_low"] == 0.0
    np.testing.assert_allclose(m["rollout_is_mean"], 5.5 / 5, rtol=1e-6)
    w, m = _weights(SEQ_RHO, SEQ_MASK, rollout_is="sequence", rollout_is_batch_normalize=True)
    np.testing.assert_allclose(m["rollout_is_batch_norm_factor"], 1.25, rtol=1e-6)
    np.testing.assert_allclose(w[0, 0], 2 / 1.25, rtol=1e-6)


def test_weights_carry_no_gradient():
    def total(log_ratio):
        w, _ = rollout_correction.compute_rollout_correction_weights(
            log_ratio, jnp.ones((1, 3)), rollout_is="token"
        )
        return jnp.sum(w)

    np.testing.assert_array_equal(np.asarray(jax.grad(total)(jnp.zeros((1, 3)))), 0.0)


# ------------------------------------------------------------------------------------------
# Rejection sampling. k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho.
# ------------------------------------------------------------------------------------------


def _reject(rho, mask, **kwargs):
    new_mask, metrics = rollout_correction.compute_rollout_rejection_mask(
        jnp.asarray(np.log(rho), jnp.float32), jnp.asarray(mask), **kwargs
    )
    return np.asarray(new_mask), _f(metrics)


def test_token_k1_hand_derived():
    # "0.5_2.0": keep log(0.5) <= -log rho <= log 2, i.e. rho in [0.5, 2]. rho (0.4, 1, 3, pad):
    # tokens 0 and 2 rejected -> mask (0, 1, 0, 0); masked fraction 2/3; the row has a
    # rejection -> seq fractions 1.
    rho = np.array([[0.4, 1.0, 3.0, 1.0]])
    mask, m = _reject(rho, TOKEN_MASK, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    np.testing.assert_array_equal(mask, [[0, 1, 0, 0]])
    np.testing.assert_allclose(m["rollout_rs_masked_fraction"], 2 / 3, rtol=1e-6)
    assert m["rollout_rs_seq_masked_fraction"] == 1.0
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == 1.0
    k1 = -np.log([0.4, 1.0, 3.0])
    np.testing.assert_allclose(m["rollout_rs_token_k1_mean"], k1.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_rs_token_k1_max"], k1.max(), rtol=1e-6)
    # fraction_high: k1 > log 2 (token 0); fraction_low: k1 < log 0.5 (token 2).
    np.testing.assert_allclose(m["rollout_rs_token_k1_fraction_high"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_rs_token_k1_fraction_low"], 1 / 3, rtol=1e-6)
    assert "rollout_rs_token_k1_seq_fraction_low" in m  # k1 options only


def test_sequence_rejection_hand_derived():
    # seq_mean_k3 <= 0.1 and seq_max_k2 <= 0.3, both must pass.
    #   row 0 rho (2, 2): k3 = 1 - ln 2 = 0.307 each -> mean 0.307 > 0.1: rejected whole.
    #   row 1 rho (0.5, 1, 1): k3 = (0.193, 0, 0) -> mean 0.064 passes; k2 max = ln^2 2 / 2 =
    #   0.240 <= 0.3 passes. row 2 is empty.
    mask, m = _reject(
        SEQ_RHO, SEQ_MASK, rollout_rs="seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.1,0.3"
    )
    np.testing.assert_array_equal(mask, [[0, 0, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(m["rollout_rs_masked_fraction"], 2 / 5, rtol=1e-6)
    # Rows with a rejected token over all B rows (the empty row counts in the denominator).
    np.testing.assert_allclose(m["rollout_rs_seq_masked_fraction"], 1 / 3, rtol=1e-6)
    # Per option over non-empty rows: seq_mean_k3 drops row 0 of 2; seq_max_k2 drops none.
    assert m["rollout_rs_seq_mean_k3_seq_masked_fraction"] == 0.5
    assert m["rollout_rs_seq_max_k2_seq_masked_fraction"] == 0.0
    k3_row1 = (0.5 - 1 - math.log(0.5)) / 3
    np.testing.assert_allclose(m["rollout_rs_seq_mean_k3_seq_min"], k3_row1, rtol=1e-5)
    np.testing.assert_allclose(m["rollout_rs_seq_mean_k3_seq_max"], 1 - math.log(2), rtol=1e-5)
    assert "rollout_rs_seq_mean_k3_seq_fraction_low" not in m


def test_rejection_keeps_the_mask_dtype():
    mask = jnp.asarray(TOKEN_MASK > 0)
    new_mask, _ = rollout_correction.compute_rollout_rejection_mask(
        jnp.zeros((1, 4)), mask, rollout_rs="token_k2", rollout_rs_threshold=1.0
    )
    assert new_mask.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(new_mask), np.asarray(mask))


# ------------------------------------------------------------------------------------------
# Diagnostics.
# ------------------------------------------------------------------------------------------


def test_offpolicy_metrics_vanish_on_policy():
    lp = jnp.asarray([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    mask = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    m = _f(rollout_correction.compute_offpolicy_metrics(lp, lp, mask))
    for key in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert abs(m[key]) < 1e-6, key
    np.testing.assert_allclose(m["ppl_ratio"], 1.0, rtol=1e-6)
    # training_ppl: mean over rows of exp(-row mean log-prob) = (e^(3.5/3) + e^(0.5)) / 2.
    np.testing.assert_allclose(
        m["training_ppl"], (math.exp(3.5 / 3) + math.exp(0.5)) / 2, rtol=1e-5
    )
    assert m["training_ppl"] == m["rollout_ppl"]


def test_rollout_probs_diff_metrics_hand_derived():
    # p_old (0.5, 0.25), p_rollout (0.4, 0.25): |diff| (0.1, 0): max 0.1, mean 0.05, unbiased
    # std sqrt(2 * 0.05^2) = 0.0707; two points are perfectly correlated: 1.
    old = jnp.log(jnp.asarray([[0.5, 0.25, 0.9]]))
    rollout = jnp.log(jnp.asarray([[0.4, 0.25, 0.1]]))
    mask = jnp.asarray([[1.0, 1.0, 0.0]])
    m = _f(rollout_correction.compute_rollout_probs_diff_metrics(old, rollout, mask))
    assert m["training/rollout_probs_diff_valid"] == 1
    np.testing.assert_allclose(m["training/rollout_probs_diff_max"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(m["training/rollout_probs_diff_mean"], 0.05, rtol=1e-5)
    np.testing.assert_allclose(m["training/rollout_probs_diff_std"], 0.05 * 2**0.5, rtol=1e-5)
    np.testing.assert_allclose(m["training/rollout_actor_probs_pearson_corr"], 1.0, rtol=1e-6)
    empty = _f(rollout_correction.compute_rollout_probs_diff_metrics(old, rollout, 0 * mask))
    assert empty["training/rollout_probs_diff_valid"] == 0
    assert all(math.isnan(v) for k, v in empty.items() if not k.endswith("_valid"))


# ------------------------------------------------------------------------------------------
# Entry point and bypass mode.
# ------------------------------------------------------------------------------------------


def test_entry_point_defaults_compute_metrics_only():
    old = jnp.log(jnp.asarray([[0.5, 0.25, 0.9]]))
    mask = jnp.asarray([[1.0, 1.0, 0.0]])
    weights, new_mask, metrics = rollout_correction.compute_rollout_correction(old, old, mask)
    assert weights is None and new_mask is mask
    assert {k.split("/")[0] for k in metrics} == {"rollout_corr", "training"}
    assert not any("rollout_is" in k or "rollout_rs" in k for k in metrics)


def test_entry_point_bypass_mode_returns_nothing_to_apply():
    old, mask = jnp.zeros((1, 3)), jnp.ones((1, 3))
    out = rollout_correction.compute_rollout_correction(
        old, old + 1.0, mask, rollout_is="token", bypass_mode=True, loss_type="reinforce"
    )
    assert out[0] is None and out[1] is mask and out[2] == {}


def test_nan_padding_does_not_leak():
    rng = np.random.default_rng(0)
    old = rng.normal(-1, 0.5, (3, 4)).astype(np.float32)
    rollout = old + rng.normal(0, 0.3, old.shape).astype(np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
    dirty_old, dirty_rollout = old.copy(), rollout.copy()
    dirty_old[mask == 0], dirty_rollout[mask == 0] = NAN, np.inf
    settings = {
        "rollout_is": "sequence",
        "rollout_rs": "token_k3,seq_sum_k1",
        "rollout_rs_threshold": "0.5,0.5_2",
    }
    clean = rollout_correction.compute_rollout_correction(old, rollout, mask, **settings)
    dirty = rollout_correction.compute_rollout_correction(
        dirty_old, dirty_rollout, mask, **settings
    )
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bypass_ppo_clip_is_vanilla_on_the_rejected_mask():
    # loss_type ppo_clip: vanilla PPO with old = rollout on the rejection-masked response, no
    # weights applied; the metrics add rollout_corr/* of the current policy vs the rollout.
    rng = np.random.default_rng(1)
    lp = jnp.asarray(rng.normal(-1, 0.5, (4, 6)), jnp.float32)
    rollout = lp + jnp.asarray(rng.normal(0, 0.3, (4, 6)), jnp.float32)
    adv = jnp.asarray(rng.normal(0, 1, (4, 6)), jnp.float32)
    mask = jnp.ones((4, 6))
    settings = {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.02, "rollout_is": "token"}
    value, metrics = loss.compute_policy_loss_bypass_mode(
        rollout, lp, adv, mask, **settings
    )
    _, kept, _ = rollout_correction.compute_rollout_correction(lp, rollout, mask, **settings)
    assert 0 < float(jnp.sum(kept)) < mask.size
    expected, vanilla_metrics = loss.compute_policy_loss(rollout, lp, adv, kept)
    assert float(value) == float(expected)
    assert set(vanilla_metrics) < set(metrics)
    assert "rollout_corr/rollout_is_mean" in metrics


def test_bypass_reinforce_hand_derived():
    # loss_type reinforce, token TIS at 2: rho = exp(lp - rollout) = (3, 0.5) -> w (2, 0.5),
    # detached; L = -A lp w, A = (1, -1), lp = (-1, -2): (2, -1); seq-mean-token-sum on one row
    # = 1; grad = -A w = (-2, 0.5). actor/ppo_kl = mean(rollout - lp) = -(ln 3 + ln 0.5) / 2.
    lp = jnp.asarray([[-1.0, -2.0]])
    rollout = lp - jnp.log(jnp.asarray([[3.0, 0.5]]))
    adv, mask = jnp.asarray([[1.0, -1.0]]), jnp.ones((1, 2))

    def objective(x):
        return loss.compute_policy_loss_bypass_mode(
            rollout,
            x,
            adv,
            mask,
            loss_type="reinforce",
            loss_agg_mode="seq-mean-token-sum",
            rollout_is="token",
        )

    (value, metrics), grad = jax.value_and_grad(objective, has_aux=True)(lp)
    np.testing.assert_allclose(float(value), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[-2.0, 0.5]], rtol=1e-6)
    kl = -(math.log(3) + math.log(0.5)) / 2
    np.testing.assert_allclose(float(metrics["actor/ppo_kl"]), kl, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Settings are validated as verl does.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [(2.0, (2.0, None)), ("3", (3.0, None)), ("0.5_5.0", (5.0, 0.5)), (4, (4.0, None))],
)
def test_parse_rollout_is_threshold(spec, expected):
    assert rollout_correction.parse_rollout_is_threshold(spec) == expected


def test_parse_rollout_rs_thresholds():
    parse = rollout_correction.parse_rollout_rs_thresholds
    # A single k1 value u means bounds (1/u, u); one value is shared by every option.
    assert parse(("token_k1", "seq_max_k3"), 2.0) == {
        "token_k1": (0.5, 2.0),
        "seq_max_k3": (None, 2.0),
    }
    assert parse(("seq_sum_k1", "token_k2"), "0.9_1.1, 0.3") == {
        "seq_sum_k1": (0.9, 1.1),
        "token_k2": (None, 0.3),
    }
    assert rollout_correction.parse_rollout_rs("token_k2, token_k1,token_k2") == (
        "token_k2",
        "token_k1",
    )


def test_invalid_settings_raise():
    rc = rollout_correction
    args = jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2))
    with pytest.raises(TypeError, match="not|must be"):
        rc.parse_rollout_is_threshold(True)
    with pytest.raises(ValueError, match="lower bound must be <= upper"):
        rc.parse_rollout_is_threshold("3_2")
    with pytest.raises(ValueError, match="upper bound must be positive"):
        rc.parse_rollout_is_threshold(-1.0)
    with pytest.raises(ValueError, match="Invalid rollout_rs option 'token_k4'"):
        rc.compute_rollout_correction(*args, rollout_rs="token_k4", rollout_rs_threshold=1.0)
    with pytest.raises(ValueError, match="must be explicitly provided"):
        rc.compute_rollout_correction(*args, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="exactly 2"):
        rc.compute_rollout_correction(
            *args, rollout_rs="token_k2,token_k3", rollout_rs_threshold="1,2,3"
        )
    with pytest.raises(ValueError, match="one upper bound"):
        rc.compute_rollout_correction(*args, rollout_rs="token_k2", rollout_rs_threshold="1_2")
    with pytest.raises(ValueError, match="Invalid rollout_is 'tokens'"):
        rc.compute_rollout_correction(*args, rollout_is="tokens")
    with pytest.raises(ValueError, match="Invalid loss_type"):
        rc.compute_rollout_correction(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.compute_rollout_correction(args[0], args[1], jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match="same"):
        rc.compute_rollout_correction(args[0], jnp.zeros((1, 3)), args[2])
