#!/usr/bin/env bash
# Runs tests under the XLA:CPU settings that change kernels and reduction orders on one machine,
# as if on other CPUs: the ISA XLA generates code for (AVX-512 -> AVX2 -> SSE4.2), one thread
# instead of two, and YNNPACK dots everywhere (the sampler's compile option, for every program).
# Usage: bash scripts/test_cpu_variants.sh [VARIANT ...] [-- PYTEST ARGS]
#   VARIANT: default isa-avx2 isa-sse42 one-thread ynnpack (all of them if none is named)
#   PYTEST ARGS default to the numerics-heavy files below.
# Each variant's result is one line at the end; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1-}" = "--" ] && shift
[ ${#variants[@]} -gt 0 ] || variants=(default isa-avx2 isa-sse42 one-thread ynnpack)
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/test_packing.py tests/test_loss.py tests/test_model.py
  tests/test_sharding.py tests/test_lora.py tests/test_train_step.py tests/test_multiprocess.py
  tests/test_hf_export.py tests/test_advantage.py tests/test_rollout_correction.py
  tests/test_algorithms_loop.py tests/test_sampler.py)
summary=()
status=0
for v in "${variants[@]}"; do
  prefix=()
  case "$v" in
    default) flags="" ;;
    isa-avx2) flags="--xla_cpu_max_isa=AVX2" ;;
    isa-sse42) flags="--xla_cpu_max_isa=SSE4_2" ;;
    one-thread) flags="--xla_cpu_multi_thread_eigen=false"; prefix=(taskset -c 0) ;;
    ynnpack) flags="--xla_cpu_experimental_ynn_fusion_type=dot" ;;
    *) echo "unknown variant $v (default isa-avx2 isa-sse42 one-thread ynnpack)" >&2; exit 2 ;;
  esac
  echo "=== $v: XLA_FLAGS='$flags' ${prefix[*]}"
  start=$SECONDS
  XLA_FLAGS="$flags" "${prefix[@]}" python -m pytest -q -p no:cacheprovider "${args[@]}" \
    | tee "/tmp/grpo_jax_variant_$v.log" | tail -n 15
  rc=${PIPESTATUS[0]}
  line=$(grep -E "^[0-9]+ (passed|failed)|passed|failed" "/tmp/grpo_jax_variant_$v.log" | tail -n 1)
  summary+=("$v: rc=$rc, $((SECONDS - start)) s: $line")
  [ "$rc" = 0 ] || status=1
done
printf '%s\n' "${summary[@]}"
exit $status
