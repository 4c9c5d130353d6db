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
vmapped over D (`spmd_axis_name`), and the host keeps one `paged_schedule.Shard` per shard,
run in lockstep: each program call carries every shard's inputs (an idle shard writes its trash
page).

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
state holds each shard's [Bd, Lm, Tb + R, A]; a prefill chunk (`paged_programs._prefill_routed`,
the program `prefill` becomes) writes its tokens' experts into the prompt columns of its group's
n rows, and each decode step the experts of the token a slot feeds, at column Tb + t - 1 (the
prompt's last at t = 0). A recomputed token (a preempted row, a turn's dropped pages) writes
again the experts it had, and a turn's appended tokens are recorded when they are fed. Off, the
state has no such field and every program is the one without it.

Kernels (`attention`, `models.paged_kernel.resolve`). On a TPU with a bfloat16 model a decode
step's attention is JAX's Pallas TPU paged-attention kernel (`models.paged_kernel`): it reads
only each row's pages, over a pool in the kernel's layout ([K, pages, page_size, H] a layer,
so no transpose on the hot path). XLA cannot partition a Pallas call, so the kernel runs in a
`shard_map` over the mesh: each device on its own shard's pool and its own kv heads, with no
collective. A row's keys are two runs of its table (the shared prompt slots, whose last page
is partly filled, then its own), so the kernel runs once per run and the two merge by
log-sum-exp. Prefill chunks, GPUs, CPUs and float32 pools take the XLA attention, which
gathers the pages it reads. In a decode step it runs in the cascade form (`models.paged.Groups`,
`paged_programs.cascade`; n > 1): the rows in flight are grouped by their shared prompt pages,
each group's prompt pages are gathered once and attended by all its rows' queries together,
each row's own pages alone, and the two parts merge by log-sum-exp; a step whose groups do not
fit the program's (more groups in flight than twice S / n) runs the plain form, every row
gathering its whole table. The kernel is tested on the CPU in Pallas interpret mode
(tests/test_paged_kernel.py): its decode attention equals the XLA one over the pool rounded to
bfloat16 (the kernel reads K and V as bfloat16) within float32 rounding, and a greedy
`sample_paged` call gives the XLA path's tokens, on one device and over data shards and a
tensor axis. TPU's `ragged_paged_attention` (prefill and decode in one kernel) fails in
interpret mode on the CPU in jax 0.10.2 (`AttributeError: 'ReshapeTransform' object has no
attribute 'indices'`), so it is not used.

Modules: this one (`sample_paged`, the face), `paged_pool` (the sizes: `plan_pool`),
`paged_programs` (the device programs) and `paged_schedule` (the host side: `Shard`,
`Schedule`, the `Turns` and `Finished` hooks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import model as model_lib
from grpo_jax import sampler
from grpo_jax.models import paged, paged_kernel
from grpo_jax.rollout import paged_programs
from grpo_jax.rollout.paged_pool import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PAGE_SIZE,
    SEGMENT_STEPS,
    PoolPlan,
    plan_pool,
)
from grpo_jax.rollout.paged_programs import Settings, peak_program
from grpo_jax.rollout.paged_schedule import Finished, Schedule, Turns, on_host

__all__ = [
    "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "PAGE_SIZE", "SEGMENT_STEPS", "PoolPlan", "plan_pool",
    "peak_program", "Finished", "Turns", "sample_paged", "pages", "shard_layout",
]


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
    ids_np, mask_np = (np.asarray(on_host(x), np.int32) for x in (prompt_ids, prompt_mask))
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
    attention = paged_kernel.resolve(attention, kv_dtype=model_lib.cache_dtype(config))
    st = Settings(config, max_new_tokens, float(temperature), float(top_p), int(top_k),
                   eos_token_ids, int(pad_token_id), logprobs_mode, axes, attention,
                   record_routing=bool(record_routing),
                   attend_rows=paged.ATTEND_ROWS if jax.default_backend() == "cpu" else 0,
                   **paged_programs.cascade(attention, plan, n))
    run = Schedule(st, plan, prompts, n, segment_steps, shards, mesh, turns, finished)
    programs = paged_programs.programs(sampler._platform(prompt_ids))
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
