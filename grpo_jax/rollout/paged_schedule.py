"""The paged engine's host side: each data shard's pages, slots, waiting rows and prefill
queue (`Shard`), and the call's lockstep schedule over the shards (`Schedule`): admission by a
promise of pages, growth, preemption and recompute by replay, multi-turn holds (`Turns`) and
finished rows (`Finished`).

The design: `rollout.paged`'s module doc; the programs it calls: `rollout.paged_programs`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed
from grpo_jax.models import paged
from grpo_jax.rollout.paged_pool import PoolPlan
from grpo_jax.rollout.paged_programs import Settings


class Turns(Protocol):
    """What a multi-turn caller tells `sample_paged` when a row stops (rollout.paged's module
    doc).

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


def on_host(x) -> np.ndarray:
    """The whole of an array on this host. Parts that other processes hold are all-gathered:
    the host reads the prompts and the slots that finished through this, so that every process
    schedules every shard alike (and calls the same programs with the same inputs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return distributed.to_host(x)
    return np.asarray(x)


class Shard:
    """The host side of one shard: its pages, slots, waiting rows and prefill queue.

    Group g and row r are the shard's own (0-based); `g0` and `r0` place them in the call.
    A slot's row has written `slot_t` of its own slots (t: one a decode step, from its first
    fed token, the prompt's last) into `slot_pages`, the pages granted to it so far.

    Turns (`sample_paged`'s `turns`): a row whose turn ended leaves its slot but keeps its own
    pages (`held`, holding `written` slots) while it waits (`pending`); once tokens are
    appended it waits at the front of the queue and, admitted, feeds them from `written` on.
    Held pages count as promised; when the pool runs short they are dropped, oldest first,
    before any running row is preempted (the row then recomputes from its first token)."""

    def __init__(self, st: Settings, plan: PoolPlan, prompts, n: int, g0: int,
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


class Schedule:
    """The host side of one call: D shards' schedules, run in lockstep by the programs."""

    def __init__(self, st: Settings, plan: PoolPlan, prompts, n: int, segment_steps: int,
                 shards: int, mesh, turns=None, finished=None) -> None:  # fmt: skip
        self.st, self.plan, self.segment_steps, self.mesh = st, plan, segment_steps, mesh
        self.turns, self.finished = turns, finished
        per = len(prompts) // shards
        self.shards = [Shard(st, plan, prompts[d * per : (d + 1) * per], n, d * per,
                              segment_steps) for d in range(shards)]  # fmt: skip
        # cascade_steps: decode steps that ran the cascade attention (Settings.cascade_groups)
        self.counts = {"decode_calls": 0, "decode_steps": 0, "cascade_steps": 0,
                       "prefill_calls": 0, "admit_calls": 0, "append_calls": 0}  # fmt: skip
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
            pool, state, (taken, cascaded) = programs["decode"](
                self.st, dparams, pool, state, *self._put([tables]), jnp.int32(steps),
                *self._put([refill_at]),
            )  # fmt: skip
            self.counts["decode_calls"] += 1
            self.counts["decode_steps"] += int(taken)
            self.counts["cascade_steps"] += int(cascaded)
            self.trace.append(("decode", int(taken)))
            active = on_host(state.active_DS)
            stopped = [sh.advance(int(taken), active_S) for sh, active_S in zip(shards, active)]
            self._turn_ends(programs, state, stopped)
