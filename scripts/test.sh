#!/usr/bin/env bash
# The project's test command (README and .ci/run run exactly this).
# Installs grpo_jax with its test dependencies, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt -e .
python -m pytest -q -ra tests "$@"
