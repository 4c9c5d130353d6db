"""LoRA invariants (grpo_jax/models/lora.py): an untrained adapter is exactly the base, merged equals
unmerged, gradients reach only the adapters and equal the chain rule through the merged
weights, the optimizer holds adapter state only, the reference is the base with the adapters
off, a sharded step equals one device, the loop trains and resumes bitwise, and the PEFT
export loads in peft with our logits. The vLLM push round trips are in test_vllm.py."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import optax
import pytest
import reference

from grpo_jax import config, loading, model, sampler, sharding
from grpo_jax.data import demo_task
from grpo_jax.models import hf as hf_lib
from grpo_jax.models import lora
from grpo_jax.trainer import actor as actor_lib
from grpo_jax.trainer import loop, packing

BASE = model.ModelConfig.tiny()
CFG = lora.configure(BASE, rank=4, alpha=8, target_modules="all-linear")
# The same gradients or logits computed in another order (packed, sharded, merged, the chain rule
# through the merged weights; torch's kernels for HF_ULPS), in ulps of each tensor's scale
# (tests/numerics.py). A dropped token or a wrong LoRA scale moves them by 1e4 ulps and more.
GRAD_ULPS = 1024
FORWARD_ULPS = 128
HF_ULPS = 512


@pytest.fixture(scope="module")
def base():
    return model.init_params(CFG, jax.random.key(0))


def _trained(adapters, scale=0.2, seed=1):
    """Adapters as after some training: B (and A) moved away from their init."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )


@pytest.fixture(scope="module")
def adapters():
    return _trained(lora.init_adapters(CFG, jax.random.key(7)))


def _inputs():
    ids = jnp.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    mask = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Forward


def test_fresh_adapters_give_exactly_the_base_logits(base):
    fresh = lora.init_adapters(CFG, jax.random.key(3))
    ids, mask = _inputs()
    got = model.forward(CFG, lora.attach(base, fresh), ids, mask)
    np.testing.assert_array_equal(got, model.forward(BASE, base, ids, mask))
    # PEFT's init: B = 0, A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), independent per target.
    q, o = fresh["layers"]["attn"]["q_proj"], fresh["layers"]["attn"]["o_proj"]
    assert not np.any(q["lora_b"]) and np.all(np.abs(q["lora_a"]) <= 1 / math.sqrt(32))
    assert np.abs(q["lora_a"]).max() > 0.5 / math.sqrt(32)
    assert np.abs(o["lora_a"]).max() <= 1 / math.sqrt(4 * 8)  # o_proj's fan-in is N x H
    assert not np.allclose(q["lora_a"], fresh["layers"]["attn"]["k_proj"]["lora_a"])


def test_bf16_base_with_f32_adapters(base):
    # The frozen base may be bfloat16 while the adapters (and their gradients and Adam state)
    # stay float32; zero B still leaves the logits exactly the base's.
    cfg16 = dataclasses.replace(CFG, param_dtype=jnp.bfloat16)
    base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    fresh = lora.init_adapters(cfg16, jax.random.key(3))
    assert {x.dtype for x in jax.tree.leaves(fresh)} == {jnp.dtype(jnp.float32)}
    ids, mask = _inputs()
    np.testing.assert_array_equal(
        model.forward(cfg16, lora.attach(base16, fresh), ids, mask),
        model.forward(dataclasses.replace(BASE, param_dtype=jnp.bfloat16), base16, ids, mask),
    )
    g = _grads(fresh, _batch(), base16, model_config=cfg16)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.float32)}
    assert np.abs(g["layers"]["attn"]["q_proj"]["lora_b"]).max() > 0  # B = 0: only B moves
    assert not np.any(g["layers"]["attn"]["q_proj"]["lora_a"])  # dL/dA = s G B^T = 0


def test_merged_forward_equals_unmerged(base, adapters):
    ids, mask = _inputs()
    unmerged = model.forward(CFG, lora.attach(base, adapters), ids, mask)
    merged_params = lora.merge(CFG, lora.attach(base, adapters))
    merged = model.forward(CFG, merged_params, ids, mask)
    assert np.abs(unmerged - model.forward(CFG, base, ids, mask)).max() > 0.1  # adapters matter
    numerics.assert_close(unmerged, merged, ulps=FORWARD_ULPS)
    # merge folds scale * A @ B into the kernel and touches nothing else
    q = adapters["layers"]["attn"]["q_proj"]
    want = base["layers"]["attn"]["q_proj"]["kernel"] + 2.0 * jnp.einsum(
        "LDR,LRNH->LDNH", q["lora_a"], q["lora_b"]
    )
    np.testing.assert_allclose(merged_params["layers"]["attn"]["q_proj"]["kernel"], want,
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    assert merged_params["embed"]["embedding"] is base["embed"]["embedding"]
    assert (
        merged_params["layers"]["attn"]["q_proj"]["bias"]
        is base["layers"]["attn"]["q_proj"]["bias"]
    )


def test_cached_decode_with_adapters_equals_the_merged_sampler(base, adapters):
    ids, mask = _inputs()
    kw = dict(n=2, max_new_tokens=6, temperature=0.0, eos_token_ids=())
    unmerged = sampler.sample(CFG, lora.attach(base, adapters), ids, mask, jax.random.key(0), **kw)
    merged = sampler.sample(CFG, lora.merge(CFG, lora.attach(base, adapters)), ids, mask,
                            jax.random.key(0), **kw)  # fmt: skip
    np.testing.assert_array_equal(unmerged.response_ids, merged.response_ids)
    numerics.assert_close(unmerged.log_probs, merged.log_probs, ulps=FORWARD_ULPS)


def test_targets_choose_the_projections(base):
    cfg = lora.configure(BASE, rank=2, alpha=4, target_modules="q_proj, down_proj")
    assert cfg.lora_targets == ("q_proj", "down_proj")
    ad = _trained(lora.init_adapters(cfg, jax.random.key(0)))
    assert set(ad["layers"]["attn"]) == {"q_proj"} and set(ad["layers"]["mlp"]) == {"down_proj"}
    merged = lora.merge(cfg, lora.attach(base, ad))
    for group, name in (("attn", "k_proj"), ("attn", "o_proj"), ("mlp", "up_proj")):
        assert merged["layers"][group][name]["kernel"] is base["layers"][group][name]["kernel"]
    assert lora.num_params(cfg) == 2 * 2 * (32 + 32) + 2 * 2 * (64 + 32)  # L r (in + out)


@pytest.mark.parametrize(
    "value, match",
    [("", "is empty"), ("q_proj,lm_head", "unknown projections"), ("q_proj,q_proj", "repeats")],
)
def test_target_modules_errors(value, match):
    with pytest.raises(ValueError, match=f"target_modules=.*{match}"):
        lora.parse_target_modules(value)


def test_model_refuses_mismatched_adapters(base, adapters):
    ids, mask = _inputs()
    with pytest.raises(ValueError, match="lora_rank=0"):
        model.forward(BASE, lora.attach(base, adapters), ids, mask)
    other = lora.configure(BASE, rank=2, alpha=8, target_modules="all-linear")
    with pytest.raises(ValueError, match="LoRA adapter .* has shape"):
        model.forward(other, lora.attach(base, adapters), ids, mask)
    with pytest.raises(ValueError, match="unexpected"):
        model.to_hf_state_dict(CFG, lora.attach(base, adapters))  # export merged weights


# ---------------------------------------------------------------------------------------------
# Training


def _batch(rng=0, *, B=8, Tp=3, T=5):
    r = np.random.default_rng(rng)
    prompt_BP = r.integers(1, CFG.vocab_size, (B, Tp)).astype(np.int32)
    prompt_mask_BP = np.ones((B, Tp), np.int32)
    prompt_mask_BP[::2, 0] = 0
    resp_BT = r.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    mask_BT = (np.arange(T)[None] < (1 + np.arange(B) % T)[:, None]).astype(np.int32)
    adv_B = np.linspace(-1.0, 1.5, B).astype(np.float32)
    return actor_lib.TrainBatch(
        input_ids_BS=jnp.asarray(np.concatenate([prompt_BP, resp_BT], 1)),
        attention_mask_BS=jnp.asarray(np.concatenate([prompt_mask_BP, mask_BT], 1)),
        response_ids_BT=jnp.asarray(resp_BT),
        response_mask_BT=jnp.asarray(mask_BT),
        advantages_BT=jnp.asarray(adv_B[:, None] * mask_BT),
    )


_SGD = optax.identity()


# p1 = p0 - lr g: with lr = 2^10 the recovered (p0 - p1) / lr carries eps |p0| / lr, far below an
# ulp of g, and the division is exact (tests/test_train_step.py).
SGD_LR = 2.0**10


@functools.partial(jax.jit, static_argnames=("model_config", "micro"))
def _sgd_step(state, batch, base, *, model_config, micro):
    return actor_lib.train_step(
        state, batch, jnp.int32(0), jnp.float32(SGD_LR), base, model_config=model_config,
        loss_config=actor_lib.LossConfig(), tx=_SGD, mini_batch_size=8, micro_batch_size=micro,
    )  # fmt: skip


def _grads(params, batch, base=None, *, model_config=CFG, micro=4):
    """Gradient recovered from one SGD step (identity optimizer): g = (p0 - p1) / SGD_LR."""
    new, _ = _sgd_step(actor_lib.init_state(params, _SGD), batch, base, model_config=model_config,
                       micro=micro)  # fmt: skip
    return jax.tree.map(lambda a, b: (a - b) / SGD_LR, params, new.params)


def test_gradients_reach_only_the_adapters_and_follow_the_merged_chain_rule(base, adapters):
    batch = _batch()
    g_ad = _grads(adapters, batch, base)
    assert jax.tree.structure(g_ad) == jax.tree.structure(adapters)  # no base gradient at all
    # Reference: full fine-tuning's gradient G at the merged weights W' = W + s A @ B, then the
    # chain rule dL/dA = s G B^T, dL/dB = s A^T G (per layer, in and out axes flattened).
    merged = lora.merge(CFG, lora.attach(base, adapters))
    g_full = _grads(merged, batch, model_config=BASE)
    s = CFG.lora_scale
    for group, name in (("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "down_proj")):
        node, g = adapters["layers"][group][name], g_ad["layers"][group][name]
        a, b = node["lora_a"], node["lora_b"]
        L, r = a.shape[0], a.shape[-1]
        G = g_full["layers"][group][name]["kernel"].reshape(L, a[0, ..., 0].size, -1)
        want_a = s * jnp.einsum("LIO,LRO->LIR", G, b.reshape(L, r, -1))
        want_b = s * jnp.einsum("LIR,LIO->LRO", a.reshape(L, -1, r), G)
        numerics.assert_close(g["lora_a"].reshape(want_a.shape), want_a, ulps=GRAD_ULPS,
                              err_msg=f"{name}.lora_a")  # fmt: skip
        numerics.assert_close(g["lora_b"].reshape(want_b.shape), want_b, ulps=GRAD_ULPS,
                              err_msg=f"{name}.lora_b")  # fmt: skip
        assert np.abs(want_a).max() > 1e-4 and np.abs(want_b).max() > 1e-4


def test_packed_micro_batches_give_the_padded_adapter_gradient(base, adapters):
    # Token-budget packing (actor.use_dynamic_bsz) with LoRA: the summed packed micro-batch
    # gradients of the adapters equal the padded step's (mixed prompt and response lengths).
    r = np.random.default_rng(3)
    B, P, T = 8, 5, 5
    p_len, r_len = r.integers(1, P + 1, B), r.integers(1, T + 1, B)
    prompt_mask = (np.arange(P)[None] >= P - p_len[:, None]).astype(np.int32)
    prompt_ids = r.integers(1, CFG.vocab_size, (B, P)).astype(np.int32) * prompt_mask
    resp_mask = (np.arange(T)[None] < r_len[:, None]).astype(np.int32)
    resp_ids = r.integers(1, CFG.vocab_size, (B, T)).astype(np.int32) * resp_mask
    adv = np.linspace(-1.0, 1.5, B).astype(np.float32)[:, None] * resp_mask
    batch = actor_lib.TrainBatch(
        input_ids_BS=jnp.asarray(np.concatenate([prompt_ids, resp_ids], 1)),
        attention_mask_BS=jnp.asarray(np.concatenate([prompt_mask, resp_mask], 1)),
        response_ids_BT=jnp.asarray(resp_ids),
        response_mask_BT=jnp.asarray(resp_mask),
        advantages_BT=jnp.asarray(adv),
    )
    want = _grads(adapters, batch, base, micro=8)
    packed = packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=24, row_len=12)
    step = jax.jit(functools.partial(actor_lib.packed_micro_grads, model_config=CFG,
                                     loss_config=actor_lib.LossConfig()))  # fmt: skip
    grads = jax.tree.map(jnp.zeros_like, adapters)
    for m in range(packed.num_micro):
        micro = actor_lib.PackedMicro(**{k: jnp.asarray(v) for k, v in packed.micro(m).items()})
        grads, _ = step(adapters, grads, micro, batch, base)
    assert packed.num_micro > 1
    numerics.assert_trees_close(grads, want, ulps=GRAD_ULPS, err_msg="grad")


def test_optimizer_state_holds_the_adapters_only(adapters):
    tx = actor_lib.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.01)
    state = actor_lib.init_state(adapters, tx)
    arrays = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(x.size for x in arrays) == 2 * lora.num_params(CFG)  # Adam's mu and nu
    full = sum(x.size for x in jax.tree.leaves(model.abstract_params(CFG)))
    assert 2 * lora.num_params(CFG) < 0.2 * 2 * full


def test_reference_log_probs_are_the_base_with_adapters_off(base, adapters):
    batch = _batch(2)
    kw = dict(micro_batch_size=4, temperature=1.0, chunk_size=16, calculate_entropy=False)
    ref, _ = actor_lib.compute_log_probs(CFG, base, batch, **kw)
    plain, _ = actor_lib.compute_log_probs(BASE, base, batch, **kw)
    policy, _ = actor_lib.compute_log_probs(CFG, lora.attach(base, adapters), batch, **kw)
    np.testing.assert_array_equal(ref, plain)
    assert np.abs(np.asarray(policy - ref) * np.asarray(batch.response_mask_BT)).max() > 1e-3


def test_sharded_lora_step_matches_single_device(base, adapters):
    mesh = sharding.make_mesh((2, 2, 2))
    batch = _batch(5)
    want = _grads(adapters, batch, base)
    ad_sh = sharding.adapter_shardings(CFG, mesh)
    assert ad_sh["layers"]["attn"]["q_proj"]["lora_b"].spec == jax.sharding.PartitionSpec(
        None, None, "tensor", None
    )
    got = _grads(
        jax.device_put(adapters, ad_sh), jax.tree.map(
            lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch
        ), jax.device_put(base, sharding.param_shardings(CFG, mesh)),
    )  # fmt: skip
    numerics.assert_trees_close(got, want, ulps=GRAD_ULPS, err_msg="grad")


# ---------------------------------------------------------------------------------------------
# The loop (tiny random model, one device): trains, checkpoints adapters only, resumes exactly


def _run(tmp_path, *, steps=2, **model_fields):
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8),
        model=config.ModelSpec(source="random", tokenizer="char",
                               **{"lora_rank": 4, "lora_alpha": 8.0} | model_fields),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                                 use_kl_loss=True, optim=config.OptimConfig(lr=1e-2)),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=8),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=steps, save_freq=1, test_freq=-1,
                                     val_before_train=False, progress_bar=False,
                                     tensorboard=False, default_local_dir=str(tmp_path)),
    )  # fmt: skip
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(run.model, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)  # fmt: skip
        rows, _ = demo_task.arithmetic_rows(64, 4, max_operand=20, seed=0)
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=rows, reward_fn=_odd_length, mesh=mesh)  # fmt: skip
    return result, params


def _odd_length(solution_str, ground_truth):
    del ground_truth
    return float(len(solution_str) % 2)


_WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")  # vary by run


def _comparable(history):
    return [{k: v for k, v in r.items() if not k.startswith(_WALL_CLOCK)} for r in history]


@pytest.mark.slow
def test_loop_trains_adapters_and_resumes_bitwise(tmp_path):
    full, base = _run(tmp_path / "full")
    assert full.model_config.lora_rank == 4 and full.base_params is not None
    assert jax.tree.structure(full.state.params) == jax.tree.structure(
        model.abstract_adapters(full.model_config)
    )
    # the base is untouched (it is also the reference: KL loss on, no copy made)
    for a, b in zip(jax.tree.leaves(full.base_params), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [r for r in full.history if "actor/pg_loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["actor/kl_loss"]) for r in rows)
    b_q = full.state.params["layers"]["attn"]["q_proj"]["lora_b"]
    assert np.abs(b_q).max() > 0  # the adapters moved
    # checkpoints hold the adapters (+ Adam state), not the base
    ckpt = tmp_path / "full" / "checkpoints" / "2"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    assert size < base_bytes
    # resume: 1 step, then the same workdir to 2 steps, equals the uninterrupted run bitwise
    _run(tmp_path / "resumed", steps=1)
    resumed, _ = _run(tmp_path / "resumed", steps=2)
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _comparable(resumed.history) == _comparable(full.history[1:])
    # a checkpoint of another LoRA setup (same shapes, another alpha) is refused, not loaded
    with pytest.raises(ValueError, match="model.lora_alpha"):
        _run(tmp_path / "resumed", steps=3, lora_alpha=16.0)
    with pytest.raises(ValueError, match="full fine-tuning"):
        _run(tmp_path / "resumed", steps=3, lora_rank=0)


# ---------------------------------------------------------------------------------------------
# Export: the merged model for transformers, and the adapter for peft


@pytest.mark.reference("hf")
def test_peft_export_loads_in_peft_with_our_logits(tmp_path, base, adapters):
    torch, transformers = reference.hf()
    peft = reference.import_or_require("peft", "hf", "pip install peft (requirements.txt)")
    model.save_hf_checkpoint(CFG, base, tmp_path / "base")
    hf_lib.save_adapter(CFG, adapters, tmp_path / "adapter",
                           base_model_name_or_path=str(tmp_path / "base"))  # fmt: skip
    model.save_hf_checkpoint(CFG, lora.merge(CFG, lora.attach(base, adapters)), tmp_path / "merged")
    ids, mask = _inputs()
    want = np.asarray(model.forward(CFG, lora.attach(base, adapters), ids, mask))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base",
                                                                dtype=torch.float32)  # fmt: skip
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    cfg = peft_model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (4, 8, set(model.LORA_TARGETS))
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                  dtype=torch.float32)  # fmt: skip
    t_ids, t_mask = torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(mask))
    valid = np.asarray(mask, bool)
    with torch.no_grad():
        for hf in (peft_model, hf_merged.eval()):
            got = hf(input_ids=t_ids, attention_mask=t_mask).logits.numpy()
            numerics.assert_close(got[valid], want[valid], ulps=HF_ULPS)
    names = hf_lib.adapter_tensors(CFG, adapters)
    assert names[0].name.startswith("base_model.model.model.layers.0.")
    assert {t.name for t in names} >= {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
    }


# ---------------------------------------------------------------------------------------------
# Config


def test_config_checks_name_the_fields():
    with pytest.raises(config.ConfigError) as e:
        config.ModelSpec(lora_rank=-1, lora_alpha=0.0, target_modules="q_proj,mlp")
    text = str(e.value)
    for field in (
        "model.lora_rank=-1",
        "model.lora_alpha=0.0",
        "model.target_modules='q_proj,mlp'",
    ):
        assert field in text
    with pytest.raises(config.ConfigError, match="rollout.vllm.lora_sync='adapter'.*lora_rank"):
        config.RunConfig(rollout=config.RolloutConfig(
            vllm=config.VLLMSettings(lora_sync="adapter")))  # fmt: skip
    config.RunConfig(
        model=config.ModelSpec(lora_rank=8),
        rollout=config.RolloutConfig(vllm=config.VLLMSettings(lora_sync="adapter")),
    )
    assert dataclasses.asdict(config.ModelSpec())["target_modules"] == "all-linear"


def test_adapter_init_draws_from_its_own_stream():
    # Loop step i samples with fold_in(key(trainer.seed), i) (loop.py); the adapters' init and
    # the update's draws fold in constants above any step count (0x10A was step 266's key).
    from grpo_jax.trainer import setup

    streams = (setup.LORA_INIT_STREAM, actor_lib.UPDATE_STREAM)
    assert min(streams) >= 1 << 30 and len(set(streams)) == 2
    root = jax.random.key(0)
    init = jax.random.key_data(jax.random.fold_in(root, setup.LORA_INIT_STREAM))
    steps = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(root, i)))(
        jnp.arange(4096, dtype=jnp.uint32)
    )
    assert not (np.asarray(steps) == np.asarray(init)).all(axis=-1).any()
