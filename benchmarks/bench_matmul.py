"""Benchmark: the update's dots in JAX (XLA:CPU, its dot back-ends) and in torch, fp32 and bf16.

The update of SmolLM2-135M on packed 4,096-token micro-batches is mostly three dot shapes per
layer: the MLP's [T, D] x [D, F] (D=576, F=1536, T=4096), its two gradients (the input's
[T, F] x [F, D] and the weight's [D, T] x [T, F], contracted over the tokens) and the attention
projections; plus a square 2048^3 dot as the machine's reference peak. Each shape runs in:

- JAX, float32; bfloat16 inputs with float32 accumulation (`preferred_element_type`, what
  `model.dtype=bfloat16` computes: bf16 operands, f32 results); plain bfloat16 (bf16 out), each
  compiled with XLA:CPU's default dots and with each alternative back-end this jaxlib accepts
  (per-program `compiler_options`: YNNPACK's dot fusion, oneDNN); the weight gradient's shape also
  as grpo_jax computes it in bf16 (grpo_jax/models/matmul.py: the activations' transpose written
  row-major first, then the canonical dot);
- torch (TRL's venv, scripts/build_trl_venv.sh, its own process): float32, bfloat16 (`a @ b` on
  bf16 tensors, what torch's bf16 autocast runs), both with torch's default threads.

Both sides use every core of the machine. The JSON gives GFLOP/s (median of --reps timed calls,
each call repeated to last at least 0.2 s) and, per shape and dtype, JAX's best back-end over
torch. On a CPU with AMX or AVX512-BF16 torch's bf16 runs on oneDNN's bf16 kernels; the question
it answers is how close XLA's bf16 path gets to them and with which option.

    python benchmarks/bench_matmul.py                 # every shape, JAX and torch
    python benchmarks/bench_matmul.py --jax-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, M, K, N, transpose_a): out[M, N] = A[M, K] @ B[K, N]; transpose_a stores A as [K, M]
# and contracts its first axis (a weight gradient: activations^T @ output gradients).
SHAPES = (
    ("square_2048", 2048, 2048, 2048, False),
    ("mlp_up_4096x576x1536", 4096, 576, 1536, False),
    ("mlp_down_grad_in_4096x1536x576", 4096, 1536, 576, False),
    ("mlp_weight_grad_576x4096x1536", 576, 4096, 1536, True),
)
# XLA:CPU's dot back-ends, as per-program compiler options; a jaxlib that rejects one skips it.
BACKENDS = {
    "xla_default": {},
    "ynnpack": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_use_onednn": True},
}


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))


def _time(call, reps: int) -> float:
    """Median seconds of one call; each timed sample repeats the call to last >= 0.2 s."""
    call()
    t0 = time.perf_counter()
    call()
    one = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, int(0.2 / one))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def jax_side(reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, REPO)
    from grpo_jax.models import matmul

    out = {"jax": jax.__version__, "backends_rejected": {}}
    rng = np.random.default_rng(0)
    modes = {
        "float32": (jnp.float32, None),
        "bf16_in_f32_acc": (jnp.bfloat16, jnp.float32),
        "bfloat16": (jnp.bfloat16, None),
    }
    rates = {}
    for name, m, k, n, transpose_a in SHAPES:
        a_np = rng.standard_normal((k, m) if transpose_a else (m, k), dtype=np.float32)
        b_np = rng.standard_normal((k, n), dtype=np.float32)
        for mode, (dtype, acc) in modes.items():
            a, b = jnp.asarray(a_np, dtype), jnp.asarray(b_np, dtype)
            dims = (((0,), (0,)), ((), ())) if transpose_a else (((1,), (0,)), ((), ()))

            def dot(x, y, dims=dims, acc=acc):
                return jax.lax.dot_general(x, y, dims, preferred_element_type=acc)

            for backend, options in BACKENDS.items():
                if backend in out["backends_rejected"]:
                    continue
                try:
                    f = jax.jit(dot, compiler_options=options or None).lower(a, b).compile()
                except Exception as e:  # noqa: BLE001 - an option this jaxlib lacks
                    out["backends_rejected"][backend] = str(e).splitlines()[0][:200]
                    continue
                s = _time(lambda f=f: f(a, b).block_until_ready(), reps)
                rates.setdefault(name, {}).setdefault(mode, {})[backend] = 2 * m * k * n / s / 1e9
            if transpose_a and acc is not None:  # grpo_jax's weight gradient: x^T copied first
                f = jax.jit(lambda x, y, acc=acc: jnp.dot(
                    matmul._row_major_transpose(x), y, preferred_element_type=acc))
                s = _time(lambda f=f: f(a, b).block_until_ready(), reps)
                rates[name][mode]["grpo_jax_row_major_transpose"] = 2 * m * k * n / s / 1e9
    out["gflop_s"] = rates
    return out


def torch_side(reps: int) -> dict:
    import torch

    out = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "mkldnn_bf16": bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)())}
    gen = torch.Generator().manual_seed(0)
    rates = {}
    for name, m, k, n, transpose_a in SHAPES:
        a32 = torch.randn((k, m) if transpose_a else (m, k), generator=gen)
        b32 = torch.randn((k, n), generator=gen)
        for mode, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            a, b = a32.to(dtype), b32.to(dtype)
            if transpose_a:
                def call(a=a, b=b):
                    return a.t() @ b
            else:
                def call(a=a, b=b):
                    return a @ b
            with torch.no_grad():
                s = _time(call, reps)
            rates.setdefault(name, {})[mode] = 2 * m * k * n / s / 1e9
    out["gflop_s"] = rates
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--jax-only", action="store_true")
    p.add_argument("--trl-python", default=os.environ.get("GRPO_JAX_TRL_PYTHON", ""))
    p.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # a child process: one side, JSON on stdout
        print(json.dumps(jax_side(args.reps) if args.side == "jax" else torch_side(args.reps)))
        return

    def child(python: str, side: str) -> dict:
        r = subprocess.run([python, os.path.abspath(__file__), f"--side={side}",
                            f"--reps={args.reps}"], capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])

    jax_r = child(sys.executable, "jax")
    result = {
        "benchmark": "the update's dot shapes, JAX (XLA:CPU back-ends) vs torch, fp32 and bf16",
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cpu_flags": _cpu_flags(), "cores": os.cpu_count()},
        "shapes": {name: {"M": m, "K": k, "N": n, "contract_first_axis_of_a": t}
                   for name, m, k, n, t in SHAPES},
        "jax": jax_r,
    }
    if not args.jax_only:
        if not args.trl_python:
            args.trl_python = subprocess.run(
                ["bash", os.path.join(REPO, "scripts", "build_trl_venv.sh")],
                capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        torch_r = child(args.trl_python, "torch")
        result["torch"] = torch_r
        ratios = {}
        for name, modes in jax_r["gflop_s"].items():
            for mode, torch_mode in (("float32", "float32"), ("bf16_in_f32_acc", "bfloat16"),
                                     ("bfloat16", "bfloat16")):
                best = max(modes[mode], key=modes[mode].get)
                ratios.setdefault(name, {})[mode] = {
                    "jax_best_backend": best,
                    "jax_over_torch": modes[mode][best] / torch_r["gflop_s"][name][torch_mode],
                }
        result["jax_best_over_torch"] = ratios
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
