"""The native engine with continuous batching over a paged KV cache (`sample_paged`).

`sampler.sample` holds the KV cache of every row of a step at once. `sample_paged` decodes at
most `max_num_seqs` rows at a time (vLLM's name) from a fixed pool of KV pages
(`models.paged.KVPool`): when a row finishes, its pages go back to the pool and the next
waiting row takes its slot. Its memory is the pool's, whatever the step's size.

How a call runs. The host schedules; the device runs four jitted programs whose shapes are
fixed for the call, so each compiles once per (model, batch shape, settings), whatever the
pool's growth and preemptions (the page tables change, not their shape):
  * `prefill`: chunks of at most `max_num_batched_tokens` prompt tokens (vLLM's name), in
    `[G, C]` batches, write the prompts' keys and values into their pages. A GRPO group's
    prompt is prefilled once; its pages are shared by its n rows (reference-counted: they go
    back to the pool when the last of them finishes). A prompt's last token is not part of
    the shared pages: each row feeds it as its first decode step, into its own pages, so
    every row starts the same way and no logits wait for a slot.
  * `admit`: places waiting rows into free slots (their page tables, first token, position).
  * `decode`: a `lax.while_loop` of decode steps over all slots (idle ones write to the trash
    page), until `max_steps` steps (within the pages granted), no live slot, or `refill_at`
    rows have finished. Each slot has its own response position, key and page table (the
    host's, an argument of each segment).
  * `outputs`: the shards' [D, Bd, R] outputs as the rollout's [B, R] arrays.
Between programs the host reads which slots finished, frees their pages, grows the running
rows' pages (preempting if it must) and admits rows. A
prompt's prefill goes chunk by chunk between decode segments (at most `segment_steps` steps
while a prefill is pending), so a long prompt never stalls the rows in flight.

Shards. On a mesh, the prompts' batch axes split the call into D data shards (`shard_layout`),
each an engine of its own, as verl runs one vLLM engine per rollout replica: its block of the
prompts, its own `max_num_seqs` slots and its own pool, on its own devices. Every device array
has a leading D axis split over those mesh axes, every program is the one-shard function
vmapped over D (`spmd_axis_name`), and the host keeps one `_Shard` schedule per shard, run in
lockstep: each program call carries every shard's inputs (an idle shard writes its trash page).

Several JAX processes (hosts; a v5p-16 is two). Every process runs every shard's schedule: the
programs are SPMD over the global mesh, so each process must call the same ones with the same
shapes and inputs in the same order. The host reads the device only for the prompts and, after
each decode segment, which slots are still active (and the step count, a replicated scalar);
where other processes hold parts of these they are all-gathered (`distributed.to_host`), so
every process makes the same decisions from the same information, and each places its own
devices' blocks of the schedule's [D, ...] inputs. One process gathers nothing. Multi-turn
rows (`turns`) are refused there: their tool calls end at different times in each process (the
multi-turn agent runs them in lockstep rounds instead, rollout/multi_turn.py).

Memory (vLLM's scheme). A row holds its group's shared prompt pages and only the pages of
its tokens so far, plus a lookahead: before every decode segment the host grants each running
row, oldest first, the pages of its next `segment_steps` steps, then more while pages are free
(up to its full response, so a roomy pool decodes in long segments), and ends the segment
before any row writes past its pages. The host does it, not the device (a free-page stack in
the programs): the host already owns the free list, the prompt refcounts and the admission
order that preemption needs, the page tables are small ([S, M] int32 a shard, handed to each
decode segment), and growth then needs no new program. When the pool cannot give a running row
its next pages, the host first frees the prompt pages of groups with no running row
(prefilled ahead; prefilled again later), then preempts the most recently admitted rows (the
row itself last): their own pages go back, and they wait at the front of the queue. Admission
is bounded by a promise: a row starts only if its first pages are free and the running rows'
full responses plus the prefilled prompts fit `max(num_pages, reserve_pages)` pages, where
`reserve_pages` (the default pool) holds `max_num_seqs` full responses and the prompts of
ceil(S / n) + 1 groups: a pool at least that big never preempts (the schedule of the
reserving engine), a smaller one (`num_pages`, rollout.num_gpu_blocks_override) admits as
many rows and preempts when they outgrow it. The oldest row is never preempted for another,
so every call finishes; a pool that cannot hold one row's prompt and one page, or one row's
full length, fails at once with the knobs named.

Preemption and recompute. vLLM V1 recomputes a preempted request by prefilling its prompt and
the tokens it generated into fresh pages. Here a re-admitted row recomputes its pages by
decode steps instead: it starts in fresh pages from its first token and, below `replay_DS`,
feeds the tokens it drew before (still in the outputs on the device) without redrawing or
rewriting them, so its tokens and log-probs stay exactly those it drew. A deliberate
difference: the cost is one decode step (a slot's share of it) per token replayed rather than
one prefill of them, but no program attends a prefill chunk over a row's whole response (the
XLA prefill attention is dense over the gathered pages: at a 32K response and 8192 batched
tokens that is tens of GiB), and no new program is compiled. `stats` counts the preemptions,
the replayed tokens and the prompts prefilled again.

Same tokens whatever the schedule. Row b's token at response position t is drawn from its
logits with key fold_in(fold_in(rng, b), t), exactly as `sampler.sample` does; slots, chunk
sizes and admission order never enter. The logits equal `sampler.sample`'s up to float
rounding (the attention is one softmax over gathered pages here, two merged by log-sum-exp
there), so the tokens are the same except where two candidates tie within that rounding.

Turns (`turns`, a `Turns` hook; multi-turn rollouts, rollout/multi_turn.py). A row that stops
(an EOS, which is a turn's stop token, or the response limit) leaves its slot and the host asks
`turns.ended(row, its response so far)`: None finishes it; a future keeps its own pages (held
out of any slot, its group's prompt pages with them) while the others decode and waiting rows
take the slot. Once the future is done, `turns.resume` gives the tokens to append (a tool turn):
a small program writes them into the row's outputs at its next response positions (valid,
log-prob 0), and the row waits at the front of the queue; admitted, it starts from its held
pages, feeding the token it ended on and then the appended ones through the replay rule above
(fed, not drawn), and draws again after them. Nothing is prefilled again and no program is
compiled per turn (the appended tokens travel as a [D, S, R] array, the ended rows' tokens come
back the same way). While a future is pending, decode segments are short (`segment_steps`) and
end at the first row that stops, so calls start and answers are fed soon. Held pages count as
promised to admission; when the pool runs short they are dropped, oldest first, before any
running row is preempted, and such a row recomputes its pages by replay when it resumes. Keys
stay by response position (the appended positions included), so the tokens do not depend on
when the futures complete. `stats` adds `paused_turns`, `appended_tokens` and `dropped_holds`;
the trace adds ("pause", rows), ("resume", rows) and ("finish", rows).

Finished rows (`finished`, a `Finished` hook; single-turn rollouts). After each decode segment
the host reads the responses of the rows that stopped (one small program, the outputs
untouched) and hands each to the hook before the next segment starts, so a caller can score a
row while the others decode, as verl's agent loop scores each trajectory when it ends.

Router replay (`record_routing`, a MoE model; actor.router_replay.mode='R3'). The rollout also
records the experts of every token fed through the model, in `sampler.sample`'s
`Rollout.routed_experts` layout ([B, Lm, Tb + R, A], `moe.no_route` where nothing was fed): the
state holds each shard's [Bd, Lm, Tb + R, A]; a prefill chunk (`_prefill_routed`, the program
`prefill` becomes) writes its tokens' experts into the prompt columns of its group's n rows,
and each decode step the experts of the token a slot feeds, at column Tb + t - 1 (the prompt's
last at t = 0). A recomputed token (a preempted row, a turn's dropped pages) writes again the
experts it had, and a turn's appended tokens are recorded when they are fed. Off, the state has
no such field and every program is the one without it.

Kernels (`attention`, `models.paged_kernel.resolve`). On a TPU with a bfloat16 model a decode
step's attention is JAX's Pallas TPU paged-attention kernel (`models.paged_kernel`): it reads
only each row's pages, over a pool in the kernel's layout ([K, pages, page_size, H] a layer,
so no transpose on the hot path). XLA cannot partition a Pallas call, so the kernel runs in a
`shard_map` over the mesh: each device on its own shard's pool and its own kv heads, with no
collective. A row's keys are two runs of its table (the shared prompt slots, whose last page
is partly filled, then its own), so the kernel runs once per run and the two merge by
log-sum-exp. Prefill chunks, GPUs, CPUs and float32 pools take the XLA attention, which
gathers each row's pages. The kernel is tested on the CPU in Pallas interpret mode
(tests/test_paged_kernel.py): its decode attention equals the XLA one over the pool rounded to
bfloat16 (the kernel reads K and V as bfloat16) within float32 rounding, and a greedy
`sample_paged` call gives the XLA path's tokens, on one device and over data shards and a
tensor axis. TPU's `ragged_paged_attention` (prefill and decode in one kernel) fails in
interpret mode on the CPU in jax 0.10.2 (`AttributeError: 'ReshapeTransform' object has no
attribute 'indices'`), so it is not used.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Protocol

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed, sampler
from grpo_jax import model as model_lib
from grpo_jax.models import decode, moe, paged, paged_kernel

# verl 0.9.1's rollout.max_num_seqs / max_num_batched_tokens defaults (vLLM's names).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
PAGE_SIZE = 16  # vLLM's default block_size
SEGMENT_STEPS = 16  # decode steps between prefill chunks while a prefill is pending


class Turns(Protocol):
    """What a multi-turn caller tells `sample_paged` when a row stops (see the module doc).

    Rows are the call's (prompt p's i-th sample is p * n + i); tokens are ids."""

    def ended(self, row: int, response_ids: np.ndarray) -> concurrent.futures.Future | None:
        """Row `row` stopped (an EOS or the response limit) with these response tokens so far
        (the appended ones included). None: it is finished. A future: it keeps its pages and
        waits (off the decode path) until the future is done, then `resume` is asked."""

    def resume(self, row: int, result) -> Sequence[int] | None:
        """Row `row`'s future is done with `result`: the tokens to append to its response (fed
        as context, not drawn; then it draws again), or None: it is finished."""


class Finished(Protocol):
    """What `sample_paged` calls when a row is done for good (not with `turns`)."""

    def __call__(self, row: int, response_ids: np.ndarray) -> None:
        """Row `row` (prompt p's i-th sample is p * n + i) finished with these response tokens
        (the valid ones, its EOS included), which are its final ones in the rollout."""


@dataclasses.dataclass(frozen=True)
class _Settings:
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
def _per_shard(st: _Settings):
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


def _over_shards(st: _Settings, fn, in_axes=0):
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


def _step(st: _Settings, dparams, pages_used, pool, s: PagedState):
    """One decode step of one shard's slots (fields without the D axis). Returns (pool, s,
    the rows that finished)."""
    P = pool.page_size
    B, R = s.ids_DBR.shape
    eos = jnp.asarray(st.eos_token_ids, jnp.int32)
    shared_S = s.prompt_pages_DS * P
    w_S = shared_S + s.plen_DS  # the fed token's logical slot
    page_S = jnp.where(
        s.active_DS, jnp.take_along_axis(s.page_table_DSM, (w_S // P)[:, None], 1)[:, 0],
        paged.TRASH_PAGE,
    )  # fmt: skip
    # The slots the row attends to: its group's shared prompt slots [0, prompt_len) and its
    # own slots up to the fed token's; not a prefix of the table (the last shared page is
    # filled only up to prompt_len), so two runs (`paged_kernel.Spans`).
    zero = jnp.zeros_like(s.plen_DS)
    spans = paged_kernel.Spans(
        shared_len_B=jnp.where(s.active_DS, s.prompt_len_DS, zero),
        own_start_B=s.prompt_pages_DS,
        own_len_B=jnp.where(s.active_DS, s.plen_DS + 1, zero),
    )
    x_DS, pool, *experts = paged.paged_forward(
        st.config, dparams, pool, s.tok_DS[:, None], s.pos_DS[:, None], page_S[:, None],
        (w_S % P)[:, None], s.page_table_DSM, None, pages_used, spans=spans,
        attention=st.attention, interpret=st.interpret, routing=st.record_routing,
        attend_rows=st.attend_rows,
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


def _decode(st: _Settings, dparams, pool, state: PagedState, page_table_DSM, max_steps,
            refill_at_D):  # fmt: skip
    """Decode steps over every slot of every shard, with the host's page tables, until
    max_steps, no live slot, or a shard has refill_at_D rows finished (its waiting rows can
    start). The host grows the tables so that max_steps steps never write past them.

    Returns (pool, state, the steps taken)."""
    P = pool.page_size
    state = dataclasses.replace(state, page_table_DSM=page_table_DSM)

    def cond(carry):
        _, state, steps, finished_D = carry
        return (steps < max_steps) & jnp.any(state.active_DS) & jnp.all(finished_D < refill_at_D)

    step = _over_shards(st, functools.partial(_step, st), in_axes=(None, None, 0, 0))

    def body(carry):
        pool, s, steps, finished_D = carry
        # How many leading pages any row of any shard reads (one attention bucket for all).
        w_DS = s.prompt_pages_DS * P + s.plen_DS
        pages_used = jnp.max(jnp.where(s.active_DS, w_DS // P + 1, 1))
        pool, s, done_D = step(dparams, pages_used, pool, s)
        return pool, s, steps + 1, finished_D + done_D

    finished = jnp.zeros_like(refill_at_D)
    pool, state, steps, _ = jax.lax.while_loop(
        cond, body, (pool, state, jnp.int32(0), finished)
    )
    return pool, state, steps


def _prefill_shard(st: _Settings, dparams, pool, tokens_GC, pos_GC, valid_GC, page_table_GM,
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


def _prefill(st: _Settings, dparams, pool, tokens_DGC, pos_DGC, valid_DGC, page_table_DGM):
    """Writes chunks of prompts (tokens at positions pos; valid False is padding), G per shard,
    into their shard's pages; a chunk attends to its prompt's slots up to itself."""
    prefill = _over_shards(st, functools.partial(_prefill_shard, st), (None, 0, 0, 0, 0, 0))
    return prefill(dparams, pool, tokens_DGC, pos_DGC, valid_DGC, page_table_DGM)


def _prefill_routed(st: _Settings, dparams, pool, state: PagedState, tokens_DGC, pos_DGC,
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


def _admit(st: _Settings, state: PagedState, *rows_DA) -> PagedState:
    """Starts rows in slots, per shard: [D, A] slot (S: no row), the shard's row, the row's
    index in the rollout (its key), first token, position, shared prompt length and pages,
    the response positions it replays (0 unless it was preempted or appended to), and the
    own slots its pages already hold (0 unless it resumes after a turn: it feeds the token at
    response position start - 1 and draws the one at start)."""
    return _over_shards(st, _admit_shard)(state, *rows_DA)


def _append(st: _Settings, state: PagedState, row_DA, start_DA, len_DA, tokens_DAR
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


def _init_state(st: _Settings, rng, *, shards: int, num_slots: int, num_pages_row: int,
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


def _init_pool(st: _Settings, shards: int, num_pages: int, page_size: int) -> paged.KVPool:
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


def peak_program(config: model_lib.ModelConfig, plan: PoolPlan, *, shards: int,
                 shard_axes: tuple[str, ...] | None, max_new_tokens: int,
                 attention: str = "xla"):  # fmt: skip
    """What a `sample_paged` call holds on the devices at once, as one function for the
    memory planner (grpo_jax/planner/ compiles it on abstract inputs): the decode weights, D pools and
    slot states, one prefill call, one admission and one decode segment. `attention` "pallas"
    plans the TPU kernel (compiled, not interpreted: for a TPU compile from any backend).

    Returns (fn, inputs): fn(params, rng, *inputs) and the (shape, dtype) of each input, each
    with the leading shard axis D but the last (a decode segment's step limit, a scalar).
    """
    st = _Settings(config, max_new_tokens, 1.0, 1.0, -1, (0,), 0, "processed_logprobs",
                   shard_axes, attention, interpret=False if attention == "pallas" else None)
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


@functools.cache
def _programs():
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
        "decode": jax.jit(_decode, static_argnums=0, donate_argnums=(2, 3)),
        "outputs": jax.jit(_outputs),
    }


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The sizes of one call's pool and batches (`plan_pool`)."""

    page_size: int
    num_pages: int  # including the trash page
    max_num_seqs: int  # slots S
    prompt_pages: int  # pages of the longest shared prompt part (Mp)
    response_pages: int  # pages of a full response (Mr): a row's most, grown as it decodes
    chunk: int  # prefill chunk width C
    chunk_rows: int  # prompts per prefill call G
    rows: int  # rollout rows (prompts x n) of the shard
    # The pool with which no row is ever preempted (S full responses and the prompts of
    # ceil(S / n) + 1 groups): the scheduler admits rows as if the pool had at least this many
    # pages, and a smaller pool preempts rows when their pages run out.
    reserve_pages: int = 0

    @property
    def admits_pages(self) -> int:
        """The pages (less the trash page) that admission promises to the running rows' full
        responses and the prefilled prompts."""
        return max(self.num_pages, self.reserve_pages) - 1


def plan_pool(
    *,
    num_prompts: int,
    n: int,
    prompt_width: int,
    max_new_tokens: int,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    page_size: int = PAGE_SIZE,
    num_pages: int | None = None,
) -> PoolPlan:
    """The pool and batch sizes of a call: S = min(max_num_seqs, P * n) slots; by default
    (`num_pages` None, rollout.num_gpu_blocks_override unset) the pool holds S full responses
    and the prompts of ceil(S / n) + 1 groups, and no row is ever preempted; a smaller pool
    grows rows page by page and preempts when it runs out (see the module doc).

    Raises:
      ValueError naming the knobs, when the pool cannot hold one row's prompt and first page,
      or one row's full length (a row that draws no EOS could never finish).
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"rollout.{name}={value} must be >= 1")
    slots = min(max_num_seqs, num_prompts * n)
    prompt_pages = -(-(prompt_width - 1) // page_size)
    response_pages = -(-max_new_tokens // page_size)
    reserve = 1 + slots * response_pages + (-(-slots // n) + 1) * prompt_pages
    num_pages = reserve if num_pages is None else num_pages
    knobs = (
        "raise the pool (rollout.num_gpu_blocks_override, the num_pages of sample_paged) or "
        "the page size, or shorten data.max_prompt_length / data.max_response_length"
    )
    for what, need in (("its prompt and one page of response", 1 + prompt_pages + 1),
                       ("its full length", 1 + prompt_pages + response_pages)):  # fmt: skip
        if num_pages < need:
            raise ValueError(
                f"a KV pool of {num_pages} pages (num_pages) of {page_size} tokens cannot hold "
                f"one row ({what}): a prompt of {prompt_width} tokens and a response of "
                f"{max_new_tokens} need {prompt_pages} + {response_pages} pages plus the trash "
                f"page ({1 + prompt_pages + response_pages}; a row that draws no EOS could "
                f"never finish in fewer); {knobs}"
            )
    shared = max(prompt_width - 1, 1)
    chunk = min(-(-shared // page_size) * page_size,
                max(page_size, max_num_batched_tokens // page_size * page_size))  # fmt: skip
    chunk_rows = min(num_prompts, max(1, max_num_batched_tokens // chunk))
    return PoolPlan(page_size, num_pages, slots, prompt_pages, response_pages, chunk, chunk_rows,
                    num_prompts * n, reserve)


def sample_paged(
    config: model_lib.ModelConfig,
    params,
    prompt_ids,
    prompt_mask,
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
    logprobs_mode: str = "processed_logprobs",
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    page_size: int = PAGE_SIZE,
    num_pages: int | None = None,
    segment_steps: int = SEGMENT_STEPS,
    attention: str = "auto",
    stats: dict | None = None,
    turns: Turns | None = None,
    record_routing: bool = False,
    finished: Finished | None = None,
) -> sampler.Rollout:
    """`sampler.sample` with continuous batching over a paged KV pool (see the module doc).

    Arguments as `sampler.sample`, plus:
      max_num_seqs: rows decoding at once (the slots).
      max_num_batched_tokens: prompt tokens per prefill call.
      page_size / num_pages: the pool a data shard (default: `plan_pool`'s, which never
        preempts; fewer pages grow rows and preempt, see the module doc).
      segment_steps: decode steps between prefill chunks while a prefill is pending.
      attention: a decode step's attention, "auto", "xla" or "pallas" (`paged_kernel.resolve`:
        "auto" is the Pallas kernel on a TPU with a bfloat16 model, else XLA; "pallas" on the
        CPU runs the kernel in interpret mode, for tests).
      stats: if given, filled with the call's schedule: the `PoolPlan` fields, counts
        (decode calls and steps, prefill calls and tokens, admissions, the peak pages in use
        and rows in flight) and `trace`, the calls in order.
      turns: multi-turn rows (`Turns`, see the module doc): a row that stops asks
        `turns.ended`, and may wait for tokens to append and go on. One JAX process only.
      record_routing: also record each token's experts in `Rollout.routed_experts` (a MoE
        model; router replay R3), as `sampler.sample` does: the prefill's chunks record the
        prompt's tokens into the columns of its group's n rows, each decode step the token a
        row feeds (the prompt's last, a drawn token, a recomputed one after a preemption, a
        turn's appended ones), so every token fed through the model has its experts.
      finished: called from the scheduler as `finished(row, response_ids)` as soon as a row is
        done for good (an EOS or the response limit), with its final response tokens (up to and
        including the EOS), between decode segments: a caller scores it while the other rows
        decode (rollout_stage's streamed rewards). The rollout is the same with or without it.
        Not with `turns` (a multi-turn caller knows when a trajectory ends from `turns.ended`).

    Returns:
      The same `Rollout` as `sampler.sample` (rows of a prompt adjacent).
    """
    if turns is not None and jax.process_count() > 1:
        raise ValueError(
            f"multi-turn rows (turns) wait on tool calls that end at different times in each of "
            f"this run's {jax.process_count()} JAX processes, so the paged engine takes them in "
            "one process only; with several, multi-turn rollouts run in lockstep rounds "
            "(rollout.multi_turn.Agent routes them there)"
        )
    ids_np, mask_np = (np.asarray(_on_host(x), np.int32) for x in (prompt_ids, prompt_mask))
    eos_token_ids = sampler.check_sampling_args(
        ids_np.shape, mask_np.shape, vocab_size=config.vocab_size, n=n,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
    )  # fmt: skip
    sampler.check_logprobs_mode(logprobs_mode)
    if record_routing and not config.num_moe_layers:
        raise ValueError("record_routing=True needs a mixture-of-experts model (num_experts > 0)")
    if segment_steps < 1:
        raise ValueError(f"segment_steps={segment_steps} must be >= 1")
    if turns is not None and finished is not None:
        raise ValueError("give sample_paged `turns` or `finished`, not both")
    ids_np, mask_np = sampler.bucket_prompts(ids_np, mask_np, pad_token_id=pad_token_id)
    num_prompts, width = ids_np.shape
    prompts = [row[m > 0] for row, m in zip(ids_np, mask_np)]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one real token (prompt_mask all 0)")
    mesh, axes, shards = shard_layout(prompt_ids)
    if num_prompts % shards:
        raise ValueError(f"{num_prompts} prompts do not split over {shards} data shards")
    plan = plan_pool(
        num_prompts=num_prompts // shards, n=n, prompt_width=width,
        max_new_tokens=max_new_tokens, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
        num_pages=num_pages,
    )  # fmt: skip
    attention = paged_kernel.resolve(attention, kv_dtype=config.dtype)
    st = _Settings(config, max_new_tokens, float(temperature), float(top_p), int(top_k),
                   eos_token_ids, int(pad_token_id), logprobs_mode, axes, attention,
                   record_routing=bool(record_routing),
                   attend_rows=paged.ATTEND_ROWS if jax.default_backend() == "cpu" else 0)
    run = _Schedule(st, plan, prompts, n, segment_steps, shards, mesh, turns, finished)
    programs = _programs()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        dparams = programs["decode_params"](config, params)
        pool = programs["pool"](st, shards, plan.num_pages, plan.page_size)
        state = programs["init"](
            st, sampler.as_typed_key(jnp.asarray(rng)), shards=shards,
            num_slots=plan.max_num_seqs, num_pages_row=plan.prompt_pages + plan.response_pages,
            rows=plan.rows, prompt_width=width if record_routing else 0,
        )  # fmt: skip
        pool, state = run(programs, dparams, pool, state)
        ids_BR, mask_BR, log_probs_BR, routed = programs["outputs"](state)
    if stats is not None:
        stats.update(dataclasses.asdict(plan), shards=shards, **run.counts, trace=run.trace)
    rollout = sampler.Rollout(
        prompt_ids=jnp.repeat(jnp.asarray(ids_np), n, axis=0),
        prompt_mask=jnp.repeat(jnp.asarray(mask_np), n, axis=0),
        response_ids=ids_BR,
        response_mask=mask_BR,
        log_probs=log_probs_BR,
        group_ids=jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), n),
        weights_version=jnp.int32(weights_version),
        routed_experts=routed,
    )
    if isinstance(prompt_ids, jax.Array):  # back on the prompts' batch sharding
        rollout = jax.tree.map(
            lambda x: jax.device_put(x, sampler._row_sharding(prompt_ids, x.ndim)), rollout
        )
    return rollout


def _on_host(x) -> np.ndarray:
    """The whole of an array on this host. Parts that other processes hold are all-gathered:
    the host reads the prompts and the slots that finished through this, so that every process
    schedules every shard alike (and calls the same programs with the same inputs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return distributed.to_host(x)
    return np.asarray(x)


def pages(rows: int, shards: int, max_num_seqs: int) -> bool:
    """Whether a call of `rows` (prompts x n) split over `shards` data shards takes the paged
    engine: a shard has more rows than slots (engines.NativeEngine's rule; the planner's)."""
    return rows // shards > max_num_seqs


def shard_layout(prompt_ids) -> tuple[jax.sharding.Mesh | None, tuple[str, ...] | None, int]:
    """(mesh, batch axes, D): the data shards a call's pools and slots split into, those of
    the prompts' batch axis. One shard (None, None, 1) for host arrays or replicated prompts.

    Each shard schedules its own prompts (D consecutive blocks, as the rollout rows split)
    over its own pool of its own device(s): `max_num_seqs` and the pool's pages are per
    shard, as vLLM's are per engine (one per data-parallel rollout replica)."""
    sharding = getattr(prompt_ids, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return None, None, 1
    axes = sharding.spec[0]
    if axes is None:
        return None, None, 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    if shards == 1:
        return None, None, 1
    return sharding.mesh, axes, shards


class _Shard:
    """The host side of one shard: its pages, slots, waiting rows and prefill queue.

    Group g and row r are the shard's own (0-based); `g0` and `r0` place them in the call.
    A slot's row has written `slot_t` of its own slots (t: one a decode step, from its first
    fed token, the prompt's last) into `slot_pages`, the pages granted to it so far.

    Turns (`sample_paged`'s `turns`): a row whose turn ended leaves its slot but keeps its own
    pages (`held`, holding `written` slots) while it waits (`pending`); once tokens are
    appended it waits at the front of the queue and, admitted, feeds them from `written` on.
    Held pages count as promised; when the pool runs short they are dropped, oldest first,
    before any running row is preempted (the row then recomputes from its first token)."""

    def __init__(self, st: _Settings, plan: PoolPlan, prompts, n: int, g0: int,
                 min_steps: int):  # fmt: skip
        self.st, self.plan, self.prompts, self.n = st, plan, prompts, n
        self.g0, self.r0 = g0, g0 * n
        self.min_steps = min_steps  # steps every running row gets pages for, at least
        P, S = plan.page_size, plan.max_num_seqs
        self.shared_len = [len(p) - 1 for p in prompts]
        self.shared_pages = [-(-s // P) for s in self.shared_len]
        self.prefilled = [0] * len(prompts)  # shared tokens written
        self.group_pages: list[list[int] | None] = [None] * len(prompts)
        self.prompt_held = 0  # pages of group_pages
        self.unfinished = [n] * len(prompts)  # rows of the group not finished
        self.free = list(range(plan.num_pages - 1, paged.TRASH_PAGE, -1))  # a stack
        self.waiting = collections.deque(range(len(prompts) * n))
        rows = len(prompts) * n
        self.known = [0] * rows  # response tokens in the outputs (drawn or appended): replayed
        self.held: dict[int, list[int]] = {}  # own pages of rows out of a slot, oldest first
        self.written = [0] * rows  # own slots a row's held pages hold
        self.last = [0] * rows  # its token at response position written - 1 (fed first)
        self.fresh = [0] * rows  # appended tokens not fed yet (not replays)
        self.pending: dict[int, object] = {}  # rows waiting on the turn hook: their futures
        self.slot_row = [-1] * S
        self.slot_pages: list[list[int]] = [[] for _ in range(S)]
        self.slot_t = [0] * S
        self.slot_order = [0] * S  # admission order (the newest is preempted first)
        self.admitted = 0
        self.tables = np.zeros((S, plan.prompt_pages + plan.response_pages), np.int32)
        self.peak_pages = self.peak_rows = self.prefill_tokens = 0
        self.preemptions = self.replayed_tokens = self.prompt_evictions = 0
        self.paused_turns = self.appended_tokens = self.dropped_holds = 0

    def note_use(self) -> None:
        self.peak_pages = max(self.peak_pages, self.plan.num_pages - 1 - len(self.free))
        self.peak_rows = max(self.peak_rows, self.decoding())

    def decoding(self) -> int:
        return sum(r >= 0 for r in self.slot_row)

    def _promised(self) -> int:
        """Pages promised: the prefilled prompts' and every running row's full response."""
        held = sum(len(p) for p in self.held.values())
        return self.prompt_held + self.decoding() * self.plan.response_pages + held

    def _own_pages(self, slots: int) -> int:
        """Own pages of a row that has written `slots` own slots (at most its R)."""
        return -(-min(slots, self.st.max_new_tokens) // self.plan.page_size)

    def refill_at(self) -> int:
        """Finished rows after which a decode segment returns, so waiting rows can start."""
        S = self.plan.max_num_seqs
        return max(1, min(len(self.waiting), -(-S // 8))) if self.waiting else S + 1

    def prefill_pending(self) -> bool:
        """A waiting row's group still has prompt tokens to prefill."""
        if not self.waiting:
            return False
        return not self._ready(self.waiting[0] // self.n)

    def _ready(self, g: int) -> bool:
        """Group g's prompt pages are allocated and prefilled: its rows may start."""
        return self.group_pages[g] is not None and self.prefilled[g] >= self.shared_len[g]

    def _evict_prompts(self, pages: int, keep: int = -1) -> None:
        """Frees the prompt pages of groups with no running row (prefilled ahead, or whose
        rows were all preempted), but group `keep`, until `pages` pages are free: they are
        prefilled again when their rows come up."""
        running = {r // self.n for r in self.slot_row if r >= 0}
        running |= {r // self.n for r in self.held}  # their own pages extend the prompt's
        for g in range(len(self.prompts) - 1, -1, -1):
            if len(self.free) >= pages:
                return
            if g == keep or g in running or not self.group_pages[g]:
                continue
            self.free.extend(self.group_pages[g])
            self.prompt_held -= len(self.group_pages[g])
            self.group_pages[g], self.prefilled[g] = None, 0
            self.prompt_evictions += 1

    def _drop_held(self, enough, keep: int = -1) -> None:
        """Frees the own pages of rows out of a slot (waiting on a turn, or to resume) but row
        `keep`, oldest first, until `enough()`: such a row recomputes from its first token."""
        for row in list(self.held):
            if enough():
                return
            if row == keep:
                continue
            self.free.extend(self.held.pop(row))
            self.written[row] = 0
            self.dropped_holds += 1

    def _preempt(self, slot: int) -> None:
        """Frees the slot's own pages; its row waits at the front, with the tokens it drew."""
        row = self.slot_row[slot]
        self.free.extend(self.slot_pages[slot])
        self.known[row] = max(self.known[row], self.slot_t[slot])
        self.written[row] = 0
        self.waiting.appendleft(row)
        self.slot_row[slot], self.slot_pages[slot] = -1, []
        self.tables[slot] = 0
        self.preemptions += 1

    def _grant(self, slot: int, pages: int) -> None:
        """Pages from the free stack onto the end of the slot's own pages and its table."""
        own = self.slot_pages[slot]
        first = self.shared_pages[self.slot_row[slot] // self.n] + len(own)
        new = [self.free.pop() for _ in range(pages)]
        own.extend(new)
        self.tables[slot, first : first + pages] = new

    def grow(self) -> None:
        """Gives every running row, oldest first, the pages of its next `min_steps` steps;
        when the pool runs out, frees prompts prefilled ahead, then preempts the newest rows
        (vLLM's recompute preemption), the row itself last."""
        for slot in sorted((s for s, r in enumerate(self.slot_row) if r >= 0),
                           key=self.slot_order.__getitem__):  # fmt: skip
            if self.slot_row[slot] < 0:  # preempted for an older row
                continue
            need = self._own_pages(self.slot_t[slot] + self.min_steps)
            need -= len(self.slot_pages[slot])
            if need > len(self.free):
                self._evict_prompts(need)
                self._drop_held(lambda: need <= len(self.free))
            while need > len(self.free):
                victim = max((s for s, r in enumerate(self.slot_row) if r >= 0),
                             key=self.slot_order.__getitem__)  # fmt: skip
                self._preempt(victim)
                if victim == slot:
                    break
            if self.slot_row[slot] >= 0 and need > 0:
                self._grant(slot, need)
        self.note_use()

    def extend(self) -> None:
        """Grants the running rows more steps while pages are free (so fewer segments): the
        longest horizon, halving from a full response down to `min_steps`, whose pages fit
        beside those that the rows waiting for idle slots take first."""
        running = [s for s, r in enumerate(self.slot_row) if r >= 0]
        idle = len(self.slot_row) - len(running)
        spare = len(self.free) - min(idle, len(self.waiting)) * self._own_pages(self.min_steps)
        k = self.st.max_new_tokens
        while k > self.min_steps:
            extra = [max(0, self._own_pages(self.slot_t[s] + k) - len(self.slot_pages[s]))
                     for s in running]  # fmt: skip
            if sum(extra) <= spare:
                for s, e in zip(running, extra):
                    if e:
                        self._grant(s, e)
                break
            k //= 2
        self.note_use()

    def max_steps(self) -> int:
        """Steps every running row can take within its pages (a row finishes at R)."""
        P, R = self.plan.page_size, self.st.max_new_tokens
        limits = [len(self.slot_pages[s]) * P - self.slot_t[s]
                  for s, r in enumerate(self.slot_row)
                  if r >= 0 and len(self.slot_pages[s]) * P < R]  # fmt: skip
        return min(limits, default=R)

    def advance(self, steps: int, active_S: np.ndarray) -> list[tuple[int, list[int]]]:
        """After a decode segment of `steps` steps: the rows still decoding wrote as many own
        slots; those that stopped (EOS or the length) leave their slots. Returns them, with
        their own pages: (row, pages)."""
        stopped = []
        for slot, row in enumerate(self.slot_row):
            if row < 0:
                continue
            if active_S[slot]:
                self.slot_t[slot] += steps
                continue
            stopped.append((row, self.slot_pages[slot]))
            self.slot_row[slot], self.slot_pages[slot] = -1, []
            self.tables[slot] = 0
        return stopped

    def finish(self, row: int, pages: list[int]) -> None:
        """The row is done: its own pages go back (and its group's, if the last)."""
        self.free.extend(pages)
        g = row // self.n
        self.unfinished[g] -= 1
        if not self.unfinished[g]:
            self.free.extend(self.group_pages[g] or [])
            self.prompt_held -= len(self.group_pages[g] or [])
            self.group_pages[g] = []

    def pause(self, row: int, pages: list[int], drawn: int, last: int, future) -> None:
        """The row's turn ended after `drawn` response tokens: it keeps its pages and waits."""
        self.held[row], self.written[row], self.last[row] = pages, drawn, last
        self.known[row] = drawn
        self.pending[row] = future
        self.paused_turns += 1

    def resume(self, row: int, appended: int) -> None:
        """`appended` tokens follow the row's (in its outputs): it waits at the front."""
        self.known[row] += appended
        self.fresh[row] = appended
        self.appended_tokens += appended
        self.waiting.appendleft(row)

    def prefill_batch(self):
        """The next chunks of the groups of the waiting rows, in order, as [G, C] tokens,
        positions, validity and [G, Mp] page tables, and the groups (None: nothing to do)."""
        plan = self.plan
        C, G = plan.chunk, plan.chunk_rows  # G * C <= max_num_batched_tokens
        tokens, pos, valid, tables, groups = [], [], [], [], []
        # Groups of the rows that will take the free slots next (and the slots after them).
        idle = sum(r < 0 for r in self.slot_row)
        next_rows = itertools.islice(self.waiting, idle + self.n)
        ahead = list(dict.fromkeys(r // self.n for r in next_rows))
        for i, g in enumerate(ahead):
            if len(tokens) == G:
                break
            if self.prefilled[g] >= self.shared_len[g]:
                if self.group_pages[g] is None:
                    self.group_pages[g] = []
                continue
            if self.group_pages[g] is None:
                need = self.shared_pages[g]

                def fits():
                    # A row's response must still fit beside the promised pages, and the
                    # prompt's pages must be free: else prefill later.
                    return (self._promised() + need + plan.response_pages <= plan.admits_pages
                            and need <= len(self.free))  # fmt: skip

                if i == 0 and not self.decoding():  # nothing else can free pages
                    self._evict_prompts(self.plan.num_pages, keep=g)
                    if not self.pending and not fits():
                        # Nor can a turn: the rows holding pages wait behind this one (their
                        # own were dropped before, so their group was evictable). Drop the
                        # holds, then the prompts they kept, else the shard stalls.
                        self._drop_held(fits)
                        self._evict_prompts(self.plan.num_pages, keep=g)
                if not fits():
                    break
                self.group_pages[g] = [self.free.pop() for _ in range(need)]
                self.prompt_held += need
            start = self.prefilled[g]
            stop = min(start + C, self.shared_len[g])
            row = np.full((C,), self.st.pad_token_id, np.int32)
            row[: stop - start] = self.prompts[g][start:stop]
            tokens.append(row)
            pos.append(start + np.arange(C, dtype=np.int32))
            valid.append(np.arange(C) < stop - start)
            table = np.zeros((plan.prompt_pages,), np.int32)
            table[: len(self.group_pages[g])] = self.group_pages[g]
            tables.append(table)
            self.prefilled[g] = stop
            self.prefill_tokens += stop - start
            groups.append(self.g0 + g)
        if not tokens or not plan.prompt_pages:
            return None
        self.note_use()
        batch = [np.stack(x) for x in (tokens, pos, valid, tables)]
        if self.st.record_routing:  # the rows whose prompt columns record the experts
            g_G = np.asarray(groups, np.int32) - self.g0
            batch += [g_G[:, None] * self.n + np.arange(self.n, dtype=np.int32),
                      np.asarray([len(self.prompts[g]) for g in g_G], np.int32)]  # fmt: skip
        return [np.concatenate([x, y[len(tokens) :]]) for x, y in zip(batch, self.idle_prefill())
                ] + [tuple(groups)]  # fmt: skip

    def idle_prefill(self):
        """A prefill batch that only writes the trash page (with st.record_routing, and the
        rows of no group: the shard's row count)."""
        C, G, Mp = self.plan.chunk, self.plan.chunk_rows, self.plan.prompt_pages
        pos = np.broadcast_to(np.arange(C, dtype=np.int32), (G, C))
        batch = [np.zeros((G, C), np.int32), pos, np.zeros((G, C), bool),
                 np.zeros((G, Mp), np.int32)]  # fmt: skip
        if self.st.record_routing:
            batch += [np.full((G, self.n), self.plan.rows, np.int32),
                      np.zeros((G,), np.int32)]  # fmt: skip
        return batch

    def admissions(self):
        """Waiting rows whose prompts are prefilled into free slots, with the pages of their
        first `min_steps` steps, while the promise of their full responses fits: [S] slot (S:
        none), row, row in the call, first token, position, shared length and pages, and the
        tokens it replays; None when no row starts."""
        plan = self.plan
        S = plan.max_num_seqs
        admitted = []
        for slot in range(S):
            if self.slot_row[slot] >= 0:
                continue
            if not self.waiting:
                break
            row = self.waiting[0]
            g = row // self.n
            if not self._ready(g):
                break
            held = self.held.get(row, [])
            w = self.written[row] if held else 0  # own slots its pages hold already
            need = self._own_pages(w + self.min_steps) - len(held)

            def fits():
                return (self._promised() - len(held) + plan.response_pages <= plan.admits_pages
                        and need <= len(self.free))  # fmt: skip

            self._drop_held(fits, keep=row)
            if not fits():
                break
            self.waiting.popleft()
            self.held.pop(row, None)
            self.slot_row[slot], self.slot_t[slot], self.slot_pages[slot] = row, w, held
            self.admitted += 1
            self.slot_order[slot] = self.admitted
            shared = self.group_pages[g]
            self.tables[slot] = 0
            self.tables[slot, : len(shared)] = shared
            first = self.shared_pages[g]
            self.tables[slot, first : first + len(held)] = held
            if need > 0:
                self._grant(slot, need)
            self.replayed_tokens += self.known[row] - w - self.fresh[row]
            self.fresh[row] = 0
            # the fed token is the prompt's last, at position len - 1 = shared_len, or, with
            # w own slots held, the token at response position w - 1, at shared_len + w
            tok = self.last[row] if w else int(self.prompts[g][-1])
            admitted.append((slot, row, self.r0 + row, tok, self.shared_len[g] + w,
                             self.shared_len[g], self.shared_pages[g], self.known[row], w))
        if not admitted:
            return None
        self.note_use()
        cols = list(zip(*admitted))
        pad = S - len(admitted)
        return [np.concatenate([np.asarray(c, np.int32), np.full((pad,), fill, np.int32)])
                for c, fill in zip(cols, (S, 0, 0, 0, 0, 0, 0, 0, 0))]  # fmt: skip

    def idle_admissions(self):
        S = self.plan.max_num_seqs
        return [np.full((S,), S, np.int32)] + [np.zeros((S,), np.int32)] * 8


class _Schedule:
    """The host side of one call: D shards' schedules, run in lockstep by the programs."""

    def __init__(self, st: _Settings, plan: PoolPlan, prompts, n: int, segment_steps: int,
                 shards: int, mesh, turns=None, finished=None) -> None:  # fmt: skip
        self.st, self.plan, self.segment_steps, self.mesh = st, plan, segment_steps, mesh
        self.turns, self.finished = turns, finished
        per = len(prompts) // shards
        self.shards = [_Shard(st, plan, prompts[d * per : (d + 1) * per], n, d * per,
                              segment_steps) for d in range(shards)]  # fmt: skip
        self.counts = {"decode_calls": 0, "decode_steps": 0, "prefill_calls": 0,
                       "admit_calls": 0, "append_calls": 0}  # fmt: skip
        # ("prefill", groups) / ("admit", rows) / ("decode", steps), and with turns ("pause",
        # rows) / ("resume", rows) / ("finish", rows), in order; groups and rows of the call
        self.trace: list[tuple[str, object]] = []

    def _put(self, arrays):
        """[D, ...] host arrays, each shard's on its devices. With several processes every
        process holds the same arrays (the same schedule) and places its own devices' blocks."""
        if self.mesh is None:
            return arrays
        spec = jax.sharding.PartitionSpec(self.st.shard_axes)
        shd = jax.sharding.NamedSharding(self.mesh, spec)
        if shd.is_fully_addressable:
            return [jax.device_put(x, shd) for x in arrays]
        return [jax.make_array_from_callback(x.shape, shd, x.__getitem__) for x in arrays]

    def _read(self, programs, state, stopped) -> list[list[np.ndarray]]:
        """The response tokens so far of the rows that stopped in a segment, per shard."""
        S = self.plan.max_num_seqs
        row_DA = np.zeros((len(self.shards), S), np.int32)
        for d, rows in enumerate(stopped):
            row_DA[d, : len(rows)] = [row for row, _ in rows]
        ids_DAR, mask_DAR = jax.device_get(programs["read_rows"](state, *self._put([row_DA])))
        return [[ids_DAR[d, a, : int(mask_DAR[d, a].sum())] for a in range(len(rows))]
                for d, rows in enumerate(stopped)]  # fmt: skip

    def _turn_ends(self, programs, state, stopped) -> None:
        """The rows that stopped in a segment: each finishes (and the `finished` hook gets its
        response), or (the turn hook returns a future) waits with its pages."""
        if self.turns is None:
            for sh, rows in zip(self.shards, stopped):
                for row, own in rows:
                    sh.finish(row, own)
            if self.finished is not None and any(stopped):
                responses = self._read(programs, state, stopped)
                for sh, rows, tokens in zip(self.shards, stopped, responses):
                    for (row, _), response in zip(rows, tokens):
                        self.finished(sh.r0 + row, response)
            return
        if not any(stopped):
            return
        R = self.st.max_new_tokens
        paused, finished = [], []
        responses = self._read(programs, state, stopped)
        for sh, rows, tokens_A in zip(self.shards, stopped, responses):
            for (row, own), tokens in zip(rows, tokens_A):
                k = len(tokens)
                future = self.turns.ended(sh.r0 + row, tokens)
                if future is None:
                    sh.finish(row, own)
                    finished.append(sh.r0 + row)
                    continue
                if k >= R:
                    raise ValueError(
                        f"the turn hook continued row {sh.r0 + row} at the response limit "
                        f"({R} tokens, max_new_tokens): a row that reached it must finish"
                    )
                sh.pause(row, own, k, int(tokens[-1]), future)
                paused.append(sh.r0 + row)
        if finished:
            self.trace.append(("finish", tuple(finished)))
        if paused:
            self.trace.append(("pause", tuple(paused)))

    def _resume(self, programs, state, *, block: bool):
        """The rows whose futures are done: each finishes, or gets the tokens the hook appends
        (written into its outputs) and waits at the front. With `block`, first waits for one."""
        if not any(sh.pending for sh in self.shards):
            return state
        if block:
            concurrent.futures.wait([f for sh in self.shards for f in sh.pending.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)  # fmt: skip
        S, R, V = self.plan.max_num_seqs, self.st.max_new_tokens, self.st.config.vocab_size
        appends = [[] for _ in self.shards]  # per shard: (row, start, tokens)
        finished = []
        for sh, rows in zip(self.shards, appends):
            for row in [r for r, f in sh.pending.items() if f.done()]:
                future = sh.pending.pop(row)
                tokens = self.turns.resume(sh.r0 + row, future.result())
                if tokens is None:
                    sh.finish(row, sh.held.pop(row, []))
                    finished.append(sh.r0 + row)
                    continue
                tokens = np.asarray(tokens, np.int32).reshape(-1)
                start = sh.known[row]
                if not 0 < len(tokens) < R - start or tokens.min() < 0 or tokens.max() >= V:
                    raise ValueError(
                        f"the turn hook appended {len(tokens)} tokens to row {sh.r0 + row} at "
                        f"response position {start}: they must be 1 to {R - start - 1} ids in "
                        f"[0, {V}) (max_new_tokens={R} leaves the last position to draw); end "
                        "the row instead (return None)"
                    )
                rows.append((row, start, tokens))
        if finished:
            self.trace.append(("finish", tuple(finished)))
        if not any(appends):
            return state
        for chunk in range(0, max(len(rows) for rows in appends), S):
            row_DA = np.full((len(self.shards), S), self.plan.rows, np.int32)
            start_DA, len_DA = np.zeros_like(row_DA), np.zeros_like(row_DA)
            tokens_DAR = np.zeros((len(self.shards), S, R), np.int32)
            for d, rows in enumerate(appends):
                for a, (row, start, tokens) in enumerate(rows[chunk : chunk + S]):
                    row_DA[d, a], start_DA[d, a], len_DA[d, a] = row, start, len(tokens)
                    tokens_DAR[d, a, : len(tokens)] = tokens
            state = programs["append"](self.st, state, *self._put(
                [row_DA, start_DA, len_DA, tokens_DAR]))  # fmt: skip
            self.counts["append_calls"] += 1
        for sh, rows in zip(self.shards, appends):
            for row, _, tokens in rows:
                sh.resume(row, len(tokens))
        self.trace.append(("resume", tuple(sh.r0 + row for sh, rows in zip(self.shards, appends)
                                           for row, _, _ in rows)))  # fmt: skip
        return state

    def __call__(self, programs, dparams, pool, state):
        shards = self.shards
        while True:
            calls = dict(self.counts)
            state = self._resume(programs, state, block=False)
            batches = [sh.prefill_batch() for sh in shards]
            if any(b is not None for b in batches):
                self.counts["prefill_calls"] += 1
                self.trace.append(("prefill", sum((b[-1] for b in batches if b), ())))
                arrays = [b[:-1] if b else sh.idle_prefill() for b, sh in zip(batches, shards)]
                arrays = self._put([np.stack(x) for x in zip(*arrays)])
                if self.st.record_routing:
                    pool, state = programs["prefill_routed"](self.st, dparams, pool, state,
                                                             *arrays)  # fmt: skip
                else:
                    pool = programs["prefill"](self.st, dparams, pool, *arrays)
            for sh in shards:  # the running rows' next pages first, as vLLM schedules
                sh.grow()
            admits = [sh.admissions() for sh in shards]
            if any(a is not None for a in admits):
                self.counts["admit_calls"] += 1
                self.trace.append(("admit", tuple(int(r) for a in admits if a is not None
                                                  for r in a[2][a[0] < len(a[0])])))
                arrays = [a if a is not None else sh.idle_admissions()
                          for a, sh in zip(admits, shards)]  # fmt: skip
                state = programs["admit"](self.st, state,
                                          *self._put([np.stack(x) for x in zip(*arrays)]))
            for sh in shards:
                sh.extend()
            waiting_on_turns = any(sh.pending for sh in shards)
            if not any(sh.decoding() for sh in shards):
                if not any(sh.waiting for sh in shards) and not waiting_on_turns:
                    self.counts.update(
                        prefill_tokens=sum(sh.prefill_tokens for sh in shards),
                        preemptions=sum(sh.preemptions for sh in shards),
                        replayed_tokens=sum(sh.replayed_tokens for sh in shards),
                        prompt_evictions=sum(sh.prompt_evictions for sh in shards),
                        peak_pages=max(sh.peak_pages for sh in shards),
                        peak_rows=max(sh.peak_rows for sh in shards),
                        paused_turns=sum(sh.paused_turns for sh in shards),
                        appended_tokens=sum(sh.appended_tokens for sh in shards),
                        dropped_holds=sum(sh.dropped_holds for sh in shards),
                    )
                    return pool, state
                if calls == self.counts:  # no prefill, no admission
                    if waiting_on_turns:  # nothing to decode until a turn's tokens come
                        state = self._resume(programs, state, block=True)
                        continue
                    # plan_pool rules it out
                    raise RuntimeError(
                        f"the KV pool of {self.plan.num_pages} pages stalled with "
                        f"{sum(len(sh.waiting) for sh in shards)} rows waiting and none "
                        "decoding"
                    )
                continue
            # Short segments while a prefill or a turn hook is pending, so that the waiting
            # rows start soon after they can.
            pending = waiting_on_turns or any(sh.prefill_pending() for sh in shards)
            steps = self.segment_steps if pending else self.st.max_new_tokens
            steps = min([steps] + [sh.max_steps() for sh in shards])
            # With turns a segment ends at the first turn's end (its tool calls start at once).
            refill_at = np.asarray([1 if self.turns is not None else sh.refill_at()
                                    for sh in shards], np.int32)  # fmt: skip
            tables = np.stack([sh.tables for sh in shards])
            pool, state, taken = programs["decode"](
                self.st, dparams, pool, state, *self._put([tables]), jnp.int32(steps),
                *self._put([refill_at]),
            )  # fmt: skip
            self.counts["decode_calls"] += 1
            self.counts["decode_steps"] += int(taken)
            self.trace.append(("decode", int(taken)))
            active = _on_host(state.active_DS)
            stopped = [sh.advance(int(taken), active_S) for sh, active_S in zip(shards, active)]
            self._turn_ends(programs, state, stopped)
