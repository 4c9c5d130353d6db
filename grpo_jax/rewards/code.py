"""Code-execution reward: verl 0.9.1's `prime_code.compute_score`, run in grpo_jax's sandbox.

verl's `default_compute_score` scores the data sources "codecontests", "apps", "codeforces" and
"taco" with `prime_code.compute_score(completion, ground_truth, continuous=True)` (or with
SandboxFusion, rewards/sandbox_fusion.py, when a sandbox_fusion_url is given). The ground truth
is JSON: {"inputs": [...], "outputs": [...]} for stdin/stdout programs, plus "fn_name" for
call-based ones (each input line is a JSON argument, the output a JSON value). This module
computes the same (score, metadata) as verl for every completion; every run of model code goes
through `grpo_jax.sandbox.run_python` (rewards/code_harness.py inside the sandbox), never in the
trainer's process.

verl's rules, reproduced here:
  * the code is `completion.split("```python")[-1].split("```")[0]`: the last python block, or
    the completion up to its first "```" when it has none.
  * first pass: every test, in one process, in order, `FIRST_PASS_TIMEOUT_S` (5 s) a step (an
    alarm, whose default action ends the process, so a slow test loses the whole pass) and
    one more second for the whole process. All pass: the result is `(True, {})`.
  * otherwise, each of the first `CONTINUOUS_TESTS` (10) tests alone, `PER_TEST_TIMEOUT_S`
    (10 s) each; the score is the fraction of them that pass, and the metadata a list with a
    dict per test ({"error", "traceback"} or {"output", "expected", "inputs",
    "error_message"} or {}, plus "test_case": {"input", "output", "res"}). A result is True,
    False (wrong answer), -1 (runtime error, timeout, a lost process) or -2 (the module does
    not build, or has no such function).
  * the module is the prelude of star imports (`PRELUDE`) plus the code. A stdin program is
    wrapped into a function `code()` (`stdin_program`): a trailing `if __name__ == "__main__":`
    block is inlined, lines that start with "from " / "import " before the first other line
    stay at module level, every other line gets a tab. So module-level names are locals of
    code(): a `global` statement in a nested function raises NameError, as in verl. exit() and
    quit() are None (verl's reliability guard): calling them is a runtime error, while
    sys.exit() ends the program normally. sys.stdin.buffer does not exist.
  * stdout is compared (`stdout_matches`) by verl's cascade: equal after stripping the whole
    text, or each line; or line lists equal after dropping empty lines and stripping the
    expected ones; or, when not every line pair is a digit string, as floats with
    numpy.allclose's tolerances (rtol 1e-5, atol 1e-8), one number a line. A return value
    (`returns_match`) equals the expected JSON value, or its first element, with a tuple result
    read as a list (and a list of tuples as a list of lists against the first element).
  * the second pass drops "fn_name" (verl builds each test as {"inputs", "outputs"} only): a
    call-based test then runs as a stdin program, which prints nothing, so a call-based
    completion scores 1.0 (all tests pass the first pass) or, nearly always, 0.0.
  * `continuous=False` with any failing test raises, as verl's does (UnboundLocalError there).
  * a ground truth that is not JSON of a dict with "inputs" and "outputs", or (unless every
    test passes) has fewer outputs than inputs, scores `(False, None)`, as verl does (it prints
    the exception and moves on).

Deliberate differences from verl (docs/data-and-rewards.md):
  * verl runs the code in a forked child of its reward worker under `reliability_guard` (which
    its docstring says is not a sandbox); here every process is a fresh interpreter in
    `grpo_jax.sandbox` (namespaces, a fresh uid, rlimits, `MEMORY_LIMIT_BYTES` of address space
    where verl sets no memory limit, output capped at `MAX_OUTPUT_BYTES`).
  * that interpreter has no site-packages: `import numpy` in a completion fails (verl's venv
    has numpy). Third-party imports are a runtime (or, at module level, a build) error.
  * the expected outputs never enter the sandbox; they are compared here. A completion can
    therefore not fake a pass (in verl's process it could patch the comparison).
  * the first pass's tests run in a fresh interpreter (about 0.1 s to start, allowed for on top
    of verl's timeouts: `STARTUP_ALLOWANCE_S`); the second pass's tests run in parallel, one
    sandbox each, from a thread pool in this process (the reward worker): the sandbox runs are
    subprocesses, so the threads only wait, and a reward worker process handles one
    completion at a time, so a pool of processes would only add start-up cost. Up to
    `reward.num_workers` x 10 sandboxes run at once.

The score is verl's in all these cases; the metadata can differ in the text of tracebacks, and
where verl's first pass runs out of its shared 6 s budget (`(1.0, [...])` here may be
`(True, {})` in verl, or the reverse). No third-party packages are needed.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import logging
import math
import pathlib

import numpy as np

from grpo_jax import sandbox

_log = logging.getLogger(__name__)

SOURCES = ("codecontests", "apps", "codeforces", "taco")  # default_compute_score routes these
FIRST_PASS_TIMEOUT_S = 5  # verl: check_correctness(all tests, timeout=5)
PER_TEST_TIMEOUT_S = 10  # verl: check_correctness(one test, timeout=10) in continuous mode
CONTINUOUS_TESTS = 10  # verl scores the first 10 tests ("some problems have enormous test cases")
STARTUP_ALLOWANCE_S = 1.0  # our interpreter's start, added to verl's process budget
MEMORY_LIMIT_BYTES = 1 << 30  # RLIMIT_AS of each process (verl: no limit)
MAX_OUTPUT_BYTES = 16 << 20  # what one sandbox run may print (its reports included)

# verl's prelude: star imports, then plain imports, then a deep recursion limit.
_STAR_IMPORTS = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing",
)  # fmt: skip
_PLAIN_IMPORTS = _STAR_IMPORTS[:16]  # all but builtins and typing
PRELUDE = (
    "".join(f"from {m} import *\n" for m in _STAR_IMPORTS)
    + "".join(f"import {m}\n" for m in _PLAIN_IMPORTS)
    + "sys.setrecursionlimit(6*10**5)\n"
)
_HARNESS = (pathlib.Path(__file__).parent / "code_harness.py").read_text(encoding="utf-8")
# The harness runs from a file of its own name: the completion's module is "<string>", and
# verl's clean_traceback cuts a traceback at the first "<string>" frame.
_BOOTSTRAP = "import runpy; runpy.run_path('code_harness.py', run_name='__main__')"
_TRUNCATED = "...(truncated) ..."
_WRONG = "Wrong Answer"


# ---------------------------------------------------------------------------------------------
# Text: the code, the program, truncation.


def extract_code(completion: str) -> str:
    """The code of a completion, as verl's prime_code takes it (see the module docstring)."""
    return completion.split("```python")[-1].split("```")[0]


def _is_import(line: str) -> bool:
    return line.startswith("from ") or line.startswith("import ")


def stdin_program(code: str) -> str:
    """A stdin program rewritten into a function `code()`, as verl's run_test does."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:  # noqa: BLE001 - verl leaves code it cannot parse as is (it fails later)
        pass
    out, started = [], False
    for line in code.split("\n"):
        if _is_import(line):
            out.append("\t" + line if started else line)
            continue
        if not started:
            out.append("stdin = sys.stdin\nstdout = sys.stdout\ndef code():")
            started = True
        out.append("\t" + line)
    return "".join(line + "\n" for line in out)


def truncate(text: str, length: int = 300) -> str:
    """verl's truncatefn: the first and last length // 2 characters around a marker.

    verl's slice `s[-length // 2:]` is `s[(-length) // 2:]`: one more character at the end
    for an odd length, and the whole text for length 0.
    """
    if not isinstance(text, str):
        raise TypeError(f"truncate takes a str, got {type(text).__name__}")
    if len(text) <= length:
        return text
    return text[: length // 2] + _TRUNCATED + text[-length // 2 :]


def clean_traceback(text: str) -> str:
    """verl's clean_traceback: the traceback from the code's first frame ("<string>") on."""
    return "Traceback (most recent call last):\n  " + text[text.find('File "<string>"') :]


# ---------------------------------------------------------------------------------------------
# Comparisons (verl's testing_util, one test).


def _as_floats(values):
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        return None


def _int_like(value) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())


def stdout_matches(stdout: str, expected: str) -> bool:
    """Whether a program's stdout passes against the expected text, by verl's cascade.

    verl tries, in order: the texts equal after strip(); the same with every line stripped;
    the lines equal [expected]; the lines equal the expected's non-empty lines, stripped; the
    same after dropping empty output lines; and, unless every (output, expected) line pair is a
    digit string, both as one float a line under numpy.allclose. (verl's last step, comparing
    token sets, compares a list with a list of sets and never passes.)
    """
    lines = stdout.splitlines()
    target = expected.strip()
    if "\n".join(lines).strip() == target:
        return True
    if "\n".join(line.strip() for line in lines).strip() == target:
        return True
    expected_lines = [line.strip() for line in expected.split("\n") if line]
    if lines == [expected] or lines == expected_lines:
        return True
    nonempty = [line for line in lines if line]
    if nonempty == expected_lines:
        return True
    if len(nonempty) != len(expected_lines):
        return False
    if all(_int_like(a) and _int_like(b) for a, b in zip(nonempty, expected_lines)):
        return False
    got, want = _as_floats(nonempty), _as_floats(expected_lines)
    return got is not None and want is not None and bool(np.allclose(got, want))


def _untag(value):
    """The value code_harness._tagged encoded (tuples, lists and dicts told apart)."""
    if not isinstance(value, list):
        return value
    tag, items = value
    if tag == "T":
        return tuple(_untag(v) for v in items)
    if tag == "L":
        return [_untag(v) for v in items]
    return {_untag(k): _untag(v) for k, v in items}


def _int_keys(value):
    """verl: a dict's keys become ints when they all can."""
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        return value


def expected_return(text: str):
    """A call-based test's expected value as verl compares it: the JSON value, a dict with int
    keys wrapped in a list, a list whose first element is such a dict cut to that dict."""
    value = json.loads(text)
    if isinstance(value, dict):
        converted = _int_keys(value)
        value = [converted] if converted is not value else value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        converted = _int_keys(value[0])
        value = [converted] if converted is not value[0] else value
    return value


def returns_match(output, expected) -> bool:
    """verl's call-based check of a return value against `expected_return(...)`."""
    if isinstance(output, tuple):
        output = list(output)
    result = output == expected
    if isinstance(expected, list) and expected:
        result = result or output == expected[0]
    try:
        if isinstance(output[0], tuple):
            result = result or [list(x) for x in output] == expected[0]
    except (IndexError, KeyError, TypeError):
        pass
    return result is True


# ---------------------------------------------------------------------------------------------
# Running tests in the sandbox.


@dataclasses.dataclass(frozen=True)
class Problem:
    """A parsed ground truth.

    Attributes:
      fn_name: the function a call-based problem calls, None for a stdin/stdout one.
      inputs, outputs: the tests (strings; anything else is verl's lost run at that test).
    """

    fn_name: str | None
    inputs: tuple
    outputs: tuple

    @property
    def mode(self) -> str:
        return "stdin" if self.fn_name is None else "call"

    def alone(self, i: int) -> Problem:
        """Test i as verl's second pass builds it: {"inputs", "outputs"} without fn_name, so
        a call-based test runs as a stdin program there."""
        return Problem(None, self.inputs[i : i + 1], self.outputs[i : i + 1])


def parse_problem(test_cases) -> Problem | None:
    """The Problem of a ground truth (a dict or its JSON text); None when it is not one."""
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, ValueError):
            return None
    if not (isinstance(test_cases, dict) and "inputs" in test_cases and "outputs" in test_cases):
        return None
    return Problem(
        test_cases.get("fn_name"), tuple(test_cases["inputs"]), tuple(test_cases["outputs"])
    )


def _well_formed(problem: Problem, i: int) -> bool:
    """Whether verl gets past its bookkeeping of test i (else its whole run raises, lost)."""
    if i >= len(problem.outputs):
        return False
    text, want = problem.inputs[i], problem.outputs[i]
    if not (isinstance(text, str) and isinstance(want, str)):
        return False
    if problem.mode == "stdin":
        return True
    try:
        json.loads(want)
        for line in text.split("\n"):
            json.loads(line)
    except ValueError:
        return False
    return True


def _limits(timeout_s: int) -> sandbox.Limits:
    # verl's parent waits timeout + 1 s for the whole process; our interpreter's start is extra.
    wall = timeout_s + 1 + STARTUP_ALLOWANCE_S
    return sandbox.Limits(
        cpu_seconds=math.ceil(wall),
        wall_seconds=wall,
        memory_bytes=MEMORY_LIMIT_BYTES,
        max_output_bytes=MAX_OUTPUT_BYTES,
    )


def _reports(stdout: str) -> list[dict]:
    """The harness's JSON lines (a line that does not parse is skipped: the code wrote it)."""
    events = []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def run_tests(code: str, problem: Problem, *, timeout_s: int) -> tuple[list, dict]:
    """verl's `check_correctness` with `run_test`: the tests in order in one sandboxed process.

    Args:
      code: the extracted code.
      problem: the tests.
      timeout_s: verl's timeout: the alarm of each step; the process gets one more second.

    Returns:
      (results, metadata) as verl's run_test would give them: results up to and including the
      first failure, metadata {} when all pass. A lost run (an alarm, a crash, a limit of the
      sandbox, a malformed test before any failure) is ([-1] * len(inputs), None): verl's
      parent then has no metadata at all.
    """
    n = len(problem.inputs)
    lost = ([-1] * n, None)
    well_formed = 0
    while well_formed < n and _well_formed(problem, well_formed):
        well_formed += 1
    program = PRELUDE + (stdin_program(code) if problem.mode == "stdin" else code)
    job = {
        "mode": problem.mode,
        "program": program,
        "fn_name": problem.fn_name,
        "solution_class": "class Solution" in code,
        "inputs": list(problem.inputs[:well_formed]),
        "timeout_s": timeout_s,
    }
    limits = _limits(timeout_s)
    files = {"code_harness.py": _HARNESS, "job.json": json.dumps(job)}
    result = sandbox.run_python(_BOOTSTRAP, files=files, limits=limits)
    events = _reports(result.stdout)
    for key in ("compile_error", "method_error"):
        found = next((e[key] for e in events if key in e), None)
        if found is not None:
            return [-2], {"error": found["error"], "traceback": clean_traceback(found["traceback"])}
    by_test = {}
    for event in events:
        by_test.setdefault(event.get("test"), event)  # a forked child may report too: first wins
    results = []
    for i in range(n):
        event = by_test.get(i)
        if i >= well_formed or event is None:
            return lost
        if "error" in event:
            meta = {"error": event["error"], "traceback": clean_traceback(event["traceback"])}
            return results + [-1], meta
        if problem.mode == "stdin":
            output, passed = event["stdout"], stdout_matches(event["stdout"], problem.outputs[i])
            shown_inputs = truncate(problem.inputs[i])
        else:
            output, passed = (
                event["json"],
                returns_match(_untag(event["value"]), expected_return(problem.outputs[i])),
            )
            text = problem.inputs[i]
            size = 300 // (text.count("\n") + 1)
            shown_inputs = "\n".join(truncate(line, size) for line in text.strip().split("\n"))
        results.append(passed)
        if not passed:
            return results, {
                "output": truncate(output, 200),
                "expected": truncate(problem.outputs[i], 200),
                "inputs": shown_inputs,
                "error_message": _WRONG,
            }
    if not any("done" in e for e in events):
        return lost
    return results, {}


def compute_score(
    completion: str,
    test_cases,
    continuous: bool = False,
    *,
    first_pass_timeout_s: int = FIRST_PASS_TIMEOUT_S,
    per_test_timeout_s: int = PER_TEST_TIMEOUT_S,
):
    """verl's `prime_code.compute_score`: (score, metadata) of a completion on its tests.

    Args:
      completion: the decoded completion (markdown code blocks allowed).
      test_cases: the ground truth, JSON text or a dict ({"inputs", "outputs"[, "fn_name"]}).
      continuous: partial credit over the first 10 tests (verl's default_compute_score passes
        True); False returns only full passes, and raises for anything else, as verl does.
      first_pass_timeout_s, per_test_timeout_s: verl's 5 s and 10 s (tests shorten them).

    Returns:
      (True, {}) when every test passes the first pass; else (fraction of the first 10 tests
      that pass, a metadata dict per test); (False, None) for a malformed ground truth.

    Raises:
      ValueError: continuous=False and a test fails (verl: UnboundLocalError).
    """
    code = extract_code(completion)
    problem = parse_problem(test_cases)
    if problem is None:
        _log.warning("code reward: malformed ground truth %r; scored False", str(test_cases)[:200])
        return False, None
    results, metadata = run_tests(code, problem, timeout_s=first_pass_timeout_s)
    if metadata is not None and all(r is True for r in results):
        return True, metadata
    if not continuous:
        raise ValueError(
            "prime_code compute_score(continuous=False) on a completion that fails a test: "
            "verl 0.9.1 raises UnboundLocalError there; its default_compute_score passes "
            "continuous=True"
        )
    if len(problem.outputs) < len(problem.inputs):
        # verl builds the per-test cases from outputs[i] for every input: IndexError, caught.
        _log.warning("code reward: fewer outputs than inputs in the ground truth; scored False")
        return False, None
    count = min(len(problem.inputs), CONTINUOUS_TESTS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(count, 1)) as pool:
        runs = list(
            pool.map(
                lambda i: run_tests(code, problem.alone(i), timeout_s=per_test_timeout_s),
                range(count),
            )
        )
    metadata_list, passed, total = [], 0, 0
    for i, (res, meta) in enumerate(runs):
        meta = dict(meta or {})
        meta["test_case"] = {
            "input": str(problem.inputs[i]),
            "output": str(problem.outputs[i]),
            "res": str(res),
        }
        metadata_list.append(meta)
        passed += sum(r is True for r in res)
        total += len(res)
    return passed / (total or 1), metadata_list
