"""Tests for grpo_jax.advantage: hand-derived GRPO / Dr.GRPO / RLOO values and invariants."""

import functools

import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax import advantage

EPS = 1e-6

# Seven rows, T = 3, in three non-contiguous groups of unequal size:
#   group 0 = rows 0, 2, 4, 6 with scores 1, 0, 1, 1
#   group 1 = rows 1, 5       with scores 2, 4
#   group 2 = row 3 (a singleton) with score 5
GROUP_IDS = np.array([0, 1, 0, 2, 0, 1, 0], np.int32)
REWARDS = np.array(
    [
        [0.0, 0.0, 1.0],
        [0.0, 2.0, 0.0],
        [0.0, 0.0, 0.0],
        [5.0, 0.0, 0.0],
        [0.5, 0.0, 0.5],  # score 1 = 0.5 + 0.5: the second half sits at a masked position
        [0.0, 0.0, 4.0],
        [1.0, 0.0, 0.0],
    ],
    np.float32,
)
MASK = np.array(
    [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], np.float32
)


def _per_row(adv_BT):
    """Recovers the per-row scalar from a [B, T] advantage (first column; mask[:, 0] is 1)."""
    return np.asarray(adv_BT)[:, 0]


def test_grpo_hand_derived():
    # Group 0: mean (1+0+1+1)/4 = 0.75, deviations (0.25, -0.75, 0.25, 0.25),
    #   unbiased var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std = 0.5 -> dev / (0.5 + 1e-6).
    # Group 1: mean 3, deviations (-1, +1), var = 2 / 1, std = sqrt(2) -> -+1 / (sqrt(2) + 1e-6).
    # Group 2 (singleton): mean 0, std 1 -> 5 / (1 + 1e-6).
    # Row 4's score counts the 0.5 at a masked position: verl sums rewards unmasked.
    s2 = np.sqrt(2.0)
    expected_B = np.array(
        [0.25 / 0.500001, -1 / (s2 + EPS), -0.75 / 0.500001, 5 / (1 + EPS), 0.25 / 0.500001]
        + [1 / (s2 + EPS), 0.25 / 0.500001]
    )
    adv, returns = advantage.compute_grpo_outcome_advantage(
        jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS)
    )
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(returns))
    assert adv.dtype == jnp.float32


def test_dr_grpo_hand_derived():
    # norm_adv_by_std_in_grpo=False: only the group mean is subtracted (singleton mean is 0).
    expected_B = np.array([0.25, -1.0, -0.75, 5.0, 0.25, 1.0, 0.25])
    adv, _ = advantage.compute_grpo_outcome_advantage(
        jnp.asarray(REWARDS),
        jnp.asarray(MASK),
        jnp.asarray(GROUP_IDS),
        norm_adv_by_std_in_grpo=False,
    )
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)


def test_rloo_hand_derived():
    # a_i = s_i - mean of the other members of its group:
    #   group 0: 1 - (0+1+1)/3 = 1/3, 0 - (1+1+1)/3 = -1; group 1: 2 - 4 = -2, 4 - 2 = 2;
    #   the singleton keeps its raw score 5 (verl's rloo loop).
    expected_B = np.array([1 / 3, -2.0, -1.0, 5.0, 1 / 3, 2.0, 1 / 3])
    adv, returns = advantage.compute_rloo_outcome_advantage(
        jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS)
    )
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(returns))


def test_num_groups_bound_and_empty_groups():
    # Ids 0..2 under a bound of 10: groups 3..9 are empty and change nothing.
    args = jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS)
    wide, _ = advantage.compute_grpo_outcome_advantage(*args, num_groups=10)
    default, _ = advantage.compute_grpo_outcome_advantage(*args)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(default))


@pytest.mark.parametrize("bad_ids", [[0, 1, 0, 2, 0, 1, 7], [0, 1, 0, -1, 0, 1, 0]])
def test_out_of_range_group_ids_raise(bad_ids):
    with pytest.raises(ValueError, match="group_ids must lie in"):
        advantage.compute_grpo_outcome_advantage(
            jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(bad_ids, jnp.int32)
        )


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        advantage.compute_grpo_outcome_advantage(
            jnp.ones((7,)), jnp.ones((7,)), jnp.asarray(GROUP_IDS)
        )
    with pytest.raises(ValueError, match="group_ids must be"):
        advantage.compute_rloo_outcome_advantage(
            jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.zeros((6,), jnp.int32)
        )


# ------------------------------------------------------------------------------------------
# Properties. Shapes are fixed (P = 4 groups of G = 3) so one compilation serves all examples.
# ------------------------------------------------------------------------------------------

P, G, T = 4, 3, 5
_grpo = jax.jit(
    advantage.compute_grpo_outcome_advantage,
    static_argnames=("num_groups", "norm_adv_by_std_in_grpo"),
)
_rloo = jax.jit(advantage.compute_rloo_outcome_advantage, static_argnames=("num_groups",))
_scores = hnp.arrays(
    np.float32, (P * G,), elements=st.floats(-4, 4, width=32, allow_subnormal=False)
)
_settings = hypothesis.settings(max_examples=25, deadline=None, derandomize=True)


def _rewards_at_last_token(score_B):
    rewards_BT = np.zeros((score_B.shape[0], T), np.float32)
    rewards_BT[:, -1] = score_B
    return rewards_BT


def _grpo_contiguous(score_B, norm):
    """GRPO advantages [B, T] for P contiguous groups of G rows, all-ones mask."""
    gid_B = np.repeat(np.arange(P, dtype=np.int32), G)
    mask_BT = np.ones((P * G, T), np.float32)
    adv, _ = _grpo(_rewards_at_last_token(score_B), mask_BT, gid_B, norm_adv_by_std_in_grpo=norm)
    return adv


@_settings
@hypothesis.given(score_B=_scores, perm=st.permutations(range(P * G)))
def test_permuting_rows_permutes_advantages(score_B, perm):
    perm = np.asarray(perm)
    gid_B = np.repeat(np.arange(P, dtype=np.int32), G)
    rewards_BT, mask_BT = _rewards_at_last_token(score_B), np.ones((P * G, T), np.float32)
    for fn in (_grpo, _rloo):
        adv, _ = fn(rewards_BT, mask_BT, gid_B)
        adv_perm, _ = fn(rewards_BT[perm], mask_BT[perm], gid_B[perm])
        np.testing.assert_allclose(
            np.asarray(adv_perm), np.asarray(adv)[perm], rtol=1e-5, atol=1e-5
        )


@_settings
@hypothesis.given(score_B=_scores, norm=st.booleans())
def test_contiguous_groups_equal_reshape_reference(score_B, norm):
    # Reference in float64 with the [P, G] reshape that the implementation must not rely on.
    score_PG = score_B.astype(np.float64).reshape(P, G)
    centered_PG = score_PG - score_PG.mean(axis=1, keepdims=True)
    expected_PG = centered_PG / (score_PG.std(axis=1, ddof=1, keepdims=True) + EPS)
    expected_PG = expected_PG if norm else centered_PG
    adv = _grpo_contiguous(score_B, norm)
    # float32 loses ~1e-7 relative on the centred score; divided by a std that can be ~1e-3.
    scale = 1.0 / (score_PG.std(axis=1, ddof=1) + EPS).min() if norm else 1.0
    np.testing.assert_allclose(
        _per_row(adv), expected_PG.reshape(-1), rtol=1e-5, atol=1e-6 * max(1.0, 10 * scale)
    )
    gid_B = np.repeat(np.arange(P, dtype=np.int32), G)
    rloo, _ = _rloo(_rewards_at_last_token(score_B), np.ones((P * G, T), np.float32), gid_B)
    np.testing.assert_allclose(_per_row(rloo), (centered_PG * G / (G - 1)).reshape(-1), atol=1e-5)


@_settings
@hypothesis.given(
    value_P=hnp.arrays(np.float32, (P,), elements=st.sampled_from([0.0, 1.0])),
    norm=st.booleans(),
)
def test_zero_variance_binary_groups_get_exactly_zero(value_P, norm):
    # Every member of a group has the same 0/1 reward: mean is exact, so the advantage is 0, not
    # NaN (std + eps = 1e-6 > 0).
    adv = _grpo_contiguous(np.repeat(value_P, G), norm)
    np.testing.assert_array_equal(np.asarray(adv), 0.0)


def test_vmap_over_independent_batches():
    # vmap over two copies with different group layouts equals two separate calls.
    rewards = jnp.stack([jnp.asarray(REWARDS), 2.0 * jnp.asarray(REWARDS)])
    masks = jnp.stack([jnp.asarray(MASK)] * 2)
    gids = jnp.stack([jnp.asarray(GROUP_IDS), jnp.zeros(7, jnp.int32)])
    fn = functools.partial(advantage.compute_grpo_outcome_advantage, num_groups=7)
    batched, _ = jax.vmap(fn)(rewards, masks, gids)
    for i in range(2):
        single, _ = fn(rewards[i], masks[i], gids[i])
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(single), rtol=1e-6)
