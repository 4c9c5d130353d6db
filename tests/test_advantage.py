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


# ------------------------------------------------------------------------------------------
# The other estimators, hand-derived on the fixture above. Scores s = (1, 2, 0, 5, 1, 4, 1);
# group 0 = rows 0, 2, 4, 6 (s = 1, 0, 1, 1), group 1 = rows 1, 5 (2, 4), group 2 = row 3.
# ------------------------------------------------------------------------------------------
ARGS = (jnp.asarray(REWARDS), jnp.asarray(MASK), jnp.asarray(GROUP_IDS))


def test_grpo_vectorized_is_grpo():
    for norm in (True, False):
        vec, ret = advantage.grpo_vectorized(*ARGS, norm_adv_by_std_in_grpo=norm)
        loop, _ = advantage.compute_grpo_outcome_advantage(*ARGS, norm_adv_by_std_in_grpo=norm)
        np.testing.assert_array_equal(np.asarray(vec), np.asarray(loop))
        assert vec is ret


def test_rloo_vectorized_hand_derived():
    # (n s - sum) / (n - 1): group 0 (n 4, sum 3): (4 - 3)/3 = 1/3, (0 - 3)/3 = -1; group 1
    # (n 2, sum 6): 4 - 6 = -2, 8 - 6 = 2; the singleton gets 0 (the loop rloo keeps 5).
    expected_B = np.array([1 / 3, -2.0, -1.0, 0.0, 1 / 3, 2.0, 1 / 3])
    adv, _ = advantage.rloo_vectorized(*ARGS)
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)


def test_grpo_passk_hand_derived():
    # Row 3 joins group 1: group 0 (1, 0, 1, 1) ties at the top -> all 0; group 1 = rows 1,
    # 3, 5 with s = (2, 5, 4): only row 3 gets (5 - 4) / (std + eps), std of (2, 5, 4) =
    # sqrt(((5/3)^2 + (4/3)^2 + (1/3)^2) / 2) = sqrt(7/3); without std: 1.
    gids = jnp.asarray([0, 1, 0, 1, 0, 1, 0], jnp.int32)
    for norm, top in ((True, 1 / (np.sqrt(7 / 3) + EPS)), (False, 1.0)):
        adv, _ = advantage.grpo_passk(*ARGS[:2], gids, norm_adv_by_std_in_grpo=norm)
        expected_B = np.zeros(7)
        expected_B[3] = top
        np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)


def test_grpo_passk_singleton_raises_as_verl_and_is_zero_under_jit():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        advantage.grpo_passk(*ARGS)
    adv, _ = jax.jit(advantage.grpo_passk)(*ARGS)  # ids are traced: no check, singleton 0
    np.testing.assert_array_equal(np.asarray(adv)[3], 0.0)


def test_opo_hand_derived():
    # Lengths |y| = mask row sums = (3, 2, 1, 3, 2, 3, 3). Group 0 (|y| 3, 1, 2, 3; s 1, 0, 1,
    # 1): baseline (3 + 0 + 2 + 3) / 9 = 8/9. Group 1 (|y| 2, 3; s 2, 4): (4 + 12) / 5 = 3.2.
    # The singleton's baseline is 0.
    expected_B = np.array([1 / 9, 2 - 3.2, -8 / 9, 5.0, 1 / 9, 4 - 3.2, 1 / 9])
    adv, _ = advantage.opo(*ARGS)
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)


def test_opo_group_without_response_tokens_is_zero_not_nan():
    # Deviation from verl (0/0 = NaN): group 1's rows have no valid token -> baseline 0.
    mask = MASK.copy()
    mask[[1, 5]] = 0.0
    adv, _ = advantage.opo(jnp.asarray(REWARDS), jnp.asarray(mask), jnp.asarray(GROUP_IDS))
    assert np.isfinite(np.asarray(adv)).all()
    np.testing.assert_array_equal(np.asarray(adv)[[1, 5]], 0.0)


def test_gpg_hand_derived():
    # 6 of the 7 scores are non-zero: alpha = 7/6. Group means 0.75, 3 and (singleton) 0:
    # a = alpha (s - mean) / f_norm.
    centred_B = np.array([0.25, -1.0, -0.75, 5.0, 0.25, 1.0, 0.25])
    for f_norm in (1.0, 2.0):
        adv, _ = advantage.gpg(*ARGS, f_norm=f_norm)
        expected_BT = (7 / 6 * centred_B / f_norm)[:, None] * MASK
        np.testing.assert_allclose(np.asarray(adv), expected_BT, rtol=1e-6)


def test_reinforce_plus_plus_baseline_hand_derived():
    # Groups (0, 0, 1), scores (1, 0, 2), masks rows [1, 0], [1, 0], [1, 1]: centred scores
    # (0.5, -0.5, 2) (singleton mean 0), on the 4 valid tokens (0.5, -0.5, 2, 2): mean 1,
    # masked var (0.25 + 2.25 + 1 + 1) / 4 = 1.125, unbiased x 4/3 = 1.5 -> (x - 1) / sqrt(1.5).
    rewards = jnp.asarray([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    mask = jnp.asarray([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = advantage.reinforce_plus_plus_baseline(rewards, mask, jnp.asarray([0, 0, 1]))
    expected = np.array([[-0.5, 0.0], [-1.5, 0.0], [1.0, 1.0]]) / np.sqrt(1.5 + 1e-8)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-6)
    assert adv is ret


def test_reinforce_plus_plus_carries_the_return_through_masked_positions():
    # gamma 0.5, rewards (0, 0, 1), mask (1, 0, 1). Backwards: t2 G = 1; t1 is masked: its
    # return is 0 and the running return stays 1 (verl 0.9.1: no reward added, no discount);
    # t0 G = 0 + 0.5 * 1 = 0.5. returns (0.5, 0, 1); whitened over (0.5, 1): mean 0.75,
    # unbiased var 0.125 -> (-0.25, 0, 0.25) / sqrt(0.125).
    rewards, mask = jnp.asarray([[0.0, 0.0, 1.0]] * 2), jnp.asarray([[1.0, 0.0, 1.0]] * 2)
    adv, ret = advantage.reinforce_plus_plus(rewards, mask, gamma=0.5)
    np.testing.assert_allclose(np.asarray(ret), [[0.5, 0.0, 1.0]] * 2, rtol=1e-6)
    # Two identical rows: mean 0.75, unbiased var over 4 tokens = 0.0625 * 4/3.
    scale = 1 / np.sqrt(0.0625 * 4 / 3 + 1e-8)
    np.testing.assert_allclose(np.asarray(adv), [[-0.25 * scale, 0.0, 0.25 * scale]] * 2, rtol=1e-5)


def test_whitening_needs_two_valid_tokens():
    rewards, mask = jnp.asarray([[1.0, 2.0]]), jnp.asarray([[1.0, 0.0]])
    for fn in (advantage.reinforce_plus_plus, advantage.reinforce_plus_plus_baseline):
        with pytest.raises(ValueError, match="sum of the mask is one"):
            fn(rewards, mask, jnp.asarray([0]))
        adv, _ = jax.jit(fn)(rewards, mask, jnp.asarray([0]))  # under jit: 0, not NaN
        np.testing.assert_array_equal(np.asarray(adv), 0.0)
    with pytest.raises(ValueError, match="at least one element"):
        advantage.gdpo(rewards, jnp.zeros((1, 2)), jnp.asarray([0]))


def test_remax_hand_derived():
    # Masked rewards, reward-to-go, minus the greedy baseline b on valid tokens only:
    #   row 0: r (0, 1, 0, 2), mask (1, 1, 1, 0): returns (1, 1, 0, 0), b 0.5 -> (.5, .5, -.5, 0).
    #   row 1: r (0, 0, 1, 0), mask (1, 0, 1, 1): returns (1, 1, 1, 0), b 0.5
    #          -> (.5, 1, .5, -.5): the masked position keeps its return (verl does not mask).
    rewards = jnp.asarray([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 1.0, 0.0]])
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    adv, ret = advantage.remax(rewards, mask, reward_baselines=jnp.asarray([0.5, 0.5]))
    np.testing.assert_allclose(np.asarray(ret), [[1, 1, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_allclose(np.asarray(adv), [[0.5, 0.5, -0.5, 0], [0.5, 1, 0.5, -0.5]])


def test_gdpo_hand_derived():
    # Groups (0, 0, 1, 1), T = 1. Component 0 = (1, 0, 1, 0): each group (1, 0) -> +-0.5 /
    # std(1, 0) = +-sqrt(1/2) = +-a. Component 1 = (0, 0, 3, 1): group 0 has zero variance -> 0;
    # group 1 (3, 1) -> +-1 / sqrt(2) = +-a. Weights (1, 2): (a, -a, 3a, -3a). Whitening over the
    # 4 tokens: mean 0, unbiased var 20 a^2 / 3 -> (1, -1, 3, -3) / sqrt(20 / 3).
    components = jnp.asarray([[1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [0.0, 1.0]])
    mask, gids = jnp.ones((4, 1)), jnp.asarray([0, 0, 1, 1])
    adv, ret = advantage.gdpo(
        jnp.zeros((4, 1)), mask, gids, reward_components=components, reward_weights=[1.0, 2.0]
    )
    np.testing.assert_allclose(
        np.asarray(adv)[:, 0], np.array([1, -1, 3, -3]) / np.sqrt(20 / 3), rtol=1e-5
    )
    assert adv is ret
    # Without components: the single score of the rewards, i.e. whitened GRPO.
    single, _ = advantage.gdpo(components[:, :1], mask, gids)
    np.testing.assert_allclose(
        np.asarray(single)[:, 0], np.array([1, -1, 1, -1]) / np.sqrt(4 / 3), rtol=1e-5
    )


GROUP_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "gdpo",
)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_permuting_rows_permutes_every_group_estimator(name):
    perm = np.array([6, 3, 0, 5, 1, 4, 2])
    adv, _ = advantage.compute_advantage(name, *ARGS, num_groups=3)
    permuted, _ = advantage.compute_advantage(
        name, *(jnp.asarray(np.asarray(x)[perm]) for x in ARGS), num_groups=3
    )
    np.testing.assert_allclose(np.asarray(permuted), np.asarray(adv)[perm], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Dispatch by name and registration.
# ------------------------------------------------------------------------------------------


def test_dispatcher_calls_each_builtin():
    direct = {
        "grpo": advantage.compute_grpo_outcome_advantage,
        "rloo": advantage.compute_rloo_outcome_advantage,
        "grpo_passk": None,  # needs groups of >= 2 (tested above)
        "remax": None,  # needs reward_baselines (tested below)
    }
    for name in advantage.ADV_ESTIMATORS:
        fn = direct[name] if name in direct else getattr(advantage, name)
        if fn is None:
            continue
        ours, ret = advantage.compute_advantage(name, *ARGS)
        theirs, their_ret = fn(*ARGS)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        np.testing.assert_array_equal(np.asarray(ret), np.asarray(their_ret))
    adv, _ = advantage.compute_advantage(
        "remax", *ARGS, reward_baselines=jnp.zeros((7,), jnp.float32)
    )
    assert adv.shape == REWARDS.shape


@advantage.register_adv_est("test_batch_mean_baseline")
def _batch_mean_baseline(token_level_rewards, response_mask, group_ids, *, num_groups, scale=1.0):
    """s minus the batch mean score, times `scale`; ignores the groups."""
    del group_ids, num_groups
    score_B = jnp.sum(token_level_rewards, axis=-1)
    adv_BT = scale * (score_B - jnp.mean(score_B))[:, None] * response_mask
    return adv_BT, adv_BT


def test_registered_estimator_runs_through_the_dispatcher_under_jit():
    # Scores (1, 2, 0, 5, 1, 4, 1): mean 2 -> (-1, 0, -2, 3, -1, 2, -1), x scale 2.
    @jax.jit
    def run(rewards, mask, gids):
        return advantage.compute_advantage(
            "test_batch_mean_baseline", rewards, mask, gids, num_groups=3, scale=2.0
        )

    adv, _ = run(*ARGS)
    expected_B = 2 * np.array([-1.0, 0.0, -2.0, 3.0, -1.0, 2.0, -1.0])
    np.testing.assert_allclose(np.asarray(adv), expected_B[:, None] * MASK, rtol=1e-6)
    # registered names follow the built-in ones (other test files may register theirs too)
    names = advantage.adv_estimator_names()
    assert "test_batch_mean_baseline" in names[len(advantage.ADV_ESTIMATORS):]
    assert "test_batch_mean_baseline" not in advantage.ADV_ESTIMATORS


def test_dispatch_and_registration_errors():
    with pytest.raises(ValueError, match=r"Unknown .* 'ppo'; valid: grpo, .*test_batch_mean"):
        advantage.compute_advantage("ppo", *ARGS)
    with pytest.raises(ValueError, match="'gae' is not implemented .*critic"):
        advantage.compute_advantage("gae", *ARGS)
    with pytest.raises(TypeError):
        advantage.compute_advantage("rloo", *ARGS, gamma=0.9)  # rloo takes no gamma
    with pytest.raises(TypeError):
        advantage.compute_advantage("remax", *ARGS)  # reward_baselines is required
    with pytest.raises(ValueError, match="built in"):
        advantage.register_adv_est("grpo")
    with pytest.raises(ValueError, match="already registered"):
        advantage.register_adv_est("test_batch_mean_baseline")(lambda *a, **k: None)
    advantage.register_adv_est("test_batch_mean_baseline")(_batch_mean_baseline)  # no-op
    with pytest.raises(ValueError, match="non-empty string"):
        advantage.register_adv_est(None)
