"""grpo_jax.rewards.code (verl's prime_code, run in grpo_jax.sandbox) against verl 0.9.1.

* Parity: completions built from a small set of programs (correct, wrong, partial, crashing,
  not compiling, looping, relying on verl's quirks) crossed with stdin/stdout and call-based
  problems, plus seeded perturbations of the printed text (whitespace, blank lines, floats,
  digit strings), are scored here and by verl's `prime_code.compute_score(continuous=True)`
  in the reference worker (tests/verl_code.py), both with the timeouts shortened to 1 s / 2 s
  so the loops end sooner. Scores, their types and the metadata must be equal (tracebacks of
  errors verl prints with memory addresses aside).
* Hostile completions score 0, within their timeout, through the whole reward path
  (`scorers.default_compute_score`), and leave the host as it was; the sandbox's own guarantees
  are tests/test_sandbox.py's.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import time

import pytest
import reference

from grpo_jax import sandbox
from grpo_jax.rewards import code, scorers

FAST = {"first_pass_timeout_s": 1, "per_test_timeout_s": 2}

# ---------------------------------------------------------------------------------------------
# Pure pieces.


def test_truncate_follows_verls_slices():
    assert code.truncate("abc", 3) == "abc"
    # length 5: the first 2 characters, the marker, then s[-5 // 2:] = s[-3:].
    assert code.truncate("abcdefgh", 5) == "ab...(truncated) ...fgh"
    assert code.truncate("abcdefgh", 0) == "...(truncated) ...abcdefgh"  # s[:0] and s[0:]


def test_stdin_program_wraps_the_code_into_a_function():
    program = code.stdin_program("import sys\nx = 1\nimport os\nprint(x)")
    assert program == (
        "import sys\nstdin = sys.stdin\nstdout = sys.stdout\ndef code():\n\tx = 1\n"
        "\timport os\n\tprint(x)\n"
    )
    # A trailing `if __name__ == "__main__":` block is inlined (through ast.unparse).
    main = code.stdin_program('def f():\n    print(1)\nif __name__ == "__main__":\n    f()')
    assert main.endswith("def code():\n\tdef f():\n\t    print(1)\n\tf()\n")


@pytest.mark.parametrize(
    "stdout, expected, passes",
    [
        ("3\n", "3", True),
        ("  3  \n\n", "3\n", True),  # the whole text stripped
        ("a \nb\n", "a\nb\n", True),  # each line stripped
        ("a\nb\n", "a\n\nb\n", True),  # the expected's empty lines dropped
        ("0.3333333\n", "0.333333\n", True),  # floats within rtol 1e-5
        ("0.3334\n", "0.333333\n", False),
        ("1.0\n2\n", "1\n2\n", True),  # not every pair is a digit string: compared as floats
        ("01\n2\n", "1\n2\n", False),  # ... digit strings only compare as text
        ("1  2\n", "1 2\n", False),  # verl's token-set step never passes
        ("1 2\n", "1.0 2.0\n", False),  # one number a line for floats
    ],
)
def test_stdout_matches_hand_cases(stdout, expected, passes):
    assert code.stdout_matches(stdout, expected) is passes


def test_expected_return_converts_dict_keys_as_verl():
    assert code.expected_return('{"1": 2}') == [{1: 2}]
    assert code.expected_return('{"a": 2}') == {"a": 2}
    assert code.expected_return('[{"1": 2}, 5]') == [{1: 2}]  # the rest of the list goes
    assert code.returns_match((1, 2), code.expected_return("[1, 2]"))
    assert code.returns_match([(1, 2)], code.expected_return("[[[1, 2]]]"))
    assert not code.returns_match([(1, 2)], code.expected_return("[[1, 2]]"))


def test_timeouts_are_verls():
    verl = (5, 10, 10)  # prime_code: check_correctness timeouts 5 and 10, `test_case_id >= 9`
    assert (code.FIRST_PASS_TIMEOUT_S, code.PER_TEST_TIMEOUT_S, code.CONTINUOUS_TESTS) == verl


# ---------------------------------------------------------------------------------------------
# Parity with verl.

ADD = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
ADD_PROGRAMS = {
    "correct": "a, b = map(int, input().split())\nprint(a + b)",
    "block": "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone.",
    "two_blocks": "```python\nprint(0)\n```\nfixed:\n```python\n"
    "print(sum(map(int, input().split())))\n```",
    "main_guard": "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n"
    'if __name__ == "__main__":\n    main()',
    "sys_exit": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)",
    "wrong": "a, b = map(int, input().split())\nprint(a - b)",
    "partial": "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)",
    "runtime_error": "a, b = map(int, input().split())\nprint(a // (b - 4))",
    "syntax_error": "def f(:\n    pass",
    "exit_builtin": "a, b = map(int, input().split())\nprint(a + b)\nexit()",
    "global_stmt": "total = 0\ndef add(x):\n    global total\n    total += x\n"
    "for v in input().split():\n    add(int(v))\nprint(total)",
    "stdin_buffer": "import sys\na, b = map(int, sys.stdin.buffer.readline().split())\n"
    "print(a + b)",
    "readline": "import sys\ninput = sys.stdin.readline\na, b = map(int, input().split())\n"
    "print(a + b)",
    "top_stdin": "from sys import stdin\na, b = map(int, stdin.readline().split())\nprint(a + b)",
    "spaces": "a, b = map(int, input().split())\nprint('  ', a + b, '  ')\nprint()",
    "sys_stdout": "from sys import stdout\na, b = map(int, input().split())\n"
    "stdout.write(str(a + b))",
    "prose": "I cannot solve this.",
}
CALL = {
    "fn_name": "add",
    "inputs": ["1\n2", "[1, 2]\n3", "5\n5"],
    "outputs": ["3", "[[1, 2, 3]]", "10"],
}
CALL_PROGRAMS = {
    "correct": "def add(a, b):\n    return a + [b] if isinstance(a, list) else a + b",
    "tuple": "def add(a, b):\n    return tuple(a + [b]) if isinstance(a, list) else a + b",
    "solution": "class Solution:\n    def add(self, a, b):\n"
    "        return a + [b] if isinstance(a, list) else a + b",
    "wrong": "def add(a, b):\n    return 0",
    "partial": "def add(a, b):\n    return a + [b] if isinstance(a, list) else a * b",
    "missing": "def plus(a, b):\n    return a + b",
    "set_result": "def add(a, b):\n    return {1}",
    "raises": "def add(a, b):\n    raise ValueError('no')",
}
DICT_CALL = {"fn_name": "f", "inputs": ['{"1": 2}'], "outputs": ['{"1": 3}']}
DICT_PROGRAMS = {"int_keys": "def f(d):\n    return {k: v + 1 for k, v in d.items()}"}
# 12 tests: verl's partial credit counts the first 10 only.
TWELVE = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i * i}\n" for i in range(12)]}
TWELVE_PROGRAMS = {
    "fails_11": "n = int(input())\nprint(n * n if n != 11 else 0)",
    "fails_0": "n = int(input())\nprint(n * n if n != 0 else 1)",
}
LOOP = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
LOOP_PROGRAMS = {"loops_on_2": "n = int(input())\nwhile n == 2:\n    pass\nprint(n)"}


def _printing(texts: list[str]) -> str:
    """A program printing texts[int(input())] exactly."""
    return f"import sys\nsys.stdout.write({texts!r}[int(input())])"


def _perturbed_outputs(rng: random.Random, count: int) -> tuple[dict, str]:
    """A problem of `count` tests and a program printing each expected text perturbed."""
    expected, printed = [], []
    for _ in range(count):
        kind = rng.choice(["ints", "floats", "words", "lines"])
        if kind == "ints":
            values = [str(rng.randint(0, 99)) for _ in range(rng.randint(1, 3))]
        elif kind == "floats":
            values = [f"{rng.uniform(-5, 5):.6f}" for _ in range(rng.randint(1, 3))]
        elif kind == "words":
            values = [" ".join(rng.choice("ab") for _ in range(rng.randint(1, 3)))]
        else:
            values = ["x", "", "y"]
        text = "\n".join(values) + "\n"
        out = list(values)
        for j, v in enumerate(out):
            change = rng.choice(["none", "space", "tab", "float", "zero", "digits", "double"])
            if change == "space":
                out[j] = rng.choice([" ", ""]) + v + rng.choice([" ", "  "])
            elif change == "tab":
                out[j] = v.replace(" ", "\t")
            elif change == "float" and v:
                try:
                    out[j] = repr(float(v) * (1 + rng.choice([1e-7, 1e-4])))
                except ValueError:
                    pass
            elif change == "zero" and v.isdigit():
                out[j] = "0" + v
            elif change == "digits" and v.isdigit():
                out[j] = v + ".0"
            elif change == "double":
                out[j] = v + "\n"
        sep = rng.choice(["\n", "\r\n"])
        expected.append(text)
        printed.append(sep.join(out) + rng.choice(["", "\n", "\n\n"]))
    problem = {"inputs": [f"{i}\n" for i in range(count)], "outputs": expected}
    return problem, _printing(printed)


def _cases():
    cases = []
    for problem, programs in [
        (ADD, ADD_PROGRAMS),
        (CALL, CALL_PROGRAMS),
        (DICT_CALL, DICT_PROGRAMS),
        (TWELVE, TWELVE_PROGRAMS),
        (LOOP, LOOP_PROGRAMS),
    ]:
        prefix = "call/" if "fn_name" in problem else ""
        for name, program in programs.items():
            cases.append((prefix + name, program, json.dumps(problem)))
    rng = random.Random(0)
    for k in range(3):
        problem, program = _perturbed_outputs(rng, 10)
        cases.append((f"perturbed_{k}", program, json.dumps(problem)))
    cases.append(("bad_ground_truth", ADD_PROGRAMS["correct"], "not json"))
    short = {"inputs": ADD["inputs"], "outputs": ADD["outputs"][:2]}
    cases.append(("short_outputs", ADD_PROGRAMS["correct"], json.dumps(short)))
    long = {"inputs": ADD["inputs"][:2], "outputs": ADD["outputs"]}
    cases.append(("long_outputs", ADD_PROGRAMS["wrong"], json.dumps(long)))
    return cases


def _comparable(metadata):
    """verl's metadata without what differs run to run (memory addresses in an error)."""
    if not isinstance(metadata, list):
        return metadata
    out = []
    for entry in metadata:
        entry = dict(entry)
        if "at 0x" in entry.get("error", ""):
            entry["error"] = entry["traceback"] = "<has addresses>"
        out.append(entry)
    return out


@pytest.mark.reference("verl")
def test_prime_code_parity_with_verl(verl):
    cases = _cases()
    calls = tuple(
        reference.fn("verl_code:prime_code_score")(program, gt, **FAST) for _, program, gt in cases
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        theirs_future = pool.submit(verl.run, calls)  # verl's worker, while ours run
        ours = list(
            pool.map(lambda c: code.compute_score(c[1], c[2], continuous=True, **FAST), cases)
        )
        theirs = theirs_future.result().value
    mismatches = []
    for (name, _, _), (our_score, our_meta), (their_score, their_meta) in zip(cases, ours, theirs):
        if (our_score, type(our_score)) != (their_score, type(their_score)):
            mismatches.append((name, "score", our_score, their_score))
        elif _comparable(our_meta) != _comparable(their_meta):
            mismatches.append((name, "metadata", our_meta, their_meta))
    assert not mismatches, mismatches
    scores = {name: float(s) for (name, _, _), (s, _) in zip(cases, ours)}
    # The generated cases do cover every outcome (not only passes).
    assert scores["correct"] == 1.0 and scores["wrong"] == 0.0
    assert 0 < scores["partial"] < 1 and scores["fails_0"] == 0.9 and scores["fails_11"] == 1.0
    assert scores["loops_on_2"] == pytest.approx(2 / 3)
    # verl's second pass runs call-based tests as stdin programs: partial credit is lost.
    assert scores["call/correct"] == 1.0 and scores["call/partial"] == 0.0


def test_documented_differences():
    gt = json.dumps(ADD)
    # No site-packages in the sandbox (verl's venv has numpy): the module does not build.
    score, meta = code.compute_score("import numpy\nprint(3)", gt, continuous=True, **FAST)
    assert score == 0.0 and "numpy" in meta[0]["error"] and meta[0]["test_case"]["res"] == "[-2]"
    # open(0) is io.open (the prelude's `from io import *`) on the sandbox's empty stdin; verl
    # reads its reward worker's fd 0 (/dev/null in a Ray worker, a pipe in tests/reference.py).
    score, meta = code.compute_score(
        "print(len(open(0).read()))", json.dumps({"inputs": ["1 2\n"], "outputs": ["0\n"]})
    )
    assert (score, meta) == (True, {})


@pytest.mark.reference("verl")
def test_continuous_false_raises_like_verl(verl):
    gt = json.dumps(ADD)
    wrong = ADD_PROGRAMS["wrong"]
    path = "verl.utils.reward_score.prime_code:compute_score"
    assert verl.run(reference.fn("verl_code:raises")(path, wrong, gt)).value == "UnboundLocalError"
    with pytest.raises(ValueError, match="UnboundLocalError"):
        code.compute_score(wrong, gt, continuous=False, **FAST)
    assert code.compute_score(ADD_PROGRAMS["correct"], gt, continuous=False) == (True, {})


def test_default_compute_score_routes_code_sources():
    gt = json.dumps(ADD)
    for source in code.SOURCES:
        assert scorers.default_compute_score(source, ADD_PROGRAMS["correct"], gt) == 1.0
    partial = scorers.default_compute_score("apps", ADD_PROGRAMS["partial"], gt)
    assert partial == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# Hostile completions, through the whole reward path.

SECRET = "GRPO_JAX_TEST_SECRET"


def _score_apps(program: str, expected: str, *, within_s: float) -> float:
    gt = json.dumps({"inputs": ["\n"], "outputs": [expected]})
    start = time.monotonic()
    score = scorers.default_compute_score("apps", program, gt)
    assert time.monotonic() - start < within_s
    return score


@pytest.mark.skipif(not sandbox.isolation().pid_namespace, reason="needs the namespace plan")
def test_hostile_completions_score_zero(tmp_path, monkeypatch):
    nonce = os.urandom(8).hex()
    monkeypatch.setenv(SECRET, nonce)
    target = f"/root/grpo_jax_pwned_{nonce}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    hostile = {
        # fork bomb (os.fork is None under verl's guard; posix.fork is not)
        "fork_bomb": ("import posix\nwhile True:\n    posix.fork()\nprint('x')", "x\n"),
        "memory_bomb": ("a = []\nwhile True:\n    a.append(' ' * 10**7)\nprint('x')", "x\n"),
        "huge_output": ("for _ in range(40):\n    print('a' * 10**6)", "a\n"),
        "write_home": (
            f"open({target!r}, 'w').write('x')\nprint('written')",
            "written\n",
        ),
        "read_env": (
            "import posix\n"
            f"print(posix.environ.get(b{SECRET!r}, b'').decode() or "
            "open('/proc/1/environ').read())",
            f"{nonce}\n",
        ),
        "socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)\nprint('in')",
            "in\n",
        ),
        "kill_parent": (
            "import posix\nposix.kill(posix.getppid(), 9)\nposix.kill(-1, 9)\nprint('killed')",
            "killed\n",
        ),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            scores = dict(
                zip(
                    hostile,
                    pool.map(lambda c: _score_apps(*c, within_s=30), hostile.values()),
                )
            )
    finally:
        listener.close()
    assert scores == dict.fromkeys(hostile, 0.0)
    assert not os.path.exists(target)


def test_an_infinite_loop_scores_zero_within_its_timeouts():
    gt = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    start = time.monotonic()
    score, meta = code.compute_score("while True:\n    pass", gt, continuous=True, **FAST)
    # 1 s + 1 s + start-up for the first pass, 2 s + 1 s + start-up for the test alone.
    assert time.monotonic() - start < 1 + 1 + 2 + 1 + 2 * code.STARTUP_ALLOWANCE_S + 1
    assert score == 0.0 and meta[0]["test_case"]["res"] == "[-1]"
