"""The projections' matmul at the compute dtype (grpo_jax/models/matmul.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import matmul

M, K, N = 96, 48, 80


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32) / np.sqrt(K)
    dy = rng.standard_normal((M, N), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)


def _value_and_vjp(x, w, dy, dtype):
    y, vjp = jax.vjp(lambda x, w: matmul.matmul(x, w, dtype), x, w)
    return y, *vjp(dy.astype(y.dtype))


def test_float32_is_jax_dot_and_its_derivative_bitwise():
    x, w, dy = _inputs()
    y, dx, dw = _value_and_vjp(x, w, dy, jnp.float32)
    y_ref, vjp = jax.vjp(jnp.dot, x, w)
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip((dx, dw), vjp(dy), strict=True):
        np.testing.assert_array_equal(got, want)


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_bf16_accumulates_in_float32_and_keeps_the_weight_gradient_unrounded():
    x, w, dy = _inputs(1)
    y, dx, dw = _value_and_vjp(x.astype(jnp.bfloat16), w, dy, jnp.bfloat16)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    xb, wb, dyb = _bf16(x), _bf16(w), _bf16(dy)
    # Exact products of the bf16 operands summed in float64: the float32 sum differs from it by
    # far less than a bf16 rounding step, so the bf16 results are that sum rounded, to one ulp.
    for got, exact in ((y, xb @ wb), (dx, dyb @ wb.T)):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(got, exact, rtol=2**-8, atol=1e-6)
    # A bf16 x bf16 -> bf16 dot (no float32 accumulation) misses this by up to sqrt(K) ulps;
    # the weight gradient is the float32 sum itself, not rounded to bf16.
    np.testing.assert_allclose(np.asarray(dw, np.float64), xb.T @ dyb, rtol=1e-5, atol=1e-5)
    assert np.any(_bf16(dw) != np.asarray(dw, np.float64))


def test_accelerator_programs_keep_jax_dot_and_its_derivative():
    """Programs for a GPU or TPU (plan.py's stand-ins, the TPU compiler) keep the plain bf16 dot
    and JAX's derivative: the CPU's custom VJP and transposes are not in them."""
    x, w, dy = _inputs(3)
    x = x.astype(jnp.bfloat16)
    for platform in ("gpu", "tpu"):
        with matmul.lowering_for(platform):
            assert not matmul.cpu_kernels()
            jaxpr = str(jax.make_jaxpr(jax.grad(
                lambda x, w: jnp.sum(matmul.matmul(x, w, jnp.bfloat16).astype(jnp.float32))
            ))(x, w))  # fmt: skip
            y, dx, dw = _value_and_vjp(x, w, dy, jnp.bfloat16)
        assert "custom_vjp" not in jaxpr and "optimization_barrier" not in jaxpr
        y_ref, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16)), x, w)
        np.testing.assert_array_equal(y, y_ref)
        for got, want in zip((dx, dw), vjp(dy.astype(jnp.bfloat16)), strict=True):
            np.testing.assert_array_equal(got, want)
    assert matmul.cpu_kernels() == (jax.default_backend() == "cpu")


def test_checkpoint_names_round_trip():
    assert matmul.weight_shape(matmul.name(576, 1536)) == (576, 1536)
    assert matmul.weight_shape("some_other_name") is None


def _dot_operand_types(compiled_text: str) -> list[list[str]]:
    """The parameter types of each computation of a compiled CPU program that holds a dot."""
    comps = re.findall(r"^%\S+ \((.*?)\) -> \S+ \{\n(.*?)^\}", compiled_text, re.S | re.M)
    return [re.findall(r": (\w+)\[", params) for params, body in comps if " dot(" in body]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot kernels")
@pytest.mark.parametrize("computed_input", [False, True], ids=["parameter", "computed"])
def test_bf16_backward_dots_run_on_the_forward_dots_kernel(computed_input):
    """XLA:CPU runs a bf16 x bf16 -> f32 dot on its bf16 kernels only in the canonical form; the
    backward's two dots must get there too (the weight gradient through a row-major transpose),
    not fall back to float32 operands as JAX's own derivative does."""
    x, w, _ = _inputs()
    x = x.astype(jnp.bfloat16)

    def loss(x, w):
        if computed_input:  # as the MLP's down projection: its input is an elementwise product
            x = (jax.nn.silu(x.astype(jnp.float32)) * x.astype(jnp.float32)).astype(x.dtype)
        return jnp.sum(matmul.matmul(x, w, jnp.bfloat16).astype(jnp.float32) ** 2)

    forward = _dot_operand_types(jax.jit(loss).lower(x, w).compile().as_text())
    if forward != [["bf16", "bf16"]]:
        pytest.skip(f"this XLA:CPU runs even the forward bf16 dot on {forward}")
    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
    assert _dot_operand_types(grad.as_text()) == [["bf16", "bf16"]] * 3
    # ... and runs (a bf16 dot XLA:CPU sends to no kernel compiles, then fails here).
    dx, dw = grad(x, w)
    assert dw.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(dw)))

    def jax_derivative(x, w):  # what Proj computed before: JAX's transpose of the f32-out dot
        y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    before = jax.jit(jax.grad(jax_derivative, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert _dot_operand_types(before).count(["bf16", "bf16"]) < 3  # the test can tell
