"""Causal self-attention's implementations (grpo_jax/models/attention.py): the blockwise one
and splash (Pallas interpret mode on the CPU) equal the dense XLA one on every mask layout the
model uses, forward and gradients, the blockwise one's memory grows linearly with the row, and
`model.attention_impl` reaches the model."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import model
from grpo_jax.models import attention, blockwise, lowp_attention, matmul, splash

# Same math in another summation order (online softmax over key blocks): measured up to ~30
# ulps of each tensor's scale; a key block off by one position or a wrong segment rule moves
# outputs by a good fraction of their scale (1e5 ulps and more).
ULPS = 256
# Through a whole model with x10 weights (sharp softmaxes amplify rounding, as in
# tests/test_packing.py); the key biases' gradient is zero in exact arithmetic (a softmax does
# not see a shift of every key), so that leaf is rounding noise at the tree's scale.
MODEL_ULPS = 2048


def _layouts(T):
    """(name, segments [2, T], prefixes [2, T]) for the masks the model builds."""
    r = np.random.default_rng(0)
    out = []
    # Left padding (model.hidden_states: prefix 1 everywhere, so padding queries see real keys).
    seg = (np.arange(T)[None] >= np.array([[T // 5], [0]])).astype(np.int32)
    out.append(("left_padded", seg, np.ones_like(seg)))
    # Right padding (responses), same rule.
    seg = (np.arange(T)[None] < np.array([[T - T // 7], [T]])).astype(np.int32)
    out.append(("right_padded", seg, np.ones_like(seg)))
    # Packed rows (grpo_jax/trainer/packing.py): a prompt then its responses, each response
    # seeing its prompt and itself, several units a row, padding at the end.
    seg, pre = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    for row in range(2):
        pos, s = 0, 1
        while pos < T - 8:
            prompt = int(r.integers(3, T // 6))
            seg[row, pos : pos + prompt] = pre[row, pos : pos + prompt] = s
            p_seg, pos, s = s, pos + prompt, s + 1
            for _ in range(int(r.integers(1, 4))):
                n = min(int(r.integers(2, T // 5)), T - 4 - pos)
                if n <= 0:
                    break
                seg[row, pos : pos + n], pre[row, pos : pos + n] = s, p_seg
                pos, s = pos + n, s + 1
    out.append(("packed_shared_prompts", seg, pre))
    return out


def _qkv(T, N, K, H, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, T, N, H))
    k = jax.random.normal(ks[1], (2, T, K, H))
    v = jax.random.normal(ks[2], (2, T, K, H))
    return tuple(x.astype(dtype) for x in (q, k, v))


@pytest.mark.parametrize(
    "T,block,N,K",
    [
        (96, 32, 6, 2),  # GQA, 3 x 3 blocks
        (100, 32, 4, 4),  # MHA, a row padded to 4 blocks
        (64, 512, 6, 2),  # one block shorter than `block`
    ],
)
def test_blockwise_equals_xla_forward_and_gradients(T, block, N, K):
    _assert_equals_xla(
        lambda q, k, v, mask: blockwise.attend(
            q, k, v, mask.segments_BT, mask.prefixes_BT, block=block
        ),
        T, N, K,
    )  # fmt: skip


def _assert_equals_xla(attend, T, N, K):
    """attend(q, k, v, mask) equals the dense XLA path on every layout: forward on the queries
    that see a key (finite elsewhere) and the gradients of a weighted sum of those."""
    for name, seg, pre in _layouts(T):
        mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))
        _assert_equals_xla_on(attend, mask, T, N, K, name)


def _xla(q, k, v, mask):
    return attention.self_attention(q, k, v, mask, "xla")


@functools.partial(jax.jit, static_argnums=0)
def _output_and_grads(attend, q, k, v, mask, w):
    """(attend's output, the gradients of sum(output * w) in q, k, v): one program per
    implementation and shape, whatever the layout (run eagerly, each layout's ops compiled
    one by one: a couple of hundred small programs a test)."""

    def loss(q, k, v):
        o = attend(q, k, v, mask)
        return jnp.sum(o * w), o

    (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return o, grads


def _assert_equals_xla_on(attend, mask, T, N, K, name):
    """`_assert_equals_xla` on one mask; returns attend's output."""
    q, k, v = _qkv(T, N, K, 16, jnp.float32)
    seen = np.asarray(mask.dense()).any(-1)  # queries that see a key (not padding)
    w = jax.random.normal(jax.random.key(1), q.shape) * seen[:, :, None, None]
    want, want_g = _output_and_grads(_xla, q, k, v, mask, w)
    got, got_g = _output_and_grads(attend, q, k, v, mask, w)
    assert np.isfinite(np.asarray(got)).all() and got.shape == want.shape, name
    sel = np.broadcast_to(seen[:, :, None, None], got.shape)
    numerics.assert_close(np.asarray(got)[sel], np.asarray(want)[sel], ulps=ULPS,
                          scale=float(jnp.max(jnp.abs(want))), err_msg=name)  # fmt: skip
    numerics.assert_trees_close(got_g, want_g, ulps=ULPS, err_msg=name)
    return np.asarray(got)


@pytest.mark.parametrize(
    "T,N,K",
    [
        (80, 6, 2),  # GQA, one 128-token block (the row padded to it)
        (80, 4, 4),  # MHA
        (300, 6, 2),  # 3 blocks of 128 after padding to 384: the causal block skipping
    ],
)
def test_splash_equals_xla_forward_and_gradients(T, N, K):
    # JAX's Pallas TPU kernel in interpret mode: two splash calls (own segment, the prompt of a
    # packed response) merged by log-sum-exp, with the merge's own backward (grpo_jax/models/
    # splash.py). A wrong merge weight or a backward run with the unmerged statistics moves
    # the outputs or the gradients by a fraction of their scale.
    _assert_equals_xla(
        lambda q, k, v, mask: attention.self_attention(q, k, v, mask, "splash"), T, N, K
    )


def test_splash_takes_one_call_for_padded_batches():
    # Mask.padded (no packed prefixes) runs one splash call, splash's own backward: the same
    # forward and gradients on the queries that see a key, at half the work.
    T = 80
    for name, seg, _ in _layouts(T)[:2]:
        mask = attention.Mask.padded(jnp.asarray(seg))
        assert not mask.shared_prefixes
        _assert_equals_xla_on(
            lambda q, k, v, mask: attention.self_attention(q, k, v, mask, "splash"),
            mask, T, 6, 2, name,
        )  # fmt: skip
    calls = []
    real = splash._two_sets
    try:
        splash._two_sets = lambda *a: calls.append(1) or real(*a)
        q, k, v = _qkv(T, 6, 2, 16, jnp.float32)
        attention.self_attention(q, k, v, attention.Mask.padded(jnp.asarray(seg)), "splash")
        assert not calls
        _, seg, pre = _layouts(T)[2]
        attention.self_attention(q, k, v, attention.Mask.packed(jnp.asarray(seg),
                                                                jnp.asarray(pre)), "splash")
        assert calls
    finally:
        splash._two_sets = real


@pytest.mark.parametrize(
    "impl",
    [
        lambda q, k, v, m: blockwise.attend(q, k, v, m.segments_BT, m.prefixes_BT, block=32),
        lambda q, k, v, m: splash.attend(q, k, v, m.segments_BT, m.prefixes_BT, interpret=True),
    ],
    ids=["blockwise", "splash"],
)
def test_bf16_inputs_keep_a_float32_softmax(impl):
    T = 96
    q, k, v = _qkv(T, 6, 2, 16, jnp.bfloat16)
    _, seg, pre = _layouts(T)[2]
    mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))
    seen = np.asarray(mask.dense()).any(-1)[:, :, None, None]
    got = impl(q, k, v, mask)
    assert got.dtype == jnp.bfloat16
    want = attention.self_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask, "xla")
    # bf16 inputs and output (8 bits of mantissa); the softmax itself is float32 on both paths.
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want)) * seen
    assert err.max() < 2e-2 * float(jnp.max(jnp.abs(want)))


def _grad_temp_bytes(impl, T, N=8, K=2, H=64):
    q, k, v = (jax.ShapeDtypeStruct((1, T, n, H), jnp.float32) for n in (N, K, K))
    mask = attention.Mask(jax.ShapeDtypeStruct((1, T), jnp.int32),
                          jax.ShapeDtypeStruct((1, T), jnp.int32))  # fmt: skip

    def f(q, k, v, mask):
        return jnp.sum(attention.self_attention(q, k, v, mask, impl))

    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_in_the_row():
    # Four times the row: the dense path's float32 scores grow 16x, the blockwise path's
    # temporaries (q, k, v, o and their gradients; one block pair of scores) about 4x.
    small, large = _grad_temp_bytes("blockwise", 2048), _grad_temp_bytes("blockwise", 8192)
    assert large < 5 * small, (small, large)
    dense_small, dense_large = _grad_temp_bytes("xla", 2048), _grad_temp_bytes("xla", 8192)
    assert dense_large > 10 * dense_small  # the check has teeth: the dense path is quadratic
    assert large < dense_large / 8


@pytest.mark.parametrize("packed", [False, True])
def test_model_hidden_states_and_gradients_equal_across_implementations(packed):
    cfg = model.ModelConfig.tiny()
    params = jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x,
                          model.init_params(cfg, jax.random.key(0)))  # fmt: skip
    T = 80
    _, seg, pre = _layouts(T)[2]
    tokens = jax.random.randint(jax.random.key(3), (2, T), 1, cfg.vocab_size)
    positions = jnp.asarray(np.arange(T)[None].repeat(2, 0), jnp.int32)
    mask_BT = jnp.asarray(seg > 0, jnp.int32)
    w = jax.random.normal(jax.random.key(4), (2, T, cfg.hidden_size)) * mask_BT[..., None]

    def run(impl):
        c = dataclasses.replace(cfg, attention_impl=impl)

        def f(params):
            if packed:
                h = model.hidden_states_packed(c, params, tokens, positions, jnp.asarray(seg),
                                               jnp.asarray(pre))  # fmt: skip
            else:
                h = model.hidden_states(c, params, tokens, mask_BT)
            return jnp.sum(h * w), h

        return jax.value_and_grad(f, has_aux=True)(params)

    (_, want), want_g = run("xla")
    sel = np.broadcast_to(np.asarray(mask_BT, bool)[..., None], want.shape)
    # splash rounds twice more per query (the queries scaled before the product, the two key
    # sets' outputs merged by weights exp(lse_i - lse)). The key biases' gradient is zero in
    # exact arithmetic (a bias shifts every score of a query by the same q.b, which the softmax
    # ignores), so both sides of its comparison are rounding noise, at the tree's floor scale:
    # splash's came out at 2,775 ulps of it on AVX-512 CPUs and 5,656 on an AVX2-only EPYC
    # (blockwise's under 2,048), so that leaf alone gets twice splash's bound.
    key_bias = "['layers']['attn']['k_proj']['bias']"
    for impl, ulps in (("blockwise", MODEL_ULPS), ("splash", 2 * MODEL_ULPS)):
        (_, got), got_g = run(impl)
        numerics.assert_close(np.asarray(got)[sel], np.asarray(want)[sel], ulps=ulps,
                              scale=float(jnp.max(jnp.abs(want))), err_msg=impl)  # fmt: skip
        numerics.assert_trees_close(got_g, want_g, ulps=ulps, err_msg=impl,
                                    leaf_ulps={key_bias: 2 * ulps})  # fmt: skip


def test_auto_rule_and_bad_names():
    assert attention.resolve("auto", 1024, "cpu") == "xla"
    assert attention.resolve("auto", attention.AUTO_BLOCKWISE_FROM, "cpu") == "blockwise"
    assert attention.resolve("auto", 64, "gpu", dtype=jnp.float32, head_dim=64) == "blockwise"
    assert attention.resolve("auto", 64, "gpu", dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert attention.resolve("auto", 64, "gpu", dtype=jnp.bfloat16, head_dim=256) == "blockwise"
    assert attention.resolve("auto", 64, "gpu", dtype=jnp.float16, head_dim=12) == "blockwise"
    assert attention.resolve("auto", 64, "tpu", dtype=jnp.bfloat16, head_dim=128) == "splash"
    assert attention.resolve("auto", 1 << 15, "tpu", dtype=jnp.float32, head_dim=64) == "splash"
    assert attention.resolve("splash", 64, "cpu") == "splash"  # interpret mode (the tests)
    assert attention.resolve("xla", 1 << 15, "gpu") == "xla"
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        model.ModelConfig.tiny(attention_impl="flash")
    with pytest.raises(ValueError, match="model.attention_impl"):
        config_lib.ModelSpec(attention_impl="flash")


@pytest.mark.parametrize(
    "backend,dtype,head_dim,reason,instead",
    [
        ("cpu", jnp.bfloat16, 64, "needs an NVIDIA GPU, and JAX's backend here is 'cpu'", "xla"),
        ("tpu", jnp.bfloat16, 64, "needs an NVIDIA GPU", "splash"),
        ("gpu", jnp.float32, 64, "takes bfloat16 or float16 inputs, and model.dtype is float32",
         "blockwise"),
        ("gpu", jnp.bfloat16, 160, "head dims up to 128 in multiples of 8, and the model's is "
         "160", "blockwise"),
    ],
)  # fmt: skip
def test_cudnn_where_it_cannot_run_names_the_field_and_the_fallback(
    backend, dtype, head_dim, reason, instead
):
    with pytest.raises(ValueError) as e:
        attention.resolve("cudnn", 256, backend, dtype=dtype, head_dim=head_dim)
    assert str(e.value).startswith("model.attention_impl='cudnn' cannot run here: ")
    assert reason in str(e.value) and f"would run {instead!r}" in str(e.value)
    assert attention.resolve("auto", 256, backend, dtype=dtype, head_dim=head_dim) == instead


def test_splash_on_a_gpu_names_the_field_and_the_fallback():
    with pytest.raises(ValueError) as e:
        attention.resolve("splash", 256, "gpu", dtype=jnp.bfloat16, head_dim=128)
    assert str(e.value).startswith("model.attention_impl='splash' cannot run here: ")
    assert "Pallas TPU kernel" in str(e.value) and "would run 'cudnn'" in str(e.value)
    run = config_lib.RunConfig(model=config_lib.ModelSpec(attention_impl="splash"))
    with pytest.raises(config_lib.ConfigError, match=r"model.attention_impl='splash' cannot run"):
        run.check_mesh(1, backend="gpu")
    run.check_mesh(1, backend="tpu")
    run.check_mesh(1, backend="cpu")


def test_cudnn_is_refused_by_the_config_check_before_any_work():
    run = config_lib.RunConfig(model=config_lib.ModelSpec(attention_impl="cudnn"))
    with pytest.raises(config_lib.ConfigError, match=r"model.attention_impl='cudnn' cannot run"):
        run.check_mesh(1, backend="cpu")
    bf16 = config_lib.RunConfig(
        model=config_lib.ModelSpec(attention_impl="cudnn", dtype="bfloat16")
    )
    bf16.check_mesh(1, backend="gpu")  # runs there
    with pytest.raises(config_lib.ConfigError, match="model.dtype is float32"):
        run.check_mesh(1, backend="gpu")


@pytest.mark.parametrize("N,K", [(6, 2), (4, 4)])
def test_fused_attention_call_equals_xla_on_every_layout(N, K):
    # The cuDNN path's call (jax.nn.dot_product_attention with the dense mask, GQA left to
    # the kernel), run with implementation="xla", which runs on CPU: the same arguments as on
    # a GPU, only the kernel differs. Forward on the queries that see a key (zeros on the
    # others) and gradients.
    T = 80
    for name, seg, pre in _layouts(T):
        mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))
        got = _assert_equals_xla_on(
            lambda q, k, v, mask: attention.fused_attention(q, k, v, mask.dense(), kernel="xla"),
            mask, T, N, K, name,
        )  # fmt: skip
        seen = np.asarray(mask.dense()).any(-1)
        assert (got[~seen] == 0).all(), name


@pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason=f"cuDNN attention needs an NVIDIA GPU; JAX's backend here is {jax.default_backend()!r}",
)
def test_cudnn_equals_xla_on_the_gpu():  # pragma: no cover - GPU only
    T = 256
    q, k, v = _qkv(T, 8, 2, 64, jnp.bfloat16)
    for name, seg, pre in _layouts(T):
        mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))
        seen = np.asarray(mask.dense()).any(-1)
        want = attention.self_attention(q, k, v, mask, "xla").astype(jnp.float32)
        got = attention.self_attention(q, k, v, mask, "cudnn").astype(jnp.float32)
        sel = np.broadcast_to(seen[:, :, None, None], got.shape)
        # bf16 outputs: a few bf16 ulps (2^-8 relative) of the outputs' scale
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got)[sel], np.asarray(want)[sel],
                                   atol=4 * 2**-8 * scale, err_msg=name)  # fmt: skip


# One bfloat16 epsilon (2^-7) in float32 ulps (2^-23).
BF16_EPS_ULPS = 2**16


@pytest.mark.parametrize("T,N,K", [(100, 6, 2), (64, 4, 4)])  # 4 blocks of 32 / one block
def test_lowp_causal_attention_is_the_float32_attention_to_bf16_precision(T, N, K):
    """grpo_jax/models/lowp_attention.py on every mask layout: its output and gradients are the
    float32 attention's of the same bf16 inputs up to bf16 rounding (inputs, probabilities,
    output and score gradients rounded to bf16: measured up to 0.7 bf16 epsilons of each
    tensor's scale); a key block off by one, a wrong mask or a missing 1/sqrt(H) moves them
    by tens of epsilons. The forward is the generic bf16 path's (`attend_causal`) but for
    the float32 sums' order."""
    q, k, v = _qkv(T, N, K, 16, jnp.bfloat16)
    for name, seg, pre in _layouts(T):
        mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))
        seen = np.asarray(mask.dense()).any(-1)
        w = jax.random.normal(jax.random.key(1), q.shape) * seen[:, :, None, None]

        def lowp(q, k, v, mask):
            return lowp_attention.attend_causal(q, k, v, mask.dense(), 32).astype(jnp.float32)

        got, got_g = _output_and_grads(lowp, q, k, v, mask, w)
        f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
        want, want_g = _output_and_grads(_xla, *f32, mask, w)
        assert np.isfinite(np.asarray(got)).all(), name
        sel = np.broadcast_to(seen[:, :, None, None], got.shape)
        numerics.assert_close(np.asarray(got)[sel], np.asarray(want)[sel],
                              ulps=2 * BF16_EPS_ULPS, scale=float(jnp.max(jnp.abs(want))),
                              err_msg=name)  # fmt: skip
        for g, wg in zip(got_g, want_g, strict=True):
            assert g.dtype == jnp.bfloat16, name
            numerics.assert_close(g.astype(jnp.float32), wg, ulps=4 * BF16_EPS_ULPS,
                                  err_msg=name)  # fmt: skip
        k_BKHS, v_BKSH = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        generic = attention.attend_causal(q, k_BKHS, v_BKSH, mask.dense()).astype(jnp.float32)
        numerics.assert_close(np.asarray(got)[sel], np.asarray(generic)[sel],
                              ulps=BF16_EPS_ULPS, scale=float(jnp.max(jnp.abs(want))),
                              err_msg=name)  # fmt: skip


def _dot_operand_types(compiled_text: str) -> list[list[str]]:
    """The operand types of each dot of a compiled CPU program (in fusions too)."""
    out = []
    for params, body in re.findall(r"^%\S+ \((.*?)\) -> \S+ \{\n(.*?)^\}", compiled_text,
                                   re.S | re.M):  # fmt: skip
        types = dict(re.findall(r"(\S+): (\w+)\[", params))
        types.update(re.findall(r"%(\S+) = (\w+)\[", body))
        for a, b in re.findall(r" dot\(%(\S+), %(\S+)\)", body):
            out.append([types[a], types[b]])
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot kernels")
def test_lowp_causal_attention_runs_every_product_on_the_bf16_kernels():
    """Every product of the forward and of the backward (2 and 5 per query block, 4 blocks) is
    a bf16 x bf16 dot in the compiled program, none a float32 one as in JAX's derivative of the
    generic path; and the program runs (XLA:CPU compiles a bf16 dot in a form it has no kernel
    for, then fails at run time)."""
    T, block = 100, 32
    q, k, v = _qkv(T, 6, 2, 16, jnp.bfloat16)
    _, seg, pre = _layouts(T)[2]
    mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

    lowp = loss(lambda q, k, v: lowp_attention.attend_causal(q, k, v, mask.dense(), block))
    forward = _dot_operand_types(jax.jit(lowp).lower(q, k, v).compile().as_text())
    if forward != [["bf16", "bf16"]] * 8:
        pytest.skip("this XLA:CPU does not run the forward's bf16 dots on bf16 operands")
    grad = jax.jit(jax.grad(lowp, argnums=(0, 1, 2))).lower(q, k, v).compile()
    grad_dots = _dot_operand_types(grad.as_text())  # XLA may share the scores' products
    assert grad_dots == [["bf16", "bf16"]] * len(grad_dots) and 6 * 4 <= len(grad_dots) <= 7 * 4
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v))
    generic = loss(lambda q, k, v: attention.attend_causal(
        q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask.dense()))  # fmt: skip
    before = jax.jit(jax.grad(generic, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    before = _dot_operand_types(before)
    assert before.count(["bf16", "bf16"]) < len(before)  # the test can tell


def test_self_attention_takes_the_lowp_path_at_bf16_on_the_cpu_only():
    """`self_attention`'s "xla" path: `lowp_attention` for bf16 on XLA:CPU, the generic one for
    float32, and for programs lowered for a GPU or TPU (plan.py's stand-ins)."""
    T = 64
    _, seg, pre = _layouts(T)[2]
    mask = attention.Mask(jnp.asarray(seg), jnp.asarray(pre))

    def jaxpr(dtype):
        q, k, v = _qkv(T, 6, 2, 16, dtype)
        return str(jax.make_jaxpr(lambda q, k, v: attention.self_attention(q, k, v, mask, "xla"))(
            q, k, v))  # fmt: skip

    assert ("custom_vjp" in jaxpr(jnp.bfloat16)) == (jax.default_backend() == "cpu")
    assert "custom_vjp" not in jaxpr(jnp.float32)
    with matmul.lowering_for("tpu"):
        assert "custom_vjp" not in jaxpr(jnp.bfloat16)
