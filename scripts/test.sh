#!/usr/bin/env bash
# The project's test command (README and .ci/run run exactly this).
# Installs grpo_jax with its test dependencies, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt -e .
# verl 0.9.1 for the parity tests (tests/test_verl_parity.py): its core maths imports on CPU torch
# without its heavy extras; ray, tensordict, omegaconf and codetiming are what `import verl` needs.
python -m pip install -q --no-deps verl==0.9.1
python -m pip install -q ray tensordict omegaconf codetiming
export GRPO_JAX_VLLM_PYTHON="${GRPO_JAX_VLLM_PYTHON-$(bash scripts/build_vllm_venv.sh)}"  # vLLM sidecar venv, cached in ~/.cache/grpo_jax; empty if the build fails (tests/test_vllm.py then fails under CI=true)
python -m pytest -q -ra tests "$@"
