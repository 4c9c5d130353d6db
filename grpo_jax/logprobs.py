"""Log-probs, entropy and the exact KL from logits or hidden states, chunked over token rows.

* ``logprobs_from_logits``, ``entropy_from_logits``: direct, for small vocabularies and tests.
* ``logprobs_and_entropy_chunked`` (from [B, T, V] logits) and ``logprobs_and_entropy_from_hidden``
  (from final hidden states and an unembedding callable): row chunks in a ``lax.scan`` with
  hand-written backward passes, so no float32 [B, T, V] array besides the logits and their
  gradient (or none at all, from hidden states) is ever live.
* ``full_kl_from_logits``: KL(softmax z || softmax z_ref) per token over the whole vocabulary
  (``loss.kl_penalty``'s ``full``), chunked the same way.

16-bit logits pass through the chunk loops bit-cast to uint16 (``_to_bits``); XLA:CPU
materialises that bit-cast as one same-width copy, still no float32 one. ``grpo_jax.loss``
re-exports the public names.

Shapes: B sequences, T tokens, V vocabulary, D hidden size, N = B*T token rows, C chunks of r
rows.
"""

import functools

import jax
import jax.numpy as jnp


def _rows_per_chunk(num_rows, chunk_size):
    """The largest divisor of num_rows that is <= chunk_size, so chunks are free reshapes."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    rows = max(1, min(chunk_size, num_rows))
    while num_rows % rows:
        rows -= 1
    return rows


def _to_bits(x):
    """16-bit floats travel through scans as same-width unsigned ints. XLA:CPU otherwise
    widens a bf16 loop operand to float32 as a whole (float normalisation), i.e. it builds the
    float32 [N, V] copy that chunking exists to avoid."""
    if x.dtype.itemsize != 2:
        return x
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def _from_bits(x, dtype):
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _upcast_chunk(x, dtype):
    """float32 values of one chunk that went through ``_to_bits``."""
    return _from_bits(x, dtype).astype(jnp.float32)


def _full_kl_chunk(z_rV, zr_rV, dtype):
    """Per-row KL(softmax z || softmax zr) = sum p (z - zr) - lse(z) + lse(zr), and residuals."""
    z_rV, zr_rV = _upcast_chunk(z_rV, dtype), _upcast_chunk(zr_rV, dtype)
    lse_r = jax.nn.logsumexp(z_rV, axis=-1)
    p_rV = jnp.exp(z_rV - lse_r[:, None])
    a_r = jnp.sum(p_rV * (z_rV - zr_rV), axis=-1)
    return a_r - lse_r + jax.nn.logsumexp(zr_rV, axis=-1), lse_r, a_r


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _full_kl_rows(z_NV, zr_NV, rows):
    return _full_kl_rows_fwd(z_NV, zr_NV, rows)[0]


def _full_kl_rows_fwd(z_NV, zr_NV, rows):
    (num, vocab), chunks = z_NV.shape, z_NV.shape[0] // rows
    z_CrV = _to_bits(z_NV).reshape(chunks, rows, vocab)
    zr_CrV = _to_bits(zr_NV.astype(z_NV.dtype)).reshape(chunks, rows, vocab)
    _, (kl_Cr, lse_Cr, a_Cr) = jax.lax.scan(
        lambda carry, x: (carry, _full_kl_chunk(*x, z_NV.dtype)), None, (z_CrV, zr_CrV)
    )
    return kl_Cr.reshape(num), (z_NV, zr_NV, lse_Cr, a_Cr)


def _full_kl_rows_bwd(rows, res, g_N):
    z_NV, zr_NV, lse_Cr, a_Cr = res
    (num, vocab), chunks = z_NV.shape, z_NV.shape[0] // rows

    def chunk_grad(carry, x):
        z_rV, zr_rV, lse_r, a_r, g_r = x
        z_rV = _upcast_chunk(z_rV, z_NV.dtype)
        p_rV = jnp.exp(z_rV - lse_r[:, None])
        # d KL / d z_j = p_j ((z_j - zr_j) - sum_k p_k (z_k - zr_k)).
        grad_rV = g_r[:, None] * p_rV * (z_rV - _upcast_chunk(zr_rV, z_NV.dtype) - a_r[:, None])
        return carry, _to_bits(grad_rV.astype(z_NV.dtype))

    xs = (
        _to_bits(z_NV).reshape(chunks, rows, vocab),
        _to_bits(zr_NV.astype(z_NV.dtype)).reshape(chunks, rows, vocab),
        lse_Cr,
        a_Cr,
        g_N.reshape(chunks, rows),
    )
    _, grad_CrV = jax.lax.scan(chunk_grad, None, xs)
    # The reference model is frozen: ref_logits get no gradient.
    return _from_bits(grad_CrV, z_NV.dtype).reshape(num, vocab), None


_full_kl_rows.defvjp(_full_kl_rows_fwd, _full_kl_rows_bwd)


def full_kl_from_logits(logits, ref_logits, chunk_size=512):
    """KL(softmax(logits) || softmax(ref_logits)) per token, float32 [...]; chunked over rows,
    the reference gets no gradient."""
    if logits is None or ref_logits is None:
        raise ValueError("kl_type 'full' needs logits and ref_logits ([B, T, V])")
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {logits.shape} and ref_logits {ref_logits.shape} differ")
    *lead, vocab = logits.shape
    num = 1
    for n in lead:
        num *= n
    rows = _rows_per_chunk(num, chunk_size)
    kl_N = _full_kl_rows(logits.reshape(num, vocab), ref_logits.reshape(num, vocab), rows)
    return kl_N.reshape(lead)



def logprobs_from_logits(logits, labels):
    """log softmax(logits)[labels], in float32 (verl's naive path; plain autodiff).

    Args:
        logits: [..., V] logits (already divided by the temperature).
        labels: [...] int token ids.

    Returns:
        [...] float32 log-probs.
    """
    z = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(z, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def entropy_from_logits(logits):
    """Entropy of softmax(logits): logsumexp(z) - sum softmax(z) z, in float32.

    Args:
        logits: [..., V] logits.

    Returns:
        [...] float32 entropies.
    """
    z = logits.astype(jnp.float32)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def _logprob_entropy_chunk(z_rV, labels_r, inv_temperature, dtype, with_entropy=True):
    """Forward on one chunk of rows: (log-prob, entropy, logsumexp, E_p[z]), all float32 [r].

    Without ``with_entropy`` the entropy and E_p[z] are zeros and the sum of p z over the
    vocabulary (a third pass over the chunk's logits) is not computed."""
    z_rV = _upcast_chunk(z_rV, dtype) * inv_temperature
    max_r = jnp.max(z_rV, axis=-1)
    max_r = jnp.where(jnp.isfinite(max_r), max_r, 0.0)
    # One exp per logit serves both sums: sum e and sum e z (exp dominates the CPU cost).
    e_rV = jnp.exp(z_rV - max_r[:, None])
    sum_e_r = jnp.sum(e_rV, axis=-1)
    lse_r = max_r + jnp.log(sum_e_r)
    picked_r = jnp.take_along_axis(z_rV, labels_r[:, None], axis=-1)[:, 0]
    if not with_entropy:
        zeros_r = jnp.zeros_like(lse_r)
        return picked_r - lse_r, zeros_r, lse_r, zeros_r
    mean_z_r = jnp.sum(e_rV * z_rV, axis=-1) / sum_e_r
    return picked_r - lse_r, lse_r - mean_z_r, lse_r, mean_z_r


def _logprob_entropy_chunk_grad(
    z_rV, labels_r, lse_r, mean_z_r, g_lp_r, g_ent_r, inv_temp, dtype, with_entropy=True
):
    """d/dz of sum(g_lp * logp + g_ent * H): g_lp (onehot - p) - g_ent p (z - E_p[z])."""
    zs_rV = _upcast_chunk(z_rV, dtype) * inv_temp
    p_rV = jnp.exp(zs_rV - lse_r[:, None])
    onehot_rV = (jnp.arange(z_rV.shape[-1], dtype=jnp.int32)[None, :] == labels_r[:, None]).astype(
        jnp.float32
    )
    grad_rV = g_lp_r[:, None] * (onehot_rV - p_rV)
    if with_entropy:
        grad_rV = grad_rV - g_ent_r[:, None] * p_rV * (zs_rV - mean_z_r[:, None])
    return _to_bits((grad_rV * inv_temp).astype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logprob_entropy_rows(z_NV, labels_N, rows, inv_temperature):
    return _logprob_entropy_rows_fwd(z_NV, labels_N, rows, inv_temperature)[0]


def _logprob_entropy_rows_fwd(z_NV, labels_N, rows, inv_temperature):
    (num, vocab), chunks = z_NV.shape, z_NV.shape[0] // rows

    def chunk(carry, x):
        return carry, _logprob_entropy_chunk(*x, inv_temperature, z_NV.dtype)

    xs = (_to_bits(z_NV).reshape(chunks, rows, vocab), labels_N.reshape(chunks, rows))
    _, (lp_Cr, ent_Cr, lse_Cr, mean_z_Cr) = jax.lax.scan(chunk, None, xs)
    # Residuals are the logits themselves plus two floats per row: nothing [N, V] is saved.
    return (lp_Cr.reshape(num), ent_Cr.reshape(num)), (z_NV, labels_N, lse_Cr, mean_z_Cr)


def _logprob_entropy_rows_bwd(rows, inv_temperature, res, g):
    z_NV, labels_N, lse_Cr, mean_z_Cr = res
    g_lp_N, g_ent_N = g
    (num, vocab), chunks = z_NV.shape, z_NV.shape[0] // rows

    def chunk(carry, x):
        return carry, _logprob_entropy_chunk_grad(*x, inv_temperature, z_NV.dtype)

    xs = (
        _to_bits(z_NV).reshape(chunks, rows, vocab),
        labels_N.reshape(chunks, rows),
        lse_Cr,
        mean_z_Cr,
        g_lp_N.reshape(chunks, rows),
        g_ent_N.reshape(chunks, rows),
    )
    _, grad_CrV = jax.lax.scan(chunk, None, xs)
    return _from_bits(grad_CrV, z_NV.dtype).reshape(num, vocab), None


_logprob_entropy_rows.defvjp(_logprob_entropy_rows_fwd, _logprob_entropy_rows_bwd)


def check_temperature(temperature) -> float:
    """Log-probs divide the logits by the temperature: it must be > 0. Returns 1 / temperature."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (the log-probs divide by it)")
    return 1.0 / float(temperature)


def logprobs_and_entropy_chunked(
    logits, labels, *, chunk_size=1024, temperature=1.0, calculate_entropy=True
):
    """Log-probs and entropy of softmax(logits / temperature), chunked over token rows.

    The B*T token rows are processed ``chunk_size`` at a time (the largest divisor of B*T not
    above ``chunk_size``, so chunks are free reshapes), in float32 whatever the logits dtype.
    Forward and backward are each one pass over the logits; the backward writes the gradient
    chunk by chunk, so the only [B, T, V] arrays are the logits and their gradient.

    Args:
        logits: [B, T, V] logits (any float dtype), not yet divided by the temperature.
        labels: [B, T] int token ids.
        chunk_size: maximum token rows per chunk.
        temperature: Python float > 0 (config ``rollout.temperature``); logits are divided by it.
        calculate_entropy: also return the entropy (verl's ``calculate_entropy``).

    Returns:
        (log_probs [B, T] float32, entropy [B, T] float32 or None).
    """
    inv_temperature = check_temperature(temperature)
    *lead, vocab = logits.shape
    if tuple(lead) != labels.shape:
        raise ValueError(f"labels {labels.shape} do not match logits {logits.shape}")
    num = 1
    for n in lead:
        num *= n
    rows = _rows_per_chunk(num, chunk_size)
    lp_N, ent_N = _logprob_entropy_rows(
        logits.reshape(num, vocab), labels.reshape(num).astype(jnp.int32), rows, inv_temperature
    )
    return lp_N.reshape(lead), (ent_N.reshape(lead) if calculate_entropy else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _head_chunk(unembed, with_entropy, inv_temperature, h_rD, labels_r, any_valid, *consts):
    """(log-prob, entropy) [r] of one chunk of hidden-state rows, logits made and dropped inside.

    Its VJP saves the rows' logsumexp and E_p[z] (two floats a row, nothing [r, V]) and, in
    the backward, makes the logits once more for the gradient: no second max / exp / sum pass
    over the vocabulary as a checkpointed forward would run. ``any_valid`` False (a traced
    bool, or None for always) skips the chunk, forward and backward: outputs and gradients 0.
    """
    return _head_chunk_fwd(unembed, with_entropy, inv_temperature, h_rD, labels_r, any_valid,
                           *consts)[0]  # fmt: skip


def _head_chunk_fwd(unembed, with_entropy, inv_temperature, h_rD, labels_r, any_valid, *consts):
    def compute(h_rD, labels_r, consts):
        z_rV = unembed(h_rD, *consts)
        return _logprob_entropy_chunk(z_rV, labels_r, inv_temperature, z_rV.dtype, with_entropy)

    def skip(h_rD, labels_r, consts):
        zeros = jnp.zeros(labels_r.shape, jnp.float32)
        return zeros, zeros, zeros, zeros

    if any_valid is None:
        lp_r, ent_r, lse_r, mean_z_r = compute(h_rD, labels_r, consts)
    else:
        lp_r, ent_r, lse_r, mean_z_r = jax.lax.cond(any_valid, compute, skip, h_rD, labels_r,
                                                    consts)  # fmt: skip
    return (lp_r, ent_r), (h_rD, labels_r, any_valid, lse_r, mean_z_r, consts)


def _head_chunk_bwd(unembed, with_entropy, inv_temperature, res, g):
    h_rD, labels_r, any_valid, lse_r, mean_z_r, consts = res
    g_lp_r, g_ent_r = g

    def compute(h_rD, consts):
        z_rV, vjp = jax.vjp(unembed, h_rD, *consts)
        g_z = _logprob_entropy_chunk_grad(z_rV, labels_r, lse_r, mean_z_r, g_lp_r, g_ent_r,
                                          inv_temperature, z_rV.dtype, with_entropy)  # fmt: skip
        return vjp(_from_bits(g_z, z_rV.dtype))

    def skip(h_rD, consts):
        return (jnp.zeros_like(h_rD), *(jnp.zeros_like(c) for c in consts))

    if any_valid is None:
        grads = compute(h_rD, consts)
    else:
        grads = jax.lax.cond(any_valid, compute, skip, h_rD, consts)
    return (grads[0], None, None, *grads[1:])


_head_chunk.defvjp(_head_chunk_fwd, _head_chunk_bwd)


def logprobs_and_entropy_from_hidden(
    h_BTD,
    unembed,
    labels,
    *,
    chunk_size=1024,
    temperature=1.0,
    calculate_entropy=True,
    valid=None,
):
    """Log-probs and entropy straight from final hidden states, never building [B, T, V].

    Token rows are processed ``chunk_size`` at a time in a ``lax.scan``; each chunk's logits
    come from ``unembed`` and are dropped after use. The chunk body is ``jax.checkpoint``-ed, so
    the backward recomputes one chunk's logits at a time too: peak extra memory is about two
    [chunk_size, V] float32 arrays, whatever B and T are. Gradients flow to ``h_BTD`` and to
    any arrays ``unembed`` closes over (e.g. the unembedding matrix).

    Args:
        h_BTD: [B, T, D] final (normed) hidden states at the positions that predict ``labels``.
        unembed: callable mapping [r, D] hidden states to [r, V] logits, e.g.
            ``functools.partial(model.unembed, config, params)`` or ``lambda h: h @ w_DV``.
        labels: [B, T] int token ids.
        chunk_size: the most token rows per chunk (B*T is split into ceil(B*T / chunk_size)
            equal chunks, zero-padded by fewer rows than there are chunks).
        temperature: Python float > 0; logits are divided by it.
        calculate_entropy: also return the entropy.
        valid: optional [B, T] bool, the rows that are wanted. A chunk with no valid row is
            not unembedded (forward or backward; its outputs are 0), so a fixed-size input
            whose wanted rows come first costs about what its valid rows do (packed slots).

    Returns:
        (log_probs [B, T] float32, entropy [B, T] float32 or None); with `valid`, the rows
        of skipped chunks are 0.
    """
    inv_temperature = check_temperature(temperature)
    if h_BTD.shape[:-1] != labels.shape:
        raise ValueError(f"labels {labels.shape} do not match hidden states {h_BTD.shape}")
    batch, length, dim = h_BTD.shape
    num = batch * length
    # As few chunks as chunk_size allows, split evenly: at most chunks - 1 padded rows (2,400
    # packed slots are 3 chunks of 800, not 3 of 1,024 with 672 rows of padding).
    chunks = -(-num // max(1, min(chunk_size, num)))
    rows = -(-num // chunks)
    pad = chunks * rows - num
    h_ND = jnp.pad(h_BTD.reshape(num, dim), ((0, pad), (0, 0)))
    labels_N = jnp.pad(labels.reshape(num).astype(jnp.int32), (0, pad))

    # The unembedding's closed-over weights become explicit arguments of the chunk's VJP.
    fn, consts = jax.closure_convert(unembed, h_ND[:rows])
    head = functools.partial(_head_chunk, fn, bool(calculate_entropy), inv_temperature)
    xs = (h_ND.reshape(chunks, rows, dim), labels_N.reshape(chunks, rows))
    if valid is not None:
        if valid.shape != labels.shape:
            raise ValueError(f"valid {valid.shape} does not match labels {labels.shape}")
        xs = (*xs, jnp.pad(valid.reshape(num), (0, pad)).reshape(chunks, rows).any(1))
    else:
        xs = (*xs, None)

    def body(carry, x):
        h_rD, labels_r, any_valid = x
        return carry, head(h_rD, labels_r, any_valid, *consts)

    _, (lp_Cr, ent_Cr) = jax.lax.scan(body, None, xs)
    lp_BT = lp_Cr.reshape(-1)[:num].reshape(batch, length)
    ent_BT = ent_Cr.reshape(-1)[:num].reshape(batch, length) if calculate_entropy else None
    return lp_BT, ent_BT
