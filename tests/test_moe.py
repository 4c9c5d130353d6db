"""Qwen3-MoE (grpo_jax/models/moe.py): parity with transformers' Qwen3MoeForCausalLM (logits,
gradients, the load-balancing loss, greedy generate), the HF checkpoint round trip, and the
sharded forward and gradient (experts split over the mesh) against one device."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from test_model import _mixed_batch, hf_random_model

from grpo_jax import model, sampler, sharding
from grpo_jax.models import moe, transformer

# Layer kinds: "dense_first" is dense, MoE, MoE, MoE (mlp_only_layers); "alternating" is
# dense, MoE, dense, MoE (decoder_sparse_step=2): several scanned runs of each kind.
CASES = {
    "dense_first": {"mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": True},
    "alternating": {"mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False},
}


def _hf_moe(case: str, seed: int = 0):
    """A tiny random transformers Qwen3-MoE with O(1) weights (HF's 0.02 init: flat logits)."""
    _, transformers = reference.hf()
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        **CASES[case],
    )
    return hf_random_model(hf_config, seed)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, the HF model, its save_pretrained directory, our config and params loaded from it)."""
    hf = _hf_moe(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    config, params = model.load_hf_checkpoint(path)
    return request.param, hf, path, config, params


def _hf_forward(hf, ids_BT, mask_BT):
    import torch

    pos_BT = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0)
    return hf(
        input_ids=torch.from_numpy(ids_BT).long(),
        attention_mask=torch.from_numpy(mask_BT).long(),
        position_ids=torch.from_numpy(pos_BT).long(),
        output_router_logits=True,
    )


@pytest.mark.reference("hf")
def test_config_and_layer_kinds_follow_hf(checkpoint):
    case, hf, _, config, params = checkpoint
    assert config.arch == "qwen3_moe" and config.num_experts == 8
    assert config.norm_topk_prob == CASES[case]["norm_topk_prob"]
    assert config.router_aux_loss_coef == pytest.approx(0.01)
    hf_kinds = tuple(type(layer.mlp).__name__ != "Qwen3MoeMLP" for layer in hf.model.layers)
    assert config.moe_layers == hf_kinds
    assert params["layers"]["moe"]["gate_proj"]["kernel"].shape[:2] == (sum(hf_kinds), 8)


@pytest.mark.reference("hf")
def test_logits_and_aux_loss_match_transformers(checkpoint):
    import torch

    _, hf, _, config, params = checkpoint
    ids_BT, mask_BT = _mixed_batch(config.vocab_size)
    with torch.no_grad():
        out = _hf_forward(hf, ids_BT, mask_BT)
    ref = out.logits.numpy()
    ours = np.asarray(model.forward(config, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)))
    real = mask_BT.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # far from flat: the comparison has teeth
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)

    _, stats = transformer.hidden_states_and_routing(
        config, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)
    )
    aux = float(moe.load_balancing_loss(stats))
    assert aux == pytest.approx(float(out.aux_loss), rel=1e-5)
    # The recorded experts are HF's top-2 of each MoE layer's router logits (real tokens).
    hf_top = [torch.topk(g, 2, dim=-1).indices.numpy() for g in out.router_logits]
    ours_top = np.asarray(stats.experts_LmBTA).reshape(len(hf_top), -1, 2)
    for layer, want in enumerate(hf_top):
        np.testing.assert_array_equal(
            np.sort(ours_top[layer][real.reshape(-1)], -1), np.sort(want[real.reshape(-1)], -1)
        )
    assert float(stats.counts_LmE.sum()) == pytest.approx(len(hf_top) * real.sum() * 2)


@pytest.mark.reference("hf")
def test_gradients_match_torch(checkpoint):
    torch, _ = reference.hf()
    _, hf, _, config, params = checkpoint
    ids_BT, mask_BT = _mixed_batch(config.vocab_size)
    w_BTV = np.random.default_rng(3).standard_normal((*ids_BT.shape, config.vocab_size))
    w_BTV = (w_BTV * mask_BT[..., None]).astype(np.float32)
    coef = config.router_aux_loss_coef

    def loss(params):
        h_BTD, stats = transformer.hidden_states_and_routing(
            config, params, jnp.asarray(ids_BT), jnp.asarray(mask_BT)
        )
        logits = transformer.unembed(config, params, h_BTD)
        return jnp.sum(logits * w_BTV) + coef * moe.load_balancing_loss(stats)

    grads = model.to_hf_state_dict(config, jax.grad(loss)(params))
    hf.zero_grad()
    out = _hf_forward(hf, ids_BT, mask_BT)
    (torch.sum(out.logits * torch.from_numpy(w_BTV)) + coef * out.aux_loss).backward()
    want = {}
    for name, p in hf.named_parameters():
        g = p.grad.numpy()
        if name.endswith("experts.gate_up_proj"):  # transformers 5 fuses [E, 2F, D] in memory
            gate, up = np.split(g, 2, axis=1)
            for e in range(g.shape[0]):
                stem = name.removesuffix("gate_up_proj")
                want[f"{stem}{e}.gate_proj.weight"], want[f"{stem}{e}.up_proj.weight"] = (
                    gate[e], up[e]
                )
        elif name.endswith("experts.down_proj"):
            for e in range(g.shape[0]):
                want[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = g[e]
        else:
            want[name] = g
    assert grads.keys() == want.keys()
    scale = max(np.abs(g).max() for g in want.values())
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, atol=2e-5 * scale, rtol=0, err_msg=name)
    # The router gets a gradient (through the top-k weights and the aux loss).
    assert np.abs(want["model.layers.1.mlp.gate.weight"]).max() > 0


@pytest.mark.reference("hf")
def test_save_writes_transformers_files_and_reloads(checkpoint, tmp_path):
    from safetensors.numpy import load_file

    _, transformers = reference.hf()
    _, hf, path, config, params = checkpoint
    model.save_hf_checkpoint(config, params, tmp_path / "out")
    theirs = load_file(path / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert ours.keys() == model.to_hf_state_dict(config, params).keys()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_experts"] == 8 and written["architectures"] == ["Qwen3MoeForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert model.ModelConfig.from_hf(reloaded.config) == config


@pytest.mark.reference("hf")
def test_greedy_sampling_matches_hf_generate(checkpoint):
    import torch

    _, hf, _, config, params = checkpoint
    new_tokens = 10
    ids_PT, mask_PT = _mixed_batch(config.vocab_size)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=torch.from_numpy(ids_PT).long(),
            attention_mask=torch.from_numpy(mask_PT).long(),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[:, ids_PT.shape[1] :].numpy()
    top2 = torch.stack(out.scores, 1).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # no near-ties: greedy is well defined
    ours = sampler.sample(
        config, params, ids_PT, mask_PT, jax.random.key(0), n=2, max_new_tokens=new_tokens,
        temperature=0.0, pad_token_id=0,
    )  # fmt: skip
    np.testing.assert_array_equal(ours.response_ids, np.repeat(expected, 2, axis=0))
    assert len(np.unique(expected)) > 3


def _tiny_moe(**overrides):
    return model.ModelConfig(
        arch="qwen3_moe", qkv_bias=False, qk_norm=True, num_layers=3, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,),
        tie_word_embeddings=False, router_aux_loss_coef=0.01, initializer_range=0.3,
        **overrides,
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_forward_and_grad_equal_one_device(shape):
    config = _tiny_moe()
    params = jax.device_get(model.init_params(config, jax.random.key(1)))
    rng = np.random.default_rng(1)
    ids_BT = rng.integers(1, config.vocab_size, (8, 7)).astype(np.int32)
    mask_BT = np.ones_like(ids_BT)
    mask_BT[1::2, :3] = 0

    def loss(params, ids, mask):
        h_BTD, stats = transformer.hidden_states_and_routing(config, params, ids, mask)
        logp = jax.nn.log_softmax(transformer.unembed(config, params, h_BTD))
        logp_BT = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1)[..., 0]
        nll = -jnp.sum(logp_BT * mask[:, 1:])
        return nll + config.router_aux_loss_coef * moe.load_balancing_loss(stats)

    def run(mesh):
        p_sh = sharding.param_shardings(config, mesh)
        p = jax.device_put(params, p_sh)
        ids, mask = jax.device_put((ids_BT, mask_BT), sharding.batch_sharding(mesh, 2))
        with sharding.use_mesh(mesh):
            value, grads = jax.jit(jax.value_and_grad(loss))(p, ids, mask)
        return p_sh, value, grads

    _, ref_value, ref_grads = run(sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1]))
    p_sh, value, grads = run(sharding.make_mesh(shape))
    gate_spec = p_sh["layers"]["moe"]["gate_proj"]["kernel"].spec
    assert gate_spec[1] == "fsdp"  # the experts are split over the FSDP devices
    assert float(value) == pytest.approx(float(ref_value), rel=1e-5)
    for (path, g), r in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)
    ):
        scale = float(np.abs(np.asarray(r)).max())
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), atol=1e-5 * scale + 1e-7, rtol=0,
            err_msg=jax.tree_util.keystr(path),
        )  # fmt: skip


def test_train_step_logs_router_metrics_of_the_rollout_batch():
    from grpo_jax.trainer import actor

    config = _tiny_moe(vocab_size=64)
    params = model.init_params(config, jax.random.key(2))
    rng = np.random.default_rng(0)
    ids_BS = rng.integers(1, 64, (4, 7)).astype(np.int32)
    mask_BS = np.ones_like(ids_BS)
    mask_BS[::2, 0] = 0
    batch = actor.TrainBatch(
        input_ids_BS=jnp.asarray(ids_BS),
        attention_mask_BS=jnp.asarray(mask_BS),
        response_ids_BT=jnp.asarray(ids_BS[:, 3:]),
        response_mask_BT=jnp.ones((4, 4), jnp.int32),
        advantages_BT=jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)),
    )
    tx = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.0)
    step = jax.jit(functools.partial(
        actor.train_step, rng=None, model_config=config, loss_config=actor.LossConfig(), tx=tx,
        mini_batch_size=4, micro_batch_size=4,
    ))  # fmt: skip
    _, metrics = step(actor.init_state(params, tx), batch, jnp.int32(0), jnp.float32(1e-3))
    _, stats = transformer.hidden_states_and_routing(config, params, batch.input_ids_BS, mask_BS)
    assert float(metrics["actor/moe_aux_loss"]) == pytest.approx(
        float(moe.load_balancing_loss(stats)), rel=1e-5
    )
    # Two MoE layers (layer 1 is dense); each share lies in [0, 1] with max >= 1/E >= min.
    assert sorted(k for k in metrics if k.startswith("actor/moe_load_max/")) == [
        "actor/moe_load_max/0", "actor/moe_load_max/1"
    ]  # fmt: skip
    for layer in range(2):
        hi, lo = metrics[f"actor/moe_load_max/{layer}"], metrics[f"actor/moe_load_min/{layer}"]
        assert 1.0 >= float(hi) >= 1 / 8 >= float(lo) >= 0.0


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)], ids=["data 8", "data 2 fsdp 2 tp 2"])
def test_the_paged_engine_samples_a_moe_model_as_the_sampler_does(mesh_shape):
    # The engine vmaps each shard's programs over the shard axis (spmd_axis_name), with the
    # expert weights unbatched: the grouped matmuls run under that vmap and in the shard_map.
    from test_paged import _EOS, _assert_same_rollout, _on_mesh, _prompts

    from grpo_jax.rollout import paged

    config = _tiny_moe()
    params = model.init_params(config, jax.random.key(4))
    mesh = sharding.make_mesh(mesh_shape)
    ids, mask = _prompts([5, 9, 2, 7, 3, 11, 4, 6], config.vocab_size, seed=3)
    kw = dict(n=2, max_new_tokens=8, temperature=1.0, eos_token_ids=(_EOS,))
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        sparams, sids, smask = _on_mesh(config, params, mesh, ids, mask)
        stats = {}
        out = paged.sample_paged(config, sparams, sids, smask, jax.random.key(2), max_num_seqs=2,
                                 page_size=4, stats=stats, **kw)  # fmt: skip
    assert stats["shards"] == mesh.shape["data"] * mesh.shape["fsdp"] > 1
    ref = sampler.sample(config, params, ids, mask, jax.random.key(2), **kw)
    _assert_same_rollout(config, params, ids, mask, jax.random.key(2), ref, out,
                         temperature=1.0, top_k=-1, top_p=1.0)  # fmt: skip


def _experts_memory(mesh, num_tokens: int, *, stand_in=False):
    """Compiled temporaries (bytes a device) of the experts' forward and gradient on
    `num_tokens` tokens split over the mesh's batch axes, with the tiny model's expert sizes."""
    config = _tiny_moe()
    E, D, F, A = config.num_experts, config.hidden_size, config.moe_intermediate_size, 2
    rules = sharding.LOGICAL_RULES
    Ps, Sds = jax.sharding.PartitionSpec, jax.ShapeDtypeStruct
    tokens = jax.sharding.NamedSharding(mesh, Ps(sharding.BATCH_AXES))
    w_sh = jax.sharding.NamedSharding(mesh, Ps("fsdp", "sequence", "tensor"))
    d_sh = jax.sharding.NamedSharding(mesh, Ps("fsdp", "tensor", "sequence"))

    def loss(x_XD, weights_XA, experts_XA, gate, up, down):
        return jnp.sum(moe.grouped_swiglu(x_XD, weights_XA, experts_XA, gate, up, down) ** 2)

    args = (
        Sds((num_tokens, D), jnp.float32, sharding=tokens),
        Sds((num_tokens, A), jnp.float32, sharding=tokens),
        Sds((num_tokens, A), jnp.int32, sharding=tokens),
        Sds((E, D, F), jnp.float32, sharding=w_sh),
        Sds((E, D, F), jnp.float32, sharding=w_sh),
        Sds((E, F, D), jnp.float32, sharding=d_sh),
    )
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4, 5)))
    with sharding.use_mesh(mesh, rules), moe.capacity_stand_in() if stand_in else _null():
        compiled = grad.lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_each_device_computes_only_its_own_tokens_experts():
    # Per device the experts' temporaries are those of its own X / 8 tokens (plus the layer's
    # gathered expert weights), not of the global batch: no token-sized all-gather.
    config = _tiny_moe()
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    one = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    eight = sharding.make_mesh((1, 8, 1))
    local, _ = _experts_memory(one, 256)
    sharded, hlo = _experts_memory(eight, 8 * 256)
    whole, _ = _experts_memory(one, 8 * 256)
    weights = 2 * 3 * E * D * F * 4  # the gathered weights and their gradients, float32
    assert sharded <= local + weights < whole / 4
    gathered = [line for line in hlo.splitlines() if "all-gather(" in line]
    assert gathered and all(f"[{E}," in line.split("=")[1] for line in gathered), gathered


def test_the_planning_stand_in_has_a_grouped_matmuls_buffers():
    # XLA:CPU's ragged_dot is a dense masked dot over all E experts (temporaries ~ Y x E x F);
    # the stand-in's are those of Y rows (Y x F), as a GPU's or TPU's grouped matmul.
    config = _tiny_moe()
    one = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    dense, _ = _experts_memory(one, 1024)
    stand_in, _ = _experts_memory(one, 1024, stand_in=True)
    assert stand_in < dense / (config.num_experts / 3)
