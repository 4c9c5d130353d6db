"""Native grouped sampler: n completions per prompt from one jitted KV-cache decode loop.

This module owns `Rollout` (the GRPO group batch handed to the trainer), `sample` (the public
entry point), `bucket_length` (the prompt-length bucketing rule) and the pure token-selection
functions (`top_k_top_p_filter`, `categorical_inverse_cdf`, `select_tokens`, `row_keys`) that
`sample` is built from.

How one call runs (a single XLA program per shape and static settings, no host round trip per
token):
  1. The prompt batch [P,Tp] is left-padded to [P,Tb], Tb = bucket_length(Tp) (see there).
  2. One `model.prefill` over the P prompts. Its KV cache becomes the prompt part of a
     `model.GroupKVCache` of P * n rows (`model.group_cache`): each prompt is prefilled once
     (the prefill matmuls run on P rows, never P*n) and stored once, and its n rows attend to
     it together, so a decode step reads each prompt's keys and values once, not n times. The
     rows' response keys and values go to blocks of which a step reads only those written.
  3. The first token is drawn from the prefill logits; a `lax.while_loop` then alternates
     `model.decode_step` and token selection until max_new_tokens are drawn or every row has
     emitted an EOS (early stop). The loop runs on per-layer buffers of the cache and the
     weights (`model.GroupKVCache`, `model.DecodeParams`, built once per loop), so a decode
     step copies neither (3x less time per step than stacked forms for SmolLM2-135M on CPU).
  4. With compaction (the default) the loop runs in phases: whenever the live rows fit half
     the slots, the finished rows' slots are dropped (`model.take_rows`), so they stop costing
     decode steps. Every call walks the whole ladder of slot counts (B, B/2, ... down to
     MIN_COMPACT_SLOTS), the phases after the last token with no decode step, so the first
     call compiles every program of its batch shape and later calls compile none.

Sampling semantics (the same as HF `generate` and vLLM):
  * temperature == 0 is greedy (argmax); top-k / top-p are then irrelevant.
  * Otherwise logits are divided by the temperature, then top-k, then top-p filtering is applied
    (HF `TemperatureLogitsWarper` -> `TopKLogitsWarper` -> `TopPLogitsWarper`, vLLM's order too),
    and a token is drawn from the softmax of what is left (inverse-CDF sampling with one uniform
    per row, see `categorical_inverse_cdf`). top-p always keeps at least the most likely token.
    `top_k` of -1 or 0 and `top_p == 1` switch the filters off.
  * `Rollout.log_probs` holds, at the drawn token, what `logprobs_mode` names (vLLM's
    `--logprobs-mode`, verl's `rollout.logprobs_mode`, `LOGPROBS_MODES`):
      - "processed_logprobs" (verl's default): the log-probability under the distribution the
        token was drawn from: log_softmax of logits / temperature after top-k / top-p, i.e.
        renormalised over the kept tokens. Without top-k and top-p this is log_softmax(logits /
        temperature), what the trainer recomputes as the old log-prob (verl); at temperature 0
        (greedy) log_softmax(logits).
      - "raw_logprobs": log_softmax(logits) of the model, before temperature and filtering.
      - "processed_logits" / "raw_logits": the logit itself (logits / temperature, or the
        model's), not a log-probability.
  * Randomness: row b at decode step t uses fold_in(fold_in(rng, b), t). Rows are independent, a
    row's draws do not depend on the batch size or on how the batch is sharded, and the same rng
    gives the same rollout.
"""

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import model as model_lib
from grpo_jax.models import moe

_DEFAULT_BUCKET_MULTIPLE = 64
# Compaction stops once the slots would drop below this. Below it a decode step reads the weights
# more than it computes, so fewer slots barely shorten a step while each rung of the ladder is one
# more decode program to compile (7-11 s each for SmolLM2-135M on a 2-core CPU). Measured there
# (48-token prompts, 47 decode steps): 172 ms a step at 64 slots, 110 at 32, 79 at 16, 75 at 8.
# On accelerators the weight-bound range reaches hundreds of rows, so 16 is conservative there.
MIN_COMPACT_SLOTS = 16


@flax.struct.dataclass
class Rollout:
    """A GRPO group batch: B = P*n rows, the n samples of each prompt adjacent.

    Attributes:
      prompt_ids: [B,Tb] int32, left-padded prompts; Tb = bucket_length(Tp) >= Tp, extra columns
        are on the left and masked out.
      prompt_mask: [B,Tb] int32, 1 on real prompt tokens.
      response_ids: [B,R] int32, R = max_new_tokens; pad_token_id after the first EOS (and after
        the end of generation).
      response_mask: [B,R] int32, 1 up to and including the first EOS, 0 after it.
      log_probs: [B,R] float32, the sampled token's value of the sampler's logprobs_mode (by
        default the log-prob under the temperature-scaled, top-k / top-p renormalised
        distribution it was drawn from; see the module docstring); 0 where masked.
      group_ids: [B] int32, the prompt index of each row (0,0,..,1,1,..).
      weights_version: int32 scalar, the policy weights version the rollout was sampled under.
      loss_mask: [B,R] int32 or None. Multi-turn rollouts (rollout/multi_turn.py): 1 on the
        tokens the policy sampled, 0 on the tool responses and chat-template tokens appended
        between its turns (verl's agent-loop `response_mask`); response_mask then marks every
        valid token (verl's attention mask). None: every valid token was sampled.
      num_turns: [B] int32 or None, verl's num_turns (user + assistant turns + 1); None: 2.
      routed_experts: [B,Lm,Tb+R,A] or None (verl's name): with `sample(record_routing=True)`
        the experts the rollout routed each prompt and response token to in each of the Lm
        MoE layers (A = num_experts_per_tok), in `moe.routing_dtype` (uint8 up to 255 experts);
        `moe.no_route` where no token was fed through the model (`fed_tokens`: the padding,
        and a row's last token, which is drawn, never fed back). The paged engine
        (`rollout.paged.sample_paged`) records the same.
        Router replay R3 (actor.router_replay.mode) replays them in the trainer's passes.
        Memory: B x Lm x (Tb + R) x A bytes (uint8); Qwen3-30B-A3B (Lm = 48, A = 8), 512 rows
        of 4,096 tokens: 805 MB (int32 would be 3.2 GB).
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    log_probs: jax.Array
    group_ids: jax.Array
    weights_version: jax.Array
    loss_mask: jax.Array | None = None
    num_turns: jax.Array | None = None
    routed_experts: jax.Array | None = None


@flax.struct.dataclass
class SampleState:
    """The decode loop's state: S slots decoding rows of the B = P*n rollout rows.

    Slots start as the rows themselves; a compaction keeps the live ones, so S shrinks as rows
    finish, while the outputs stay [B, R] and each slot writes into its own row.
    """

    t: jax.Array  # int32 scalar: response position of the token drawn from `logits_SV`
    logits_SV: jax.Array  # float32: next-token logits of every slot
    keys_S: jax.Array  # typed keys: the row's key (fold_in(rng, row))
    done_S: jax.Array  # bool: the slot's row has emitted an EOS at a position < t
    ids_SR: jax.Array  # int32: the slot's response so far, pad_token_id where not generated
    mask_SR: jax.Array  # int32
    log_probs_SR: jax.Array  # float32
    cache: model_lib.GroupKVCache  # the slots' rows (cache.row_B: the rollout row of a slot)
    # The [B, R] outputs of rows whose slots a compaction dropped (all rows, in row order).
    ids_BR: jax.Array
    mask_BR: jax.Array
    log_probs_BR: jax.Array
    # With record_routing (else None): the experts each prompt token (per prompt) and each fed
    # response token (per slot, and per row for the dropped slots) was routed to.
    routing_PLmTA: jax.Array | None = None
    routing_SLmRA: jax.Array | None = None
    routing_BLmRA: jax.Array | None = None


def bucket_length(t: int, multiple: int = _DEFAULT_BUCKET_MULTIPLE) -> int:
    """The bucketed prompt length: `t` rounded up to a multiple of `multiple`.

    Bucketing rule: a prompt batch of width Tp is left-padded to Tb = ceil(Tp / multiple) *
    multiple columns (mask 0, id pad_token_id), so prompt batches of widths 1..64 share one
    compiled program, 65..128 the next, and so on. The KV cache holds Tb slots per prompt and
    max_new_tokens - 1 response slots per row (`model.GroupKVCache`).

    Args:
      t: the prompt width Tp, >= 1.
      multiple: the bucket size, >= 1.

    Returns:
      The smallest multiple of `multiple` that is >= t.
    """
    if multiple < 1:
        raise ValueError(f"bucket multiple must be >= 1, got {multiple}")
    if t < 1:
        raise ValueError(f"prompt length must be >= 1, got {t}")
    return -(-t // multiple) * multiple


def bucket_prompts(prompt_ids_PT, prompt_mask_PT, *, pad_token_id: int):
    """Left-pads a [P, Tp] prompt batch to [P, bucket_length(Tp)] (ids pad_token_id, mask 0).

    `sample` does this itself; an engine holding host (numpy) prompts calls it before moving
    them to the devices, so batches of different widths in one bucket run no width-specific
    device program (numpy in, numpy out; jax arrays are padded with jnp)."""
    width = prompt_ids_PT.shape[1]
    pad_cols = bucket_length(width) - width
    if not pad_cols:
        return prompt_ids_PT, prompt_mask_PT
    xp = jnp if isinstance(prompt_ids_PT, jax.Array) else np
    return (
        xp.pad(prompt_ids_PT, ((0, 0), (pad_cols, 0)), constant_values=pad_token_id),
        xp.pad(prompt_mask_PT, ((0, 0), (pad_cols, 0))),
    )


def row_keys(rng: jax.Array, num_rows: int) -> jax.Array:
    """Per-row typed keys: row b gets fold_in(rng, b).

    Args:
      rng: a typed key (`jax.random.key`) or a legacy uint32[2] key (`jax.random.PRNGKey`).
      num_rows: B.

    Returns:
      keys_B, a typed key array.
    """
    rng = as_typed_key(rng)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(num_rows))


def as_typed_key(rng: jax.Array) -> jax.Array:
    """Returns `rng` as a scalar typed key; legacy uint32[2] keys are wrapped, not re-seeded."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"expected a single key, got a key array of shape {rng.shape}")
        return rng
    if rng.dtype == jnp.uint32 and rng.shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(
        "rng must be a typed key (jax.random.key) or a legacy uint32[2] key (jax.random.PRNGKey), "
        f"got dtype {rng.dtype} shape {rng.shape}"
    )


# vLLM's LogprobsMode (verl passes rollout.logprobs_mode to it); the first is verl's default.
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


def check_logprobs_mode(logprobs_mode: str) -> None:
    """Raises ValueError unless `logprobs_mode` is one of `LOGPROBS_MODES`."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} must be one of {list(LOGPROBS_MODES)}")


def top_k_top_p_filter(logits_BV: jax.Array, *, top_k: int, top_p: float) -> jax.Array:
    """Masks logits outside the top-k, then outside the top-p nucleus, to -inf (HF semantics).

    top-k (HF `TopKLogitsWarper`): drop logits strictly below the k-th largest.
    top-p (HF `TopPLogitsWarper`, vLLM `apply_top_k_top_p`): sort the remaining logits ascending,
    drop those whose cumulative softmax probability is <= 1 - top_p, and always keep the largest.
    The dropped set is a prefix of the ascending order, so it is applied as a threshold on the
    logit (or probability). Exact ties with the threshold are all kept, where HF keeps an arbitrary
    subset of them; ties between float logits have probability zero in practice.

    With top-k on, top-p runs on the k sorted values only (the filtered softmax is zero elsewhere,
    and those entries add 0 to HF's cumulative sum). With top-p alone, the threshold is found by
    bisection over the float32 bit patterns of the probabilities (32 masked sums over [B,V])
    instead of a full [B,V] sort, which is 20x slower on CPU.

    Args:
      logits_BV: [..., V] float logits, already divided by the temperature.
      top_k: keep the k most likely tokens; -1 or 0 (or >= V) disables top-k.
      top_p: nucleus mass in (0, 1]; 1 disables top-p.

    Returns:
      The logits with filtered entries set to -inf, same shape and dtype.
    """
    vocab = logits_BV.shape[-1]
    use_top_k = 0 < top_k < vocab
    use_top_p = top_p < 1.0
    if not (use_top_k or use_top_p):
        return logits_BV
    if not use_top_k:
        return jnp.where(_top_p_keep(logits_BV, top_p), logits_BV, -jnp.inf)
    desc_BK, index_BK = jax.lax.top_k(logits_BV, top_k)
    threshold_B1 = desc_BK[..., -1:]
    if use_top_p:
        asc_BK = jnp.flip(desc_BK, axis=-1)
        cum_BK = jnp.cumsum(jax.nn.softmax(asc_BK, axis=-1), axis=-1)
        keep_BK = cum_BK > (1.0 - top_p)
        keep_BK = keep_BK.at[..., -1].set(True)  # the most likely token is always kept
        threshold_B1 = jnp.min(jnp.where(keep_BK, asc_BK, jnp.inf), axis=-1, keepdims=True)
    # The tokens top-k picked that pass the threshold are kept by index too. XLA may compute
    # `logits_BV` twice, into top-k and into the comparison below, and nothing makes the two
    # copies round alike: with LLVM's optimisations off (--xla_backend_optimization_level=0)
    # the copy compared rounded below the one top-k returned, every token of some rows was
    # dropped and the draw left the vocabulary. By index the kept set never comes out empty.
    by_index_BV = jnp.put_along_axis(
        jnp.zeros(logits_BV.shape, bool), index_BK, desc_BK >= threshold_B1, axis=-1,
        inplace=False,
    )
    return jnp.where((logits_BV >= threshold_B1) | by_index_BV, logits_BV, -jnp.inf)


def _top_p_keep(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """Boolean keep-mask of HF top-p over the full vocabulary, without sorting.

    With probabilities p and mass_below(v) = sum of p_y over p_y <= v (HF's ascending cumsum at
    v), HF keeps token x iff mass_below(p_x) > 1 - top_p. mass_below is non-decreasing, so the
    kept set is {x: p_x >= tau}, tau the smallest probability with mass_below(tau) > 1 - top_p.
    Non-negative float32 values order like their int32 bit patterns, so 32 bisection steps over
    the bits find tau exactly; it is capped at the row maximum so at least one token is kept.
    """
    probs_BV = jax.nn.softmax(logits_BV.astype(jnp.float32), axis=-1)
    # The barrier materialises the probabilities once; otherwise XLA fuses the softmax into each
    # of the 32 masked sums below and recomputes V exponentials per step (30x slower on CPU).
    probs_BV = jax.lax.optimization_barrier(probs_BV)
    target = jnp.float32(1.0 - top_p)

    def as_float(b_B1):
        return jax.lax.bitcast_convert_type(b_B1, jnp.float32)

    def mass_below(b_B1):
        # Comparing floats is the same order as comparing the bits (all values are >= 0 and
        # b >= 0 here) and fuses into a faster reduction on CPU.
        return jnp.sum(jnp.where(probs_BV <= as_float(b_B1), probs_BV, 0.0), axis=-1, keepdims=True)

    def bisect(_, lo_hi):
        # Invariant: mass_below(lo) <= target, and tau's bits are in (lo, hi].
        lo_B1, hi_B1 = lo_hi
        mid_B1 = lo_B1 + (hi_B1 - lo_B1) // 2
        above_B1 = mass_below(mid_B1) > target
        return jnp.where(above_B1, lo_B1, mid_B1), jnp.where(above_B1, mid_B1, hi_B1)

    hi_B1 = jax.lax.bitcast_convert_type(jnp.max(probs_BV, axis=-1, keepdims=True), jnp.int32)
    lo_B1 = jnp.full_like(hi_B1, -1)
    _, tau_B1 = jax.lax.fori_loop(0, 32, bisect, (lo_B1, hi_B1))
    return probs_BV >= as_float(tau_B1)


def categorical_inverse_cdf(probs_BV: jax.Array, u_B: jax.Array, *, chunk: int = 128) -> jax.Array:
    """Draws token ~ probs_BV per row from one uniform per row (inverse-CDF sampling).

    Gumbel-max (`jax.random.categorical`) needs V random numbers per row and step; at V = 32k
    threefry makes that ~100 ms per step for 64 rows on CPU, 10x the model. Inverse-CDF needs one.
    It runs in two levels to avoid a length-V cumsum: pick the chunk of `chunk` tokens where the
    cumulative chunk mass first exceeds u * total, then the token inside it. Tokens with zero
    probability are never drawn, even when float rounding pushes u * total past the last cumsum.

    Args:
      probs_BV: [B,V] non-negative float32 weights (need not sum to 1; each row sums to > 0).
      u_B: [B] uniforms in [0, 1).
      chunk: tokens per first-level chunk.

    Returns:
      tokens_B int32.
    """
    batch, vocab = probs_BV.shape
    num_chunks = -(-vocab // chunk)
    probs_BMC = jnp.pad(probs_BV, ((0, 0), (0, num_chunks * chunk - vocab))).reshape(
        batch, num_chunks, chunk
    )
    mass_BM = jnp.sum(probs_BMC, axis=-1)
    cdf_BM = jnp.cumsum(mass_BM, axis=-1)
    target_B = u_B * cdf_BM[:, -1]
    m_B = jnp.minimum(jnp.sum(cdf_BM <= target_B[:, None], axis=-1), _last_positive_index(mass_BM))
    base_B = jnp.where(m_B > 0, jnp.take_along_axis(cdf_BM, m_B[:, None] - 1, axis=-1)[:, 0], 0.0)
    probs_BC = jnp.take_along_axis(probs_BMC, m_B[:, None, None], axis=1)[:, 0]
    cdf_BC = jnp.cumsum(probs_BC, axis=-1)
    c_B = jnp.minimum(
        jnp.sum(cdf_BC <= (target_B - base_B)[:, None], axis=-1), _last_positive_index(probs_BC)
    )
    return (m_B * chunk + c_B).astype(jnp.int32)


def _last_positive_index(x_BN: jax.Array) -> jax.Array:
    """Index of the last positive entry of each row (0 if none)."""
    n = x_BN.shape[-1]
    return n - 1 - jnp.argmax(jnp.flip(x_BN > 0, axis=-1), axis=-1)


def select_tokens(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    logprobs_mode: str = "processed_logprobs",
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row and returns its log-probability (or logit) of `logprobs_mode`.

    Args:
      logits_BV: [B,V] float32 next-token logits.
      keys_B: [B] typed keys, one per row (unused when temperature == 0).
      temperature: 0 for greedy, else the softmax temperature.
      top_k: see `top_k_top_p_filter`.
      top_p: see `top_k_top_p_filter`.
      logprobs_mode: one of `LOGPROBS_MODES` (vLLM's meanings, as in the module docstring).

    Returns:
      (tokens_B int32, values_B float32), values_B at the token:
      "processed_logprobs": log_softmax(filtered logits / temperature), renormalised over the
        tokens top-k / top-p keep (log_softmax(logits) when greedy, as vLLM's greedy path);
      "raw_logprobs": log_softmax(logits); "processed_logits": logits / temperature (logits
        when greedy); "raw_logits": logits.
    """
    check_logprobs_mode(logprobs_mode)
    logits_BV = logits_BV.astype(jnp.float32)
    filtering = temperature != 0.0 and (0 < top_k < logits_BV.shape[-1] or top_p < 1.0)
    if temperature == 0.0:
        tokens_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    else:
        logp_BV = jax.nn.log_softmax(logits_BV / temperature, axis=-1)
        filtered_BV = top_k_top_p_filter(logp_BV, top_k=top_k, top_p=top_p)
        u_B = jax.vmap(jax.random.uniform)(keys_B)
        tokens_B = categorical_inverse_cdf(jnp.exp(filtered_BV), u_B)

    def at_token(x_BV):
        return jnp.take_along_axis(x_BV, tokens_B[:, None], axis=-1)[:, 0]

    match logprobs_mode:
        case "processed_logprobs" if filtering:
            # Renormalised over the kept tokens: log p(token) - log(kept probability mass).
            return tokens_B, at_token(logp_BV) - jax.nn.logsumexp(filtered_BV, axis=-1)
        case "processed_logprobs":
            return tokens_B, at_token(logp_BV)
        case "raw_logprobs":
            return tokens_B, at_token(jax.nn.log_softmax(logits_BV, axis=-1))
        case "processed_logits" if temperature != 0.0:
            return tokens_B, at_token(logits_BV) / temperature  # always kept by the filters
        case _:  # raw_logits, and processed_logits when greedy (no temperature applied)
            return tokens_B, at_token(logits_BV)


def check_sampling_settings(*, temperature: float, top_p: float, top_k: int) -> None:
    """The rules of the sampling settings, in one place (here, the sidecar, grpo_jax/config/).

    Raises:
      ValueError: 'name=value why'.
    """
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature!r} must be finite and >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 = off)")
    if top_k < -1:
        raise ValueError(f"top_k={top_k!r} must be -1 or 0 (off) or >= 1")


def check_sampling_args(
    prompt_shape: tuple[int, ...],
    mask_shape: tuple[int, ...],
    *,
    vocab_size: int,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
) -> tuple[int, ...]:
    """Validates the arguments of `sample` (shared with the vLLM sidecar); returns the EOS ids.

    Raises:
      ValueError naming the argument and its allowed values.
    """
    if len(prompt_shape) != 2 or tuple(prompt_shape) != tuple(mask_shape):
        raise ValueError(
            f"prompt_ids and prompt_mask must both be [P,Tp]; got {tuple(prompt_shape)} and "
            f"{tuple(mask_shape)}"
        )
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling_settings(temperature=temperature, top_p=top_p, top_k=top_k)
    eos_token_ids = tuple(int(e) for e in eos_token_ids)
    for token in (*eos_token_ids, pad_token_id):
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} outside the vocabulary [0, {vocab_size})")
    return eos_token_ids


def sample(
    config: model_lib.ModelConfig,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    weights_version: int = -1,
    compaction: bool = True,
    logprobs_mode: str = "processed_logprobs",
    record_routing: bool = False,
) -> Rollout:
    """Samples n completions for each of P left-padded prompts (see the module docstring).

    Compiles once per (padded prompt shape, config, n, max_new_tokens, temperature, top_p, top_k,
    eos_token_ids, pad_token_id, logprobs_mode); params, prompts, rng and weights_version are
    traced. Works with inputs sharded along the batch axis: the computation is row-parallel.

    Args:
      config: the model config (static).
      params: model parameters.
      prompt_ids: [P,Tp] int, left-padded (each row's last column is a real token).
      prompt_mask: [P,Tp] int or bool, 1 on real tokens.
      rng: a typed key (`jax.random.key`) or a legacy `jax.random.PRNGKey`.
      n: samples per prompt (GRPO group size G).
      max_new_tokens: R, the response length.
      temperature: 0 for greedy, else > 0.
      top_p: nucleus mass in (0, 1]; 1 is off.
      top_k: -1 or 0 is off, else >= 1.
      eos_token_ids: ids that end a response (may be several, or none).
      pad_token_id: id for left padding and for response positions after the first EOS.
      weights_version: recorded in `Rollout.weights_version`.
      compaction: decode in phases, compacting the live rows into half the slots whenever they
        fit, so finished rows stop costing decode steps (the default). Off, or when `sample`
        is traced inside an outer jit, the call is one while_loop over all rows.
      logprobs_mode: what `Rollout.log_probs` records (`LOGPROBS_MODES`, config
        rollout.logprobs_mode; see the module docstring).
      record_routing: also record each token's experts in `Rollout.routed_experts` (a MoE
        model; router replay R3).

    Returns:
      A `Rollout` with B = P*n rows, prompt i at rows [i*n, (i+1)*n).
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
    eos_token_ids = check_sampling_args(
        prompt_ids.shape,
        prompt_mask.shape,
        vocab_size=config.vocab_size,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
    )
    check_logprobs_mode(logprobs_mode)
    if record_routing and not config.num_moe_layers:
        raise ValueError("record_routing=True needs a mixture-of-experts model (num_experts > 0)")

    prompt_ids, prompt_mask = bucket_prompts(prompt_ids, prompt_mask, pad_token_id=pad_token_id)
    st = _Static(
        config,
        n,
        max_new_tokens,
        float(temperature),
        float(top_p),
        int(top_k),
        eos_token_ids,
        int(pad_token_id),
        logprobs_mode,
        bool(record_routing),
    )
    args = (
        st,
        params,
        prompt_ids,
        prompt_mask,
        as_typed_key(jnp.asarray(rng)),
        jnp.int32(weights_version),
    )
    if not compaction or isinstance(prompt_ids, jax.core.Tracer):
        return _sample_jit(*args)
    return _sample_compacting(
        *args, multiple=_batch_multiple(prompt_ids), min_slots=MIN_COMPACT_SLOTS
    )


def _batch_multiple(x: jax.Array) -> int:
    """How many ways the batch axis of `x` is split (slot counts must stay divisible)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return 1
    return x.shape[0] // sharding.shard_shape(x.shape)[0]


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static settings of one sampling call (hashable: a jit static argument)."""

    config: model_lib.ModelConfig
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    logprobs_mode: str = "processed_logprobs"
    record_routing: bool = False


def _start(st: _Static, params, prompt_ids_PT, prompt_mask_PT, rng) -> SampleState:
    """Prefill once per prompt, share the cache across the n samples, draw token 0."""
    num_prompts, prompt_len = prompt_ids_PT.shape
    batch = num_prompts * st.n
    cache = model_lib.init_cache(st.config, num_prompts, prompt_len)
    routing = {}
    if not st.record_routing:
        logits_PV, cache = model_lib.prefill(
            st.config, params, prompt_ids_PT, prompt_mask_PT, cache
        )
    else:
        logits_PV, cache, experts_LmPTA = model_lib.prefill_and_routing(
            st.config, params, prompt_ids_PT, prompt_mask_PT, cache
        )
        E, dtype = st.config.num_experts, moe.routing_dtype(st.config.num_experts)
        Lm, A = experts_LmPTA.shape[0], experts_LmPTA.shape[-1]
        routing = dict(
            routing_PLmTA=experts_LmPTA.transpose(1, 0, 2, 3).astype(dtype),
            routing_SLmRA=jnp.full((batch, Lm, st.max_new_tokens, A), moe.no_route(E), dtype),
            routing_BLmRA=jnp.full((batch, Lm, st.max_new_tokens, A), moe.no_route(E), dtype),
        )
    # The last generated token is never fed back, hence max_new_tokens - 1 response slots.
    cache = model_lib.group_cache(cache, n=st.n, response_slots=st.max_new_tokens - 1)
    state = SampleState(
        t=jnp.int32(0),
        logits_SV=jnp.repeat(logits_PV, st.n, axis=0).astype(jnp.float32),
        keys_S=row_keys(rng, batch),
        done_S=jnp.zeros((batch,), jnp.bool_),
        ids_SR=jnp.full((batch, st.max_new_tokens), st.pad_token_id, jnp.int32),
        mask_SR=jnp.zeros((batch, st.max_new_tokens), jnp.int32),
        log_probs_SR=jnp.zeros((batch, st.max_new_tokens), jnp.float32),
        cache=cache,
        ids_BR=jnp.full((batch, st.max_new_tokens), st.pad_token_id, jnp.int32),
        mask_BR=jnp.zeros((batch, st.max_new_tokens), jnp.int32),
        log_probs_BR=jnp.zeros((batch, st.max_new_tokens), jnp.float32),
        **routing,
    )
    return dataclasses.replace(_draw(st, state), t=jnp.int32(1))


def _draw(st: _Static, state: SampleState) -> SampleState:
    """Selects the token at response position state.t of every slot and records it."""
    step_keys_S = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys_S, state.t)
    tokens_S, log_probs_S = select_tokens(
        state.logits_SV, step_keys_S, temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
        logprobs_mode=st.logprobs_mode,
    )  # fmt: skip
    live_S = ~state.done_S
    tokens_S = jnp.where(live_S, tokens_S, st.pad_token_id)
    is_eos_S = jnp.isin(tokens_S, jnp.asarray(st.eos_token_ids, jnp.int32)) & live_S
    return dataclasses.replace(
        state,
        done_S=state.done_S | is_eos_S,
        ids_SR=state.ids_SR.at[:, state.t].set(tokens_S),
        mask_SR=state.mask_SR.at[:, state.t].set(live_S.astype(jnp.int32)),
        log_probs_SR=state.log_probs_SR.at[:, state.t].set(jnp.where(live_S, log_probs_S, 0.0)),
    )


def _decode(st: _Static, params, state: SampleState, stop_at) -> SampleState:
    """Decodes until max_new_tokens, or until at most `stop_at` slots are still live."""

    def cond(state: SampleState) -> jax.Array:
        live = jnp.sum(~state.done_S)
        return (state.t < st.max_new_tokens) & (live > 0) & (live > stop_at)

    # The weights are laid out for the per-layer decode once, before the loop: every step then
    # reads each weight and each layer's cache in place (model.DecodeParams, GroupKVCache).
    decode_params = model_lib.decode_params(st.config, params)

    def body(state: SampleState) -> SampleState:
        # Feed back the token drawn at t - 1 (pad for finished slots; their outputs are ignored).
        prev_S = state.ids_SR[:, state.t - 1]
        if not st.record_routing:
            logits_SV, cache = model_lib.decode_step(st.config, decode_params, prev_S, state.cache)
            state = dataclasses.replace(state, logits_SV=logits_SV, cache=cache)
        else:  # and the experts of response token t - 1, the one fed
            logits_SV, cache, experts_LmSA = model_lib.decode_step_and_routing(
                st.config, decode_params, prev_S, state.cache
            )
            state = dataclasses.replace(state, logits_SV=logits_SV, cache=cache)
            routing_SLmA = experts_LmSA.transpose(1, 0, 2).astype(state.routing_SLmRA.dtype)
            state = dataclasses.replace(
                state, routing_SLmRA=state.routing_SLmRA.at[:, :, state.t - 1].set(routing_SLmA)
            )
        return dataclasses.replace(_draw(st, state), t=state.t + 1)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames="size")
def _compact(state: SampleState, *, size: int) -> SampleState:
    """Keeps `size` slots, the live ones first: finished rows stop costing decode steps."""
    keep_S = jnp.argsort(state.done_S, stable=True)[:size]
    state = _flush(state)  # every row's output so far, before slots are dropped
    return dataclasses.replace(
        state,
        logits_SV=state.logits_SV[keep_S],
        keys_S=state.keys_S[keep_S],
        done_S=state.done_S[keep_S],
        ids_SR=state.ids_SR[keep_S],
        mask_SR=state.mask_SR[keep_S],
        log_probs_SR=state.log_probs_SR[keep_S],
        cache=model_lib.take_rows(state.cache, keep_S),
        routing_SLmRA=None if state.routing_SLmRA is None else state.routing_SLmRA[keep_S],
    )


def _flush(state: SampleState) -> SampleState:
    """Writes every slot's outputs into its row of the [B, R] outputs."""
    row_S = state.cache.row_B
    routing = {}
    if state.routing_SLmRA is not None:
        routing["routing_BLmRA"] = state.routing_BLmRA.at[row_S].set(state.routing_SLmRA)
    return dataclasses.replace(
        state,
        ids_BR=state.ids_BR.at[row_S].set(state.ids_SR),
        mask_BR=state.mask_BR.at[row_S].set(state.mask_SR),
        log_probs_BR=state.log_probs_BR.at[row_S].set(state.log_probs_SR),
        **routing,
    )


def _rollout(
    st: _Static, prompt_ids_PT, prompt_mask_PT, state, weights_version, *, compacted: bool
) -> Rollout:
    num_prompts = prompt_ids_PT.shape[0]
    # Without a compaction slot s is row s: the slot outputs are the rollout (and keep the
    # prompts' batch sharding, which a scatter by row would lose).
    if compacted:
        state = _flush(state)
        out = (state.ids_BR, state.mask_BR, state.log_probs_BR, state.routing_BLmRA)
    else:
        out = (state.ids_SR, state.mask_SR, state.log_probs_SR, state.routing_SLmRA)
    routed = None
    if st.record_routing:  # the prompt's experts (shared by its n rows), then the response's
        prompt_BLmTA = jnp.repeat(state.routing_PLmTA, st.n, axis=0)
        routed = jnp.concatenate([prompt_BLmTA, out[3]], axis=2)
        # Only the tokens fed through the model as a row's context keep theirs (the slots of
        # finished rows feed padding until they are compacted away: that depends on the
        # schedule), as the paged engine records them.
        fed_BT = fed_tokens(jnp.repeat(prompt_mask_PT, st.n, axis=0), out[1])
        routed = jnp.where(fed_BT[:, None, :, None], routed, moe.no_route(st.config.num_experts))
    return Rollout(
        prompt_ids=jnp.repeat(prompt_ids_PT, st.n, axis=0),
        prompt_mask=jnp.repeat(prompt_mask_PT, st.n, axis=0),
        response_ids=out[0],
        response_mask=out[1],
        log_probs=out[2],
        group_ids=jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), st.n),
        weights_version=weights_version,
        routed_experts=routed,
    )


def fed_tokens(prompt_mask_BT, response_mask_BR):
    """bool [B, Tb + R]: the tokens a rollout fed through the model as context, those whose
    experts `Rollout.routed_experts` records: the real prompt tokens and every response token
    followed by another (a row's last token is drawn, never fed)."""
    prompt_BT = prompt_mask_BT > 0
    followed_BR = jnp.pad(response_mask_BR[:, 1:] > 0, ((0, 0), (0, 1)))
    return jnp.concatenate([prompt_BT, followed_BR], axis=1)


def _sample_whole(st: _Static, params, prompt_ids_PT, prompt_mask_PT, rng, weights_version):
    """The whole call as one program (no compaction)."""
    state = _decode(st, params, _start(st, params, prompt_ids_PT, prompt_mask_PT, rng), 0)
    return _rollout(st, prompt_ids_PT, prompt_mask_PT, state, weights_version, compacted=False)


# XLA:CPU compiles the sampler's programs for long responses with YNNPACK's dot kernels. A decode
# step's attention is many small products (per row and KV head: R query heads x head_dim against
# every cache slot), and XLA:CPU's default batched dot runs them at about 6 GB/s; YNNPACK's at
# about twice that. SmolLM2-135M, 8 GSM8K prompts x 4 x 256 tokens (bench_rollout.py): 78 -> 53 s
# per call. The update's large dots gain nothing from it (101 vs 103 s), so only the sampler and
# the paged engine's decode program (rollout.paged_programs.programs) set it. (The XLA_FLAGS
# spelling of the same option is --xla_cpu_experimental_ynn_fusion_type=dot.)
CPU_COMPILER_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}
# Short responses gain nothing from YNNPACK and compile longer with it, so they keep the default
# dots. SmolLM2-135M on a 2-core AMD EPYC (AVX-512), ms per decode step / compile s of one decode
# program, default -> YNNPACK: 48 new tokens, 64 rows: 172 / 7.1 -> 183 / 10.7; 128 new tokens,
# 64 rows: 183 -> 188; 128 new tokens after 160-token prompts, 32 rows: 121 -> 117; 256 new tokens
# after 160-token prompts, 32 rows: 182 -> 109 (compile 18.5 -> 18.3).
YNNPACK_MIN_NEW_TOKENS = 129


@functools.cache
def compiler_options(platform: str | None) -> dict[str, str] | None:
    """The XLA options the sampler's programs compile with on `platform` (None: the defaults).

    On CPU, `CPU_COMPILER_OPTIONS` where this jaxlib knows them: older jaxlibs have no YNNPACK
    and compile the sampler with the defaults (same results, slower decode), with a warning.
    """
    if platform != "cpu":
        return None
    try:
        jax.jit(lambda x: x @ x, compiler_options=CPU_COMPILER_OPTIONS).lower(
            jnp.ones((2, 2), jnp.float32)
        ).compile()
    except Exception as e:  # noqa: BLE001 - any rejection of the options means "not here"
        warnings.warn(
            f"this jaxlib ({jax.__version__}) rejects {CPU_COMPILER_OPTIONS} ({e}); the sampler "
            "compiles with XLA:CPU's default dots (slower decode, same results)",
            stacklevel=2,
        )
        return None
    return dict(CPU_COMPILER_OPTIONS)


def _uses_ynnpack(st: _Static) -> bool:
    """Whether `st`'s programs take `compiler_options` (see YNNPACK_MIN_NEW_TOKENS)."""
    return st.max_new_tokens >= YNNPACK_MIN_NEW_TOKENS


@functools.cache
def _programs(platform: str | None, long_responses: bool = True) -> dict:
    """The sampler's jitted programs for one platform (see `compiler_options`); with
    `long_responses` False they compile with the platform's default options."""
    opts = compiler_options(platform) if long_responses else None
    return {
        "sample": jax.jit(_sample_whole, static_argnums=0, compiler_options=opts),
        "start": jax.jit(_start, static_argnums=0, compiler_options=opts),
        "decode": jax.jit(_decode, static_argnums=0, donate_argnums=2, compiler_options=opts),
        "rollout": jax.jit(
            _rollout, static_argnums=0, static_argnames="compacted", compiler_options=opts
        ),
    }


def _platform(x) -> str | None:
    """The platform `x` lives on; None inside a trace (an outer jit compiles the programs, and
    jax takes compiler options on top-level jits only)."""
    if isinstance(x, jax.core.Tracer):
        return None
    devices = getattr(x, "devices", None)
    return next(iter(devices())).platform if devices is not None else jax.default_backend()


def _sample_jit(st: _Static, params, prompt_ids_PT, prompt_mask_PT, rng, weights_version):
    """`_sample_whole` as one program: traceable, e.g. by plan.py."""
    program = _programs(_platform(prompt_ids_PT), _uses_ynnpack(st))["sample"]
    return program(st, params, prompt_ids_PT, prompt_mask_PT, rng, weights_version)


def _decode_jit(st: _Static, params, state: SampleState, stop_at):
    """One decode phase (`_decode`), compiled for the platform the state lives on."""
    program = _programs(_platform(state.done_S), _uses_ynnpack(st))["decode"]
    return program(st, params, state, stop_at)


def _next_size(size: int, multiple: int) -> int:
    """The slot count after a compaction: half, rounded up to the data devices' multiple."""
    return max(multiple, -(-(size // 2) // multiple) * multiple)


def _sample_compacting(
    st: _Static,
    params,
    prompt_ids_PT,
    prompt_mask_PT,
    rng,
    weights_version,
    *,
    multiple: int,
    min_slots: int,
) -> Rollout:
    """Decodes in phases: whenever the live rows fit half the slots, the cache is compacted.

    Each phase is one compiled while_loop over the current slot count (B, B/2, ..., down to
    `min_slots`); the host only reads the live count between phases. Once every row is done
    (or max_new_tokens are drawn) the remaining phases still run, each compacting (every row's
    output is flushed first) and exiting its loop at once: the same programs run in every call
    of a batch shape, whenever its rows finish, so only the first call compiles.
    """
    programs = _programs(_platform(prompt_ids_PT), _uses_ynnpack(st))
    state = programs["start"](st, params, prompt_ids_PT, prompt_mask_PT, rng)
    size = state.done_S.shape[0]
    compacted = False
    while True:
        nxt = _next_size(size, multiple)
        can_shrink = nxt < size and nxt >= min_slots
        state = _decode_jit(st, params, state, jnp.int32(nxt if can_shrink else 0))
        if not can_shrink:
            break
        state, size, compacted = _compact(state, size=nxt), nxt, True
    rollout = programs["rollout"](
        st, prompt_ids_PT, prompt_mask_PT, state, weights_version, compacted=compacted
    )
    if compacted:  # rows back on the prompts' batch sharding (the gathers moved them)
        rollout = jax.tree.map(
            lambda x: jax.device_put(x, _row_sharding(prompt_ids_PT, x.ndim)), rollout
        )
    return rollout


def _row_sharding(prompt_ids_PT, ndim: int):
    """The prompts' split of the batch axis for an array of `ndim` dims (replicated scalars)."""
    sharding = prompt_ids_PT.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding if ndim else None
    if ndim == 0:
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    spec = jax.sharding.PartitionSpec(
        sharding.spec[0] if sharding.spec else None, *([None] * (ndim - 1))
    )
    return jax.sharding.NamedSharding(sharding.mesh, spec)
