r"""Runs the embedded demo and checks that GRPO learned: `python scripts/check_demo.py`.

Criterion (issue 6): with the default seed, the final greedy eval accuracy is at least 0.3 above
the first eval (taken after the supervised warm-up, before any GRPO step) and at least twice it,
and the whole run takes at most --max_seconds (default 600 s: 10 minutes on 2 CPU cores).
Prints the figures as one JSON line; exits non-zero when a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACC = "val/arithmetic/acc"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="", help="run directory (default: a fresh temp dir)")
    parser.add_argument("--max_seconds", type=float, default=600.0, help="wall-time limit")
    parser.add_argument("--min_gain", type=float, default=0.3, help="final - first eval acc")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_demo_")
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        sys.exit(f"{workdir} already holds a run; pass a fresh --workdir")
    cmd = [
        sys.executable,
        "train.py",
        "--config=configs/demo.py",
        f"--config.trainer.default_local_dir={workdir}",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = [(r["step"], r[ACC]) for r in map(json.loads, f) if ACC in r]
    if len(evals) < 2:
        sys.exit(f"expected a first and a final eval in {workdir}, got {evals}")
    (_, first), (final_step, final) = evals[0], evals[-1]
    checks = {
        f"final >= first + {args.min_gain}": final >= first + args.min_gain,
        "final >= 2 x first": final >= 2 * first,
        f"wall <= {args.max_seconds:.0f} s": wall <= args.max_seconds,
    }
    print(
        json.dumps(
            {
                "first_eval_acc": first,
                "final_eval_acc": final,
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
