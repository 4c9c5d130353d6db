"""Importing grpo_jax.loss / grpo_jax.advantage pulls in no heavy framework.

Each check runs in a fresh interpreter, because this test process has already imported others.
"""

import os
import pathlib
import subprocess
import sys

import pytest

FORBIDDEN = ("flax", "transformers", "tensorflow_datasets", "tensorflow", "vllm", "torch")
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
_PROBE = """
import sys
import {module}
print(sorted({{m.split(".")[0] for m in sys.modules}} & set({forbidden!r})))
"""


def _imported_frameworks(module):
    """Runs `import <module>` in a fresh interpreter and returns the forbidden top-level names."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module, forbidden=FORBIDDEN)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["grpo_jax.loss", "grpo_jax.advantage", "grpo_jax"])
def test_import_pulls_in_no_heavy_framework(module):
    assert _imported_frameworks(module) == "[]"


def test_probe_detects_a_forbidden_import():
    """The probe itself can fail: flax imported next to the module is reported."""
    assert _imported_frameworks("grpo_jax.loss, flax") == "['flax']"
