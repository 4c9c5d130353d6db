"""Code-execution reward on a SandboxFusion service: verl 0.9.1's `reward_score.sandbox_fusion`.

With `reward.sandbox_fusion.url` set (verl's name), `scorers.default_compute_score` sends the
code sources ("codecontests", "apps", "codeforces", "taco") here instead of running them in
grpo_jax's local sandbox (rewards/code.py). SandboxFusion (github.com/bytedance/SandboxFusion)
runs code behind an HTTP API; `run_code` POSTs to the URL (the full endpoint, e.g.
"http://host:8080/run_code") verl's request:

    {"compile_timeout", "run_timeout", "code", "stdin", "memory_limit_MB", "language": "python",
     "files": {}, "fetch_files": []}

and reads its response: {"status": "Success" | "Failed" | "SandboxError", "compile_result",
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout",
"stderr", "execution_time"}}.

verl's rules, reproduced here:
  * the code is the last ```python block; else the text after the first "```" (up to the next),
    without a first line that is a bare language name; a completion with no "```" scores
    (0.0, [{"error": "Invalid completion (missing code block)"}]).
  * every test is a request (all at once, under `concurrent_semaphore`), `timeout` (10 s) both
    to compile and to run. A call-based test (fn_name) wraps the code in a harness
    (`call_harness`) that reads one JSON argument a line from stdin and prints the result
    (json.dumps for dict, list, tuple, None and bool, str() otherwise); its errors print
    nothing, so they read as wrong answers.
  * a test passes when the run finishes with status "Success" and its stdout, right-stripped
    of newlines, equals the expected output so stripped (only exact text: none of
    prime_code's whitespace or float rules); "assert_case" tests pass on any success.
  * results: True, False, -1 (sandbox error), -2 (runtime error), -3 (timeout), -4 (compile
    error, which also marks every later test); `continuous` scores the first 10, else all.
  * the return is (score float, a metadata dict per test with verl's keys).

Deliberate differences from verl:
  * an unreachable service raises `SandboxFusionError` naming the URL, after retries (3
    attempts, 1 s then 2 s apart) on connection errors, timeouts and HTTP 502/503/504; any
    other HTTP error raises at once. verl retries only a 504 and scores any failed request -1,
    so a service that is down silently scores every completion 0.
  * `concurrent_semaphore` may be any context manager; the trainer passes a
    `RequestLimit` (per reward worker process) where verl passes a multiprocessing Manager's
    semaphore shared by all its workers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
import urllib.error
import urllib.request

from grpo_jax.rewards import code as code_reward

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10  # verl: compile and run timeout of each test
API_TIMEOUT_S = 10  # verl: added to the two timeouts for the whole request
ATTEMPTS = 3
RETRY_DELAY_S = 1.0  # the n-th retry waits n times this
_RETRY_HTTP = (502, 503, 504)
_MAX_WORKERS = 32


class SandboxFusionError(RuntimeError):
    """The SandboxFusion service could not be reached or answered with an error."""


@dataclasses.dataclass(frozen=True)
class RequestLimit:
    """At most `max_concurrent` requests in flight in this process (reward.sandbox_fusion).

    A frozen dataclass, so it travels to the reward worker processes by value; each process
    holds one semaphore per limit.
    """

    max_concurrent: int

    def __post_init__(self):
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent={self.max_concurrent} must be >= 1")

    def __enter__(self):
        _semaphore(self.max_concurrent).acquire()
        return self

    def __exit__(self, *exc):
        _semaphore(self.max_concurrent).release()


_SEMAPHORES: dict[int, threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()


def _semaphore(n: int) -> threading.BoundedSemaphore:
    with _SEMAPHORES_LOCK:
        return _SEMAPHORES.setdefault(n, threading.BoundedSemaphore(n))


def extract_code(completion: str) -> str | None:
    """The code of a completion as verl's sandbox_fusion takes it; None without any "```"."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    block = completion.split("```")[1]
    if "\n" in block:
        first, rest = block.split("\n", 1)
        if first.strip().isalpha():  # a language name
            block = rest
    return block


_CALL_HARNESS = """
{prelude}
# --- the completion ---
{code}
# --- end of the completion ---

def _grpo_jax_call(name):
    raw = sys.stdin.read()
    args = []
    if raw.strip():
        try:
            args = [json.loads(line) for line in raw.split("\\n")]
        except json.JSONDecodeError as e:
            sys.stderr.write(f"bad JSON input: {{e}}\\n")
            return None, True
    try:
        target = None
        if name in globals():
            target = globals()[name]
        elif "Solution" in globals():
            target = getattr(globals()["Solution"](), name)
        if not target:
            sys.stderr.write(f"no function {{name!r}}\\n")
            return None, True
        return target(*args), False
    except Exception:
        sys.stderr.write(traceback.format_exc())
        return None, True

if __name__ == "__main__":
    _result, _failed = _grpo_jax_call({fn_name!r})
    if not _failed:
        if isinstance(_result, (dict, list, tuple, bool)) or _result is None:
            print(json.dumps(_result))
        else:
            print(str(_result))
"""


def call_harness(code: str, fn_name: str) -> str:
    """A call-based test's program: verl's wrapper around the code (see the module docstring)."""
    prelude = "import traceback\n" + code_reward.PRELUDE.rsplit("sys.setrecursionlimit", 1)[0]
    return _CALL_HARNESS.format(prelude=prelude, code=code, fn_name=fn_name)


def run_code(
    url: str,
    code: str,
    *,
    stdin: str | None,
    timeout_s: int,
    memory_limit_mb: int | None,
    language: str = "python",
) -> dict:
    """One POST to SandboxFusion's run_code; its JSON response.

    Raises:
      SandboxFusionError: naming the URL, when no attempt got an answer or the service
        answered with an HTTP error.
    """
    payload = json.dumps(
        {
            "compile_timeout": timeout_s,
            "run_timeout": timeout_s,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_limit_mb,
            "language": language,
            "files": {},
            "fetch_files": [],
        }
    ).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last = None
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_DELAY_S * attempt)
        request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=2 * timeout_s + API_TIMEOUT_S) as reply:
                body = reply.read()
        except urllib.error.HTTPError as e:
            if e.code not in _RETRY_HTTP:
                raise SandboxFusionError(f"SandboxFusion at {url} answered HTTP {e.code}") from e
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out
            last = repr(getattr(e, "reason", e))
        else:
            try:
                return json.loads(body)
            except ValueError as e:
                raise SandboxFusionError(
                    f"SandboxFusion at {url} answered with something that is not JSON: "
                    f"{body[:200]!r}"
                ) from e
        _log.warning("SandboxFusion at %s: attempt %d/%d failed: %s", url, attempt + 1,
                     ATTEMPTS, last)  # fmt: skip
    raise SandboxFusionError(
        f"SandboxFusion at {url} is unreachable after {ATTEMPTS} attempts ({last}); check "
        "reward.sandbox_fusion.url (the full run_code endpoint) or unset it to run the code "
        "in grpo_jax's local sandbox"
    )


def _status(response: dict, expected) -> tuple[object, dict]:
    """verl's reading of one response: (result, the fields of its metadata)."""
    compile_result = response.get("compile_result") or {}
    run_result = response.get("run_result") or {}
    fields = {
        "api_response": response,
        "api_status": response.get("status"),
        "compile_status": compile_result.get("status"),
        "compile_duration": compile_result.get("execution_time"),
        "compile_stderr": compile_result.get("stderr"),
        "run_status": run_result.get("status"),
        "stdout": run_result.get("stdout"),
        "stderr": run_result.get("stderr"),
        "exit_code": run_result.get("return_code"),
        "duration": run_result.get("execution_time"),
    }
    api, run_status = fields["api_status"], fields["run_status"]
    if api == "SandboxError":
        return -1, {**fields, "status": "sandbox_error"}
    if api == "Failed":
        compiled = fields["compile_status"]
        if compile_result and (
            compiled in ("Error", "TimeLimitExceeded")
            or (compiled == "Finished" and compile_result.get("return_code") != 0)
        ):
            status = "compile_timeout" if compiled == "TimeLimitExceeded" else "compile_error"
            return -4, {**fields, "status": status}
        if not run_result:
            return -1, {**fields, "status": "unknown_failure_state"}
        if run_status == "TimeLimitExceeded":
            return -3, {**fields, "status": "timeout"}
        if run_status == "Error" or (
            run_status == "Finished" and run_result.get("return_code") != 0
        ):
            return -2, {**fields, "status": "runtime_error"}
        return -1, {**fields, "status": "unknown_failure"}
    if api == "Success":
        if not (run_result and run_status == "Finished"):
            return -1, {**fields, "status": "unexpected_success_state"}
        stdout = fields["stdout"] if fields["stdout"] is not None else ""
        if expected is None or str(stdout).rstrip("\n") == str(expected).rstrip("\n"):
            return True, {**fields, "status": "success"}
        return False, {**fields, "status": "wrong_answer"}
    return -1, {**fields, "status": f"unknown_api_status_{api}"}


def check_correctness(
    url: str,
    in_outs: dict,
    generation: str,
    *,
    timeout_s: int = DEFAULT_TIMEOUT_S,
    memory_limit_mb: int | None = 1024,
    concurrent_semaphore=None,
) -> tuple[list, list[dict]]:
    """verl's sandbox_fusion check_correctness: every test at once; (results, metadata)."""
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    fn_name = in_outs.get("fn_name")
    n = len(inputs)
    if n == 0:
        return [], []
    asserts = in_outs.get("assert_case", [""] * n)
    if len(outputs) != n or len(asserts) != n:
        errors = [{"error": "Input/output count mismatch", "case_index": i} for i in range(n)]
        return [-1] * n, errors

    def one(i):
        program = generation + "\n\n" + asserts[i]
        if fn_name:
            program = call_harness(program, fn_name)
        stdin = None if inputs[i] is None else str(inputs[i])
        if concurrent_semaphore is not None:
            with concurrent_semaphore:
                response = run_code(url, program, stdin=stdin, timeout_s=timeout_s,
                                    memory_limit_mb=memory_limit_mb)  # fmt: skip
        else:
            response = run_code(url, program, stdin=stdin, timeout_s=timeout_s,
                                memory_limit_mb=memory_limit_mb)  # fmt: skip
        result, fields = _status(response, outputs[i])
        meta = {
            "case_index": i,
            "input": stdin,
            "expected_output": str(outputs[i]) if outputs[i] else None,
            "api_request_error": None,
            **fields,
        }
        return result, meta

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(n, _MAX_WORKERS)) as pool:
        done = list(pool.map(one, range(n)))
    results = [r for r, _ in done]
    metadata = [m for _, m in done]
    if -4 in results:  # verl: a compile error marks every later test
        first = results.index(-4)
        for i in range(first + 1, n):
            if results[i] != -4:
                results[i] = -4
                metadata[i]["status"] = "compile_error_skipped"
    return results, metadata


def compute_score(
    sandbox_fusion_url: str,
    concurrent_semaphore,
    memory_limit_mb: int | None,
    completion: str,
    test_cases,
    continuous: bool = False,
    timeout: int = DEFAULT_TIMEOUT_S,
) -> tuple[float, list[dict]]:
    """verl's sandbox_fusion.compute_score, with its signature: (score, metadata list).

    Raises:
      SandboxFusionError: the service is unreachable (verl scores that 0).
    """
    solution = extract_code(completion)
    if solution is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except ValueError:
            return 0.0, [{"error": "Invalid test_cases JSON format"}]
    if isinstance(test_cases, dict) and isinstance(test_cases.get("assert_case"), list):
        test_cases.setdefault("inputs", [""] * len(test_cases["assert_case"]))
        test_cases.setdefault("outputs", [None] * len(test_cases["assert_case"]))
    elif not test_cases or "inputs" not in test_cases or "outputs" not in test_cases:
        return 0.0, [{"error": "Invalid test_cases structure (missing inputs/outputs)"}]
    results, metadata = check_correctness(
        sandbox_fusion_url,
        test_cases,
        solution,
        timeout_s=timeout,
        memory_limit_mb=memory_limit_mb,
        concurrent_semaphore=concurrent_semaphore,
    )
    if not results:
        return 0.0, metadata
    counted = results[: code_reward.CONTINUOUS_TESTS] if continuous else results
    return sum(r is True for r in counted) / len(counted), metadata
