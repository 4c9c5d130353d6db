"""The native engine with continuous batching over a paged KV cache (`sample_paged`).

`sampler.sample` holds the KV cache of every row of a step at once. `sample_paged` decodes at
most `max_num_seqs` rows at a time (vLLM's name) from a fixed pool of KV pages
(`models.paged.KVPool`): when a row finishes, its pages go back to the pool and the next
waiting row takes its slot. Its memory is the pool's, whatever the step's size.

How a call runs. The host schedules; the device runs four jitted programs whose shapes are
fixed for the call, so each compiles once per (model, batch shape, settings):
  * `prefill`: chunks of at most `max_num_batched_tokens` prompt tokens (vLLM's name), in
    `[G, C]` batches, write the prompts' keys and values into their pages. A GRPO group's
    prompt is prefilled once; its pages are shared by its n rows (reference-counted: they go
    back to the pool when the last of them finishes). A prompt's last token is not part of
    the shared pages: each row feeds it as its first decode step, into its own pages, so
    every row starts the same way and no logits wait for a slot.
  * `admit`: places waiting rows into free slots (their page tables, first token, position).
  * `decode`: a `lax.while_loop` of decode steps over all slots (idle ones write to the trash
    page), until `max_steps` steps, no live slot, or `refill_at` rows have finished. Each
    slot has its own response position, key and page table.
  * `rollout`: the outputs, as `sampler.Rollout`.
Between programs the host reads which slots finished, frees their pages and admits rows. A
prompt's prefill goes chunk by chunk between decode segments (at most `segment_steps` steps
while a prefill is pending), so a long prompt never stalls the rows in flight.

Memory. A row is admitted only when the pool has pages for its whole response (ceil(R /
page_size), reserved at admission), and a group's prompt pages are allocated when its prefill
starts, only if a row's pages remain free after them: the pool can never deadlock, and a pool
too small for one prompt and one response fails at once with the knobs named. (vLLM allocates
response pages as rows grow and preempts rows when the pool runs out; with reservation the
pool holds `max_num_seqs` full responses.)

Same tokens whatever the schedule. Row b's token at response position t is drawn from its
logits with key fold_in(fold_in(rng, b), t), exactly as `sampler.sample` does; slots, chunk
sizes and admission order never enter. The logits equal `sampler.sample`'s up to float
rounding (the attention is one softmax over gathered pages here, two merged by log-sum-exp
there), so the tokens are the same except where two candidates tie within that rounding.

Kernels. The attention gathers each row's pages and runs XLA's softmax attention on every
platform. TPU's Pallas `ragged_paged_attention` in jax 0.10.2 does not run in interpret mode
on the CPU (`AttributeError: 'ReshapeTransform' object has no attribute 'indices'`), so it
cannot be tested here and is not wired.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import model as model_lib
from grpo_jax import sampler
from grpo_jax.models import decode, paged

# verl 0.9.1's rollout.max_num_seqs / max_num_batched_tokens defaults (vLLM's names).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
PAGE_SIZE = 16  # vLLM's default block_size
SEGMENT_STEPS = 16  # decode steps between prefill chunks while a prefill is pending


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


@flax.struct.dataclass
class PagedState:
    """The decode slots (S = max_num_seqs) and the [B, R] outputs of a `sample_paged` call.

    A slot feeds `tok_S` at position `pos_S` into logical slot `prompt_pages_S * page_size +
    plen_S` of its page table (the prompt's shared pages first, then its own), and draws the
    token at response position `t_S` of rollout row `row_S`.
    """

    rng: jax.Array  # the call's typed key
    tok_S: jax.Array  # int32, the token to feed
    pos_S: jax.Array  # int32, its rotary position
    t_S: jax.Array  # int32, the response position drawn next
    plen_S: jax.Array  # int32, own (non-shared) slots written so far
    prompt_len_S: jax.Array  # int32, tokens in the shared prompt pages (prompt length - 1)
    prompt_pages_S: jax.Array  # int32, shared prompt pages at the head of the page table
    row_S: jax.Array  # int32, rollout row
    active_S: jax.Array  # bool, a row is decoding in the slot
    keys_S: jax.Array  # typed keys, fold_in(rng, row)
    page_table_SM: jax.Array  # int32
    ids_BR: jax.Array
    mask_BR: jax.Array
    log_probs_BR: jax.Array


def _decode(st: _Settings, dparams, pool, state: PagedState, max_steps, refill_at):
    """Decode steps over every slot until max_steps, no live slot, or refill_at finished.

    Returns (pool, state, the steps taken)."""
    P = pool.page_size
    S, M = state.page_table_SM.shape
    B, R = state.ids_BR.shape
    eos = jnp.asarray(st.eos_token_ids, jnp.int32)
    slots = jnp.arange(M * P, dtype=jnp.int32)

    def cond(carry):
        _, state, steps, finished = carry
        return (steps < max_steps) & jnp.any(state.active_S) & (finished < refill_at)

    def body(carry):
        pool, s, steps, finished = carry
        shared_S = s.prompt_pages_S * P
        w_S = shared_S + s.plen_S  # the fed token's logical slot
        page_S = jnp.where(
            s.active_S, jnp.take_along_axis(s.page_table_SM, (w_S // P)[:, None], 1)[:, 0],
            paged.TRASH_PAGE,
        )  # fmt: skip
        valid_SS = s.active_S[:, None] & (
            (slots[None] < s.prompt_len_S[:, None])
            | ((slots[None] >= shared_S[:, None]) & (slots[None] <= w_S[:, None]))
        )
        pages_used = jnp.max(jnp.where(s.active_S, w_S // P + 1, 1))
        x_DS, pool = paged.paged_forward(
            st.config, dparams, pool, s.tok_S[:, None], s.pos_S[:, None], page_S[:, None],
            (w_S % P)[:, None], s.page_table_SM, valid_SS[:, None], pages_used,
        )  # fmt: skip
        logits_SV = decode.head_logits_fm(st.config, dparams, x_DS)
        step_keys_S = jax.vmap(jax.random.fold_in)(s.keys_S, s.t_S)
        tokens_S, values_S = sampler.select_tokens(
            logits_SV, step_keys_S, temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
            logprobs_mode=st.logprobs_mode,
        )  # fmt: skip
        row_S = jnp.where(s.active_S, s.row_S, B)  # idle slots' writes are dropped
        done_S = s.active_S & (jnp.isin(tokens_S, eos) | (s.t_S + 1 >= R))
        s = dataclasses.replace(
            s,
            ids_BR=s.ids_BR.at[row_S, s.t_S].set(tokens_S, mode="drop"),
            mask_BR=s.mask_BR.at[row_S, s.t_S].set(1, mode="drop"),
            log_probs_BR=s.log_probs_BR.at[row_S, s.t_S].set(values_S, mode="drop"),
            tok_S=tokens_S,
            pos_S=s.pos_S + 1,
            t_S=s.t_S + 1,
            plen_S=s.plen_S + 1,
            active_S=s.active_S & ~done_S,
        )
        return pool, s, steps + 1, finished + jnp.sum(done_S)

    pool, state, steps, _ = jax.lax.while_loop(
        cond, body, (pool, state, jnp.int32(0), jnp.int32(0))
    )
    return pool, state, steps


def _prefill(st: _Settings, dparams, pool, tokens_GC, pos_GC, valid_GC, page_table_GM):
    """Writes chunks of prompts (tokens at positions pos_GC; valid_GC False is padding) into
    their pages; a chunk attends to its prompt's slots up to itself."""
    P = pool.page_size
    M = page_table_GM.shape[1]
    page_GC = jnp.where(
        valid_GC, jnp.take_along_axis(page_table_GM, pos_GC // P, 1), paged.TRASH_PAGE
    )
    slots = jnp.arange(M * P, dtype=jnp.int32)
    valid_GCS = slots[None, None] <= pos_GC[:, :, None]
    _, pool = paged.paged_forward(
        st.config, dparams, pool, tokens_GC, pos_GC, page_GC, pos_GC % P, page_table_GM,
        valid_GCS,
    )  # fmt: skip
    return pool


def _admit(state: PagedState, slot_A, row_A, tok_A, pos_A, prompt_len_A, prompt_pages_A,
           page_table_AM) -> PagedState:  # fmt: skip
    """Starts rows row_A in slots slot_A (slot S: no row)."""
    keys_A = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(state.rng, row_A)

    def put(x, v):
        return x.at[slot_A].set(v, mode="drop")

    zeros = jnp.zeros_like(slot_A)
    return dataclasses.replace(
        state,
        tok_S=put(state.tok_S, tok_A),
        pos_S=put(state.pos_S, pos_A),
        t_S=put(state.t_S, zeros),
        plen_S=put(state.plen_S, zeros),
        prompt_len_S=put(state.prompt_len_S, prompt_len_A),
        prompt_pages_S=put(state.prompt_pages_S, prompt_pages_A),
        row_S=put(state.row_S, row_A),
        active_S=put(state.active_S, jnp.ones_like(slot_A, jnp.bool_)),
        keys_S=put(state.keys_S, keys_A),
        page_table_SM=put(state.page_table_SM, page_table_AM),
    )


def _init_state(st: _Settings, rng, *, num_slots: int, num_pages_row: int, rows: int):
    S, R = num_slots, st.max_new_tokens
    zeros = jnp.zeros((S,), jnp.int32)
    return PagedState(
        rng=rng,
        tok_S=zeros,
        pos_S=zeros,
        t_S=zeros,
        plen_S=zeros,
        prompt_len_S=zeros,
        prompt_pages_S=zeros,
        row_S=zeros,
        active_S=jnp.zeros((S,), jnp.bool_),
        keys_S=sampler.row_keys(rng, S),
        page_table_SM=jnp.zeros((S, num_pages_row), jnp.int32),
        ids_BR=jnp.full((rows, R), st.pad_token_id, jnp.int32),
        mask_BR=jnp.zeros((rows, R), jnp.int32),
        log_probs_BR=jnp.zeros((rows, R), jnp.float32),
    )


@functools.cache
def _programs():
    return {
        "decode_params": jax.jit(model_lib.decode_params, static_argnums=0),
        "init": jax.jit(_init_state, static_argnums=0, static_argnames=(
            "num_slots", "num_pages_row", "rows")),  # fmt: skip
        "pool": jax.jit(paged.init_pool, static_argnums=(0, 1, 2)),
        "prefill": jax.jit(_prefill, static_argnums=0, donate_argnums=2),
        "admit": jax.jit(_admit, donate_argnums=0),
        "decode": jax.jit(_decode, static_argnums=0, donate_argnums=(2, 3)),
    }


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The sizes of one call's pool and batches (`plan_pool`)."""

    page_size: int
    num_pages: int  # including the trash page
    max_num_seqs: int  # slots S
    prompt_pages: int  # pages of the longest shared prompt part (Mp)
    response_pages: int  # pages reserved per row (Mr)
    chunk: int  # prefill chunk width C
    chunk_rows: int  # prompts per prefill call G


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
    """The pool and batch sizes of a call: S = min(max_num_seqs, P * n) slots; by default the
    pool holds S responses and the prompts of ceil(S / n) + 1 groups (no row ever waits for
    pages while a slot is free).

    Raises:
      ValueError naming the knob, when a pool (or the knobs) cannot hold one row.
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"rollout.{name}={value} must be >= 1")
    slots = min(max_num_seqs, num_prompts * n)
    prompt_pages = -(-(prompt_width - 1) // page_size)
    response_pages = -(-max_new_tokens // page_size)
    if num_pages is None:
        num_pages = 1 + slots * response_pages + (-(-slots // n) + 1) * prompt_pages
    need = 1 + prompt_pages + response_pages
    if num_pages < need:
        raise ValueError(
            f"a KV pool of {num_pages} pages of {page_size} tokens cannot hold one row: a "
            f"prompt of {prompt_width} tokens and a response of {max_new_tokens} need "
            f"{prompt_pages} + {response_pages} pages plus the trash page ({need}); raise the "
            "pool's pages (num_pages) or the page size, or shorten data.max_prompt_length / "
            "data.max_response_length"
        )
    shared = max(prompt_width - 1, 1)
    chunk = min(-(-shared // page_size) * page_size,
                max(page_size, max_num_batched_tokens // page_size * page_size))  # fmt: skip
    chunk_rows = min(num_prompts, max(1, max_num_batched_tokens // chunk))
    return PoolPlan(page_size, num_pages, slots, prompt_pages, response_pages, chunk, chunk_rows)


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
    stats: dict | None = None,
) -> sampler.Rollout:
    """`sampler.sample` with continuous batching over a paged KV pool (see the module doc).

    Arguments as `sampler.sample`, plus:
      max_num_seqs: rows decoding at once (the slots).
      max_num_batched_tokens: prompt tokens per prefill call.
      page_size / num_pages: the pool (default: `plan_pool`'s).
      segment_steps: decode steps between prefill chunks while a prefill is pending.
      stats: if given, filled with the call's schedule: the `PoolPlan` fields, counts
        (decode calls and steps, prefill calls and tokens, admissions, the peak pages in use
        and rows in flight) and `trace`, the calls in order.

    Returns:
      The same `Rollout` as `sampler.sample` (rows of a prompt adjacent).
    """
    if jax.process_count() > 1:
        raise ValueError(
            f"the paged engine schedules from one process, and this run has "
            f"{jax.process_count()} JAX processes: raise rollout.max_num_seqs to the step's rows "
            "(prompts x n) so that the grouped sampler runs"
        )
    ids_np, mask_np = np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, np.int32)
    eos_token_ids = sampler.check_sampling_args(
        ids_np.shape, mask_np.shape, vocab_size=config.vocab_size, n=n,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
    )  # fmt: skip
    sampler.check_logprobs_mode(logprobs_mode)
    if segment_steps < 1:
        raise ValueError(f"segment_steps={segment_steps} must be >= 1")
    ids_np, mask_np = sampler.bucket_prompts(ids_np, mask_np, pad_token_id=pad_token_id)
    num_prompts, width = ids_np.shape
    prompts = [row[m > 0] for row, m in zip(ids_np, mask_np)]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one real token (prompt_mask all 0)")
    plan = plan_pool(
        num_prompts=num_prompts, n=n, prompt_width=width, max_new_tokens=max_new_tokens,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size, num_pages=num_pages,
    )  # fmt: skip
    st = _Settings(config, max_new_tokens, float(temperature), float(top_p), int(top_k),
                   eos_token_ids, int(pad_token_id), logprobs_mode)  # fmt: skip
    run = _Schedule(st, plan, prompts, n, segment_steps)
    programs = _programs()
    dparams = programs["decode_params"](config, params)
    pool = programs["pool"](config, plan.num_pages, plan.page_size)
    state = programs["init"](
        st, sampler.as_typed_key(jnp.asarray(rng)), num_slots=plan.max_num_seqs,
        num_pages_row=plan.prompt_pages + plan.response_pages, rows=num_prompts * n,
    )  # fmt: skip
    pool, state = run(programs, dparams, pool, state)
    if stats is not None:
        stats.update(dataclasses.asdict(plan), **run.counts, trace=run.trace)
    rollout = sampler.Rollout(
        prompt_ids=jnp.repeat(jnp.asarray(ids_np), n, axis=0),
        prompt_mask=jnp.repeat(jnp.asarray(mask_np), n, axis=0),
        response_ids=state.ids_BR,
        response_mask=state.mask_BR,
        log_probs=state.log_probs_BR,
        group_ids=jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), n),
        weights_version=jnp.int32(weights_version),
    )
    if isinstance(prompt_ids, jax.Array):  # back on the prompts' batch sharding
        rollout = jax.tree.map(
            lambda x: jax.device_put(x, sampler._row_sharding(prompt_ids, x.ndim)), rollout
        )
    return rollout


class _Schedule:
    """The host side of one call: pages, slots, the waiting rows and the prefill queue."""

    def __init__(self, st: _Settings, plan: PoolPlan, prompts, n: int, segment_steps: int):
        self.st, self.plan, self.prompts, self.n = st, plan, prompts, n
        self.segment_steps = segment_steps
        P = plan.page_size
        self.shared_len = [len(p) - 1 for p in prompts]
        self.shared_pages = [-(-s // P) for s in self.shared_len]
        self.prefilled = [0] * len(prompts)  # shared tokens written
        self.group_pages: list[list[int] | None] = [None] * len(prompts)
        self.unfinished = [n] * len(prompts)  # rows of the group not finished
        self.free = list(range(plan.num_pages - 1, paged.TRASH_PAGE, -1))  # a stack
        self.waiting = collections.deque(range(len(prompts) * n))
        self.slot_row = [-1] * plan.max_num_seqs
        self.slot_pages: list[list[int]] = [[] for _ in range(plan.max_num_seqs)]
        self.counts = {"decode_calls": 0, "decode_steps": 0, "prefill_calls": 0,
                       "prefill_tokens": 0, "admit_calls": 0, "peak_pages": 0,
                       "peak_rows": 0}  # fmt: skip
        # ("prefill", groups) / ("admit", rows) / ("decode", steps), in order
        self.trace: list[tuple[str, object]] = []

    def _note_use(self) -> None:
        used = self.plan.num_pages - 1 - len(self.free)
        self.counts["peak_pages"] = max(self.counts["peak_pages"], used)
        rows = sum(r >= 0 for r in self.slot_row)
        self.counts["peak_rows"] = max(self.counts["peak_rows"], rows)

    def __call__(self, programs, dparams, pool, state):
        S = self.plan.max_num_seqs
        while True:
            calls = dict(self.counts)
            pool = self._prefill_some(programs, dparams, pool)
            state = self._admit(programs, state)
            if not any(r >= 0 for r in self.slot_row):
                if not self.waiting:
                    return pool, state
                if calls == self.counts:  # no prefill, no admission: plan_pool rules it out
                    raise RuntimeError(
                        f"the KV pool of {self.plan.num_pages} pages stalled with "
                        f"{len(self.waiting)} rows waiting and none decoding"
                    )
                continue
            steps = self.segment_steps if self._prefill_pending() else self.st.max_new_tokens
            refill_at = max(1, min(len(self.waiting), -(-S // 8))) if self.waiting else S + 1
            pool, state, taken = programs["decode"](
                self.st, dparams, pool, state, jnp.int32(steps), jnp.int32(refill_at)
            )
            self.counts["decode_calls"] += 1
            self.counts["decode_steps"] += int(taken)
            self.trace.append(("decode", int(taken)))
            self._release(np.asarray(state.active_S))

    def _prefill_pending(self) -> bool:
        """A waiting row's group still has prompt tokens to prefill."""
        if not self.waiting:
            return False
        return not self._ready(self.waiting[0] // self.n)

    def _ready(self, g: int) -> bool:
        """Group g's prompt pages are allocated and prefilled: its rows may start."""
        return self.group_pages[g] is not None and self.prefilled[g] >= self.shared_len[g]

    def _prefill_some(self, programs, dparams, pool):
        """One prefill call: the next chunks of the groups of the waiting rows, in order."""
        plan = self.plan
        C, G = plan.chunk, plan.chunk_rows  # G * C <= max_num_batched_tokens
        tokens, pos, valid, tables, groups = [], [], [], [], []
        # Groups of the rows that will take the free slots next (and the slots after them).
        idle = sum(r < 0 for r in self.slot_row)
        ahead = list(dict.fromkeys(r // self.n for r in list(self.waiting)[: idle + self.n]))
        for g in ahead:
            if len(tokens) == G:
                break
            if self.prefilled[g] >= self.shared_len[g]:
                if self.group_pages[g] is None:
                    self.group_pages[g] = []
                continue
            if self.group_pages[g] is None:
                need = self.shared_pages[g]
                if len(self.free) - need < plan.response_pages:
                    break  # a row's response must still fit: prefill later
                self.group_pages[g] = [self.free.pop() for _ in range(need)]
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
            self.counts["prefill_tokens"] += stop - start
            groups.append(g)
        if not tokens or not plan.prompt_pages:
            return pool
        while len(tokens) < G:  # padding rows: all writes to the trash page
            tokens.append(np.zeros((C,), np.int32))
            pos.append(np.arange(C, dtype=np.int32))
            valid.append(np.zeros((C,), bool))
            tables.append(np.zeros((plan.prompt_pages,), np.int32))
        self.counts["prefill_calls"] += 1
        self.trace.append(("prefill", tuple(groups)))
        self._note_use()
        return programs["prefill"](
            self.st, dparams, pool, *(np.stack(x) for x in (tokens, pos, valid, tables))
        )

    def _admit(self, programs, state):
        """Waiting rows whose prompts are prefilled into free slots, while pages last."""
        plan = self.plan
        S, M = plan.max_num_seqs, plan.prompt_pages + plan.response_pages
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
            if len(self.free) < plan.response_pages:
                break
            self.waiting.popleft()
            own = [self.free.pop() for _ in range(plan.response_pages)]
            self.slot_row[slot], self.slot_pages[slot] = row, own
            table = np.zeros((M,), np.int32)
            shared = self.group_pages[g]
            table[: len(shared)] = shared
            table[len(shared) : len(shared) + len(own)] = own
            admitted.append((slot, row, int(self.prompts[g][-1]), self.shared_len[g],
                             self.shared_pages[g], table))  # fmt: skip
        if not admitted:
            return state
        cols = list(zip(*admitted))
        pad = S - len(admitted)
        arrays = [np.concatenate([np.asarray(c, np.int32), np.full((pad,), fill, np.int32)])
                  for c, fill in zip(cols[:5], (S, 0, 0, 0, 0))]  # fmt: skip
        table = np.concatenate([np.stack(cols[5]), np.zeros((pad, M), np.int32)])
        self.counts["admit_calls"] += 1
        self.trace.append(("admit", tuple(a[1] for a in admitted)))
        self._note_use()
        # pos of the fed token: the prompt's last, at position len - 1 = shared_len.
        slot_A, row_A, tok_A, shared_A, pages_A = arrays
        return programs["admit"](state, slot_A, row_A, tok_A, shared_A, shared_A, pages_A, table)

    def _release(self, active_S: np.ndarray) -> None:
        """Frees the pages of the slots that finished (and of groups with no row left)."""
        for slot, row in enumerate(self.slot_row):
            if row < 0 or active_S[slot]:
                continue
            self.free.extend(self.slot_pages[slot])
            self.slot_row[slot], self.slot_pages[slot] = -1, []
            g = row // self.n
            self.unfinished[g] -= 1
            if not self.unfinished[g]:
                self.free.extend(self.group_pages[g] or [])
                self.group_pages[g] = []
