"""Tolerances that follow from float32 arithmetic, not from one machine.

Two float32 computations of the same quantity that differ only in the order of their sums
(packed vs padded rows, micro-batches vs one batch, a sharded vs an unsharded reduction, XLA vs
torch, AVX2 vs AVX-512 kernels, YNNPACK vs Eigen dots) differ by rounding. For one sum
y = sum_i t_i of n terms the difference is bounded by about n * eps * sum_i |t_i|: by the size of
the TERMS, not of y. A gradient element summed over many tokens of both signs can be small while
its terms are not, so its relative error can be large (1.7 % on an element of 0.0019 was seen on
an AVX-512 machine) and a bound relative to each element, or a fixed atol, holds on one CPU only.

So these checks bound every element's difference by a multiple of one float32 ulp at the SCALE
of what is compared: the largest |desired| over the tensor (for gradients, activations and
log-probs the terms are of that order), or a scale the caller gives (for a scalar loss, the sum
of its terms' magnitudes divided by the same normaliser). `ulps` is what the caller allows for
the depth of the computation: a few for one short sum, hundreds for a backward pass through a
network, always far below what a real error costs (a dropped token, a wrong normaliser or a
wrong layout moves the values by a percent of the scale or more, 1e5 ulps).

Set GRPO_JAX_TOLERANCE_LOG=FILE to append each check's measured margin (worst difference in ulps
of the scale, against the bound) to FILE: how far each test is from its bound on this machine.
"""

import os

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7: one ulp at 1.0


def assert_close(actual, desired, *, ulps: float, scale=None, err_msg: str = "") -> None:
    """|actual - desired| <= ulps * EPS32 * scale, elementwise.

    Args:
      actual, desired: arrays (or scalars) of the same shape.
      ulps: allowed difference in float32 ulps at `scale`.
      scale: the magnitude the rounding follows: a number, or an array of desired's shape (one
        scale per element, e.g. each sum's sum of |terms|); default max|desired| over the tensor.
      err_msg: names what is compared.
    """
    a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    if a.shape != d.shape:
        raise AssertionError(f"{err_msg}: shapes differ, {a.shape} vs {d.shape}")
    scale = np.max(np.abs(d), initial=0.0) if scale is None else np.asarray(scale, np.float64)
    bound = ulps * EPS32 * scale
    diff = np.abs(a - d)
    with np.errstate(divide="ignore", invalid="ignore"):
        used = np.where(diff == 0, 0.0, diff / bound)  # the share of the bound each one uses
    worst = int(np.argmax(used)) if used.size else 0
    worst_ulps = float(used.flat[worst] * ulps) if used.size else 0.0
    _log(err_msg, worst_ulps, ulps)
    if not np.all(diff <= bound):  # also fails on NaN
        bad = ~(diff <= bound)
        raise AssertionError(
            f"{err_msg}: {int(bad.sum())} of {a.size} elements differ by more than {ulps:g} ulps "
            f"of their scale (max scale {float(np.max(scale)):.4g}); the worst by "
            f"{float(diff.flat[worst]):.3g} ({worst_ulps:.0f} ulps)"
        )


def assert_trees_close(
    actual, desired, *, ulps: float, floor: float = 1e-3, err_msg: str = "", leaf_ulps=None
) -> None:
    """assert_close on every leaf of two pytrees of the same structure, each at its own scale,
    but at least `floor` times the largest leaf's: a leaf that is zero or tiny on one side (a
    saturated softmax gives the keys an exactly zero gradient on one path and rounding noise on
    the other) still carries the rounding of the computation the whole tree comes from.
    `leaf_ulps` maps a leaf's path (`jax.tree_util.keystr`) to its own bound instead of `ulps`."""
    got = jax.tree_util.tree_leaves_with_path(actual)
    want = jax.tree_util.tree_leaves_with_path(desired)
    assert [p for p, _ in got] == [p for p, _ in want], f"{err_msg}: tree structures differ"
    leaf_ulps = dict(leaf_ulps or {})
    unknown = set(leaf_ulps) - {jax.tree_util.keystr(p) for p, _ in want}
    assert not unknown, f"{err_msg}: leaf_ulps names no leaf: {sorted(unknown)}"
    tree_scale = max(float(np.max(np.abs(np.asarray(d)), initial=0.0)) for _, d in want)
    for (path, a), (_, d) in zip(got, want, strict=True):
        scale = max(float(np.max(np.abs(np.asarray(d)), initial=0.0)), floor * tree_scale)
        key = jax.tree_util.keystr(path)
        assert_close(a, d, ulps=leaf_ulps.get(key, ulps), scale=scale, err_msg=err_msg + key)


def _log(what: str, worst_ulps: float, ulps: float) -> None:
    path = os.environ.get("GRPO_JAX_TOLERANCE_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a") as f:
        f.write(f"{worst_ulps / ulps:.3f}\t{worst_ulps:.1f}\t{test}\t{what}\n")
