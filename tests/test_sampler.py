"""Tests for grpo_jax.sampler: token selection, bucketing, and the grouped KV-cache sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import sampler

# ---------------------------------------------------------------------------------------------
# Bucketing.


def test_bucket_length_rounds_up_to_the_multiple():
    # ceil(t / 64) * 64: 1..64 -> 64, 65..128 -> 128.
    assert [sampler.bucket_length(t) for t in (1, 63, 64, 65, 128, 129)] == [
        64,
        64,
        64,
        128,
        128,
        192,
    ]
    assert sampler.bucket_length(9, multiple=8) == 16
    assert sampler.bucket_length(5, multiple=1) == 5


@pytest.mark.parametrize("t, multiple", [(0, 64), (-3, 64), (5, 0)])
def test_bucket_length_rejects_bad_arguments(t, multiple):
    with pytest.raises(ValueError):
        sampler.bucket_length(t, multiple)


# ---------------------------------------------------------------------------------------------
# top-k / top-p filtering.

# probs [0.5, 0.3, 0.15, 0.05]; ascending order 0.05, 0.15, 0.3, 0.5 with cumulative sums
# 0.05, 0.2, 0.5, 1.0 (HF's top-p drops the ascending prefix whose cumsum is <= 1 - top_p).
_PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        (-1, 1.0, [0, 1, 2, 3]),  # both off
        (0, 1.0, [0, 1, 2, 3]),  # top_k=0 is off too (vLLM)
        (2, 1.0, [0, 1]),
        (4, 1.0, [0, 1, 2, 3]),  # k == V
        (9, 1.0, [0, 1, 2, 3]),  # k > V
        (-1, 0.75, [0, 1]),  # 1-p = 0.25: drops cumsums 0.05, 0.2
        (-1, 0.4, [0]),  # 1-p = 0.6: drops 0.05, 0.2, 0.5
        (-1, 1e-6, [0]),  # the most likely token is always kept
        # top-k first: the top-2 renormalise to 0.625, 0.375; ascending cumsum 0.375, 1.0;
        # 1-p = 0.5 drops token 1.
        (2, 0.5, [0]),
        (3, 0.9, [0, 1, 2]),  # top-3 probs /0.95: cumsum 0.158, 0.474, 1.0; 1-p=0.1 drops none
    ],
)
def test_top_k_top_p_filter_hand_derived(top_k, top_p, kept):
    logits_BV = jnp.log(jnp.asarray(_PROBS))[None] + 3.0  # a shift must not matter
    out_BV = sampler.top_k_top_p_filter(logits_BV, top_k=top_k, top_p=top_p)
    expected_kept = np.zeros(4, bool)
    expected_kept[kept] = True
    np.testing.assert_array_equal(np.isfinite(out_BV[0]), expected_kept)
    np.testing.assert_array_equal(out_BV[0][expected_kept], logits_BV[0][expected_kept])


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.9), (-1, 0.3), (20, 0.8), (1, 0.5)])
def test_top_k_top_p_filter_matches_hf_warpers(top_k, top_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(0).normal(size=(16, 50)).astype(np.float32) * 2.0
    expected = torch.from_numpy(logits)
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    out = sampler.top_k_top_p_filter(jnp.asarray(logits), top_k=top_k, top_p=top_p)
    np.testing.assert_array_equal(np.asarray(out), expected.numpy())


# ---------------------------------------------------------------------------------------------
# Token selection and keys.


def test_typed_and_legacy_keys_give_the_same_row_keys():
    typed = sampler.row_keys(jax.random.key(3), 4)
    legacy = sampler.row_keys(jax.random.PRNGKey(3), 4)
    np.testing.assert_array_equal(jax.random.key_data(typed), jax.random.key_data(legacy))
    # Row b's key does not depend on the number of rows, and rows differ.
    np.testing.assert_array_equal(
        jax.random.key_data(sampler.row_keys(jax.random.key(3), 2)),
        jax.random.key_data(typed[:2]),
    )
    assert len({tuple(np.asarray(k).tolist()) for k in jax.random.key_data(typed)}) == 4


def test_as_typed_key_rejects_other_arrays():
    with pytest.raises(TypeError):
        sampler.as_typed_key(jnp.zeros((3,), jnp.uint32))
    with pytest.raises(ValueError):
        sampler.as_typed_key(jax.random.split(jax.random.key(0), 2))


def test_top_k_one_and_temperature_zero_are_greedy():
    logits_BV = jax.random.normal(jax.random.key(0), (64, 100)) * 3.0
    keys_B = sampler.row_keys(jax.random.key(1), 64)
    greedy_B, greedy_logp_B = sampler.select_tokens(
        logits_BV, keys_B, temperature=0.0, top_k=-1, top_p=1.0
    )
    np.testing.assert_array_equal(greedy_B, jnp.argmax(logits_BV, axis=-1))
    np.testing.assert_allclose(
        greedy_logp_B, jnp.max(jax.nn.log_softmax(logits_BV, axis=-1), axis=-1), rtol=1e-6
    )
    top1_B, top1_logp_B = sampler.select_tokens(
        logits_BV, keys_B, temperature=0.7, top_k=1, top_p=1.0
    )
    np.testing.assert_array_equal(top1_B, greedy_B)
    # Unrenormalised: log_softmax(logits / 0.7) at the argmax, not log(1) = 0.
    np.testing.assert_allclose(
        top1_logp_B, jnp.max(jax.nn.log_softmax(logits_BV / 0.7, axis=-1), axis=-1), rtol=1e-6
    )


# chi2.ppf(0.999, df) for df = 1..5 (standard table values); the test is seeded, so it either
# always passes or always fails, and a 0.1 % false-alarm level keeps it meaningful.
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.mark.parametrize(
    "temperature, top_k, top_p, expected",
    [
        # Plain softmax of log([.4,.3,.15,.1,.05]).
        (1.0, -1, 1.0, [0.4, 0.3, 0.15, 0.1, 0.05]),
        # T=0.5 squares the probabilities: [.16,.09,.0225,.01,.0025] / 0.285.
        (0.5, -1, 1.0, [0.16 / 0.285, 0.09 / 0.285, 0.0225 / 0.285, 0.01 / 0.285, 0.0025 / 0.285]),
        # top_k=3 renormalises the first three: [.4,.3,.15] / .85.
        (1.0, 3, 1.0, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
        # top_p=0.8: ascending cumsums .05,.15,.3,.6,1.0; 1-p=.2 drops tokens 4, 3 -> [.4,.3,.15]/.85.
        (1.0, -1, 0.8, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
    ],
)
def test_sampled_distribution_chi_square(temperature, top_k, top_p, expected):
    num_draws = 20_000
    probs_V = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(probs_V, jnp.float32)), (num_draws, 5))
    keys_B = sampler.row_keys(jax.random.key(42), num_draws)
    tokens_B, logp_B = jax.jit(
        sampler.select_tokens, static_argnames=("temperature", "top_k", "top_p")
    )(logits_BV, keys_B, temperature=temperature, top_k=top_k, top_p=top_p)
    counts_V = np.bincount(np.asarray(tokens_B), minlength=5)
    expected_V = np.asarray(expected) * num_draws
    support = expected_V > 0
    assert counts_V[~support].sum() == 0, "drew a filtered-out token"
    chi2 = float((((counts_V - expected_V) ** 2)[support] / expected_V[support]).sum())
    assert chi2 < _CHI2_999[int(support.sum()) - 1], (chi2, counts_V, expected_V)
    # log_probs are log_softmax(logits / T) at the token, never renormalised by the filters.
    full_logp_V = np.log(probs_V ** (1 / temperature) / (probs_V ** (1 / temperature)).sum())
    np.testing.assert_allclose(logp_B, full_logp_V[np.asarray(tokens_B)], rtol=1e-5)


def test_inverse_cdf_sparse_support_and_edges():
    # V = 300 is not a multiple of the 128-token chunk; only tokens 5 (weight 1) and 290 (weight 3)
    # can be drawn, so u < 1/4 gives 5 and u >= 1/4 gives 290 (cumulative weights 1, 4).
    probs_V = np.zeros(300, np.float32)
    probs_V[[5, 290]] = [1.0, 3.0]
    u_B = jnp.asarray([0.0, 0.2, 0.2499, 0.2501, 0.9, np.nextafter(np.float32(1), 0)], jnp.float32)
    probs_BV = jnp.broadcast_to(jnp.asarray(probs_V), (6, 300))
    tokens_B = sampler.categorical_inverse_cdf(probs_BV, u_B)
    np.testing.assert_array_equal(tokens_B, [5, 5, 5, 290, 290, 290])
    # Rounding can push u * total past the last cumulative sum: the last positive token wins,
    # never the zero-weight tail (tokens 291..383 of the padded last chunk).
    tokens_B = sampler.categorical_inverse_cdf(probs_BV[:1] * 1e-30, jnp.asarray([0.9999999]))
    np.testing.assert_array_equal(tokens_B, [290])
