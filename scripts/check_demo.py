r"""Runs the embedded demo and checks that GRPO learned: `python scripts/check_demo.py`.

Criterion (the real-model demo, configs/demo.py): the final greedy validation accuracy
(val-core/arithmetic/acc/mean@1: the flexible GSM8K scorer's "acc") is at least --min_final
(0.5) and at least --min_gain (0.3) above the first validation (before any GRPO step), and the
whole run, compilation included, takes at most --max_seconds (600 s: 10 minutes on this 2-core
CPU). With --tiny it runs configs/demo.py:tiny, the random model (whose first validation is
after its supervised warm-up; min_final 0). Prints the figures as one JSON line; exits non-zero
when a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACC = {
    False: "val-core/arithmetic/acc/mean@1",  # demo_task.sum_reward's "acc"
    True: "val-core/arithmetic/acc/mean@1",  # the strict scorer's float score (verl: "acc")
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="", help="run directory (default: a fresh temp dir)")
    parser.add_argument("--tiny", action="store_true", help="the random-model demo instead")
    parser.add_argument("--max_seconds", type=float, default=600.0, help="wall-time limit")
    parser.add_argument("--min_gain", type=float, default=0.3, help="final - first accuracy")
    parser.add_argument("--min_final", type=float, default=None, help="final accuracy (0.5)")
    args, extra = parser.parse_known_args()
    min_final = args.min_final if args.min_final is not None else (0.0 if args.tiny else 0.5)
    workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_demo_")
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        sys.exit(f"{workdir} already holds a run; pass a fresh --workdir")
    cmd = [
        sys.executable,
        "train.py",
        "--config=configs/demo.py" + (":tiny" if args.tiny else ""),
        f"--config.trainer.default_local_dir={workdir}",
        *extra,  # more --config.* overrides
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    key = ACC[args.tiny]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = [(r["step"], r[key]) for r in map(json.loads, f) if key in r]
    if len(evals) < 2:
        sys.exit(f"expected a first and a final validation ({key}) in {workdir}, got {evals}")
    (_, first), (final_step, final) = evals[0], evals[-1]
    checks = {
        f"final >= {min_final}": final >= min_final,
        f"final >= first + {args.min_gain}": final >= first + args.min_gain,
        f"wall <= {args.max_seconds:.0f} s": wall <= args.max_seconds,
    }
    print(
        json.dumps(
            {
                "metric": key,
                "first_acc": first,
                "final_acc": final,
                "final_step": final_step,
                "evals": evals,
                "wall_s": round(wall, 1),
                "workdir": workdir,
                "checks": checks,
            }
        )
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
