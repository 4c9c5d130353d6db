"""The projections' matmul, x [M, K] @ w [K, N], at the model's compute dtype.

float32, and bfloat16 on a GPU or TPU: ``jnp.dot`` and JAX's own derivative (their
bf16 dots accumulate in float32 inside cuBLAS and the MXU).

bfloat16 on XLA:CPU (``model.dtype=bfloat16``, float32 master weights): the three dots of the
matmul and of its derivative take bf16 operands and accumulate in float32, as torch's bf16
autocast does:

  y  = bf16(x @ w)           [M, N], float32 sum rounded to bf16 (the activation)
  dx = bf16(dy @ w^T)        [M, K], rounded to bf16 (an activation's gradient)
  dw = (x^T @ dy)            [K, N], the float32 sum cast to w's dtype (no bf16 rounding of the
                             weight gradient when the weights are float32)

XLA:CPU runs a bf16 x bf16 -> bf16 dot, and JAX's derivative of a bf16 dot with a float32
result (a float32 cotangent times a bf16 operand), as float32 dots. It sends a dot to its bf16
kernels (YNNPACK: AMX or AVX512-BF16 where the CPU has them) only when it is bf16 x bf16 -> f32
with the lhs contracted on its last axis and neither operand column-major, so the derivative is
written out (a custom VJP). The forward and dx are of that form; dw contracts the tokens, the
first axis of both x and dy, so x^T is first written to a row-major buffer of its own
(``_row_major_transpose``). On a 2-core Xeon with AMX (benchmarks/bench_matmul.py), the SmolLM2
MLP's [4096, 576] x [576, 1536] and its gradients ran at 100-200 GFLOP/s as plain bf16 dots or
JAX's derivative, 450-1,300 in this form; the update of `benchmarks/bench_update.py --dtype
bfloat16` went from 142 to 83 s.

The platform is decided when the program is traced: JAX's default backend, unless
``lowering_for`` says which accelerator a CPU-compiled program stands in for (plan.py).

``remat_policy_fn`` in transformer.py cannot see dots inside a custom VJP, so each CPU bf16
matmul's output is named ``lowp_dot:KxN`` (`checkpoint_name`) and the policies treat the name
as the dot it stands for.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

NAME_PREFIX = "lowp_dot:"
# The platform programs traced now stand in for (`lowering_for`); None: JAX's default backend.
_STAND_IN_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "matmul_stand_in_for", default=None
)


@contextlib.contextmanager
def lowering_for(platform: str | None):
    """Programs traced inside compute as on `platform` ("gpu", "tpu", "cpu") whatever JAX's
    default backend: plan.py's CPU devices standing in for an accelerator, or the TPU compiler
    run from a CPU-only process, get the accelerator's program. None: JAX's default backend."""
    token = _STAND_IN_FOR.set(platform)
    try:
        yield
    finally:
        _STAND_IN_FOR.reset(token)


def cpu_kernels() -> bool:
    """Whether the programs traced now are for XLA:CPU (see `lowering_for`)."""
    return (_STAND_IN_FOR.get() or jax.default_backend()) == "cpu"


def name(k: int, n: int) -> str:
    """The checkpoint name of a low-precision matmul's output with a [k, n] weight."""
    return f"{NAME_PREFIX}{k}x{n}"


def weight_shape(checkpoint_name_: str) -> tuple[int, int] | None:
    """The [K, N] weight shape a ``lowp_dot`` checkpoint name stands for; None for any other."""
    if not checkpoint_name_.startswith(NAME_PREFIX):
        return None
    k, n = checkpoint_name_[len(NAME_PREFIX):].split("x")
    return int(k), int(n)


def matmul(x_MK, w_KN, dtype):
    """x @ w computed at `dtype` (see the module docstring); the result has `dtype`."""
    if jnp.dtype(dtype) == jnp.float32 or not cpu_kernels():
        return jnp.dot(x_MK.astype(dtype), w_KN.astype(dtype))
    y_MN = _lowp_matmul(x_MK.astype(dtype), w_KN)
    return checkpoint_name(y_MN, name(*w_KN.shape))


def row_major(x, perm):
    """`x.transpose(perm)` in a row-major buffer of its own (XLA:CPU; see the module docstring).

    Three parts, each needed on XLA:CPU (jaxlib 0.10): a pad by one element on the last axis and
    a slice, so that the bf16 pass, which runs before layout assignment, sees a row-major operand
    (a transpose's layout is permuted); an optimization barrier, so that no later simplification
    turns the pair back into a transpose that XLA then folds into the dot (a bf16 dot in that
    form has no kernel on XLA:CPU and fails at run time); and the move done on the uint16 bits
    (XLA:CPU's bf16 transpose was up to 4x slower). tests/test_matmul.py checks the compiled dots.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).transpose(perm)
    n = bits.shape[-1]
    pad = [(0, 0, 0)] * (bits.ndim - 1) + [(0, 1, 0)]
    bits = jax.lax.pad(bits, jnp.uint16(0), pad)[..., :n]
    return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(bits), x.dtype)


def _row_major_transpose(x_MK):
    """x^T [K, M] in a row-major buffer of its own (`row_major`)."""
    return row_major(x_MK, (1, 0))


@jax.custom_vjp
def _lowp_matmul(x_MK, w_KN):
    y_MN = jnp.dot(x_MK, w_KN.astype(x_MK.dtype), preferred_element_type=jnp.float32)
    return y_MN.astype(x_MK.dtype)


def _lowp_matmul_fwd(x_MK, w_KN):
    return _lowp_matmul(x_MK, w_KN), (x_MK, w_KN)


def _lowp_matmul_bwd(res, dy_MN):
    x_MK, w_KN = res
    dy_MN = dy_MN.astype(x_MK.dtype)
    dx_MK = jax.lax.dot_general(
        dy_MN, w_KN.astype(x_MK.dtype), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    ).astype(x_MK.dtype)  # fmt: skip
    dw_KN = jnp.dot(_row_major_transpose(x_MK), dy_MN, preferred_element_type=jnp.float32)
    return dx_MK, dw_KN.astype(w_KN.dtype)


_lowp_matmul.defvjp(_lowp_matmul_fwd, _lowp_matmul_bwd)
