"""Advantage estimators with verl 0.9.1 semantics, and the dispatcher that selects one by name.

This module owns the step from per-token rewards to per-token advantages. Every function is pure
JAX (jit, grad and vmap safe) and groups rows with ``jax.ops.segment_sum``, so groups may be
non-contiguous and of unequal size (packing, dropped samples, uneven ``rollout.n``). No Python
loop over rows and no reshape to ``[P, G]`` is involved.

Shapes: B rollouts (P prompts x G samples each), T response tokens, P groups, K reward functions.

Estimators, by verl's registered name (``algorithm.adv_estimator``; ``compute_advantage``
dispatches on it, ``ADV_ESTIMATORS`` lists them; see ``docs/verl-semantics.md`` section 2). The
sequence score s is always the **unmasked** sum over T of ``token_level_rewards``; "singleton"
is a group with one member; std is the unbiased (n-1) standard deviation:

* ``grpo`` (arXiv 2402.03300), ``compute_grpo_outcome_advantage``: (s - mean) / (std + epsilon);
  ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO (arXiv 2503.20783), s - mean. A singleton has
  mean 0 and std 1, so its advantage is its raw score s / (1 + eps).
* ``grpo_vectorized``: the same maths (verl 0.9.1's vectorised variant equals the loop to float32
  rounding). verl's trainer never passes ``norm_adv_by_std_in_grpo`` to it, so under verl it
  always normalises by the std whatever ``algorithm.norm_adv_by_std_in_grpo`` says.
* ``grpo_passk`` (Pass@k, arXiv 2503.19595): only a group's top scorer gets
  (max - second max) / (std + eps) (no division without ``norm_adv_by_std_in_grpo``); a tie for
  the top gives 0. verl raises for a singleton group.
* ``rloo`` (arXiv 2402.14740), ``compute_rloo_outcome_advantage``: n/(n-1) (s - mean), i.e. s
  minus the mean of the other members; a singleton keeps its raw score. ``rloo_vectorized``
  computes (n s - sum) / (n - 1) and gives a singleton 0.
* ``opo`` (arXiv 2505.23585): s minus the length-weighted group mean sum |y| s / sum |y|, |y| the
  number of response tokens; a singleton's baseline is 0.
* ``gpg`` (arXiv 2504.02546): alpha (s - mean) / f_norm, alpha = B / max(1, #rows with s != 0)
  over the whole batch; no std; singleton mean 0.
* ``reinforce_plus_plus_baseline`` (arXiv 2501.03262): s - group mean (singleton 0), broadcast
  over the response, then whitened over all valid tokens of the batch.
* ``reinforce_plus_plus``: the discounted reward-to-go with ``gamma`` (``algorithm.gamma``),
  whitened over the batch. verl 0.9.1 carries the running return through mask-0 positions
  unchanged (no reward is added and no discount applied there), so rewards propagate past
  observation spans; the returns are 0 at mask-0 positions.
* ``remax`` (arXiv 2310.10505): reward-to-go of the masked rewards minus the per-row greedy
  rollout's score ``reward_baselines`` times the mask (no whitening).
* ``gdpo`` (arXiv 2601.05242): GRPO-normalises each reward function's score separately
  (``reward_components`` [B, K]), sums them with ``reward_weights`` [K], then whitens over the
  batch. verl's trainer never passes ``norm_adv_by_std_in_grpo`` to it either.

Whitening is verl's ``masked_whiten``: (x - mean) * rsqrt(var + 1e-8) with the masked mean and
the unbiased masked variance over every valid token of the batch, then times the mask.

Not implemented: ``gae`` (needs the values of a critic) and ``optimal_token_baseline`` /
``tir_optimal_token_baseline`` (need the per-token sum of squared probabilities,
``actor.calculate_sum_pi_squared``): the trainer computes neither. ``register_adv_est`` adds a
user estimator under any name that is not built in.

The public functions that return the same array twice do not copy it: the maths runs in an
inner jitted function with one output (a jitted function returning one array twice makes XLA
write a second [B, T] copy). They can still be called inside an outer jit.

Group statistics use two passes (mean, then the centred sum of squares) like verl 0.9.1's
``group_mean_std``, in float32; results are cast to the rewards' dtype.

Deviations from verl, all where verl returns NaN or raises for input a jitted function cannot
reject:

1. ``opo``: a group whose members have no response token at all has baseline 0 (verl divides 0
   by 0 and returns NaN for the whole rows).
2. Whitening over fewer than 2 valid tokens (``reinforce_plus_plus*``, ``gdpo``) and
   ``grpo_passk`` on a singleton raise ValueError as in verl when the arrays are concrete; under
   jit, where nothing can raise, they give advantages of 0.
3. Group ids out of range raise ValueError for concrete arrays; under jit they give meaningless
   advantages (verl uses uid strings and cannot have this error).
"""

import functools

import jax
import jax.numpy as jnp

from grpo_jax import registry


def _check_groups(token_level_rewards, group_ids, num_groups):
    """Validates shapes (and the id range, for concrete ids); returns the static group bound."""
    if token_level_rewards.ndim != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got shape {token_level_rewards.shape}"
        )
    if group_ids.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group_ids must be [B] = {token_level_rewards.shape[:1]}, got {group_ids.shape}"
        )
    num_groups = token_level_rewards.shape[0] if num_groups is None else num_groups
    if not isinstance(group_ids, jax.core.Tracer) and group_ids.size:
        lo, hi = int(jnp.min(group_ids)), int(jnp.max(group_ids))
        if lo < 0 or hi >= num_groups:
            raise ValueError(f"group_ids must lie in [0, {num_groups}), got [{lo}, {hi}]")
    return int(num_groups)


def _scores_and_group_stats(token_level_rewards, group_ids, num_groups):
    """Sequence scores s_B (unmasked sum over T), group sizes n_P and means (singleton: 0)."""
    score_B = jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)
    count_P = jax.ops.segment_sum(jnp.ones_like(score_B), group_ids, num_groups)
    sum_P = jax.ops.segment_sum(score_B, group_ids, num_groups)
    mean_P = jnp.where(count_P > 1, sum_P / jnp.maximum(count_P, 1.0), 0.0)
    return score_B, count_P, mean_P


def _broadcast_over_tokens(adv_B, response_mask, dtype):
    return (adv_B[:, None] * response_mask.astype(jnp.float32)).astype(dtype)


def compute_grpo_outcome_advantage(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    norm_adv_by_std_in_grpo=True,
    epsilon=1e-6,
):
    """GRPO outcome advantage: group-normalised sequence score, broadcast over the response.

    Args:
        token_level_rewards: [B, T] float rewards (usually one non-zero entry per row).
        response_mask: [B, T] 0/1 mask of response tokens (any numeric or bool dtype).
        group_ids: [B] int, non-negative and below ``num_groups``: rows sharing an id form a
            group (verl's ``index`` uid). The range is checked (ValueError) for concrete arrays;
            under jit it cannot be, and an out-of-range id gives meaningless advantages.
        num_groups: Python int bound on the ids (static: one compilation per value); None
            means B.
        norm_adv_by_std_in_grpo: divide by (std + epsilon) (GRPO) or not (Dr.GRPO).
            Config field ``algorithm.norm_adv_by_std_in_grpo``.
        epsilon: added to the std, outside the square root (verl default 1e-6).

    Returns:
        (advantages, returns): the same [B, T] array twice, in the dtype of the rewards.
    """
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    adv_BT = _grpo_advantage(
        token_level_rewards,
        response_mask,
        group_ids,
        epsilon,
        num_groups=num_groups,
        norm_by_std=bool(norm_adv_by_std_in_grpo),
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups", "norm_by_std"))
def _grpo_advantage(
    token_level_rewards, response_mask, group_ids, epsilon, *, num_groups, norm_by_std
):
    score_B, count_P, mean_P = _scores_and_group_stats(token_level_rewards, group_ids, num_groups)
    centered_B = score_B - mean_P[group_ids]
    if norm_by_std:
        sq_P = jax.ops.segment_sum(centered_B * centered_B, group_ids, num_groups)
        std_P = jnp.where(count_P > 1, jnp.sqrt(sq_P / jnp.maximum(count_P - 1.0, 1.0)), 1.0)
        adv_B = centered_B / (std_P[group_ids] + epsilon)
    else:
        adv_B = centered_B
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


def compute_rloo_outcome_advantage(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    epsilon=1e-6,
):
    """RLOO outcome advantage: score minus the mean score of the other group members.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids, as in ``compute_grpo_outcome_advantage``.
        num_groups: static Python int bound on the ids; None means B.
        epsilon: unused; kept so the signature matches verl's and the GRPO estimator.

    Returns:
        (advantages, returns): the same [B, T] array twice. A singleton keeps its raw score.
    """
    del epsilon  # verl's rloo accepts and ignores it too.
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    adv_BT = _rloo_advantage(token_level_rewards, response_mask, group_ids, num_groups=num_groups)
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _rloo_advantage(token_level_rewards, response_mask, group_ids, *, num_groups):
    score_B, count_P, mean_P = _scores_and_group_stats(token_level_rewards, group_ids, num_groups)
    n_B = count_P[group_ids]
    # n/(n-1) * (s - mean) == s - (sum - s)/(n-1): the leave-one-out baseline.
    scale_B = jnp.where(n_B > 1, n_B / jnp.maximum(n_B - 1.0, 1.0), 1.0)
    adv_B = scale_B * (score_B - mean_P[group_ids])
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


# ----------------------------------------------------------------------------------------------
# SHARED PIECES
# ----------------------------------------------------------------------------------------------


def _is_concrete(*arrays):
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def _check_rewards_2d(token_level_rewards):
    if token_level_rewards.ndim != 2:
        raise ValueError(
            f"token_level_rewards must be [B, T], got shape {token_level_rewards.shape}"
        )


def _check_mask(token_level_rewards, response_mask):
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask must be [B, T] = {token_level_rewards.shape}, got {response_mask.shape}"
        )


def _check_whiten_mask(response_mask):
    """verl's masked_var raises for fewer than 2 valid tokens; so do we, for concrete masks."""
    if _is_concrete(response_mask):
        count = float(jnp.sum(response_mask.astype(jnp.float32)))
        if count == 0:
            raise ValueError("whitening: at least one element in the mask has to be 1 (verl)")
        if count == 1:
            raise ValueError("whitening: the sum of the mask is one (division by zero in verl)")


def _group_std(score_B, count_P, group_ids, num_groups):
    """Unbiased per-group std (two-pass, true mean even for singletons, which callers override)."""
    sum_P = jax.ops.segment_sum(score_B, group_ids, num_groups)
    centered_B = score_B - (sum_P / jnp.maximum(count_P, 1.0))[group_ids]
    sq_P = jax.ops.segment_sum(centered_B * centered_B, group_ids, num_groups)
    return jnp.sqrt(sq_P / jnp.maximum(count_P - 1.0, 1.0))


def _masked_whiten(values_BT, mask_BT):
    """verl_F.masked_whiten: (x - mean) * rsqrt(var + 1e-8), unbiased masked var (float32).

    verl raises for fewer than 2 valid tokens; here the Bessel factor is then 1, so the variance
    is 0 and every entry is (x - mean) * 1e4, which the callers multiply by the mask (0 tokens)
    or which is exactly 0 (1 token: the mean equals that token's value)."""
    valid_BT = mask_BT != 0
    count = jnp.sum(mask_BT)
    mean = jnp.sum(jnp.where(valid_BT, values_BT, 0.0) * mask_BT) / (count + 1e-8)
    centered_BT = values_BT - mean
    var = jnp.sum(jnp.where(valid_BT, centered_BT**2, 0.0) * mask_BT) / (count + 1e-8)
    var = var * (count / jnp.maximum(count - 1.0, 1.0))
    return centered_BT * jax.lax.rsqrt(var + 1e-8)


# ----------------------------------------------------------------------------------------------
# GROUP-BASELINE ESTIMATORS
# ----------------------------------------------------------------------------------------------


def grpo_vectorized(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    norm_adv_by_std_in_grpo=True,
    epsilon=1e-6,
):
    """verl's ``grpo_vectorized``: the same advantage as ``compute_grpo_outcome_advantage``.

    verl's trainer calls this estimator without ``norm_adv_by_std_in_grpo``, so it always divides
    by the std there; to reproduce the trainer, leave the argument at its default True.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        norm_adv_by_std_in_grpo: divide by (std + epsilon).
        epsilon: added to the std.

    Returns:
        (advantages, returns): the same [B, T] array twice.
    """
    return compute_grpo_outcome_advantage(
        token_level_rewards,
        response_mask,
        group_ids,
        num_groups=num_groups,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )


def grpo_passk(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    norm_adv_by_std_in_grpo=True,
    epsilon=1e-6,
):
    """Pass@k advantage (arXiv 2503.19595): only each group's best response is reinforced.

    The top scorer of a group gets (max - second max) / (std + epsilon), every other row 0.
    A tie for the top gives max - second max = 0 for the whole group (verl picks one of the tied
    rows, which then also gets 0). Unlike ``grpo``, verl reads ``norm_adv_by_std_in_grpo`` from
    the algorithm config here, so its trainer honours it.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids in [0, num_groups); every group needs >= 2 rows.
        num_groups: static Python int bound on the ids; None means B.
        norm_adv_by_std_in_grpo: divide by (std + epsilon) (config
            ``algorithm.norm_adv_by_std_in_grpo``).
        epsilon: added to the std.

    Returns:
        (advantages, returns): the same [B, T] array twice.

    Raises:
        ValueError: a group has a single row (concrete ids only; under jit it gets 0).
    """
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    if _is_concrete(group_ids) and group_ids.size:
        counts = jnp.bincount(group_ids, length=num_groups)
        if bool(jnp.any(counts == 1)):
            raise ValueError("grpo_passk requires at least 2 samples per group (verl)")
    adv_BT = _passk_advantage(
        token_level_rewards,
        response_mask,
        group_ids,
        epsilon,
        num_groups=num_groups,
        norm_by_std=bool(norm_adv_by_std_in_grpo),
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups", "norm_by_std"))
def _passk_advantage(
    token_level_rewards, response_mask, group_ids, epsilon, *, num_groups, norm_by_std
):
    score_B = jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)
    count_P = jax.ops.segment_sum(jnp.ones_like(score_B), group_ids, num_groups)
    max_P = jax.ops.segment_max(score_B, group_ids, num_groups)
    is_max_B = score_B == max_P[group_ids]
    num_max_P = jax.ops.segment_sum(is_max_B.astype(jnp.float32), group_ids, num_groups)
    below_max_P = jax.ops.segment_max(jnp.where(is_max_B, -jnp.inf, score_B), group_ids, num_groups)
    # The second largest counts multiplicity: a tied top makes it the max itself.
    second_P = jnp.where(num_max_P > 1, max_P, below_max_P)
    gap_P = jnp.where(count_P > 1, max_P - second_P, 0.0)
    if norm_by_std:
        gap_P = gap_P / (_group_std(score_B, count_P, group_ids, num_groups) + epsilon)
    adv_B = jnp.where(is_max_B & (count_P[group_ids] > 1), gap_P[group_ids], 0.0)
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


def rloo_vectorized(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    epsilon=1e-6,
):
    """verl's ``rloo_vectorized``: (n s - group sum) / (n - 1); a singleton gets 0.

    The same leave-one-out baseline as ``compute_rloo_outcome_advantage`` except for singletons
    (the loop ``rloo`` keeps their raw score), computed in verl's vectorised order.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        epsilon: unused (verl's signature).

    Returns:
        (advantages, returns): the same [B, T] array twice.
    """
    del epsilon
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    adv_BT = _rloo_vectorized_advantage(
        token_level_rewards, response_mask, group_ids, num_groups=num_groups
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _rloo_vectorized_advantage(token_level_rewards, response_mask, group_ids, *, num_groups):
    score_B = jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)
    n_B = jax.ops.segment_sum(jnp.ones_like(score_B), group_ids, num_groups)[group_ids]
    sum_B = jax.ops.segment_sum(score_B, group_ids, num_groups)[group_ids]
    adv_B = jnp.where(n_B > 1, (n_B * score_B - sum_B) / jnp.maximum(n_B - 1.0, 1.0), 0.0)
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


def opo(token_level_rewards, response_mask, group_ids, *, num_groups=None, epsilon=1e-6):
    """OPO advantage (arXiv 2505.23585): s minus the length-weighted group mean score.

    baseline = sum_j |y_j| s_j / sum_j |y_j| over the group, |y| = number of response tokens
    (sum of the mask); a singleton's baseline is 0. Deviation: a group with no response token
    at all gets baseline 0 (verl: 0/0 = NaN).

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask (its row sums are the lengths |y|).
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        epsilon: unused (verl's signature).

    Returns:
        (advantages, returns): the same [B, T] array twice.
    """
    del epsilon
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    adv_BT = _opo_advantage(token_level_rewards, response_mask, group_ids, num_groups=num_groups)
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _opo_advantage(token_level_rewards, response_mask, group_ids, *, num_groups):
    score_B = jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)
    length_B = jnp.sum(response_mask.astype(jnp.float32), axis=-1)
    count_P = jax.ops.segment_sum(jnp.ones_like(score_B), group_ids, num_groups)
    weighted_P = jax.ops.segment_sum(length_B * score_B, group_ids, num_groups)
    length_P = jax.ops.segment_sum(length_B, group_ids, num_groups)
    has_baseline_P = (count_P > 1) & (length_P > 0)
    baseline_P = jnp.where(has_baseline_P, weighted_P / jnp.where(has_baseline_P, length_P, 1), 0)
    adv_B = score_B - baseline_P[group_ids]
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


def gpg(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    epsilon=1e-6,
    f_norm=1.0,
):
    """GPG advantage (arXiv 2504.02546): alpha (s - group mean) / f_norm, no std.

    alpha = B / max(1, number of rows of the batch with a non-zero score) rescales for the
    groups that carry no signal. verl's ``alpha`` argument is overwritten by this value inside
    its function, so it is not offered here.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        epsilon: unused (verl's signature).
        f_norm: divisor of the advantage (verl default 1).

    Returns:
        (advantages, returns): the same [B, T] array twice. A singleton's mean is 0.
    """
    del epsilon
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    adv_BT = _gpg_advantage(
        token_level_rewards, response_mask, group_ids, f_norm, num_groups=num_groups
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _gpg_advantage(token_level_rewards, response_mask, group_ids, f_norm, *, num_groups):
    score_B, _, mean_P = _scores_and_group_stats(token_level_rewards, group_ids, num_groups)
    nonzero = jnp.sum((score_B != 0).astype(jnp.float32))
    alpha = score_B.shape[0] / jnp.maximum(nonzero, 1.0)
    adv_B = alpha * (score_B - mean_P[group_ids]) / f_norm
    return _broadcast_over_tokens(adv_B, response_mask, token_level_rewards.dtype)


def reinforce_plus_plus_baseline(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    epsilon=1e-6,
):
    """REINFORCE++ with a group baseline (arXiv 2501.03262): whiten(s - group mean) x mask.

    The centred score (singleton mean 0) is broadcast over the response and whitened over all
    valid tokens of the batch (so long responses weigh more in the statistics).

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask, with at least 2 valid tokens in the batch.
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        epsilon: unused (verl's signature).

    Returns:
        (advantages, returns): the same [B, T] array twice.

    Raises:
        ValueError: fewer than 2 valid tokens (concrete masks only, as verl; under jit: 0).
    """
    del epsilon
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    _check_whiten_mask(response_mask)
    adv_BT = _rpp_baseline_advantage(
        token_level_rewards, response_mask, group_ids, num_groups=num_groups
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _rpp_baseline_advantage(token_level_rewards, response_mask, group_ids, *, num_groups):
    score_B, _, mean_P = _scores_and_group_stats(token_level_rewards, group_ids, num_groups)
    mask_BT = response_mask.astype(jnp.float32)
    centered_BT = (score_B - mean_P[group_ids])[:, None] * mask_BT
    adv_BT = _masked_whiten(centered_BT, mask_BT) * mask_BT
    return adv_BT.astype(token_level_rewards.dtype)


# ----------------------------------------------------------------------------------------------
# PER-TOKEN RETURN ESTIMATORS (no groups)
# ----------------------------------------------------------------------------------------------


def reinforce_plus_plus(
    token_level_rewards, response_mask, group_ids=None, *, num_groups=None, gamma=1.0
):
    """REINFORCE++ (arXiv 2501.03262): whitened discounted reward-to-go.

    Returns G_t = r_t + gamma G_{t+1} on valid tokens; verl 0.9.1 carries the running return
    through mask-0 positions unchanged (their reward is dropped and no discount is applied), so
    a reward after an observation span still reaches the tokens before it. The returns are 0 at
    mask-0 positions; the advantages are the returns whitened over all valid tokens, x mask.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask, with at least 2 valid tokens in the batch.
        group_ids: unused (no baseline); accepted so every estimator takes the same arguments.
        num_groups: unused.
        gamma: discount factor (config ``algorithm.gamma``, default 1.0).

    Returns:
        (advantages [B, T], returns [B, T]), in the rewards' dtype.

    Raises:
        ValueError: fewer than 2 valid tokens (concrete masks only, as verl; under jit: 0).
    """
    del group_ids, num_groups
    _check_rewards_2d(token_level_rewards)
    _check_mask(token_level_rewards, response_mask)
    _check_whiten_mask(response_mask)
    return _rpp_advantage(token_level_rewards, response_mask, gamma)


@jax.jit
def _rpp_advantage(token_level_rewards, response_mask, gamma):
    rewards_TB = token_level_rewards.astype(jnp.float32).T
    mask_TB = response_mask.astype(jnp.float32).T

    def step(running_B, x):
        reward_B, m_B = x
        new_B = reward_B + gamma * running_B
        # A mask-0 position keeps the running return as it is (verl 0.9.1's carry-through).
        return new_B * m_B + running_B * (1.0 - m_B), new_B * m_B

    _, returns_TB = jax.lax.scan(
        step, jnp.zeros_like(rewards_TB[0]), (rewards_TB, mask_TB), reverse=True
    )
    returns_BT, mask_BT = returns_TB.T, mask_TB.T
    adv_BT = _masked_whiten(returns_BT, mask_BT) * mask_BT
    dtype = token_level_rewards.dtype
    return adv_BT.astype(dtype), returns_BT.astype(dtype)


def remax(token_level_rewards, response_mask, group_ids=None, *, reward_baselines, num_groups=None):
    """ReMax advantage (arXiv 2310.10505): reward-to-go minus the greedy rollout's score.

    returns_t = sum_{t' >= t} r_t' m_t' (masked rewards); advantages = returns - b m with b the
    score of a greedy (argmax) rollout of the same prompt. Not whitened, and (as in verl) not
    multiplied by the mask: a mask-0 position before a later valid reward keeps its return.

    Args:
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: unused (the baseline is per row); accepted for a uniform signature.
        reward_baselines: [B] greedy-rollout score per row (verl's ``reward_baselines``).
        num_groups: unused.

    Returns:
        (advantages [B, T], returns [B, T]), in the rewards' dtype.
    """
    del group_ids, num_groups
    _check_rewards_2d(token_level_rewards)
    _check_mask(token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must be [B] = {token_level_rewards.shape[:1]}, "
            f"got {reward_baselines.shape}"
        )
    return _remax_advantage(token_level_rewards, response_mask, reward_baselines)


@jax.jit
def _remax_advantage(token_level_rewards, response_mask, reward_baselines):
    mask_BT = response_mask.astype(jnp.float32)
    masked_BT = token_level_rewards.astype(jnp.float32) * mask_BT
    returns_BT = jnp.flip(jnp.cumsum(jnp.flip(masked_BT, axis=-1), axis=-1), axis=-1)
    adv_BT = returns_BT - reward_baselines.astype(jnp.float32)[:, None] * mask_BT
    dtype = token_level_rewards.dtype
    return adv_BT.astype(dtype), returns_BT.astype(dtype)


# ----------------------------------------------------------------------------------------------
# MULTI-REWARD ESTIMATOR
# ----------------------------------------------------------------------------------------------


def gdpo(
    token_level_rewards,
    response_mask,
    group_ids,
    *,
    num_groups=None,
    reward_components=None,
    reward_weights=None,
    norm_adv_by_std_in_grpo=True,
    epsilon=1e-6,
):
    """GDPO (arXiv 2601.05242): per-reward-function GRPO normalisation, weighted sum, whitening.

    For each reward function k the sequence scores ``reward_components[:, k]`` are GRPO-
    normalised within their groups (singleton mean 0 / std 1); A = sum_k w_k A_k over valid
    tokens is then whitened over the batch, x mask. This keeps a reward with a large spread from
    drowning the others. verl builds the components from ``algorithm.gdpo_reward_keys`` (the
    reward function's extra outputs) and ``algorithm.gdpo_reward_weights``; without them it
    uses the single score of ``token_level_rewards``, as here with ``reward_components=None``.
    verl's trainer never passes ``norm_adv_by_std_in_grpo`` to it (so it always normalises).

    Args:
        token_level_rewards: [B, T] float rewards; only used when ``reward_components`` is None.
        response_mask: [B, T] 0/1 response mask, with at least 2 valid tokens in the batch.
        group_ids: [B] int group ids in [0, num_groups).
        num_groups: static Python int bound on the ids; None means B.
        reward_components: [B, K] per-reward-function sequence scores, or None.
        reward_weights: [K] weights w_k (config ``algorithm.gdpo_reward_weights``); None: ones.
        norm_adv_by_std_in_grpo: per-component division by (std + epsilon).
        epsilon: added to the std.

    Returns:
        (advantages, returns): the same [B, T] array twice.

    Raises:
        ValueError: fewer than 2 valid tokens (concrete masks only, as verl; under jit: 0).
    """
    num_groups = _check_groups(token_level_rewards, group_ids, num_groups)
    _check_mask(token_level_rewards, response_mask)
    _check_whiten_mask(response_mask)
    if reward_components is None:
        reward_components = jnp.sum(token_level_rewards.astype(jnp.float32), axis=-1)[:, None]
    if reward_components.ndim != 2 or reward_components.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(
            f"reward_components must be [B, K] with B = {token_level_rewards.shape[0]}, "
            f"got {reward_components.shape}"
        )
    num_components = reward_components.shape[1]
    if reward_weights is None:
        reward_weights = jnp.ones((num_components,), jnp.float32)
    reward_weights = jnp.asarray(reward_weights, jnp.float32)
    if reward_weights.shape != (num_components,):
        raise ValueError(
            f"reward_weights must be [K] = ({num_components},), got {reward_weights.shape}"
        )
    adv_BT = _gdpo_advantage(
        reward_components,
        reward_weights,
        response_mask,
        group_ids,
        epsilon,
        num_groups=num_groups,
        norm_by_std=bool(norm_adv_by_std_in_grpo),
        dtype=token_level_rewards.dtype,
    )
    return adv_BT, adv_BT


@functools.partial(jax.jit, static_argnames=("num_groups", "norm_by_std", "dtype"))
def _gdpo_advantage(
    score_BK, weight_K, response_mask, group_ids, epsilon, *, num_groups, norm_by_std, dtype
):
    score_BK = score_BK.astype(jnp.float32)
    mask_BT = response_mask.astype(jnp.float32)
    count_P = jax.ops.segment_sum(jnp.ones_like(score_BK[:, 0]), group_ids, num_groups)
    single_P = count_P <= 1
    adv_BT = None
    for k in range(score_BK.shape[1]):  # K is small and static; verl accumulates in this order
        score_B = score_BK[:, k]
        mean_P = jnp.where(
            single_P,
            0.0,
            jax.ops.segment_sum(score_B, group_ids, num_groups) / jnp.maximum(count_P, 1.0),
        )
        centered_B = score_B - mean_P[group_ids]
        if norm_by_std:
            std_P = jnp.where(single_P, 1.0, _group_std(score_B, count_P, group_ids, num_groups))
            centered_B = centered_B / (std_P[group_ids] + epsilon)
        term_BT = weight_K[k] * (centered_B[:, None] * mask_BT)
        adv_BT = term_BT if adv_BT is None else adv_BT + term_BT
    return (_masked_whiten(adv_BT, mask_BT) * mask_BT).astype(dtype)


# ----------------------------------------------------------------------------------------------
# DISPATCH BY NAME
# ----------------------------------------------------------------------------------------------

ADV_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "gdpo",
)
# verl registers these too; they need inputs the trainer does not compute.
_NOT_IMPLEMENTED = {
    "gae": "needs the values of a critic",
    "optimal_token_baseline": "needs sum_pi_squared (actor.calculate_sum_pi_squared)",
    "tir_optimal_token_baseline": "needs sum_pi_squared (actor.calculate_sum_pi_squared)",
}
# Estimators added with register_adv_est, by name. Only the decorator writes here.
_REGISTERED_ADV_ESTIMATORS = registry.Registry("advantage estimator", ADV_ESTIMATORS)


def adv_estimator_names():
    """Every name ``compute_advantage`` accepts now: ``ADV_ESTIMATORS``, then registered ones
    (and any "module:function", imported when used)."""
    return _REGISTERED_ADV_ESTIMATORS.names()


def check_adv_estimator(field: str, name) -> None:
    """Raises ValueError('field=name ...') unless ``compute_advantage`` accepts ``name``."""
    _REGISTERED_ADV_ESTIMATORS.check(field, name)


def register_adv_est(name):
    """Decorator adding a user advantage estimator under ``name`` for ``compute_advantage``.

    The function is called as ``fn(token_level_rewards, response_mask, group_ids,
    num_groups=num_groups, **kwargs)`` with the keyword arguments given to ``compute_advantage``,
    and must return ``(advantages [B, T], returns [B, T])``. Keep it pure and jittable if the
    dispatcher runs under jit. The function is returned unchanged.

    Args:
        name: a non-empty string that is neither built in (``ADV_ESTIMATORS``) nor registered
            already (registering the same function again under the same name is a no-op).

    Raises:
        ValueError: ``name`` is built in or already taken by another function.
    """
    return _REGISTERED_ADV_ESTIMATORS.decorator(name, caller="register_adv_est")


def compute_advantage(
    adv_estimator, token_level_rewards, response_mask, group_ids, *, num_groups=None, **kwargs
):
    """Advantages and returns of the estimator named ``adv_estimator`` (verl's names).

    Keyword arguments go to the estimator unchanged, so an argument it does not take is a
    TypeError rather than silently ignored. The built-ins take (besides ``num_groups``):

    * ``grpo``, ``grpo_vectorized``, ``grpo_passk``: ``norm_adv_by_std_in_grpo``, ``epsilon``.
    * ``rloo``, ``rloo_vectorized``, ``opo``, ``reinforce_plus_plus_baseline``: ``epsilon``
      (unused, verl's signature).
    * ``gpg``: ``epsilon`` (unused), ``f_norm``.
    * ``reinforce_plus_plus``: ``gamma``.  ``remax``: ``reward_baselines`` (required).
    * ``gdpo``: ``reward_components``, ``reward_weights``, ``norm_adv_by_std_in_grpo``,
      ``epsilon``.

    To reproduce verl's trainer, pass ``norm_adv_by_std_in_grpo`` only to ``grpo`` and
    ``grpo_passk`` (it never reaches ``grpo_vectorized`` or ``gdpo`` there) and ``gamma`` to
    ``reinforce_plus_plus``.

    Args:
        adv_estimator: a name from ``adv_estimator_names()`` (config ``algorithm.adv_estimator``);
            a Python string, static under jit.
        token_level_rewards: [B, T] float rewards.
        response_mask: [B, T] 0/1 response mask.
        group_ids: [B] int group ids in [0, num_groups) (ignored by the per-row estimators).
        num_groups: static Python int bound on the ids; None means B.
        **kwargs: the estimator's own keyword arguments (above).

    Returns:
        (advantages [B, T], returns [B, T]).

    Raises:
        ValueError: unknown or unimplemented name (the message lists the valid names).
    """
    match adv_estimator:
        case "grpo":
            fn = compute_grpo_outcome_advantage
        case "grpo_vectorized":
            fn = grpo_vectorized
        case "grpo_passk":
            fn = grpo_passk
        case "rloo":
            fn = compute_rloo_outcome_advantage
        case "rloo_vectorized":
            fn = rloo_vectorized
        case "opo":
            fn = opo
        case "gpg":
            fn = gpg
        case "reinforce_plus_plus":
            fn = reinforce_plus_plus
        case "reinforce_plus_plus_baseline":
            fn = reinforce_plus_plus_baseline
        case "remax":
            fn = remax
        case "gdpo":
            fn = gdpo
        case _ if adv_estimator in _REGISTERED_ADV_ESTIMATORS or ":" in adv_estimator:
            fn = _REGISTERED_ADV_ESTIMATORS[adv_estimator]  # "module:function": imported here
        case _:
            valid = ", ".join(adv_estimator_names())
            why = _NOT_IMPLEMENTED.get(adv_estimator)
            if why is not None:
                raise ValueError(
                    f"advantage estimator {adv_estimator!r} is not implemented ({why}); "
                    f"valid: {valid}"
                )
            raise ValueError(f"Unknown advantage estimator {adv_estimator!r}; valid: {valid}")
    return fn(token_level_rewards, response_mask, group_ids, num_groups=num_groups, **kwargs)
