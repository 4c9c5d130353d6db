"""Tests for grpo_jax.sharding on 8 fake CPU devices (see conftest.py).

Unit tests use synthetic logical trees; the parity tests further down run the real model, loss,
sampler and orbax on meshes (2,2,2), (1,8,1), (8,1,1) against one device.
"""

import math

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from grpo_jax import distributed, sharding

MESH_SHAPES = [(2, 2, 2), (1, 8, 1), (8, 1, 1)]
E = ("fsdp", "sequence")  # the mesh axes of a parameter's `embed` dimension (FSDP)


def test_make_mesh_fills_minus_one_and_uses_auto_axes():
    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "sequence": 1, "tensor": 1}
    assert mesh.axis_names == sharding.AXES
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(sharding.make_mesh((2, -1, 2)).shape) == {
        "data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}  # fmt: skip
    one = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    assert one.devices.size == 1


@pytest.mark.parametrize(
    "shape, match",
    [
        ((3, -1, 1), "not divisible"),
        ((-1, -1, 1), "at most one -1"),
        ((2, 2), "must have 3 entries"),
        ((1, 1, 1), "needs 1 devices, have 8"),
        ((0, 8, 1), ">= 1"),
    ],
)
def test_make_mesh_rejects_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(shape)


def test_logical_to_mesh_spec_follows_rules():
    assert sharding.logical_to_mesh_spec(P("embed", "mlp")) == P(E, "tensor")
    assert sharding.logical_to_mesh_spec(P("vocab", "embed")) == P("tensor", E)
    assert sharding.logical_to_mesh_spec(P("embed", "kv_heads", "head_dim")) == P(
        E, "tensor", None
    )
    batch_spec = P(("data", "fsdp"), "sequence", None)
    assert sharding.logical_to_mesh_spec(P("batch", "seq", None)) == batch_spec
    assert sharding.logical_to_mesh_spec(P()) == P()


def test_unknown_logical_name_and_reused_mesh_axis_raise():
    with pytest.raises(ValueError, match="'experts'.*has no rule"):
        sharding.logical_to_mesh_spec(P("experts", "embed"))
    # batch -> (data, fsdp) and embed -> fsdp cannot shard two dims of one array over fsdp.
    with pytest.raises(ValueError, match="mesh axis 'fsdp' would shard two dimensions"):
        sharding.logical_to_mesh_spec(P("batch", "embed"))


def test_rules_override_from_config_lists():
    # ConfigDict hands rules back as lists; an override replaces the whole table.
    rules = sharding.validate_rules([["embed", None], ["mlp", ["fsdp", "tensor"]]])
    assert rules == (("embed", None), ("mlp", ("fsdp", "tensor")))
    assert sharding.logical_to_mesh_spec(P("embed", "mlp"), rules) == P(None, ("fsdp", "tensor"))
    with pytest.raises(ValueError, match="'model' is not one of"):
        sharding.validate_rules([("embed", "model")])
    with pytest.raises(ValueError, match="more than one rule"):
        sharding.validate_rules([("embed", "fsdp"), ("embed", None)])


def _synthetic_params():
    # D=8, F=16, N=4, H=2, V=12: every split below divides on a (2,2,2) mesh.
    shapes = {
        "embed_VD": ((12, 8), P("vocab", "embed")),
        "layer": {
            "q_DNH": ((8, 4, 2), P("embed", "heads", "head_dim")),
            "up_DF": ((8, 16), P("embed", "mlp")),
            "down_FD": ((16, 8), P("mlp", "embed")),
            "norm_D": ((8,), P(None)),
        },
    }
    is_pair = lambda x: isinstance(x, tuple) and isinstance(x[1], P)
    params = jax.tree.map(
        lambda sp: jnp.arange(np.prod(sp[0]), dtype=jnp.float32).reshape(sp[0]),
        shapes,
        is_leaf=is_pair,
    )
    logical = jax.tree.map(lambda sp: sp[1], shapes, is_leaf=is_pair)
    return params, logical


def test_params_really_are_sharded_shard_by_shard():
    mesh = sharding.make_mesh((2, 2, 2))
    params, logical = _synthetic_params()
    shardings = sharding.logical_to_mesh_sharding(logical, mesh, shapes=params)
    placed = jax.device_put(params, shardings)
    up = placed["layer"]["up_DF"]
    assert up.sharding.spec == P(E, "tensor")
    # up_DF (8,16) split 2 ways on dim 0 (fsdp) and 2 ways on dim 1 (tensor): 8 shards of (4,8),
    # each pair of devices differing only in "data" holding the same block.
    assert len(up.addressable_shards) == 8
    assert {s.data.shape for s in up.addressable_shards} == {(4, 8)}
    assert len({(s.index[0].start, s.index[1].start) for s in up.addressable_shards}) == 4
    for shard in up.addressable_shards:
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(params["layer"]["up_DF"])[shard.index]
        )
    # Replicated norm: every device holds all 8 values.
    assert {s.data.shape for s in placed["layer"]["norm_D"].addressable_shards} == {(8,)}
    assert placed["embed_VD"].addressable_shards[0].data.shape == (6, 4)


def test_indivisible_split_raises_clear_error():
    mesh = sharding.make_mesh((2, 2, 2))
    with pytest.raises(ValueError, match=r"\['w'\]: dimension 1 of size 3 cannot be split 2 ways"):
        sharding.logical_to_mesh_sharding(
            {"w": P("embed", "mlp")}, mesh, shapes={"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
        )


def test_batch_sharding_and_replicated():
    mesh = sharding.make_mesh((2, 2, 2))
    x = jax.device_put(jnp.arange(40.0).reshape(8, 5), sharding.batch_sharding(mesh, 2))
    assert x.sharding.spec == P(("data", "fsdp"), None)
    # 8 rows over data*fsdp = 4 groups: 2 rows per device, replicated over the 2 tensor devices.
    assert {s.data.shape for s in x.addressable_shards} == {(2, 5)}
    assert len({s.index[0].start for s in x.addressable_shards}) == 4
    r = jax.device_put(jnp.float32(3.0), sharding.replicated(mesh))
    assert r.sharding.spec == P() and len(r.addressable_shards) == 8
    with pytest.raises(ValueError, match="leading batch axis"):
        sharding.batch_sharding(mesh, 0)


def test_opt_state_mirrors_params_through_chains_and_masks():
    mesh = sharding.make_mesh((2, 2, 2))
    params, logical = _synthetic_params()
    abstract = jax.eval_shape(lambda: params)
    p_sh = sharding.logical_to_mesh_sharding(logical, mesh, shapes=abstract)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.masked(optax.add_decayed_weights(0.1), {"embed_VD": True, "layer": False}),
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    )
    o_sh = sharding.tx_state_shardings(tx, abstract, p_sh, mesh)
    adam = o_sh[2].inner_state[0]
    assert adam.mu["layer"]["up_DF"].spec == P(E, "tensor")
    assert adam.nu["embed_VD"].spec == P("tensor", E)
    assert adam.count.spec == P()
    assert o_sh[2].hyperparams["learning_rate"].spec == P()
    # The sharded state is usable: tx.init under jit with these out_shardings and one update.
    placed = jax.device_put(params, p_sh)
    state = jax.jit(tx.init, out_shardings=o_sh)(placed)
    assert state[2].inner_state[0].mu["layer"]["q_DNH"].sharding.spec == P(E, "tensor", None)
    grads = jax.tree.map(jnp.ones_like, placed)
    updates, _ = jax.jit(tx.update)(grads, state, placed)
    ref_updates, _ = tx.update(grads, tx.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, ref_updates)


def test_opt_state_leaf_matching_no_param_raises():
    mesh = sharding.make_mesh((2, 2, 2))
    params, logical = _synthetic_params()
    abstract = jax.eval_shape(lambda: params)
    p_sh = sharding.logical_to_mesh_sharding(logical, mesh, shapes=abstract)
    bogus_state = {"ema": {"embed_VD": jax.ShapeDtypeStruct((3, 3), jnp.float32)}}
    with pytest.raises(ValueError, match="matches no parameter"):
        sharding.opt_state_shardings(bogus_state, abstract, p_sh, mesh)


def test_auto_mesh_matmul_under_set_mesh_equals_unsharded():
    # jax>=0.10 defaults to explicit axes; our Auto mesh must let FSDP weights meet batch-sharded
    # activations without per-op out_sharding, inside jax.set_mesh as train.py uses it.
    mesh = sharding.make_mesh((2, 2, 2))
    x_BD = jnp.arange(64.0).reshape(8, 8) / 64
    w_DF = jnp.arange(128.0).reshape(8, 16) / 128
    expected = np.asarray(x_BD) @ np.asarray(w_DF)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x_BD, sharding.batch_sharding(mesh, 2))
        ws = jax.device_put(w_DF, sharding.logical_to_mesh_sharding(P("embed", "mlp"), mesh))
        out = jax.jit(lambda a, b: jnp.tanh(a @ b))(xs, ws)
    # A sum of 8 products of values <= 1 in another order: a few ulps at the scale of tanh (1).
    numerics.assert_close(out, np.tanh(expected), ulps=16, scale=1.0)


# ----------------------------------------------------------------------------------------------
# grpo_jax.distributed
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),  # one srun task: one process
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "slurm"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
        ({"TPU_WORKER_HOSTNAMES": "w-0"}, None),
        ({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}, "tpu-pod"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "jax-env"),
    ],
)
def test_multiprocess_env_detection(env, expected):
    assert distributed.multiprocess_env(env) == expected


def test_maybe_initialize_calls_jax_only_when_needed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    assert distributed.maybe_initialize() is False and calls == []
    assert distributed.maybe_initialize(mode="on") is True and calls == [{}]
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert distributed.maybe_initialize() is True and calls[-1] == {}
    assert distributed.maybe_initialize(mode="off") is False and len(calls) == 2
    flags = {"coordinator_address": "h:1", "num_processes": 4, "process_id": 3}
    assert distributed.maybe_initialize(**flags) is True and calls[-1] == flags
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert distributed.maybe_initialize() is True
    assert calls[-1] == {"coordinator_address": "10.0.0.1:99", "num_processes": 2, "process_id": 1}
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert distributed.maybe_initialize() is True and calls[-1] == {}  # JAX reads the address
    with pytest.raises(ValueError, match="given together"):
        distributed.maybe_initialize(coordinator_address="h:1")
    with pytest.raises(ValueError, match=r"not in \[0, 4\)"):
        distributed.maybe_initialize(coordinator_address="h:1", num_processes=4, process_id=4)
    with pytest.raises(ValueError, match="must be one of"):
        distributed.maybe_initialize(mode="yes")


def test_process_shard_equal_sizes_and_disjoint():
    items = list(range(10))
    shards = [distributed.process_shard(items, process_index=i, process_count=3) for i in range(3)]
    # 10 rows over 3 processes: 9 usable, every process gets 3, row 9 is dropped.
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert distributed.process_shard(items) == items  # one process here
    assert distributed.local_batch_size(12, process_count=4) == 3
    with pytest.raises(ValueError, match="not divisible by 5"):
        distributed.local_batch_size(12, process_count=5)


_TWO_PROCESS_SCRIPT = """
import sys
pid, port, ckpt = int(sys.argv[2]), sys.argv[3], sys.argv[4]
import workers
from grpo_jax import distributed, sharding
import jax, jax.numpy as jnp, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
mesh = sharding.make_mesh((-1, 1, 1))
rows = distributed.process_shard(list(range(9)))
local = np.asarray(rows[: distributed.local_batch_size(8)], np.float32)
x = distributed.to_global(local, sharding.batch_sharding(mesh, 1))
total = jax.jit(lambda a: jnp.sum(a * jnp.arange(8.0)), out_shardings=sharding.replicated(mesh))(x)
# Multi-host orbax: save a (data)-sharded array, restore it fsdp x tensor sharded.
w = jax.device_put(jnp.arange(16.0).reshape(4, 4), sharding.logical_to_mesh_sharding(
    P("batch", None), mesh))
ckptr = ocp.StandardCheckpointer()
ckptr.save(ckpt, {"w": w})
ckptr.wait_until_finished()
mesh2 = sharding.make_mesh((1, 2, 2))
target = jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=sharding.logical_to_mesh_sharding(
    P("embed", "mlp"), mesh2))
w2 = ckptr.restore(ckpt, {"w": target})["w"]
ok = bool(jax.jit(lambda a: jnp.all(a == jnp.arange(16.0).reshape(4, 4)),
                  out_shardings=sharding.replicated(mesh2))(w2))
workers.answer([pid, jax.process_count(), len(jax.devices()), distributed.is_main_process(),
                rows, float(total), str(w2.sharding.spec), ok])
"""


def test_two_processes_share_one_mesh(tmp_path):
    """Two real JAX processes (2 CPU devices each) on one 4-device mesh, with orbax."""
    import workers

    results = workers.run(_TWO_PROCESS_SCRIPT, tmp_path / "workers", args=(tmp_path / "ckpt",),
                          timeout=180)  # fmt: skip
    # Process p's local rows become global rows [4p, 4p+4): x = [0,2,4,6,1,3,5,7], so
    # sum(x * arange(8)) = 0+2+8+18+4+15+30+49 = 126.
    spec = "P(('fsdp', 'sequence'), 'tensor')"
    assert results[0] == [0, 2, 4, True, [0, 2, 4, 6], 126.0, spec, True]
    assert results[1] == [1, 2, 4, False, [1, 3, 5, 7], 126.0, spec, True]


# ----------------------------------------------------------------------------------------------
# Parity on real meshes: the tiny model, the actor loss, AdamW, the sampler and orbax.
# ----------------------------------------------------------------------------------------------

TP, TR = 4, 4  # prompt and response tokens of the synthetic GRPO batch


def _tiny():
    from grpo_jax import model

    return model.ModelConfig.tiny()


def _single_mesh():
    return sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _grpo_batch(config, batch_size=8):
    """A trainer.TrainBatch of B=8 rows: left-padded prompts, responses ending early."""
    from grpo_jax.trainer import actor

    rng = np.random.default_rng(0)
    ids_BS = rng.integers(1, config.vocab_size, (batch_size, TP + TR)).astype(np.int32)
    mask_BS = np.ones_like(ids_BS)
    mask_BS[::2, :2] = 0  # even rows: 2 left-pad tokens
    resp_mask_BT = np.ones((batch_size, TR), np.int32)
    resp_mask_BT[1::3, 2:] = 0  # some rows stop after 2 response tokens
    mask_BS[:, TP:] = resp_mask_BT
    adv_B1 = rng.normal(size=(batch_size, 1)).astype(np.float32)
    return actor.TrainBatch(
        input_ids_BS=ids_BS,
        attention_mask_BS=mask_BS,
        response_ids_BT=ids_BS[:, TP:],
        response_mask_BT=resp_mask_BT,
        advantages_BT=adv_B1 * resp_mask_BT,
        # Old log-probs away from the current policy (about -log V = -4.85) so that clipping is
        # active on some tokens; reference log-probs make the KL term non-zero.
        old_log_probs_BT=(rng.normal(size=(batch_size, TR)) - 4.8).astype(np.float32),
        ref_log_probs_BT=(rng.normal(size=(batch_size, TR)) - 4.8).astype(np.float32),
    )


def _run_step(mesh, config, params_host, batch_host):
    """trainer.train_step on `mesh`: 2 micro-batches of 4, clip + KL + entropy, AdamW."""
    import functools

    from grpo_jax import model
    from grpo_jax.trainer import actor as actor_lib

    # A clip threshold that never fires, so Adam's first moment is exactly (1 - b1) * grads.
    tx = actor_lib.make_optimizer(grad_clip=1e9, betas=(0.9, 0.999), weight_decay=0.01)
    loss_config = actor_lib.LossConfig(
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, chunk_size=8
    )
    p_sh = sharding.param_shardings(config, mesh)
    o_sh = sharding.tx_state_shardings(tx, model.abstract_params(config), p_sh, mesh)
    state_sh = actor_lib.TrainState(sharding.replicated(mesh), p_sh, o_sh)
    params = jax.device_put(params_host, p_sh)
    batch = jax.tree.map(
        lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch_host
    )
    state = jax.jit(functools.partial(actor_lib.init_state, tx=tx), out_shardings=state_sh)(params)
    step = jax.jit(
        functools.partial(
            actor_lib.train_step,
            model_config=config,
            loss_config=loss_config,
            tx=tx,
            mini_batch_size=8,
            micro_batch_size=4,
        ),
        out_shardings=(state_sh, sharding.replicated(mesh)),
    )
    with jax.set_mesh(mesh):
        return step(state, batch, jnp.int32(0), jnp.float32(1e-3))


@pytest.fixture(scope="module")
def single_device_step():
    from grpo_jax import model

    config = _tiny()
    params = jax.device_get(model.init_params(config, jax.random.key(0)))
    batch = _grpo_batch(config)
    return config, params, batch, jax.device_get(_run_step(_single_mesh(), config, params, batch))


# A sharded step sums its gradients over devices in another order (tests/numerics.py): measured
# up to ~100 ulps of each tensor's scale; a row counted twice or missed moves them by >1e4.
STEP_ULPS = 1024


@pytest.mark.parametrize("shape", MESH_SHAPES)
def test_train_step_on_mesh_equals_single_device(shape, single_device_step):
    config, params, batch, (state1, metrics1) = single_device_step
    mesh = sharding.make_mesh(shape)
    state_m, metrics_m = _run_step(mesh, config, params, batch)
    # The batch is not trivial: the update happened, clipping is active, every term is non-zero.
    assert float(metrics1["actor/update_skipped"]) == 0.0
    assert 0.0 < float(metrics1["actor/pg_clipfrac"]) < 1.0
    assert float(metrics1["actor/kl_loss"]) > 0 and float(metrics1["actor/entropy"]) > 0
    assert set(metrics_m) == set(metrics1)
    for k in metrics1:  # actor/loss, actor/pg_loss, actor/grad_norm, ...
        # Sums of O(1) terms (advantages x ratios, entropies, KL): rounding at a scale of >= 1.
        want = float(metrics1[k])
        numerics.assert_close(metrics_m[k], want, ulps=STEP_ULPS, scale=max(abs(want), 1.0),
                              err_msg=k)  # fmt: skip
    # Gradients: after one step Adam's mu is (1 - b1) * grads (clip off), nu is (1 - b2) * grads^2.
    adam1, adam_m = state1.opt_state[1], state_m.opt_state[1]
    for path, g in jax.tree_util.tree_leaves_with_path(adam1.mu):
        assert np.max(np.abs(g)) > 0, jax.tree_util.keystr(path)  # every param gets a gradient
    numerics.assert_trees_close(adam_m.mu, adam1.mu, ulps=STEP_ULPS, err_msg="grads")
    numerics.assert_trees_close(adam_m.nu, adam1.nu, ulps=2 * STEP_ULPS, err_msg="grads^2")
    # Params after Adam's first step move by ~lr sign(g) (lr 1e-3); where a gradient is exactly
    # zero on one path (the key bias: softmax is shift-invariant) Adam turns rounding noise into a
    # step of up to lr, so params are compared at the scale of the largest parameter (floor 1).
    numerics.assert_trees_close(state_m.params, state1.params, ulps=STEP_ULPS, floor=1.0,
                                err_msg="params")  # fmt: skip
    # The updated params and Adam moments came back sharded as declared, not gathered.
    want = sharding.param_shardings(config, mesh)
    for path, p in jax.tree_util.tree_leaves_with_path(state_m.params):
        assert p.sharding.spec == _get(want, path).spec, jax.tree_util.keystr(path)
        assert _get(adam_m.mu, path).sharding.spec == _get(want, path).spec


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)])
def test_params_are_really_sharded(shape):
    """No silent no-op: every tensor-parallel / FSDP dim is split in the device-local shards."""
    from grpo_jax import model

    config = _tiny()
    mesh = sharding.make_mesh(shape)
    params = sharding.init_sharded_params(config, mesh, jax.random.key(0))
    logical = model.logical_axes(config)
    num_split = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        spec = _get(logical, path)
        mesh_spec = sharding.logical_to_mesh_spec(spec)
        assert x.sharding.spec == mesh_spec, jax.tree_util.keystr(path)
        local = tuple(
            n // math.prod(mesh.shape[a] for a in ((a,) if isinstance(a, str) else a or ()))
            for n, a in zip(x.shape, tuple(mesh_spec) + (None,) * x.ndim)
        )
        assert {s.data.shape for s in x.addressable_shards} == {local}
        num_split += local != x.shape
    assert num_split >= 7  # embed, q/k/v/o, gate/up/down at least
    # Sharded init equals the plain init.
    ref = model.init_params(config, jax.random.key(0))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, ref
    )


def test_param_shardings_of_tiny_model_follow_logical_axes():
    config = _tiny()
    sh = sharding.param_shardings(config, sharding.make_mesh((2, 2, 2)))
    assert sh["embed"]["embedding"].spec == P("tensor", E)  # (vocab, embed)
    attn = sh["layers"]["attn"]
    assert attn["q_proj"]["kernel"].spec == P(None, E, "tensor", None)
    assert attn["o_proj"]["kernel"].spec == P(None, "tensor", None, E)
    assert sh["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", E)
    # K=2 kv heads cannot be split 4 ways: a clear error, not silent replication.
    with pytest.raises(ValueError, match="k_proj.*cannot be split 4 ways"):
        sharding.param_shardings(config, sharding.make_mesh((2, 1, 4)))


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1)])
def test_greedy_sampling_on_mesh_equals_single_device(shape):
    from grpo_jax import model, sampler

    config = _tiny()
    params = jax.device_get(model.init_params(config, jax.random.key(1)))
    rng = np.random.default_rng(1)
    ids_PT = rng.integers(1, config.vocab_size, (8, 6)).astype(np.int32)
    mask_PT = np.ones_like(ids_PT)
    mask_PT[1::2, :3] = 0
    kwargs = {"n": 2, "max_new_tokens": 6, "temperature": 0.0, "eos_token_ids": (5,)}

    def run(mesh):
        p = jax.device_put(params, sharding.param_shardings(config, mesh))
        ids, mask = jax.device_put((ids_PT, mask_PT), sharding.batch_sharding(mesh, 2))
        with jax.set_mesh(mesh):
            return sampler.sample(config, p, ids, mask, jax.random.key(0), **kwargs)

    ref, out = run(_single_mesh()), run(sharding.make_mesh(shape))
    np.testing.assert_array_equal(out.response_ids, ref.response_ids)
    np.testing.assert_array_equal(out.response_mask, ref.response_mask)
    numerics.assert_close(out.log_probs, ref.log_probs, ulps=STEP_ULPS, err_msg="log_probs")
    # Greedy decoding over a random model is not degenerate: several distinct tokens appear.
    assert len(np.unique(np.asarray(ref.response_ids))) > 3


def test_checkpoint_saved_on_one_mesh_restores_onto_another(tmp_path):
    import orbax.checkpoint as ocp

    from grpo_jax import model

    config = _tiny()
    tx = optax.adamw(1e-3)
    abstract = model.abstract_params(config)
    mesh_a, mesh_b = sharding.make_mesh((2, 2, 2)), sharding.make_mesh((1, 8, 1))
    p_a = sharding.init_sharded_params(config, mesh_a, jax.random.key(0))
    o_a = jax.jit(
        tx.init,
        out_shardings=sharding.tx_state_shardings(
            tx, abstract, p_a_sh := jax.tree.map(lambda x: x.sharding, p_a), mesh_a
        ),
    )(p_a)
    # One real (jitted) update so the optimizer state is not all zeros.
    o_a = jax.jit(lambda p, o: tx.update(jax.tree.map(lambda x: 0.5 * x + 0.1, p), o, p)[1])(
        p_a, o_a
    )
    state_a = {"params": p_a, "opt_state": o_a}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", state_a)
    ckptr.wait_until_finished()

    p_b_sh = sharding.param_shardings(config, mesh_b)
    target = {
        "params": sharding.abstract_with_shardings(abstract, p_b_sh),
        "opt_state": sharding.abstract_with_shardings(
            jax.eval_shape(tx.init, abstract),
            sharding.tx_state_shardings(tx, abstract, p_b_sh, mesh_b),
        ),
    }
    state_b = ckptr.restore(tmp_path / "ckpt", target)
    assert p_a_sh["embed"]["embedding"].spec == P("tensor", E)
    emb_b = state_b["params"]["embed"]["embedding"]
    assert emb_b.sharding.mesh.shape == mesh_b.shape and emb_b.sharding.spec == P("tensor", E)
    # (V=128, D=32) on (1,8,1): tensor=1, fsdp=8 -> each device holds (128, 4).
    assert {s.data.shape for s in emb_b.addressable_shards} == {(128, 4)}
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state_a, state_b
    )
    assert float(np.abs(np.asarray(state_b["opt_state"][0].mu["final_norm"]["scale"])).max()) > 0


def test_model_activations_are_batch_sharded_under_fsdp():
    from grpo_jax import model

    config = _tiny()
    mesh = sharding.make_mesh((1, 8, 1))
    abstract = sharding.abstract_with_shardings(
        model.abstract_params(config), sharding.param_shardings(config, mesh)
    )
    # T=24 is used by no other test: model.forward's jit cache does not key on flax's rules
    # context, so a trace of the same shapes made earlier without use_mesh would be reused.
    ids = jax.ShapeDtypeStruct((8, 24), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
    with sharding.use_mesh(mesh):
        hlo = jax.jit(model.forward, static_argnums=0).lower(config, abstract, ids, ids)
        hlo = hlo.compile().as_text()
    # The MLP hidden state of B=8 rows over 8 devices: [1,24,F=64] per device, never [8,24,64]
    # (without the rules XLA keeps the FSDP weight layout and every device computes all 8 rows).
    assert "f32[1,24,64]" in hlo
    assert "f32[8,24,64]" not in hlo
