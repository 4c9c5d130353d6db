r"""A few hand-written programming problems as verl-layout code parquets, for configs/code.py.

  python scripts/prepare_code_data.py data/code      # writes data/code/{train,test}.parquet

Each row is what verl's code datasets hold (PRIME's Eurus-2-RL-Data, whose data sources are the
ones verl's default_compute_score runs as code): data_source "apps", prompt a chat list (one
user turn), ability "code", reward_model {"style": "rule", "ground_truth": JSON text of
{"inputs": [...], "outputs": [...]} (stdin/stdout) or with "fn_name" (call-based)}, and
extra_info {"split", "index", "answer"}; the answer (a reference program, also verified against
its tests by `check`) feeds grpo_jax's supervised warm-up (warmup.steps), which the :tiny
variant uses to get a random model writing programs at all.
"""

import json
import os
import sys

# (statement, reference program, tests as (stdin, stdout) pairs, or fn_name and (args, value)).
STDIN_PROBLEMS = [
    (
        "Print twice the integer read.",
        "print(int(input())*2)",
        [("3\n", "6\n"), ("0\n", "0\n"), ("-4\n", "-8\n")],
    ),
    (
        "Print the line reversed.",
        "print(input()[::-1])",
        [("abc\n", "cba\n"), ("x\n", "x\n"), ("hello\n", "olleh\n")],
    ),
    (
        "Print the sum of the integers.",
        "print(sum(map(int,input().split())))",
        [("1 2\n", "3\n"), ("5\n", "5\n"), ("1 1 1\n", "3\n")],
    ),
    (
        "Print the line in upper case.",
        "print(input().upper())",
        [("ab\n", "AB\n"), ("Hi\n", "HI\n"), ("z\n", "Z\n")],
    ),
    (
        "Print the largest integer.",
        "print(max(map(int,input().split())))",
        [("1 9 3\n", "9\n"), ("4\n", "4\n"), ("-1 -2\n", "-1\n")],
    ),
    (
        "Print the length of the line.",
        "print(len(input()))",
        [("abc\n", "3\n"), ("\n", "0\n"), ("hello\n", "5\n")],
    ),
    (
        "Print the square of the integer.",
        "n=int(input())\nprint(n*n)",
        [("3\n", "9\n"), ("0\n", "0\n"), ("-2\n", "4\n")],
    ),
]
CALL_PROBLEMS = [
    (
        "Write f(x) returning x plus one.",
        "def f(x):\n return x+1",
        "f",
        [([1], 2), ([0], 1), ([-5], -4)],
    ),
]
TEST_INDICES = (0, 2, 7)  # held out for validation too (the set is tiny; they stay in train)


def rows() -> list[dict]:
    """Every problem as a verl-layout row (the split is set by `write`)."""
    out = []
    for statement, answer, tests in STDIN_PROBLEMS:
        truth = {"inputs": [i for i, _ in tests], "outputs": [o for _, o in tests]}
        out.append((statement, answer, truth))
    for statement, answer, fn_name, tests in CALL_PROBLEMS:
        truth = {
            "fn_name": fn_name,
            "inputs": ["\n".join(json.dumps(a) for a in args) for args, _ in tests],
            "outputs": [json.dumps(v) for _, v in tests],
        }
        out.append((statement, answer, truth))
    return [
        {
            "data_source": "apps",
            "prompt": [{"role": "user", "content": statement}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"split": "train", "index": i, "answer": answer},
        }
        for i, (statement, answer, truth) in enumerate(out)
    ]


def check(table: list[dict]) -> None:
    """Every reference answer scores 1.0 with verl's scorer (run in grpo_jax's sandbox)."""
    from grpo_jax.rewards import scorers

    for row in table:
        score = scorers.default_compute_score(
            row["data_source"], row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        )
        if score != 1.0:
            raise AssertionError(f"the reference answer of row {row['extra_info']} scores {score}")


def write(out_dir: str) -> None:
    import datasets

    table = rows()
    check(table)
    os.makedirs(out_dir, exist_ok=True)
    test = [dict(table[i], extra_info={**table[i]["extra_info"], "split": "test"})
            for i in TEST_INDICES]  # fmt: skip
    for split, split_rows in (("train", table), ("test", test)):
        datasets.Dataset.from_list(split_rows).to_parquet(os.path.join(out_dir, f"{split}.parquet"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    write(sys.argv[1])
