"""Benchmark: grpo_jax's GRPO maths (jitted) against verl 0.9.1's PyTorch functions on the CPU.

Cases (float32, the same NumPy inputs on both sides; value and gradient where a loss is timed):

* ``policy_kl_loss/BxT``: vanilla PPO loss (clip-higher 0.2/0.28, dual clip 3, token-mean) plus
  0.001 * low_var_kl loss, value and gradient with respect to log_prob, at 256x1024 and
  4096x1024. verl: ``compute_policy_loss_vanilla`` + ``kl_penalty`` + ``agg_loss``, backward.
* ``logprobs_entropy/8x1024x32768``: per-token log-probs and entropy from logits, value and
  gradient of sum(g1 * logp + g2 * H) with respect to the logits, with the peak resident memory
  growth. grpo_jax: ``logprobs_and_entropy_chunked``; verl: ``logprobs_from_logits`` (its
  log_softmax path on CPU) and ``entropy_from_logits``.
* ``grpo_advantage/B``: GRPO outcome advantage for B = 4096 and 65536 rows x T = 1024, groups of
  8 rollouts. verl: ``compute_grpo_outcome_advantage`` (``grpo``, a Python loop) and
  ``compute_grpo_vectorized_outcome_advantage`` (``grpo_vectorized``), given uid strings as the
  trainer passes them; grpo_jax gets int32 group ids (mapping uids to ids is the data loader's
  job and is not timed).

Method (see shared/design/benchmarking.md): each framework runs in its own subprocess (torch's
OpenMP spin-waiting slows JAX in the same process), rounds alternate which goes first, every case
is warmed up (JIT compile, allocator) before timing, and the report gives the median, min and
max over rounds of each round's median time, plus ratios verl / grpo_jax of the medians. Both
workers run with the same environment, by default GLIBC_TUNABLES=glibc.malloc.hugetlb=1
(``--no-hugetlb`` to turn it off), and the load average at the end is reported: on a shared
machine absolute times drift, the ratios are the result.
Peak memory is the growth of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs)
over its RSS before the case, with the inputs already resident.

Run: ``python benchmarks/bench_core.py [--rounds 3]``; prints one JSON object. verl runs in its
own venv with its own pins (``scripts/build_verl_venv.sh``, built on first use and cached; or
``--verl-python``), grpo_jax in the current interpreter.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

POLICY_SHAPES = ((256, 1024), (4096, 1024))
LOGITS_SHAPE = (8, 1024, 32768)
ADV_ROWS = (4096, 65536)
ADV_T = 1024
GROUP = 8
CLIP_LOW, CLIP_HIGH, CLIP_C, KL_COEF = 0.2, 0.28, 3.0, 0.001
TARGETS = {"policy_kl_loss": 2.0, "grpo_advantage_vs_grpo": 20.0, "grpo_advantage_vs_vec": 2.0}


# ----------------------------------------------------------------------------------------------
# INPUTS (NumPy, identical for both frameworks)
# ----------------------------------------------------------------------------------------------


def _policy_inputs(b, t):
    rng = np.random.default_rng(0)
    lp = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    return {
        "log_prob": lp,
        "old_log_prob": lp - rng.normal(0.0, 0.3, (b, t)).astype(np.float32),
        "ref_log_prob": lp + rng.normal(0.0, 0.5, (b, t)).astype(np.float32),
        "advantages": rng.normal(0.0, 1.0, (b, t)).astype(np.float32),
        "response_mask": (rng.random((b, t)) < 0.9).astype(np.float32),
    }


def _logits_inputs():
    rng = np.random.default_rng(1)
    b, t, v = LOGITS_SHAPE
    logits = np.empty((b, t, v), np.float32)
    for i in range(b):  # row by row: never a float64 [B, T, V] temporary
        logits[i] = rng.standard_normal((t, v), dtype=np.float32) * 2.0
    return {
        "logits": logits,
        "labels": rng.integers(0, v, (b, t)).astype(np.int64),
        "g_lp": rng.normal(0, 1, (b, t)).astype(np.float32),
        "g_ent": rng.normal(0, 1, (b, t)).astype(np.float32),
    }


def _adv_inputs(b):
    rng = np.random.default_rng(2)
    rewards = np.zeros((b, ADV_T), np.float32)
    lengths = rng.integers(1, ADV_T + 1, b)
    rewards[np.arange(b), lengths - 1] = rng.integers(0, 2, b).astype(np.float32)
    mask = (np.arange(ADV_T)[None, :] < lengths[:, None]).astype(np.float32)
    group_ids = (np.arange(b) // GROUP).astype(np.int32)
    return {"rewards": rewards, "mask": mask, "group_ids": group_ids}


# ----------------------------------------------------------------------------------------------
# MEASUREMENT
# ----------------------------------------------------------------------------------------------


def _rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _time(fn, reps):
    """Median of `reps` timed calls after a warm-up call, and the peak RSS growth (bytes) over
    all calls including the warm-up (where JAX compiles and both frameworks first allocate)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    base = _rss_bytes("VmRSS")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"s": statistics.median(times), "peak_growth_bytes": _rss_bytes("VmHWM") - base}


# ----------------------------------------------------------------------------------------------
# WORKERS
# ----------------------------------------------------------------------------------------------


def _jax_worker(skip_logits):

    import jax
    import jax.numpy as jnp

    from grpo_jax import loss

    results = {}

    def policy_kl(lp, old, ref, adv, mask):
        pg, metrics = loss.compute_policy_loss(
            old, lp, adv, mask, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH
        )
        kl = loss.agg_loss(loss.kl_penalty(lp, ref, "low_var_kl"), mask, "token-mean")
        return pg + KL_COEF * kl, metrics

    policy_step = jax.jit(jax.value_and_grad(policy_kl, has_aux=True))
    for b, t in POLICY_SHAPES:
        x = {k: jnp.asarray(v) for k, v in _policy_inputs(b, t).items()}
        args = (x["log_prob"], x["old_log_prob"], x["ref_log_prob"], x["advantages"])
        args += (x["response_mask"],)
        results[f"policy_kl_loss/{b}x{t}"] = _time(
            lambda args=args: jax.block_until_ready(policy_step(*args)), reps=20 if b < 1024 else 7
        )
        del x, args

    def lp_ent(z, labels, g_lp, g_ent):
        lp, ent = loss.logprobs_and_entropy_chunked(z, labels, chunk_size=1024)
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent)

    lp_ent_step = jax.jit(jax.value_and_grad(lp_ent))
    if skip_logits:
        return _advantage_cases_jax(results)
    host = _logits_inputs()
    x = {k: jnp.asarray(v.astype(np.int32) if k == "labels" else v) for k, v in host.items()}
    del host
    args = (x["logits"], x["labels"], x["g_lp"], x["g_ent"])
    b, t, v = LOGITS_SHAPE
    results[f"logprobs_entropy/{b}x{t}x{v}"] = _time(
        lambda args=args: jax.block_until_ready(lp_ent_step(*args)), reps=2
    )
    del x, args
    return _advantage_cases_jax(results)


def _advantage_cases_jax(results):
    import functools

    import jax
    import jax.numpy as jnp

    from grpo_jax import advantage

    for b in ADV_ROWS:
        # Already jitted inside; an outer jit would make XLA copy the returned pair apart.
        fn = functools.partial(advantage.compute_grpo_outcome_advantage, num_groups=b // GROUP)
        x = {k: jnp.asarray(v) for k, v in _adv_inputs(b).items()}
        results[f"grpo_advantage/{b}x{ADV_T}"] = _time(
            lambda fn=fn, x=x: jax.block_until_ready(fn(x["rewards"], x["mask"], x["group_ids"])),
            reps=10 if b < 16384 else 5,
        )
        del x
    return results


def _verl_worker(skip_logits, threads):
    import torch
    from verl.trainer.ppo import core_algos
    from verl.utils import torch_functional as verl_F
    from verl.workers.config import ActorConfig

    torch.set_num_threads(threads)
    config = ActorConfig(
        strategy="fsdp",
        clip_ratio=CLIP_LOW,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=GROUP,
    )
    results = {}
    for b, t in POLICY_SHAPES:
        x = {k: torch.from_numpy(v) for k, v in _policy_inputs(b, t).items()}
        lp = x["log_prob"].clone().requires_grad_(True)

        def step(lp=lp, x=x):
            lp.grad = None
            pg, _ = core_algos.compute_policy_loss_vanilla(
                x["old_log_prob"], lp, x["advantages"], x["response_mask"], "token-mean", config
            )
            kld = core_algos.kl_penalty(lp, x["ref_log_prob"], "low_var_kl")
            kl = core_algos.agg_loss(kld, x["response_mask"], "token-mean")
            (pg + KL_COEF * kl).backward()

        results[f"policy_kl_loss/{b}x{t}"] = _time(step, reps=20 if b < 1024 else 7)
        del x, lp

    def logprobs_entropy_case():  # inputs are freed when it returns
        x = {k: torch.from_numpy(v) for k, v in _logits_inputs().items()}
        logits = x["logits"].requires_grad_(True)

        def step():
            logits.grad = None
            lp = verl_F.logprobs_from_logits(logits, x["labels"])
            ent = verl_F.entropy_from_logits(logits)
            ((x["g_lp"] * lp).sum() + (x["g_ent"] * ent).sum()).backward()

        return _time(step, reps=1)

    b, t, v = LOGITS_SHAPE
    if not skip_logits:
        results[f"logprobs_entropy/{b}x{t}x{v}"] = logprobs_entropy_case()

    for b in ADV_ROWS:
        host = _adv_inputs(b)
        rewards, mask = torch.from_numpy(host["rewards"]), torch.from_numpy(host["mask"])
        index = np.array([f"uid-{g}" for g in host["group_ids"]], dtype=object)
        reps = 5 if b < 16384 else 2
        results[f"grpo_advantage/{b}x{ADV_T}"] = _time(
            lambda r=rewards, m=mask, i=index: core_algos.compute_grpo_outcome_advantage(r, m, i),
            reps=reps,
        )
        results[f"grpo_advantage_vectorized/{b}x{ADV_T}"] = _time(
            lambda r=rewards, m=mask, i=index: core_algos.compute_grpo_vectorized_outcome_advantage(
                r, m, i
            ),
            reps=reps,
        )
    return results


# ----------------------------------------------------------------------------------------------
# DRIVER
# ----------------------------------------------------------------------------------------------


def _run_worker(framework, args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if args.hugetlb:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    flags = ["--worker", framework, "--threads", str(args.threads)]
    if args.threads == 1:  # XLA:CPU's only switch: everything on the calling thread
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    elif args.threads != os.cpu_count():
        raise ValueError("--threads must be 1 or the number of CPUs (XLA:CPU has no other knob)")
    flags += ["--skip-logits"] if args.skip_logits else []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    python = sys.executable if framework == "jax" else args.verl_python
    out = subprocess.run(
        [python, os.path.abspath(__file__), *flags],
        capture_output=True,
        text=True,
        env=env,
        check=False,  # the error below carries the worker's stderr
    )
    if out.returncode != 0:
        raise RuntimeError(f"{framework} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(samples):
    times = [s["s"] for s in samples]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "peak_rss_growth_gb": round(max(s["peak_growth_bytes"] for s in samples) / 2**30, 3),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hugetlb",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run both workers with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge "
        "pages for malloc: fewer first-touch page faults on fresh [B, T] buffers)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="threads per framework: all CPUs (default) or 1 (fairer on a loaded machine, "
        "where torch's OpenMP spin-waiting suffers most)",
    )
    parser.add_argument(
        "--skip-logits", action="store_true", help="skip the 8x1024x32768 log-prob case"
    )
    parser.add_argument(
        "--verl-python",
        default=os.environ.get("GRPO_JAX_VERL_PYTHON", ""),
        help="interpreter of the verl 0.9.1 venv (default $GRPO_JAX_VERL_PYTHON, else "
        "scripts/build_verl_venv.sh builds or finds it)",
    )
    parser.add_argument("--worker", choices=("jax", "verl"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker and not args.verl_python:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        args.verl_python = subprocess.run(
            ["bash", os.path.join(repo, "scripts", "build_verl_venv.sh")],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    if args.worker:
        if args.worker == "jax":
            print(json.dumps(_jax_worker(args.skip_logits)))
        else:
            print(json.dumps(_verl_worker(args.skip_logits, args.threads)))
        return

    runs = {"jax": [], "verl": []}
    for r in range(args.rounds):
        for framework in ("jax", "verl") if r % 2 == 0 else ("verl", "jax"):
            runs[framework].append(_run_worker(framework, args))

    def collect(framework, case):
        return _summary([run[case] for run in runs[framework]])

    cases = {}
    for case in runs["jax"][0]:
        entry = {"grpo_jax": collect("jax", case), "verl": collect("verl", case)}
        entry["speedup_verl_over_grpo_jax"] = round(
            entry["verl"]["median_s"] / entry["grpo_jax"]["median_s"], 2
        )
        if case.startswith("grpo_advantage/"):
            vec = collect("verl", case.replace("grpo_advantage/", "grpo_advantage_vectorized/"))
            entry["verl_vectorized"] = vec
            entry["speedup_verl_vectorized_over_grpo_jax"] = round(
                vec["median_s"] / entry["grpo_jax"]["median_s"], 2
            )
        cases[case] = entry
    report = {
        "benchmark": "grpo_jax core vs verl 0.9.1 (torch), CPU, float32",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "rounds": args.rounds,
        "env": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1" if args.hugetlb else None},
        "threads_per_framework": args.threads,
        "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "stat": "median / min / max over rounds of per-round median times (s)",
        "targets_speedup": TARGETS,
        "cases": cases,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
