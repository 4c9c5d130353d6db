"""A paged KV cache: a fixed pool of pages and the forward pass that reads and writes it.

`KVPool` holds every layer's keys and values in `num_pages` pages of `page_size` token slots
(vLLM's blocks). A sequence owns a list of pages, its *page table*; its logical slot j lives in
page `page_table[j // page_size]`, column `j % page_size`. Pages are shared by reference: the
n rows of a GRPO group point at the same prompt pages. Page `TRASH_PAGE` is never handed out:
writes of idle slots and padding tokens go there, and no mask ever admits it.

`paged_forward` runs T tokens of each of B sequences through the model over the pool: it writes
each token's key and value at its slot, then attends over the pages of the sequence's table
that `key_valid_BTS` admits. It is the decode step (T = 1) and a chunk of a prompt's prefill
(T = chunk) alike, in the per-layer, feature-major form of ``decode._decode_layers``
(``DecodeParams``, one buffer per layer so a decode loop updates the pool in place).

The attention (`attention=`): "xla" gathers the sequence's pages (an XLA gather) and runs one
softmax over them in float32, on every platform and for any mask. "pallas" (decode steps, T = 1)
is JAX's Pallas TPU paged-attention kernel (`paged_kernel`): it reads only the pages below
each row's two runs of slots (`paged_kernel.Spans`, the shared prompt and the row's own) and
needs the pool in its layout, `init_pool(layout="pallas")`; prefill chunks run "xla" on either
layout. `rollout/paged.py` picks one per platform (`paged_kernel.resolve`).

The XLA attention gathers a copy of every page it reads (docs/rollouts.md measures it). A
decode step reads the pages in `PAGE_BLOCKS` blocks, one block at a time (a loop whose trip
count is the blocks that hold pages some row uses), and merges the blocks' softmax partials by
their log-sum-exps: one program body for every length, where a branch per bucket of page counts
compiled the attention eight times, and a block past a row's slots adds exactly nothing to it,
so a row's attention does not depend on how long the other rows in flight are. In a
decode step given `groups` it runs in the cascade form (`Groups`): a GRPO group's n rows read
their shared prompt pages through one gather, with all n rows' queries in one product, instead
of n gathers of the same pages. With
many rows in flight it runs over `attend_rows` rows at a time (a `lax.scan` over chunks of the
batch, the last one padded with masked rows of the trash page), so each chunk gathers and reads
back a few MiB instead of tens. A row's attention is the same computation either way
(tests/test_paged.py checks it). Measured on the 2-core CPU of docs/rollouts.md: the attention
of 30 layers at 128 rows x 400 slots alone took 1.28 s in one piece and 0.54-0.62 s in chunks
of 16-32 rows; a whole call of 64-128 rows in flight, 4-7 % less at ATTEND_ROWS = 32
(docs/rollouts.md); at 16 rows chunks of 8 were slower, so up to ATTEND_ROWS rows run in one
piece. `rollout/paged.py` chunks on the CPU only (a GPU gathers at its memory bandwidth; a TPU
runs the kernel), and the planner plans the unchunked program.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp

from grpo_jax.models import config as config_lib
from grpo_jax.models import decode, paged_kernel, transformer

TRASH_PAGE = 0  # written by idle slots and padding, never read
ATTEND_ROWS = 32  # the XLA attention's rows a chunk when more are in flight (module doc)


LAYOUTS = ("xla", "pallas")  # KVPool.layout


@flax.struct.dataclass
class KVPool:
    """Keys and values of every layer in pages (a pytree; donate it to the programs).

    Attributes:
      k, v: L arrays each, rotary-embedded keys and values, in `layout`:
        "xla": k [num_pages, K, H, page_size], v [num_pages, K, page_size, H], head dim before
          the slots for the keys (as ``KVCache``: a query's scores read each gathered page
          with the slots contiguous);
        "pallas": k and v [K, num_pages, page_size, H], the Pallas paged-attention kernel's
          (`paged_kernel`: it copies pages of one kv head from HBM).
      layout: static, one of LAYOUTS.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    layout: str = flax.struct.field(pytree_node=False, default="xla")

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[-4] if self.layout == "xla" else self.k[0].shape[-3]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[-1] if self.layout == "xla" else self.k[0].shape[-2]


def init_pool(
    config: config_lib.ModelConfig, num_pages: int, page_size: int, *, dtype=None,
    layout: str = "xla",
) -> KVPool:  # fmt: skip
    """An empty pool (zeros) of `num_pages` pages of `page_size` slots, in `dtype` (default:
    ``decode.cache_dtype(config)``, as ``decode.init_cache``) and `layout` (`KVPool`)."""
    if num_pages < 2 or page_size < 1:
        raise ValueError(
            f"a KV pool needs num_pages >= 2 (page {TRASH_PAGE} is the trash page) and "
            f"page_size >= 1; got {num_pages} and {page_size}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    dtype = decode.cache_dtype(config) if dtype is None else dtype
    K, H, L = config.num_kv_heads, config.head_dim, config.num_layers
    if layout == "pallas":
        k_shape = v_shape = (K, num_pages, page_size, H)
    else:
        k_shape, v_shape = (num_pages, K, H, page_size), (num_pages, K, page_size, H)
    return KVPool(
        k=tuple(jnp.zeros(k_shape, dtype) for _ in range(L)),
        v=tuple(jnp.zeros(v_shape, dtype) for _ in range(L)),
        layout=layout,
    )


def pool_bytes(config: config_lib.ModelConfig, num_pages: int, page_size: int, dtype=None) -> int:
    """The bytes of `init_pool(config, num_pages, page_size, dtype=dtype)`."""
    dtype = jnp.dtype(decode.cache_dtype(config) if dtype is None else dtype)
    per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    return num_pages * page_size * per_slot


@flax.struct.dataclass
class Groups:
    """A decode step's rows grouped by the prompt pages they share (`group_rows`), for the
    cascade form of the XLA attention: each group's shared prompt slots are gathered once and
    attended by all its rows' queries together, each row's own slots alone, and the two merge
    by their log-sum-exps (the cascade attention of FlashInfer and vLLM V1).

    Attributes:
      members_GN: int32 [G, N], the rows of each group (B: no row).
      slot_B: int32 [B], each row's index in members_GN flattened (G * N: none; the row has
        no shared slots).
      use: bool scalar, whether the cascade runs: every row with shared slots has a place,
        and a group's rows share their slots' count (else the plain attention runs).
      own_pages: int32 scalar, the most own pages any row reads (the own part's page blocks).
    """

    members_GN: jax.Array
    slot_B: jax.Array
    use: jax.Array
    own_pages: jax.Array


def group_rows(page_table_BM, spans: paged_kernel.Spans, page_size: int, *, groups: int,
               members: int) -> Groups:  # fmt: skip
    """Rows with shared slots (`spans.shared_len_B` > 0) grouped by their first page, at
    most `groups` groups of `members` rows (`use` is False if they do not fit)."""
    B = page_table_BM.shape[0]
    G, N = groups, members
    has_B = spans.shared_len_B > 0
    key_B = jnp.where(has_B, page_table_BM[:, 0], jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key_B, stable=True)
    key, has, shared_len = key_B[order], has_B[order], spans.shared_len_B[order]
    i = jnp.arange(B, dtype=jnp.int32)
    new = has & ((i == 0) | (key != jnp.roll(key, 1)))
    gid = jnp.cumsum(new, dtype=jnp.int32) - 1
    start = jnp.full((B + 1,), B, jnp.int32).at[jnp.where(new, gid, B)].set(i)[:B]
    head = start[jnp.clip(gid, 0, B - 1)]
    rank = i - head
    use = (jnp.sum(new) <= G) & jnp.all(~has | ((rank < N) & (shared_len == shared_len[head])))
    slot = jnp.where(has & (gid < G) & (rank < N), gid * N + rank, G * N)
    slot_B = jnp.zeros((B,), jnp.int32).at[order].set(slot)
    members_GN = jnp.full((G * N + 1,), B, jnp.int32).at[slot_B].set(i)[: G * N].reshape(G, N)
    own_B = jnp.where(spans.own_len_B > 0, -(-spans.own_len_B // page_size), 1)
    return Groups(members_GN, slot_B, use, jnp.max(own_B))


def paged_forward(
    config: config_lib.ModelConfig,
    params: decode.DecodeParams,
    pool: KVPool,
    tokens_BT,
    positions_BT,
    write_page_BT,
    write_column_BT,
    page_table_BM,
    key_valid_BTS=None,
    pages_used=None,
    *,
    spans: paged_kernel.Spans | None = None,
    attention: str = "xla",
    interpret: bool | None = None,
    routing: bool = False,
    attend_rows: int = 0,
    groups: Groups | None = None,
    shared_pages: int = 0,
):
    """T tokens of each of B sequences through the model over the paged cache.

    Args:
      config: the model config.
      params: ``decode.decode_params`` weights.
      pool: the KV pool; returned with the tokens' keys and values written.
      tokens_BT: int32 token ids.
      positions_BT: int32 rotary positions.
      write_page_BT / write_column_BT: int32, where each token's key and value go
        (`TRASH_PAGE` for tokens that must not be stored).
      page_table_BM: int32 [B, M], the pages each sequence attends over, in logical order: key
        slot s of the gathered sequence is page s // page_size, column s % page_size.
      key_valid_BTS: bool [B, T, S], S = M * page_size: which slots token t attends to (its
        own, written first, included). None for a decode step given `spans`.
      pages_used: optional int32 scalar, how many leading pages of the tables any token
        attends to: the XLA attention then reads the pages in blocks (`block_pages`), only
        those that hold the first `pages_used` (a loop; a row's result does not depend on how
        many blocks run), not all M at once.
      spans: a decode step's (T = 1) slots as `paged_kernel.Spans`, instead of key_valid_BTS;
        "pallas" needs them.
      attention: "xla" or "pallas" (T = 1 only; a `layout="pallas"` pool), see the module doc.
      interpret: the kernel's Pallas interpret mode (`paged_kernel.attend`).
      routing: also return the experts each token was routed to (router replay R3).
      attend_rows: the XLA attention runs over chunks of this many sequences when B is larger
        (module doc; `rollout/paged.py` passes ATTEND_ROWS on the CPU); 0: all B at once.
        The result does not depend on it.
      groups: a decode step's (T = 1, "xla", given `spans`) rows grouped by their shared
        prompt pages (`group_rows`): where `groups.use`, the attention runs in the cascade
        form (`Groups`), reading each group's first `shared_pages` pages once. The same
        attention up to float rounding (two softmax parts merged instead of one).

    Returns:
      (x_DX, pool): the final residual stream feature-major, [D, B * T] (row-major over (B, T);
      ``decode.head_logits_fm`` gives logits), and the updated pool; with `routing`, also
      experts_LmXA, int32 [Lm, B * T, A]: each token's experts in each of the Lm MoE layers
      (Lm = 0 for a dense model).
    """
    c = config
    B, T = tokens_BT.shape
    M = page_table_BM.shape[1]
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    R = N // K
    P = pool.page_size
    S = M * P
    if attention not in ("xla", "pallas"):
        raise ValueError(f"attention={attention!r}: expected 'xla' or 'pallas'")
    if attention == "pallas" and (T != 1 or spans is None or pool.layout != "pallas"):
        raise ValueError(
            "the Pallas kernel runs decode steps (T = 1) given spans over a layout='pallas' "
            f"pool; got T={T}, spans={'given' if spans is not None else None}, "
            f"layout={pool.layout!r}"
        )
    if groups is not None and (attention != "xla" or spans is None or T != 1
                               or not 0 < shared_pages <= M):  # fmt: skip
        raise ValueError(
            "groups (the cascade attention) are for XLA decode steps (T = 1) given spans and "
            f"0 < shared_pages <= {M}; got attention={attention!r}, T={T}, "
            f"shared_pages={shared_pages}"
        )
    if key_valid_BTS is None:
        if spans is None or T != 1:
            raise ValueError("key_valid_BTS is needed unless spans give a decode step's slots")
        key_valid_BTS = spans.mask(S, P)[:, None]
    if key_valid_BTS.shape != (B, T, S):
        raise ValueError(f"key_valid_BTS {key_valid_BTS.shape} must be {(B, T, S)}")
    X = B * T
    if pages_used is not None and pages_used.ndim != 0:
        raise ValueError("pages_used must be a scalar")
    cos_BTH, sin_BTH = transformer.rope_tables(c, positions_BT)
    cos_HX, sin_HX = cos_BTH.reshape(X, H).T, sin_BTH.reshape(X, H).T
    x_DX = decode.embed_fm(c, params, tokens_BT.reshape(X))
    page_X, column_X = write_page_BT.reshape(X), write_column_BT.reshape(X)
    new_k, new_v, experts = [], [], []
    if groups is not None:
        tables = _cascade_tables(page_table_BM, spans, groups, shared_pages, P)

    def out_mlp(w, x_DX, o_XX):
        x_DX, experts_XA = decode.out_mlp_fm_routed(c, w, x_DX, o_XX)
        if experts_XA is not None:
            experts.append(experts_XA)
        return x_DX

    for layer, w in enumerate(params.layers):
        q_NHX, k_KHX, v_KHX = decode.qkv_fm(c, w, x_DX, cos_HX, sin_HX)
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if pool.layout == "pallas":  # [K, pages, P, H]
            k_pool = k_pool.at[:, page_X, column_X, :].set(
                k_KHX.transpose(0, 2, 1).astype(k_pool.dtype)
            )
            v_pool = v_pool.at[:, page_X, column_X, :].set(
                v_KHX.transpose(0, 2, 1).astype(v_pool.dtype)
            )
        else:
            k_pool = k_pool.at[page_X, :, :, column_X].set(
                k_KHX.transpose(2, 0, 1).astype(k_pool.dtype)
            )
            v_pool = v_pool.at[page_X, :, column_X, :].set(
                v_KHX.transpose(2, 0, 1).astype(v_pool.dtype)
            )
        new_k.append(k_pool)
        new_v.append(v_pool)
        if attention == "pallas":
            # Queries [N, H, B] -> [B, N, H]; the kernel's output [B, N, H] -> [N * H, B].
            o_BNH = paged_kernel.attend(
                q_NHX.transpose(2, 0, 1), k_pool, v_pool, page_table_BM, spans,
                interpret=interpret,
            )  # fmt: skip
            o_XX = o_BNH.transpose(1, 2, 0).reshape(N * H, X)
            x_DX = out_mlp(w, x_DX, o_XX)
            continue
        # Queries [N, H, B*T] -> [B, K, T*R, H] (head n = k * R + r, as the model's GQA).
        q_BKQH = q_NHX.reshape(K, R, H, B, T).transpose(3, 0, 4, 1, 2).reshape(B, K, T * R, H)
        dt = decode.attention_dtype(c, k_pool.dtype)
        q_BKQH = q_BKQH.astype(dt)

        def plain(q_BKQH, k_pool, v_pool):
            # Only the blocks of pages that hold the first pages any sequence uses (decode);
            # a prefill chunk reads every page at once.
            return _attend(pool.layout, P, dt, attend_rows, q_BKQH, k_pool, v_pool,
                           page_table_BM, key_valid_BTS, used=pages_used)  # fmt: skip

        if groups is None:
            o_BKTRH = plain(q_BKQH, k_pool, v_pool)
        else:
            cascade = functools.partial(_attend_cascade, pool.layout, P, dt, attend_rows,
                                        tables, groups)  # fmt: skip
            o_BKTRH = jax.lax.cond(groups.use, cascade, plain, q_BKQH, k_pool, v_pool)
        # [B, K, T, R, H] -> [N * H, B * T]
        o_XX = o_BKTRH.transpose(1, 3, 4, 0, 2).reshape(N * H, X)
        x_DX = out_mlp(w, x_DX, o_XX)
    pool = KVPool(k=tuple(new_k), v=tuple(new_v), layout=pool.layout)
    if not routing:
        return x_DX, pool
    A = c.num_experts_per_tok
    experts_LmXA = jnp.stack(experts) if experts else jnp.zeros((0, X, A), jnp.int32)
    return x_DX, pool, experts_LmXA


PAGE_BLOCKS = 16  # blocks a decode step's attention reads (`block_pages`; docs/rollouts.md)


def _attend(layout: str, P: int, dt, rows: int, q_BKQH, k_pool, v_pool, page_table_BM,
            key_valid_BTS, *, used=None, partial: bool = False):
    """`_attend_pages` (`_partials` if `partial`) over the pages (of P slots) of the tables:
    all at once (used None), or in blocks (`_attend_blocks`), those that hold the first `used`
    pages; `rows` sequences at a time (all at once if rows is 0 or at least B)."""
    if used is not None:
        attend = functools.partial(_attend_blocks, layout, P, used, partial=partial)
    else:
        attend = functools.partial(_partials if partial else _attend_pages, layout)
    B = q_BKQH.shape[0]
    if not rows or B <= rows:
        return attend(q_BKQH, k_pool, v_pool, page_table_BM, key_valid_BTS, dt)
    n = -(-B // rows)  # chunks; the last one padded with rows of the trash page, all masked

    def chunks(x):
        x = jnp.pad(x, [(0, n * rows - B)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, rows, *x.shape[1:])

    def chunk(_, xs):
        q, table, valid = xs
        return None, attend(q, k_pool, v_pool, table, valid, dt)

    _, o = jax.lax.scan(chunk, None, (chunks(q_BKQH), chunks(page_table_BM), chunks(key_valid_BTS)))
    return jax.tree.map(lambda x: x.reshape(n * rows, *x.shape[2:])[:B], o)


def block_pages(num_pages: int) -> int:
    """The pages of one block of a decode step's attention (`_attend_blocks`): PAGE_BLOCKS
    blocks cover `num_pages`."""
    return -(-num_pages // PAGE_BLOCKS)


def _attend_blocks(layout: str, P: int, used, q_BKQH, k_pool, v_pool, page_table_BM,
                   key_valid_BTS, dt, *, partial: bool = False):  # fmt: skip
    """`_attend_pages` (`_partials` if `partial`) in blocks of `block_pages(M)` pages, one
    block at a time (a loop: one program body, not a branch per page count), their partials
    merged by log-sum-exp (`_merge`); only the blocks that hold the first `used` pages. A
    block a row admits no slot of adds nothing (its weight is exp(float32 min - m) = 0), so a
    row's result does not depend on how many blocks run."""
    B, M = page_table_BM.shape
    b = block_pages(M)
    nb = -(-M // b)
    page_table_BM = jnp.pad(page_table_BM, ((0, 0), (0, nb * b - M)), constant_values=TRASH_PAGE)
    key_valid_BTS = jnp.pad(key_valid_BTS, ((0, 0), (0, 0), (0, (nb * b - M) * P)))
    _, K, Q, H = q_BKQH.shape
    T = key_valid_BTS.shape[1]
    lowest = jnp.finfo(jnp.float32).min
    init = (jnp.full((B, K, T, Q // T, 1), lowest, jnp.float32),
            jnp.zeros((B, K, T, Q // T, 1), jnp.float32),
            jnp.zeros((B, K, T, Q // T, H), jnp.float32))  # fmt: skip

    def block(j, carry):
        table = jax.lax.dynamic_slice_in_dim(page_table_BM, j * b, b, axis=1)
        valid = jax.lax.dynamic_slice_in_dim(key_valid_BTS, j * b * P, b * P, axis=2)
        return _merge(carry, _partials(layout, q_BKQH, k_pool, v_pool, table, valid, dt))

    m, l, o = jax.lax.fori_loop(0, jnp.clip(-(-used // b), 1, nb), block, init)
    return (m, l, o) if partial else o / l


def _merge(a, b):
    """Two key ranges' softmax partials (m, l, o) (`_partials`) as those of both: rescaled to
    their common maximum by log-sum-exp."""
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = jnp.maximum(m_a, m_b)
    w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, l_a * w_a + l_b * w_b, o_a * w_a + o_b * w_b


def _cascade_tables(page_table_BM, spans: paged_kernel.Spans, groups: Groups,
                    shared_pages: int, P: int):  # fmt: skip
    """The cascade attention's pages and masks, the same in every layer: each group's first
    `shared_pages` pages and its shared slots [G, 1, shared_pages * P], and each row's own
    pages from own_start on with its first own_len slots [B, 1, M * P]."""
    B, M = page_table_BM.shape
    first_G = jnp.minimum(groups.members_GN[:, 0], B - 1)
    shared_G = jnp.where(groups.members_GN[:, 0] < B, spans.shared_len_B[first_G], 0)
    valid_G1S = (jnp.arange(shared_pages * P)[None] < shared_G[:, None])[:, None]
    own_BM = jnp.take_along_axis(
        page_table_BM, jnp.minimum(spans.own_start_B[:, None] + jnp.arange(M)[None], M - 1), 1
    )
    own_B1S = (jnp.arange(M * P)[None] < spans.own_len_B[:, None])[:, None]
    return page_table_BM[first_G, :shared_pages], valid_G1S, own_BM, own_B1S


def _attend_cascade(layout: str, P: int, dt, rows: int, tables, groups: Groups, q_BKQH, k_pool,
                    v_pool):  # fmt: skip
    """A decode step's attention (T = 1) in two parts merged by their log-sum-exps: each
    group's prompt pages gathered once for the queries of all its rows, and each row's own
    slots (`_cascade_tables`); float32 [B, K, 1, R, H] (`Groups`)."""
    B, K, R, H = q_BKQH.shape
    G, N = groups.members_GN.shape
    shared_GM, valid_G1S, own_BM, own_B1S = tables
    lowest = jnp.finfo(jnp.float32).min
    # The shared part: a group's rows' queries [G, K, N * R, H] over its prompt slots.
    q_GNKRH = jnp.concatenate([q_BKQH, jnp.zeros_like(q_BKQH[:1])])[groups.members_GN]
    q_GKQH = q_GNKRH.transpose(0, 2, 1, 3, 4).reshape(G, K, N * R, H)
    parts = _partials(layout, q_GKQH, k_pool, v_pool, shared_GM, valid_G1S, dt)

    def to_rows(x_GK1QY, pad):  # [G, K, 1, N * R, Y] -> each row's [B, K, 1, R, Y]
        Y = x_GK1QY.shape[-1]
        x = x_GK1QY.reshape(G, K, N, R, Y).transpose(0, 2, 1, 3, 4).reshape(G * N, K, R, Y)
        x = jnp.concatenate([x, jnp.full_like(x[:1], pad)])[groups.slot_B]
        return x[:, :, None]

    shared = to_rows(parts[0], lowest), to_rows(parts[1], 0.0), to_rows(parts[2], 0.0)
    # The own part: each row's pages from own_start on, its first own_len slots.
    own = _attend(layout, P, dt, rows, q_BKQH, k_pool, v_pool, own_BM, own_B1S,
                  used=groups.own_pages, partial=True)  # fmt: skip
    _, l, o = _merge(shared, own)
    return o / l


def _attend_pages(layout: str, q_BKQH, k_pool, v_pool, page_table_BM, key_valid_BTS, dt):
    """Softmax attention of q [B, K, T*R, H] over the pages of each sequence's table (gathered
    from a pool in `layout`), where `key_valid_BTS` admits; float32 [B, K, T, R, H]."""
    _, l, o = _partials(layout, q_BKQH, k_pool, v_pool, page_table_BM, key_valid_BTS, dt)
    return o / l


def _partials(layout: str, q_BKQH, k_pool, v_pool, page_table_BM, key_valid_BTS, dt):
    """`_attend_pages` before the division: (m, l, o), float32 [B, K, T, R, 1], [.., 1] and
    [.., H]: each query's largest admitted score, the sum of exp(score - m) over the admitted
    slots, and the values weighted by those (a query that admits no slot: m = the float32
    minimum, and every slot weighs 1)."""
    B, K, Q, H = q_BKQH.shape
    T, S = key_valid_BTS.shape[1], key_valid_BTS.shape[2]
    # The sequences' pages, gathered, as [B, K, H, S] keys and [B, K, S, H] values.
    if layout == "pallas":  # [K, B, M, P, H]
        k_BKHS = k_pool[:, page_table_BM].transpose(1, 0, 4, 2, 3).reshape(B, K, H, S).astype(dt)
        v_BKSH = v_pool[:, page_table_BM].transpose(1, 0, 2, 3, 4).reshape(B, K, S, H).astype(dt)
    else:  # [B, M, K, H, P], [B, M, K, P, H]
        k_BKHS = k_pool[page_table_BM].transpose(0, 2, 3, 1, 4).reshape(B, K, H, S).astype(dt)
        v_BKSH = v_pool[page_table_BM].transpose(0, 2, 1, 3, 4).reshape(B, K, S, H).astype(dt)
    s_BKQS = jnp.einsum(
        "bkqh,bkhs->bkqs", q_BKQH, k_BKHS, preferred_element_type=jnp.float32
    ) * (H**-0.5)
    s_BKTRS = jnp.where(
        key_valid_BTS[:, None, :, None, :], s_BKQS.reshape(B, K, T, Q // T, S),
        jnp.finfo(jnp.float32).min,
    )  # fmt: skip
    m = jnp.max(s_BKTRS, axis=-1, keepdims=True)
    e = jnp.exp(s_BKTRS - m)
    o = jnp.einsum("bktrs,bksh->bktrh", e.astype(dt), v_BKSH, preferred_element_type=jnp.float32)
    return m, jnp.sum(e, axis=-1, keepdims=True), o
