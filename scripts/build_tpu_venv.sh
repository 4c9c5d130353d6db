#!/usr/bin/env bash
# A venv with libtpu, the TPU compiler, on top of the project's packages (--system-site-packages),
# for `plan.py --tpu_topology=...` on a machine without TPUs. Kept out of the project's own env:
# with libtpu installed, JAX looks for TPU hardware whenever JAX_PLATFORMS is unset.
# Prints the venv's python (export it as GRPO_JAX_TPU_PYTHON for tests/test_plan.py).
set -euo pipefail
JAX_VERSION=$(python -c "import jax; print(jax.__version__)")
LIBTPU=$(python - <<'PY'
import importlib.metadata as m
reqs = m.requires("jax") or []
print(next(r.split(";")[0].replace(" ", "") for r in reqs if r.startswith("libtpu") and "tpu" in r))
PY
)
DIR=${GRPO_JAX_CACHE:-$HOME/.cache/grpo_jax}/tpu-venv-jax${JAX_VERSION}
if [ ! -x "$DIR/bin/python" ] || ! "$DIR/bin/python" -c "import libtpu" 2>/dev/null; then
  python -m venv --system-site-packages "$DIR" >&2
  "$DIR/bin/pip" install -q "$LIBTPU" >&2
fi
echo "$DIR/bin/python"
