"""The paged engine (`grpo_jax.rollout.paged`): the same rollout as `sampler.sample` whatever
the schedule, a pool that is bounded and reused, and clear errors."""

import collections
import concurrent.futures
import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import whole_context

from grpo_jax import model, sampler
from grpo_jax.models import paged as paged_model
from grpo_jax.rollout import paged, paged_programs, paged_schedule

_PAD, _EOS = 0, 3


@pytest.fixture(scope="module")
def tiny():
    config = model.ModelConfig.tiny()
    return config, model.init_params(config, jax.random.key(0))


def _prompts(lengths, vocab, seed):
    """Left-padded prompts of the given lengths (ids in [4, vocab): no EOS, no pad)."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.full((len(lengths), width), _PAD, np.int32)
    mask = np.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, width - length :] = rng.integers(4, vocab, size=length)
        mask[i, width - length :] = 1
    return ids, mask


def _assert_same_rollout(config, params, ids, mask, rng, ref, out, *, temperature, top_k, top_p):
    """Equal tokens, masks and (1e-5) log-probs; where a row parts from the reference, it must
    be at a near-tie of the reference's own logits there (greedy: the two tokens' logits
    within 1e-4; sampled: the row's uniform within 1e-4 of a CDF boundary between them)."""
    np.testing.assert_array_equal(np.asarray(out.prompt_ids), np.asarray(ref.prompt_ids))
    np.testing.assert_array_equal(np.asarray(out.group_ids), np.asarray(ref.group_ids))
    got, want = np.asarray(out.response_ids), np.asarray(ref.response_ids)
    n = got.shape[0] // ids.shape[0]
    parted = []
    for b in np.flatnonzero((got != want).any(axis=1)):
        t = int(np.argmax(got[b] != want[b]))
        prompt = ids[b // n][mask[b // n] > 0]
        seq = np.concatenate([prompt, want[b, :t]])[None]
        logits = model.forward(config, params, jnp.asarray(seq), jnp.ones_like(seq))[0, -1]
        a, c = int(want[b, t]), int(got[b, t])
        if temperature == 0:
            gap = abs(float(logits[a] - logits[c]))
        else:
            logp = jax.nn.log_softmax(logits / temperature)
            probs = np.exp(np.asarray(sampler.top_k_top_p_filter(logp, top_k=top_k, top_p=top_p)))
            cdf = np.cumsum(probs / probs.sum())
            key = jax.random.fold_in(jax.random.fold_in(rng, b), t)
            u = float(jax.random.uniform(key))
            gap = float(np.min(np.abs(cdf[min(a, c) : max(a, c)] - u)))
        assert gap <= 1e-4, f"row {b} parts at response token {t} ({a} vs {c}), gap {gap}"
        parted.append(b)
    same = np.setdiff1d(np.arange(got.shape[0]), parted)
    for field in ("response_mask", "log_probs"):
        x, y = np.asarray(getattr(out, field))[same], np.asarray(getattr(ref, field))[same]
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5, err_msg=field)
    assert len(parted) <= max(1, got.shape[0] // 10), f"{len(parted)} rows parted"


def _mixed_case(config, params, temperature, top_k, top_p):
    """Prompts of lengths 1 (nothing shared: the prompt is the row's first fed token) to past a
    page, n = 3, an EOS that the rollout draws mid-way (some rows end early) and a 20-token cap
    (the rest stop at the length): (ids, mask, rng, sampling kwargs, `sampler.sample`'s)."""
    ids, mask = _prompts([5, 9, 1, 17, 3, 30], config.vocab_size, seed=1)
    rng = jax.random.key(7)
    kw = dict(n=3, max_new_tokens=20, temperature=temperature, top_k=top_k, top_p=top_p,
              pad_token_id=_PAD)  # fmt: skip
    drawn = np.asarray(sampler.sample(config, params, ids, mask, rng, **kw).response_ids)
    kw["eos_token_ids"] = (int(drawn[0, 6]),)
    return ids, mask, rng, kw, sampler.sample(config, params, ids, mask, rng, **kw)


_SCHEDULES = {  # max_num_seqs, page_size, max_num_batched_tokens, segment_steps
    "all rows at once": (1024, 16, 8192, 16),
    "4 slots, small pages, one chunk a call": (4, 4, 8, 3),
    "5 slots, chunks of 16": (5, 8, 16, 16),
    "one slot": (1, 2, 4, 2),
}


@pytest.mark.parametrize("schedule", list(_SCHEDULES), ids=list(_SCHEDULES))
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.8, 5, 0.9)],
    ids=["greedy", "sampled", "top-k-top-p"],
)  # fmt: skip
def test_the_rollout_is_sampler_samples_whatever_the_schedule(
    tiny, schedule, temperature, top_k, top_p
):
    config, params = tiny
    ids, mask, rng, kw, ref = _mixed_case(config, params, temperature, top_k, top_p)
    seqs, page, batched, segment = _SCHEDULES[schedule]
    stats = {}
    out = paged.sample_paged(
        config, params, ids, mask, rng, max_num_seqs=seqs, page_size=page,
        max_num_batched_tokens=batched, segment_steps=segment, stats=stats, **kw,
    )  # fmt: skip
    _assert_same_rollout(config, params, ids, mask, rng, ref, out, temperature=temperature,
                         top_k=top_k, top_p=top_p)  # fmt: skip
    lengths = np.asarray(mask).sum(axis=1)
    # Every prompt is prefilled once, whatever the slots: its n rows share its pages.
    assert stats["prefill_tokens"] == int(np.sum(lengths - 1))
    assert stats["peak_rows"] <= min(seqs, 18)
    assert stats["peak_pages"] <= stats["num_pages"] - 1
    # The CPU's XLA attention ran in the cascade form (groups of n rows read their shared
    # prompt pages once) on the steps where the groups in flight fit (all, with every row in
    # flight), the plain form on the others.
    assert 0 < stats["cascade_steps"] <= stats["decode_steps"]
    if seqs >= 18:
        assert stats["cascade_steps"] == stats["decode_steps"]
    mask_out = np.asarray(out.response_mask)
    assert (mask_out.sum(axis=1) < 20).any() and (mask_out.sum(axis=1) == 20).any()


@pytest.mark.parametrize("logprobs_mode", sampler.LOGPROBS_MODES)
def test_logprobs_modes_are_the_samplers(tiny, logprobs_mode):
    config, params = tiny
    ids, mask = _prompts([6, 2, 11], config.vocab_size, seed=2)
    kw = dict(n=2, max_new_tokens=8, temperature=0.7, top_k=7, eos_token_ids=(_EOS,),
              logprobs_mode=logprobs_mode)  # fmt: skip
    ref = sampler.sample(config, params, ids, mask, jax.random.key(3), **kw)
    out = paged.sample_paged(config, params, ids, mask, jax.random.key(3), max_num_seqs=3,
                             page_size=4, **kw)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.response_ids), np.asarray(ref.response_ids))
    np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(ref.log_probs), atol=1e-5)


def test_finished_rows_give_their_slots_and_pages_to_waiting_rows(tiny):
    config, params = tiny
    ids, mask = _prompts([4, 4, 4, 4], config.vocab_size, seed=3)
    stats = {}
    paged.sample_paged(config, params, ids, mask, jax.random.key(0), n=4, max_new_tokens=12,
                       eos_token_ids=(_EOS,), max_num_seqs=4, page_size=4, stats=stats)  # fmt: skip
    # 16 rows through 4 slots: admitted in several waves, never more than 4 at once, and the
    # pool (1 trash + 4 rows x 3 response pages + 2 groups x the prompt pages of the bucketed
    # width, 63 shared tokens: 16) never overflows.
    admitted = [r for kind, rows in stats["trace"] if kind == "admit" for r in rows]
    assert sorted(admitted) == list(range(16)) and admitted == sorted(admitted)
    assert stats["admit_calls"] >= 4 and stats["peak_rows"] == 4
    assert stats["num_pages"] == 1 + 4 * 3 + 2 * 16
    assert stats["peak_pages"] <= stats["num_pages"] - 1


def test_a_long_prompt_is_prefilled_between_decode_segments(tiny):
    config, params = tiny
    # Group 0 is short; group 1's 40 shared tokens take 5 chunks of 8 while group 0 decodes.
    ids, mask = _prompts([3, 41], config.vocab_size, seed=4)
    stats = {}
    out = paged.sample_paged(
        config, params, ids, mask, jax.random.key(1), n=2, max_new_tokens=24, temperature=1.0,
        max_num_seqs=4, page_size=8, max_num_batched_tokens=8, segment_steps=2, stats=stats,
    )  # fmt: skip
    kinds = [kind for kind, _ in stats["trace"]]
    first_decode = kinds.index("decode")
    assert "prefill" in kinds[first_decode:], stats["trace"]
    chunks_of_1 = [i for i, (kind, g) in enumerate(stats["trace"]) if kind == "prefill" and 1 in g]
    assert len(chunks_of_1) == 5
    assert any(kinds[i] == "decode" for i in range(chunks_of_1[0], chunks_of_1[-1]))
    ref = sampler.sample(config, params, ids, mask, jax.random.key(1), n=2, max_new_tokens=24,
                         temperature=1.0)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.response_ids), np.asarray(ref.response_ids))


def test_each_program_compiles_once_per_shape(tiny):
    config, params = tiny
    kw = dict(n=2, max_new_tokens=10, eos_token_ids=(_EOS,), max_num_seqs=3, page_size=4,
              max_num_batched_tokens=16)  # fmt: skip
    ids, mask = _prompts([7, 2, 5], config.vocab_size, seed=5)
    paged.sample_paged(config, params, ids, mask, jax.random.key(0), **kw)
    programs = paged_programs.programs()
    sizes = {name: fn._cache_size() for name, fn in programs.items()}
    # Other prompts of the same bucket, another key: other schedules, no new program.
    ids, mask = _prompts([3, 9, 1], config.vocab_size, seed=6)
    paged.sample_paged(config, params, ids, mask, jax.random.key(5), **kw)
    assert {name: fn._cache_size() for name, fn in programs.items()} == sizes


def test_a_pool_too_small_for_one_row_names_the_knobs(tiny):
    config, params = tiny
    ids, mask = _prompts([30], config.vocab_size, seed=0)
    # The prompt bucket of 64 tokens: 63 shared, 8 pages of 8; a 16-token response: 2 pages;
    # and the trash page.
    for num_pages, what in ((9, "its prompt and one page"), (10, "its full length")):
        with pytest.raises(ValueError, match=rf"cannot hold one row \({what}") as e:
            paged.sample_paged(config, params, ids, mask, jax.random.key(0), n=2,
                               max_new_tokens=16, page_size=8, num_pages=num_pages)  # fmt: skip
        for knob in ("rollout.num_gpu_blocks_override", "num_pages", "page size",
                     "max_prompt_length", "max_response_length"):  # fmt: skip
            assert knob in str(e.value)
    paged.plan_pool(num_prompts=1, n=2, prompt_width=64, max_new_tokens=16, page_size=8,
                    num_pages=11)  # one row's full length: enough
    with pytest.raises(ValueError, match="rollout.max_num_seqs=0"):
        paged.plan_pool(num_prompts=1, n=1, prompt_width=4, max_new_tokens=4, max_num_seqs=0)


def test_a_response_longer_than_any_decode_bucket_needs_only_its_slots_pages(tiny):
    """Long responses (the long-CoT recipes' 32K, here 2,048 tokens on the tiny model): the
    pool holds the pages of the rows in flight, not a full-length cache for every row of the
    call, and the tokens are `sampler.sample`'s (whose response cache is sized for the call)."""
    config, params = tiny
    ids, mask = _prompts([5, 3, 6], config.vocab_size, seed=4)
    R, rng, stats = 2048, jax.random.key(7), {}
    assert R - 1 > model.MAX_DECODE_BLOCKS * model.DECODE_BLOCK  # past the grouped cache's
    kw = dict(n=2, max_new_tokens=R, temperature=1.0)  # no EOS: every row runs to R tokens
    out = paged.sample_paged(config, params, ids, mask, rng, max_num_seqs=2, page_size=64,
                             stats=stats, **kw)  # fmt: skip
    ref = sampler.sample(config, params, ids, mask, rng, **kw)
    _assert_same_rollout(config, params, ids, mask, rng, ref, out, temperature=1.0, top_k=-1,
                         top_p=1.0)  # fmt: skip
    assert int(np.asarray(out.response_mask).sum()) == 6 * R
    # 6 rows through 2 slots: the pool is 2 rows' response pages (R - 1 slots each: the last
    # token is never fed back) plus prompt pages, a third of what all 6 rows would need.
    response_pages = -(-(R - 1) // 64)
    assert stats["peak_rows"] == 2
    assert stats["num_pages"] < 3 * response_pages
    assert stats["peak_pages"] >= 2 * response_pages
    assert stats["preemptions"] == 0  # the default pool never preempts


def test_a_long_response_grows_its_pages_in_a_pool_smaller_than_slots_times_its_length(tiny):
    """Issue 32's long responses: 4 slots of 2,048-token responses from a pool of one full
    row and a few pages (the pool is nowhere near slots x R): rows grow page by page, the
    newest are preempted and replayed, and the tokens are still `sampler.sample`'s."""
    config, params = tiny
    ids, mask = _prompts([5, 3], config.vocab_size, seed=4)
    R, P, rng, stats = 2048, 64, jax.random.key(7), {}
    response_pages = R // P
    num_pages = 1 + 1 + response_pages + 8  # trash, the prompt's page, one row, 8 spare
    assert (num_pages - 1) * P < 4 * R
    kw = dict(n=2, max_new_tokens=R, temperature=1.0)  # no EOS: every row runs to R tokens
    out = paged.sample_paged(config, params, ids, mask, rng, max_num_seqs=4, page_size=P,
                             num_pages=num_pages, segment_steps=64, stats=stats, **kw)  # fmt: skip
    ref = sampler.sample(config, params, ids, mask, rng, **kw)
    _assert_same_rollout(config, params, ids, mask, rng, ref, out, temperature=1.0, top_k=-1,
                         top_p=1.0)  # fmt: skip
    assert int(np.asarray(out.response_mask).sum()) == 4 * R
    assert stats["preemptions"] > 1 and stats["peak_rows"] > 1
    assert stats["peak_pages"] <= num_pages - 1


def _random_pool(config, num_pages, P, rng):
    """A pool of `num_pages` pages of P slots holding random keys and values."""
    pool = paged_model.init_pool(config, num_pages, P)
    return paged_model.KVPool(
        k=tuple(jnp.asarray(rng.standard_normal(k.shape), k.dtype) for k in pool.k),
        v=tuple(jnp.asarray(rng.standard_normal(v.shape), v.dtype) for v in pool.v),
    )


def test_page_blocks_cover_every_count():
    for m in (1, 2, 7, 28, 200):
        b = paged_model.block_pages(m)
        assert b * paged_model.PAGE_BLOCKS >= m > (b - 1) * paged_model.PAGE_BLOCKS


def test_a_rows_attention_does_not_depend_on_how_many_page_blocks_run(tiny):
    """A decode step's attention reads the pages in blocks, as many as the longest row needs
    (`pages_used`): the blocks past a row's slots add nothing to it, so its output is the same
    bit for bit however many run, and the one softmax over all its pages' up to float order
    (the page blocks' partial sums merged instead of one sum)."""
    config, params = tiny
    dparams = model.decode_params(config, params)
    B, M, P = 6, 19, 4  # 10 blocks of 2 pages, the last one padded with a trash page
    rng = np.random.default_rng(1)
    pool = _random_pool(config, 1 + B * M, P, rng)
    table = jnp.asarray(1 + rng.permutation(B * M).reshape(B, M), jnp.int32)
    own_len = np.array([1, 5, 12, 13, 30, 0])  # 1 to 8 pages; row 5 idle
    spans = paged_model.paged_kernel.Spans(
        jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.asarray(own_len, jnp.int32)
    )  # fmt: skip
    w = np.maximum(own_len - 1, 0)
    args = (jnp.asarray(rng.integers(4, config.vocab_size, (B, 1)), jnp.int32),
            jnp.asarray(w, jnp.int32)[:, None],
            jnp.asarray(np.where(own_len > 0, np.asarray(table)[np.arange(B), w // P],
                                 paged_model.TRASH_PAGE), jnp.int32)[:, None],
            jnp.asarray(w % P, jnp.int32)[:, None], table)  # fmt: skip
    run = jax.jit(functools.partial(paged_model.paged_forward, config, spans=spans))
    live = own_len > 0
    x_all = np.asarray(run(dparams, pool, *args)[0])  # one softmax over every page
    x_every = np.asarray(run(dparams, pool, *args, pages_used=jnp.int32(M))[0])
    # Each live row alone, then all of them: the blocks they need, then every block.
    for r in [[i] for i in live.nonzero()[0]] + [live.nonzero()[0]]:
        need = jnp.asarray(-(-int(own_len[r].max()) // P), jnp.int32)
        x_need = np.asarray(run(dparams, pool, *args, pages_used=need)[0])
        np.testing.assert_array_equal(x_need[:, r], x_every[:, r])
        numerics.assert_close(x_need[:, r], x_all[:, r], ulps=8)


@pytest.mark.parametrize("T", [1, 3], ids=["decode", "prefill chunk"])
def test_the_attention_in_chunks_of_rows_is_the_attention_of_all_rows(tiny, T):
    """`attend_rows` only cuts the batch into chunks (the last one padded with masked rows):
    every row's output and the written pool are those of all rows at once, with and without
    the page blocks."""
    config, params = tiny
    dparams = model.decode_params(config, params)
    B, M, P = 7, 5, 4
    rng = np.random.default_rng(0)
    pool = _random_pool(config, 1 + B * M, P, rng)
    table = jnp.asarray(1 + rng.permutation(B * M).reshape(B, M), jnp.int32)
    pos = jnp.asarray(rng.integers(0, M * P - T, (B, 1)) + np.arange(T), jnp.int32)
    valid = (np.arange(M * P) <= np.asarray(pos)[:, :, None]) & (rng.random((B, T, M * P)) < 0.8)
    valid |= np.arange(M * P) == np.asarray(pos)[:, :, None]  # each token sees its own slot
    args = (jnp.asarray(rng.integers(4, config.vocab_size, (B, T)), jnp.int32), pos,
            jnp.take_along_axis(table, pos // P, 1), pos % P, table, jnp.asarray(valid))
    used = jnp.asarray(int(np.asarray(pos).max()) // P + 1, jnp.int32)
    for pages_used in (None, used):
        run = jax.jit(functools.partial(paged_model.paged_forward, config, pages_used=pages_used),
                      static_argnames="attend_rows")  # fmt: skip
        x_all, pool_all = run(dparams, pool, *args, attend_rows=0)
        for rows in (3, 4):
            x, pool_rows = run(dparams, pool, *args, attend_rows=rows)
            numerics.assert_close(x, x_all, ulps=4, err_msg=f"rows={rows}")
            for a, b in zip(jax.tree.leaves(pool_rows), jax.tree.leaves(pool_all)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _cascade_case(config, B=8, Mp=2, Mo=4, P=4, seed=0):
    """A decode step over a random pool: rows 0-2 share prompt pages (6 slots), rows 3-4
    others (8 slots, the prompt ending on a page boundary), row 5 a one-row group (3 slots),
    row 6 is idle and row 7 has no shared slots; each row's own pages follow."""
    rng = np.random.default_rng(seed)
    pool = _random_pool(config, 1 + 4 * Mp + B * Mo, P, rng)
    group = np.array([0, 0, 0, 1, 1, 2, 3, 3])
    shared_len = np.array([6, 6, 6, 8, 8, 3, 0, 0])
    own_len = np.array([1, 5, 16, 9, 2, 12, 0, 7])
    table = np.zeros((B, Mp + Mo), np.int32)
    own = 1 + 4 * Mp + rng.permutation(B * Mo).reshape(B, Mo)
    for b in range(B):
        table[b, :Mp] = 1 + group[b] * Mp + np.arange(Mp)
        table[b, Mp:] = own[b]
    spans = paged_model.paged_kernel.Spans(
        jnp.asarray(shared_len, jnp.int32), jnp.full((B,), Mp, jnp.int32),
        jnp.asarray(own_len, jnp.int32),
    )  # fmt: skip
    w = Mp * P + np.maximum(own_len - 1, 0)  # the fed token's logical slot
    write_page = np.where(own_len > 0, table[np.arange(B), w // P], paged_model.TRASH_PAGE)
    args = (jnp.asarray(rng.integers(4, config.vocab_size, (B, 1)), jnp.int32),
            jnp.asarray(shared_len + own_len, jnp.int32)[:, None],
            jnp.asarray(write_page, jnp.int32)[:, None], jnp.asarray(w % P, jnp.int32)[:, None],
            jnp.asarray(table))  # fmt: skip
    return pool, spans, args


def test_rows_are_grouped_by_their_shared_pages(tiny):
    """`group_rows` puts the rows that share a first page in one group, one place each; the
    idle row and the row with no shared slots in none."""
    config, _ = tiny
    _, spans, args = _cascade_case(config)
    table = args[-1]
    groups = paged_model.group_rows(table, spans, 4, groups=3, members=3)
    assert bool(groups.use) and int(groups.own_pages) == 4
    members, slot = np.asarray(groups.members_GN), np.asarray(groups.slot_B)
    assert sorted(sorted(r for r in g if r < 8) for g in members.tolist()) == [
        [0, 1, 2], [3, 4], [5]]
    for b in range(8):  # each grouped row sits where its slot says, the others nowhere
        assert (slot[b] < 9) == (b < 6)
        if b < 6:
            assert members.reshape(-1)[slot[b]] == b
    # Too few groups or too few members a group: the plain attention runs.
    assert not bool(paged_model.group_rows(table, spans, 4, groups=2, members=3).use)
    assert not bool(paged_model.group_rows(table, spans, 4, groups=3, members=2).use)


def test_the_cascade_attention_is_the_attention_of_each_rows_pages(tiny):
    """The cascade form (each group's prompt pages once for its rows' queries, merged with
    each row's own pages by log-sum-exp) gives every row the plain attention's output up to
    float rounding (rows in flight; so are the keys and values the later layers write), with
    and without page blocks and chunks of rows; where the groups do not fit it runs the plain
    attention itself (bit for bit)."""
    config, params = tiny
    dparams = model.decode_params(config, params)
    pool, spans, args = _cascade_case(config)
    table = args[-1]
    used = jnp.asarray(6, jnp.int32)
    run = jax.jit(functools.partial(paged_model.paged_forward, config, spans=spans),
                  static_argnames=("attend_rows", "shared_pages"))  # fmt: skip
    for pages_used, rows in ((None, 0), (used, 0), (used, 3)):
        x_plain, pool_plain = run(dparams, pool, *args, pages_used=pages_used, attend_rows=rows)
        for G, N, fits in ((3, 3, True), (8, 4, True), (2, 3, False)):
            groups = paged_model.group_rows(table, spans, 4, groups=G, members=N)
            x, pool_out = run(dparams, pool, *args, pages_used=pages_used, attend_rows=rows,
                              groups=groups, shared_pages=2)  # fmt: skip
            pools = [(np.asarray(a), np.asarray(b))
                     for a, b in zip(jax.tree.leaves(pool_out), jax.tree.leaves(pool_plain))]
            if fits:  # the idle row 6 attends to nothing: its output is never used, its
                # writes go to the trash page
                live = np.asarray(spans.own_len_B) > 0
                numerics.assert_close(x[:, live], x_plain[:, live], ulps=8,
                                      err_msg=f"{G}x{N}, rows={rows}")  # fmt: skip
                trash = paged_model.TRASH_PAGE
                for a, b in pools:
                    numerics.assert_close(np.delete(a, trash, 0), np.delete(b, trash, 0), ulps=8)
            else:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(x_plain))
                for a, b in pools:
                    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("schedule", ["all rows at once", "5 slots, chunks of 16"])
def test_the_rollout_with_the_attention_in_chunks_of_rows_is_sampler_samples(
    tiny, schedule, monkeypatch
):
    """The engine with the XLA attention over a few rows at a time (the CPU's schedule of many
    rows in flight, `models.paged.ATTEND_ROWS`) still samples `sampler.sample`'s rollout."""
    monkeypatch.setattr(paged_model, "ATTEND_ROWS", 4)
    config, params = tiny
    ids, mask, rng, kw, ref = _mixed_case(config, params, 1.0, -1, 1.0)
    seqs, page, batched, segment = _SCHEDULES[schedule]
    out = paged.sample_paged(
        config, params, ids, mask, rng, max_num_seqs=seqs, page_size=page,
        max_num_batched_tokens=batched, segment_steps=segment, **kw,
    )  # fmt: skip
    _assert_same_rollout(config, params, ids, mask, rng, ref, out, temperature=1.0, top_k=-1,
                         top_p=1.0)  # fmt: skip


def test_the_native_engine_pages_steps_of_more_than_max_num_seqs_rows_a_shard(
    tiny, tmp_path, monkeypatch
):
    # rollout.max_num_seqs -> setup.make_engine -> NativeEngine: on the trainer's 8-device FSDP
    # mesh (sharded params, sharded prompts), a step of 8 x 2 = 16 rows, 2 a data shard, takes
    # the paged engine with 1 slot a shard (each shard its own pool), and the grouped sampler
    # with 2; the same rollout, on the same sharding.
    from grpo_jax import config as config_lib
    from grpo_jax import sharding
    from grpo_jax.rollout import engines
    from grpo_jax.trainer import setup

    config, params = tiny
    mesh = sharding.make_mesh((1, 8, 1))
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        params = jax.device_put(params, sharding.param_shardings(config, mesh,
                                                                 sharding.LOGICAL_RULES))
    ids, mask = _prompts([6, 2, 13, 1, 4, 9, 3, 7], config.vocab_size, seed=8)
    sp = engines.SamplingParams(n=2, max_new_tokens=9, temperature=1.0, top_k=30)
    calls = []
    monkeypatch.setattr(paged, "sample_paged", lambda *a, **k: calls.append(k) or
                        _real_sample_paged(*a, **k, stats=k.setdefault("stats", {})))  # fmt: skip
    out = {}
    for seqs in (1, 2):
        run = config_lib.RunConfig(rollout=config_lib.RolloutConfig(max_num_seqs=seqs))
        engine = setup.make_engine(run, config, mesh, eos_ids=(_EOS,), pad_id=_PAD,
                                   workdir=str(tmp_path))  # fmt: skip
        out[seqs] = engine.sample(params, ids, mask, jax.random.key(4), sp)
    assert len(calls) == 1 and calls[0]["max_num_seqs"] == 1
    assert calls[0]["max_num_batched_tokens"] == 8192
    assert calls[0]["stats"]["shards"] == 8 and calls[0]["stats"]["peak_rows"] == 1
    for field in ("prompt_ids", "response_ids", "response_mask", "group_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(out[1], field)),
                                      np.asarray(getattr(out[2], field)))  # fmt: skip
    np.testing.assert_allclose(np.asarray(out[1].log_probs), np.asarray(out[2].log_probs),
                               atol=1e-5)  # fmt: skip
    assert out[1].response_ids.sharding.is_equivalent_to(out[2].response_ids.sharding, 2)
    # rollout.kv_cache_dtype reaches the engine's model config, whose cache_dtype the pool and
    # the grouped cache store (tests/test_model.py); the trainer's own config keeps "auto"
    run = config_lib.RunConfig(rollout=config_lib.RolloutConfig(kv_cache_dtype="bfloat16"))
    engine = setup.make_engine(run, config, mesh, eos_ids=(_EOS,), pad_id=_PAD,
                               workdir=str(tmp_path))  # fmt: skip
    assert model.cache_dtype(engine.model_config) == jnp.bfloat16
    assert model.cache_dtype(config) == jnp.float32


def _on_mesh(config, params, mesh, ids, mask):
    """The params on the trainer's shardings and the prompts split over the batch axes."""
    from grpo_jax import sharding

    params = jax.device_put(params, sharding.param_shardings(config, mesh, sharding.LOGICAL_RULES))
    return (params, *(jax.device_put(x, sharding.batch_sharding(mesh, 2)) for x in (ids, mask)))


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)], ids=["data 8", "data 2 fsdp 2 tp 2"])
def test_each_data_shard_holds_its_own_pool_and_slots(tiny, mesh_shape):
    # The pool and the slots split over the prompts' batch axes (one pool a shard, split by KV
    # head over the tensor axis), each shard's rows are its block of the rollout, and the
    # rollout is still the grouped sampler's.
    from grpo_jax import sharding

    config, params = tiny
    mesh = sharding.make_mesh(mesh_shape)
    ids, mask = _prompts([5, 9, 2, 7, 3, 11, 4, 6], config.vocab_size, seed=9)
    kw = dict(n=3, max_new_tokens=10, temperature=1.0, eos_token_ids=(_EOS,))
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        params, sids, smask = _on_mesh(config, params, mesh, ids, mask)
        stats = {}
        out = paged.sample_paged(config, params, sids, smask, jax.random.key(2), max_num_seqs=2,
                                 page_size=4, stats=stats, **kw)  # fmt: skip
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        assert stats["shards"] == shards and stats["max_num_seqs"] == 2
        st = paged_programs.Settings(config, 10, 1.0, 1.0, -1, (_EOS,), _PAD, "processed_logprobs",
                             sharding.BATCH_AXES)  # fmt: skip
        pool = paged_programs.programs()["pool"](st, shards, stats["num_pages"], 4)
    K, H = config.num_kv_heads, config.head_dim
    for x in pool.k:
        assert x.shape == (shards, stats["num_pages"], K, H, 4)
        assert x.sharding.shard_shape(x.shape) == (1, stats["num_pages"],
                                                   K // mesh.shape["tensor"], H, 4)
    admitted = [r for kind, rows in stats["trace"] if kind == "admit" for r in rows]
    assert sorted(admitted) == list(range(24))
    ref = sampler.sample(config, params, ids, mask, jax.random.key(2), **kw)
    _assert_same_rollout(config, params, ids, mask, jax.random.key(2), ref, out,
                         temperature=1.0, top_k=-1, top_p=1.0)  # fmt: skip
    assert out.response_ids.sharding.is_equivalent_to(sids.sharding, 2)


def _one_row_pages(ids, mask, *, page_size, max_new_tokens):
    """The pages of one row's full length (the smallest pool `plan_pool` takes): the trash
    page, the pages of the bucketed prompt width and of a full response."""
    width = sampler.bucket_prompts(ids, mask, pad_token_id=_PAD)[0].shape[1]
    return 1 + -(-(width - 1) // page_size) + -(-max_new_tokens // page_size)


_GROWTH = {  # max_num_seqs, page_size, max_num_batched_tokens, segment_steps, spare pages
    # Pools of one full row's pages and a few more: rows grow, and the newest are preempted.
    "4 slots, pages of 4, tight": (4, 4, 8, 3, 1),
    "6 slots, pages of 2, tight": (6, 2, 16, 2, 2),
    "3 slots, pages of 8, chunks of 8": (3, 8, 8, 4, 0),
    "5 slots, pages of 4, 5 spare": (5, 4, 16, 4, 5),
}


@pytest.mark.parametrize("schedule", list(_GROWTH), ids=list(_GROWTH))
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (0.8, 5, 0.9)],
                         ids=["greedy", "top-k-top-p"])  # fmt: skip
def test_rows_grow_their_pages_and_preempted_rows_end_as_sampler_samples(
    tiny, schedule, temperature, top_k, top_p
):
    config, params = tiny
    ids, mask, rng, kw, ref = _mixed_case(config, params, temperature, top_k, top_p)
    seqs, page, batched, segment, spare = _GROWTH[schedule]
    num_pages = _one_row_pages(ids, mask, page_size=page, max_new_tokens=20) + spare
    stats = {}
    out = paged.sample_paged(
        config, params, ids, mask, rng, max_num_seqs=seqs, page_size=page,
        max_num_batched_tokens=batched, segment_steps=segment, num_pages=num_pages,
        stats=stats, **kw,
    )  # fmt: skip
    _assert_same_rollout(config, params, ids, mask, rng, ref, out, temperature=temperature,
                         top_k=top_k, top_p=top_p)  # fmt: skip
    # The pool is below the default (one that never preempts), rows ran side by side in it,
    # and the preempted ones replayed the tokens they had drawn.
    assert num_pages < stats["reserve_pages"]
    assert stats["peak_rows"] > 1 and stats["peak_pages"] <= num_pages - 1
    assert stats["preemptions"] > 0 and stats["replayed_tokens"] > 0


def test_preemption_on_each_data_shards_own_pool(tiny):
    from grpo_jax import sharding

    config, params = tiny
    mesh = sharding.make_mesh((8, 1, 1))
    # Prompts of about the bucket's width (64), so a group's pages take most of the pool.
    ids, mask = _prompts([60, 63, 58, 61, 62, 59, 63, 57] * 2, config.vocab_size, seed=9)
    kw = dict(n=3, max_new_tokens=16, temperature=1.0)
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        params, sids, smask = _on_mesh(config, params, mesh, ids, mask)
        stats = {}
        out = paged.sample_paged(config, params, sids, smask, jax.random.key(2), max_num_seqs=3,
                                 page_size=4, segment_steps=2,
                                 num_pages=_one_row_pages(ids, mask, page_size=4,
                                                          max_new_tokens=16) + 2,
                                 stats=stats, **kw)  # fmt: skip
    assert stats["shards"] == 8 and stats["preemptions"] > 1
    ref = sampler.sample(config, params, ids, mask, jax.random.key(2), **kw)
    _assert_same_rollout(config, params, ids, mask, jax.random.key(2), ref, out,
                         temperature=1.0, top_k=-1, top_p=1.0)  # fmt: skip


_real_sample_paged = paged.sample_paged


@pytest.mark.slow
def test_the_loop_pages_its_rollouts_and_resumes_exactly(tmp_path):
    # train.py's loop (tiny model, 4 prompts x 4 = 16 rows a step): rollout.max_num_seqs=3
    # sends every step through the paged engine (3 slots); the run is the grouped sampler's
    # (max_num_seqs=256) step for step, and a paged run stopped after step 1 and resumed ends
    # bitwise where the uninterrupted one does.
    import dataclasses

    from test_algorithms_loop import _rows, _run

    calls = []
    real = paged.sample_paged

    def spy(*a, **k):
        calls.append(k["max_num_seqs"])
        return real(*a, **k)

    slots = lambda s: (lambda r: dataclasses.replace(r, max_num_seqs=s))  # noqa: E731
    grouped = _rows(_run(tmp_path / "grouped", rollout=slots(256)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged, "sample_paged", spy)
        full = _rows(_run(tmp_path / "paged", rollout=slots(3)))
        assert calls == [3, 3]
        _run(tmp_path / "resumed", steps=1, rollout=slots(3))
        resumed = _rows(_run(tmp_path / "resumed", steps=2, rollout=slots(3)))
    for a, b in zip(full, grouped):
        assert a["response_length/mean"] == b["response_length/mean"]
        assert a["critic/score/mean"] == b["critic/score/mean"]
        np.testing.assert_allclose(a["actor/pg_loss"], b["actor/pg_loss"], rtol=1e-5, atol=1e-7)
    assert resumed[-1]["actor/pg_loss"] == full[-1]["actor/pg_loss"]
    assert resumed[-1]["actor/grad_norm"] == full[-1]["actor/grad_norm"]


class _Appender:
    """A turn hook: a row's first two turns (with room left) are answered, after
    `delay(row)` seconds on a timer thread, by three tokens that depend only on the row and
    its length; then it finishes. Records each row's appended positions."""

    def __init__(self, R, delay=lambda row: 0.0):
        self.R, self.delay = R, delay
        self.turns, self.appended = {}, {}

    def ended(self, row, response_ids):
        k = len(response_ids)
        self.turns[row] = self.turns.get(row, 0) + 1
        if self.turns[row] > 2 or k + 4 >= self.R:
            return None
        future = concurrent.futures.Future()
        tokens = [4 + (7 * row + k) % 50, 5 + k % 7, 6]
        threading.Timer(self.delay(row), future.set_result, [tokens]).start()
        return future

    def resume(self, row, tokens):
        start = self.appended.setdefault(row, [])
        start.append(None)  # placeholder, filled from the outputs below
        return tokens


def test_turns_wait_out_of_their_slots_and_reuse_their_pages(tiny):
    """Rows that end a turn wait for the hook's tokens while the others decode; the tokens
    are fed into the row's kept pages (not drawn) and it draws on: the rollout is the same
    whatever the slots, the pool and the order the answers come in, and every drawn token is
    the one a full forward pass over the whole sequence gives with its position's key."""
    from grpo_jax import sharding

    config, params = tiny
    ids, mask = _prompts([5, 9, 3, 7], config.vocab_size, seed=2)
    rng, R = jax.random.key(5), 40
    kw = dict(n=2, max_new_tokens=R, temperature=1.0, pad_token_id=_PAD,
              eos_token_ids=tuple(range(60, 72)))  # fmt: skip

    def run(delay=lambda row: 0.0, mesh=None, **schedule):
        hook, stats = _Appender(R, delay), {}
        args = (params, ids, mask)
        with sharding.use_mesh(mesh, sharding.LOGICAL_RULES) if mesh else contextlib.nullcontext():
            if mesh is not None:
                args = _on_mesh(config, params, mesh, ids, mask)
            out = paged.sample_paged(config, *args, rng, stats=stats, turns=hook, page_size=8,
                                     **kw, **schedule)  # fmt: skip
        return jax.device_get(out), stats, hook

    want, stats, hook = run(max_num_seqs=6)
    assert stats["paused_turns"] >= 4 and stats["appended_tokens"] == 3 * stats["paused_turns"]
    got_ids = np.asarray(want.response_ids)
    valid, logp = np.asarray(want.response_mask), np.asarray(want.log_probs)
    lengths = valid.sum(1)
    prompts = [ids[b // 2][mask[b // 2] > 0] for b in range(8)]
    logits = whole_context.sequence_logits(
        config, params, [np.concatenate([prompts[b], got_ids[b, : lengths[b]]]) for b in range(8)]
    )
    rows, drawn, logits_SV, keys_S = [], [], [], []
    for b, k in enumerate(lengths):
        assert valid[b, :k].all() and not valid[b, k:].any()
        drawn_b = np.flatnonzero(logp[b, :k] != 0)  # appended tokens have log-prob 0
        assert len(drawn_b) == k - 3 * hook.turns[b] + 3  # all but the appended ones
        rows += [b] * len(drawn_b)
        drawn.append(drawn_b)
        logits_SV.append(logits[b][len(prompts[b]) - 1 + drawn_b])
        keys_S.append(jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(rng, b),
                                                             jnp.asarray(drawn_b)))  # fmt: skip
    drawn = np.concatenate(drawn)
    tokens, lp = whole_context.select_tokens(np.concatenate(logits_SV), jnp.concatenate(keys_S),
                                             temperature=1.0, top_k=-1, top_p=1.0)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(tokens), got_ids[rows, drawn])
    np.testing.assert_allclose(np.asarray(lp), logp[rows, drawn], atol=1e-5)

    # No program compiles per turn: the same call with answers coming in another order adds
    # no entry to any paged program's cache, and gives the same rollout.
    sizes = {name: fn._cache_size() for name, fn in paged_programs.programs().items()}
    again = run(delay=lambda row: 0.2 if row % 2 else 0.0, max_num_seqs=6)
    assert {name: fn._cache_size() for name, fn in paged_programs.programs().items()} == sizes
    np.testing.assert_array_equal(np.asarray(again[0].response_ids), got_ids)

    # Row 0's answers come late: the others decode, and finish, while it waits.
    slow = run(delay=lambda row: 0.5 if row == 0 else 0.0, max_num_seqs=2)
    # prompts bucketed to 64 tokens: 8 pages; a response 5: rows lose their kept pages
    small = run(max_num_seqs=3, num_pages=1 + 8 + 5)
    # two data shards, each with its own pool and slots and its own rows' turns
    sharded = run(max_num_seqs=2, mesh=sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2]))
    assert sharded[1]["shards"] == 2
    for out, stats, _ in (slow, small, sharded):
        for f in ("response_ids", "response_mask"):
            np.testing.assert_array_equal(np.asarray(getattr(out, f)),
                                          np.asarray(getattr(want, f)), err_msg=f)
        np.testing.assert_allclose(np.asarray(out.log_probs), np.asarray(want.log_probs),
                                   atol=1e-5)  # fmt: skip
    trace = slow[1]["trace"]
    paused = next(i for i, (kind, rows) in enumerate(trace) if kind == "pause" and 0 in rows)
    resumed = next(i for i, (kind, rows) in enumerate(trace) if kind == "resume" and 0 in rows)
    between = trace[paused:resumed]
    assert sum(steps for kind, steps in between if kind == "decode") > 0, trace
    assert any(kind == "finish" for kind, _ in between), trace
    assert small[1]["dropped_holds"] > 0 and small[1]["replayed_tokens"] > 0


def test_a_turn_hook_that_overflows_the_response_is_refused(tiny):
    config, params = tiny
    ids, mask = _prompts([5], config.vocab_size, seed=2)

    class Overflow:
        def ended(self, row, response_ids):
            future = concurrent.futures.Future()
            future.set_result(None)
            return future

        def resume(self, row, result):
            return [5] * 40

    with pytest.raises(ValueError, match="turn hook appended 40 tokens"):
        paged.sample_paged(config, params, ids, mask, jax.random.key(0), n=1, max_new_tokens=16,
                           eos_token_ids=tuple(range(4, 128)), turns=Overflow())  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [None, (8, 1, 1)], ids=["one device", "data 8"])
def test_the_finished_hook_hears_each_row_once_with_its_final_tokens(tiny, mesh_shape):
    """`finished(row, tokens)`: every row once, with the valid tokens it ends the rollout with,
    rows ending early (an EOS) before the call returns the later ones; the rollout is bitwise
    the one without the hook, and so is the schedule."""
    from grpo_jax import sharding

    config, params = tiny
    ids, mask, rng, kw, _ = _mixed_case(config, params, 1.0, -1, 1.0)
    if mesh_shape is not None:
        params, ids, mask = _on_mesh(config, params, sharding.make_mesh(mesh_shape),
                                     np.concatenate([ids, ids[:2]]),
                                     np.concatenate([mask, mask[:2]]))  # fmt: skip
    heard, stats = [], [{}, {}]
    outs = [
        paged.sample_paged(config, params, ids, mask, rng, max_num_seqs=4, page_size=4,
                           stats=stats[i], **kw, **hook)  # fmt: skip
        for i, hook in enumerate([{}, {"finished": lambda row, t: heard.append((row, t))}])
    ]
    for field in ("prompt_ids", "response_ids", "response_mask", "log_probs", "group_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(outs[0], field)),
                                      np.asarray(getattr(outs[1], field)), err_msg=field)
    assert stats[0] == stats[1]
    response_ids, lengths = np.asarray(outs[1].response_ids), np.asarray(outs[1].response_mask)
    rows = [row for row, _ in heard]
    assert sorted(rows) == list(range(len(response_ids)))
    for row, tokens in heard:
        np.testing.assert_array_equal(tokens, response_ids[row, : lengths[row].sum()])
    # Heard in the order they finished: an early EOS before the rows cut at the length limit.
    ended = [len(t) < kw["max_new_tokens"] for _, t in heard]
    assert ended[0] and not ended[-1]
    with pytest.raises(ValueError, match="`turns` or `finished`, not both"):
        paged.sample_paged(config, params, ids, mask, rng, turns=object(),
                           finished=lambda row, t: None, **kw)  # fmt: skip


def test_rows_holding_pages_behind_an_unprefilled_group_do_not_stall_the_pool():
    """Host schedule alone: nothing decodes, no turn is pending, the first waiting row's group
    has no prompt pages (its rows' own were dropped, so it was evicted) and the rows behind it
    hold pages that leave no room for that prompt. The holds are dropped (those rows recompute)
    and the prompt is prefilled; before, the call stalled with a RuntimeError."""
    P, R = 4, 16
    plan = paged.PoolPlan(page_size=P, num_pages=12, max_num_seqs=2, prompt_pages=2,
                          response_pages=R // P, chunk=8, chunk_rows=2, rows=4)  # fmt: skip
    st = paged_programs.Settings(config=None, max_new_tokens=R, temperature=0.0, top_p=1.0,
                                 top_k=-1, eos_token_ids=(0,), pad_token_id=0,
                                 logprobs_mode="raw_logprobs")  # fmt: skip
    prompts = [np.arange(1, 8, dtype=np.int32), np.arange(1, 8, dtype=np.int32)]
    sh = paged_schedule.Shard(st, plan, prompts, n=2, g0=0, min_steps=4)
    # Group 1 is prefilled; its rows 2 and 3 paused after 8 tokens (2 own pages each) and
    # were resumed; group 0's rows wait first with no prompt pages.
    sh.group_pages[1], sh.prefilled[1], sh.prompt_held = [sh.free.pop(), sh.free.pop()], 6, 2
    for row in (2, 3):
        sh.held[row], sh.written[row], sh.last[row] = [sh.free.pop(), sh.free.pop()], 8, 5
    sh.waiting = collections.deque([0, 1, 2, 3])
    assert sh._promised() + 2 + plan.response_pages > plan.admits_pages  # no room as it is
    batch = sh.prefill_batch()
    assert batch is not None and batch[-1] == (0,)  # group 0's prompt, prefilled
    assert sh.dropped_holds >= 1 and sh.group_pages[0]
    held = sum(len(p) for p in sh.held.values())
    assert len(sh.free) + held + sh.prompt_held == plan.num_pages - 1  # no page lost
