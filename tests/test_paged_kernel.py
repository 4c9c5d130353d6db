"""The Pallas TPU paged-attention kernel (`grpo_jax.models.paged_kernel`), run in Pallas TPU
interpret mode on the CPU, against the XLA attention of `paged.paged_forward`.

Tolerances. The kernel reads keys and values as bfloat16 (its page loads convert to bfloat16)
and computes the scores, the softmax and the value sum in float32; interpret mode computes
those as float32 too (against a float32 reference over the bfloat16-rounded pages its outputs
agree to 1e-7). So over a pool whose entries are bfloat16 values the two paths compute the same
sums in another order: float32 rounding, atol 1e-5 on unit-scale outputs. Over a float32 pool
the kernel equals the XLA path over that pool rounded to bfloat16 (the same float32 bound);
against the unrounded pool the difference is bfloat16 rounding of K and V, bounded here by
4 bfloat16 ulps of the outputs' scale (atol = 4 * 2**-8 * scale, as the cuDNN test).

And that the kernel path compiles for a real TPU chip: libtpu's compiler, ahead of time, on no
TPU (reference "tpu", scripts/build_tpu_venv.sh).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import whole_context

from grpo_jax import model
from grpo_jax.models import decode, paged, paged_kernel
from grpo_jax.rollout import paged as paged_rollout

P = 4  # page size
# Rows: (shared prompt length, the group's pages, own slots incl. the fed token, own pages).
# Rows 0-1 share a partly filled prompt page (5 slots of 8) and part at own page counts; row 2's
# prompt ends on a page boundary and its own slots fill one page exactly; row 3 has one slot in
# all (a one-token prompt); row 4 is idle (no slot).
_ROWS = [(5, [1, 2], 3, [3, 4]), (5, [1, 2], 6, [5, 6]), (8, [7, 8], 4, [9, 10]),
         (0, [], 1, [11, 12]), (0, [], 0, [13, 14])]  # fmt: skip
M = 4  # pages a table


def _decode_step(config, seed):
    """A decode step of the `_ROWS` over random pools: (token ids, positions, write page and
    column, page tables, spans), each [B] or [B, M]."""
    tables, shared, start, own, pos, wpage, wcol = [], [], [], [], [], [], []
    for plen, gpages, olen, opages in _ROWS:
        tables.append(gpages + opages + [0] * (M - len(gpages) - len(opages)))
        shared.append(plen)
        start.append(len(gpages))
        own.append(olen)
        pos.append(plen + max(olen, 1) - 1)
        slot = max(olen, 1) - 1
        wpage.append(opages[slot // P] if olen else paged.TRASH_PAGE)
        wcol.append(slot % P)
    rng = np.random.default_rng(seed)
    i32 = np.int32
    spans = paged_kernel.Spans(*(jnp.asarray(x, i32) for x in (shared, start, own)))
    tokens = rng.integers(4, config.vocab_size, size=len(_ROWS))
    return [jnp.asarray(x, i32)[:, None] for x in (tokens, pos, wpage, wcol)] + [
        jnp.asarray(tables, i32), spans]  # fmt: skip


def _pools(config, seed, dtype):
    """The same random pool in both layouts (16 pages), entries in `dtype`."""
    rng = np.random.default_rng(seed)
    K, H, L = config.num_kv_heads, config.head_dim, config.num_layers
    shape = (K, 16, P, H)
    ks = [jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype) for _ in range(L)]
    vs = [jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype) for _ in range(L)]
    kernel = paged.KVPool(k=tuple(ks), v=tuple(vs), layout="pallas")
    xla = paged.KVPool(
        k=tuple(k.transpose(1, 0, 3, 2) for k in ks), v=tuple(v.transpose(1, 0, 2, 3) for v in vs)
    )
    return kernel, xla


def _as_xla_layout(pool):
    return paged.KVPool(k=tuple(k.transpose(1, 0, 3, 2) for k in pool.k),
                        v=tuple(v.transpose(1, 0, 2, 3) for v in pool.v))  # fmt: skip


def _forward(config, dparams, pool, step, attention):
    *inputs, table, spans = step
    x_DX, pool = jax.jit(
        paged.paged_forward, static_argnums=0, static_argnames=("attention", "interpret")
    )(config, dparams, pool, *inputs, table, spans=spans, attention=attention,
      interpret=attention == "pallas")  # fmt: skip
    return decode.head_logits_fm(config, dparams, x_DX), pool


def _config(**overrides):
    """The tiny model with one layer (interpret mode compiles each kernel call for seconds)."""
    return model.ModelConfig.tiny(num_layers=1, **overrides)


@pytest.mark.parametrize(
    "kv_heads,float32_pool", [(2, True), (4, False)], ids=["gqa", "mha-bfloat16-pool-only"]
)
def test_the_kernels_decode_step_is_the_xla_one(kv_heads, float32_pool):
    config = _config(num_kv_heads=kv_heads)
    dparams = decode.decode_params(config, model.init_params(config, jax.random.key(1)))
    step = _decode_step(config, seed=2)
    active = np.asarray(step[-1].own_len_B) > 0

    # A bfloat16 pool: both paths read the same values.
    kernel_pool, xla_pool = _pools(config, seed=3, dtype=jnp.bfloat16)
    got, got_pool = _forward(config, dparams, kernel_pool, step, "pallas")
    want, want_pool = _forward(config, dparams, xla_pool, step, "xla")
    scale = float(jnp.max(jnp.abs(want[active])))
    np.testing.assert_allclose(got[active], want[active], rtol=0, atol=1e-5 * scale)
    # The same keys and values written (the trash page aside: the idle row's second layer
    # sees its first layer's output, zeros from the kernel, a uniform average from XLA).
    for a, b in zip(jax.tree.leaves(_as_xla_layout(got_pool)), jax.tree.leaves(want_pool)):
        np.testing.assert_array_equal(a[1:], b[1:])
    if not float32_pool:
        return

    # A float32 pool: the kernel is the XLA path over the pool rounded to bfloat16, and within
    # bfloat16 rounding of the XLA path over the pool itself.
    kernel_pool, xla_pool = _pools(config, seed=3, dtype=jnp.float32)
    got, _ = _forward(config, dparams, kernel_pool, step, "pallas")
    want, _ = _forward(config, dparams, xla_pool, step, "xla")
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), xla_pool)
    want_rounded, _ = _forward(config, dparams, rounded, step, "xla")
    scale = float(jnp.max(jnp.abs(want[active])))
    diff = float(jnp.max(jnp.abs(got[active] - want_rounded[active])))
    assert diff <= 1e-5 * scale, diff
    np.testing.assert_allclose(got[active], want[active], rtol=0, atol=4 * 2**-8 * scale)
    assert float(jnp.max(jnp.abs(got[active] - want[active]))) > diff  # the rounding shows


def test_the_kernels_spans_are_the_engines_decode_mask():
    # The engine's decode rows attend to slots [0, shared_len) and own_len slots from page
    # own_start: a row with a partly filled prompt page skips that page's empty slots.
    mask = paged_kernel.Spans(*(jnp.asarray(x, jnp.int32) for x in ([5, 0], [2, 0], [3, 0])))
    want = np.zeros((2, 16), bool)
    want[0, [0, 1, 2, 3, 4, 8, 9, 10]] = True
    np.testing.assert_array_equal(mask.mask(16, P), want)


def test_a_paged_rollout_with_the_kernel_has_the_xla_paths_tokens():
    config = _config()
    params = model.init_params(config, jax.random.key(0))
    ids = np.asarray([[0, 9, 17, 33, 41, 5], [12, 7, 64, 90, 22, 8]], np.int32)
    mask = np.asarray([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32)
    kw = dict(n=2, max_new_tokens=6, temperature=0.0, max_num_seqs=3, page_size=P,
              max_num_batched_tokens=8, segment_steps=3)  # fmt: skip
    rng = jax.random.key(4)
    ref = paged_rollout.sample_paged(config, params, ids, mask, rng, attention="xla", **kw)
    out = paged_rollout.sample_paged(config, params, ids, mask, rng, attention="pallas", **kw)
    # No near-tie on these rows: every greedy token leads the runner-up by far more than the
    # kernel's bfloat16 rounding of K and V moves a logit (~1e-3 here).
    seqs = [np.concatenate([ids[b // 2][mask[b // 2] > 0], np.asarray(ref.response_ids[b])])
            for b in range(ref.response_ids.shape[0])]  # fmt: skip
    for logits_TV in whole_context.sequence_logits(config, params, seqs):
        top2 = np.sort(logits_TV[-7:-1], axis=-1)[:, -2:]
        assert float(np.min(top2[:, 1] - top2[:, 0])) > 1e-2
    np.testing.assert_array_equal(out.response_ids, ref.response_ids)
    np.testing.assert_array_equal(out.response_mask, ref.response_mask)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, rtol=0, atol=1e-2)


def test_a_sharded_paged_rollout_with_the_kernel_has_the_xla_paths_tokens():
    # On a mesh the kernel runs per device in a shard_map (data shards and kv heads split over
    # the tensor axis): the same tokens as the XLA path on the same mesh, and each device's
    # pool is its own shard's pages and kv heads. One prompt (two rows) a data shard: interpret
    # mode simulates each of the kernel's DMAs in a host callback, so its time follows the rows.
    from grpo_jax import sharding

    config = _config(num_kv_heads=2)
    params = model.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(5)
    ids = rng.integers(4, config.vocab_size, size=(4, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::3, :2] = 0  # left padding on prompts 0 and 3
    mesh = sharding.make_mesh((2, 2, 2))  # 4 data shards (data x fsdp), kv heads over tensor
    kw = dict(n=2, max_new_tokens=5, temperature=0.0, max_num_seqs=1, page_size=P,
              max_num_batched_tokens=8, segment_steps=2)  # fmt: skip
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        params = jax.device_put(params, sharding.param_shardings(config, mesh,
                                                                 sharding.LOGICAL_RULES))
        sids, smask = (jax.device_put(x, sharding.batch_sharding(mesh, 2)) for x in (ids, mask))
        stats = {}
        ref = paged_rollout.sample_paged(config, params, sids, smask, jax.random.key(4),
                                         attention="xla", **kw)  # fmt: skip
        out = paged_rollout.sample_paged(config, params, sids, smask, jax.random.key(4),
                                         attention="pallas", stats=stats, **kw)  # fmt: skip
    assert stats["shards"] == 4
    np.testing.assert_array_equal(out.response_ids, ref.response_ids)
    np.testing.assert_array_equal(out.response_mask, ref.response_mask)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, rtol=0, atol=1e-2)


def test_auto_picks_the_kernel_on_tpus_for_one_bfloat16_pool_only():
    assert paged_kernel.resolve("auto", "tpu", kv_dtype=jnp.bfloat16) == "pallas"
    assert paged_kernel.resolve("auto", "tpu", kv_dtype=jnp.float32) == "xla"
    assert paged_kernel.resolve("auto", "gpu", kv_dtype=jnp.bfloat16) == "xla"
    assert paged_kernel.resolve("auto", "cpu", kv_dtype=jnp.bfloat16) == "xla"
    assert paged_kernel.resolve("pallas", "cpu", kv_dtype=jnp.float32) == "pallas"  # interpret
    with pytest.raises(ValueError, match="'gpu'"):
        paged_kernel.resolve("pallas", "gpu", kv_dtype=jnp.bfloat16)


def test_the_kernel_needs_a_decode_step_over_its_layout():
    config = _config()
    dparams = decode.decode_params(config, model.init_params(config, jax.random.key(1)))
    *inputs, table, spans = _decode_step(config, seed=2)
    _, xla_pool = _pools(config, seed=3, dtype=jnp.float32)
    with pytest.raises(ValueError, match="layout='xla'"):
        paged.paged_forward(config, dparams, xla_pool, *inputs, table, spans=spans,
                            attention="pallas")  # fmt: skip


_TPU_COMPILE = """
import jax, jax.numpy as jnp
from grpo_jax import planner
from grpo_jax.models import paged_kernel
chip = jax.sharding.SingleDeviceSharding(planner.tpu_topology("v5p:2x2x1")[0])
B, N, K, H, NP, P, M = 8, 32, 8, 128, 512, 16, 64  # Qwen3-8B's heads, a 512-page pool
def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=chip)
spans = paged_kernel.Spans(*(spec((B,), jnp.int32) for _ in range(3)))
args = (spec((B, N, H), jnp.bfloat16), spec((K, NP, P, H), jnp.bfloat16),
        spec((K, NP, P, H), jnp.bfloat16), spec((B, M), jnp.int32), spans)
attend = jax.jit(lambda *a: paged_kernel.attend(*a, interpret=False))
compiled = attend.lower(*args).compile()
print(chip.device_set.pop().device_kind, "tpu_custom_call" in compiled.as_text())
"""


@pytest.mark.reference("tpu")
def test_the_kernel_compiles_for_a_tpu_chip():
    # Interpret mode checks the numbers; this checks the real thing lowers: the kernel path
    # (both runs' pallas_calls and their merge) compiled by libtpu's TPU compiler (Mosaic) for
    # a v5p chip, on no TPU, with Qwen3-8B's head counts in bfloat16.
    out = reference.tpu_compile(_TPU_COMPILE).split()
    assert out[-1] == "True" and "TPU" in " ".join(out[:-1])


# A v5p-16's 8 chips as 4 data shards x tensor 2: the engine's one-shard attention vmapped over
# the shard axis D (`spmd_axis_name`, as rollout/paged.py runs it), under the logical rules.
_TPU_COMPILE_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as Ps
from grpo_jax import planner, sharding
from grpo_jax.models import paged_kernel
mesh = sharding.make_mesh((1, 4, 2), devices=planner.tpu_topology("v5p:2x2x2"))
axes = ("data", "fsdp")
D, B, N, K, H, NP, P, M = 4, 8, 32, 8, 128, 512, 16, 64
def spec(shape, dtype, *rest):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, Ps(axes, *rest)))
pages = spec((D, K, NP, P, H), jnp.bfloat16, "tensor")
spans = paged_kernel.Spans(*(spec((D, B), jnp.int32) for _ in range(3)))
args = (spec((D, B, N, H), jnp.bfloat16, None, "tensor"), pages, pages, spec((D, B, M), jnp.int32),
        spans)
step = jax.vmap(lambda *a: paged_kernel.attend(*a, interpret=False), spmd_axis_name=axes)
with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
    compiled = jax.jit(step).lower(*args).compile()
text = compiled.as_text()
own_pages = 2 * (K // 2) * NP * P * H * 2  # one chip's keys and values: its shard, its heads
print("tpu_custom_call" in text, any(op in text for op in ("all-gather", "all-reduce", "all-to-all",
      "collective-permute")), compiled.memory_analysis().argument_size_in_bytes - own_pages)

# The planner's program of a whole engine call (prefill, admission, a decode segment) with the
# kernel, as plan.py --tpu_topology compiles it: a tiny bfloat16 model, 4 shards x tensor 2.
from grpo_jax import model
from grpo_jax.rollout import paged
config = model.ModelConfig.tiny(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=128,
                                dtype=jnp.bfloat16)
plan = paged.plan_pool(num_prompts=2, n=2, prompt_width=64, max_new_tokens=64, page_size=16)
fn, inputs = paged.peak_program(config, plan, shards=4, shard_axes=axes, max_new_tokens=64,
                                attention="pallas")
key = jax.eval_shape(lambda: jax.random.key(0))
with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
    params = jax.eval_shape(lambda k: model.init_params(config, k), key)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                          sharding.param_shardings(config, mesh, sharding.LOGICAL_RULES))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, Ps(axes) if shape
                                                                      else Ps()))
            for shape, dtype in inputs]
    key = jax.ShapeDtypeStruct((), key.dtype, sharding=NamedSharding(mesh, Ps()))
    program = jax.jit(fn).lower(params, key, *args).compile().as_text()
print("tpu_custom_call" in program)
"""


@pytest.mark.reference("tpu")
def test_the_kernel_compiles_per_chip_over_data_shards_and_a_tensor_axis():
    # XLA cannot partition a Mosaic kernel (libtpu refuses: "Mosaic kernels cannot be
    # automatically partitioned"), so under a mesh the kernel runs in a shard_map: compiled for
    # a v5p-16's chips, each chip's arguments are its own pages and kv heads (plus its rows'
    # queries and tables), and the program moves nothing between chips.
    kernel, collective, extra, planned = reference.tpu_compile(_TPU_COMPILE_SHARDED).split()[-4:]
    assert kernel == "True" and collective == "False"
    assert 0 <= int(extra) < 2**20, extra  # the queries, tables and spans: kilobytes
    assert planned == "True"  # the planner's engine program compiles with the kernel in it
