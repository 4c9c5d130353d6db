#!/usr/bin/env bash
# The GPU-only checks in one go; one JSON line per check on stdout ("check": its name).
#
#   vllm_push  benchmarks/bench_vllm_push.py: random Qwen2.5-0.5B-shaped weights in bf16, pushed
#              to a vLLM server by disk export + reload and over NCCL (weight_transfer="nccl"),
#              with the greedy outputs of both compared. Needs VLLM_PY (a GPU vLLM venv's python).
#   sampler    benchmarks/bench_sampler.py --size qwen2.5-0.5b --jax-only --dtype bfloat16.
#   e2e        benchmarks/bench_e2e.py --jax-only --dtype bfloat16: whole GRPO steps of train.py
#              (SmolLM2-135M, GSM8K from ../shared/data/gsm8k).
#
# Without a GPU (JAX's default backend is not "gpu") it prints one line saying so and exits 0.
# Exit status 1 when a check failed; its stderr is in $GPU_CHECK_LOGS/<check>.log.
#
# Usage: VLLM_PY=$HOME/vllm-venv/bin/python bash scripts/gpu_check.sh
# Env:   GPU_CHECK_TIMEOUT (seconds per check, default 900), GPU_CHECK_LOGS (default: a temp dir).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

backend=$(python -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo "unavailable")
if [[ "$backend" != "gpu" ]]; then
  echo "{\"check\": \"gpu\", \"skipped\": \"no GPU: JAX's default backend is '$backend'\"}"
  exit 0
fi
logs=${GPU_CHECK_LOGS:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$logs"
limit=${GPU_CHECK_TIMEOUT:-900}
failed=0

# check NAME CMD...: runs CMD and prints its JSON result (its whole stdout) as one line.
check() {
  local name=$1
  shift
  timeout "$limit" "$@" >"$logs/$name.out" 2>"$logs/$name.log"
  python - "$name" "$?" "$logs" <<'EOF' || failed=1
import json, sys
name, rc, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = open(f"{logs}/{name}.out").read()
result = None
if rc == 0 and "{" in out:
    start = 0 if out.startswith("{") else out.find("\n{") + 1
    try:
        result = json.JSONDecoder().raw_decode(out[start:])[0]
    except ValueError:
        pass
if result is None:
    why = "timed out" if rc == 124 else f"exit status {rc}" if rc else "no JSON on stdout"
    result = {"error": why, "log": f"{logs}/{name}.log"}
print(json.dumps({"check": name, **{k: v for k, v in result.items() if k != "check"}}))
sys.exit(1 if "error" in result else 0)
EOF
}

if [[ -n "${VLLM_PY:-}" ]]; then
  # JAX and vLLM share the GPU: JAX takes 30 %, vLLM --gpu-memory-utilization 0.3.
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 check vllm_push \
    python benchmarks/bench_vllm_push.py --python "$VLLM_PY" --gpu-memory-utilization 0.3
else
  echo '{"check": "vllm_push", "skipped": "set VLLM_PY to the python of a GPU vLLM venv"}'
fi
check sampler python benchmarks/bench_sampler.py --size qwen2.5-0.5b --jax-only --dtype bfloat16
check e2e python benchmarks/bench_e2e.py --jax-only --dtype bfloat16 --steps 3
echo "gpu_check: logs in $logs" >&2
exit "$failed"
