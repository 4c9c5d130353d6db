"""Tests for grpo_jax.sampler: token selection, bucketing, and the grouped KV-cache sampler."""

import json
import os
import subprocess
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import reference

from grpo_jax import config as config_lib
from grpo_jax import model, sampler, sharding
from grpo_jax.rollout import engines
from grpo_jax.trainer import setup

# Log-probs of the same tokens computed in another order (a KV cache vs a full forward, fewer
# decode slots, YNNPACK dots, a sharded batch), in ulps of the largest |log p| (tests/numerics.py).
# A wrong temperature, mask or position moves them by a good fraction of that scale.
LOGP_ULPS = 256

# ---------------------------------------------------------------------------------------------
# Bucketing.


def test_bucket_length_rounds_up_to_the_multiple():
    # ceil(t / 64) * 64: 1..64 -> 64, 65..128 -> 128.
    assert [sampler.bucket_length(t) for t in (1, 63, 64, 65, 128, 129)] == [
        64,
        64,
        64,
        128,
        128,
        192,
    ]
    assert sampler.bucket_length(9, multiple=8) == 16
    assert sampler.bucket_length(5, multiple=1) == 5


def test_bucket_prompts_pads_host_batches_on_the_host():
    # Widths 46 and 47 share the 64 bucket: host prompts are padded with numpy (no device
    # program per width), device prompts with jnp, to the same values.
    for width in (46, 47, 64):
        ids = np.arange(2 * width, dtype=np.int32).reshape(2, width) + 1
        mask = np.ones((2, width), np.int32)
        got_ids, got_mask = sampler.bucket_prompts(ids, mask, pad_token_id=-5)
        assert isinstance(got_ids, np.ndarray) and got_ids.shape == (2, 64)
        np.testing.assert_array_equal(got_ids[:, 64 - width :], ids)
        assert (got_ids[:, : 64 - width] == -5).all() and got_mask.sum() == mask.sum()
        dev_ids, dev_mask = sampler.bucket_prompts(
            jnp.asarray(ids), jnp.asarray(mask), pad_token_id=-5
        )
        np.testing.assert_array_equal(dev_ids, got_ids)
        np.testing.assert_array_equal(dev_mask, got_mask)


@pytest.mark.parametrize("t, multiple", [(0, 64), (-3, 64), (5, 0)])
def test_bucket_length_rejects_bad_arguments(t, multiple):
    with pytest.raises(ValueError):
        sampler.bucket_length(t, multiple)


# ---------------------------------------------------------------------------------------------
# top-k / top-p filtering.

# probs [0.5, 0.3, 0.15, 0.05]; ascending order 0.05, 0.15, 0.3, 0.5 with cumulative sums
# 0.05, 0.2, 0.5, 1.0 (HF's top-p drops the ascending prefix whose cumsum is <= 1 - top_p).
_PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        (-1, 1.0, [0, 1, 2, 3]),  # both off
        (0, 1.0, [0, 1, 2, 3]),  # top_k=0 is off too (vLLM)
        (2, 1.0, [0, 1]),
        (4, 1.0, [0, 1, 2, 3]),  # k == V
        (9, 1.0, [0, 1, 2, 3]),  # k > V
        (-1, 0.75, [0, 1]),  # 1-p = 0.25: drops cumsums 0.05, 0.2
        (-1, 0.4, [0]),  # 1-p = 0.6: drops 0.05, 0.2, 0.5
        (-1, 1e-6, [0]),  # the most likely token is always kept
        # top-k first: the top-2 renormalise to 0.625, 0.375; ascending cumsum 0.375, 1.0;
        # 1-p = 0.5 drops token 1.
        (2, 0.5, [0]),
        (3, 0.9, [0, 1, 2]),  # top-3 probs /0.95: cumsum 0.158, 0.474, 1.0; 1-p=0.1 drops none
    ],
)
def test_top_k_top_p_filter_hand_derived(top_k, top_p, kept):
    logits_BV = jnp.log(jnp.asarray(_PROBS))[None] + 3.0  # a shift must not matter
    out_BV = sampler.top_k_top_p_filter(logits_BV, top_k=top_k, top_p=top_p)
    expected_kept = np.zeros(4, bool)
    expected_kept[kept] = True
    np.testing.assert_array_equal(np.isfinite(out_BV[0]), expected_kept)
    np.testing.assert_array_equal(out_BV[0][expected_kept], logits_BV[0][expected_kept])


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.9), (-1, 0.3), (20, 0.8), (1, 0.5)])
@pytest.mark.reference("hf")
def test_top_k_top_p_filter_matches_hf_warpers(top_k, top_p):
    torch, _ = reference.hf()
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(0).normal(size=(16, 50)).astype(np.float32) * 2.0
    expected = torch.from_numpy(logits)
    if top_k > 0:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    out = sampler.top_k_top_p_filter(jnp.asarray(logits), top_k=top_k, top_p=top_p)
    np.testing.assert_array_equal(np.asarray(out), expected.numpy())


# ---------------------------------------------------------------------------------------------
# Token selection and keys.


def test_typed_and_legacy_keys_give_the_same_row_keys():
    typed = sampler.row_keys(jax.random.key(3), 4)
    legacy = sampler.row_keys(jax.random.PRNGKey(3), 4)
    np.testing.assert_array_equal(jax.random.key_data(typed), jax.random.key_data(legacy))
    # Row b's key does not depend on the number of rows, and rows differ.
    np.testing.assert_array_equal(
        jax.random.key_data(sampler.row_keys(jax.random.key(3), 2)),
        jax.random.key_data(typed[:2]),
    )
    assert len({tuple(np.asarray(k).tolist()) for k in jax.random.key_data(typed)}) == 4


def test_as_typed_key_rejects_other_arrays():
    with pytest.raises(TypeError):
        sampler.as_typed_key(jnp.zeros((3,), jnp.uint32))
    with pytest.raises(ValueError):
        sampler.as_typed_key(jax.random.split(jax.random.key(0), 2))


def test_top_k_one_and_temperature_zero_are_greedy():
    logits_BV = jax.random.normal(jax.random.key(0), (64, 100)) * 3.0
    keys_B = sampler.row_keys(jax.random.key(1), 64)
    greedy_B, greedy_logp_B = sampler.select_tokens(
        logits_BV, keys_B, temperature=0.0, top_k=-1, top_p=1.0
    )
    np.testing.assert_array_equal(greedy_B, jnp.argmax(logits_BV, axis=-1))
    np.testing.assert_allclose(
        greedy_logp_B, jnp.max(jax.nn.log_softmax(logits_BV, axis=-1), axis=-1), rtol=1e-6
    )
    top1_B, top1_logp_B = sampler.select_tokens(
        logits_BV, keys_B, temperature=0.7, top_k=1, top_p=1.0
    )
    np.testing.assert_array_equal(top1_B, greedy_B)
    # processed_logprobs (the default): top-k 1 leaves one token, renormalised to log(1) = 0.
    np.testing.assert_array_equal(top1_logp_B, np.zeros(64, np.float32))


# chi2.ppf(0.999, df) for df = 1..5 (standard table values); the test is seeded, so it either
# always passes or always fails, and a 0.1 % false-alarm level keeps it meaningful.
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.mark.parametrize(
    "temperature, top_k, top_p, expected",
    [
        # Plain softmax of log([.4,.3,.15,.1,.05]).
        (1.0, -1, 1.0, [0.4, 0.3, 0.15, 0.1, 0.05]),
        # T=0.5 squares the probabilities: [.16,.09,.0225,.01,.0025] / 0.285.
        (0.5, -1, 1.0, [0.16 / 0.285, 0.09 / 0.285, 0.0225 / 0.285, 0.01 / 0.285, 0.0025 / 0.285]),
        # top_k=3 renormalises the first three: [.4,.3,.15] / .85.
        (1.0, 3, 1.0, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
        # top_p=0.8: ascending cumsums .05,.15,.3,.6,1.0; 1-p=.2 drops tokens 4, 3
        # -> [.4,.3,.15]/.85.
        (1.0, -1, 0.8, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
    ],
)
def test_sampled_distribution_chi_square(temperature, top_k, top_p, expected):
    num_draws = 20_000
    probs_V = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(probs_V, jnp.float32)), (num_draws, 5))
    keys_B = sampler.row_keys(jax.random.key(42), num_draws)
    tokens_B, logp_B = jax.jit(
        sampler.select_tokens, static_argnames=("temperature", "top_k", "top_p")
    )(logits_BV, keys_B, temperature=temperature, top_k=top_k, top_p=top_p)
    counts_V = np.bincount(np.asarray(tokens_B), minlength=5)
    expected_V = np.asarray(expected) * num_draws
    support = expected_V > 0
    assert counts_V[~support].sum() == 0, "drew a filtered-out token"
    chi2 = float((((counts_V - expected_V) ** 2)[support] / expected_V[support]).sum())
    assert chi2 < _CHI2_999[int(support.sum()) - 1], (chi2, counts_V, expected_V)
    # processed_logprobs: the log-probability under the distribution drawn from, `expected`
    # (never a filtered-out token, whose expected probability is 0).
    drawn = np.asarray(expected)[np.asarray(tokens_B)]
    np.testing.assert_allclose(logp_B, np.log(drawn), rtol=1e-5)


def _np_processed_logprobs(logits_V, temperature, top_k, top_p):
    """log_softmax of logits / T after HF/vLLM top-k then top-p, in float64 (-inf dropped)."""
    z = np.asarray(logits_V, np.float64) / temperature
    if 0 < top_k < z.size:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    if top_p < 1:
        order = np.argsort(z)  # ascending; dropped tokens first
        probs = np.exp(z[order] - z.max())
        cum = np.cumsum(probs / probs.sum())
        drop = cum <= 1 - top_p
        drop[-1] = False  # the most likely token stays
        z[order[drop]] = -np.inf
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.7, -1, 1.0), (0.7, 10, 1.0), (1.3, -1, 0.8), (0.9, 20, 0.7), (0.0, -1, 1.0)],
)
def test_logprobs_modes_are_vllms(temperature, top_k, top_p):
    # vLLM's --logprobs-mode (verl's rollout.logprobs_mode), at the sampled token:
    # processed_logprobs = log_softmax of the temperature-scaled, top-k / top-p truncated and
    # renormalised logits (computed here in numpy); raw_logprobs = log_softmax(logits);
    # processed_logits = logits / T; raw_logits = logits (greedy: no temperature, no filter).
    # The mode never changes the draw.
    logits_BV = jax.random.normal(jax.random.key(3), (64, 50)) * 2.0
    keys_B = sampler.row_keys(jax.random.key(4), 64)
    statics = ("temperature", "top_k", "top_p", "logprobs_mode")
    select = jax.jit(sampler.select_tokens, static_argnames=statics)
    out = {
        mode: select(logits_BV, keys_B, temperature=temperature, top_k=top_k, top_p=top_p,
                     logprobs_mode=mode)  # fmt: skip
        for mode in sampler.LOGPROBS_MODES
    }
    tokens_B = np.asarray(out["processed_logprobs"][0])
    for mode, (tokens, _) in out.items():
        np.testing.assert_array_equal(tokens, tokens_B, err_msg=mode)
    logits = np.asarray(logits_BV, np.float64)
    rows = np.arange(64)
    raw_logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = {
        "raw_logprobs": raw_logp[rows, tokens_B],
        "raw_logits": logits[rows, tokens_B],
        "processed_logits": logits[rows, tokens_B] / (temperature or 1.0),
        "processed_logprobs": np.array([
            _np_processed_logprobs(logits[b], temperature, top_k, top_p)[t] if temperature
            else raw_logp[b, t] for b, t in zip(rows, tokens_B)
        ]),
    }  # fmt: skip
    assert np.isfinite(want["processed_logprobs"]).all()  # drawn tokens survive the filters
    for mode, values in want.items():
        np.testing.assert_allclose(out[mode][1], values, rtol=2e-6, atol=2e-6, err_msg=mode)
    if temperature and (top_k > 0 or top_p < 1):
        # The truncation bites: the renormalised log-prob exceeds the untruncated
        # log_softmax(logits / T) by -log(kept mass) >= 0, clearly on most rows.
        scaled = logits / temperature
        untruncated = (scaled - np.log(np.exp(scaled).sum(-1, keepdims=True)))[rows, tokens_B]
        gap = np.asarray(out["processed_logprobs"][1]) - untruncated
        assert (gap > -1e-6).all() and np.median(gap) > 1e-2


# Run with LLVM's optimisations off: XLA:CPU then computes the filter's input twice (into
# top-k and into the threshold comparison) with different roundings, the case that once dropped
# every token of some rows (the draw then left the vocabulary, token 127 of 50).
_UNOPTIMISED_DRAW = """
import json, jax, numpy as np
from grpo_jax import sampler
logits_BV = jax.random.normal(jax.random.key(3), (64, 50)) * 2.0
keys_B = sampler.row_keys(jax.random.key(4), 64)
select = jax.jit(sampler.select_tokens, static_argnames=(
    "temperature", "top_k", "top_p", "logprobs_mode"))
print(json.dumps({k: {mode: np.asarray(select(
    logits_BV, keys_B, temperature=0.9, top_k=k, top_p=p, logprobs_mode=mode)[0]).tolist()
    for mode in sampler.LOGPROBS_MODES} for k, p in ((20, 0.7), (10, 1.0))}))
"""


def test_top_k_keeps_its_tokens_however_xla_compiles_the_filter():
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _UNOPTIMISED_DRAW], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    draws = json.loads(out.stdout.strip().splitlines()[-1])
    logits = np.asarray(jax.random.normal(jax.random.key(3), (64, 50)) * 2.0)
    rank = np.argsort(np.argsort(-logits, axis=-1), axis=-1)  # 0 = the row's largest
    for top_k, by_mode in draws.items():
        for mode, tokens in by_mode.items():
            name = f"top_k={top_k} {mode}"
            assert tokens == by_mode["processed_logprobs"], name  # the mode never changes the draw
            tokens = np.asarray(tokens)
            assert ((0 <= tokens) & (tokens < 50)).all(), name
            assert (rank[np.arange(64), tokens] < int(top_k)).all(), name


def test_inverse_cdf_sparse_support_and_edges():
    # V = 300 is not a multiple of the 128-token chunk; only tokens 5 (weight 1) and 290 (weight 3)
    # can be drawn, so u < 1/4 gives 5 and u >= 1/4 gives 290 (cumulative weights 1, 4).
    probs_V = np.zeros(300, np.float32)
    probs_V[[5, 290]] = [1.0, 3.0]
    u_B = jnp.asarray([0.0, 0.2, 0.2499, 0.2501, 0.9, np.nextafter(np.float32(1), 0)], jnp.float32)
    probs_BV = jnp.broadcast_to(jnp.asarray(probs_V), (6, 300))
    draw = jax.jit(sampler.categorical_inverse_cdf)
    tokens_B = draw(probs_BV, u_B)
    np.testing.assert_array_equal(tokens_B, [5, 5, 5, 290, 290, 290])
    # Rounding can push u * total to (or past) the last cumulative sum; u = 1 forces exactly
    # that. The guard then picks the last positive token, never the zero-weight tail (tokens
    # 291..383 of the padded last chunk, which a plain count of cdf <= u * total would reach).
    tokens_B = draw(probs_BV[:1], jnp.asarray([1.0]))
    np.testing.assert_array_equal(tokens_B, [290])


# ---------------------------------------------------------------------------------------------
# The sampler on a tiny model.

_PAD = 0


@pytest.fixture(scope="module")
def tiny():
    config = model.ModelConfig.tiny()
    params = model.init_params(config, jax.random.key(0))
    return config, params


def _left_padded(lengths, width, vocab, seed):
    """[P,width] left-padded random prompts (ids in [1, vocab)) and their masks."""
    rng = np.random.default_rng(seed)
    ids_PT = np.full((len(lengths), width), _PAD, np.int32)
    mask_PT = np.zeros((len(lengths), width), np.int32)
    for i, length in enumerate(lengths):
        ids_PT[i, width - length :] = rng.integers(1, vocab, size=length)
        mask_PT[i, width - length :] = 1
    return ids_PT, mask_PT


def test_rollout_layout_and_bucketing(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([5, 9, 3], 9, config.vocab_size, seed=1)
    out = sampler.sample(
        config,
        params,
        ids_PT,
        mask_PT,
        jax.random.key(0),
        n=2,
        max_new_tokens=4,
        weights_version=7,
    )
    # Tp = 9 is bucketed to 64: 55 extra pad columns on the left, mask 0; prompt i at rows 2i, 2i+1.
    expected_ids = np.concatenate([np.full((3, 55), _PAD, np.int32), ids_PT], axis=1)
    expected_mask = np.concatenate([np.zeros((3, 55), np.int32), mask_PT], axis=1)
    np.testing.assert_array_equal(out.prompt_ids, np.repeat(expected_ids, 2, axis=0))
    np.testing.assert_array_equal(out.prompt_mask, np.repeat(expected_mask, 2, axis=0))
    np.testing.assert_array_equal(out.group_ids, [0, 0, 1, 1, 2, 2])
    assert int(out.weights_version) == 7
    assert out.response_ids.shape == (6, 4) and out.response_ids.dtype == jnp.int32
    # No EOS ids: every position is a response token.
    np.testing.assert_array_equal(out.response_mask, np.ones((6, 4), np.int32))
    assert out.log_probs.dtype == jnp.float32 and bool(jnp.all(out.log_probs < 0))


def test_samples_do_not_depend_on_the_prompt_width(tiny):
    """data.prompt_padding pads a batch wider than its longest prompt (the set's longest, or
    max_prompt_length): the extra columns are masked, so the same prompts in a wider bucket
    give the same tokens and, up to float rounding, the same log-probs."""
    config, params = tiny
    ids_PT, mask_PT = _left_padded([5, 9, 3], 9, config.vocab_size, seed=1)
    kw = dict(n=2, max_new_tokens=12, temperature=1.0, top_k=30,
              eos_token_ids=tuple(range(3, config.vocab_size, 12)), pad_token_id=_PAD)  # fmt: skip
    narrow = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(4), **kw)
    wide_ids, wide_mask = (np.pad(x, ((0, 0), (61, 0)), constant_values=c)  # 70: bucket 128
                           for x, c in ((ids_PT, _PAD), (mask_PT, 0)))  # fmt: skip
    wide = sampler.sample(config, params, wide_ids, wide_mask, jax.random.key(4), **kw)
    assert narrow.prompt_ids.shape[1] == 64 and wide.prompt_ids.shape[1] == 128
    np.testing.assert_array_equal(wide.prompt_ids[:, -64:], narrow.prompt_ids)
    np.testing.assert_array_equal(wide.response_ids, narrow.response_ids)
    np.testing.assert_array_equal(wide.response_mask, narrow.response_mask)
    assert 0 < int(narrow.response_mask.sum()) < narrow.response_mask.size  # some stopped at EOS
    np.testing.assert_allclose(wide.log_probs, narrow.log_probs, rtol=0, atol=1e-5)


def test_log_probs_match_teacher_forced_forward(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([6, 2], 6, config.vocab_size, seed=2)
    temperature = 0.7
    out = sampler.sample(
        config,
        params,
        ids_PT,
        mask_PT,
        jax.random.key(1),
        n=3,
        max_new_tokens=8,
        temperature=temperature,
        top_k=20,
        top_p=0.9,
        eos_token_ids=(3, 4, 5),
        pad_token_id=_PAD,
    )
    seq_BS = jnp.concatenate([out.prompt_ids, out.response_ids], axis=1)
    mask_BS = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    logits_BSV = model.forward(config, params, seq_BS, mask_BS)
    # The logits at position Tb - 1 + t predict response token t; log_probs (processed_logprobs,
    # the default) are the log-softmax of logits / T after top-k 20 and top-p 0.9 there.
    prompt_len = out.prompt_ids.shape[1]
    logits_BRV = np.asarray(logits_BSV[:, prompt_len - 1 : -1])
    ids_BR, live_BR = np.asarray(out.response_ids), np.asarray(out.response_mask) == 1
    expected_BR = np.zeros(ids_BR.shape)
    for b, t in zip(*np.nonzero(live_BR)):
        logp_V = _np_processed_logprobs(logits_BRV[b, t], temperature, 20, 0.9)
        expected_BR[b, t] = logp_V[ids_BR[b, t]]
    numerics.assert_close(out.log_probs, expected_BR, ulps=LOGP_ULPS)
    logp_BRV = jax.nn.log_softmax(logits_BRV / temperature, axis=-1)
    # top-k=20 kept every drawn token inside the top 20 of its row.
    rank_BR = jnp.sum(logp_BRV > jnp.take_along_axis(logp_BRV, out.response_ids[..., None], -1), -1)
    assert bool(jnp.all(jnp.where(out.response_mask == 1, rank_BR < 20, True)))


def test_rollout_logprobs_mode_reaches_the_native_engine(tiny, tmp_path):
    # rollout.logprobs_mode -> setup.make_engine -> NativeEngine -> sampler.sample: with
    # "raw_logprobs" the rollout holds vLLM's raw value, log_softmax(logits) before the
    # temperature and the filters, at each sampled token.
    config, params = tiny
    run = config_lib.RunConfig(rollout=config_lib.RolloutConfig(logprobs_mode="raw_logprobs"))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    engine = setup.make_engine(run, config, mesh, eos_ids=(3, 4, 5), pad_id=_PAD,
                               workdir=str(tmp_path))  # fmt: skip
    assert engine.logprobs_mode == "raw_logprobs"
    ids_PT, mask_PT = _left_padded([6, 2], 6, config.vocab_size, seed=2)
    sp = engines.SamplingParams(n=3, max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20)
    out = engine.sample(params, ids_PT, mask_PT, jax.random.key(1), sp)
    seq_BS = jnp.concatenate([out.prompt_ids, out.response_ids], axis=1)
    mask_BS = jnp.concatenate([out.prompt_mask, out.response_mask], axis=1)
    prompt_len = out.prompt_ids.shape[1]
    logits_BRV = model.forward(config, params, seq_BS, mask_BS)[:, prompt_len - 1 : -1]
    raw_BRV = jax.nn.log_softmax(logits_BRV, axis=-1)
    expected_BR = jnp.take_along_axis(raw_BRV, out.response_ids[..., None], axis=-1)[..., 0]
    expected_BR = jnp.where(out.response_mask == 1, expected_BR, 0.0)
    numerics.assert_close(out.log_probs, expected_BR, ulps=LOGP_ULPS)


def test_cpu_programs_compile_with_ynnpack_dots_and_match_the_default_compile(tiny):
    # On CPU the sampler's programs for long responses take sampler.CPU_COMPILER_OPTIONS
    # (YNNPACK dots); the result is the default compile's up to float32 rounding.
    config, params = tiny
    assert sampler.compiler_options("cpu") == sampler.CPU_COMPILER_OPTIONS
    short = sampler.YNNPACK_MIN_NEW_TOKENS - 1
    assert not sampler._uses_ynnpack(sampler._Static(config, 2, short, 0.0, 1.0, -1, (), _PAD))
    assert sampler._uses_ynnpack(sampler._Static(config, 2, short + 1, 0.0, 1.0, -1, (), _PAD))
    assert sampler.compiler_options("gpu") is None and sampler.compiler_options(None) is None
    ids_PT, mask_PT = _left_padded([6, 3], 64, config.vocab_size, seed=11)
    st = sampler._Static(config, 2, 6, 0.0, 1.0, -1, (), _PAD)
    args = (st, params, jnp.asarray(ids_PT), jnp.asarray(mask_PT), jax.random.key(0), jnp.int32(0))
    ynn, default = sampler._programs("cpu")["sample"], sampler._programs(None)["sample"]
    # The option reaches XLA: it changes which dots become YNNPACK fusions (unless XLA_FLAGS
    # already asks it of every program: the ynnpack variant of scripts/test_cpu_variants.sh).
    if "xla_cpu_experimental_ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
        assert ynn.lower(*args).compile().as_text() != default.lower(*args).compile().as_text()
    a, b = ynn(*args), default(*args)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    numerics.assert_close(a.log_probs, b.log_probs, ulps=LOGP_ULPS)


def test_same_rng_same_rollout_different_rng_different(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([4, 7], 7, config.vocab_size, seed=3)
    kwargs = {"n": 4, "max_new_tokens": 6, "temperature": 1.0}
    first = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(5), **kwargs)
    again = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(5), **kwargs)
    legacy = sampler.sample(config, params, ids_PT, mask_PT, jax.random.PRNGKey(5), **kwargs)
    other = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(6), **kwargs)
    for a, b in ((first, again), (first, legacy)):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.log_probs, b.log_probs)
    assert not np.array_equal(first.response_ids, other.response_ids)
    # Rows of one group draw independently: with V=128 and 6 tokens, 4 identical copies of a
    # prompt's response would mean shared randomness.
    groups = np.asarray(first.response_ids).reshape(2, 4, 6)
    assert all(len({tuple(r) for r in g}) > 1 for g in groups)


def test_top_k_one_equals_greedy(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([3, 8], 8, config.vocab_size, seed=4)
    greedy = sampler.sample(
        config, params, ids_PT, mask_PT, jax.random.key(0), n=2, max_new_tokens=6, temperature=0.0
    )
    top1 = sampler.sample(
        config, params, ids_PT, mask_PT, jax.random.key(9), n=2, max_new_tokens=6, top_k=1
    )
    np.testing.assert_array_equal(top1.response_ids, greedy.response_ids)


def test_everything_after_the_first_eos_is_masked(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([5, 5, 2, 4], 5, config.vocab_size, seed=5)
    # 8 of 128 ids: with near-uniform random logits P(no EOS in 12 tokens) ~ (15/16)^12 ~ 0.46.
    eos = tuple(range(10, 18))
    pad = 7
    out = sampler.sample(
        config,
        params,
        ids_PT,
        mask_PT,
        jax.random.key(3),
        n=4,
        max_new_tokens=12,
        eos_token_ids=eos,
        pad_token_id=pad,
    )
    ids_BR, mask_BR, logp_BR = map(np.asarray, (out.response_ids, out.response_mask, out.log_probs))
    is_eos_BR = np.isin(ids_BR, eos)
    ended_B = is_eos_BR.any(axis=1)
    first_B = np.where(ended_B, is_eos_BR.argmax(axis=1), 12)
    assert 0 < ended_B.sum() < len(ended_B)  # the workload has both kinds of rows
    assert (first_B[ended_B] < 11).any()  # and some EOS well inside the response
    for b in range(len(ids_BR)):
        live = first_B[b] + 1  # 1 up to and including the first EOS
        np.testing.assert_array_equal(mask_BR[b], np.arange(12) < live)
        assert (ids_BR[b, live:] == pad).all()
        assert (logp_BR[b, live:] == 0).all() and (logp_BR[b, :live] < 0).all()
    # No EOS id, or pad, in a live position before the first EOS.
    assert not np.isin(ids_BR[~is_eos_BR & (mask_BR == 1)], eos).any()


def test_compaction_gives_the_same_rollout_and_drops_finished_rows(tiny, monkeypatch):
    """Rows ending at different times: the compacting decode equals the one-loop decode token
    for token, and once half the rows are done it decodes on half the slots."""
    config, params = tiny
    ids_PT, mask_PT = _left_padded([5, 3, 4, 5, 2, 5, 1, 4], 5, config.vocab_size, seed=8)
    kw = dict(n=4, max_new_tokens=24, eos_token_ids=tuple(range(10, 26)), pad_token_id=7)
    slots = []
    real = sampler._decode_jit

    def counting(st, params, state, stop_at):
        slots.append(state.done_S.shape[0])
        return real(st, params, state, stop_at)

    monkeypatch.setattr(sampler, "_decode_jit", counting)
    got = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(5), **kw)
    want = sampler.sample(
        config, params, ids_PT, mask_PT, jax.random.key(5), compaction=False, **kw
    )
    lengths = np.asarray(want.response_mask).sum(1)
    assert lengths.min() < 12 and lengths.max() == 24  # rows end early and late
    assert slots[0] == 32 and slots[-1] < 32  # it did compact
    for field in ("response_ids", "response_mask", "group_ids", "prompt_ids"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    # Fewer slots change the matmul shapes, so the float sums differ in the last bits only.
    numerics.assert_close(got.log_probs, want.log_probs, ulps=LOGP_ULPS)


def test_every_call_walks_the_whole_ladder_so_only_the_first_compiles(tiny, monkeypatch):
    """Calls whose rows end at different times run the same programs: each compacts down to
    MIN_COMPACT_SLOTS (after the last token, phases without decode steps), so the second call
    of a batch shape compiles nothing, however its rows end."""
    from grpo_jax.trainer import perf

    config, params = tiny
    kw = dict(n=4, max_new_tokens=24, eos_token_ids=tuple(range(10, 26)), pad_token_id=7)
    slots = []
    real = sampler._decode_jit

    def counting(st, params, state, stop_at):
        slots.append(state.done_S.shape[0])
        return real(st, params, state, stop_at)

    monkeypatch.setattr(sampler, "_decode_jit", counting)
    lengths, ladders = [], []
    for seed in (8, 9):
        ids_PT, mask_PT = _left_padded([5, 3, 4, 5, 2, 5, 1, 4], 5, config.vocab_size, seed=seed)
        before, slots[:] = perf.compile_stats(), []
        out = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(seed), **kw)
        compiled = perf.compile_stats() - before
        lengths.append(np.asarray(out.response_mask).sum(1))
        ladders.append(list(slots))
    assert ladders == [[32, 16]] * 2  # down to MIN_COMPACT_SLOTS = 16
    assert not np.array_equal(lengths[0], lengths[1])  # the rows ended differently
    assert compiled.programs == 0, compiled.names


def test_early_stop_when_every_row_ends_at_once(tiny):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([3, 6], 6, config.vocab_size, seed=6)
    # Every id is an EOS, so the first token ends every row: mask [1, 0, 0, 0, 0], pad after.
    out = sampler.sample(
        config,
        params,
        ids_PT,
        mask_PT,
        jax.random.key(0),
        n=2,
        max_new_tokens=5,
        eos_token_ids=tuple(range(config.vocab_size)),
        pad_token_id=9,
    )
    np.testing.assert_array_equal(out.response_mask, np.tile([1, 0, 0, 0, 0], (4, 1)))
    np.testing.assert_array_equal(out.response_ids[:, 1:], np.full((4, 4), 9))


def test_prefill_runs_once_on_prompt_rows_and_no_retrace(tiny, monkeypatch):
    config, params = tiny
    calls = []
    real_prefill, real_decode = model.prefill, model.decode_step

    @chex.assert_max_traces(n=1)
    def counting_prefill(config, params, input_ids, attention_mask, cache):
        calls.append(("prefill", input_ids.shape))
        return real_prefill(config, params, input_ids, attention_mask, cache)

    def counting_decode(config, params, tokens, cache):
        calls.append(("decode", tokens.shape))
        return real_decode(config, params, tokens, cache)

    # Swap the sampler's view of the model module only: model internals keep the real functions.
    proxy = types.SimpleNamespace(**vars(model))
    proxy.prefill, proxy.decode_step = counting_prefill, counting_decode
    monkeypatch.setattr(sampler, "model_lib", proxy)
    # Settings used by no other test, so the first call traces; the second batch has other
    # prompts, widths (11 and 30 both bucket to 64), params, rng and weights_version.
    kwargs = {"n": 5, "max_new_tokens": 3, "temperature": 0.9}
    a_PT, a_mask_PT = _left_padded([11, 4], 11, config.vocab_size, seed=7)
    b_PT, b_mask_PT = _left_padded([30, 1], 30, config.vocab_size, seed=8)
    other_params = model.init_params(config, jax.random.key(1))
    sampler.sample(config, params, a_PT, a_mask_PT, jax.random.key(0), **kwargs)
    sampler.sample(
        config, other_params, b_PT, b_mask_PT, jax.random.key(1), weights_version=3, **kwargs
    )
    # One trace in all; the prefill sees the P=2 prompts (not P*n=10 rows), decode all 10 rows
    # (no compaction: 5 slots would be below sampler.MIN_COMPACT_SLOTS).
    assert sampler.MIN_COMPACT_SLOTS > 5
    assert calls == [("prefill", (2, 64)), ("decode", (10,))]


def test_batch_sharded_over_a_mesh_matches_unsharded(tiny):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    config, params = tiny
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data", None))
    ids_PT, mask_PT = _left_padded([5, 2, 8, 3], 8, config.vocab_size, seed=9)
    for temperature in (0.0, 1.0):
        kwargs = {"n": 2, "max_new_tokens": 5, "temperature": temperature, "eos_token_ids": (1,)}
        plain = sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(2), **kwargs)
        sharded = sampler.sample(
            config,
            jax.device_put(params, NamedSharding(mesh, PartitionSpec())),
            jax.device_put(ids_PT, rows),
            jax.device_put(mask_PT, rows),
            jax.random.key(2),
            **kwargs,
        )
        # The rollout stays batch-sharded (no gather to one device).
        assert sharded.response_ids.sharding.is_equivalent_to(rows, 2)
        assert sharded.log_probs.sharding.is_equivalent_to(rows, 2)
        np.testing.assert_array_equal(sharded.response_ids, plain.response_ids)
        numerics.assert_close(sharded.log_probs, plain.log_probs, ulps=LOGP_ULPS)


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 0},
        {"max_new_tokens": 0},
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"eos_token_ids": (128,)},
        {"pad_token_id": -1},
    ],
)
def test_sample_rejects_bad_settings(tiny, bad):
    config, params = tiny
    ids_PT, mask_PT = _left_padded([2], 2, config.vocab_size, seed=0)
    kwargs = {"n": 1, "max_new_tokens": 1} | bad
    with pytest.raises(ValueError):
        sampler.sample(config, params, ids_PT, mask_PT, jax.random.key(0), **kwargs)


# ---------------------------------------------------------------------------------------------
# Parity with transformers' generate.


@pytest.fixture(scope="module")
def hf_qwen2(tmp_path_factory):
    """A tiny random Qwen2 in transformers, and the same checkpoint loaded by grpo_jax."""
    torch, transformers = reference.hf()
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # Larger than the 0.02 default so that greedy argmax margins are far above float32
        # noise (checked in the test) and the continuations are not one repeated token.
        initializer_range=0.3,
    )
    hf_model = transformers.Qwen2ForCausalLM(hf_config).eval()
    path = tmp_path_factory.mktemp("qwen2")
    hf_model.save_pretrained(path)
    config, params = model.load_hf_checkpoint(path)
    return hf_model, config, params


def _hf_greedy(hf_model, ids_PT, mask_PT, new_tokens, eos, pad):
    """HF greedy continuations [P,new_tokens] (pad-filled after EOS / early stop) and margins."""
    import torch

    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=torch.from_numpy(ids_PT).long(),
            attention_mask=torch.from_numpy(mask_PT).long(),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=list(eos) if eos else None,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[:, ids_PT.shape[1] :].numpy()
    top2 = torch.stack(out.scores, 1).topk(2, dim=-1).values  # [P, steps, 2]
    margins = (top2[..., 0] - top2[..., 1]).numpy()
    full = np.full((ids_PT.shape[0], new_tokens), pad, np.int64)
    full[:, : tokens.shape[1]] = tokens
    live = np.ones_like(full, bool)
    live[:, : tokens.shape[1]] = tokens != pad  # pad is never a generated token below
    return full, margins[live[:, : margins.shape[1]]]


@pytest.mark.reference("hf")
def test_greedy_matches_hf_generate_with_eos_inside_outputs(hf_qwen2):
    hf_model, config, params = hf_qwen2
    new_tokens, pad = 12, 0
    ids_PT, mask_PT = _left_padded([7, 3, 10], 10, config.vocab_size, seed=11)
    # First pass without EOS, then pick as EOS a token that row 0 first emits mid-way (step >= 2)
    # and that some other row never emits: some outputs then stop early and others run to the end.
    free, _ = _hf_greedy(hf_model, ids_PT, mask_PT, new_tokens, (), pad)
    assert not (free == pad).any()  # so pad marks only post-EOS positions below
    eos = next(
        int(tok)
        for t, tok in enumerate(free[0])
        if t >= 2 and tok not in free[0, :t] and any(tok not in row for row in free[1:])
    )
    expected, margins = _hf_greedy(hf_model, ids_PT, mask_PT, new_tokens, (eos,), pad)
    assert margins.min() > 1e-3  # no near-ties: the comparison below is well defined
    assert (expected == pad).any() and (expected[:, -1] != pad).any()

    out = sampler.sample(
        config,
        params,
        ids_PT,
        mask_PT,
        jax.random.key(0),
        n=2,
        max_new_tokens=new_tokens,
        temperature=0.0,
        eos_token_ids=(eos,),
        pad_token_id=pad,
    )
    np.testing.assert_array_equal(out.response_ids, np.repeat(expected, 2, axis=0))
    # Mask: 1 up to and including the EOS, i.e. exactly the non-pad positions of HF's output.
    np.testing.assert_array_equal(out.response_mask, np.repeat(expected != pad, 2, axis=0))
