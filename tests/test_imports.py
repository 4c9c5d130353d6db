"""Importing grpo_jax.loss / grpo_jax.advantage pulls in no heavy framework.

Each check runs in a fresh interpreter, because this test process has already imported others.
"""

import os
import pathlib
import shutil
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


@pytest.mark.parametrize("module", ["grpo_jax.loss", "grpo_jax.logprobs", "grpo_jax.advantage", "grpo_jax"])
def test_import_pulls_in_no_heavy_framework(module):
    assert _imported_frameworks(module) == "[]"


def test_probe_detects_a_forbidden_import():
    """The probe itself can fail: flax imported next to the module is reported."""
    assert _imported_frameworks("grpo_jax.loss, flax") == "['flax']"


def test_a_regular_install_imports_every_module(tmp_path):
    """`pip install .` (not editable) ships every subpackage: each module of the source tree
    imports from the installed copy, with the checkout out of the path."""
    target, src = tmp_path / "site", tmp_path / "src"
    # A copy of what the project ships: the build writes into its source tree.
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(pathlib.Path(_ROOT, name), src / name)
    shutil.copytree(pathlib.Path(_ROOT, "grpo_jax"), src / "grpo_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    source = sorted(
        ".".join(p.relative_to(_ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in pathlib.Path(_ROOT, "grpo_jax").rglob("*.py")
    )
    probe = (
        "import importlib, sys\n"
        f"names = {source!r}\n"
        "mods = [importlib.import_module(n) for n in names]\n"
        "print(all(m.__file__.startswith(sys.argv[1]) for m in mods), len(mods))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split() == ["True", str(len(source))], out.stderr[-2000:]
