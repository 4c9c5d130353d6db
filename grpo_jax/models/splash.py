"""Splash attention (JAX's Pallas TPU flash-attention kernel) for the model's segment masks.

Splash takes a static mask (here causal) and *equality* segment ids: query t sees key s when
their ids are equal. The model's rule is wider (`attention.Mask`): a packed response also sees
its group's prompt, a segment of its own. So each query's softmax runs over two key sets, each
one splash call:

  * own: ids = segments, query and key alike (a prompt, a response, a padded row's tokens;
    padding (0) queries see no key here);
  * prefix: query ids = the prefix segment where it differs from the own one (-1, no key,
    elsewhere), key ids = segments: a response's keys in its prompt.

The two calls' outputs merge by their log-sum-exps (o = o1 w1 + o2 w2, w = exp(lse - lse_12)).
Splash differentiates neither its log-sum-exp nor a merge, so the merge has its own VJP: the
gradient of one softmax over the union, restricted to one key set, is exactly splash's
backward of that set run with the merged output and log-sum-exp (FlashAttention's backward
needs only o, lse and dO per query row), so dq is the sum of the two backwards' and dk, dv
theirs. That reuses splash's private forward and backward (`_splash_attention_forward`,
`_splash_attention_bwd` of jax 0.10); tests/test_attention.py runs them in Pallas interpret
mode against the dense path on every layout, so an API change fails there.

Cost: two passes over the causal blocks, twice the attention FLOPs of one flash pass (splash's
block sparsity comes from the static mask; the segment ids skip no block). Padded batches
(`attention.Mask.padded`: the update without packing, the sampler's prefill) have no second
key set and take one splash call with splash's own backward. Memory: linear in
the row, as the blockwise kernel. Rows are padded to a multiple of 128 tokens (splash's block
unit) with ids no query or key shares.

Off the TPU it runs in interpret mode (`interpret=None`: when JAX's backend is not a TPU),
which the tests use on CPU; it is far too slow for training there, so "auto" never picks it.

Shapes: B rows, T tokens, N query heads, K kv heads, R = N / K, H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _sm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as _mi

LANE = 128  # splash's block unit: rows are padded to a multiple of it
BLOCKS = (512, 256, 128)  # the largest that divides the padded row is the block size
_NO_QUERY, _NO_KEY = -1, -2  # ids of the prefix call's non-responses and of the padding keys


@functools.lru_cache(maxsize=None)
def _kernel(T: int, R: int, interpret: bool) -> _sk.SplashAttentionKernel:
    """The causal MQA kernel for padded rows of T tokens and R query heads per kv head.

    `make_splash_mqa`'s kernel, but its block tables (splash's own,
    `splash_attention_mask_info.process_mask`) stay NumPy arrays: they enter each program as
    constants, so the cached kernel holds no trace's tracers and building it runs nothing on a
    device. (`make_splash_mqa` turns them into device arrays at once, which fails under a mesh
    of devices this process cannot run on: the planner's TPU topology, compiled ahead of
    time.) With every block size equal, the dq tables are the forward's.
    """
    b = next(b for b in BLOCKS if T % b == 0)
    sizes = _sk.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
        block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    mask = _sm.MultiHeadMask([_sm.CausalMask((T, T))] * R)
    shards = {"downcast_smem_data": True, "head_shards": 1, "q_seq_shards": 1}
    fwd, mask_function = _mi.process_mask(mask, (b, b), **shards)
    dkv, _ = _mi.process_mask_dkv(mask, (b, b), shrink_grid=True, **shards)
    return _sk.SplashAttentionKernel(
        fwd, fwd, dkv, block_sizes=sizes, is_mqa=True, save_residuals=False,
        mask_value=_sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
        residual_checkpoint_name=None, mask_function=mask_function, interpret=interpret,
    )  # fmt: skip


def _forward(kernel, q_RTH, k_TH, v_TH, ids):
    kw = kernel.kwargs
    return _sk._splash_attention_forward(
        kernel.fwd_mask_info, q_RTH, k_TH, v_TH, ids, None,
        mask_value=kw["mask_value"], is_mqa=True, block_sizes=kw["block_sizes"],
        residual_checkpoint_name=None, save_residuals=True,
        mask_function=kw["mask_function"], attn_logits_soft_cap=None,
        interpret=kw["interpret"],
    )  # fmt: skip


def _backward(kernel, q_RTH, k_TH, v_TH, ids, o_RTH, lse_RT, do_RTH):
    kw = kernel.kwargs
    res = (q_RTH, k_TH, v_TH, ids, None, o_RTH, lse_RT, kernel.dq_mask_info,
           kernel.dkv_mask_info)  # fmt: skip
    grads = _sk._splash_attention_bwd(
        False, kw["mask_value"], True, kw["block_sizes"], None, kw["mask_function"], None,
        kw["interpret"], res, do_RTH,
    )  # fmt: skip
    return grads[3:6]


def _merge(o1, lse1, o2, lse2):
    lse = jnp.logaddexp(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - lse)[..., None], jnp.exp(lse2 - lse)[..., None]
    o = o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2
    return o.astype(o1.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _two_sets(kernel, q_RTH, k_TH, v_TH, own, prefix):
    """Causal attention of one (row, kv head) over the union of the `own` and `prefix` key
    sets (splash SegmentIds each)."""
    o, _ = _two_sets_fwd(kernel, q_RTH, k_TH, v_TH, own, prefix)
    return o


def _two_sets_fwd(kernel, q_RTH, k_TH, v_TH, own, prefix):
    o1, (lse1,) = _forward(kernel, q_RTH, k_TH, v_TH, own)
    o2, (lse2,) = _forward(kernel, q_RTH, k_TH, v_TH, prefix)
    o, lse = _merge(o1, lse1, o2, lse2)
    return o, (q_RTH, k_TH, v_TH, own, prefix, o, lse)


def _two_sets_bwd(kernel, res, do_RTH):
    q, k, v, own, prefix, o, lse = res
    dq1, dk1, dv1 = _backward(kernel, q, k, v, own, o, lse, do_RTH)
    dq2, dk2, dv2 = _backward(kernel, q, k, v, prefix, o, lse, do_RTH)
    return dq1 + dq2, dk1 + dk2, dv1 + dv2, None, None


_two_sets.defvjp(_two_sets_fwd, _two_sets_bwd)


def attend(
    q_BTNH, k_BTKH, v_BTKH, segments_BT, prefixes_BT, *, prefixes: bool = True,
    interpret: bool | None = None,
):  # fmt: skip
    """Causal self-attention with GQA under `attention.Mask`'s rule, by splash.

    Args:
      q_BTNH, k_BTKH, v_BTKH: queries, keys, values (compute dtype; the 1/sqrt(H) scale is
        applied to the queries in float32).
      segments_BT, prefixes_BT: int32 segment and prefix ids (`attention.Mask`).
      prefixes: False when each query sees exactly the earlier keys of its prefix segment
        (padded batches, `Mask.shared_prefixes`): one splash call (query ids = the prefixes,
        key ids = the segments), splash's own backward.
      interpret: Pallas interpret mode; None = unless JAX's backend is a TPU.

    Returns:
      o_BTNH; queries that see no key get finite, unspecified values.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    R = N // K
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    Tp = -(-T // LANE) * LANE
    pad = Tp - T
    seg, pre = segments_BT.astype(jnp.int32), prefixes_BT.astype(jnp.int32)

    def ids(x_BT, fill):  # padded to Tp with an id nothing else carries
        return jnp.pad(x_BT, ((0, 0), (0, pad)), constant_values=fill)

    own_kv = ids(seg, _NO_KEY)
    if prefixes:  # own segment, then a response's prompt as the second key set
        own_q = ids(jnp.where(seg > 0, seg, _NO_QUERY), _NO_QUERY)
        pre_q = ids(jnp.where(pre != seg, pre, _NO_QUERY), _NO_QUERY)
    else:  # padded: each query sees its prefix segment's keys, one set
        own_q = pre_q = ids(pre, _NO_QUERY)
    scale = np.float32(H**-0.5)
    q = (q_BTNH.astype(jnp.float32) * scale).astype(q_BTNH.dtype)
    q_BKRTH = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, Tp, K, R, H)
    q_BKRTH = q_BKRTH.transpose(0, 2, 3, 1, 4)
    k_BKTH = jnp.pad(k_BTKH, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    v_BKTH = jnp.pad(v_BTKH, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    kernel = _kernel(Tp, R, bool(interpret))

    def one(q_RTH, k_TH, v_TH, own_q_T, own_kv_T, pre_q_T):
        own = _sk.SegmentIds(q=own_q_T, kv=own_kv_T)
        if not prefixes:
            return kernel(q_RTH, k_TH, v_TH, own)
        prefix = _sk.SegmentIds(q=pre_q_T, kv=own_kv_T)
        return _two_sets(kernel, q_RTH, k_TH, v_TH, own, prefix)

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None, None))
    o_BKRTH = jax.vmap(per_head)(q_BKRTH, k_BKTH, v_BKTH, own_q, own_kv, pre_q)
    o_BTNH = o_BKRTH.transpose(0, 3, 1, 2, 4).reshape(B, Tp, N, H)
    return o_BTNH[:, :T]
