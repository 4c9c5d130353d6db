"""Causal self-attention at bfloat16 on XLA:CPU, in the dot forms its bf16 kernels take.

`attention.self_attention`'s "xla" path at the bfloat16 compute dtype on XLA:CPU
(`matmul.cpu_kernels`). XLA:CPU hands a dot to its bf16 kernels (YNNPACK: AMX or AVX512-BF16)
only when it is bf16 x bf16 -> float32 with the lhs contracted on its last axis and the rhs
row-major (grpo_jax/models/matmul.py); every other form runs as a float32 dot. In
`attention.attend_causal` the probabilities x values product has a bf16 result, and JAX's
derivative of both products (a float32 cotangent against a bf16 operand, lhs contracted on its
first axis) is of the other forms. Here each of the six products is written in that form:

  forward    s  = q @ k            [Q, H] x [H, S]   float32 scores, masked, softmax in float32
             o  = bf16(p) @ v      [Q, S] x [S, H]   rounded to bf16
  backward   dp = do @ v^T         [Q, H] x [H, S]
             ds = p (dp - rowsum(p dp)), rounded to bf16 (as torch's bf16 autocast does)
             dq = ds @ k^T         [Q, S] x [S, H]
             dk^T = q^T @ ds       [H, Q] x [Q, S]
             dv^T = do^T @ bf16(p) [H, Q] x [Q, S]

with the transposed operands written to row-major buffers of their own (`matmul.row_major`), on
[Q, H]- and [S, H]-sized arrays only, never on the [Q, S] scores. The backward recomputes the
scores from the rows' log-sum-exp instead of saving them (FlashAttention-2's rule, as
grpo_jax/models/blockwise.py does), so no remat policy sees (or saves) these products.

The queries are laid out [B, K, T, R, H] (the R query heads of a kv head inside each token),
so a causal block of b tokens is R*b contiguous query rows: block i attends to keys [0, (i+1) b)
only, as `attention.attend_causal` does, and the blocks' outputs concatenate without a
transpose.

Shapes: B rows, T tokens, N query heads, K kv heads, R = N / K, H head dim; S keys (= T).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.models import matmul

_MIN = float(jnp.finfo(jnp.float32).min)
_BATCH = ((0, 1), (0, 1))


def _dot(a_BKMC, b_BKCN):
    """[B, K, M, C] x [B, K, C, N] -> float32 [B, K, M, N]: the form XLA:CPU's bf16 kernels
    take (lhs contracted on its last axis, rhs on its first non-batch one)."""
    return jax.lax.dot_general(
        a_BKMC, b_BKCN, (((3,), (2,)), _BATCH), preferred_element_type=jnp.float32
    )


def _blocks(T: int, b: int):
    """[(start, end)] of the causal query blocks of b tokens."""
    return [(start, min(T, start + b)) for start in range(0, T, b)]


def _scores(q_BKQH, k_BKHS, vis_BtS, R):
    """Masked float32 scores [B, K, Q, S] of one query block (Q = t R rows)."""
    B, K, Q, H = q_BKQH.shape
    S = k_BKHS.shape[3]
    # The mask as an additive [B, t, S] bias, written once (the barrier) and broadcast over the
    # heads: the same scores as a select (s + 0 = s; s + MIN = MIN for any |s| < 1e31), and on
    # XLA:CPU the add joins the softmax's fusion where the select wrote the [B, K, Q, S] scores
    # in a pass of its own (the forward 49-52 -> 38-44 ms at the SmolLM2 update's shapes).
    bias_BtS = jax.lax.optimization_barrier(jnp.where(vis_BtS, 0.0, _MIN).astype(jnp.float32))
    s = (_dot(q_BKQH, k_BKHS) * (H**-0.5)).reshape(B, K, Q // R, R, S)
    return (s + bias_BtS[:, None, :, None, :]).reshape(B, K, Q, S)


def _layouts(q_BTNH, k_BTKH, v_BTKH):
    """Queries [B, K, T*R, H], keys [B, K, H, T], values [B, K, T, H] (bf16, row-major)."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q_BKQH = matmul.row_major(q_BTNH.reshape(B, T, K, N // K, H), (0, 2, 1, 3, 4))
    return (
        q_BKQH.reshape(B, K, T * (N // K), H),
        matmul.row_major(k_BTKH, (0, 2, 3, 1)),
        matmul.row_major(v_BTKH, (0, 2, 1, 3)),
    )


def _from_rows(o_BKQH, N):
    """[B, K, T*R, H] -> [B, T, N, H]."""
    B, K, Q, H = o_BKQH.shape
    T = Q // (N // K)
    return o_BKQH.reshape(B, K, T, N // K, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attend_causal(q_BTNH, k_BTKH, v_BTKH, visible_BTT, block):
    """Causal GQA attention (query head n uses kv head n // R), float32 softmax, the result in
    the inputs' dtype; queries that see no key (padding) get a uniform distribution.

    Args:
      q_BTNH, k_BTKH, v_BTKH: bfloat16 queries, keys, values.
      visible_BTT: bool, query t sees key s (s <= t, as `attention.Mask.dense` gives).
      block: the query block in tokens (static).
    """
    return _forward(q_BTNH, k_BTKH, v_BTKH, visible_BTT, block)[0]


def _forward(q_BTNH, k_BTKH, v_BTKH, visible_BTT, block):
    N, T = q_BTNH.shape[2], q_BTNH.shape[1]
    R = N // k_BTKH.shape[2]
    q_BKQH, k_BKHS, v_BKSH = _layouts(q_BTNH, k_BTKH, v_BTKH)
    outs, lses = [], []
    for start, end in _blocks(T, block):
        s = _scores(q_BKQH[:, :, start * R : end * R], k_BKHS[..., :end],
                    visible_BTT[:, start:end, :end], R)  # fmt: skip
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = (e / total).astype(v_BKSH.dtype)
        outs.append(_dot(p, v_BKSH[:, :, :end]).astype(v_BKSH.dtype))
        lses.append(m + jnp.log(total))
    o_BKQH = jnp.concatenate(outs, axis=2)
    return _from_rows(o_BKQH, N), (q_BKQH, k_BKHS, v_BKSH, visible_BTT, lses)


def _bwd(block, res, do_BTNH):
    q_BKQH, k_BKHS, v_BKSH, visible_BTT, lses = res
    B, K, Q, H = q_BKQH.shape
    T = k_BKHS.shape[3]
    R, N, dt, scale = Q // T, Q // T * K, q_BKQH.dtype, H**-0.5
    do_BKQH = matmul.row_major(do_BTNH.astype(dt).reshape(B, T, K, R, H), (0, 2, 1, 3, 4))
    do_BKQH = do_BKQH.reshape(B, K, Q, H)
    k_BKSH = matmul.row_major(k_BKHS, (0, 1, 3, 2))
    v_BKHS = matmul.row_major(v_BKSH, (0, 1, 3, 2))
    dqs = []
    dk_BKHS = dvT_BKHS = jnp.zeros((B, K, H, T), jnp.float32)
    for (start, end), lse in zip(_blocks(T, block), lses, strict=True):
        q = q_BKQH[:, :, start * R : end * R]
        do = do_BKQH[:, :, start * R : end * R]
        p = jnp.exp(_scores(q, k_BKHS[..., :end], visible_BTT[:, start:end, :end], R) - lse)
        dp = _dot(do, v_BKHS[..., :end])
        ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))).astype(dt)
        dqs.append((_dot(ds, k_BKSH[:, :, :end]) * scale).astype(dt))
        pad = ((0, 0), (0, 0), (0, 0), (0, T - end))
        dk_BKHS = dk_BKHS + jnp.pad(_dot(matmul.row_major(q, (0, 1, 3, 2)), ds), pad)
        dvT_BKHS = dvT_BKHS + jnp.pad(_dot(matmul.row_major(do, (0, 1, 3, 2)), p.astype(dt)), pad)
    dq_BTNH = _from_rows(jnp.concatenate(dqs, axis=2), N)
    dk_BTKH = matmul.row_major((dk_BKHS * scale).astype(dt), (0, 3, 1, 2))
    dv_BTKH = matmul.row_major(dvT_BKHS.astype(dt), (0, 3, 1, 2))
    return dq_BTNH, dk_BTKH, dv_BTKH, None


attend_causal.defvjp(_forward, _bwd)
