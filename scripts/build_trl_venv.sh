#!/usr/bin/env bash
# Builds (or finds, when already built) the venv of the peer trainer that benchmarks/bench_e2e.py
# measures grpo_jax against: TRL's GRPOTrainer, on the CPU build of torch, with pinned versions
# (TRL 1.16.0, transformers 5.24.0, accelerate 1.13, datasets 5.2, torch 2.13.0 from the local
# CPU wheel: an unpinned torch resolves to a multi-GB CUDA build). About 1.8 GB; cached under
# ${GRPO_JAX_CACHE:-~/.cache/grpo_jax} (scripts/cached_venv.sh).
#
# Usage: bash scripts/build_trl_venv.sh   -> prints the venv's python path on stdout (only that).
set -euo pipefail
source "$(dirname "$0")/cached_venv.sh"
cached_venv trl \
  "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" \
  "torch==2.13.0 trl==1.16.0 transformers==5.24.0 accelerate==1.13.* datasets==5.2.*"
