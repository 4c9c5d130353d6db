"""The reference machinery itself: a missing reference fails under CI, and the verl worker
evaluates expressions faithfully (values, gradients, errors)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import reference

_ONE_PARITY_TEST = "tests/test_verl_parity.py::test_rloo_advantage_matches_verl"


def _pytest(env_update):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GRPO_JAX_VERL_PYTHON")}
    env.update(env_update)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", _ONE_PARITY_TEST],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "python",
    [
        "/nonexistent/bin/python",  # the venv was never built
        sys.executable,  # an interpreter without verl: the worker's import fails
    ],
)
def test_missing_verl_fails_under_ci_and_skips_elsewhere(python):
    ci = _pytest({"CI": "true", "GRPO_JAX_VERL_PYTHON": python})
    assert ci.returncode == 1, ci.stdout
    # The fixture fails, so the test errors at setup: never a skip, never a pass.
    assert "1 error" in ci.stdout and "CI must run every verl parity test" in ci.stdout
    assert "verl parity: 1 error (not run)" in ci.stdout
    local = _pytest({"GRPO_JAX_VERL_PYTHON": python})
    assert local.returncode == 0, local.stdout
    assert "1 skipped" in local.stdout and "verl parity: 1 skipped" in local.stdout


def test_worker_values_gradients_and_errors(verl):
    x = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    cot = np.array([[1.0, 0.0], [2.0, 1.0]], np.float32)
    # d/dx sum(cot * x^2) = 2 x cot, and the NumPy input stays NumPy when asked.
    out = verl.run(
        (
            reference.fn("torch:mul")(reference.grad(x, "x"), reference.grad(x, "x")),
            reference.fn("numpy:asarray")(reference.keep_numpy(np.array(["a", "b"], object))),
        ),
        backward=[(0, cot)],
    )
    np.testing.assert_array_equal(out.value[0], x * x)
    np.testing.assert_array_equal(out.grads["x"], 2 * x * cot)
    assert out.value[1].tolist() == ["a", "b"]
    with pytest.raises(reference.WorkerError, match="ZeroDivisionError"):
        verl.run(reference.fn("operator:truediv")(1, 0))
    # The worker survives an error.
    assert verl.run(reference.fn("operator:add")(1, 2)).value == 3
