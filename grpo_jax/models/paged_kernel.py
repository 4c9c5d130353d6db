"""Decode attention over the paged KV pool with JAX's Pallas TPU paged-attention kernel.

`attend` is one decode step's attention (one query token per sequence) for
`paged.paged_forward(..., attention="pallas")`. Its kernel body is the one of
`jax.experimental.pallas.ops.tpu.paged_attention` (jax 0.10.2): per sequence and kv head it
reads the sequence's pages from HBM in blocks of `pages_per_compute_block` pages (double
buffered DMAs, only the blocks below the sequence's length) and runs an online softmax over
them; the R = N / K query heads of a kv head share each block (head n reads kv head n // R, as
the model's GQA).

Layout. The kernel reads keys and values as [K, num_pages, page_size, H] a layer, so the pool
the engine builds for it has that layout (`paged.init_pool(layout="pallas")`): transposing the
XLA layout (keys [num_pages, K, H, page_size]) on every call would copy the whole pool, every
layer, every decode step. Prefill chunks run the XLA attention on that layout.

Masks. The kernel admits the first `length` slots of a page table, nothing else. A decode
row's keys are two such runs (`Spans`): its group's shared prompt pages (the prompt but its
last token: the last shared page is filled only up to the prompt's length) and its own pages
(the last prompt token, then its response). So `attend` runs the kernel twice, once per run,
and merges the two by their log-sum-exps; the public `paged_attention` returns no log-sum-exp,
so the kernel is called here with its own `pallas_call` (the wrapper's unquantized,
non-megacore form), which the tests run in interpret mode so an API change fails there.

Precision. The kernel reads keys and values as bfloat16 (its loads convert unquantized pages
with `quantization_utils`' default dtype), then computes scores, softmax and the value sum in
float32: exact for a bfloat16 pool, a bfloat16 rounding of K and V for a float32 one (why
"auto" picks it for bfloat16 pools only, `resolve`). In Pallas TPU interpret mode on the CPU
the result equals the XLA attention over the pool rounded to bfloat16 within float32 rounding
(tests/test_paged_kernel.py); against a float32 pool the outputs of unit-scale values differ
by up to about 6e-3, bfloat16's rounding.

Meshes. XLA cannot partition a Mosaic kernel ("Mosaic kernels cannot be automatically
partitioned"), so under a mesh `attend` runs it inside a `jax.shard_map` over every mesh axis:
each device runs the kernel on its own block. The engine's shard axis D (the leading axis it
vmaps its one-shard programs over, `spmd_axis_name`) becomes a manual axis through shard_map's
batching rule, and the KV heads split over the rules' `act_kv_heads` axis (the query heads
over the same axis, so a device's query heads read its own kv heads, GQA's n // R). A decode
step's attention then moves no pool bytes between devices: compiled by libtpu for a v5p-16's
8 chips (4 shards x tensor 2, Qwen3-8B's heads) its arguments are each device's own pages and
it has no collective (tests/test_paged_kernel.py).

Platforms: TPUs; the CPU in Pallas TPU interpret mode (tests; far too slow to sample with); not
GPUs (`resolve`). TPU's `ragged_paged_attention` (prefill and decode in one kernel) would be
the natural one, but in jax 0.10.2 it fails in interpret mode on the CPU, under
`force_tpu_interpret_mode` too (`AttributeError: 'ReshapeTransform' object has no attribute
'indices'`), so it cannot be tested here.

Shapes: B sequences, N query heads, K kv heads, R = N / K, H head dim, M pages a table, P
page size.
"""

from __future__ import annotations

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as _pak

IMPLEMENTATIONS = ("auto", "xla", "pallas")
BLOCK_TOKENS = 128  # key slots a compute block reads (pages_per_compute_block = this / P)


def resolve(attention: str, backend: str | None = None, *, kv_dtype) -> str:
    """The decode attention `attention` runs on `backend` (default: JAX's) over a pool of
    `kv_dtype`: "xla" or "pallas".

    "auto" is "pallas" on a TPU when the pool is bfloat16, else "xla": the kernel reads K and V
    as bfloat16, so on a float32 pool it would round them (asked for explicitly, it does).
    Over data shards and a tensor axis the kernel runs per device (`attend`, module doc).
    "pallas" off the TPU runs in interpret mode on the CPU; on a GPU it is an error.
    """
    if attention not in IMPLEMENTATIONS:
        raise ValueError(f"attention={attention!r}: expected one of {IMPLEMENTATIONS}")
    backend = backend or jax.default_backend()
    if attention == "auto":
        bf16 = jnp.dtype(kv_dtype) == jnp.bfloat16
        return "pallas" if backend == "tpu" and bf16 else "xla"
    if attention == "pallas" and backend == "gpu":
        raise ValueError(
            "attention='pallas' is JAX's Pallas TPU paged-attention kernel (TPUs, and "
            "interpret mode on the CPU), and JAX's backend here is 'gpu'; 'auto' runs 'xla'"
        )
    return attention


@flax.struct.dataclass
class Spans:
    """A decode step's keys as two runs of each row's page table: slots [0, shared_len) (the
    group's shared prompt pages) and `own_len` slots from page `own_start` on (the row's own
    pages). Idle rows: both lengths 0.

    Attributes:
      shared_len_B, own_start_B, own_len_B: int32.
    """

    shared_len_B: jax.Array
    own_start_B: jax.Array
    own_len_B: jax.Array

    def mask(self, num_slots: int, page_size: int):
        """bool [B, num_slots]: the slots the spans admit (the XLA attention's mask)."""
        s = jnp.arange(num_slots, dtype=jnp.int32)[None]
        own0_B1 = (self.own_start_B * page_size)[:, None]
        return (s < self.shared_len_B[:, None]) | (
            (s >= own0_B1) & (s < own0_B1 + self.own_len_B[:, None])
        )


def attend(q_BNH, k_KNPH, v_KNPH, page_table_BM, spans: Spans, *, interpret=None):
    """One decode step's softmax attention over each row's `spans` of its pages.

    Args:
      q_BNH: queries (rotary-embedded), any float dtype; scaled by H**-0.5 here.
      k_KNPH, v_KNPH: one layer of a `layout="pallas"` pool, [K, num_pages, P, H].
      page_table_BM: int32, each row's pages in logical order.
      spans: the slots each row attends to.
      interpret: Pallas TPU interpret mode; None = unless JAX's backend is a TPU.

    Returns:
      float32 [B, N, H]; rows that attend to no slot (idle) get zeros.
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    local = functools.partial(_attend_local, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q_BNH, k_KNPH, v_KNPH, page_table_BM, spans)
    # Every mesh axis manual (a shard axis D of a caller's vmap joins through shard_map's
    # batching rule); heads split as the rules split the pool's kv heads.
    heads = nn.logical_to_mesh_axes(("act_kv_heads",))[0]
    Ps = jax.sharding.PartitionSpec
    rows = Ps()
    per_device = jax.shard_map(
        local, in_specs=(Ps(None, heads), Ps(heads), Ps(heads), rows, rows),
        out_specs=Ps(None, heads), check_vma=False,  # the kernel's outputs carry no vma
    )  # fmt: skip
    return per_device(q_BNH, k_KNPH, v_KNPH, page_table_BM, spans)


def _attend_local(q_BNH, k_KNPH, v_KNPH, page_table_BM, spans: Spans, *, interpret):
    """`attend` on one device's rows and heads."""
    B, M = page_table_BM.shape
    q_BNH = q_BNH.astype(jnp.float32) * (q_BNH.shape[-1] ** -0.5)  # the kernel does not scale
    # The own run as a table of its own: row b's pages from own_start on (past the end: the
    # last page, read by a compute block but masked).
    shift_BM = spans.own_start_B[:, None] + jnp.arange(M, dtype=jnp.int32)[None]
    shift_BM = jnp.minimum(shift_BM, M - 1)
    own_table_BM = jnp.take_along_axis(page_table_BM, shift_BM, axis=1)
    runs = [(page_table_BM, spans.shared_len_B), (own_table_BM, spans.own_len_B)]
    outs = [_attend_lse(q_BNH, k_KNPH, v_KNPH, t, n, interpret=interpret) for t, n in runs]
    (o1, m1, l1), (o2, m2, l2) = outs
    # Merge the two softmaxes: o = (o1 l1 e^(m1 - m) + o2 l2 e^(m2 - m)) / (the weights' sum);
    # an empty run has m = -inf and l = 0.
    m = jnp.maximum(m1, m2)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w1, w2 = l1 * jnp.exp(m1 - m), l2 * jnp.exp(m2 - m)
    total = w1 + w2
    o_BNH = (o1 * w1[..., None] + o2 * w2[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return o_BNH


def _attend_lse(q_BNH, k_KNPH, v_KNPH, page_table_BM, lengths_B, *, interpret):
    """The kernel over the first lengths_B slots of each table: (o [B, N, H], the running max
    m [B, N] and sum l [B, N] of its softmax: log-sum-exp = m + log l), all float32.

    `paged_attention.paged_attention` without the megacore and quantized cases, returning m and
    l, which it drops. Queries go in float32 as [B, N, 1, H] when R is not a multiple of 8 (the
    wrapper's layout hint: <1x128> tiles) and [B, N, H] when it is."""
    B, N, H = q_BNH.shape
    K, _, P, _ = k_KNPH.shape
    R = N // K
    block = max(1, min(BLOCK_TOKENS // P, page_table_BM.shape[1]))
    M = -(-page_table_BM.shape[1] // block) * block  # a whole number of compute blocks
    table_BM = jnp.pad(page_table_BM, ((0, 0), (0, M - page_table_BM.shape[1])))
    if R % 8:
        q = q_BNH.reshape(B, N, 1, H)
        spec = pl.BlockSpec((None, R, None, H), lambda c, b, h, *_: (b, h, 0, 0))
    else:
        q = q_BNH
        spec = pl.BlockSpec((None, R, H), lambda c, b, h, *_: (b, h, 0))
    buf = pltpu.VMEM((2, block, P, H), k_KNPH.dtype)  # double buffered pages
    kernel = functools.partial(
        _pak.paged_flash_attention_kernel_inline_seq_dim, pages_per_sequence=M, batch_size=B,
        pages_per_compute_block=block, mask_value=_pak.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None, megacore_mode=None,
    )  # fmt: skip
    stat = jax.ShapeDtypeStruct((*q.shape[:-1], 1), jnp.float32)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            # lengths, the tables, the DMA buffer index, the first-block flag
            num_scalar_prefetch=4,
            in_specs=[spec, any_, None, any_, None],
            out_specs=[spec, spec, spec],
            grid=(1, B, K),
            scratch_shapes=(buf, None, buf, None, pltpu.SemaphoreType.DMA((2,)),
                            pltpu.SemaphoreType.DMA((2,))),  # fmt: skip
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32), stat, stat],
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        lengths_B.astype(jnp.int32), table_BM.reshape(-1), jnp.zeros((1,), jnp.int32),
        jnp.ones((1,), jnp.int32), q, k_KNPH, None, v_KNPH, None,
    )  # fmt: skip
    return o.reshape(B, N, H), m.reshape(B, N), l.reshape(B, N)
