"""Tests of grpo_jax.model: behaviour (causality, padding, KV cache, tracing) and HF parity."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import model

TINY = model.ModelConfig.tiny()
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
    np.testing.assert_allclose(np.asarray(padded[0, 3:]), np.asarray(alone[0]), atol=1e-5)
    other_pads = padded_BT.at[0, :3].set(jnp.array([1, 2, 4], jnp.int32))
    again = model.forward(TINY, params, other_pads, mask_BT)
    np.testing.assert_allclose(np.asarray(again[0, 3:]), np.asarray(alone[0]), atol=1e-5)


def test_forward_equals_unembed_of_hidden_states():
    params = _params()
    ids_BT, mask_BT = _tokens(3, (2, 6)), jnp.ones((2, 6), jnp.int32)
    logits = model.forward(TINY, params, ids_BT, mask_BT)
    h_BTD = model.hidden_states(TINY, params, ids_BT, mask_BT)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 6, TINY.vocab_size)
    np.testing.assert_allclose(
        np.asarray(model.unembed(TINY, params, h_BTD)), np.asarray(logits), atol=1e-6
    )
    # Tied head: logits are h . embedding^T.
    ref = np.einsum("btd,vd->btv", np.asarray(h_BTD), np.asarray(params["embed"]["embedding"]))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5)


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
    np.testing.assert_allclose(np.asarray(logits_BV), full[:, 3], atol=1e-5)
    for r in range(4):
        logits_BV, cache = model.decode_step(config, params, new_BR[:, r], cache)
        np.testing.assert_allclose(np.asarray(logits_BV), full[:, 4 + r], atol=1e-5)
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
    np.testing.assert_allclose(np.asarray(two), np.asarray(one), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.pos_B), [5, 6])


def test_repeat_cache_then_decode_matches_repeated_rows():
    params = _params()
    prompt_BP = _tokens(7, (2, 3))
    mask_BP = jnp.array([[0, 1, 1], [1, 1, 1]], jnp.int32)
    _, cache = model.prefill(TINY, params, prompt_BP, mask_BP, model.init_cache(TINY, 2, 6))
    rep = model.repeat_cache(cache, 3)
    assert rep.k_LBSKH.shape[1] == 6
    # Copies adjacent: rows 0,1,2 come from row 0 and rows 3,4,5 from row 1.
    np.testing.assert_array_equal(np.asarray(rep.pos_B), [2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(np.asarray(rep.k_LBSKH[:, 4]), np.asarray(cache.k_LBSKH[:, 1]))
    tokens_B = jnp.array([5, 6, 7, 8, 9, 10], jnp.int32)
    logits_BV, _ = model.decode_step(TINY, params, tokens_B, rep)
    full = model.forward(
        TINY,
        params,
        jnp.concatenate([jnp.repeat(prompt_BP, 3, axis=0), tokens_B[:, None]], axis=1),
        jnp.concatenate([jnp.repeat(mask_BP, 3, axis=0), jnp.ones((6, 1), jnp.int32)], axis=1),
    )
    np.testing.assert_allclose(np.asarray(logits_BV), np.asarray(full[:, -1]), atol=1e-5)


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
        flat_axes = dict(model._flatten(axes))
        flat_shapes = dict(model._flatten(shapes))
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
    g_remat = jax.grad(lambda p: loss(model.ModelConfig.tiny(remat=True), p))(params)
    chex.assert_trees_all_close(g_plain, g_remat, atol=1e-6)
    bf16 = model.ModelConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert all(
        x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.abstract_params(bf16))
    )
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits = model.forward(bf16, p16, ids_BT, mask_BT)
    assert logits.dtype == jnp.float32
    # The f32 weights rounded to bf16: logits agree with the f32 model to bf16 precision.
    ref = model.forward(TINY, params, ids_BT, mask_BT)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-2)


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
