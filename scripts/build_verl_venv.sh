#!/usr/bin/env bash
# Builds (or finds, when already built) the venv that holds verl 0.9.1 as released, with the
# dependencies its own pins allow, for the parity tests (tests/reference.py runs verl there, in a
# worker process, and the tests compare its outputs with grpo_jax's in the project's venv). The
# project's venv never installs verl, so its dependencies are not bound by verl's pins.
#
# Pins: verl 0.9.1 with transformers 5.9.0 (the version verl's own cpu/vllm extras pin; its base
# requirement is >=5.5.3,<5.11), math-verify 0.9.0 (verl's `math` extra, for the math-verify
# scorer), and the CPU build of torch 2.13.0 (a local wheel; verl itself pins no torch, and an
# unpinned one resolves to a multi-GB CUDA build). About 1.9 GB and 2 min to build; cached under
# ${GRPO_JAX_CACHE:-~/.cache/grpo_jax} (scripts/cached_venv.sh).
#
# Usage: bash scripts/build_verl_venv.sh   -> prints the venv's python path on stdout (only that).
set -euo pipefail
source "$(dirname "$0")/cached_venv.sh"
cached_venv verl \
  "import verl, torch, transformers; from verl.trainer.ppo import core_algos; print('verl', verl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" \
  "torch==2.13.0 verl==0.9.1 transformers==5.9.0 math-verify==0.9.0 mathruler==0.1.0"
