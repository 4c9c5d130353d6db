"""Rollout correction with verl 0.9.1 semantics: IS weights, rejection masks, bypass mode, metrics.

The rollout engine (vLLM, our sampler in bf16, a stale checkpoint) samples from a policy
pi_rollout that differs from the trainer's recomputation pi_old of the same weights. verl's
``algorithm.rollout_correction`` (``verl/trainer/ppo/rollout_corr_helper.py``; Liu, Li, Fu et al.
2025, "When Speed Kills Stability", https://richardli.xyz/rl-collapse; Yao et al., "Your
efficient RL framework secretly brings you off-policy RL training", for truncated IS) corrects
for it from the two log-probs alone. This module owns that step, as pure jittable functions of
[B, T] arrays; the settings are Python values (static under jit) with verl's config field names:

* ``compute_rollout_correction_weights``: importance weights rho = pi_old / pi_rollout per token
  (``rollout_is="token"``) or per sequence (product over its tokens, ``"sequence"``), computed in
  log space with the log-ratio clamped to +-20, then truncated at ``rollout_is_threshold`` (TIS)
  or, for a "lower_upper" string, zeroed outside [lower, upper] (IcePop); optionally normalised
  to batch mean 1 (``rollout_is_batch_normalize``). The weights carry no gradient.
* ``compute_rollout_rejection_mask``: drops tokens or whole sequences whose divergence exceeds
  ``rollout_rs_threshold`` (``rollout_rs``: comma-separated options from ``ROLLOUT_RS_OPTIONS``,
  k1 = -log rho with ratio bounds "lower_upper", k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho,
  per token or as the sum, mean or max over a sequence; every option must pass).
* ``compute_offpolicy_metrics``: KL, k3 KL, perplexities, chi^2 of pi_old vs pi_rollout.
* ``compute_rollout_probs_diff_metrics``: verl's ``training/rollout_probs_diff_*`` debug metrics
  (|p_old - p_rollout| over valid tokens) and ``training/rollout_actor_probs_pearson_corr``.
* ``compute_rollout_correction``: the entry point the trainer calls once per batch, returning
  the weights (or None), the rejection-masked response mask and all metrics, with verl's keys
  (``rollout_corr/...`` and ``training/...``).
* ``compute_policy_loss_bypass_mode`` and ``compute_policy_loss_reinforce``: verl's
  ``bypass_mode`` policy loss, where old_log_prob *is* the rollout's log-prob (two policies, no
  recomputation): the IS weights and rejection mask are computed inside the loss from the
  current policy, then ``loss_type`` "ppo_clip" runs the vanilla PPO loss (the ratio already is
  the IS correction, so the weights are not applied) or "reinforce" runs -w A log pi.

Config defaults are those of verl's ``algorithm/rollout_correction.yaml``, which the trainer
reads: ``rollout_is=None`` (verl's ``RolloutCorrectionConfig`` dataclass says "sequence", but the
yaml that builds the trainer's config says null), ``rollout_is_threshold=2.0``,
``rollout_is_batch_normalize=False``, ``rollout_rs=None``, ``rollout_rs_threshold=None``,
``bypass_mode=False``, ``loss_type="ppo_clip"``.

verl 0.9.1's v1 trainer: with ``bypass_mode`` it sets old_log_prob = rollout_log_prob and skips
the correction (no weights, no rejection, no ``rollout_corr/*`` or ``training/*`` metrics) but
keeps the configured ``actor.policy_loss.loss_mode``; ``loss_type`` only matters for the
``bypass_mode`` loss, which 0.9.1 selects only in the deprecated v0 trainer (it rewrites
``loss_mode`` to "bypass_mode"). ``compute_rollout_correction(bypass_mode=True)`` follows v1.

Shapes: B sequences, T response tokens. Metrics are float32 scalar arrays (verl's are Python
floats). Deviations from verl:

1. Inputs at masked positions are zeroed before any arithmetic, so NaN or inf padding cannot
   reach weights or metrics (verl's ``exp(log_ratio) * mask`` keeps a NaN there).
2. An all-masked batch raises ValueError as in verl when the mask is concrete; under jit, where
   nothing can raise, weights are 0, the mask is unchanged and the metrics are finite or NaN.
3. Token IcePop that zeroes every weight: verl's effective sample size divides by zero in
   Python (ZeroDivisionError); here it is inf.
"""

import math

import jax
import jax.numpy as jnp

SAFETY_BOUND = 20.0  # |log rho| clamp before exp: e^20 ~ 4.9e8
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
LOSS_TYPES = ("ppo_clip", "reinforce")


# ----------------------------------------------------------------------------------------------
# THRESHOLD PARSING (static Python, verl's rules and error messages)
# ----------------------------------------------------------------------------------------------


def parse_rollout_is_threshold(rollout_is_threshold):
    """(upper, lower or None) from a float (TIS) or a "lower_upper" string (IcePop).

    Raises:
        TypeError: a bool or a non-number, non-string value.
        ValueError: unparsable, non-positive, or lower > upper.
    """
    spec = rollout_is_threshold
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a float or a string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string")
        try:
            if "_" in text:
                lower_text, upper_text = text.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(text)
        except ValueError as e:
            raise ValueError(f"Invalid rollout_is_threshold {spec!r}") from e
    else:
        upper = float(spec)
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None:
        if not lower > 0:
            raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}")
        if lower > upper:
            raise ValueError("rollout_is_threshold lower bound must be <= upper bound")
    return upper, lower


def parse_rollout_rs(rollout_rs):
    """The distinct options of a comma-separated ``rollout_rs`` string, in order."""
    if not isinstance(rollout_rs, str):
        # verl raises ValueError here, not TypeError.
        raise ValueError("rollout_rs must be a non-empty string (comma separated)")  # noqa: TRY004
    options = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if not option:
            continue
        if option not in ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option {option!r}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}"
            )
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option")
    return tuple(options)


def parse_rollout_rs_thresholds(options, rollout_rs_threshold):
    """{option: (lower or None, upper)}: one shared threshold or one per option.

    k1 options take ratio bounds "lower_upper" (a single value u means 1/u_u); the others one
    positive upper bound.
    """
    spec = rollout_rs_threshold
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a string or a number, got {spec!r}")
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.split(",") if part.strip()]
    else:
        parts = [str(spec)]
    if not parts:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value")
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold expects one threshold shared by all options or exactly "
            f"{len(options)} (one per rollout_rs option), got {len(parts)}"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    thresholds = {}
    for option, part in zip(options, parts, strict=True):
        is_k1 = option.endswith("k1")
        if not is_k1 and "_" in part:
            raise ValueError(
                f"rollout_rs_threshold for {option!r} takes one upper bound without '_', "
                f"got {part!r}"
            )
        try:
            if not is_k1:
                lower, upper = None, float(part)
            elif "_" in part:
                lower_text, upper_text = part.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(part)
                lower = 1.0 / upper
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"Invalid threshold {part!r} for rollout_rs option {option!r}") from e
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"Thresholds for {option!r} must be positive, got {part!r}")
        if lower is not None and lower > upper:
            raise ValueError(f"Thresholds for {option!r} must have lower <= upper, got {part!r}")
        thresholds[option] = (lower, upper)
    return thresholds


# ----------------------------------------------------------------------------------------------
# MASKED REDUCTIONS (verl_F.masked_sum / masked_mean; the mask is float32)
# ----------------------------------------------------------------------------------------------


def _masked_sum(x, mask, axis=None):
    return jnp.sum(jnp.where(mask != 0, x, 0.0) * mask, axis=axis)


def _masked_mean(x, mask, axis=None):
    return _masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def _masked_max(x, valid):
    return jnp.max(jnp.where(valid, x, -jnp.inf))


def _masked_min(x, valid):
    return jnp.min(jnp.where(valid, x, jnp.inf))


def _mean_std_over(x_B, valid_B):
    """Mean and unbiased std (0 for one element, as verl) of x over the rows where valid."""
    count = jnp.sum(valid_B.astype(jnp.float32))
    mean = jnp.sum(jnp.where(valid_B, x_B, 0.0)) / jnp.maximum(count, 1.0)
    sq = jnp.sum(jnp.where(valid_B, (x_B - mean) ** 2, 0.0))
    std = jnp.where(count > 1, jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0)), 0.0)
    return mean, std


def _clamped_std(x_BT, mask_BT, lo, hi):
    """verl's metric std: sqrt(max(E[c^2] - E[c]^2, 0)), c = clamp(x, lo, hi); 0 for <= 1 token."""
    c_BT = jnp.clip(x_BT, lo, hi)
    mean = _masked_mean(c_BT, mask_BT)
    var = _masked_mean(c_BT * c_BT, mask_BT) - mean * mean
    return jnp.where(jnp.sum(mask_BT) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _prepare(response_mask, *arrays):
    """float32 mask and the arrays zeroed at masked positions (deviation 1)."""
    mask_BT = response_mask.astype(jnp.float32)
    return mask_BT, [jnp.where(mask_BT != 0, x.astype(jnp.float32), 0.0) for x in arrays]


def _check_has_valid_token(response_mask):
    if not isinstance(response_mask, jax.core.Tracer) and not bool(jnp.any(response_mask != 0)):
        raise ValueError("response_mask must contain at least one valid token (1)")


# ----------------------------------------------------------------------------------------------
# IMPORTANCE-SAMPLING WEIGHTS
# ----------------------------------------------------------------------------------------------


def compute_rollout_correction_weights(
    log_ratio,
    response_mask,
    *,
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
):
    """Truncated (TIS) or IcePop importance weights pi_old / pi_rollout, and their metrics.

    Args:
        log_ratio: [B, T] log pi_old - log pi_rollout.
        response_mask: [B, T] 0/1 response mask.
        rollout_is: "token" (one weight per token) or "sequence" (exp of the row's summed log
            ratio on every token of the row). Config ``algorithm.rollout_correction.rollout_is``.
        rollout_is_threshold: float u: weights min(rho, u); string "l_u": rho where
            l <= rho <= u, else 0.
        rollout_is_batch_normalize: divide the weights by their mean (over valid tokens, or
            over non-empty sequences for "sequence") when that mean exceeds 1e-8.

    Returns:
        (weights [B, T] float32, 0 at padding, no gradient; metrics with verl's unprefixed keys
        ``rollout_is_*``, computed before the batch normalisation).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"Invalid rollout_is {rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}"
        )
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    mask_BT, (log_ratio_BT,) = _prepare(response_mask, log_ratio)
    valid_BT = mask_BT != 0
    if rollout_is == "token":
        raw_BT = jnp.exp(jnp.clip(log_ratio_BT, -SAFETY_BOUND, SAFETY_BOUND))
        seq_log_ratio_B = None
    else:
        seq_log_ratio_B = _masked_sum(log_ratio_BT, mask_BT, axis=-1)
        raw_B = jnp.exp(jnp.clip(seq_log_ratio_B, -SAFETY_BOUND, SAFETY_BOUND))
        raw_BT = jnp.broadcast_to(raw_B[:, None], log_ratio_BT.shape)
    raw_BT = raw_BT * mask_BT
    if lower is None:
        weights_BT = jnp.minimum(raw_BT, upper)
    else:
        weights_BT = jnp.where((raw_BT >= lower) & (raw_BT <= upper), raw_BT, 0.0)
    weights_BT = jax.lax.stop_gradient(weights_BT)
    metrics = _is_metrics(weights_BT, raw_BT, seq_log_ratio_B, mask_BT, upper=upper, lower=lower)
    if lower is not None:
        outside_BT = (raw_BT < lower) | (raw_BT > upper)
        metrics["rollout_is_oob_ratio"] = _masked_mean(outside_BT, mask_BT)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _masked_mean(weights_BT, mask_BT)
        else:
            seq_weight_B = _masked_mean(weights_BT, mask_BT, axis=-1)
            nonempty_B = jnp.any(valid_BT, axis=-1).astype(jnp.float32)
            mean = jnp.sum(seq_weight_B * nonempty_B) / jnp.maximum(jnp.sum(nonempty_B), 1e-8)
        normalize = mean > 1e-8
        weights_BT = jnp.where(normalize, weights_BT / jnp.where(normalize, mean, 1.0), weights_BT)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(normalize, mean, 1.0)
    return weights_BT, metrics


def _is_metrics(weights_BT, raw_BT, seq_log_ratio_B, mask_BT, *, upper, lower):
    """verl's compute_is_metrics; seq_log_ratio_B is None for token-level weights."""
    valid_BT = mask_BT != 0
    lower_metric = 1.0 / upper if lower is None else lower
    m = {"rollout_is_mean": _masked_mean(weights_BT, mask_BT)}
    if seq_log_ratio_B is not None:
        # In log space over every row, fully masked ones included (their log ratio is 0).
        m["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(seq_log_ratio_B), SAFETY_BOUND))
        m["rollout_is_min"] = jnp.exp(jnp.min(seq_log_ratio_B))
        log_upper = jnp.log(jnp.float32(upper))
        log_lower = jnp.log(jnp.float32(lower_metric))
        m["rollout_is_ratio_fraction_high"] = jnp.mean(seq_log_ratio_B > log_upper)
        m["rollout_is_ratio_fraction_low"] = jnp.mean(seq_log_ratio_B < log_lower)
    else:
        m["rollout_is_ratio_fraction_high"] = _masked_mean(raw_BT > upper, mask_BT)
        m["rollout_is_ratio_fraction_low"] = _masked_mean(raw_BT < lower_metric, mask_BT)
        m["rollout_is_max"] = _masked_max(weights_BT, valid_BT)
        m["rollout_is_min"] = _masked_min(weights_BT, valid_BT)
    m["rollout_is_std"] = _clamped_std(weights_BT, mask_BT, 0.0, upper)
    clamped_BT = jnp.clip(weights_BT, 0.0, upper)
    normalized_BT = clamped_BT / (_masked_mean(clamped_BT, mask_BT) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / _masked_mean(normalized_BT**2, mask_BT)
    # Per-row means over all B rows (a fully masked row has mean 0), as verl.
    seq_mean_B = _masked_mean(weights_BT, mask_BT, axis=-1)
    every_row_B = jnp.ones(seq_mean_B.shape, bool)
    m["rollout_is_seq_mean"], m["rollout_is_seq_std"] = _mean_std_over(seq_mean_B, every_row_B)
    m["rollout_is_seq_max"] = jnp.max(seq_mean_B)
    m["rollout_is_seq_min"] = jnp.min(seq_mean_B)
    m["rollout_is_seq_max_deviation"] = jnp.max(jnp.abs(seq_mean_B - 1.0))
    # Untruncated row means: a truncated mean could never exceed the threshold.
    raw_seq_mean_B = _masked_mean(raw_BT, mask_BT, axis=-1)
    m["rollout_is_seq_fraction_high"] = jnp.mean(raw_seq_mean_B > upper)
    m["rollout_is_seq_fraction_low"] = jnp.mean(raw_seq_mean_B < lower_metric)
    return m


# ----------------------------------------------------------------------------------------------
# REJECTION SAMPLING
# ----------------------------------------------------------------------------------------------


def compute_rollout_rejection_mask(
    log_ratio, response_mask, *, rollout_rs="token_k1", rollout_rs_threshold=None
):
    """Hard trust region: the response mask with out-of-bound tokens or sequences set to 0.

    With lr = clamp(log pi_old - log pi_rollout, -20, 20): k1 = -lr, k2 = lr^2 / 2,
    k3 = e^lr - 1 - lr. ``token_kX`` tests each token; ``seq_sum_kX`` / ``seq_mean_kX`` /
    ``seq_max_kX`` test the masked sum / mean / max over the row and keep or drop it whole.
    k1 options keep log(lower) <= k1 <= log(upper); k2/k3 keep values <= upper.

    Args:
        log_ratio: [B, T] log pi_old - log pi_rollout.
        response_mask: [B, T] 0/1 response mask.
        rollout_rs: comma-separated options from ``ROLLOUT_RS_OPTIONS``; all must pass.
        rollout_rs_threshold: one threshold for every option or one per option, comma
            separated ("lower_upper" ratio bounds for k1 options, an upper bound otherwise).

    Returns:
        (mask [B, T] in response_mask's dtype, metrics with verl's unprefixed keys
        ``rollout_rs_*``).
    """
    options = parse_rollout_rs(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    mask_BT, (log_ratio_BT,) = _prepare(response_mask, log_ratio)
    valid_BT = mask_BT != 0
    nonempty_B = jnp.any(valid_BT, axis=-1)
    safe_BT = jnp.clip(log_ratio_BT, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe_BT, "k2": 0.5 * safe_BT**2, "k3": jnp.exp(safe_BT) - 1.0 - safe_BT}
    keep_all_BT = jnp.ones_like(mask_BT)
    metrics = {}
    for option in options:
        lower, upper = thresholds[option]
        kind = option[-2:]
        is_k1 = kind == "k1"
        stat_BT = per_token[kind]
        if option.startswith("token"):
            seq_stat_B = None
            token_stat_BT = stat_BT
        else:
            if option.startswith("seq_sum"):
                seq_stat_B = _masked_sum(stat_BT, mask_BT, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat_B = _masked_mean(stat_BT, mask_BT, axis=-1)
            else:  # seq_max: 0 for a row without valid tokens
                row_max_B = jnp.max(jnp.where(valid_BT, stat_BT, -jnp.inf), axis=-1)
                seq_stat_B = jnp.where(row_max_B == -jnp.inf, 0.0, row_max_B)
            token_stat_BT = jnp.broadcast_to(seq_stat_B[:, None], stat_BT.shape)
        if is_k1:
            # Compared in float32 against log bounds computed in float64, as torch does.
            hi, lo = math.log(upper), math.log(lower)
            keep_BT = (token_stat_BT >= lo) & (token_stat_BT <= hi)
        else:
            hi, lo = upper, 0.0
            keep_BT = token_stat_BT <= hi
        keep_f_BT = keep_BT.astype(jnp.float32)
        keep_all_BT = keep_all_BT * keep_f_BT
        metrics.update(
            _rs_metrics(option, token_stat_BT, seq_stat_B, mask_BT, nonempty_B, hi, lo, is_k1)
        )
        seq_kept_B = jnp.all(keep_BT | ~valid_BT, axis=-1)
        nonempty_f_B = nonempty_B.astype(jnp.float32)
        count = jnp.sum(nonempty_f_B)
        dropped = jnp.sum((1.0 - seq_kept_B.astype(jnp.float32)) * nonempty_f_B)
        metrics[f"rollout_rs_{option}_masked_fraction"] = _masked_mean(1.0 - keep_f_BT, mask_BT)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = jnp.where(
            count > 0, dropped / jnp.maximum(count, 1.0), 0.0
        )
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1.0 - keep_all_BT, mask_BT)
    dropped_token_BT = ~(keep_all_BT > 0.5) & valid_BT
    metrics["rollout_rs_seq_masked_fraction"] = jnp.mean(jnp.any(dropped_token_BT, axis=-1))
    return (response_mask.astype(jnp.float32) * keep_all_BT).astype(response_mask.dtype), metrics


def _rs_metrics(option, token_stat_BT, seq_stat_B, mask_BT, nonempty_B, hi, lo, is_k1):
    """verl's compute_rs_metrics for one option; hi/lo are the thresholds in the statistic."""
    p = f"rollout_rs_{option}"
    valid_BT = mask_BT != 0
    sequence_level = seq_stat_B is not None
    if seq_stat_B is None:
        seq_stat_B = _masked_mean(token_stat_BT, mask_BT, axis=-1)
    num_rows = jnp.maximum(jnp.sum(nonempty_B.astype(jnp.float32)), 1.0)

    def row_fraction(flag_B):
        return jnp.sum(jnp.where(nonempty_B, flag_B, False).astype(jnp.float32)) / num_rows

    row_max = jnp.max(jnp.where(nonempty_B, seq_stat_B, -jnp.inf))
    row_min = jnp.min(jnp.where(nonempty_B, seq_stat_B, jnp.inf))
    m = {f"{p}_mean": _masked_mean(token_stat_BT, mask_BT)}
    if sequence_level:
        m[f"{p}_max"], m[f"{p}_min"] = row_max, row_min
        m[f"{p}_fraction_high"] = row_fraction(seq_stat_B > hi)
        m[f"{p}_fraction_low"] = row_fraction(seq_stat_B < lo) if is_k1 else jnp.float32(0.0)
    else:
        m[f"{p}_max"] = _masked_max(token_stat_BT, valid_BT)
        m[f"{p}_min"] = _masked_min(token_stat_BT, valid_BT)
        m[f"{p}_fraction_high"] = _masked_mean(token_stat_BT > hi, mask_BT)
        low = _masked_mean(token_stat_BT < lo, mask_BT)
        m[f"{p}_fraction_low"] = low if is_k1 else jnp.float32(0.0)
    m[f"{p}_std"] = _clamped_std(token_stat_BT, mask_BT, lo if is_k1 else 0.0, hi)
    m[f"{p}_seq_mean"], m[f"{p}_seq_std"] = _mean_std_over(seq_stat_B, nonempty_B)
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = row_max, row_min
    m[f"{p}_seq_max_deviation"] = jnp.max(jnp.where(nonempty_B, jnp.abs(seq_stat_B), -jnp.inf))
    m[f"{p}_seq_fraction_high"] = row_fraction(seq_stat_B > hi)
    if is_k1:  # verl reports this key for k1 options only
        m[f"{p}_seq_fraction_low"] = row_fraction(seq_stat_B < lo)
    return m


# ----------------------------------------------------------------------------------------------
# DIAGNOSTICS
# ----------------------------------------------------------------------------------------------


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """verl's off-policy diagnostics of pi_old (training) against pi_rollout.

    Per-row means over valid tokens (0 for a fully masked row) are averaged over all B rows.

    Args:
        old_log_prob: [B, T] training-policy log-probs.
        rollout_log_prob: [B, T] rollout-policy log-probs.
        response_mask: [B, T] 0/1 response mask.

    Returns:
        Unprefixed metrics: ``training_ppl``, ``training_log_ppl``, ``kl`` (mean of
        log pi_rollout - log pi_old), ``k3_kl`` (mean of rho - log rho - 1, unclamped),
        ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff`` (with ``_abs_``, ``_max``,
        ``_min`` variants), ``ppl_ratio``, ``chi2_token`` (E[rho^2] - 1) and ``chi2_seq``
        (E[prod rho^2] - 1, log clamped at +-20).
    """
    mask_BT, (old_BT, rollout_BT) = _prepare(response_mask, old_log_prob, rollout_log_prob)
    mean_old_B = _masked_mean(old_BT, mask_BT, axis=-1)
    mean_rollout_B = _masked_mean(rollout_BT, mask_BT, axis=-1)
    log_ratio_BT = old_BT - rollout_BT
    log_ppl_diff_B = mean_rollout_B - mean_old_B
    rho_BT = jnp.exp(jnp.clip(log_ratio_BT, -SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio_B = jnp.clip(
        _masked_sum(log_ratio_BT, mask_BT, axis=-1), -SAFETY_BOUND, SAFETY_BOUND
    )
    return {
        "training_ppl": jnp.mean(jnp.exp(-mean_old_B)),
        "training_log_ppl": jnp.mean(-mean_old_B),
        "kl": _masked_mean(rollout_BT - old_BT, mask_BT),
        "k3_kl": _masked_mean(jnp.exp(log_ratio_BT) - log_ratio_BT - 1.0, mask_BT),
        "rollout_ppl": jnp.mean(jnp.exp(-mean_rollout_B)),
        "rollout_log_ppl": jnp.mean(-mean_rollout_B),
        "log_ppl_diff": jnp.mean(log_ppl_diff_B),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(log_ppl_diff_B)),
        "log_ppl_diff_max": jnp.max(log_ppl_diff_B),
        "log_ppl_diff_min": jnp.min(log_ppl_diff_B),
        "ppl_ratio": jnp.mean(jnp.exp(log_ppl_diff_B)),
        "chi2_token": _masked_mean(rho_BT * rho_BT, mask_BT) - 1.0,
        "chi2_seq": jnp.mean(jnp.exp(2.0 * seq_log_ratio_B)) - 1.0,
    }


def compute_rollout_probs_diff_metrics(old_log_prob, rollout_log_prob, response_mask):
    """verl's ``training/rollout_probs_diff_*`` debug metrics (verl.utils.debug.metrics).

    Over the valid tokens, d = |exp(old_log_prob) - exp(rollout_log_prob)| (probabilities, not
    log-probs) and the Pearson correlation of the two probabilities.

    Args:
        old_log_prob: [B, T] trainer-recomputed log-probs.
        rollout_log_prob: [B, T] rollout-engine log-probs.
        response_mask: [B, T] 0/1 response mask.

    Returns:
        ``training/rollout_probs_diff_valid`` (int32 1, or 0 without a valid token, when the
        others are NaN as in verl), ``training/rollout_probs_diff_max`` / ``_mean`` / ``_std``
        (unbiased; NaN for a single token, as torch) and
        ``training/rollout_actor_probs_pearson_corr`` (clipped to [-1, 1], as torch.corrcoef).
    """
    valid_BT = response_mask != 0
    zeroed = [
        jnp.where(valid_BT, x.astype(jnp.float32), 0.0) for x in (old_log_prob, rollout_log_prob)
    ]
    actor_BT, rollout_BT = (jnp.exp(x) for x in zeroed)
    count = jnp.sum(valid_BT.astype(jnp.float32))
    any_valid = count > 0
    nan = jnp.float32(jnp.nan)

    def mean(x_BT):
        return jnp.sum(jnp.where(valid_BT, x_BT, 0.0)) / count

    def centred(x_BT):
        return jnp.where(valid_BT, x_BT - mean(x_BT), 0.0)

    diff_BT = jnp.abs(actor_BT - rollout_BT)
    diff_c_BT, actor_c_BT, rollout_c_BT = (centred(x) for x in (diff_BT, actor_BT, rollout_BT))
    # torch.corrcoef: the covariance (divided by n - 1) over each standard deviation in turn.
    dof = count - 1.0
    cov = jnp.sum(actor_c_BT * rollout_c_BT) / dof
    corr = cov / jnp.sqrt(jnp.sum(actor_c_BT**2) / dof) / jnp.sqrt(jnp.sum(rollout_c_BT**2) / dof)
    return {
        "training/rollout_probs_diff_valid": any_valid.astype(jnp.int32),
        "training/rollout_probs_diff_max": jnp.where(
            any_valid, _masked_max(diff_BT, valid_BT), nan
        ),
        "training/rollout_probs_diff_mean": jnp.where(any_valid, mean(diff_BT), nan),
        "training/rollout_probs_diff_std": jnp.where(
            any_valid, jnp.sqrt(jnp.sum(diff_c_BT**2) / dof), nan
        ),
        "training/rollout_actor_probs_pearson_corr": jnp.where(
            any_valid, jnp.clip(corr, -1.0, 1.0), nan
        ),
    }


# ----------------------------------------------------------------------------------------------
# ENTRY POINT
# ----------------------------------------------------------------------------------------------


def correction_and_rejection(
    old_log_prob,
    rollout_log_prob,
    response_mask,
    *,
    rollout_is,
    rollout_is_threshold,
    rollout_is_batch_normalize,
    rollout_rs,
    rollout_rs_threshold,
):
    """verl's compute_rollout_correction_and_rejection_mask: weights, mask, rollout_corr/*."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old_log_prob {old_log_prob.shape}, rollout_log_prob {rollout_log_prob.shape} and "
            f"response_mask {response_mask.shape} must have the same [B, T] shape"
        )
    _check_has_valid_token(response_mask)
    log_ratio_BT = old_log_prob.astype(jnp.float32) - rollout_log_prob.astype(jnp.float32)
    metrics = {}
    weights_BT = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights_BT, is_metrics = compute_rollout_correction_weights(
            log_ratio_BT,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    mask_BT = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(
                "rollout_rs_threshold must be explicitly provided when rollout_rs is set"
            )
        mask_BT, rs_metrics = compute_rollout_rejection_mask(
            log_ratio_BT,
            response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights_BT, mask_BT, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_correction(
    old_log_prob,
    rollout_log_prob,
    response_mask,
    *,
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
    rollout_rs=None,
    rollout_rs_threshold=None,
    bypass_mode=False,
    loss_type="ppo_clip",
):
    """One batch's rollout correction, as verl 0.9.1's trainer applies it before the advantages.

    The keyword names and defaults are verl's ``algorithm.rollout_correction`` fields (yaml
    defaults). The trainer then multiplies the per-token policy loss by the weights
    (``compute_policy_loss(..., rollout_is_weights=weights)``) and uses the returned mask as the
    response mask everywhere downstream (advantages and losses), except token-mean's denominator,
    which counts the mask as sampled (verl's ``loss_mask``; trainer/actor.py
    ``batch_num_tokens``).

    Args:
        old_log_prob: [B, T] log-probs recomputed by the trainer (pi_old).
        rollout_log_prob: [B, T] log-probs reported by the rollout engine (pi_rollout).
        response_mask: [B, T] 0/1 response mask, with at least one valid token.
        rollout_is: None (no weights, metrics only), "token" or "sequence".
        rollout_is_threshold: TIS upper bound (float) or IcePop bounds ("lower_upper"); None
            also disables the weights.
        rollout_is_batch_normalize: normalise the weights to batch mean 1.
        rollout_rs: None, or comma-separated rejection options (``ROLLOUT_RS_OPTIONS``).
        rollout_rs_threshold: required with ``rollout_rs``.
        bypass_mode: the v1 trainer's bypass: old_log_prob is the rollout's, nothing is
            corrected, so this returns (None, response_mask, {}) after validating the settings.
            verl's ``bypass_mode`` loss is ``compute_policy_loss_bypass_mode``.
        loss_type: "ppo_clip" or "reinforce"; only read by ``compute_policy_loss_bypass_mode``
            (validated here).

    Returns:
        (weights [B, T] float32 or None, response mask [B, T] with rejected tokens set to 0 in
        response_mask's dtype, metrics): ``rollout_corr/rollout_is_*`` (with weights),
        ``rollout_corr/rollout_rs_*`` (with rejection), the ``rollout_corr/`` off-policy
        diagnostics of ``compute_offpolicy_metrics``, and ``training/rollout_probs_diff_*`` /
        ``training/rollout_actor_probs_pearson_corr`` (verl logs these from the old-log-prob
        step whenever ``rollout.calculate_log_probs``).

    Raises:
        ValueError: invalid settings, mismatched shapes, or no valid token (concrete masks).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Invalid loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"Invalid rollout_is {rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}"
        )
    if bypass_mode:
        return None, response_mask, {}
    weights_BT, mask_BT, metrics = correction_and_rejection(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    metrics.update(
        compute_rollout_probs_diff_metrics(old_log_prob, rollout_log_prob, response_mask)
    )
    return weights_BT, mask_BT, metrics


# ----------------------------------------------------------------------------------------------
# BYPASS-MODE POLICY LOSS
# ----------------------------------------------------------------------------------------------
