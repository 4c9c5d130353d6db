"""The paged engine's device programs over D shards' pools and slots: prefill chunks,
admissions, appended turn tokens and decode segments (`programs`), and `peak_program`, what a
call holds at once, for the memory planner. Their shapes are fixed for a call, so each compiles
once per (model, batch shape, settings).

The host schedule that calls them: `rollout.paged_schedule`; the design: `rollout.paged`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import model as model_lib
from grpo_jax import sampler
from grpo_jax.models import decode, moe, paged, paged_kernel
from grpo_jax.rollout.paged_pool import PoolPlan


@dataclasses.dataclass(frozen=True)
class Settings:
    """The static settings of one call (a jit static argument)."""

    config: model_lib.ModelConfig
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    logprobs_mode: str
    # The mesh axes the shards (the leading D axis of the pool and the state) are split over:
    # the prompts' batch axes; None on one device or with replicated prompts (D = 1).
    shard_axes: tuple[str, ...] | None = None
    # A decode step's attention, resolved (`paged_kernel.resolve`): "xla" or "pallas" (the
    # pool then has the kernel's layout).
    attention: str = "xla"
    # The kernel's Pallas interpret mode (`paged_kernel.attend`); None: unless JAX's backend
    # is a TPU. False where a program is compiled for TPUs from another backend (the planner).
    interpret: bool | None = None
    # Record each fed token's experts (`PagedState.routing_DBLmTA`; router replay R3).
    record_routing: bool = False
    # The XLA attention's sequences a chunk (`models.paged.paged_forward`; 0: all at once):
    # `models.paged.ATTEND_ROWS` on the CPU (its module doc has the measurements); 0 on
    # accelerators and in the planner's program.
    attend_rows: int = 0
    # The cascade form of the XLA decode attention (`models.paged.Groups`): at most
    # `cascade_groups` groups in flight of `cascade_rows` rows each (the rollout's n) read
    # their shared prompt pages once per group; 0: off (the Pallas kernel; n = 1).
    cascade_groups: int = 0
    cascade_rows: int = 0


@flax.struct.dataclass
class PagedState:
    """The decode slots (S = max_num_seqs) and the [Bd, R] outputs of each of D shards.

    Every field has a leading shard axis D (split over the mesh's batch axes). A slot feeds
    `tok_DS` at position `pos_DS` into logical slot `prompt_pages_DS * page_size + plen_DS` of
    its page table (the prompt's shared pages first, then its own; pages of its shard's pool),
    and draws the token at response position `t_DS` of its shard's rollout row `row_DS`; below
    `replay_DS` (a row re-admitted after a preemption) it feeds the token it drew before instead.
    The host owns the page tables (it grows them) and hands them to every decode segment.
    """

    rng_D: jax.Array  # the call's typed key, once per shard
    tok_DS: jax.Array  # int32, the token to feed
    pos_DS: jax.Array  # int32, its rotary position
    t_DS: jax.Array  # int32, the response position drawn next
    replay_DS: jax.Array  # int32, response positions already drawn (fed again, not redrawn)
    plen_DS: jax.Array  # int32, own (non-shared) slots written so far
    prompt_len_DS: jax.Array  # int32, tokens in the shared prompt pages (prompt length - 1)
    prompt_pages_DS: jax.Array  # int32, shared prompt pages at the head of the page table
    row_DS: jax.Array  # int32, the shard's rollout row
    active_DS: jax.Array  # bool, a row is decoding in the slot
    keys_DS: jax.Array  # typed keys, fold_in(rng, the row's index in the whole rollout)
    page_table_DSM: jax.Array  # int32
    ids_DBR: jax.Array
    mask_DBR: jax.Array
    log_probs_DBR: jax.Array
    # With record_routing (else None): [Bd, Lm, Tb + R, A] in moe.routing_dtype, the experts
    # of each token the row fed through the model (`sampler.Rollout.routed_experts`' layout:
    # Tb bucketed prompt columns, left-padded, then the response), moe.no_route elsewhere.
    routing_DBLmTA: jax.Array | None = None


@contextlib.contextmanager
def _per_shard(st: Settings):
    """While tracing a shard's computation (vmapped over D with `spmd_axis_name`): the
    logical "batch" axis maps to no mesh axis, since the shard axis D already takes the mesh's
    batch axes (a mesh axis can split one dimension only)."""
    if st.shard_axes is None:
        yield
        return
    rules = tuple((name, None if name == "batch" else axes)
                  for name, axes in nn.get_logical_axis_rules())  # fmt: skip
    with nn.logical_axis_rules(rules):
        yield


def _over_shards(st: Settings, fn, in_axes=0):
    """`fn` of one shard, vmapped over the leading shard axis D: its outputs' D axis is split
    over `st.shard_axes` (so each shard's pool, slots and rows stay on its devices)."""
    vmapped = jax.vmap(fn, in_axes=in_axes, spmd_axis_name=st.shard_axes)

    def call(*args):
        with _per_shard(st):
            out = vmapped(*args)
        if st.shard_axes is None:
            return out
        free = jax.sharding.PartitionSpec.UNCONSTRAINED
        return jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x, jax.sharding.PartitionSpec(st.shard_axes, *(free,) * (x.ndim - 1))
            ),
            out,
        )

    return call


def _spans(s: PagedState) -> paged_kernel.Spans:
    """The slots each of a shard's slots attends to in a decode step: its group's shared
    prompt slots [0, prompt_len) and its own slots up to the fed token's; not a prefix of the
    table (the last shared page is filled only up to prompt_len), so two runs. Idle: none."""
    zero = jnp.zeros_like(s.plen_DS)
    return paged_kernel.Spans(
        shared_len_B=jnp.where(s.active_DS, s.prompt_len_DS, zero),
        own_start_B=s.prompt_pages_DS,
        own_len_B=jnp.where(s.active_DS, s.plen_DS + 1, zero),
    )


def _groups(st: Settings, P: int, s: PagedState) -> paged.Groups:
    """A shard's slots grouped by their shared prompt pages (the cascade attention's)."""
    return paged.group_rows(s.page_table_DSM, _spans(s), P, groups=st.cascade_groups,
                            members=st.cascade_rows)  # fmt: skip


def _step(st: Settings, shared_pages: int, dparams, pages_used, groups, pool, s: PagedState):
    """One decode step of one shard's slots (fields without the D axis), given the cascade
    attention's `groups` over the tables' first `shared_pages` pages (or None). Returns
    (pool, s, the rows that finished)."""
    P = pool.page_size
    B, R = s.ids_DBR.shape
    eos = jnp.asarray(st.eos_token_ids, jnp.int32)
    shared_S = s.prompt_pages_DS * P
    w_S = shared_S + s.plen_DS  # the fed token's logical slot
    page_S = jnp.where(
        s.active_DS, jnp.take_along_axis(s.page_table_DSM, (w_S // P)[:, None], 1)[:, 0],
        paged.TRASH_PAGE,
    )  # fmt: skip
    x_DS, pool, *experts = paged.paged_forward(
        st.config, dparams, pool, s.tok_DS[:, None], s.pos_DS[:, None], page_S[:, None],
        (w_S % P)[:, None], s.page_table_DSM, None, pages_used, spans=_spans(s),
        attention=st.attention, interpret=st.interpret, routing=st.record_routing,
        attend_rows=st.attend_rows, groups=groups, shared_pages=shared_pages,
    )  # fmt: skip
    if st.record_routing:
        # The fed token is the prompt's last (t = 0, prompt column Tb - 1) or the response's
        # t - 1 (column Tb + t - 1). A replayed token records again: the same experts.
        Tb = s.routing_DBLmTA.shape[2] - R
        rows_S = jnp.where(s.active_DS, s.row_DS, B)
        experts_SLmA = experts[0].transpose(1, 0, 2).astype(s.routing_DBLmTA.dtype)
        s = dataclasses.replace(s, routing_DBLmTA=s.routing_DBLmTA.at[
            rows_S, :, Tb + s.t_DS - 1].set(experts_SLmA, mode="drop"))  # fmt: skip
    logits_SV = decode.head_logits_fm(st.config, dparams, x_DS)
    step_keys_S = jax.vmap(jax.random.fold_in)(s.keys_DS, s.t_DS)
    tokens_S, values_S = sampler.select_tokens(
        logits_SV, step_keys_S, temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
        logprobs_mode=st.logprobs_mode,
    )  # fmt: skip
    # A re-admitted row recomputes its pages from the tokens it drew before (kept in the
    # outputs): it feeds them again, and neither redraws nor rewrites them.
    replay_S = s.active_DS & (s.t_DS < s.replay_DS)
    drawn_S = s.ids_DBR[jnp.minimum(s.row_DS, B - 1), jnp.minimum(s.t_DS, R - 1)]
    tokens_S = jnp.where(replay_S, drawn_S, tokens_S)
    row_S = jnp.where(s.active_DS & ~replay_S, s.row_DS, B)  # idle and replay writes dropped
    done_S = s.active_DS & ~replay_S & (jnp.isin(tokens_S, eos) | (s.t_DS + 1 >= R))
    s = dataclasses.replace(
        s,
        ids_DBR=s.ids_DBR.at[row_S, s.t_DS].set(tokens_S, mode="drop"),
        mask_DBR=s.mask_DBR.at[row_S, s.t_DS].set(1, mode="drop"),
        log_probs_DBR=s.log_probs_DBR.at[row_S, s.t_DS].set(values_S, mode="drop"),
        tok_DS=tokens_S,
        pos_DS=s.pos_DS + 1,
        t_DS=s.t_DS + 1,
        plen_DS=s.plen_DS + 1,
        active_DS=s.active_DS & ~done_S,
    )
    return pool, s, jnp.sum(done_S)


def _decode(st: Settings, dparams, pool, state: PagedState, page_table_DSM, max_steps,
            refill_at_D):  # fmt: skip
    """Decode steps over every slot of every shard, with the host's page tables, until
    max_steps, no live slot, or a shard has refill_at_D rows finished (its waiting rows can
    start). The host grows the tables so that max_steps steps never write past them.

    Returns (pool, state, int32 [2]: the steps taken, and those of them that ran the cascade
    attention)."""
    P = pool.page_size
    state = dataclasses.replace(state, page_table_DSM=page_table_DSM)

    def cond(carry):
        _, state, (steps, _), finished_D = carry
        return (steps < max_steps) & jnp.any(state.active_DS) & jnp.all(finished_D < refill_at_D)

    # The tables' first pages hold the shared prompts (PoolPlan.prompt_pages), then a full
    # response's pages.
    shared_pages = page_table_DSM.shape[-1] - -(-state.ids_DBR.shape[-1] // P)
    cascade = bool(st.cascade_groups) and shared_pages > 0
    # The attention's page blocks (pages used) and branch (whether the cascade's groups fit)
    # are one for all shards: a choice vmapped over D would run every branch.
    groups_axes = paged.Groups(0, 0, None, None) if cascade else None
    step = _over_shards(st, functools.partial(_step, st, shared_pages),
                        in_axes=(None, None, groups_axes, 0, 0))  # fmt: skip
    group = _over_shards(st, functools.partial(_groups, st, P)) if cascade else None

    def body(carry):
        pool, s, (steps, cascaded), finished_D = carry
        # How many leading pages any row of any shard reads (the attention's page blocks).
        w_DS = s.prompt_pages_DS * P + s.plen_DS
        pages_used = jnp.max(jnp.where(s.active_DS, w_DS // P + 1, 1))
        groups = None
        if cascade:
            g = group(s)
            groups = paged.Groups(g.members_GN, g.slot_B, jnp.all(g.use), jnp.max(g.own_pages))
            cascaded = cascaded + groups.use.astype(jnp.int32)
        pool, s, done_D = step(dparams, pages_used, groups, pool, s)
        return pool, s, (steps + 1, cascaded), finished_D + done_D

    finished = jnp.zeros_like(refill_at_D)
    zero = jnp.int32(0)
    pool, state, steps, _ = jax.lax.while_loop(
        cond, body, (pool, state, (zero, zero), finished)
    )
    return pool, state, jnp.stack(steps)


def _prefill_shard(st: Settings, dparams, pool, tokens_GC, pos_GC, valid_GC, page_table_GM,
                   routing: bool = False):  # fmt: skip
    P = pool.page_size
    M = page_table_GM.shape[1]
    page_GC = jnp.where(
        valid_GC, jnp.take_along_axis(page_table_GM, pos_GC // P, 1), paged.TRASH_PAGE
    )
    slots = jnp.arange(M * P, dtype=jnp.int32)
    valid_GCS = slots[None, None] <= pos_GC[:, :, None]
    _, pool, *experts = paged.paged_forward(
        st.config, dparams, pool, tokens_GC, pos_GC, page_GC, pos_GC % P, page_table_GM,
        valid_GCS, routing=routing, attend_rows=st.attend_rows,
    )  # fmt: skip
    return (pool, *experts) if routing else pool


def _prefill(st: Settings, dparams, pool, tokens_DGC, pos_DGC, valid_DGC, page_table_DGM):
    """Writes chunks of prompts (tokens at positions pos; valid False is padding), G per shard,
    into their shard's pages; a chunk attends to its prompt's slots up to itself."""
    prefill = _over_shards(st, functools.partial(_prefill_shard, st), (None, 0, 0, 0, 0, 0))
    return prefill(dparams, pool, tokens_DGC, pos_DGC, valid_DGC, page_table_DGM)


def _prefill_routed(st: Settings, dparams, pool, state: PagedState, tokens_DGC, pos_DGC,
                    valid_DGC, page_table_DGM, rows_DGN, prompt_len_DG):  # fmt: skip
    """`_prefill` that also records the chunks' experts (st.record_routing) into the prompt
    columns of their groups' rows: rows_DGN (Bd: none) of prompts of prompt_len_DG tokens."""

    def shard(dparams, pool, s: PagedState, tokens_GC, pos_GC, valid_GC, page_table_GM,
              rows_GN, prompt_len_G):  # fmt: skip
        pool, experts_LmXA = _prefill_shard(st, dparams, pool, tokens_GC, pos_GC, valid_GC,
                                            page_table_GM, routing=True)  # fmt: skip
        (G, C), (B, N) = tokens_GC.shape, (s.ids_DBR.shape[0], rows_GN.shape[1])
        Lm, A = experts_LmXA.shape[0], experts_LmXA.shape[-1]
        Tb = s.routing_DBLmTA.shape[2] - st.max_new_tokens
        # prompt position pos of a prompt of len tokens is column Tb - len + pos (left-padded)
        col_GNC = jnp.broadcast_to((Tb - prompt_len_G[:, None] + pos_GC)[:, None], (G, N, C))
        rows_GNC = jnp.where(valid_GC[:, None], rows_GN[:, :, None], B)
        experts_GNCLmA = jnp.broadcast_to(
            experts_LmXA.reshape(Lm, G, 1, C, A).transpose(1, 2, 3, 0, 4), (G, N, C, Lm, A)
        ).astype(s.routing_DBLmTA.dtype)
        routing = s.routing_DBLmTA.at[rows_GNC, :, col_GNC].set(experts_GNCLmA, mode="drop")
        return pool, dataclasses.replace(s, routing_DBLmTA=routing)

    prefill = _over_shards(st, shard, (None, 0, 0, 0, 0, 0, 0, 0, 0))
    return prefill(dparams, pool, state, tokens_DGC, pos_DGC, valid_DGC, page_table_DGM,
                   rows_DGN, prompt_len_DG)  # fmt: skip


def _admit_shard(state: PagedState, slot_A, row_A, key_row_A, tok_A, pos_A, prompt_len_A,
                 prompt_pages_A, replay_A, start_A) -> PagedState:  # fmt: skip
    keys_A = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(state.rng_D, key_row_A)

    def put(x, v):
        return x.at[slot_A].set(v, mode="drop")

    return dataclasses.replace(
        state,
        tok_DS=put(state.tok_DS, tok_A),
        pos_DS=put(state.pos_DS, pos_A),
        t_DS=put(state.t_DS, start_A),
        replay_DS=put(state.replay_DS, replay_A),
        plen_DS=put(state.plen_DS, start_A),
        prompt_len_DS=put(state.prompt_len_DS, prompt_len_A),
        prompt_pages_DS=put(state.prompt_pages_DS, prompt_pages_A),
        row_DS=put(state.row_DS, row_A),
        active_DS=put(state.active_DS, jnp.ones_like(slot_A, jnp.bool_)),
        keys_DS=put(state.keys_DS, keys_A),
    )


def _admit(st: Settings, state: PagedState, *rows_DA) -> PagedState:
    """Starts rows in slots, per shard: [D, A] slot (S: no row), the shard's row, the row's
    index in the rollout (its key), first token, position, shared prompt length and pages,
    the response positions it replays (0 unless it was preempted or appended to), and the
    own slots its pages already hold (0 unless it resumes after a turn: it feeds the token at
    response position start - 1 and draws the one at start)."""
    return _over_shards(st, _admit_shard)(state, *rows_DA)


def _append(st: Settings, state: PagedState, row_DA, start_DA, len_DA, tokens_DAR
            ) -> PagedState:  # fmt: skip
    """Writes forced tokens into rows' outputs, per shard: row (Bd: none) gets tokens_DAR[d,
    a, :len] at response positions start ... start + len - 1, valid and with log-prob 0. The
    row then feeds them (below its replay_DS) without drawing them."""

    def shard(s: PagedState, row_A, start_A, len_A, tokens_AR):
        B, R = s.ids_DBR.shape
        r_R = jnp.arange(R, dtype=jnp.int32)
        pos_AR = start_A[:, None] + r_R[None]
        row_AR = jnp.where(r_R[None] < len_A[:, None], row_A[:, None], B)
        return dataclasses.replace(
            s,
            ids_DBR=s.ids_DBR.at[row_AR, pos_AR].set(tokens_AR, mode="drop"),
            mask_DBR=s.mask_DBR.at[row_AR, pos_AR].set(1, mode="drop"),
            log_probs_DBR=s.log_probs_DBR.at[row_AR, pos_AR].set(0.0, mode="drop"),
        )

    return _over_shards(st, shard)(state, row_DA, start_DA, len_DA, tokens_DAR)


def _read_rows(state: PagedState, row_DA):
    """The [D, A, R] response tokens and validity of rows row_DA of each shard."""
    take = jax.vmap(lambda x, r: jnp.take(x, r, axis=0, mode="clip"))
    return take(state.ids_DBR, row_DA), take(state.mask_DBR, row_DA)


def _init_state(st: Settings, rng, *, shards: int, num_slots: int, num_pages_row: int,
                rows: int, prompt_width: int = 0) -> PagedState:  # fmt: skip
    """The empty slots and outputs of D shards; with st.record_routing, routing of
    `prompt_width` (Tb) prompt columns and R response columns, moe.no_route throughout."""
    S, R, c = num_slots, st.max_new_tokens, st.config

    def shard(_):
        zeros = jnp.zeros((S,), jnp.int32)
        routing = None
        if st.record_routing:
            E = c.num_experts
            routing = jnp.full((rows, c.num_moe_layers, prompt_width + R, c.num_experts_per_tok),
                               moe.no_route(E), moe.routing_dtype(E))  # fmt: skip
        return PagedState(
            rng_D=rng,
            tok_DS=zeros,
            pos_DS=zeros,
            t_DS=zeros,
            replay_DS=zeros,
            plen_DS=zeros,
            prompt_len_DS=zeros,
            prompt_pages_DS=zeros,
            row_DS=zeros,
            active_DS=jnp.zeros((S,), jnp.bool_),
            keys_DS=sampler.row_keys(rng, S),
            page_table_DSM=jnp.zeros((S, num_pages_row), jnp.int32),
            ids_DBR=jnp.full((rows, R), st.pad_token_id, jnp.int32),
            mask_DBR=jnp.zeros((rows, R), jnp.int32),
            log_probs_DBR=jnp.zeros((rows, R), jnp.float32),
            routing_DBLmTA=routing,
        )

    return _over_shards(st, shard)(jnp.arange(shards))


def _init_pool(st: Settings, shards: int, num_pages: int, page_size: int) -> paged.KVPool:
    """D empty pools, one per shard, each split over the mesh's tensor axis by KV head."""

    layout = "pallas" if st.attention == "pallas" else "xla"
    pool = _over_shards(
        st, lambda _: paged.init_pool(st.config, num_pages, page_size, layout=layout)
    )(jnp.arange(shards))
    if st.shard_axes is None:
        return pool
    kv_heads = nn.logical_to_mesh_axes(("act_kv_heads",))[0]  # the rules' tensor axis, if any
    # xla: [D, pages, K, H, page]; pallas: [D, K, pages, page, H]
    heads_at = 1 if layout == "pallas" else 2
    spec = jax.sharding.PartitionSpec(
        st.shard_axes, *(kv_heads if i == heads_at else None for i in range(1, 5))
    )
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), pool)


def _outputs(state: PagedState):
    """The [D, Bd, R] outputs as [B, R] (shard d holds rows d * Bd ... (d + 1) * Bd - 1), and
    the routing as [B, Lm, Tb + R, A] (None unless recorded)."""
    routing = state.routing_DBLmTA
    if routing is not None:
        routing = routing.reshape(-1, *routing.shape[2:])
    return tuple(x.reshape(-1, x.shape[-1])
                 for x in (state.ids_DBR, state.mask_DBR, state.log_probs_DBR)) + (routing,)


def cascade(attention: str, plan: PoolPlan, n: int) -> dict[str, int]:
    """The cascade attention's sizes (`Settings.cascade_groups` / `cascade_rows`) for a call:
    with the XLA attention and groups of n > 1 rows, room for the groups that S slots hold
    when every group has all its n rows in flight, and twice that (rows of groups that run
    longer than their siblings keep their group in flight); otherwise off."""
    if attention != "xla" or n < 2:
        return {"cascade_groups": 0, "cascade_rows": 0}
    return {"cascade_groups": min(plan.max_num_seqs, 2 * -(-plan.max_num_seqs // n)),
            "cascade_rows": n}


def peak_program(config: model_lib.ModelConfig, plan: PoolPlan, *, shards: int,
                 shard_axes: tuple[str, ...] | None, max_new_tokens: int,
                 attention: str = "xla", n: int = 1):  # fmt: skip
    """What a `sample_paged` call holds on the devices at once, as one function for the
    memory planner (grpo_jax/planner/ compiles it on abstract inputs): the decode weights, D
    pools and slot states, one prefill call, one admission and one decode segment. `attention`
    "pallas" plans the TPU kernel (compiled, not interpreted: for a TPU compile from any
    backend). `n`: the rows of a group (the cascade attention's, `cascade`).

    Returns (fn, inputs): fn(params, rng, *inputs) and the (shape, dtype) of each input, each
    with the leading shard axis D but the last (a decode segment's step limit, a scalar).
    """
    st = Settings(config, max_new_tokens, 1.0, 1.0, -1, (0,), 0, "processed_logprobs",
                   shard_axes, attention, interpret=False if attention == "pallas" else None,
                   **cascade(attention, plan, n))
    D, S, G, C = shards, plan.max_num_seqs, plan.chunk_rows, plan.chunk
    Mp, M = plan.prompt_pages, plan.prompt_pages + plan.response_pages
    i32 = np.int32
    prefill = [((D, G, C), i32), ((D, G, C), i32), ((D, G, C), np.bool_), ((D, G, Mp), i32)]
    admit = [((D, S), i32)] * 9
    inputs = [*prefill, *admit, ((D, S, M), i32), ((D,), i32), ((), i32)]

    def fn(params, rng, *args):
        prefill_args, admit_args = args[:4], args[4:13]
        page_table_DSM, refill_at_D, max_steps = args[13:]
        dparams = model_lib.decode_params(config, params)
        pool = _init_pool(st, D, plan.num_pages, plan.page_size)
        state = _init_state(st, rng, shards=D, num_slots=S, num_pages_row=M,
                            rows=plan.rows)  # fmt: skip
        if Mp:
            pool = _prefill(st, dparams, pool, *prefill_args)
        state = _admit(st, state, *admit_args)
        return _decode(st, dparams, pool, state, page_table_DSM, max_steps, refill_at_D)

    return fn, inputs


def programs(platform: str | None = None) -> dict:
    """The paged engine's jitted programs for `platform` (None: JAX's default backend).

    On CPU the decode program compiles with `sampler.compiler_options` (YNNPACK's dot kernels,
    as the grouped sampler's long responses). Under XLA:CPU's default options the head's dot
    and the log-softmax's max and subtraction after it fuse into one YNNPACK graph that ran at
    about 40 % of the dot's own rate: 103-114 ms a decode step at 128 rows (SmolLM2, vocabulary
    49,152) where the dot alone takes 41-46 ms, the step 377 ms against 317 (docs/rollouts.md).
    With the option the dot stays a fusion of its own. At 64 slots the option costs about 8 %
    and at 32 it is level; it is on at every slot count, since training runs the engine with
    `rollout.max_num_seqs` (256) slots. The other programs keep the defaults (the prefill's
    dots are the update's shapes, which gain nothing from it)."""
    return _programs(platform or jax.default_backend())


@functools.cache
def _programs(platform: str) -> dict:
    return {
        "decode_params": jax.jit(model_lib.decode_params, static_argnums=0),
        "init": jax.jit(_init_state, static_argnums=0, static_argnames=(
            "shards", "num_slots", "num_pages_row", "rows", "prompt_width")),  # fmt: skip
        "pool": jax.jit(_init_pool, static_argnums=(0, 1, 2, 3)),
        "prefill": jax.jit(_prefill, static_argnums=0, donate_argnums=2),
        "prefill_routed": jax.jit(_prefill_routed, static_argnums=0, donate_argnums=(2, 3)),
        "admit": jax.jit(_admit, static_argnums=0, donate_argnums=1),
        "append": jax.jit(_append, static_argnums=0, donate_argnums=1),
        "read_rows": jax.jit(_read_rows),
        "decode": jax.jit(
            _decode, static_argnums=0, donate_argnums=(2, 3),
            compiler_options=sampler.compiler_options(platform),
        ),  # fmt: skip
        "outputs": jax.jit(_outputs),
    }
