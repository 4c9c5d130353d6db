"""Softmax attention with grouped-query heads, for training, log-probs and prefill.

`self_attention` is the entry point of causal self-attention (training, log-probs): who sees
whom comes as a `Mask` of per-token segment ids, and `ModelConfig.attention_impl` picks the
implementation:

  * "xla": `attend_causal` over the dense [B, T, T] mask the segments give; float32 scores of
    a whole row (T^2 per head), the key blocks above the diagonal skipped. At bfloat16 on
    XLA:CPU, `lowp_attention.attend_causal`: the same blocks and float32 softmax, its products
    and their derivatives in the one form XLA:CPU runs on its bf16 kernels (AMX, AVX512-BF16).
  * "blockwise": `blockwise.attend`, online softmax over key blocks with a custom backward;
    memory linear in T, any backend.
  * "cudnn": cuDNN's fused (flash) attention through `jax.nn.dot_product_attention`, NVIDIA
    GPUs only, bfloat16 / float16 compute, head dims up to 128 in multiples of 8 (cuDNN's
    limits). The segments go in as a dense [B, 1, T, T] mask, which cuDNN reads as an additive
    bias in the compute dtype: T^2 x 2 bytes a row (19 MB at 3,072 tokens, 2 GiB at 32K), not
    per head, and no float32 scores.
  * "splash": JAX's Pallas TPU flash-attention kernel (`splash.attend`: two splash calls, the
    own segment and a response's prompt, merged by log-sum-exp); TPUs, and Pallas interpret
    mode on the CPU (for tests: far too slow to train with), not GPUs.
  * "auto": "splash" on a TPU; on a GPU "cudnn" where its limits hold, else "blockwise"; on
    the CPU "blockwise" from `AUTO_BLOCKWISE_FROM` tokens a row, else "xla". It never picks an
    implementation that cannot run; asking for one explicitly where it cannot is an error that
    names model.attention_impl (`unsupported`).

`attend` is the plain form (any visibility mask, float32 softmax); decode and chunked prefill
into a partly filled KV cache (grpo_jax/models/decode.py) use it with their own masks, while a
prefill of a whole fresh cache (the sampler's) goes through `self_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.models import blockwise, lowp_attention, matmul, splash
from grpo_jax.models import config as config_lib

IMPLEMENTATIONS = config_lib.ATTENTION_IMPLS

# "auto" on the CPU: rows of at least this many tokens take the blockwise path (see
# `resolve`); on other backends always (it is the only linear-memory one there yet).
AUTO_BLOCKWISE_FROM = 2048


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """Who sees whom in causal self-attention over rows of T tokens.

    Query t sees key s when s <= t, segment[s] > 0, and segment[s] is t's segment or t's
    prefix. Padded batches (`padded`): segment = the attention mask, prefix = 1, so every
    query sees the real keys up to it. Packed rows (`packed`): one segment per prompt and per
    response, a response's prefix is its prompt's segment, 0 is padding.

    Attributes:
      segments_BT: int32 [B, T].
      prefixes_BT: int32 [B, T].
      shared_prefixes: static; False when each query sees exactly the earlier keys of its
        prefix segment (`padded`: prefix 1, the real tokens), so implementations that take the
        prefixes as a second key set (splash) need one set only.
    """

    segments_BT: jax.Array
    prefixes_BT: jax.Array
    shared_prefixes: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def padded(cls, attention_mask_BT) -> "Mask":
        seg = attention_mask_BT.astype(jnp.int32)
        return cls(seg, jnp.ones_like(seg), shared_prefixes=False)

    @classmethod
    def packed(cls, segments_BT, prefixes_BT=None) -> "Mask":
        seg = segments_BT.astype(jnp.int32)
        return cls(seg, seg if prefixes_BT is None else prefixes_BT.astype(jnp.int32))

    def dense(self):
        """bool [B, T, T]: query t sees key s."""
        idx_T = jnp.arange(self.segments_BT.shape[1], dtype=jnp.int32)
        return blockwise.visible(self.segments_BT, self.prefixes_BT, idx_T, self.segments_BT,
                                 idx_T)  # fmt: skip


CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128


def unsupported(impl: str, *, backend: str, dtype=None, head_dim: int | None = None) -> str | None:
    """Why `impl` cannot run on `backend` at this compute dtype / head dim; None when it can
    (None for the unknown ones too: a missing dtype or head dim is not checked)."""
    if impl == "splash":
        if backend == "gpu":
            return (
                "splash attention is a Pallas TPU kernel (it runs on TPUs, and in interpret "
                "mode on the CPU), and JAX's backend here is 'gpu'"
            )
        return None
    if impl != "cudnn":
        return None
    if backend != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU, and JAX's backend here is {backend!r}"
    if dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return (
            f"cuDNN's fused attention takes {' or '.join(CUDNN_DTYPES)} inputs, and "
            f"model.dtype is {jnp.dtype(dtype).name}"
        )
    if head_dim is not None and (head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM):
        return (
            f"cuDNN's fused attention takes head dims up to {CUDNN_MAX_HEAD_DIM} in multiples "
            f"of 8, and the model's is {head_dim}"
        )
    return None


def resolve(
    impl: str, length: int, backend: str | None = None, *, dtype=None, head_dim=None
) -> str:
    """The implementation `impl` runs for rows of `length` tokens on `backend` (default: JAX's)
    at compute `dtype` and `head_dim` (unchecked when None).

    "auto" is "splash" on a TPU, "cudnn" on a GPU where cuDNN's limits hold and "blockwise"
    where they do not, and on the CPU "blockwise" from AUTO_BLOCKWISE_FROM tokens a row: below
    it the dense path is as fast there (SmolLM2, rows of 1,024: docs/performance.md) and its
    scores are small.
    An explicit implementation that cannot run here raises ValueError naming
    model.attention_impl, the reason and what "auto" would run.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"model.attention_impl={impl!r}: expected one of {IMPLEMENTATIONS}"
        )
    backend = backend or jax.default_backend()
    if impl == "auto":
        if backend == "tpu":
            return "splash"
        if backend == "gpu" and not unsupported(
            "cudnn", backend=backend, dtype=dtype, head_dim=head_dim
        ):
            return "cudnn"
        if backend != "cpu" or length >= AUTO_BLOCKWISE_FROM:
            return "blockwise"
        return "xla"
    reason = unsupported(impl, backend=backend, dtype=dtype, head_dim=head_dim)
    if reason:
        instead = resolve("auto", length, backend, dtype=dtype, head_dim=head_dim)
        raise ValueError(
            f"model.attention_impl={impl!r} cannot run here: {reason}; "
            f"model.attention_impl=auto would run {instead!r}"
        )
    return impl


def self_attention(q_BTNH, k_BTKH, v_BTKH, mask: Mask, impl: str = "auto"):
    """Causal self-attention with GQA (query head n uses kv head n // (N / K)).

    Args:
      q_BTNH, k_BTKH, v_BTKH: queries, keys, values (rotary-embedded), compute dtype.
      mask: the rows' segments (`Mask`).
      impl: one of IMPLEMENTATIONS (`ModelConfig.attention_impl`).

    Returns:
      o_BTNH. Rows a query sees nothing of (padding) are finite and implementation-specific.
    """
    T, H = q_BTNH.shape[1], q_BTNH.shape[3]
    impl = resolve(impl, T, dtype=q_BTNH.dtype, head_dim=H)
    if impl == "blockwise":
        return blockwise.attend(q_BTNH, k_BTKH, v_BTKH, mask.segments_BT, mask.prefixes_BT)
    if impl == "cudnn":
        return fused_attention(q_BTNH, k_BTKH, v_BTKH, mask.dense(), kernel="cudnn")
    if impl == "splash":
        return splash.attend(q_BTNH, k_BTKH, v_BTKH, mask.segments_BT, mask.prefixes_BT,
                             prefixes=mask.shared_prefixes)  # fmt: skip
    if q_BTNH.dtype == jnp.bfloat16 and matmul.cpu_kernels():
        return lowp_attention.attend_causal(q_BTNH, k_BTKH, v_BTKH, mask.dense(), causal_block(T))
    k_BKHS, v_BKSH = k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3)
    return attend_causal(q_BTNH, k_BKHS, v_BKSH, mask.dense())


def fused_attention(q_BTNH, k_BTKH, v_BTKH, visible_BTT, *, kernel: str):
    """`jax.nn.dot_product_attention` with `implementation=kernel` ("cudnn"; "xla" runs the
    same call anywhere, which the tests compare with `attend_causal`): GQA by the kernel,
    the visibility as a [B, 1, T, T] mask, the 1/sqrt(H) scale. Queries that see no key
    (padding) get zeros, whatever the kernel leaves there."""
    out_BTNH = jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=visible_BTT[:, None], implementation=kernel
    )
    seen_BT = jnp.any(visible_BTT, axis=-1)
    return jnp.where(seen_BT[:, :, None, None], out_BTNH, jnp.zeros((), out_BTNH.dtype))


def attend(q_BTNH, k_BKHS, v_BKSH, visible_BTS):
    """Softmax attention with GQA (query head n uses kv head n // R); float32 softmax.

    The R = N/K query heads of one kv head and the T queries are folded into one query axis, so
    both products are plain batched matmuls over (B, K) that read the cache in its stored
    layouts, keys [B,K,H,S] and values [B,K,S,H] (XLA CPU emits slow loops for the 5-d GQA
    einsum, and decode is T=1). Fully masked rows (padding queries) get a uniform distribution
    instead of NaN.
    """
    B, T, N, H = q_BTNH.shape
    K, S = k_BKHS.shape[1], k_BKHS.shape[3]
    R = N // K
    q_BKRTH = q_BTNH.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4)
    q_BKQH = q_BKRTH.reshape(B, K, R * T, H)  # Q = R*T query rows per kv head
    batch_dims = ((0, 1), (0, 1))
    s_BKQS = jax.lax.dot_general(
        q_BKQH, k_BKHS, (((3,), (2,)), batch_dims), preferred_element_type=jnp.float32
    ) * (H**-0.5)
    s_BKRTS = s_BKQS.reshape(B, K, R, T, S)
    s_BKRTS = jnp.where(visible_BTS[:, None, None], s_BKRTS, jnp.finfo(jnp.float32).min)
    p_BKQS = jax.nn.softmax(s_BKRTS, axis=-1).astype(v_BKSH.dtype).reshape(B, K, R * T, S)
    o_BKQH = jax.lax.dot_general(p_BKQS, v_BKSH, (((3,), (2,)), batch_dims))
    o_BTKRH = o_BKQH.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)
    return o_BTKRH.reshape(B, T, N, H)


CAUSAL_BLOCK = 128  # query block of _attend_causal (tokens); at most MAX_CAUSAL_BLOCKS blocks


MAX_CAUSAL_BLOCKS = 16


def causal_block(T: int) -> int:
    """The query block (tokens) of causal attention over rows of T tokens: CAUSAL_BLOCK, or
    more where T needs more than MAX_CAUSAL_BLOCKS of them."""
    return max(CAUSAL_BLOCK, -(-T // MAX_CAUSAL_BLOCKS))


def attend_causal(q_BTNH, k_BKHS, v_BKSH, visible_BTS):
    """`_attend` for causal self-attention (S = T, no query sees a later key): query block i of
    b tokens attends to keys [0, (i + 1) b) only, so the scores, the softmax and both products
    skip the key blocks above the diagonal, (n - 1) / 2n of the work for n blocks. The result is
    `_attend`'s exactly: the skipped keys are the ones `visible_BTS` masks anyway.

    On SmolLM2 rows of 768 tokens (GSM8K packing) the attention's forward + backward per layer
    took 411 -> 224 ms on the 2-core CPU. b = max(CAUSAL_BLOCK, T / MAX_CAUSAL_BLOCKS) bounds the
    unrolled blocks a layer compiles.
    """
    T = q_BTNH.shape[1]
    b = causal_block(T)
    if T <= b:
        return attend(q_BTNH, k_BKHS, v_BKSH, visible_BTS)
    outs = []
    for start in range(0, T, b):
        end = min(T, start + b)
        outs.append(
            attend(
                q_BTNH[:, start:end],
                k_BKHS[..., :end],
                v_BKSH[:, :, :end],
                visible_BTS[:, start:end, :end],
            )
        )
    return jnp.concatenate(outs, axis=1)
