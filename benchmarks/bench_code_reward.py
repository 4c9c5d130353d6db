r"""Benchmark: reward seconds per step for a code batch, grpo_jax vs verl 0.9.1, side by side.

Workload: 64 completions for 8 simple stdin/stdout problems (sum of integers, reverse a line,
count words, largest integer, sort integers, count vowels, palindrome test, n-th Fibonacci
number) with 10 tests each, generated deterministically. Each problem gets 8 completions, a
realistic mix: correct ones (plain code, in a ```python block after some prose, a `main()`
under `if __name__ == "__main__":`), partially correct ones (right on some of the tests),
a wrong answer, a runtime error and a syntax error; one partially correct completion of the
first problem instead loops forever on one of its tests (an infinite loop costs verl's timeouts,
5 s for the first pass and 10 s for the looping test in the second, on both sides). Every row
has data_source "codecontests", so both sides route it to prime_code with continuous=True,
verl's timeouts unchanged.

Timed (wall seconds of one step's scoring of the 64, median of --repeats, rounds alternating):
  * grpo_jax, as the trainer runs it: `loading.reward_fn(RewardConfig())` (reward.fn
    "grpo_jax.rewards.scorers:default_compute_score") through `functions.score_batch` over a
    `rewards.pool.Pool` of reward.num_workers processes with reward.timeout_s (the config's
    defaults: 2 workers, 30 s; --workers adds other counts). The pool lives across steps in the
    trainer, so each pool is started and warmed (its function loaded) before the timing.
  * verl 0.9.1 in its venv ($GRPO_JAX_VERL_PYTHON), `verl.utils.reward_score.
    default_compute_score` on the same (data_source, completion, ground truth):
    - "sequential": one call after the other in one process (the legacy naive reward manager's
      loop, verl/workers/reward_manager/naive.py).
    - "reward_loop": what verl 0.9.1's reward loop does (experimental/reward_loop/
      reward_loop.py): reward.num_workers worker processes (Ray actors there, spawned and
      warmed here before the timing), the batch padded to a multiple of the worker count and
      cut into one chunk each, and each worker scoring its chunk's items concurrently with
      `loop.run_in_executor(None, compute_score)` (the naive manager's run_single: the default
      thread pool, min(32, CPUs + 4) threads). Same worker counts as grpo_jax's.
    - "prime" (--verl-modes prime): the legacy prime reward manager's `run_reward_scoring`
      (a ProcessPoolExecutor started per batch, here with the worker count instead of its 64).

Scores of every side are compared with verl's sequential ones (the count that differ).

--overlap adds the reward seconds a step waits after generation when rows are scored as they
finish (reward.overlap_with_rollout, "on") or all after generation ("off"), for the config's
worker count. Generation is a real finish schedule replayed: SmolLM2-135M-Instruct (Q4_1 GGUF,
float32) through the paged engine (rollout.max_num_seqs --overlap-slots) on the first 16 GSM8K
train questions x n=4 = 64 rows, at most 256 new tokens, temperature 1, in a process of its own,
records when each row finished (sample_paged's `finished` hook; the second call, the first
compiles). Each repeat then replays that schedule with sleeps: row i's code completion is handed
to `functions.Scoring.add` at row i's finish time ("on"), and at the end of generation the
wait for `Scoring.result` ("on") or `functions.score_batch` ("off") is timed. The replay leaves
the CPU to the reward workers, as when an accelerator generates; on a CPU-only machine
generation and scoring share the cores. verl's agent loop scores each trajectory as it ends
too; its columns above are its batch scoring, as before.

    python benchmarks/bench_code_reward.py                      # the config's 2 workers
    python benchmarks/bench_code_reward.py --workers 1 \
        --out benchmarks/results/code_reward_2026-12-04.json    # also 1 worker: ~12 minutes
    python benchmarks/bench_code_reward.py --overlap --verl-modes sequential \
        --out benchmarks/results/code_reward_2026-12-05_overlap.json   # ~20 minutes
"""

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
VERL_PYTHON = os.environ.get(
    "GRPO_JAX_VERL_PYTHON", "/root/.cache/grpo_jax/verl-venv-346cb6873efd/bin/python"
)
DATA_SOURCE = "codecontests"
TESTS = 10

# ---------------------------------------------------------------------------------------------
# The workload: problems (reference, input generator) and completions of each kind.


def _ints(rng, lo=-50, hi=50, count=None, zero=False):
    count = count or rng.randint(1, 8)
    values = [rng.randint(lo, hi) for _ in range(count)]
    return [v if zero or v != 0 else 7 for v in values]


_WORDS = "alpha beta gamma delta level radar noon kayak apple queue tree sky".split()


def _line(rng):
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))


# name: (reference on the input text, input generator, completions as (kind, code))
PROBLEMS = {
    "sum": (
        lambda s: str(sum(map(int, s.split()))),
        lambda rng, i: " ".join(map(str, _ints(rng) if i != 7 else [3, 0, 5])),
        [
            ("partial", "print(sum(abs(int(x)) for x in input().split()))"),
            ("partial", "a = list(map(int, input().split()))\nprint(sum(a[:3]))"),
            ("wrong", "print(sum(map(int, input().split())) + 1)"),
            ("runtime_error", "a = input().split()\nprint(a[0] + a[1])"),
            ("syntax_error", "print(sum(map(int, input().split()))"),
        ],
    ),
    "reverse": (
        lambda s: s[::-1],
        lambda rng, i: _line(rng),
        [
            ("partial", "print(' '.join(input().split()[::-1]))"),
            ("partial", "s = input()\nprint(s[::-1] if len(s) < 15 else s)"),
            ("wrong", "print(input())"),
            ("runtime_error", "s = input()\nprint(s[len(s)] + s[::-1])"),
            ("syntax_error", "s = input(\nprint(s[::-1])"),
        ],
    ),
    "words": (
        lambda s: str(len(s.split())),
        lambda rng, i: _line(rng),
        [
            ("partial", "print(len(set(input().split())))"),
            ("partial", "print(min(len(input().split()), 3))"),
            ("wrong", "print(len(input()))"),
            ("runtime_error", "print(len(input().split()) / 0)"),
            ("syntax_error", "print len(input().split())"),
        ],
    ),
    "max": (
        lambda s: str(max(map(int, s.split()))),
        lambda rng, i: " ".join(map(str, _ints(rng))),
        [
            ("partial", "a = list(map(int, input().split()))\nprint(max(a[0], a[-1]))"),
            ("partial", "print(max(map(abs, map(int, input().split()))))"),
            ("wrong", "print(min(map(int, input().split())))"),
            ("runtime_error", "a = sorted(map(int, input().split()))\nprint(a[len(a)])"),
            ("syntax_error", "print(max(map(int, input().split()))))"),
        ],
    ),
    "sort": (
        lambda s: " ".join(map(str, sorted(map(int, s.split())))),
        lambda rng, i: " ".join(map(str, _ints(rng, 0, 99, zero=True))),
        [
            ("partial", "print(' '.join(sorted(input().split())))"),
            ("partial", "a = list(map(int, input().split()))\nprint(*a)"),
            ("wrong", "print(*sorted(map(int, input().split()), reverse=True), 0)"),
            ("runtime_error", "a = list(map(int, input().split()))\na.sort(key=len)\nprint(*a)"),
            ("syntax_error", "for x in sorted(map(int, input().split()))\n    print(x)"),
        ],
    ),
    "vowels": (
        lambda s: str(sum(c in "aeiou" for c in s)),
        lambda rng, i: _line(rng),
        [
            ("partial", "print(sum(input().count(c) for c in 'aeio'))"),
            ("partial", "s = input()\nprint(sum(c in 'aeiouy' for c in s))"),
            ("wrong", "print(sum(c not in 'aeiou' for c in input()))"),
            ("runtime_error", "import vowels\nprint(vowels.count(input()))"),
            ("syntax_error", "print(sum(c in 'aeiou' for c in input())"),
        ],
    ),
    "palindrome": (
        lambda s: "YES" if s == s[::-1] else "NO",
        lambda rng, i: rng.choice(_WORDS[4:8]) if i % 2 else rng.choice(_WORDS),
        [
            ("partial", "s = input()\nprint('YES' if s[0] == s[-1] else 'NO')"),
            ("partial", "print('YES')"),
            ("wrong", "s = input()\nprint('yes' if s == s[::-1] else 'no')"),
            ("runtime_error", "s = input()\nprint('YES' if s == reversed(s)[0] else 'NO')"),
            ("syntax_error", "s = input()\nif s == s[::-1]: print('YES') else: print('NO')"),
        ],
    ),
    "fibonacci": (
        lambda s: str(_fib(int(s))),
        lambda rng, i: str(rng.randint(0, 40)),
        [
            (
                "partial",
                "n = int(input())\na, b = 0, 1\nfor _ in range(min(n, 25)): a, b = b, a + b\n"
                "print(a)",
            ),
            (
                "partial",
                "n = int(input())\na, b = 0, 1\nfor _ in range(n): a, b = b, a + b\n"
                "print(a if n < 12 else a - 1)",
            ),  # fmt: skip
            (
                "wrong",
                "n = int(input())\na, b = 0, 1\nfor _ in range(n): a, b = b, a + b\nprint(b)",
            ),  # fmt: skip
            ("runtime_error", "n = int(input())\nprint([0, 1][n])"),
            ("syntax_error", "n = int(input())\nprint(fib(n)))"),
        ],
    ),
}

# Correct programs (three per problem, in the three styles below).
CORRECT = {
    "sum": "print(sum(map(int, input().split())))",
    "reverse": "print(input()[::-1])",
    "words": "print(len(input().split()))",
    "max": "print(max(map(int, input().split())))",
    "sort": "print(*sorted(map(int, input().split())))",
    "vowels": "s = input()\nprint(sum(c in 'aeiou' for c in s))",
    "palindrome": "s = input()\nprint('YES' if s == s[::-1] else 'NO')",
    "fibonacci": "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
}
# Loops forever on a 0 (the sum problem's test 7 holds one), otherwise right.
LOOPS = (
    "nums = list(map(int, input().split()))\ni = total = 0\nwhile i < len(nums):\n"
    "    total += nums[i]\n    if nums[i] != 0:\n        i += 1\nprint(total)"
)


def _fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _styled(code: str, style: int) -> str:
    """A completion as a model writes it: bare code, prose around a ```python block, or a
    main() under `if __name__ == "__main__":` in a block."""
    if style == 0:
        return code
    if style == 1:
        return f"Read the input and compute the answer.\n\n```python\n{code}\n```\n\nDone."
    body = "".join(f"    {line}\n" for line in code.split("\n"))
    main = f'def main():\n{body}\n\nif __name__ == "__main__":\n    main()'
    return f"Here is my solution:\n```python\n{main}\n```"


def workload(seed: int = 0) -> list[dict]:
    """64 rows: {"problem", "kind", "data_source", "completion", "ground_truth"}."""
    rng = random.Random(seed)
    rows = []
    for name, (reference, make_input, others) in PROBLEMS.items():
        inputs = [make_input(rng, i) for i in range(TESTS)]
        truth = json.dumps(
            {"inputs": [x + "\n" for x in inputs], "outputs": [reference(x) + "\n" for x in inputs]}
        )
        kinds = [("correct", CORRECT[name])] * 3 + list(others)
        if name == "sum":  # the one completion that times out (on test 7)
            kinds[3] = ("timeout", LOOPS)
        for j, (kind, program) in enumerate(kinds):
            rows.append(
                {
                    "problem": name,
                    "kind": kind,
                    "data_source": DATA_SOURCE,
                    "completion": _styled(program, j % 3),
                    "ground_truth": truth,
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------
# grpo_jax's side, in this process (its reward workers are processes of their own).


@contextlib.contextmanager
def warm_pool(rows, workers: int):
    """(config, reward_fn, examples, solutions, pool) as the trainer sets them up, the pool
    warmed: every worker has loaded the function (a correct completion, one call each)."""
    from grpo_jax import config as config_lib
    from grpo_jax import loading
    from grpo_jax.data import prompts as prompts_lib
    from grpo_jax.rewards import functions as reward_fns
    from grpo_jax.rewards import pool as reward_pool

    cfg = config_lib.RewardConfig(num_workers=workers)
    reward_fn = loading.reward_fn(cfg)
    examples = [
        prompts_lib.Example(prompt="", ground_truth=r["ground_truth"], data_source=r["data_source"])
        for r in rows
    ]
    solutions = [r["completion"] for r in rows]
    with reward_pool.Pool(cfg.num_workers, timeout_s=cfg.timeout_s) as pool:
        reward_fns.score_batch(reward_fn, solutions[:1] * workers, examples[:1] * workers,
                               pool=pool)  # fmt: skip
        yield cfg, reward_fn, examples, solutions, pool


def grpo_jax_side(rows, workers: int, repeats: int) -> dict:
    from grpo_jax.rewards import functions as reward_fns

    times, result = [], None
    with warm_pool(rows, workers) as (cfg, reward_fn, examples, solutions, pool):
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = reward_fns.score_batch(reward_fn, solutions, examples, pool=pool)
            times.append(time.perf_counter() - t0)
        restarts = pool.restarts
    return {
        "times": times,
        "scores": list(result.scores_B),
        "num_lost": result.num_lost,
        "num_errors": result.num_errors,
        "restarts": restarts,
        "timeout_s": cfg.timeout_s,
    }


# ---------------------------------------------------------------------------------------------
# --overlap: a real generation's finish schedule (its own process), replayed against the scoring.

SCHEDULE = {"prompts": 16, "n": 4, "max_new_tokens": 256, "seed": 1}


def finish_schedule(max_num_seqs: int) -> dict:
    """When each of the 64 rows of SmolLM2-135M-Instruct's paged rollout of GSM8K prompts
    finished (seconds from the call's start), in the second call (the first compiles)."""
    import bench_rollout  # this directory's: the GSM8K chat prompts
    import jax
    import numpy as np

    from grpo_jax import model
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf as gguf_lib
    from grpo_jax.rollout import paged

    gguf = demo_task.smollm2_gguf()
    cfg, params = model.load_gguf(gguf)
    tok = gguf_lib.load_tokenizer(gguf)
    ids, mask = bench_rollout._prompts(tok, SCHEDULE["prompts"])
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id}))
    for call in range(2):
        heard: dict[int, float] = {}
        t0 = time.perf_counter()
        out = paged.sample_paged(
            cfg, params, ids, mask, jax.random.key(SCHEDULE["seed"] + call), n=SCHEDULE["n"],
            max_new_tokens=SCHEDULE["max_new_tokens"], temperature=1.0, eos_token_ids=eos,
            pad_token_id=tok.pad_token_id, max_num_seqs=max_num_seqs,
            finished=lambda row, _: heard.__setitem__(row, time.perf_counter() - t0),
        )  # fmt: skip
        jax.block_until_ready(out)
        generation_s = time.perf_counter() - t0
    return {
        "finish_s": [heard[i] for i in range(len(heard))],
        "generation_s": generation_s,
        "lengths": np.asarray(out.response_mask).sum(1).tolist(),
    }


def overlap_side(rows, schedule: dict, workers: int, first: str) -> dict:
    """One replay each of "on" and "off" (`first` first): the seconds waited for the rewards
    after generation, the seconds of scoring during generation, the scores."""
    from grpo_jax.rewards import functions as reward_fns

    finish_s = schedule["finish_s"]
    order = sorted(range(len(rows)), key=finish_s.__getitem__)
    out = {}
    with warm_pool(rows, workers) as (_, reward_fn, examples, solutions, pool):
        for mode in (first, "off" if first == "on" else "on"):
            t0 = time.perf_counter()
            scoring = reward_fns.Scoring(reward_fn, examples, pool=pool)
            if mode == "on":
                for i in order:
                    time.sleep(max(0.0, t0 + finish_s[i] - time.perf_counter()))
                    scoring.add(i, solutions[i])
            time.sleep(max(0.0, t0 + schedule["generation_s"] - time.perf_counter()))
            generated_at = time.perf_counter()
            result = scoring.result(solutions)
            out[mode] = {
                "wait_s": time.perf_counter() - generated_at,
                "overlapped_s": scoring.overlapped_s(generated_at),
                "scores": list(result.scores_B),
                "num_lost": result.num_lost,
            }
    return out


# ---------------------------------------------------------------------------------------------
# verl's side: this file run by verl's interpreter with --verl-worker (standard library only
# above; verl is imported in the functions below).


def _verl_score(item):
    from verl.utils.reward_score import default_compute_score

    data_source, completion, ground_truth = item
    return default_compute_score(data_source, completion, ground_truth, None)


def _verl_chunk(items):
    """One reward-loop worker's `compute_score_batch`: its items concurrently, each through
    `loop.run_in_executor(None, compute_score)` (the naive manager's run_single)."""
    import asyncio

    async def run_all():
        loop = asyncio.get_running_loop()
        tasks = [loop.run_in_executor(None, _verl_score, item) for item in items]
        return await asyncio.gather(*tasks)

    return asyncio.run(run_all())


def _verl_warm(_):
    from verl.utils.reward_score import default_compute_score  # noqa: F401 - the import

    return os.getpid()


def verl_worker(path: str, modes: list[str], workers: list[int]) -> dict:
    import concurrent.futures
    import multiprocessing

    from verl.utils.reward_score import default_compute_score  # noqa: F401 - imported first

    rows = json.load(open(path))
    items = [(r["data_source"], r["completion"], r["ground_truth"]) for r in rows]
    out = {}
    for mode in modes:
        for w in [1] if mode == "sequential" else workers:
            key = mode if mode == "sequential" else f"{mode}_{w}"
            if mode == "sequential":
                t0 = time.perf_counter()
                scores = [_verl_score(item) for item in items]
            elif mode == "reward_loop":
                spawn = multiprocessing.get_context("spawn")  # fresh processes, as Ray's actors
                with concurrent.futures.ProcessPoolExecutor(w, mp_context=spawn) as actors:
                    while len(set(actors.map(_verl_warm, range(4 * w)))) < w:
                        pass
                    t0 = time.perf_counter()
                    padded = items + items[: (-len(items)) % w]  # pad_dataproto_to_divisor
                    size = len(padded) // w
                    chunks = [padded[i * size : (i + 1) * size] for i in range(w)]
                    scores = [s for part in actors.map(_verl_chunk, chunks) for s in part]
                    scores = scores[: len(items)]
                    elapsed = time.perf_counter() - t0
            elif mode == "prime":
                from verl.utils.reward_score import default_compute_score as fn
                from verl.workers.reward_manager.prime import run_reward_scoring

                t0 = time.perf_counter()
                scores = run_reward_scoring(
                    fn, [i[1] for i in items], [i[2] for i in items], [i[0] for i in items],
                    num_processes=w,
                )  # fmt: skip
            else:
                raise ValueError(f"unknown verl mode {mode!r}")
            if mode != "reward_loop":
                elapsed = time.perf_counter() - t0
            out[key] = {"time": elapsed, "scores": [float(s) for s in scores]}
    return out


# ---------------------------------------------------------------------------------------------


def _cpu() -> dict:
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "python": platform.python_version()}


def _summary(times: list[float], batch: int) -> dict:
    median = statistics.median(times)
    return {
        "s_median": median,
        "s_min": min(times),
        "s_max": max(times),
        "completions_s": batch / median,
        "repeats": len(times),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", default="", help="reward worker counts besides the config's")
    p.add_argument("--verl-modes", default="sequential,reward_loop",
                   help="of sequential, reward_loop, prime")  # fmt: skip
    p.add_argument("--out", default="")
    p.add_argument("--overlap", action="store_true",
                   help="also the wait after generation with rows scored as they finish")
    p.add_argument("--overlap-slots", type=int, default=32,
                   help="rollout.max_num_seqs of the generation whose schedule is replayed")
    p.add_argument("--verl-worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--schedule-worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    modes = [m for m in args.verl_modes.split(",") if m]

    from grpo_jax import config as config_lib

    default_workers = config_lib.RewardConfig().num_workers
    counts = [
        default_workers,
        *sorted({int(w) for w in args.workers.split(",") if w} - {default_workers}),
    ]
    rows = workload()

    grpo = {w: {"times": []} for w in counts}
    verl: dict[str, dict] = {}
    overlap = None
    if args.overlap:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "schedule.json")
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--schedule-worker",
                                   path, "--overlap-slots", str(args.overlap_slots)])  # fmt: skip
            if proc.returncode:
                sys.exit("the generation schedule failed")
            overlap = {"schedule": json.load(open(path)), "on": [], "off": []}
        print(f"generation {overlap['schedule']['generation_s']:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        json.dump(rows, open(path, "w"))
        cmd = [VERL_PYTHON, os.path.abspath(__file__), "--verl-worker", path, "--verl-modes",
               ",".join(modes), "--workers", ",".join(map(str, counts))]  # fmt: skip
        for r in range(args.repeats):  # rounds alternate: grpo_jax's counts, then verl's modes
            for w in counts:
                res = grpo_jax_side(rows, w, 1)
                grpo[w]["times"] += res["times"]
                grpo[w].update({k: v for k, v in res.items() if k != "times"})
                print(f"round {r}: grpo_jax {w} workers {res['times'][0]:.2f} s", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"verl worker failed:\n{proc.stderr[-4000:]}")
            for key, res in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                verl.setdefault(key, {"times": []})["times"].append(res["time"])
                verl[key]["scores"] = res["scores"]
                print(f"round {r}: verl {key} {res['time']:.2f} s", flush=True)
            if overlap is not None:
                res = overlap_side(rows, overlap["schedule"], default_workers,
                                   "on" if r % 2 == 0 else "off")  # fmt: skip
                for mode in ("on", "off"):
                    overlap[mode].append(res[mode])
                    print(f"round {r}: overlap {mode}: waited {res[mode]['wait_s']:.2f} s",
                          flush=True)  # fmt: skip
            _report(args, rows, counts, grpo, verl, overlap)  # after every round: partial counts


def _report(args, rows, counts, grpo, verl, overlap=None) -> None:
    batch, default_workers = len(rows), counts[0]
    reference = verl["sequential"]["scores"] if "sequential" in verl else None
    kinds = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + 1

    def differing(scores):
        if reference is None:
            return None
        return sum(abs(a - b) > 1e-9 for a, b in zip(scores, reference, strict=True))

    report = {
        "benchmark": "code reward (prime_code, continuous=True), one step's batch",
        "workload": {
            "completions": batch,
            "problems": len(PROBLEMS),
            "tests_per_problem": TESTS,
            "data_source": DATA_SOURCE,
            "kinds": kinds,
            "verl_timeouts_s": {"first_pass": 5, "per_test": 10},
            "score_mean": statistics.fmean(grpo[default_workers]["scores"]),
        },
        "machine": _cpu(),
        "grpo_jax": {},
        "verl": {},
    }
    for w in counts:
        g = grpo[w]
        report["grpo_jax"][f"workers_{w}"] = {
            **_summary(g["times"], batch),
            "num_lost": g["num_lost"],
            "restarts": g["restarts"],
            "scores_differing_from_verl": differing(g["scores"]),
        }
    for key, v in verl.items():
        report["verl"][key] = {
            **_summary(v["times"], batch),
            "scores_differing_from_verl_sequential": differing(v["scores"]),
        }
    ratios = {}
    for w in counts:
        mine = report["grpo_jax"][f"workers_{w}"]["s_median"]
        for key in (f"reward_loop_{w}", f"prime_{w}", "sequential"):
            if key in report["verl"]:
                name = f"grpo_jax_{w}_workers_vs_verl_{key}"
                ratios[name] = mine / report["verl"][key]["s_median"]
    report["ratio_seconds_grpo_jax_over_verl"] = ratios
    report["score_agreement"] = {
        "compared_with": "verl sequential",
        "differing": {
            **{f"grpo_jax_workers_{w}": differing(grpo[w]["scores"]) for w in counts},
            **{f"verl_{k}": differing(v["scores"]) for k, v in verl.items()},
        },
    }
    if overlap is not None:
        report["overlap"] = _overlap_report(args, overlap, default_workers, differing)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _overlap_report(args, overlap, workers: int, differing) -> dict:
    sched = overlap["schedule"]
    finish = sorted(sched["finish_s"])

    def summary(mode):
        runs = overlap[mode]
        waits = [r["wait_s"] for r in runs]
        return {
            "wait_after_generation_s_median": statistics.median(waits),
            "wait_after_generation_s_min": min(waits),
            "wait_after_generation_s_max": max(waits),
            "overlapped_s_median": statistics.median(r["overlapped_s"] for r in runs),
            "num_lost": [r["num_lost"] for r in runs],
            "scores_differing_from_verl": differing(runs[-1]["scores"]),
            "repeats": len(runs),
        }

    on, off = summary("on"), summary("off")
    return {
        "what": "reward seconds a step waits after generation, rows scored as they finish "
                "(reward.overlap_with_rollout on) or after generation (off), grpo_jax, "
                f"{workers} reward workers",
        "generation": {
            "source": "replayed finish schedule of a real rollout: SmolLM2-135M-Instruct "
                      "(Q4_1 GGUF, float32), paged engine, first GSM8K train questions, "
                      "verl's instruction, chat template; row i's finish time given to the "
                      "code batch's completion i",
            **SCHEDULE,
            "max_num_seqs": args.overlap_slots,
            "generation_s": sched["generation_s"],
            "finish_s": {"first": finish[0], "median": statistics.median(finish),
                         "last": finish[-1]},
            "mean_length": statistics.fmean(sched["lengths"]),
            "replay": "sleeps: the CPU is free for the reward workers during generation, as "
                      "when an accelerator generates",
        },
        "on": on,
        "off": off,
        "scores_on_equal_off": all(a["scores"] == b["scores"]
                                   for a, b in zip(overlap["on"], overlap["off"])),
        "ratio_wait_on_over_off": on["wait_after_generation_s_median"]
        / off["wait_after_generation_s_median"],
    }


if __name__ == "__main__":
    if "--schedule-worker" in sys.argv:
        a = argparse.ArgumentParser()
        a.add_argument("--schedule-worker")
        a.add_argument("--overlap-slots", type=int)
        ns = a.parse_args()
        with open(ns.schedule_worker, "w") as f:
            json.dump(finish_schedule(ns.overlap_slots), f)
    elif "--verl-worker" in sys.argv:
        a = argparse.ArgumentParser()
        a.add_argument("--verl-worker")
        a.add_argument("--verl-modes")
        a.add_argument("--workers")
        ns = a.parse_args()
        result = verl_worker(
            ns.verl_worker, ns.verl_modes.split(","), [int(w) for w in ns.workers.split(",")]
        )
        print(json.dumps(result))
    else:
        main()
