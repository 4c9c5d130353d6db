"""grpo_jax.rewards.sandbox_fusion against verl 0.9.1's, through a fake SandboxFusion server.

The server (`FakeSandboxFusion`, an http.server in a thread of this process) implements
SandboxFusion's /run_code for Python by running the code in grpo_jax.sandbox, and records each
request. Nothing remote is contacted.

* Parity: the same completions are scored by verl's `sandbox_fusion.compute_score` (in the
  reference worker, over HTTP to the fake server) and by ours; scores, per-test statuses and
  the request payloads must be equal (the call-based harness is each side's own text).
* Where verl's two paths agree (exact stdout, code in a python block), SandboxFusion and the
  local prime_code path (rewards/code.py) give the same score.
* The client's own behaviour: retries, a clear error naming the URL when the service is down,
  the config section and its wiring into default_compute_score through the reward workers.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
import reference

from grpo_jax import config, loading, sandbox
from grpo_jax.data import prompts
from grpo_jax.rewards import code, sandbox_fusion, scorers
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool


class FakeSandboxFusion:
    """SandboxFusion's run_code on localhost, with grpo_jax.sandbox as the executor.

    Attributes:
      url: the run_code endpoint.
      requests: every request body received, in order.
      fail_next: HTTP codes to answer the next requests with, instead of running them.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_next: list[int] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                if owner.fail_next:
                    self.send_error(owner.fail_next.pop(0))
                    return
                if self.path != "/run_code":
                    self.send_error(404)
                    return
                reply = json.dumps(owner.run(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def run(body: dict) -> dict:
        """A run_code response: Python has no compile step, so compile_result is None."""
        assert body["language"] == "python"
        timeout = body["run_timeout"]
        memory_mb = body["memory_limit_MB"] or 1024
        limits = sandbox.Limits(
            cpu_seconds=timeout, wall_seconds=timeout + 1.0, memory_bytes=memory_mb << 20
        )
        result = sandbox.run_python(body["code"], stdin=body["stdin"] or "", limits=limits)
        return_code = result.exit_code if result.exit_code is not None else -(result.signal or 9)
        if result.status == "timeout":
            # Over its time limit a run is killed: the CPU limit's SIGXCPU or the wall limit's
            # SIGKILL fires first depending on the machine's load, so the stand-in reports the
            # kill alike (both clients of one parity test must see the same response).
            return_code = -9
        return {
            "status": "Success" if result.status == "ok" else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": {
                "status": "TimeLimitExceeded" if result.status == "timeout" else "Finished",
                "execution_time": result.wall_seconds,
                "return_code": return_code,
                "stdout": result.stdout,
                "stderr": result.stderr,
            },
            "executor_pod_name": None,
            "files": {},
        }

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server():
    fake = FakeSandboxFusion()
    yield fake
    fake.close()


ADD = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
CALL = {"fn_name": "add", "inputs": ["1\n2", "5\n5"], "outputs": ["3", "10"]}
TWELVE = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i * i}\n" for i in range(12)]}
ASSERTS = {"assert_case": ["assert f(2) == 4", "assert f(3) == 6"]}


def _block(program: str) -> str:
    return f"Solution:\n```python\n{program}\n```\n"


STDIN_CASES = {
    "correct": ("a, b = map(int, input().split())\nprint(a + b)", ADD),
    "wrong": ("a, b = map(int, input().split())\nprint(a - b)", ADD),
    "partial": ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", ADD),
    "runtime_error": ("a, b = map(int, input().split())\nprint(a // (b - 4))", ADD),
    "syntax_error": ("def f(:\n    pass", ADD),
    "fails_0_of_12": ("n = int(input())\nprint(n * n if n else 1)", TWELVE),
}
OTHER_CASES = {
    "call_correct": (_block("def add(a, b):\n    return a + b"), CALL),
    "call_solution": (
        _block("class Solution:\n    def add(self, a, b):\n        return a + b"),
        CALL,
    ),
    "call_raises": (_block("def add(a, b):\n    raise ValueError"), CALL),
    "call_missing": (_block("def plus(a, b):\n    return a + b"), CALL),
    "asserts": (_block("def f(x):\n    return 2 * x"), ASSERTS),
    "asserts_fail": (_block("def f(x):\n    return x * x"), ASSERTS),
    "plain_block": ("```\nprint(3)\n```", {"inputs": [""], "outputs": ["3"]}),
    "named_block": ("```py\nprint(3)\n```", {"inputs": [""], "outputs": ["3"]}),
    "no_block": ("print(3)", {"inputs": [""], "outputs": ["3"]}),
    "timeout": (_block("while True:\n    pass"), {"inputs": [""], "outputs": ["3"]}),
}


def _comparable(metadata: list, *, harness: bool) -> list:
    # Timings differ from run to run (and with them the raw response); a traceback through the
    # call-based harness names each side's own harness.
    drop = ("duration", "api_response") + (("stderr",) if harness else ())
    return [{k: v for k, v in m.items() if k not in drop} for m in metadata]


@pytest.mark.reference("verl")
def test_parity_with_verls_client(verl, server):
    cases = {k: (_block(p), json.dumps(gt)) for k, (p, gt) in STDIN_CASES.items()}
    cases |= {k: (c, json.dumps(gt)) for k, (c, gt) in OTHER_CASES.items()}
    cases["bad_json"] = (_block("print(1)"), "{not json")
    fn = reference.fn("verl.utils.reward_score.sandbox_fusion:compute_score")
    kw = {"continuous": True, "timeout": 2}
    del server.requests[:]
    theirs = verl.run(tuple(fn(server.url, None, 1024, c, gt, **kw) for c, gt in cases.values()))
    their_requests = sorted(json.dumps(r, sort_keys=True) for r in server.requests)
    del server.requests[:]
    score = sandbox_fusion.compute_score
    ours = [score(server.url, None, 1024, c, gt, **kw) for c, gt in cases.values()]
    our_requests = sorted(json.dumps(r, sort_keys=True) for r in server.requests)
    for name, (our_score, our_meta), (their_score, their_meta) in zip(cases, ours, theirs.value):
        assert (name, our_score, type(our_score)) == (name, their_score, type(their_score))
        harness = name.startswith("call")
        assert (name, _comparable(our_meta, harness=harness)) == (
            name,
            _comparable(their_meta, harness=harness),
        )
    scores = dict(zip(cases, (s for s, _ in ours)))
    assert scores["correct"] == 1.0 and scores["partial"] == pytest.approx(2 / 3)
    assert scores["fails_0_of_12"] == 0.9 and scores["call_correct"] == 1.0
    assert scores["asserts"] == 1.0 and scores["asserts_fail"] == 0.5 and scores["timeout"] == 0
    # The requests are verl's, field for field, but for the call-based harness's text.
    assert len(our_requests) == len(their_requests)
    for ours_r, theirs_r in zip(our_requests, their_requests):
        ours_r, theirs_r = json.loads(ours_r), json.loads(theirs_r)
        if "_SANDBOX_FN_NAME" in theirs_r["code"]:
            ours_r["code"] = theirs_r["code"] = None
        assert ours_r == theirs_r


def test_sandbox_fusion_agrees_with_the_local_path(server):
    # verl's two paths agree on exact stdout of code in a python block.
    for name, (program, gt) in STDIN_CASES.items():
        remote, _ = sandbox_fusion.compute_score(
            server.url, None, 1024, _block(program), json.dumps(gt), continuous=True
        )
        local, _ = code.compute_score(_block(program), json.dumps(gt), continuous=True)
        assert (name, remote) == (name, float(local))


def test_default_compute_score_uses_the_url(server):
    program, gt = STDIN_CASES["partial"]
    del server.requests[:]
    got = scorers.default_compute_score(
        "taco", _block(program), json.dumps(gt), sandbox_fusion_url=server.url, memory_limit_mb=256
    )
    assert got == pytest.approx(2 / 3)
    assert len(server.requests) == 3 and {r["memory_limit_MB"] for r in server.requests} == {256}


def test_retries_then_answers(server, monkeypatch):
    monkeypatch.setattr(sandbox_fusion, "RETRY_DELAY_S", 0.01)
    server.fail_next[:] = [503, 504]
    response = sandbox_fusion.run_code(
        server.url, "print(1)", stdin="", timeout_s=2, memory_limit_mb=None
    )
    assert response["run_result"]["stdout"] == "1\n"


def test_service_errors_name_the_url(server, monkeypatch):
    monkeypatch.setattr(sandbox_fusion, "RETRY_DELAY_S", 0.01)
    server.fail_next[:] = [504] * sandbox_fusion.ATTEMPTS
    with pytest.raises(sandbox_fusion.SandboxFusionError, match="unreachable after 3 attempts"):
        sandbox_fusion.run_code(server.url, "print(1)", stdin="", timeout_s=2, memory_limit_mb=1)
    bad_path = server.url.replace("/run_code", "/nope")
    with pytest.raises(sandbox_fusion.SandboxFusionError, match=f"{bad_path}.*HTTP 404"):
        sandbox_fusion.run_code(bad_path, "print(1)", stdin="", timeout_s=2, memory_limit_mb=1)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
    with pytest.raises(sandbox_fusion.SandboxFusionError, match=f"{closed} is unreachable"):
        scorers.default_compute_score(
            "apps", _block("print(3)"), json.dumps(ADD), sandbox_fusion_url=closed
        )


def test_config_section_and_wiring(server):
    with pytest.raises(config.ConfigError, match="reward.sandbox_fusion.url"):
        config.SandboxFusionConfig(url="host:8080/run_code")
    with pytest.raises(config.ConfigError, match="reward.sandbox_fusion.max_concurrent"):
        config.SandboxFusionConfig(max_concurrent=0)
    sf = config.SandboxFusionConfig(url=server.url, max_concurrent=3, memory_limit_mb=512)
    reward = loading.reward_fn(config.RewardConfig(num_workers=2, sandbox_fusion=sf))
    (bound,) = reward.fns
    assert bound.keywords == {
        "sandbox_fusion_url": server.url,
        "concurrent_semaphore": sandbox_fusion.RequestLimit(2),  # 3 over 2 workers, rounded up
        "memory_limit_mb": 512,
    }
    with pytest.raises(ValueError, match="does not include"):
        only_gsm8k = "grpo_jax.rewards.scorers:gsm8k_score"
        loading.reward_fn(config.RewardConfig(fn=only_gsm8k, sandbox_fusion=sf))
    # Through the reward worker processes, as the trainer scores a batch.
    program, gt = STDIN_CASES["partial"]
    examples = [prompts.Example("p", json.dumps(gt), "codecontests")] * 2
    solutions = [_block(program), _block(STDIN_CASES["correct"][0])]
    with reward_pool.Pool(1, timeout_s=60) as pool:
        result = reward_fns.score_batch(reward, solutions, examples, pool=pool)
    assert result.scores_B == [pytest.approx(2 / 3), 1.0]
