"""Ulysses sequence parallelism (actor.ulysses_sequence_parallel_size) on 8 fake CPU devices.

With the mesh's `sequence` axis at sp, every row's tokens are split over sp devices and attention
runs on whole rows split by head (grpo_jax/sharding.py). The update, the log-prob passes and a
whole loop step must then compute what sp = 1 computes on the same data-parallel width, up to
float32 rounding (the bound the issue names: 1e-5), padded and packed rows alike; and the split
must really happen (an all-to-all in the compiled program, activations split by token).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config, loading, model, sharding
from grpo_jax.data import demo_task
from grpo_jax.models import lora, transformer
from grpo_jax.rollout import engines, paged
from grpo_jax.trainer import actor, loop, packing
from grpo_jax.trainer import setup as setup_lib

CFG = model.ModelConfig.tiny()  # 4 query heads, 2 kv heads
DP = 2  # data-parallel width of every mesh below: only the sequence axis changes
TOL = 1e-5  # float32: |a - b| <= TOL * max(1, |b|), the issue's bound
B, TP, TR = 8, 8, 8  # rows, prompt and response tokens of the padded batch (16 a row)


def _mesh(sp: int):
    return sharding.make_mesh((1, DP, sp, 1), devices=jax.devices()[: DP * sp])


def _assert_close(got, want, what):
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = np.asarray(_get(want, path), np.float64)
        g = np.asarray(g, np.float64)
        scale = max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        assert err <= TOL * scale, f"{what}{jax.tree_util.keystr(path)}: {err} > {TOL * scale}"


def _get(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", getattr(k, "idx", None))]
    return tree


@pytest.fixture(scope="module")
def params():
    p = model.init_params(CFG, jax.random.key(0))
    return jax.device_get(jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p))


def _padded_batch():
    r = np.random.default_rng(0)
    ids = r.integers(1, CFG.vocab_size, (B, TP + TR)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::2, :3] = 0  # left padding
    resp_mask = np.ones((B, TR), np.int32)
    resp_mask[1::3, 3:] = 0  # responses ending early
    mask[:, TP:] = resp_mask
    adv = r.normal(size=(B, 1)).astype(np.float32) * resp_mask
    old = (r.normal(size=(B, TR)) * 0.3 - 4.0).astype(np.float32) * resp_mask
    return actor.TrainBatch(
        input_ids_BS=ids, attention_mask_BS=mask, response_ids_BT=ids[:, TP:],
        response_mask_BT=resp_mask, advantages_BT=adv, old_log_probs_BT=old,
        ref_log_probs_BT=old - 0.1,
    )  # fmt: skip


LOSS = actor.LossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                        calculate_entropy=True, chunk_size=8)  # fmt: skip


# Ulysses composes with the attention implementations, remat and LoRA: the same equality for
# each (the xla kernel is "auto"'s at these lengths on the CPU).
VARIANTS = {
    "xla": CFG,
    "blockwise + remat": dataclasses.replace(CFG, attention_impl="blockwise", remat=True),
    "lora": lora.configure(CFG, rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj"),
}


def _with_adapters(cfg, params_host):
    if not cfg.lora_rank:
        return params_host
    adapters = jax.device_get(lora.init_adapters(cfg, jax.random.key(2)))
    # B starts at zero (PEFT); a non-zero B makes the adapters' path count in the forward.
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x, adapters)
    return lora.attach(params_host, adapters)


def _shardings(cfg, mesh):
    sh = sharding.param_shardings(cfg, mesh)
    if cfg.lora_rank:
        sh = lora.attach(sh, sharding.adapter_shardings(cfg, mesh))
    return sh


def _padded_update(sp, params_host, batch_host, cfg=CFG):
    """One optimizer step (2 micro-batches) and the old log-probs pass, padded rows, on the
    sp mesh; returns (params, metrics, log_probs, entropy, compiled text of the step)."""
    mesh = _mesh(sp)
    tx = actor.make_optimizer(grad_clip=1e9, betas=(0.9, 0.999), weight_decay=0.0)
    params_host = _with_adapters(cfg, params_host)
    p_sh = _shardings(cfg, mesh)
    params = jax.device_put(params_host, p_sh)
    batch = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)),
                         batch_host)  # fmt: skip
    step = jax.jit(functools.partial(
        actor.train_step, model_config=cfg, loss_config=LOSS, tx=tx, mini_batch_size=B,
        micro_batch_size=B // 2))  # fmt: skip
    log_probs = jax.jit(functools.partial(
        actor.compute_log_probs, cfg, micro_batch_size=B, temperature=1.0, chunk_size=8,
        calculate_entropy=True))  # fmt: skip
    with sharding.use_mesh(mesh):
        state = actor.init_state(params, tx)
        text = step.lower(state, batch, jnp.int32(0), jnp.float32(1e-3)).compile().as_text()
        lp, ent = log_probs(params, batch)
        state, metrics = step(state, batch, jnp.int32(0), jnp.float32(1e-3))
    return jax.device_get((state.params, metrics, lp, ent)), text


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("sp", [2, 4])
def test_padded_update_and_log_probs_equal_sp1(params, sp, variant):
    batch, cfg = _padded_batch(), VARIANTS[variant]
    (p1, m1, lp1, ent1), text1 = _padded_update(1, params, batch, cfg)
    (p, m, lp, ent), text = _padded_update(sp, params, batch, cfg)
    # Ulysses really ran: GSPMD turned the token split into a head split and back (FSDP's
    # embedding lookup has all-to-alls of its own, at sp = 1 too).
    assert text.count("all-to-all(") > text1.count("all-to-all(")
    assert float(m1["actor/pg_loss"]) != 0 and float(m1["actor/kl_loss"]) > 0
    _assert_close(m, m1, "metrics")
    _assert_close(p, p1, "params")  # Adam's first step: lr * sign-like of every gradient
    _assert_close({"lp": lp, "ent": ent}, {"lp": lp1, "ent": ent1}, "log-probs")


def _packed(group=4):
    r = np.random.default_rng(3)
    P, T = 7, 9
    p_len = np.repeat(r.integers(2, P + 1, B // group), group)
    r_len = r.integers(1, T + 1, B)
    prompt_ids = np.repeat(r.integers(1, CFG.vocab_size, (B // group, P)), group, 0)
    prompt_mask = (np.arange(P)[None] >= P - p_len[:, None]).astype(np.int32)
    prompt_ids = (prompt_ids * prompt_mask).astype(np.int32)
    resp_ids = r.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    resp_mask = (np.arange(T)[None] < r_len[:, None]).astype(np.int32)
    resp_ids = resp_ids * resp_mask
    batch = actor.TrainBatch(
        input_ids_BS=np.concatenate([prompt_ids, resp_ids], 1),
        attention_mask_BS=np.concatenate([prompt_mask, resp_mask], 1),
        response_ids_BT=resp_ids, response_mask_BT=resp_mask,
        advantages_BT=r.normal(size=(B, 1)).astype(np.float32) * resp_mask,
        old_log_probs_BT=(r.normal(size=(B, T)) * 0.3 - 4.0).astype(np.float32) * resp_mask,
        ref_log_probs_BT=(r.normal(size=(B, T)) * 0.3 - 4.1).astype(np.float32) * resp_mask,
    )  # fmt: skip
    # Rows of 16 tokens: a group's prompt shared by its responses (prefix segments), 2 rows a
    # micro-batch (one per data-parallel device).
    packed = packing.pack(prompt_ids, prompt_mask, resp_ids, resp_mask, max_tokens=32,
                          row_multiple=DP, row_len=16)  # fmt: skip
    return batch, packed


def _packed_pass(sp, params_host, batch_host, packed):
    mesh = _mesh(sp)
    params = jax.device_put(params_host, sharding.param_shardings(CFG, mesh))
    put = functools.partial(jax.device_put)
    batch = jax.tree.map(lambda x: put(x, sharding.batch_sharding(mesh, x.ndim)), batch_host)
    grads_fn = jax.jit(functools.partial(actor.packed_micro_grads, model_config=CFG,
                                         loss_config=LOSS))  # fmt: skip
    lp_fn = jax.jit(functools.partial(actor.packed_log_probs_into, CFG, temperature=1.0,
                                      chunk_size=8, calculate_entropy=True))  # fmt: skip
    T = batch_host.response_mask_BT.shape[1]
    with sharding.use_mesh(mesh):
        grads = jax.tree.map(jnp.zeros_like, params)
        lp, ent = jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T), jnp.float32)
        metrics = []
        for m in range(packed.num_micro):
            micro = actor.PackedMicro(**{
                k: put(v, sharding.batch_sharding(mesh, np.ndim(v))) if np.ndim(v) else v
                for k, v in packed.micro(m).items()})  # fmt: skip
            grads, mets = grads_fn(params, grads, micro, batch)
            lp, ent = lp_fn(params, micro, lp, ent)
            metrics.append(mets)
    return jax.device_get((grads, metrics, lp, ent))


@pytest.mark.parametrize("sp", [2, 4])
def test_packed_update_and_log_probs_equal_sp1(params, sp):
    batch, packed = _packed()
    assert packed.num_micro > 1 and (packed.micro(0)["prefixes_RL"] > 0).any()
    g1, m1, lp1, ent1 = _packed_pass(1, params, batch, packed)
    g, m, lp, ent = _packed_pass(sp, params, batch, packed)
    assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g1)) > 0
    _assert_close(g, g1, "grads")
    _assert_close(m, m1, "metrics")
    _assert_close({"lp": lp, "ent": ent}, {"lp": lp1, "ent": ent1}, "log-probs")
    assert np.count_nonzero(lp1) == int(batch.response_mask_BT.sum())


def test_activations_are_split_by_token_and_attention_by_head(params):
    """Not a no-op: inside the sp = 4 forward, the hidden states hold a quarter of each row's
    tokens per device, and the attention's queries a quarter of the heads over whole rows."""
    mesh = _mesh(4)
    seen = {}
    real = transformer.ulysses_in
    jax.clear_caches()  # model.hidden_states is a jit: trace it again, through the spy

    def spy(config, q, k, v):
        q2, k2, v2 = real(config, q, k, v)
        jax.debug.inspect_array_sharding(q, callback=lambda s: seen.setdefault("in", s))
        jax.debug.inspect_array_sharding(q2, callback=lambda s: seen.setdefault("heads", s))
        return q2, k2, v2

    batch = _padded_batch()
    p = jax.device_put(params, sharding.param_shardings(CFG, mesh))
    ids, mask = (jax.device_put(x, sharding.batch_sharding(mesh, 2))
                 for x in (batch.input_ids_BS, batch.attention_mask_BS))  # fmt: skip
    with pytest.MonkeyPatch.context() as mp, sharding.use_mesh(mesh):
        mp.setattr(transformer, "ulysses_in", spy)
        jax.jit(functools.partial(model.forward, CFG))(p, ids, mask).block_until_ready()
    shape = (B, TP + TR, CFG.num_heads, CFG.head_dim)
    assert seen["in"].shard_shape(shape) == (B // DP, (TP + TR) // 4, CFG.num_heads, CFG.head_dim)
    assert seen["heads"].shard_shape(shape) == (B // DP, TP + TR, CFG.num_heads // 4, CFG.head_dim)


# --- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [256, 1], ids=["grouped", "paged"])
def test_the_native_sampler_splits_rows_over_the_sequence_devices_too(params, max_num_seqs):
    """Decoding is row by row: with sp 4 the sampler's rows go over data x fsdp x sequence (8
    shards, each its own pool and slots), not 2 shards decoded 4 times over; the rollout is
    sp 1's, back on the batch's sharding."""
    r = np.random.default_rng(5)
    ids = r.integers(4, CFG.vocab_size, (8, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::3, :2] = 0
    sp_args = engines.SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    seen = []
    real = paged.sample_paged

    def spy(*args, **kwargs):
        seen.append(paged.shard_layout(args[2])[2])
        return real(*args, **kwargs)

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged, "sample_paged", spy)
        for sp in (1, 4):
            mesh = _mesh(sp)
            engine = engines.NativeEngine(CFG, mesh, eos_ids=(3,), pad_id=0,
                                          max_num_seqs=max_num_seqs)  # fmt: skip
            p = jax.device_put(params, sharding.param_shardings(CFG, mesh))
            out[sp] = engine.sample(p, ids, mask, jax.random.key(1), sp_args)
            assert out[sp].response_ids.sharding.spec == sharding.batch_sharding(mesh, 2).spec
    for field in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(getattr(out[4], field), getattr(out[1], field))
    np.testing.assert_allclose(out[4].log_probs, out[1].log_probs, rtol=0, atol=TOL)
    if max_num_seqs == 1:  # 16 rows: 8 a shard on 2 shards, 2 a shard on 8, one slot each
        assert seen == [DP, DP * 4]


# --- a whole loop step --------------------------------------------------------------------------


def _reward(solution_str, ground_truth):
    """Differs between a group's samples (the random model never gets a sum right), so the
    advantages and the policy gradient are not zero."""
    return float(sum(map(ord, solution_str)) % 5) / 4.0


def _loop_step(tmp_path, sp):
    """One GRPO step of the tiny random model through loop.train (packed rows, KL loss,
    entropy), on a mesh of DP x sp devices; returns the step's metrics and the final params.
    The per-device token budget is 128 / sp, so every sp packs the same micro-batches (verl's
    budgets are per device: a group of sp devices packs sp times one's)."""
    tok = loading.tokenizer(config.ModelSpec(source="random", tokenizer="char", path=None))
    mesh = _mesh(sp)
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=8, max_prompt_length=24, max_response_length=8,
                               val_batch_size=8),
        actor=config.ActorConfig(ppo_mini_batch_size=8, use_dynamic_bsz=True,
                                 ppo_max_token_len_per_gpu=128 // sp, use_kl_loss=True,
                                 calculate_entropy=True, ulysses_sequence_parallel_size=sp),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=4),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=1, progress_bar=False,
                                     tensorboard=False, test_freq=-1,
                                     default_local_dir=str(tmp_path / f"sp{sp}")),
        checkpoint=config.CheckpointConfig(save_last=False, export_hf=False),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    train_rows, _ = demo_task.arithmetic_rows(16, 1, max_operand=9, seed=0)
    with sharding.use_mesh(mesh):
        model_config, p0 = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                         max_positions=64)  # fmt: skip
        result = loop.train(run, model_config=model_config, params=p0, tokenizer=tok,
                            train_data=train_rows, reward_fn=_reward, mesh=mesh)  # fmt: skip
    return result.history[-1], jax.device_get(result.state.params)


def test_a_loop_step_with_sp_4_equals_sp_1(tmp_path):
    # sp=4 over the tiny model's 2 key/value heads: each head is held by 2 sequence devices. The
    # update-level tests above run sp=2 as well, with every attention implementation.
    m1, p1 = _loop_step(tmp_path, 1)
    assert m1["actor/kl_loss"] >= 0 and m1["perf/total_num_tokens"] > 0
    m, p = _loop_step(tmp_path, 4)
    keys = [k for k in m1 if k.startswith(("actor/", "critic/", "response_length/"))
            and "perf/" not in k and not k.startswith("actor/lr")]  # fmt: skip
    assert "actor/pg_loss" in keys and m1["actor/grad_norm"] > 1e-3
    _assert_close({k: m[k] for k in keys}, {k: m1[k] for k in keys}, "sp=4 metrics")
    _assert_close(p, p1, "sp=4 params")


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"actor": {"ulysses_sequence_parallel_size": 2},
          "ref": {"ulysses_sequence_parallel_size": 4}},
         r"ref.ulysses_sequence_parallel_size=4 must equal actor.ulysses_sequence_parallel_size=2"),
        ({"actor": {"ulysses_sequence_parallel_size": 4}, "data": {"max_response_length": 6}},
         r"data.max_response_length=6 must be a multiple of actor.ulysses_sequence_parallel_size"),
        ({"actor": {"ulysses_sequence_parallel_size": 2}, "mesh": {"shape": (1, -1, 4, 1)}},
         r"mesh.shape=\(1, -1, 4, 1\) its sequence entry"),
        ({"actor": {"ulysses_sequence_parallel_size": 0}},
         r"actor.ulysses_sequence_parallel_size=0 must be >= 1"),
    ],
)  # fmt: skip
def test_bad_sequence_parallel_configs_name_the_field(kw, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(config.RunConfig, kw)


def test_heads_rows_and_devices_that_do_not_split_fail_before_any_work():
    run = config.RunConfig(actor=config.ActorConfig(ulysses_sequence_parallel_size=8))
    with pytest.raises(config.ConfigError, match=r"4 attention heads cannot be split over 8 x 1 "
                       r"\(tensor\) devices; 4 would work"):  # fmt: skip
        run.check_sequence_parallel(num_heads=4, tensor=1, row_len=128)
    with pytest.raises(config.ConfigError, match="does not divide the packed row length 384"):
        config.RunConfig(
            actor=config.ActorConfig(ulysses_sequence_parallel_size=5, use_dynamic_bsz=True)
        ).check_sequence_parallel(num_heads=5, tensor=1, row_len=384)
    run = config.RunConfig(
        actor=config.ActorConfig(ulysses_sequence_parallel_size=3, use_dynamic_bsz=True)
    )
    with pytest.raises(config.ConfigError, match=r"ulysses_sequence_parallel_size=3 with "
                       r"mesh.shape=\(-1, 1, 1\) does not fit the 8 devices.*e.g. 2"):  # fmt: skip
        setup_lib.train_mesh(run)
    # A mesh handed to loop.train must carry the run's sequence axis.
    with pytest.raises(config.ConfigError, match="has a sequence axis of 1"):
        loop.train(config.RunConfig(actor=config.ActorConfig(ulysses_sequence_parallel_size=2,
                                                             ppo_mini_batch_size=8),
                                    data=config.DataConfig(train_batch_size=8)),
                   model_config=CFG, params={}, tokenizer=None, train_data=[],
                   reward_fn=_reward, mesh=sharding.make_mesh())  # fmt: skip


def test_three_entry_mesh_shapes_take_the_sequence_axis_from_the_fill():
    assert dict(sharding.make_mesh((1, -1, 1), sequence=4).shape) == {
        "data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}  # fmt: skip
    assert dict(sharding.make_mesh((1, -1, 2, 2)).shape)["fsdp"] == 2
    assert dict(sharding.make_mesh().shape)["sequence"] == 1
    # Parameters are split over the sequence devices too (verl's FSDP shards over all ranks).
    sh = sharding.param_shardings(CFG, sharding.make_mesh((1, 2, 4, 1)))
    assert sh["embed"]["embedding"].spec == jax.sharding.PartitionSpec(
        "tensor", ("fsdp", "sequence"))
