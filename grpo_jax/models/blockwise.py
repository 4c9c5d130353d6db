"""Blockwise (flash) self-attention in plain JAX: memory linear in the sequence, forward and
backward, on any backend.

The scores of one (query block, key block) pair are the only quadratic array alive: the forward
keeps a running max, sum and output per query row over the key blocks (online softmax) and
returns the output with the rows' log-sum-exp; the backward (a ``jax.custom_vjp``) recomputes
each block's probabilities from that log-sum-exp instead of saving them (FlashAttention-2,
arXiv 2307.08691, section 3.1). Key blocks after a query block's causal limit are not visited.

Who sees whom comes from per-token segment ids (``attention.Mask``), never from a dense
[T, S] mask: query t sees key s <= t whose segment is > 0 and equals t's segment or t's
prefix segment (a packed response sees its own tokens and its group's prompt).

Shapes: B rows, T tokens, K kv heads, R query heads per kv head (N = K R), H head dim; a query
block holds R x bq query rows of one kv head (the GQA heads folded into the query axis, as in
``attention.attend``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MIN = float(jnp.finfo(jnp.float32).min)


def visible(seg_q, pre_q, idx_q, seg_k, idx_k):
    """[B, bq, bk] bool: query (segment, prefix, index) sees key (segment, index); the rule of
    `attention.Mask`, for one block pair or (whole index ranges) a whole row."""
    same = (seg_k[:, None, :] == seg_q[:, :, None]) | (seg_k[:, None, :] == pre_q[:, :, None])
    return (idx_k[None, None, :] <= idx_q[None, :, None]) & (seg_k[:, None, :] > 0) & same


def _scores(q_BKQH, k_BKbH, vis_Bqb, R, scale):
    """Masked float32 scores [B, K, R*bq, bk] of one block pair."""
    B, K, Q, _ = q_BKQH.shape
    s = jax.lax.dot_general(
        q_BKQH, k_BKbH, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32
    ) * scale
    bk = s.shape[-1]
    s = s.reshape(B, K, R, Q // R, bk)
    s = jnp.where(vis_Bqb[:, None, None], s, _MIN)
    return s.reshape(B, K, Q, bk)


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _q_rows(x_BKRTH, i, bq):
    """Query block i as [B, K, R*bq, H]."""
    B, K, R, _, H = x_BKRTH.shape
    return _slice(x_BKRTH, i * bq, bq, 3).reshape(B, K, R * bq, H)


def _rows_of(x_BKRq, i, bq):
    """Per-query-row values [B, K, R, T] of query block i, as [B, K, R*bq]."""
    B, K, R, _ = x_BKRq.shape
    return _slice(x_BKRq, i * bq, bq, 3).reshape(B, K, R * bq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q_BKRTH, k_BKTH, v_BKTH, seg_BT, pre_BT, bq, bk):
    return _flash_fwd(q_BKRTH, k_BKTH, v_BKTH, seg_BT, pre_BT, bq, bk)[0]


def _flash_fwd(q_BKRTH, k_BKTH, v_BKTH, seg_BT, pre_BT, bq, bk):
    B, K, R, T, H = q_BKRTH.shape
    scale = H**-0.5
    idx_T = jnp.arange(T, dtype=jnp.int32)

    def q_block(_, i):
        q = _q_rows(q_BKRTH, i, bq)
        seg_q, pre_q = _slice(seg_BT, i * bq, bq, 1), _slice(pre_BT, i * bq, bq, 1)
        idx_q = _slice(idx_T, i * bq, bq, 0)

        def kv_block(j, carry):
            m, l, acc = carry
            k, v = _slice(k_BKTH, j * bk, bk, 2), _slice(v_BKTH, j * bk, bk, 2)
            vis = visible(seg_q, pre_q, idx_q, _slice(seg_BT, j * bk, bk, 1),
                           _slice(idx_T, j * bk, bk, 0))  # fmt: skip
            s = _scores(q, k, vis, R, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jax.lax.dot_general(
                p.astype(v.dtype), v, (((3,), (2,)), ((0, 1), (0, 1))),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        Q = R * bq
        init = (jnp.full((B, K, Q), _MIN, jnp.float32), jnp.zeros((B, K, Q), jnp.float32),
                jnp.zeros((B, K, Q, H), jnp.float32))  # fmt: skip
        last = ((i + 1) * bq - 1) // bk  # the last key block a query of this block can see
        m, l, acc = jax.lax.fori_loop(0, last + 1, kv_block, init)
        o = (acc / l[..., None]).reshape(B, K, R, bq, H)
        lse = (m + jnp.log(l)).reshape(B, K, R, bq)
        return None, (o, lse)

    _, (o_nBKRqH, lse_nBKRq) = jax.lax.scan(q_block, None, jnp.arange(T // bq))
    o_BKRTH = jnp.moveaxis(o_nBKRqH, 0, 3).reshape(B, K, R, T, H).astype(q_BKRTH.dtype)
    lse_BKRT = jnp.moveaxis(lse_nBKRq, 0, 3).reshape(B, K, R, T)
    return o_BKRTH, (q_BKRTH, k_BKTH, v_BKTH, seg_BT, pre_BT, o_BKRTH, lse_BKRT)


def _flash_bwd(bq, bk, res, do_BKRTH):
    q_BKRTH, k_BKTH, v_BKTH, seg_BT, pre_BT, o_BKRTH, lse_BKRT = res
    B, K, R, T, H = q_BKRTH.shape
    scale = H**-0.5
    idx_T = jnp.arange(T, dtype=jnp.int32)
    # D_i = sum_h dO o: the softmax backward's row term (FlashAttention-2, algorithm 2).
    d_BKRT = jnp.sum(do_BKRTH.astype(jnp.float32) * o_BKRTH.astype(jnp.float32), axis=-1)

    def kv_block(dq_BKRTH, j):
        k, v = _slice(k_BKTH, j * bk, bk, 2), _slice(v_BKTH, j * bk, bk, 2)
        seg_k, idx_k = _slice(seg_BT, j * bk, bk, 1), _slice(idx_T, j * bk, bk, 0)

        def q_block(i, carry):
            dq, dk, dv = carry
            q, do = _q_rows(q_BKRTH, i, bq), _q_rows(do_BKRTH, i, bq)
            vis = visible(_slice(seg_BT, i * bq, bq, 1), _slice(pre_BT, i * bq, bq, 1),
                           _slice(idx_T, i * bq, bq, 0), seg_k, idx_k)  # fmt: skip
            s = _scores(q, k, vis, R, scale)
            p = jnp.exp(s - _rows_of(lse_BKRT, i, bq)[..., None])
            batch = ((0, 1), (0, 1))
            dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((2,), (2,)), batch),
                                          preferred_element_type=jnp.float32)  # fmt: skip
            dp = jax.lax.dot_general(do, v, (((3,), (3,)), batch),
                                     preferred_element_type=jnp.float32)  # fmt: skip
            ds = p * (dp - _rows_of(d_BKRT, i, bq)[..., None]) * scale
            dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((2,), (2,)), batch),
                                          preferred_element_type=jnp.float32)  # fmt: skip
            dq_blk = jax.lax.dot_general(ds.astype(k.dtype), k, (((3,), (2,)), batch),
                                         preferred_element_type=jnp.float32)  # fmt: skip
            dq_blk = dq_blk.reshape(B, K, R, bq, H)
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, _slice(dq, i * bq, bq, 3) + dq_blk, i * bq, 3
            )
            return dq, dk, dv

        zeros = jnp.zeros((B, K, bk, H), jnp.float32)
        first = (j * bk) // bq  # the first query block that can see this key block
        dq_BKRTH, dk, dv = jax.lax.fori_loop(first, T // bq, q_block, (dq_BKRTH, zeros, zeros))
        return dq_BKRTH, (dk, dv)

    dq, (dk_nBKbH, dv_nBKbH) = jax.lax.scan(
        kv_block, jnp.zeros(q_BKRTH.shape, jnp.float32), jnp.arange(T // bk)
    )
    dk = jnp.moveaxis(dk_nBKbH, 0, 2).reshape(k_BKTH.shape)
    dv = jnp.moveaxis(dv_nBKbH, 0, 2).reshape(v_BKTH.shape)
    return (dq.astype(q_BKRTH.dtype), dk.astype(k_BKTH.dtype), dv.astype(v_BKTH.dtype),
            None, None)  # fmt: skip


_flash.defvjp(_flash_fwd, _flash_bwd)


def attend(q_BTNH, k_BTKH, v_BTKH, segments_BT, prefixes_BT, *, block=512):
    """Causal self-attention with GQA over rows of T tokens, blockwise.

    Args:
      q_BTNH, k_BTKH, v_BTKH: queries, keys and values (k, v with K heads, N = K x R).
      segments_BT, prefixes_BT: int32 (``attention.Mask``): query t sees key s <= t whose
        segment is > 0 and equals t's segment or t's prefix.
      block: query and key block length; rows are padded to a multiple of it (T up to
        `block`: one block of T). Scores are float32 [B, N, block, block] at a time.

    Returns:
      o_BTNH. A query that sees no key gets the mean of the values of the key blocks it
      visits (finite, as ``attention.attend``'s uniform row; such rows are padding).
    """
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    R = N // K
    b = min(block, T)
    Tp = -(-T // b) * b
    if Tp != T:  # padded keys have segment 0 (seen by nobody), padded queries are dropped
        pad = ((0, 0), (0, Tp - T))
        q_BTNH, k_BTKH, v_BTKH = (
            jnp.pad(x, pad + ((0, 0), (0, 0))) for x in (q_BTNH, k_BTKH, v_BTKH)
        )
        segments_BT, prefixes_BT = jnp.pad(segments_BT, pad), jnp.pad(prefixes_BT, pad)
    q_BKRTH = q_BTNH.reshape(B, Tp, K, R, H).transpose(0, 2, 3, 1, 4)
    k_BKTH, v_BKTH = k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)
    o_BKRTH = _flash(q_BKRTH, k_BKTH, v_BKTH, segments_BT.astype(jnp.int32),
                     prefixes_BT.astype(jnp.int32), b, b)  # fmt: skip
    return o_BKRTH.transpose(0, 3, 1, 2, 4).reshape(B, Tp, N, H)[:, :T]
