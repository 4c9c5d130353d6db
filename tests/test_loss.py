"""Tests for grpo_jax.loss: hand-derived values for every mode and type, gradients, invariants.

Expected numbers are derived in the comments. "grad" always means the gradient with respect to
log_prob (or the logits) of the scalar under test.
"""

import functools
import math

import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax import loss

NAN = float("nan")
# Most expected values below are derived by hand from a handful of terms each: float32 gets them
# to a few ulps of themselves on any CPU, so per-element rtol (1e-6 = 8 ulps, 1e-5) is their
# bound. Where a chunked computation is compared with a dense one (another summation order over
# the vocabulary or the tokens), the bound is in ulps of the scale instead (tests/numerics.py).
CHUNK_ULPS = 256

# ------------------------------------------------------------------------------------------
# agg_loss. L = [[1,2,3],[4,5,6],[7,8,9]], mask = [[1,1,0],[1,0,0],[0,0,0]]:
#   S = 1+2+4 = 7, n = (2, 1, 0), N_tok = 3, N_seq = 2 (row 2 is fully masked), T = 3.
# ------------------------------------------------------------------------------------------
AGG_L = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
AGG_MASK = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
AGG_CASES = [
    ("token-mean", {}, 7 / 3),  # S / N_tok
    ("token-mean", {"dp_size": 2, "batch_num_tokens": 14}, 1.0),  # 7 / 14 * 2
    ("token-sum", {}, 7.0),
    ("token-sum", {"dp_size": 2}, 14.0),  # S * dp_size
    ("seq-mean-token-sum", {}, 3.5),  # (1+2 + 4) / N_seq = 7 / 2
    ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 4}, 3.5),  # 7 / 4 * 2
    ("seq-mean-token-mean", {}, (3 / (2 + 1e-8) + 4 / (1 + 1e-8)) / 2),  # (1.5 + 4) / 2 = 2.75
    ("seq-mean-token-mean", {"global_batch_size": 5}, 5.5 / 5),  # fully masked rows count
    ("seq-mean-token-sum-norm", {}, 3.5 / 3),  # seq-mean-token-sum / T
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 7}, 0.5),  # 3.5 / 7
    ("token-mean", {"loss_scale_factor": 7}, 7 / 3),  # loss_scale_factor: only the -norm mode
]


@pytest.mark.parametrize("mode, kwargs, expected", AGG_CASES)
def test_agg_loss_hand_derived(mode, kwargs, expected):
    value = loss.agg_loss(jnp.asarray(AGG_L), jnp.asarray(AGG_MASK), mode, **kwargs)
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    assert value.dtype == jnp.float32


@pytest.mark.parametrize("mode, kwargs, expected", AGG_CASES)
def test_agg_loss_gradient_is_its_weight_matrix(mode, kwargs, expected):
    # The loss is linear in L, so grad = loss(L) / ... : check grad . L == loss and grad = 0
    # off-mask; the per-mode weights are then fixed by the hand values above.
    grad = jax.grad(lambda x: loss.agg_loss(x, jnp.asarray(AGG_MASK), mode, **kwargs))(
        jnp.asarray(AGG_L)
    )
    np.testing.assert_allclose(float(jnp.sum(grad * AGG_L)), expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad)[AGG_MASK == 0], 0.0)


def test_agg_loss_token_mean_weights():
    # token-mean weights every valid token by 1 / N_tok = 1/3; seq-mean-token-mean weights a
    # token of row i by 1 / (n_i N_seq): row 0 -> 1/4, row 1 -> 1/2.
    mask = jnp.asarray(AGG_MASK)
    g_tok = jax.grad(lambda x: loss.agg_loss(x, mask, "token-mean"))(jnp.asarray(AGG_L))
    np.testing.assert_allclose(np.asarray(g_tok), AGG_MASK / 3, rtol=1e-6)
    g_seq = jax.grad(lambda x: loss.agg_loss(x, mask, "seq-mean-token-mean"))(jnp.asarray(AGG_L))
    expected = np.array([[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]], np.float32)
    np.testing.assert_allclose(np.asarray(g_seq), expected, rtol=1e-6)


@pytest.mark.parametrize("mode", loss.AGG_MODES)
def test_agg_loss_nan_in_padding_does_not_leak(mode):
    # Deviation 2: NaN/inf off-mask changes neither the value nor the gradient, in every mode
    # (verl: token-mean is immune, the seq-mean-* modes return NaN).
    poisoned = AGG_L.copy()
    poisoned[AGG_MASK == 0] = NAN
    poisoned[2, 2] = np.inf
    mask = jnp.asarray(AGG_MASK)
    clean_v, clean_g = jax.value_and_grad(lambda x: loss.agg_loss(x, mask, mode))(AGG_L)
    value, grad = jax.value_and_grad(lambda x: loss.agg_loss(x, mask, mode))(poisoned)
    assert float(value) == float(clean_v)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(clean_g))


@pytest.mark.parametrize("mode", loss.AGG_MODES)
def test_agg_loss_all_masked_is_zero_with_zero_gradient(mode):
    # Deviation 1: verl returns 0/0 = NaN here.
    zeros = jnp.zeros((2, 3))
    value, grad = jax.value_and_grad(lambda x: loss.agg_loss(x, zeros, mode))(jnp.ones((2, 3)))
    assert float(value) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_agg_loss_errors():
    with pytest.raises(ValueError, match=r"\['token-mean', 'token-sum', 'seq-mean-token-sum'"):
        loss.agg_loss(jnp.ones((1, 2)), jnp.ones((1, 2)), "mean")
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        loss.agg_loss(jnp.ones((1, 2)), jnp.ones((1, 2)), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size is required"):
        loss.agg_loss(jnp.ones((1, 2)), jnp.ones((1, 2)), "seq-mean-token-mean", dp_size=2)


# ------------------------------------------------------------------------------------------
# kl_penalty. ref = 0 everywhere, so d = lp and the k3 argument is x = ref - lp = -lp.
#   lp = -1: k3 = e^1 - 1 - 1 = e - 2,          grad 1 - e^1
#   lp =  1: k3 = e^-1 + 1 - 1 = e^-1,          grad 1 - e^-1
#   lp = -2: k3 = e^2 - 2 - 1 = e^2 - 3 (4.39), grad 1 - e^2
#   lp = -3: k3 = e^3 - 4 = 16.09 > 10 -> 10,   grad 0 (outer clamp binds)
#   lp = 25: x = -25 -> -20, e^-20 + 19 > 10 -> 10, grad 0 (both clamps bind)
#   lp =  0: every estimator is 0.
# ------------------------------------------------------------------------------------------
KL_LP = np.array([[-1.0, 1.0, -2.0], [-3.0, 25.0, 0.0]], np.float32)
E = math.e
KL_EXPECTED = {
    "kl": (KL_LP, np.ones_like(KL_LP)),
    "abs": (np.abs(KL_LP), np.sign(KL_LP)),
    "mse": (0.5 * KL_LP**2, KL_LP),
    "low_var_kl": (
        np.array([[E - 2, 1 / E, E**2 - 3], [10.0, 10.0, 0.0]]),
        np.array([[1 - E, 1 - 1 / E, 1 - E**2], [0.0, 0.0, 0.0]]),
    ),
}
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@functools.partial(jax.jit, static_argnames=("kl_type",))
def _kl_value_and_grad_jit(lp, ref, kl_type):
    value = loss.kl_penalty(lp, ref, kl_type)
    grad = jax.grad(lambda x: jnp.sum(loss.kl_penalty(x, ref, kl_type)))(lp)
    return value, grad


def _kl_value_and_grad(kl_type, lp=KL_LP, ref=None):
    ref = np.zeros_like(lp) if ref is None else ref
    value, grad = _kl_value_and_grad_jit(jnp.asarray(lp), jnp.asarray(ref), kl_type)
    return np.asarray(value), np.asarray(grad)


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators_hand_derived(kl_type):
    expected_value, expected_grad = KL_EXPECTED[KL_ALIASES.get(kl_type, kl_type)]
    value, grad = _kl_value_and_grad(kl_type)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6)


@pytest.mark.parametrize("kl_type", ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_plus_variants_keep_value_and_take_k2_gradient(kl_type):
    # value = the base estimator's; grad = d(d^2/2)/d lp = d = lp (ref = 0), even where the k3
    # clamps bind (lp = -3, 25).
    base = KL_ALIASES.get(kl_type[:-1], kl_type[:-1])
    value, grad = _kl_value_and_grad(kl_type)
    np.testing.assert_allclose(value, KL_EXPECTED[base][0], rtol=1e-6)
    np.testing.assert_allclose(grad, KL_LP, rtol=1e-6)


_lp_pairs = hnp.arrays(np.float32, (4, 6), elements=st.floats(-30, 30, width=32))


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(lp=_lp_pairs, ref=_lp_pairs)
def test_kl_properties(lp, ref):
    # Every estimator is 0 where lp == ref; k3 >= 0 everywhere; every '+' gradient is lp - ref.
    for kl_type in loss.KL_TYPES:
        if kl_type.startswith("full"):
            continue
        value_eq, _ = _kl_value_and_grad(kl_type, lp, lp)
        np.testing.assert_array_equal(value_eq, 0.0)
        if kl_type.endswith("+"):
            _, grad = _kl_value_and_grad(kl_type, lp, ref)
            np.testing.assert_allclose(grad, lp - ref, rtol=1e-6, atol=1e-6)
    value, _ = _kl_value_and_grad("k3", lp, ref)
    # e^x - x - 1 >= 0, up to float32 cancellation near x = 0 (verl evaluates the same formula):
    # x = 2^-24 gives e^x = 1 after rounding, then 1 - x - 1 = -2^-24.
    assert (value >= -(2.0**-23)).all()


def test_full_kl_hand_derived():
    # p = softmax([0, 0]) = (1/2, 1/2), q = softmax([0, ln 3]) = (1/4, 3/4):
    #   KL = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3).
    # grad_j = p_j ((z_j - zr_j) - a), a = sum p (z - zr) = -ln(3)/2:
    #   grad = (1/2 * ln3/2, 1/2 * (-ln3 + ln3/2)) = (ln3/4, -ln3/4).
    logits = jnp.zeros((1, 1, 2))
    ref_logits = jnp.asarray([[[0.0, math.log(3.0)]]])
    value, grad = jax.value_and_grad(
        lambda z: jnp.sum(loss.kl_penalty(None, None, "full", logits=z, ref_logits=ref_logits))
    )(logits)
    np.testing.assert_allclose(float(value), 0.5 * math.log(4 / 3), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad)[0, 0], [math.log(3) / 4, -math.log(3) / 4], rtol=1e-6
    )


def _dense_full_kl(z, zr):
    logp, logq = jax.nn.log_softmax(z, axis=-1), jax.nn.log_softmax(zr, axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def test_full_kl_matches_dense_reference_and_is_zero_on_equal_logits():
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(0, 2, (3, 5, 11)), jnp.float32)
    zr = jnp.asarray(rng.normal(0, 2, (3, 5, 11)), jnp.float32)
    g = jnp.asarray(rng.normal(0, 1, (3, 5)), jnp.float32)
    ours, grad = jax.value_and_grad(
        lambda x: jnp.sum(g * loss.kl_penalty(None, None, "full", logits=x, ref_logits=zr))
    )(z)
    ref, ref_grad = jax.value_and_grad(lambda x: jnp.sum(g * _dense_full_kl(x, zr)))(z)
    # Another summation order over the vocabulary (tests/numerics.py): the value is a sum of 15
    # rows' KLs, each of terms p (log p - log q) of O(1) at logits of scale 2.
    numerics.assert_close(ours, ref, ulps=CHUNK_ULPS, scale=15.0)
    numerics.assert_close(grad, ref_grad, ulps=CHUNK_ULPS)
    same = loss.kl_penalty(None, None, "full", logits=z, ref_logits=z)
    np.testing.assert_allclose(np.asarray(same), 0.0, atol=1e-6)
    # full+: the full-KL value with the k2 gradient with respect to the log-probs.
    lp, ref_lp = jnp.full((3, 5), -1.0), jnp.full((3, 5), -1.5)
    plus = loss.kl_penalty(lp, ref_lp, "full+", logits=z, ref_logits=zr)
    numerics.assert_close(plus, _dense_full_kl(z, zr), ulps=CHUNK_ULPS)
    grad_lp = jax.grad(
        lambda x: jnp.sum(loss.kl_penalty(x, ref_lp, "full+", logits=z, ref_logits=zr))
    )(lp)
    np.testing.assert_allclose(np.asarray(grad_lp), 0.5, rtol=1e-6)


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_full_kl_makes_no_float32_copy_of_the_logits():
    # float32 logits [N, V] (the model's output dtype), N = 16384 rows, V = 512: one copy is
    # 32 MiB. Working memory (forward and backward) must stay at a few 512-row chunks (1 MiB
    # each), well under one copy; a log_softmax of both inputs would need two.
    n, vocab = 16384, 512
    z = jnp.zeros((1, n, vocab), jnp.float32)

    def ours(x, y):
        return jnp.sum(loss.kl_penalty(None, None, "full", logits=x, ref_logits=y))

    assert _temp_bytes(ours, z, z) < n * vocab * 4 / 4
    assert _temp_bytes(jax.grad(ours), z, z) < n * vocab * 4 / 4


def test_kl_errors():
    with pytest.raises(ValueError, match=r"must be one of \['kl', 'k1', 'abs'"):
        loss.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")
    with pytest.raises(ValueError, match="needs logits and ref_logits"):
        loss.kl_penalty(None, None, "full")
    with pytest.raises(ValueError, match="needs log_prob and ref_log_prob"):
        loss.kl_penalty(None, None, "k3")


# ------------------------------------------------------------------------------------------
# Vanilla PPO policy loss, eps_low = 0.2, eps_high = 0.28, c = 3, old = 0 so lp = log r.
# Row 0 = tokens a, b, c, pad; row 1 = d, e, f, pad (pad: lp = NaN, masked).
#   a: A= 1, r=1.1: L1 = -1.1, L2 = -1.1          -> L = -1.1, grad -A r = -1.1
#   b: A= 1, r=1.5: L1 = -1.5, L2 = -1.28         -> L = -1.28 (clipped), grad 0
#   c: A=-1, r=0.5: L1 =  0.5, L2 =  0.8          -> L = 0.8 (clipped), grad 0
#   d: A=-1, r=4  : L1 =  4,   L2 =  1.28, Lc = 4 -> dual clip min(3, 4) = 3, grad 0
#   e: A=-2, r=2  : L1 =  4,   L2 =  2.56, Lc = 4 -> min(6, 4) = 4, grad -A r = 4
#   f: A= 2, r=0.5: L1 = -1,   L2 = -1.6          -> L = -1 (A > 0 never clips below), grad -1
# token-mean: (-1.1 - 1.28 + 0.8 + 3 + 4 - 1) / 6 = 4.42 / 6; grads / 6.
# pg_clipfrac = #{L2 > L1} / 6 = {b, c} = 2/6; pg_clipfrac_lower = #{Lc > 3, A < 0} = {d} = 1/6;
# ppo_kl = mean(-log r) = -ln(1.1 * 1.5 * 0.5 * 4 * 2 * 0.5) / 6 = -ln(3.3) / 6.
# ------------------------------------------------------------------------------------------
PPO_RATIO = np.array([[1.1, 1.5, 0.5, 1.0], [4.0, 2.0, 0.5, 1.0]])
PPO_LP = np.log(PPO_RATIO).astype(np.float32)
PPO_LP[:, 3] = NAN
PPO_ADV = np.array([[1, 1, -1, NAN], [-1, -2, 2, NAN]], np.float32)
PPO_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.float32)


@functools.partial(jax.jit, static_argnames=("options",))
def _policy_jit(lp, old, adv, mask, weights, options):
    def objective(x):
        return loss.compute_policy_loss(
            old, x, adv, mask, rollout_is_weights=weights, **dict(options)
        )

    return jax.value_and_grad(objective, has_aux=True)(lp)


def _policy(lp, old, adv, mask, rollout_is_weights=None, **options):
    """(value, metrics, grad wrt lp) of compute_policy_loss; options are static keywords."""
    arrays = [jnp.asarray(x, jnp.float32) for x in (lp, old, adv, mask)]
    (value, metrics), grad = _policy_jit(
        *arrays, rollout_is_weights, options=tuple(sorted(options.items()))
    )
    return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def test_vanilla_hand_derived_with_clip_higher_and_dual_clip():
    value, metrics, grad = _policy(
        PPO_LP, np.zeros_like(PPO_LP), PPO_ADV, PPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    np.testing.assert_allclose(value, 4.42 / 6, rtol=1e-5)
    expected_grad = np.array([[-1.1, 0, 0, 0], [0, 4, -1, 0]]) / 6
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    # Exact zeros where verl's gradient is zero: the clipped and dual-clipped tokens, padding.
    assert grad[0, 1] == grad[0, 2] == grad[1, 0] == grad[0, 3] == grad[1, 3] == 0.0
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 2 / (6 + 1e-8), rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], 1 / (6 + 1e-8), rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/ppo_kl"], -math.log(3.3) / 6, rtol=1e-5)


def test_vanilla_symmetric_clip_defaults_to_clip_ratio():
    # clip_ratio = 0.2 on both sides: token b clips at 1.2, so L_b = -1.2 instead of -1.28.
    value, _, _ = _policy(PPO_LP, np.zeros_like(PPO_LP), PPO_ADV, PPO_MASK)
    np.testing.assert_allclose(value, (4.42 + 1.28 - 1.2) / 6, rtol=1e-5)


def test_vanilla_ratio_clamp_at_20_zeroes_the_gradient():
    # lp - old = 21 > 20: r = e^20 with zero gradient; A = 1 keeps it in the clipped branch
    # anyway, so use A = -1 with a large c so the dual clip does not bind: L = e^20, grad 0.
    value, _, grad = _policy(
        np.array([[21.0]], np.float32),
        np.zeros((1, 1), np.float32),
        -np.ones((1, 1), np.float32),
        np.ones((1, 1), np.float32),
        clip_ratio_c=1e10,
    )
    np.testing.assert_allclose(value, math.exp(20.0), rtol=1e-5)
    assert grad[0, 0] == 0.0


def test_vanilla_rollout_is_weights_scale_each_token():
    # Weights (2, 1, 1 | 1, 0.5, 1): L = (-2.2 - 1.28 + 0.8 + 3 + 2 - 1) / 6 = 1.32 / 6.
    weights = np.array([[2, 1, 1, 1], [1, 0.5, 1, 1]], np.float32)
    value, _, grad = _policy(
        PPO_LP,
        np.zeros_like(PPO_LP),
        PPO_ADV,
        PPO_MASK,
        clip_ratio_high=0.28,
        rollout_is_weights=jnp.asarray(weights),
    )
    np.testing.assert_allclose(value, 1.32 / 6, rtol=1e-5)
    np.testing.assert_allclose(grad, np.array([[-2.2, 0, 0, 0], [0, 2, -1, 0]]) / 6, rtol=1e-5)


_ratio_logs = hnp.arrays(
    np.float32, (3, 8), elements=st.floats(-2.5, 2.5, width=32, allow_subnormal=False)
)
# Advantages are 0 or at least 2^-6 in size, so -A r / N never underflows to a subnormal.
_advs = hnp.arrays(
    np.float32,
    (3, 8),
    elements=st.one_of(
        st.just(0.0), st.floats(2**-6, 3, width=32), st.floats(-3, -(2**-6), width=32)
    ),
)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(log_r=_ratio_logs, adv=_advs)
def test_vanilla_gradient_is_exactly_zero_where_verls_is(log_r, adv):
    # Active (unclipped) tokens: A > 0 and r <= 1.28, or A < 0 and 0.8 <= r < 3. There the
    # grad is -A r / N; everywhere else it is exactly 0. Ties at a bound are excluded.
    r = np.exp(log_r.astype(np.float64))
    bounds = (0.8, 1.28, 3.0)
    hypothesis.assume(all(np.abs(r - b).min() > 1e-4 for b in bounds))
    mask = np.ones_like(log_r)
    _, _, grad = _policy(log_r, np.zeros_like(log_r), adv, mask, clip_ratio_high=0.28)
    active = ((adv > 0) & (r <= 1.28)) | ((adv < 0) & (r >= 0.8) & (r < 3.0))
    np.testing.assert_array_equal(grad[~active], 0.0)
    np.testing.assert_allclose(grad[active], (-adv * r)[active] / mask.size, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# GSPO, eps = 0.2, token-mean over 4 valid tokens, old = 0.
#   row 0: log r = (ln 2, 0): sequence log-ratio ln(2)/2, ratio sqrt 2 on both tokens; A = 1:
#          L1 = -1.414 < L2 = -1.2 -> L = -1.2 (clipped), grad 0.
#   row 1: log r = (ln 1.1, ln 1.1): ratio 1.1 (inside the clip); A = (1, -1):
#          L = (-1.1, 1.1); d ratio / d lp_t = ratio (lp - sg(lp)) -> grad -A * 1.1.
#   value = (-1.2 - 1.2 - 1.1 + 1.1) / 4 = -0.6; pg_clipfrac = 2/4;
#   ppo_kl = -(ln 2 + 2 ln 1.1) / 4 (unclamped per-token log-ratio).
# ------------------------------------------------------------------------------------------
def test_gspo_hand_derived():
    lp = np.log(np.array([[2.0, 1.0, 1.0], [1.1, 1.1, 1.0]])).astype(np.float32)
    lp[:, 2] = NAN  # padding
    adv = np.array([[1, 1, 0], [1, -1, 0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    value, metrics, grad = _policy(lp, np.zeros_like(lp), adv, mask, policy_loss_mode="gspo")
    np.testing.assert_allclose(value, -0.6, rtol=1e-5)
    np.testing.assert_allclose(grad, np.array([[0, 0, 0], [-1.1, 1.1, 0]]) / 4, rtol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(
        metrics["actor/ppo_kl"], -(math.log(2) + 2 * math.log(1.1)) / 4, rtol=1e-5
    )
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


# ------------------------------------------------------------------------------------------
# CISPO and GPG on one row: lp = (-1, -2, -0.5), A = (1, -1, 2), r = (1.5, 0.5, 1.0),
# eps_low = 0.2, eps_high = 0.28 -> sg(clamp(r)) = (1.28, 0.8, 1.0).
#   CISPO L = -sg(clamp r) A lp = (1.28, -1.6, 1); mean 0.68/3; grad -sg(clamp r) A / 3
#         = (-1.28, 0.8, -2)/3; pg_clipfrac = #{r != clamp r} / 3 = 2/3.
#   GPG   L = -A lp = (1, -2, 1); mean 0; grad -A/3 = (-1, 1, -2)/3; no metrics.
# ------------------------------------------------------------------------------------------
CIS_LP = np.array([[-1.0, -2.0, -0.5]], np.float32)
CIS_OLD = CIS_LP - np.log(np.array([[1.5, 0.5, 1.0]], np.float32))
CIS_ADV = np.array([[1.0, -1.0, 2.0]], np.float32)


def test_cispo_hand_derived():
    value, metrics, grad = _policy(
        CIS_LP, CIS_OLD, CIS_ADV, np.ones((1, 3)), policy_loss_mode="cispo", clip_ratio_high=0.28
    )
    np.testing.assert_allclose(value, 0.68 / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, np.array([[-1.28, 0.8, -2.0]]) / 3, rtol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 2 / (3 + 1e-8), rtol=1e-6)


def test_gpg_hand_derived():
    value, metrics, grad = _policy(
        CIS_LP, CIS_OLD, CIS_ADV, np.ones((1, 3)), policy_loss_mode="gpg"
    )
    np.testing.assert_allclose(value, 0.0, atol=1e-7)
    np.testing.assert_allclose(grad, np.array([[-1.0, 1.0, -2.0]]) / 3, rtol=1e-6)
    assert metrics == {}


# Settings a mode needs beyond the defaults (verl's dro has no default beta).
MODE_OPTIONS = {"dro": {"dro_beta": 0.1}}


@pytest.mark.parametrize("mode", loss.POLICY_LOSS_MODES)
@pytest.mark.parametrize("agg", loss.AGG_MODES)
def test_policy_loss_nan_padding_does_not_leak(mode, agg):
    # NaN in log_prob, old_log_prob and advantages at masked positions: same value, metrics
    # and gradient as with zeros there, and a zero gradient at the padding.
    clean_lp = np.nan_to_num(PPO_LP)
    clean_adv = np.nan_to_num(PPO_ADV)
    old = np.zeros_like(PPO_LP)
    poisoned_old = old.copy()
    poisoned_old[:, 3] = NAN
    kwargs = {"policy_loss_mode": mode, "loss_agg_mode": agg, **MODE_OPTIONS.get(mode, {})}
    clean = _policy(clean_lp, old, clean_adv, PPO_MASK, **kwargs)
    dirty = _policy(PPO_LP, poisoned_old, PPO_ADV, PPO_MASK, **kwargs)
    assert clean[0] == dirty[0] and clean[1] == dirty[1]
    np.testing.assert_array_equal(clean[2], dirty[2])
    np.testing.assert_array_equal(dirty[2][:, 3], 0.0)


def test_policy_loss_errors():
    args = [jnp.zeros((1, 2))] * 4
    with pytest.raises(ValueError, match=r"must be one of \['vanilla', 'gspo', 'cispo', 'gpg'"):
        loss.compute_policy_loss(*args, policy_loss_mode="ppo")
    with pytest.raises(ValueError, match=r"clip_ratio_c=.* must be > 1"):
        loss.compute_policy_loss(*args, clip_ratio_c=1.0)


def test_modes_are_static_under_jit():
    # Mode strings are Python values bound outside jit; one trace per (mode) and no retrace.
    calls = []

    @functools.partial(jax.jit, static_argnames=("mode", "agg"))
    def step(lp, mode, agg):
        calls.append(mode)
        old = jax.lax.stop_gradient(lp)  # on-policy: ratio 1
        return loss.compute_policy_loss(
            old,
            lp,
            jnp.ones_like(lp),
            jnp.ones_like(lp),
            policy_loss_mode=mode,
            loss_agg_mode=agg,
            **MODE_OPTIONS.get(mode, {}),
        )[0]

    for _ in range(2):
        for mode in loss.POLICY_LOSS_MODES:
            step(jnp.full((2, 3), -1.0), mode=mode, agg="seq-mean-token-mean")
    assert calls == list(loss.POLICY_LOSS_MODES)
    # Ratio 1, A = 1, token-mean: vanilla loss = -A r = -1.
    assert float(step(jnp.full((2, 3), -1.0), mode="vanilla", agg="token-mean")) == -1.0


# ------------------------------------------------------------------------------------------
# SAPO on the CIS row (r = 1.5, 0.5, 1; A = 1, -1, 2), tau_pos = 1 (A > 0), tau_neg = 1.05:
#   gate f = sigmoid(tau (r - 1)) 4 / tau; L = -A f:
#     L = (-4 s(0.5), +4/1.05 s(-0.525), -2 * 4 s(0) = -4); s = sigmoid.
#   df/dlp = f'(r) r = 4 s (1 - s) r (tau cancels), so grad = -A 4 s(1 - s) r / 3.
#   Always seq-mean-token-mean: on one row that is the mean over its 3 tokens.
# ------------------------------------------------------------------------------------------
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_hand_derived():
    s = [_sigmoid(0.5), _sigmoid(1.05 * -0.5), _sigmoid(0.0)]
    losses = [-4 * s[0], 4 / 1.05 * s[1], -2 * 4 * s[2]]
    grads = [-a * 4 * x * (1 - x) * r for a, x, r in zip([1, -1, 2], s, [1.5, 0.5, 1.0])]
    value, metrics, grad = _policy(
        CIS_LP, CIS_OLD, CIS_ADV, np.ones((1, 3)), policy_loss_mode="sapo"
    )
    np.testing.assert_allclose(value, sum(losses) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad, np.array([grads]) / 3, rtol=1e-5)
    assert metrics["actor/pg_clipfrac"] == metrics["actor/pg_clipfrac_lower"] == 0.0
    np.testing.assert_allclose(metrics["actor/ppo_kl"], -math.log(0.75) / 3, rtol=1e-5)


def test_sapo_and_geo_mean_ignore_loss_agg_mode():
    # verl hard-codes sapo's aggregation (seq-mean-token-mean) and geo_mean's (plain mean over
    # rows): every mode gives the same value. PPO_MASK rows have equal lengths, so use a ragged
    # mask to make seq-mean-token-mean differ from token-mean.
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
    for mode in ("sapo", "geo_mean"):
        values = {
            agg: _policy(
                PPO_LP,
                np.zeros_like(PPO_LP),
                PPO_ADV,
                mask,
                policy_loss_mode=mode,
                loss_agg_mode=agg,
            )[0]
            for agg in loss.AGG_MODES
        }
        assert len(set(values.values())) == 1, (mode, values)
    sapo_vanilla = {
        agg: _policy(PPO_LP, np.zeros_like(PPO_LP), PPO_ADV, mask, loss_agg_mode=agg)[0]
        for agg in ("token-mean", "seq-mean-token-mean")
    }
    assert sapo_vanilla["token-mean"] != sapo_vanilla["seq-mean-token-mean"]


# ------------------------------------------------------------------------------------------
# GMPO (geo_mean), eps_low = eps_high = 0.2, old = 0; row 2 fully masked (it still counts).
#   row 0: log r = (ln 1.5, ln 0.5), A = (1, 1): for A > 0 the log-ratio is capped above at
#          0.2 -> (0.2, ln 0.5); mean m0 = (0.2 + ln 0.5) / 2; ratio e^m0; A_seq = 1;
#          L0 = -e^m0. Only token 1 is unclipped: dL/dlp = -A_seq e^m0 / 2.
#   row 1: log r = (ln 1.1, ln 0.5), A = (-1, -1): floored below at -0.2 -> (ln 1.1, -0.2);
#          m1 = (ln 1.1 - 0.2) / 2; A_seq = -1; L1 = +e^m1; token 0 unclipped: +e^m1 / 2.
#   loss = (L0 + L1 + 0) / 3 rows; grads / 3.
#   clipped tokens: row 0 both (A > 0), row 1 token 1 (A < 0): pg_clipfrac = 2/4 and
#   pg_clipfrac_lower = 1/4 of the 4 valid tokens; ppo_kl = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 0.5)/4.
# ------------------------------------------------------------------------------------------
def test_geo_mean_hand_derived():
    lp = np.log(np.array([[1.5, 0.5, 1.0], [1.1, 0.5, 1.0], [1.0, 1.0, 1.0]])).astype(np.float32)
    adv = np.array([[1, 1, 0], [-1, -1, 0], [5, 5, 5]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0]], np.float32)
    m0, m1 = (0.2 + math.log(0.5)) / 2, (math.log(1.1) - 0.2) / 2
    value, metrics, grad = _policy(lp, np.zeros_like(lp), adv, mask, policy_loss_mode="geo_mean")
    np.testing.assert_allclose(value, (-math.exp(m0) + math.exp(m1)) / 3, rtol=1e-5)
    expected = np.array([[0, -math.exp(m0) / 2, 0], [math.exp(m1) / 2, 0, 0], [0, 0, 0]]) / 3
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 2 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], 1 / 4, rtol=1e-6)
    kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(1.1)) / 4
    np.testing.assert_allclose(metrics["actor/ppo_kl"], kl, rtol=1e-5)
    # IS weights enter as their per-row geometric mean: weights 4 and 1 on row 0 scale L0 by 2.
    weights = np.array([[4, 1, 1], [1, 1, 1], [1, 1, 1]], np.float32)
    weighted, _, _ = _policy(
        lp, np.zeros_like(lp), adv, mask, jnp.asarray(weights), policy_loss_mode="geo_mean"
    )
    np.testing.assert_allclose(weighted, (-2 * math.exp(m0) + math.exp(m1)) / 3, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# DPPO, eps_low = eps_high = 0.2, cap clip_ratio_c = 3, token-mean over 5 tokens.
#   p_old = (.5, .5, .5, .5, .1), p = (.8, .6, .25, .45, .4), A = (1, 1, -1, -1, -1);
#   r = p / p_old = (1.6, 1.2, .5, .9, 4); truncated ratio (1.6, 1.2, .5, .9, 3).
#   TV (p - p_old = .3, .1, -.25, -.05, .3): keep A > 0 if <= .2, A <= 0 if >= -.2
#     -> keep (0, 1, 0, 1, 1). L = -A sg(trunc) lp keep; grad = -A trunc keep.
#   KL: binary KL(p_old || p) = p_old ln(p_old / p) + (1 - p_old) ln((1 - p_old) / (1 - p)):
#     t0 .5 ln(.5/.8) + .5 ln(.5/.2) = .5 ln 1.5625 = .223 > .2 with p > p_old -> drop;
#     t2 .5 ln 2 + .5 ln(2/3) = .5 ln(4/3) = .144 <= .2 -> keep (TV drops it); others keep.
#   pg_clipfrac = dropped fraction (TV 2/5, KL 1/5); pg_clipfrac_lower = kept with r > 3 = 1/5.
# ------------------------------------------------------------------------------------------
DPPO_OLD = np.log(np.array([[0.5, 0.5, 0.5, 0.5, 0.1]], np.float32))
DPPO_LP = np.log(np.array([[0.8, 0.6, 0.25, 0.45, 0.4]], np.float32))
DPPO_ADV = np.array([[1, 1, -1, -1, -1]], np.float32)


@pytest.mark.parametrize(
    "mode, keep",
    [("dppo_tv", [0, 1, 0, 1, 1]), ("dppo_kl", [0, 1, 1, 1, 1])],
)
def test_dppo_hand_derived(mode, keep):
    keep = np.array(keep, np.float64)
    trunc = np.array([1.6, 1.2, 0.5, 0.9, 3.0])
    adv = DPPO_ADV[0].astype(np.float64)
    lp = np.log([0.8, 0.6, 0.25, 0.45, 0.4])
    value, metrics, grad = _policy(
        DPPO_LP, DPPO_OLD, DPPO_ADV, np.ones((1, 5)), policy_loss_mode=mode
    )
    np.testing.assert_allclose(value, np.sum(-adv * trunc * lp * keep) / 5, rtol=1e-5)
    np.testing.assert_allclose(grad[0], -adv * trunc * keep / 5, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], (5 - keep.sum()) / 5, rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], 1 / 5, rtol=1e-6)
    kl = -np.log([1.6, 1.2, 0.5, 0.9, 4.0]).sum() / 5
    np.testing.assert_allclose(metrics["actor/ppo_kl"], kl, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# DRO, beta = 0.5, on the CIS row: L = -(lp A - beta/2 (log r)^2), log r = (ln 1.5, ln .5, 0):
#   lp A = (-1, 2, -1) -> L = (1 + .25 ln^2 1.5, -2 + .25 ln^2 .5, 1); grad = -A + beta log r.
# ------------------------------------------------------------------------------------------
def test_dro_hand_derived():
    log_r = np.log([1.5, 0.5, 1.0])
    value, metrics, grad = _policy(
        CIS_LP, CIS_OLD, CIS_ADV, np.ones((1, 3)), policy_loss_mode="dro", dro_beta=0.5
    )
    expected = (1 + 0.25 * log_r[0] ** 2 - 2 + 0.25 * log_r[1] ** 2 + 1) / 3
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad[0], (-CIS_ADV[0] + 0.5 * log_r) / 3, rtol=1e-5)
    assert set(metrics) == {"actor/ppo_kl"}
    np.testing.assert_allclose(metrics["actor/ppo_kl"], -log_r.sum() / 3, rtol=1e-5)
    with pytest.raises(ValueError, match="dro_beta must be a positive"):
        _policy(CIS_LP, CIS_OLD, CIS_ADV, np.ones((1, 3)), policy_loss_mode="dro")


# ------------------------------------------------------------------------------------------
# Covariance selection. One row, lp = (-1, -2, -0.5, -3), A = (1, -1, 2, 0.5), N_tok = 4:
#   mean A = .625, mean lp = -1.625; cov = (A - .625)(lp + 1.625)
#         = (.375 * .625, -1.625 * -.375, 1.375 * 1.125, -.125 * -1.375)
#         = (.234, .609, 1.547, .172)  -> order by cov: t2, t1, t0, t3.
# ------------------------------------------------------------------------------------------
COV_LP = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
COV_ADV = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)


def _old_for(ratios):
    return COV_LP - np.log(np.array([ratios], np.float32))


@pytest.mark.parametrize("ratio, penalised", [(2e-4, [2]), (0.5, [2, 1])])
def test_kl_cov_hand_derived(ratio, penalised):
    # r = (1.5, .5, 1.2, 2). budget max(1, int(ratio * 4)) = 1 or 2: the top-cov tokens get
    # + 0.1 |log r| (grad + 0.1 sign(log r)); L = -A r elsewhere (no clamp, no clip).
    r = np.array([1.5, 0.5, 1.2, 2.0])
    value, metrics, grad = _policy(
        COV_LP, _old_for(r), COV_ADV, np.ones((1, 4)), policy_loss_mode="kl_cov", kl_cov_ratio=ratio
    )
    penalty = np.zeros(4)
    penalty[penalised] = 0.1
    adv = COV_ADV[0].astype(np.float64)
    np.testing.assert_allclose(value, np.sum(-adv * r + penalty * np.abs(np.log(r))) / 4, rtol=1e-5)
    np.testing.assert_allclose(grad[0], (-adv * r + penalty * np.sign(np.log(r))) / 4, rtol=1e-5)
    assert set(metrics) == {"actor/ppo_kl"}  # here the mean |log r|
    np.testing.assert_allclose(metrics["actor/ppo_kl"], np.abs(np.log(r)).mean(), rtol=1e-5)


def test_kl_cov_on_policy_penalty_has_zero_gradient():
    # lp == old: |log r| = 0 with torch's gradient sign(0) = 0, so grad = -A / N exactly.
    _, _, grad = _policy(
        COV_LP, COV_LP, COV_ADV, np.ones((1, 4)), policy_loss_mode="kl_cov", kl_cov_ratio=1.0
    )
    np.testing.assert_array_equal(grad[0], np.float32(-COV_ADV[0] / 4))


def test_token_budget_uses_float64_rounding():
    # verl: max(1, int(0.0003 * 10000)) = 2, as 0.0003 * 10000 = 2.9999999999999996 in float64;
    # float32 gives 3.0000002. kl_cov with lp - old = 0.1 everywhere: the penalty
    # adds 0.1 / N to the gradient of exactly the selected tokens.
    assert int(0.0003 * 10000) == 2 and int(np.float32(0.0003) * np.float32(10000)) == 3
    rng = np.random.default_rng(0)
    lp = rng.normal(-1, 0.5, (2, 5000)).astype(np.float32)
    adv = rng.normal(0, 1, (2, 5000)).astype(np.float32)
    old = lp - np.float32(0.1)
    _, _, grad = _policy(
        lp, old, adv, np.ones_like(lp), policy_loss_mode="kl_cov", kl_cov_ratio=0.0003
    )
    plain = -adv.astype(np.float64) * np.exp(0.1) / lp.size
    assert np.sum(np.abs(grad - plain) > 0.05 / lp.size) == 2


@pytest.mark.parametrize(
    "ratio, ratios, expected_zeroed",
    [
        (2e-4, [1.1, 0.9, 1.0, 1.05], [1]),  # candidates t0, t1 (t2 above ub, t3 below lb)
        (0.5, [1.1, 0.9, 1.0, 1.05], [0, 1]),  # budget 2 covers both candidates
        (0.5, [1.5, 0.9, 1.0, 1.05], [1]),  # t0 already clipped by PPO: not a candidate
    ],
)
def test_clip_cov_hand_derived(ratio, ratios, expected_zeroed):
    # clip_cov_lb = .2, clip_cov_ub = 1: candidates have .2 < cov < 1 and are not clipped;
    # without rng the largest covariance goes first (t1 .609 before t0 .234). Zeroed tokens
    # have L = 0 and grad 0; the others L = max(-A r, -A clamp(r, .8, 1.2)).
    r = np.array(ratios)
    adv = COV_ADV[0].astype(np.float64)
    value, metrics, grad = _policy(
        COV_LP,
        _old_for(ratios),
        COV_ADV,
        np.ones((1, 4)),
        policy_loss_mode="clip_cov",
        clip_cov_ratio=ratio,
        clip_cov_lb=0.2,
        clip_cov_ub=1.0,
    )
    token_loss = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2))
    token_grad = np.where(-adv * r >= -adv * np.clip(r, 0.8, 1.2), -adv * r, 0.0)
    token_loss[expected_zeroed] = token_grad[expected_zeroed] = 0.0
    np.testing.assert_allclose(value, token_loss.sum() / 4, rtol=1e-5)
    np.testing.assert_allclose(grad[0], token_grad / 4, rtol=1e-5, atol=1e-8)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl"}
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], len(expected_zeroed) / 4, rtol=1e-6)


def test_clip_cov_random_pick_is_a_seeded_uniform_subset_of_the_candidates():
    # verl detaches perm[:k] of the candidates (torch.randperm): each candidate with probability
    # k / |C|, never another token, k = max(1, int(ratio N_tok)) every draw. Over 4000 keys a
    # candidate's count is Binomial(4000, k / |C|) under a uniform pick; 5 standard deviations
    # bound all |C| counts at once with a false alarm below 1e-4. A pick biased to the largest
    # covariance (the pick without a key) detaches the same k tokens on every draw. The same
    # key draws the same tokens.
    rng = np.random.default_rng(1)
    lp = rng.normal(-1, 0.5, (4, 16)).astype(np.float32)
    old = lp - rng.normal(0, 0.05, lp.shape).astype(np.float32)  # no PPO clipping
    adv = rng.normal(0, 1, lp.shape).astype(np.float32)
    mask = (rng.random(lp.shape) > 0.2).astype(np.float32)
    cov = (adv - adv[mask > 0].mean()) * (lp - lp[mask > 0].mean())
    candidates = (mask > 0) & (cov > 0.05) & (cov < 0.8)
    k, num_candidates = int(0.1 * mask.sum()), int(candidates.sum())
    assert 1 < k < num_candidates

    def detached(key):
        grad = jax.grad(
            lambda x: loss.compute_policy_loss(
                jnp.asarray(old), x, jnp.asarray(adv), jnp.asarray(mask),
                policy_loss_mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=0.05,
                clip_cov_ub=0.8, rng=key,
            )[0]
        )(jnp.asarray(lp))  # fmt: skip
        return (grad == 0) & (jnp.asarray(mask) > 0)

    draws = 4000
    keys = jax.random.split(jax.random.key(7), draws)
    chosen = np.asarray(jax.jit(jax.vmap(detached))(keys))
    assert (chosen.sum(axis=(1, 2)) == k).all()
    assert not (chosen & ~candidates).any()
    p = k / num_candidates
    counts = chosen.sum(axis=0)[candidates]
    assert np.abs(counts - draws * p).max() < 5 * np.sqrt(draws * p * (1 - p))
    np.testing.assert_array_equal(np.asarray(jax.jit(detached)(keys[3])), chosen[3])


# ------------------------------------------------------------------------------------------
# A user loss through the registry: L = -A lp times a user setting `scale`, token-mean.
# ------------------------------------------------------------------------------------------
@loss.register_policy_loss("test_scaled_reinforce")
def _scaled_reinforce(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, **kwargs
):
    loss_BT = -kwargs["scale"] * advantages * log_prob
    info = {k: kwargs[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
    value = loss.agg_loss(loss_BT, response_mask, loss_agg_mode, **info)
    return value, {"test/clip_ratio_high": jnp.float32(kwargs["clip_ratio_high"])}


def test_registered_policy_loss_runs_through_the_dispatchers_under_jit():
    # CIS row: -A lp = (1, -2, 1), mean 0; with scale 3 and A' = A + 1 = (2, 0, 3):
    # -3 A' lp = (6, 0, 4.5) -> mean 3.5; grad -3 A' / 3 = (-2, 0, -3).
    assert "test_scaled_reinforce" in loss.policy_loss_mode_names()
    assert "test_scaled_reinforce" not in loss.POLICY_LOSS_MODES

    @jax.jit
    def run(lp):
        return loss.actor_loss(
            jnp.asarray(CIS_OLD),
            lp,
            jnp.asarray(CIS_ADV) + 1.0,
            jnp.ones((1, 3)),
            policy_loss_mode="test_scaled_reinforce",
            clip_ratio_high=0.28,
            policy_loss_kwargs={"scale": 3.0},
        )

    (value, metrics), grad = jax.value_and_grad(run, has_aux=True)(jnp.asarray(CIS_LP))
    np.testing.assert_allclose(float(value), 3.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[-2.0, 0.0, -3.0]], rtol=1e-6)
    assert set(metrics) == {"actor/pg_loss", "test/clip_ratio_high"}
    np.testing.assert_allclose(float(metrics["test/clip_ratio_high"]), 0.28, rtol=1e-6)


def test_register_policy_loss_errors():
    with pytest.raises(ValueError, match="built in"):
        loss.register_policy_loss("vanilla")
    with pytest.raises(ValueError, match="already registered"):
        loss.register_policy_loss("test_scaled_reinforce")(lambda *a, **k: None)
    loss.register_policy_loss("test_scaled_reinforce")(_scaled_reinforce)  # same function: no-op
    with pytest.raises(ValueError, match="non-empty string"):
        loss.register_policy_loss("")
    args = [jnp.zeros((1, 2))] * 4
    with pytest.raises(ValueError, match=r"must be one of \['vanilla', .*'dro', .*'test_scaled_reinforce'"):
        loss.compute_policy_loss(*args, policy_loss_mode="no_such_policy_loss")
    with pytest.raises(TypeError, match="takes no extra keyword"):
        loss.compute_policy_loss(*args, scale=2.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be > 0"):
        loss.compute_policy_loss(*args, policy_loss_mode="kl_cov", kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_ratio must be > 0"):
        loss.compute_policy_loss(*args, policy_loss_mode="clip_cov", clip_cov_ratio=0.0)


def test_actor_loss_passes_policy_loss_kwargs():
    # sapo with other temperatures through actor_loss equals compute_policy_loss directly.
    args = [jnp.asarray(x) for x in (CIS_OLD, CIS_LP, CIS_ADV)] + [jnp.ones((1, 3))]
    settings = {"tau_pos": 2.0, "tau_neg": 3.0}
    direct, _ = loss.compute_policy_loss(*args, policy_loss_mode="sapo", **settings)
    value, metrics = loss.actor_loss(*args, policy_loss_mode="sapo", policy_loss_kwargs=settings)
    assert float(value) == float(direct) == float(metrics["actor/pg_loss"])
    assert float(value) != float(loss.actor_loss(*args, policy_loss_mode="sapo")[0])


# ------------------------------------------------------------------------------------------
# actor_loss. GPG tokens above: pg = 0. entropy (1, 2, 3) -> token-mean 2; entropy_coeff 0.01
# -> -0.02. k1 with lp - ref = (0.3, -0.3, 0.6) -> mean 0.2; kl_loss_coef 0.5 -> +0.1.
# loss = 0 - 0.02 + 0.1 = 0.08.
# ------------------------------------------------------------------------------------------
def test_actor_loss_combines_terms_with_verl_metric_names():
    ref = CIS_LP - np.array([[0.3, -0.3, 0.6]], np.float32)
    value, metrics = loss.actor_loss(
        jnp.asarray(CIS_OLD),
        jnp.asarray(CIS_LP),
        jnp.asarray(CIS_ADV),
        jnp.ones((1, 3)),
        ref_log_prob=jnp.asarray(ref),
        entropy=jnp.asarray([[1.0, 2.0, 3.0]]),
        policy_loss_mode="gpg",
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        kl_loss_type="k1",
    )
    np.testing.assert_allclose(float(value), 0.08, rtol=1e-5, atol=1e-7)
    assert set(metrics) == {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/kl_coef"}
    np.testing.assert_allclose(float(metrics["actor/entropy"]), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["actor/kl_loss"]), 0.2, rtol=1e-5)

    value, metrics = loss.actor_loss(
        jnp.asarray(PPO_LP * 0),
        jnp.asarray(PPO_LP),
        jnp.asarray(PPO_ADV),
        jnp.asarray(PPO_MASK),
        clip_ratio_high=0.28,
    )  # vanilla, no entropy, no KL: just the hand-derived pg loss
    np.testing.assert_allclose(float(value), 4.42 / 6, rtol=1e-5)
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
    }


def test_actor_loss_errors():
    args = [jnp.zeros((1, 2))] * 4
    with pytest.raises(ValueError, match="entropy_coeff"):
        loss.actor_loss(*args, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="needs ref_log_prob"):
        loss.actor_loss(*args, use_kl_loss=True)


# ------------------------------------------------------------------------------------------
# Log-probs and entropy.
#   logits (0, 0, 0, 0): log p = -ln 4 for any label, H = ln 4.
#   logits (0, ln 3): p = (1/4, 3/4); label 1 -> ln(3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4).
# ------------------------------------------------------------------------------------------
def test_logprobs_and_entropy_hand_derived():
    uniform = jnp.zeros((1, 4))
    np.testing.assert_allclose(
        float(loss.logprobs_from_logits(uniform, jnp.asarray([2]))[0]), -math.log(4), rtol=1e-6
    )
    np.testing.assert_allclose(float(loss.entropy_from_logits(uniform)[0]), math.log(4), rtol=1e-6)
    skewed = jnp.asarray([[0.0, math.log(3.0)]])
    np.testing.assert_allclose(
        float(loss.logprobs_from_logits(skewed, jnp.asarray([1]))[0]), math.log(0.75), rtol=1e-6
    )
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    np.testing.assert_allclose(float(loss.entropy_from_logits(skewed)[0]), h, rtol=1e-6)
    # Chunked path, temperature 2 on logits (0, 2 ln 3): same distribution as (0, ln 3).
    lp, ent = loss.logprobs_and_entropy_chunked(
        jnp.asarray([[[0.0, 2 * math.log(3.0)]]]), jnp.asarray([[1]]), temperature=2.0
    )
    np.testing.assert_allclose(float(lp[0, 0]), math.log(0.75), rtol=1e-6)
    np.testing.assert_allclose(float(ent[0, 0]), h, rtol=1e-6)


def _dense_objective(z, labels, g_lp, g_ent, temperature):
    z = z.astype(jnp.float32) / temperature
    return jnp.sum(g_lp * loss.logprobs_from_logits(z, labels)) + jnp.sum(
        g_ent * loss.entropy_from_logits(z)
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 6, 1024])
def test_chunked_matches_dense_value_and_gradient(dtype, chunk_size):
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(0, 3, (3, 5, 13)), dtype)
    labels = jnp.asarray(rng.integers(0, 13, (3, 5)), jnp.int32)
    g_lp = jnp.asarray(rng.normal(0, 1, (3, 5)), jnp.float32)
    g_ent = jnp.asarray(rng.normal(0, 1, (3, 5)), jnp.float32)

    def chunked(x):
        lp, ent = loss.logprobs_and_entropy_chunked(
            x, labels, chunk_size=chunk_size, temperature=0.7
        )
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent)

    value, grad = jax.value_and_grad(chunked)(z)
    ref, ref_grad = jax.value_and_grad(_dense_objective)(z, labels, g_lp, g_ent, 0.7)
    # Chunks change the summation order only: bounded at the scale of the objective's terms
    # (15 log-probs and entropies of logits of scale 3 / 0.7, weighted by N(0, 1): ~10 each).
    numerics.assert_close(value, ref, ulps=CHUNK_ULPS, scale=150.0)
    assert grad.dtype == dtype
    # bf16 logits: the gradient is rounded to bf16 (2^-8 relative, 2^15 float32 ulps).
    ulps = CHUNK_ULPS if dtype == jnp.float32 else 2**15
    numerics.assert_close(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), ulps=ulps)


@pytest.mark.parametrize("chunk_size", [4, 7, 64])  # 7 does not divide B*T = 15: zero padding
def test_from_hidden_matches_dense_value_and_gradients(chunk_size):
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(0, 1, (3, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (8, 17)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 17, (3, 5)), jnp.int32)
    g_lp = jnp.asarray(rng.normal(0, 1, (3, 5)), jnp.float32)
    g_ent = jnp.asarray(rng.normal(0, 1, (3, 5)), jnp.float32)

    def chunked(h, w):
        lp, ent = loss.logprobs_and_entropy_from_hidden(
            h, lambda x: x @ w, labels, chunk_size=chunk_size, temperature=1.3
        )
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent)

    def dense(h, w):
        return _dense_objective(h @ w, labels, g_lp, g_ent, 1.3)

    value, grads = jax.value_and_grad(chunked, argnums=(0, 1))(h, w)
    ref, ref_grads = jax.value_and_grad(dense, argnums=(0, 1))(h, w)
    numerics.assert_close(value, ref, ulps=CHUNK_ULPS, scale=150.0)  # as above
    for g, r, name in zip(grads, ref_grads, ("h", "w"), strict=True):
        numerics.assert_close(g, r, ulps=CHUNK_ULPS, err_msg=name)


def test_from_hidden_skips_chunks_without_valid_rows():
    # 4 chunks of 5 rows; rows 0-6 wanted (chunks 0, 1), chunks 2 and 3 hold none: their rows
    # read 0 and take no gradient, and the wanted rows match the unmasked values and gradients.
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(0, 1, (2, 10, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (8, 17)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 17, (2, 10)), jnp.int32)
    valid = jnp.arange(20).reshape(2, 10) < 7
    g_lp = jnp.asarray(rng.normal(0, 1, (2, 10)), jnp.float32) * valid
    g_ent = jnp.asarray(rng.normal(0, 1, (2, 10)), jnp.float32) * valid

    def run(h, w, valid):
        lp, ent = loss.logprobs_and_entropy_from_hidden(
            h, lambda x: x @ w, labels, chunk_size=5, temperature=1.3, valid=valid
        )
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent), (lp, ent)

    (value, (lp, ent)), grads = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(h, w, valid)
    (ref, (lp_all, ent_all)), ref_grads = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(
        h, w, None
    )
    chunk_valid = np.asarray(valid).reshape(4, 5).any(1).repeat(5).reshape(2, 10)
    np.testing.assert_array_equal(np.asarray(lp)[~chunk_valid], 0.0)
    np.testing.assert_array_equal(np.asarray(ent)[~chunk_valid], 0.0)
    numerics.assert_close(np.asarray(lp)[chunk_valid], np.asarray(lp_all)[chunk_valid], ulps=4)
    numerics.assert_close(value, ref, ulps=CHUNK_ULPS, scale=150.0)
    for g, r, name in zip(grads, ref_grads, ("h", "w"), strict=True):
        numerics.assert_close(g, r, ulps=CHUNK_ULPS, err_msg=name)
    np.testing.assert_array_equal(np.asarray(grads[0])[~chunk_valid], 0.0)
    # Nothing valid: every chunk is skipped, so even the wanted rows' cotangents reach nothing.
    none = jnp.zeros((2, 10), bool)
    _, (g_h, g_w) = jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(h, w, none)
    assert not np.asarray(g_h).any() and not np.asarray(g_w).any()
    with pytest.raises(ValueError, match="valid"):
        run(h, w, valid[:, :5])


def test_chunked_paths_bound_memory():
    # B*T = 4096 rows, V = 2048: one float32 [N, V] array is 32 MiB. From hidden states nothing
    # [N, V] may be live; from logits, only the gradient output itself (not a temp).
    n, dim, vocab, chunk = 4096, 16, 2048, 256
    h = jnp.zeros((1, n, dim))
    w = jnp.zeros((dim, vocab))
    labels = jnp.zeros((1, n), jnp.int32)
    f32_copy = n * vocab * 4

    def from_hidden(h, w):
        lp, ent = loss.logprobs_and_entropy_from_hidden(
            h, lambda x: x @ w, labels, chunk_size=chunk
        )
        return jnp.sum(lp) + jnp.sum(ent)

    def from_logits(z):
        lp, ent = loss.logprobs_and_entropy_chunked(z, labels, chunk_size=chunk)
        return jnp.sum(lp) + jnp.sum(ent)

    def dense_from_hidden(h, w):
        return _dense_objective(h @ w, labels, 1.0, 1.0, 1.0)

    assert _temp_bytes(jax.grad(from_hidden, argnums=(0, 1)), h, w) < f32_copy / 4
    # The check can fail: the unchunked path materialises the [N, V] logits.
    assert _temp_bytes(jax.grad(dense_from_hidden, argnums=(0, 1)), h, w) >= f32_copy
    z = jnp.zeros((1, n, vocab))
    assert _temp_bytes(jax.grad(from_logits), z) < f32_copy / 4


def test_skipping_chunks_saves_no_logits_for_the_backward():
    # valid= skips chunks with lax.cond inside the checkpointed chunk. A checkpoint inside the
    # cond instead would save every chunk's logits for the backward: 169 MiB of temporaries
    # here against 48 (one float32 [N, V] copy is 64 MiB; 1,134 against 313 MiB at the demo's
    # 2,048 slots x 576 x 49,152).
    n, dim, vocab, chunk = 1024, 256, 16384, 128
    h, w = jnp.zeros((1, n, dim)), jnp.zeros((dim, vocab))
    labels = jnp.zeros((1, n), jnp.int32)
    valid = jnp.arange(n).reshape(1, n) < n // 2

    def from_hidden(h, w, valid):
        lp, ent = loss.logprobs_and_entropy_from_hidden(
            h, lambda x: x @ w, labels, chunk_size=chunk, valid=valid
        )
        return jnp.sum(lp) + jnp.sum(ent)

    assert _temp_bytes(jax.grad(from_hidden, argnums=(0, 1)), h, w, valid) < n * vocab * 4


def test_logprob_errors():
    with pytest.raises(ValueError, match="temperature=.* must be > 0"):
        loss.logprobs_and_entropy_chunked(
            jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), int), temperature=0
        )
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        loss.logprobs_and_entropy_chunked(
            jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), int), chunk_size=0
        )
    with pytest.raises(ValueError, match="do not match"):
        loss.logprobs_and_entropy_from_hidden(
            jnp.zeros((1, 2, 3)), lambda x: x, jnp.zeros((1, 3), int)
        )
