"""GRPO/PPO actor losses with verl 0.9.1 semantics, as pure JAX functions.

This module owns everything between per-token log-probs and the scalar actor loss:

* ``agg_loss``: verl's loss aggregation modes (``token-mean`` as in DAPO arXiv 2503.14476,
  ``seq-mean-token-mean`` as in the GRPO paper arXiv 2402.03300, ``seq-mean-token-sum``,
  ``seq-mean-token-sum-norm`` as in Dr.GRPO arXiv 2503.20783, ``token-sum``), including the
  global-batch arguments (``dp_size``, ``batch_num_tokens``, ``global_batch_size``) of verl's
  engine workers.
* ``kl_penalty``: Schulman's estimators k1/k2/k3 (http://joschu.net/blog/kl-approx.html) with
  verl's clamps, their ``+`` straight-through variants (value of the estimator, gradient of k2),
  and ``full``: the exact per-token KL over the vocabulary, which verl documents but does not
  implement.
* ``compute_policy_loss``: one entry point for the policy-gradient losses, selected by
  ``policy_loss_mode`` (plain ``match``): ``vanilla`` (PPO clip, arXiv 1707.06347, with
  clip-higher from DAPO and the dual clip of arXiv 1912.09729 on negative advantages), ``gspo``
  (sequence-level ratio, arXiv 2507.18071), ``cispo`` (clipped, detached IS weight times log-prob,
  arXiv 2506.13585), ``gpg`` (plain REINFORCE, arXiv 2504.02546), ``clip_cov`` and ``kl_cov``
  (covariance-selected token clipping / KL penalty, arXiv 2505.22617), ``geo_mean`` (GMPO,
  arXiv 2507.20673), ``sapo`` (soft gate, arXiv 2511.20347), ``dppo_tv`` / ``dppo_kl``
  (binary trust regions, arXiv 2602.04879) and ``dro`` (quadratic log-ratio penalty), all listed
  in ``POLICY_LOSS_MODES``; ``register_policy_loss`` adds user losses under new names. verl's
  ``bypass_mode`` loss is ``compute_policy_loss_bypass_mode`` (below).
* ``logprobs_from_logits``, ``entropy_from_logits``, ``logprobs_and_entropy_chunked``,
  ``logprobs_and_entropy_from_hidden`` and ``check_temperature`` are re-exported from
  ``grpo_jax.logprobs`` (the row-chunked passes over the vocabulary, with the exact KL).
* ``actor_loss``: pg - entropy_coeff * entropy + kl_loss_coef * kl, with verl's metric names.

Shapes: B sequences, T response tokens, V vocabulary, D hidden size, N = B*T token rows.

Mode and type strings (``loss_agg_mode``, ``kl_type``, ``policy_loss_mode``) and the clip
coefficients are Python values, static under jit; an unknown string raises ValueError listing
the valid names. Metrics are float32 scalar arrays (verl's are Python floats from ``.item()``,
which cannot exist under jit).

Deliberate differences from verl, all where verl returns NaN or inf:

1. Empty denominators. ``token-mean`` over an all-masked batch (or with ``batch_num_tokens``
   of 0), and the ``seq-mean-*`` modes with no non-empty sequence, return 0 with a zero gradient;
   verl divides 0 by 0 and returns NaN.
2. Non-finite values at masked-out positions never reach a result or a gradient. verl's
   ``token-mean`` already ignores them (``masked_sum`` uses ``where``), but its
   ``seq-mean-*`` modes multiply by the mask before summing (NaN * 0 = NaN), GSPO's sequence
   ratio does the same, and every mode passes NaN gradients to masked positions whose inputs are
   NaN. Here policy-loss inputs are replaced by 0 at masked positions with ``where`` before any
   arithmetic, and ``agg_loss`` selects with ``where`` in every mode.

clip_cov and kl_cov select tokens: verl's clip_cov draws them with ``torch.randperm`` (not
reproducible from JAX); here a uniform random subset is drawn from a JAX key (``rng``; the
trainer passes one per micro-batch, trainer/actor.py ``update_key``), jittable and
reproducible (see ``compute_policy_loss``), and their token budget int(ratio * N_tok) is
computed with verl's float64 rounding, not float32's.

For finite inputs with at least one valid token, every value and gradient equals verl's. Ratio
clamps follow ``torch.clamp`` (a value exactly on a bound passes its gradient), not
``jnp.clip``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import logprobs, registry, rollout_correction
from grpo_jax.logprobs import check_temperature as check_temperature
from grpo_jax.logprobs import entropy_from_logits as entropy_from_logits
from grpo_jax.logprobs import logprobs_and_entropy_chunked as logprobs_and_entropy_chunked
from grpo_jax.logprobs import logprobs_and_entropy_from_hidden as logprobs_and_entropy_from_hidden
from grpo_jax.logprobs import logprobs_from_logits as logprobs_from_logits

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_KL_BASE_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
KL_TYPES = _KL_BASE_TYPES + tuple(name + "+" for name in _KL_BASE_TYPES)
POLICY_LOSS_MODES = (
    "vanilla",
    "gspo",
    "cispo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "sapo",
    "dppo_tv",
    "dppo_kl",
    "dro",
)


def check_choice(what, value, valid):
    """The one rule for mode strings: 'what=value must be one of [...]' (also used by config)."""
    if value not in valid:
        raise ValueError(f"{what}={value!r} must be one of {list(valid)}")


def check_clip_ratio_c(clip_ratio_c) -> None:
    """The dual clip's cap c must be > 1 (verl asserts it); config.ActorConfig calls this too."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c!r} must be > 1 (the dual-clip cap)")


def _clamp(x, lo=None, hi=None):
    """torch.clamp: the gradient passes where lo <= x <= hi, bounds included (jnp.clip halves)."""
    if lo is not None:
        x = jnp.where(x < lo, lo, x)
    if hi is not None:
        x = jnp.where(x > hi, hi, x)
    return x


def _safe_divide(num, den):
    """num / den, and 0 (with zero gradient) where den == 0: the only deviation from verl."""
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def _masked_mean(x_BT, mask_BT):
    """verl_F.masked_mean over all elements: denominator sum(mask) + 1e-8, no gradient.

    ``mask_BT`` is the float32 mask, so its sum is the same expression as in ``agg_loss`` and
    XLA computes it once."""
    total = jnp.sum(jnp.where(mask_BT != 0, x_BT.astype(jnp.float32), 0.0) * mask_BT)
    return jax.lax.stop_gradient(total / (jnp.sum(mask_BT) + 1e-8))


# ----------------------------------------------------------------------------------------------
# AGGREGATION
# ----------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat,
    loss_mask,
    loss_agg_mode,
    *,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """Aggregates a per-token loss matrix into a scalar, as verl's ``agg_loss``.

    S = sum of mask * loss over valid tokens, n_i = valid tokens of row i, N_tok = sum n_i,
    N_seq = number of rows with n_i > 0:

    * ``token-mean``: S / (batch_num_tokens or N_tok) * dp_size.
    * ``token-sum``: S * dp_size.
    * ``seq-mean-token-sum``: sum_i S_i / (global_batch_size or N_seq) * dp_size.
    * ``seq-mean-token-mean``: sum_i S_i / (n_i + 1e-8) / (global_batch_size or N_seq) * dp_size.
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / (loss_scale_factor or T).

    Args:
        loss_mat: [B, T] per-token losses (any float dtype; summed in float32).
        loss_mask: [B, T] mask; non-zero entries are valid and weigh by their value (verl).
        loss_agg_mode: one of ``AGG_MODES`` (config ``actor.loss_agg_mode``).
        dp_size: data-parallel size; > 1 requires the global count of the chosen mode.
        batch_num_tokens: global valid-token count (``token-mean``), int or scalar array.
        global_batch_size: global number of sequences (``seq-mean-*``), int or scalar array.
        loss_scale_factor: divisor of ``seq-mean-token-sum-norm`` (config
            ``actor.loss_scale_factor``); None means the padded width T. Ignored by other modes.

    Returns:
        float32 scalar. Empty denominators give 0 (verl: NaN).
    """
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    mask_BT = loss_mask.astype(jnp.float32)
    valid_BT = jnp.where(mask_BT != 0, loss_mat.astype(jnp.float32), 0.0) * mask_BT
    match loss_agg_mode:
        case "token-mean":
            if batch_num_tokens is None:
                if dp_size > 1:
                    raise ValueError("agg_loss: batch_num_tokens is required when dp_size > 1")
                batch_num_tokens = jnp.sum(mask_BT)
            return _safe_divide(jnp.sum(valid_BT), batch_num_tokens) * dp_size
        case "token-sum":
            return jnp.sum(valid_BT) * dp_size
        case "seq-mean-token-sum" | "seq-mean-token-sum-norm" | "seq-mean-token-mean":
            n_B = jnp.sum(mask_BT, axis=-1)
            seq_B = jnp.sum(valid_BT, axis=-1)
            if loss_agg_mode == "seq-mean-token-mean":
                seq_B = seq_B / (n_B + 1e-8)
            if global_batch_size is None:
                if dp_size > 1:
                    raise ValueError("agg_loss: global_batch_size is required when dp_size > 1")
                global_batch_size = jnp.sum((n_B > 0).astype(jnp.float32))
            loss = _safe_divide(jnp.sum(jnp.where(n_B > 0, seq_B, 0.0)), global_batch_size)
            loss = loss * dp_size
            if loss_agg_mode == "seq-mean-token-sum-norm":
                scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
                loss = loss / scale
            return loss


# ----------------------------------------------------------------------------------------------
# KL ESTIMATORS
# ----------------------------------------------------------------------------------------------


def kl_penalty(log_prob, ref_log_prob, kl_type, *, logits=None, ref_logits=None):
    """Per-token KL estimate between the policy and the reference, as verl's ``kl_penalty``.

    With d = log_prob - ref_log_prob:

    * ``kl``/``k1``: d.  ``abs``: |d|.  ``mse``/``k2``: d^2 / 2.
    * ``low_var_kl``/``k3``: x = clamp(-d, -20, 20); clamp(e^x - x - 1, -10, 10). The gradient
      is 0 where either clamp binds.
    * ``full``: exact KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v) from ``logits`` and
      ``ref_logits`` [B, T, V] (already divided by the temperature), computed over row chunks
      with a hand-written backward, so no float32 [B, T, V] copy is made. Gradient flows to
      ``logits`` only (the reference is frozen). ``log_prob``/``ref_log_prob`` may be None.
    * ``<name>+``: the value of ``<name>`` with the gradient of k2 with respect to the log-probs
      (straight-through: k2 - sg(k2) + sg(value)); needs the log-probs, also for ``full+``.

    Args:
        log_prob: [B, T] policy log-probs of the sampled tokens.
        ref_log_prob: [B, T] reference-model log-probs of the same tokens.
        kl_type: one of ``KL_TYPES`` (config ``actor.kl_loss_type`` or
            ``algorithm.kl_penalty``).
        logits: [B, T, V] policy logits, only for ``full``/``full+``.
        ref_logits: [B, T, V] reference logits, only for ``full``/``full+``.

    Returns:
        [B, T] float32 estimate (no masking inside).
    """
    check_choice("kl_type", kl_type, KL_TYPES)
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    if (base != "full" or straight_through) and (log_prob is None or ref_log_prob is None):
        raise ValueError(f"kl_type {kl_type!r} needs log_prob and ref_log_prob")
    if base == "full":
        value = logprobs.full_kl_from_logits(logits, ref_logits)
    else:
        d = log_prob.astype(jnp.float32) - ref_log_prob.astype(jnp.float32)
        match base:
            case "kl" | "k1":
                value = d
            case "abs":
                value = d * jnp.sign(d)  # |d| with torch's gradient sign(d), 0 at d = 0
            case "mse" | "k2":
                value = 0.5 * d * d
            case "low_var_kl" | "k3":
                x = _clamp(-d, -20.0, 20.0)
                value = _clamp(jnp.exp(x) - x - 1.0, -10.0, 10.0)
    if not straight_through or base in ("mse", "k2"):
        return value
    d = log_prob.astype(jnp.float32) - ref_log_prob.astype(jnp.float32)
    k2 = 0.5 * d * d
    return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)


# ----------------------------------------------------------------------------------------------
# POLICY LOSSES
# ----------------------------------------------------------------------------------------------


def _vanilla_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, clip_low, clip_high, clip_ratio_c):
    """PPO clip with clip-higher and dual clip; returns (loss_BT, metrics)."""
    log_ratio_BT = _clamp(lp_BT - old_BT, -20.0, 20.0)
    ratio_BT = jnp.exp(log_ratio_BT)
    loss1_BT = -adv_BT * ratio_BT
    loss2_BT = -adv_BT * _clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    clipped_BT = jnp.maximum(loss1_BT, loss2_BT)
    # Dual clip (arXiv 1912.09729): for A < 0 the loss is capped at -A * c once ratio > c.
    loss3_BT = -adv_BT * clip_ratio_c
    negative_BT = adv_BT < 0
    loss_BT = jnp.where(negative_BT, jnp.minimum(loss3_BT, clipped_BT), clipped_BT)
    metrics = {
        "actor/pg_clipfrac": _masked_mean(loss2_BT > loss1_BT, mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": _masked_mean((clipped_BT > loss3_BT) & negative_BT, mask_BT),
    }
    return loss_BT, metrics


def _gspo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, clip_low, clip_high):
    """GSPO: token ratio exp(sg(mean_t log r) + lp - sg(lp)), PPO clip, no dual clip."""
    log_ratio_BT = lp_BT - old_BT
    length_B = jnp.maximum(jnp.sum(mask_BT.astype(jnp.float32), axis=-1), 1.0)
    seq_log_ratio_B = jnp.sum(log_ratio_BT * mask_BT, axis=-1) / length_B
    log_seq_ratio_BT = (
        lp_BT - jax.lax.stop_gradient(lp_BT) + jax.lax.stop_gradient(seq_log_ratio_B)[:, None]
    )
    ratio_BT = jnp.exp(_clamp(log_seq_ratio_BT, hi=10.0))
    loss1_BT = -adv_BT * ratio_BT
    loss2_BT = -adv_BT * _clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    metrics = {
        "actor/pg_clipfrac": _masked_mean(loss2_BT > loss1_BT, mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": jnp.zeros((), jnp.float32),
    }
    return jnp.maximum(loss1_BT, loss2_BT), metrics


def _cispo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, clip_low, clip_high):
    """CISPO: -sg(clamp(ratio, 1 - eps_low, 1 + eps_high)) * A * log_prob."""
    log_ratio_BT = _clamp(lp_BT - old_BT, -20.0, 20.0)
    ratio_BT = jnp.exp(log_ratio_BT)
    clipped_ratio_BT = _clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    metrics = {
        "actor/pg_clipfrac": _masked_mean(ratio_BT != clipped_ratio_BT, mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": jnp.zeros((), jnp.float32),
    }
    return -jax.lax.stop_gradient(clipped_ratio_BT) * adv_BT * lp_BT, metrics


def _abs(x):
    """|x| with torch's gradient sign(x), 0 at x = 0 (jnp.abs passes 1 there)."""
    return x * jnp.sign(x)


@functools.lru_cache(maxsize=64)
def _count_thresholds(ratio, n_max):
    """c_j = min{n : float64(n * ratio) >= j} for j = 1..min(int(ratio * n_max), n_max).

    verl computes a token budget as ``int(ratio * n)`` on Python floats (float64). Float32
    rounds differently near integers (0.0003 * 10000 is 2.9999999999999996 in float64, so verl
    takes 2, but 3.0000002 in float32), so the count is looked up among these static thresholds
    instead: int(ratio * n) = #{j : c_j <= n}.
    """
    top = min(int(ratio * n_max), n_max)
    j = np.arange(1, top + 1, dtype=np.float64)
    c = np.ceil(j / ratio)
    while np.any(step := (c > 0) & ((c - 1) * ratio >= j)):
        c = c - step
    while np.any(step := c * ratio < j):
        c = c + step
    c = c.astype(np.int32)
    c.setflags(write=False)
    return c


def _token_budget(num_valid, ratio, n_max):
    """max(1, int(ratio * num_valid)) with float64 semantics, for a traced int32 count."""
    thresholds = _count_thresholds(float(ratio), int(n_max))
    count = jnp.searchsorted(jnp.asarray(thresholds), num_valid, side="right")
    return jnp.maximum(count, 1)


def _top_k_mask(score_BT, candidate_BT, k):
    """The (at most) k candidates with the largest score; ties go to the lower flat index."""
    key_N = jnp.where(candidate_BT, score_BT, -jnp.inf).reshape(-1)
    order_N = jnp.argsort(key_N, stable=True, descending=True)
    rank_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(key_N.size, dtype=order_N.dtype))
    return candidate_BT & (rank_N.reshape(score_BT.shape) < k)


def _clip_cov_token_losses(
    old_BT,
    lp_BT,
    adv_BT,
    mask_BT,
    *,
    clip_low,
    clip_high,
    clip_cov_ratio,
    clip_cov_lb,
    clip_cov_ub,
    rng,
):
    """Clip-Cov (arXiv 2505.22617): PPO clip, then detach a few high-covariance tokens.

    Candidates are the valid tokens the PPO clip did not already clip whose centred covariance
    (A - mean A)(lp - mean lp) lies strictly inside (clip_cov_lb, clip_cov_ub); max(1,
    int(clip_cov_ratio * N_tok)) of them get a zero loss (so no gradient). verl draws them with
    torch.randperm; here ``rng`` (a PRNG key) draws a uniform random subset, and without it the
    candidates with the largest covariance are taken (ties: lower flat index first)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    log_ratio_BT = lp_BT - old_BT  # no +-20 clamp in verl's clip_cov
    ratio_BT = jnp.exp(log_ratio_BT)
    loss1_BT = -adv_BT * ratio_BT
    loss2_BT = -adv_BT * _clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    valid_BT = mask_BT != 0
    cov_BT = jax.lax.stop_gradient(
        (adv_BT - _masked_mean(adv_BT, mask_BT)) * (lp_BT - _masked_mean(lp_BT, mask_BT))
    )
    candidate_BT = (
        valid_BT & ~(loss2_BT > loss1_BT) & (cov_BT > clip_cov_lb) & (cov_BT < clip_cov_ub)
    )
    budget = _token_budget(jnp.sum(valid_BT, dtype=jnp.int32), clip_cov_ratio, mask_BT.size)
    selected_BT = _clip_cov_select(cov_BT, candidate_BT, budget, rng)
    metrics = {
        "actor/pg_clipfrac": _masked_mean(selected_BT, mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
    }
    return jnp.where(selected_BT, 0.0, jnp.maximum(loss1_BT, loss2_BT)), metrics


def _clip_cov_select(cov_BT, candidate_BT, budget, rng):
    """The tokens clip_cov detaches (a seam for parity tests): ``budget`` candidates drawn
    uniformly at random from ``rng``, or the largest-covariance ones without it."""
    if rng is None:
        return _top_k_mask(cov_BT, candidate_BT, budget)
    return _random_subset_mask(rng, candidate_BT, budget)


def _random_subset_mask(rng, candidate_BT, k):
    """min(k, #candidates) of the candidates, every such subset equally likely.

    Each token gets a distinct random priority (a uniform random permutation of 0..N-1, so no
    ties can favour an index) and the k candidates of lowest priority are taken: as verl's
    ``torch.randperm`` over the candidates, a uniform random subset."""
    size = candidate_BT.size
    priority_N = jax.random.permutation(rng, size)
    key_N = jnp.where(candidate_BT.reshape(-1), priority_N, size)
    order_N = jnp.argsort(key_N)
    rank_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(size, dtype=order_N.dtype))
    return candidate_BT & (rank_N.reshape(candidate_BT.shape) < k)


def _kl_cov_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, kl_cov_ratio, ppo_kl_coef):
    """KL-Cov (arXiv 2505.22617): -A r, plus ppo_kl_coef |lp - old| on the top-covariance tokens.

    The max(1, int(kl_cov_ratio * N_tok)) valid tokens with the largest centred covariance
    (A - mean A)(lp - mean lp) (plain means over valid tokens) get the KL penalty. Ties (verl's
    torch.topk leaves them unspecified) go to the lower flat index."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio_BT = lp_BT - old_BT  # no +-20 clamp in verl's kl_cov
    abs_kl_BT = _abs(log_ratio_BT)
    loss1_BT = -adv_BT * jnp.exp(log_ratio_BT)
    valid_BT = mask_BT != 0
    num_valid = jnp.sum(valid_BT, dtype=jnp.int32)
    denominator = jnp.maximum(num_valid, 1).astype(jnp.float32)

    def centred(x_BT):
        return x_BT - jnp.sum(jnp.where(valid_BT, x_BT, 0.0)) / denominator

    cov_BT = jax.lax.stop_gradient(centred(adv_BT) * centred(lp_BT))
    budget = _token_budget(num_valid, kl_cov_ratio, mask_BT.size)
    selected_BT = _top_k_mask(cov_BT, valid_BT, budget)
    loss_BT = jnp.where(selected_BT, loss1_BT + ppo_kl_coef * abs_kl_BT, loss1_BT)
    return loss_BT, {"actor/ppo_kl": _masked_mean(abs_kl_BT, mask_BT)}


def _geo_mean_loss(
    old_BT, lp_BT, adv_BT, mask_BT, weights_BT, *, clip_low, clip_high, local_batch_size
):
    """GMPO (arXiv 2507.20673): geometric mean of sign-aware clipped token ratios per sequence.

    Returns (pg_loss, metrics); pg_loss is the sum over the B rows of -A_seq ratio_seq divided by
    ``local_batch_size`` (None: B), verl's plain mean over the micro-batch's sequences (verl
    ignores ``loss_agg_mode`` and the global-batch arguments here). Fully masked rows add 0."""
    log_ratio_BT = lp_BT - old_BT  # verl leaves the +-20 clamp commented out
    sign_BT = jnp.sign(adv_BT)
    clamped_BT = _clamp(log_ratio_BT, -clip_low, clip_high)
    # Clip in the direction that limits the update: for A > 0 cap log r at eps_high, for A < 0
    # floor it at -eps_low; the other side stays unclipped.
    clipped_BT = sign_BT * jnp.minimum(sign_BT * log_ratio_BT, sign_BT * clamped_BT)
    length_B = jnp.sum(mask_BT, axis=-1) + 1e-8
    ratio_B = jnp.exp(jnp.sum(clipped_BT * mask_BT, axis=-1) / length_B)
    adv_B = jnp.sum(adv_BT * mask_BT, axis=-1) / length_B
    loss_B = -adv_B * ratio_B
    if weights_BT is not None:
        # Token IS weights become one per sequence, by their geometric mean.
        loss_B = loss_B * jnp.exp(
            jnp.sum(jnp.log(weights_BT + 1e-10) * mask_BT, axis=-1) / length_B
        )
    was_clipped_BT = log_ratio_BT != clamped_BT
    metrics = {
        "actor/pg_clipfrac": _masked_mean(was_clipped_BT & (adv_BT > 0), mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": _masked_mean(was_clipped_BT & (adv_BT < 0), mask_BT),
    }
    rows = loss_B.shape[0] if local_batch_size is None else local_batch_size
    return jnp.sum(loss_B) / rows, metrics


def _sapo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, tau_pos, tau_neg):
    """SAPO (arXiv 2511.20347): -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, a soft clip."""
    log_ratio_BT = _clamp(lp_BT - old_BT, -20.0, 20.0)
    ratio_BT = jnp.exp(log_ratio_BT)
    tau_BT = jnp.where(adv_BT > 0, jnp.float32(tau_pos), jnp.float32(tau_neg))
    gate_BT = jax.nn.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    zero = jnp.zeros((), jnp.float32)
    metrics = {
        "actor/pg_clipfrac": zero,
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": zero,
    }
    return -gate_BT * adv_BT, metrics


def _dppo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, clip_low, clip_high, cap, divergence):
    """DPPO (arXiv 2602.04879): -A sg(min(r, cap)) lp on tokens inside a binary trust region.

    ``divergence`` "tv": the region is p - p_old <= eps_high (A > 0) / >= -eps_low (A <= 0);
    "kl": binary KL(p_old || p) <= eps_high (A > 0) or p <= p_old, and <= eps_low (A <= 0) or
    p >= p_old. Tokens outside get no loss; the truncated ratio is detached."""
    log_ratio_BT = _clamp(lp_BT - old_BT, -20.0, 20.0)
    ratio_BT = jnp.exp(log_ratio_BT)
    truncated_BT = jax.lax.stop_gradient(_clamp(ratio_BT, hi=cap))
    prob_BT, old_prob_BT = jnp.exp(lp_BT), jnp.exp(old_BT)
    if divergence == "tv":
        keep_pos_BT = prob_BT - old_prob_BT <= clip_high
        keep_neg_BT = prob_BT - old_prob_BT >= -clip_low
    else:
        binary_kl_BT = old_prob_BT * (old_BT - lp_BT) + (1.0 - old_prob_BT) * jnp.log(
            (1.0 - old_prob_BT + 1e-8) / (1.0 - prob_BT + 1e-8)
        )
        keep_pos_BT = (binary_kl_BT <= clip_high) | (prob_BT <= old_prob_BT)
        keep_neg_BT = (binary_kl_BT <= clip_low) | (prob_BT >= old_prob_BT)
    keep_BT = jax.lax.stop_gradient(
        jnp.where(adv_BT > 0, keep_pos_BT, keep_neg_BT).astype(jnp.float32)
    )
    metrics = {
        "actor/pg_clipfrac": _masked_mean(1.0 - keep_BT, mask_BT),
        "actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "actor/pg_clipfrac_lower": _masked_mean((ratio_BT > cap) * keep_BT, mask_BT),
    }
    return -adv_BT * truncated_BT * lp_BT * keep_BT, metrics


def _dro_token_losses(old_BT, lp_BT, adv_BT, mask_BT, *, dro_beta):
    """DRO: -(lp A - beta/2 (lp - old)^2), REINFORCE with a quadratic log-ratio penalty."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro_beta must be a positive value when using DRO, got {dro_beta}")
    log_ratio_BT = lp_BT - old_BT
    loss_BT = -(lp_BT * adv_BT - 0.5 * dro_beta * log_ratio_BT * log_ratio_BT)
    return loss_BT, {"actor/ppo_kl": _masked_mean(-log_ratio_BT, mask_BT)}


# Policy losses added with register_policy_loss, by name. Only the decorator writes here.
_REGISTERED_POLICY_LOSSES = registry.Registry("policy loss", (*POLICY_LOSS_MODES, "bypass_mode"))


def policy_loss_mode_names():
    """Every mode name ``compute_policy_loss`` accepts now: ``POLICY_LOSS_MODES``,
    ``bypass_mode``, then registered ones (and any "module:function", imported when used)."""
    return _REGISTERED_POLICY_LOSSES.names()


def check_policy_loss_mode(field: str, mode) -> None:
    """Raises ValueError('field=mode ...') unless ``compute_policy_loss`` accepts ``mode``."""
    _REGISTERED_POLICY_LOSSES.check(field, mode)


def register_policy_loss(name):
    """Decorator adding a user policy loss under ``name`` for ``compute_policy_loss``.

    The function is called as ``fn(old_log_prob, log_prob, advantages, response_mask, *,
    loss_agg_mode, **kwargs)`` and must return ``(loss, metrics)``: a float32 scalar and a dict
    of scalars. ``kwargs`` holds every other keyword of ``compute_policy_loss`` (``clip_ratio``,
    ``clip_ratio_low`` and ``clip_ratio_high`` resolved to floats, ``clip_ratio_c``,
    ``rollout_is_weights``, ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``, ``local_batch_size``, the built-in losses' settings, ``rng``) plus
    any extra keyword the caller gave, the way verl hands every loss the whole actor config:
    take what you need and accept the rest with ``**kwargs``. The arrays arrive as given (not
    zeroed at padding); ``agg_loss(loss_BT, response_mask, loss_agg_mode, dp_size=..., ...)``
    aggregates like the built-ins. The function is returned unchanged.

    Args:
        name: a non-empty string that is neither built in (``POLICY_LOSS_MODES``) nor registered
            already (registering the same function again under the same name is a no-op).

    Raises:
        ValueError: ``name`` is built in or already taken by another function.
    """
    return _REGISTERED_POLICY_LOSSES.decorator(name, caller="register_policy_loss")


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    rollout_is_weights=None,
    policy_loss_mode="vanilla",
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    local_batch_size=None,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    kl_cov_ratio=0.0002,
    ppo_kl_coef=0.1,
    tau_pos=1.0,
    tau_neg=1.05,
    dro_beta=None,
    rng=None,
    **kwargs,
):
    """Policy-gradient loss and its metrics, as verl's registered policy losses.

    ``policy_loss_mode`` (config ``actor.policy_loss.loss_mode``) selects the per-token loss,
    with r = exp(clamp(log_prob - old_log_prob, -20, 20)), A the advantage, eps_low/eps_high the
    clip ratios and sg the stop-gradient:

    * ``vanilla``: L = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high)), and for A < 0
      additionally min(-A c, L) (dual clip, c = ``clip_ratio_c`` > 1).
    * ``gspo``: the same clip (no dual clip) on the sequence-level ratio
      exp(sg(masked mean of log r) + log_prob - sg(log_prob)), log clamped at 10, no +-20 clamp.
    * ``cispo``: L = -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A log_prob.
    * ``gpg``: L = -A log_prob (REINFORCE; no ratio, no metrics).
    * ``clip_cov`` (arXiv 2505.22617): the vanilla clip without dual clip and without the +-20
      clamp; then max(1, int(clip_cov_ratio N_tok)) of the unclipped valid tokens whose centred
      covariance (A - mean A)(lp - mean lp) lies in (clip_cov_lb, clip_cov_ub) get L = 0. verl
      picks them uniformly at random with torch.randperm; here a uniform random subset is drawn
      from ``rng`` (the trainer always passes one). Without ``rng`` the candidates with the
      largest covariance are taken instead (ties: lower flat index), a deterministic pick for
      hand-derived tests, not verl's. Both equal verl's whenever the budget covers every
      candidate. Metrics: ``actor/pg_clipfrac`` (fraction detached), ``actor/ppo_kl``.
    * ``kl_cov``: L = -A exp(lp - old) (no clamp, no clip), plus ``ppo_kl_coef`` |lp - old| on
      the max(1, int(kl_cov_ratio N_tok)) valid tokens with the largest covariance (ties: lower
      flat index). Metric ``actor/ppo_kl`` is the masked mean of |lp - old| here.
    * ``geo_mean`` (GMPO, arXiv 2507.20673): per token log r (unclamped) clipped to eps_high
      above for A > 0 and to -eps_low below for A < 0; per sequence ratio = exp(masked mean),
      advantage = masked mean of A, loss = plain mean over the micro-batch's sequences of
      -A_seq ratio_seq: the sum over the B rows / ``local_batch_size`` (None: B). Ignores
      ``loss_agg_mode`` and the global-batch arguments (as verl, so micro-batch gradients summed
      by the engine scale with the micro-batch count); token IS weights become their
      per-sequence geometric mean. Metrics: clipped fraction with A > 0 (``pg_clipfrac``) and
      with A < 0 (``pg_clipfrac_lower``).
    * ``sapo`` (arXiv 2511.20347): L = -A sigmoid(tau (r - 1)) 4 / tau, tau = ``tau_pos`` where
      A > 0 else ``tau_neg``. Always aggregated with ``seq-mean-token-mean`` (verl ignores
      ``loss_agg_mode``; the global-batch arguments still apply). Clip fractions are 0.
    * ``dppo_tv`` / ``dppo_kl`` (arXiv 2602.04879): L = -A sg(min(r, clip_ratio_c)) log_prob on
      tokens inside a binary trust region (TV: p - p_old <= eps_high for A > 0, >= -eps_low
      otherwise; KL: binary KL(p_old || p) <= eps, or the probability moved the safe way), 0
      elsewhere; eps_low/eps_high are divergence thresholds here. ``pg_clipfrac`` is the
      fraction outside the region, ``pg_clipfrac_lower`` the kept fraction with r > cap. verl
      reads the cap as ``config.get("clip_ratio_c", 20.0)``, but ActorConfig always defines
      clip_ratio_c (3.0), so the effective default is 3.0, as here; the paper suggests 20.
    * ``dro``: L = -(A log_prob - dro_beta/2 (lp - old)^2); ``dro_beta`` has no default and must
      be > 0 (ValueError, as verl). Metric ``actor/ppo_kl``.
    * a name added with ``register_policy_loss``: that function, with every keyword here.

    * ``bypass_mode``: verl's bypass loss, ``compute_policy_loss_bypass_mode``, given its
      settings as ``rollout_correction=...``.
    L is multiplied by ``rollout_is_weights`` when given (except geo_mean, above), then
    aggregated with ``agg_loss``.

    Args:
        old_log_prob: [B, T] log-probs of the policy that sampled (or recomputed old policy).
        log_prob: [B, T] log-probs of the current policy (differentiated).
        advantages: [B, T] advantages.
        response_mask: [B, T] 0/1 (or bool) response mask.
        loss_agg_mode: aggregation mode, see ``agg_loss``.
        clip_ratio: eps, the default for both sides (config ``actor.clip_ratio``).
        clip_ratio_low: eps_low; None means ``clip_ratio``.
        clip_ratio_high: eps_high (DAPO clip-higher); None means ``clip_ratio``.
        clip_ratio_c: dual-clip cap c (must be > 1 for ``vanilla``); the ratio cap of dppo.
        rollout_is_weights: optional [B, T] importance weights (treated as given; pass constants).
        policy_loss_mode: one of ``policy_loss_mode_names()``.
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see ``agg_loss``
            (verl's ``global_batch_info``).
        local_batch_size: the sequences of the micro-batch these [B, T] arrays hold, when they
            are a larger layout whose other rows are fully masked (packed micro-batches); the
            divisor of geo_mean's plain mean. None: B.
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: clip_cov settings (config
            ``actor.policy_loss.*``; verl defaults 2e-4, 1, 5).
        kl_cov_ratio, ppo_kl_coef: kl_cov settings (verl defaults 2e-4, 0.1).
        tau_pos, tau_neg: sapo temperatures (config ``actor.tau_pos`` / ``tau_neg``; 1.0, 1.05).
        dro_beta: dro's penalty (config ``actor.policy_loss.dro_beta``; None).
        rng: PRNG key of clip_cov's uniform random pick (see above); passed on to a registered
            loss too.
        **kwargs: extra settings, only for a registered loss (TypeError for a built-in mode).

    Returns:
        (pg_loss, metrics): float32 scalar, and a dict of float32 scalars with verl's keys for
        the mode (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, or the
        subsets above; empty for gpg). Metrics are masked means over valid tokens with
        denominator (sum of mask + 1e-8).
    """
    check_policy_loss_mode("policy_loss_mode", policy_loss_mode)
    check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    clip_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    clip_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    global_batch_info = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    if policy_loss_mode == "bypass_mode":
        return _bypass_mode_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
            clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c, **global_batch_info, **kwargs,
        )  # fmt: skip
    if policy_loss_mode not in POLICY_LOSS_MODES:
        return _REGISTERED_POLICY_LOSSES[policy_loss_mode](
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode=loss_agg_mode,
            clip_ratio=clip_ratio,
            clip_ratio_low=clip_low,
            clip_ratio_high=clip_high,
            clip_ratio_c=clip_ratio_c,
            rollout_is_weights=rollout_is_weights,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
            kl_cov_ratio=kl_cov_ratio,
            ppo_kl_coef=ppo_kl_coef,
            tau_pos=tau_pos,
            tau_neg=tau_neg,
            dro_beta=dro_beta,
            rng=rng,
            local_batch_size=local_batch_size,
            **global_batch_info,
            **kwargs,
        )
    if kwargs:
        raise TypeError(
            f"policy_loss_mode {policy_loss_mode!r} takes no extra keyword arguments, got "
            f"{sorted(kwargs)} (extra keywords are for registered losses)"
        )
    if policy_loss_mode == "vanilla":
        check_clip_ratio_c(clip_ratio_c)
    mask_BT = response_mask.astype(jnp.float32)
    # Zero the inputs at masked positions so NaN/inf padding cannot reach values or gradients.
    old_BT, lp_BT, adv_BT = (
        jnp.where(mask_BT != 0, x.astype(jnp.float32), 0.0)
        for x in (old_log_prob, log_prob, advantages)
    )
    weights_BT = (
        None
        if rollout_is_weights is None
        else jnp.where(mask_BT != 0, rollout_is_weights.astype(jnp.float32), 0.0)
    )
    clips = {"clip_low": clip_low, "clip_high": clip_high}
    match policy_loss_mode:
        case "vanilla":
            loss_BT, metrics = _vanilla_token_losses(
                old_BT, lp_BT, adv_BT, mask_BT, **clips, clip_ratio_c=clip_ratio_c
            )
        case "gspo":
            loss_BT, metrics = _gspo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, **clips)
        case "cispo":
            loss_BT, metrics = _cispo_token_losses(old_BT, lp_BT, adv_BT, mask_BT, **clips)
        case "gpg":
            loss_BT, metrics = -lp_BT * adv_BT, {}
        case "clip_cov":
            loss_BT, metrics = _clip_cov_token_losses(
                old_BT,
                lp_BT,
                adv_BT,
                mask_BT,
                **clips,
                clip_cov_ratio=clip_cov_ratio,
                clip_cov_lb=clip_cov_lb,
                clip_cov_ub=clip_cov_ub,
                rng=rng,
            )
        case "kl_cov":
            loss_BT, metrics = _kl_cov_token_losses(
                old_BT, lp_BT, adv_BT, mask_BT, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef
            )
        case "geo_mean":
            return _geo_mean_loss(
                old_BT, lp_BT, adv_BT, mask_BT, weights_BT, **clips,
                local_batch_size=local_batch_size,
            )  # fmt: skip
        case "sapo":
            loss_BT, metrics = _sapo_token_losses(
                old_BT, lp_BT, adv_BT, mask_BT, tau_pos=tau_pos, tau_neg=tau_neg
            )
            loss_agg_mode = "seq-mean-token-mean"  # verl's sapo ignores the configured mode
        case "dppo_tv" | "dppo_kl":
            loss_BT, metrics = _dppo_token_losses(
                old_BT,
                lp_BT,
                adv_BT,
                mask_BT,
                **clips,
                cap=clip_ratio_c,
                divergence=policy_loss_mode.removeprefix("dppo_"),
            )
        case "dro":
            loss_BT, metrics = _dro_token_losses(old_BT, lp_BT, adv_BT, mask_BT, dro_beta=dro_beta)
    if weights_BT is not None:
        loss_BT = loss_BT * weights_BT
    pg_loss = agg_loss(loss_BT, mask_BT, loss_agg_mode, **global_batch_info)
    return pg_loss, metrics


# ----------------------------------------------------------------------------------------------
# BYPASS MODE (verl's rollout-correction losses: old_log_prob is the rollout engine's)
# ----------------------------------------------------------------------------------------------


def compute_policy_loss_reinforce(
    rollout_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="seq-mean-token-sum",
    rollout_is_weights=None,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """REINFORCE with optional IS weights: L = -A log_prob w, no ratio and no clip.

    Args:
        rollout_log_prob: [B, T] rollout log-probs (only for the ``actor/ppo_kl`` metric).
        log_prob: [B, T] current log-probs (differentiated).
        advantages: [B, T] advantages.
        response_mask: [B, T] 0/1 mask (rejection already applied).
        loss_agg_mode: see ``agg_loss`` (verl's default for this function).
        rollout_is_weights: optional [B, T] weights (treated as constants).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see ``agg_loss``.

    Returns:
        (pg_loss, {"actor/ppo_kl": masked mean of rollout_log_prob - log_prob}).
    """
    mask_BT = response_mask.astype(jnp.float32)
    rollout_BT, lp_BT, adv_BT = (
        jnp.where(mask_BT != 0, x.astype(jnp.float32), 0.0)
        for x in (rollout_log_prob, log_prob, advantages)
    )
    loss_BT = -adv_BT * lp_BT
    if rollout_is_weights is not None:
        loss_BT = loss_BT * jnp.where(mask_BT != 0, rollout_is_weights.astype(jnp.float32), 0.0)
    pg_loss = agg_loss(
        loss_BT,
        mask_BT,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    ppo_kl = _masked_mean(-(lp_BT - rollout_BT), mask_BT)
    return pg_loss, {"actor/ppo_kl": ppo_kl}


def compute_policy_loss_bypass_mode(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    loss_type="ppo_clip",
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
    rollout_rs=None,
    rollout_rs_threshold=None,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's ``bypass_mode`` policy loss: old_log_prob is the rollout engine's log-prob.

    IS weights and the rejection mask are computed from sg(log_prob) (the current policy)
    against ``old_log_prob`` with the ``rollout_correction`` settings, then:

    * ``loss_type="ppo_clip"``: ``compute_policy_loss`` vanilla on the rejection-masked
      response (the ratio pi / pi_rollout already is the IS correction; weights not applied).
    * ``loss_type="reinforce"``: ``compute_policy_loss_reinforce`` with the weights.

    verl ignores the trainer's ``rollout_is_weights`` here (it recomputes them), so this
    function does not take them. ``compute_policy_loss(policy_loss_mode="bypass_mode",
    rollout_correction=<settings>)`` selects it by name.

    Args:
        old_log_prob: [B, T] rollout log-probs (bypass: old = rollout).
        log_prob: [B, T] current log-probs (differentiated).
        advantages: [B, T] advantages.
        response_mask: [B, T] 0/1 response mask, with at least one valid token.
        loss_agg_mode: see ``agg_loss``.
        loss_type: "ppo_clip" or "reinforce" (config ``algorithm.rollout_correction.loss_type``).
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
            rollout_rs_threshold: see ``compute_rollout_correction``.
        clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c: vanilla PPO settings.
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see ``agg_loss``.

    Returns:
        (pg_loss, metrics): the chosen loss's metrics plus the ``rollout_corr/*`` metrics of the
        current policy against the rollout.
    """
    if loss_type not in rollout_correction.LOSS_TYPES:
        raise ValueError(
            f"Invalid loss_type {loss_type!r}; valid: {', '.join(rollout_correction.LOSS_TYPES)}"
        )
    weights_BT, mask_BT, corr_metrics = rollout_correction.correction_and_rejection(
        jax.lax.stop_gradient(log_prob),
        old_log_prob,
        response_mask,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    global_batch_info = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    if loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(
            old_log_prob,
            log_prob,
            advantages,
            mask_BT,
            loss_agg_mode=loss_agg_mode,
            rollout_is_weights=weights_BT,
            **global_batch_info,
        )
    else:
        pg_loss, metrics = compute_policy_loss(
            old_log_prob,
            log_prob,
            advantages,
            mask_BT,
            loss_agg_mode=loss_agg_mode,
            clip_ratio=clip_ratio,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            policy_loss_mode="vanilla",
            **global_batch_info,
        )
    return pg_loss, {**metrics, **corr_metrics}


def _bypass_mode_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    rollout_correction=None,
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    **unused,
):
    """``policy_loss_mode="bypass_mode"``: ``compute_policy_loss_bypass_mode`` by name (what
    ``compute_policy_loss`` calls for that mode).

    ``rollout_correction`` holds the ``algorithm.rollout_correction`` settings it reads
    (``rollout_is``, ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``, ``loss_type``) as a dict or a tuple of (name, value) pairs, the way
    verl hands the loss ``policy_loss.rollout_correction``. The trainer's ``rollout_is_weights``
    and the other losses' settings in ``unused`` are ignored, as in verl.
    """
    del unused
    if rollout_correction is None:
        raise ValueError(
            "policy_loss_mode='bypass_mode' needs rollout_correction=<the "
            "algorithm.rollout_correction settings> (grpo_jax's config passes them when "
            "algorithm.rollout_correction.bypass_mode=True)"
        )
    settings = dict(rollout_correction)
    return compute_policy_loss_bypass_mode(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
        **{k: settings[k] for k in _BYPASS_SETTINGS if k in settings},
    )


_BYPASS_SETTINGS = (
    "loss_type",
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)


# ----------------------------------------------------------------------------------------------
# ACTOR LOSS
# ----------------------------------------------------------------------------------------------


def actor_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    ref_log_prob=None,
    entropy=None,
    logits=None,
    ref_logits=None,
    policy_loss_mode="vanilla",
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    entropy_coeff=0.0,
    use_kl_loss=False,
    kl_loss_coef=0.001,
    kl_loss_type="low_var_kl",
    rollout_is_weights=None,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
    local_batch_size=None,
    policy_loss_kwargs=None,
):
    """verl's actor loss: pg_loss - entropy_coeff * entropy_loss (+ kl_loss_coef * kl_loss).

    All three terms use ``loss_agg_mode`` and the same global-batch arguments (verl 0.9.1
    engine ``ppo_loss``). The keyword names are verl's ``actor.*`` config fields.

    Args:
        old_log_prob, log_prob, advantages, response_mask: [B, T], see ``compute_policy_loss``.
        ref_log_prob: [B, T] reference log-probs; required when ``use_kl_loss``.
        entropy: [B, T] per-token entropy of the current policy (e.g. from
            ``logprobs_and_entropy_from_hidden``); required when ``entropy_coeff != 0``. When
            given, its aggregate is reported as ``actor/entropy``.
        logits, ref_logits: [B, T, V], only for ``kl_loss_type`` ``full``/``full+``.
        policy_loss_mode, loss_agg_mode, clip_ratio, clip_ratio_low, clip_ratio_high,
            clip_ratio_c, rollout_is_weights: see ``compute_policy_loss``.
        entropy_coeff: weight of the entropy bonus (config ``actor.entropy_coeff``).
        use_kl_loss: add the KL-to-reference loss (config ``actor.use_kl_loss``).
        kl_loss_coef: its weight beta (config ``actor.kl_loss_coef``).
        kl_loss_type: ``kl_penalty`` estimator (config ``actor.kl_loss_type``).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: see ``agg_loss``.
        local_batch_size: see ``compute_policy_loss`` (geo_mean's divisor; the other terms use
            the global-batch arguments).
        policy_loss_kwargs: the per-loss settings passed on to ``compute_policy_loss`` (e.g.
            ``{"clip_cov_ratio": 2e-4}``, ``{"tau_pos": 1.0, "tau_neg": 1.05}``,
            ``{"dro_beta": 0.1}``, ``{"rng": key}``, or a registered loss's own keywords).

    Returns:
        (loss, metrics): float32 scalar, and float32 scalar metrics ``actor/pg_loss``,
        the policy loss's metrics (``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower`` or the mode's subset, see ``compute_policy_loss``),
        ``actor/entropy`` (when ``entropy`` is given), ``actor/kl_loss`` and ``actor/kl_coef``
        (when ``use_kl_loss``).
    """
    check_choice("kl_loss_type", kl_loss_type, KL_TYPES)
    if entropy_coeff != 0 and entropy is None:
        raise ValueError("actor_loss: entropy_coeff != 0 needs the per-token entropy")
    needs_log_probs = kl_loss_type not in ("full",)
    if use_kl_loss and needs_log_probs and ref_log_prob is None:
        raise ValueError(f"actor_loss: use_kl_loss with {kl_loss_type!r} needs ref_log_prob")
    global_batch_info = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    pg_loss, pg_metrics = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        rollout_is_weights=rollout_is_weights,
        policy_loss_mode=policy_loss_mode,
        local_batch_size=local_batch_size,
        **global_batch_info,
        **(policy_loss_kwargs or {}),
    )
    metrics = {"actor/pg_loss": jax.lax.stop_gradient(pg_loss), **pg_metrics}
    loss = pg_loss
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode, **global_batch_info)
        loss = loss - entropy_coeff * entropy_loss
        metrics["actor/entropy"] = jax.lax.stop_gradient(entropy_loss)
    if use_kl_loss:
        mask_BT = response_mask != 0
        kld_BT = kl_penalty(
            None if ref_log_prob is None else jnp.where(mask_BT, log_prob, 0.0),
            None if ref_log_prob is None else jnp.where(mask_BT, ref_log_prob, 0.0),
            kl_loss_type,
            logits=logits,
            ref_logits=ref_logits,
        )
        kl_loss = agg_loss(kld_BT, response_mask, loss_agg_mode, **global_batch_info)
        loss = loss + kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = jax.lax.stop_gradient(kl_loss)
        metrics["actor/kl_coef"] = jnp.asarray(kl_loss_coef, jnp.float32)
    return loss, metrics
