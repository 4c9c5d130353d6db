"""vLLM sidecar: rollouts from a stock vLLM OpenAI-compatible server fed the trainer's weights.

This module owns the `rollout.name = "vllm"` path: `VLLMSidecar` (server lifecycle, weight
push, generation), with `VLLMConfig` (the `rollout.vllm` config section as a frozen
dataclass), its errors and `check_fresh` (refuses to train on a rollout sampled under older
weights) from `vllm_config`, and the answers' checks and layout from `vllm_responses`. It never
imports vllm: the server runs in its own Python environment (its own torch and transformers) as
a subprocess, and this module talks to it over HTTP with `requests`, every call with a timeout.

Protocol (checked against vllm 0.32; the server needs `VLLM_SERVER_DEV_MODE=1`, which the sidecar
sets, for the two dev endpoints):
  * `GET /health` -> 200 when ready.
  * Weight push, `weight_transfer="disk"` (the default): the params are written with
    `hf_export.save(..., untie_embeddings=True)` (sharded safetensors, one tensor at a time, so it
    also works when FSDP splits the params over hosts) to a fresh directory, then
    `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
    (answers `{"results": [null, ...]}`, one per worker) and `POST /reset_prefix_cache` (answers
    `{"success": true}`) so no KV block computed under the old weights is reused. The server is
    always started from such an export, never from the original HF directory: vLLM builds its
    module tree from config.json at start-up, and a tied config has no lm_head parameter, so
    reloading into it silently keeps the old head.
  * Weight push, `weight_transfer="nccl"` (GPU): vLLM 0.32's in-memory transfer (the server runs
    with `--weight-transfer-config '{"backend": "nccl"}'`). After the start-up export, `start`
    reads `GET /get_world_size`, mints an ncclUniqueId and `POST /init_weight_transfer_engine`s
    it while joining the NCCL group as rank 0 (grpo_jax/rollout/nccl_transfer.py). Each push is
    `POST /start_weight_update`, `POST /update_weights` (names, dtypes and shapes) while every HF
    tensor is gathered on device (`hf_export.device_tensor`) and `ncclBroadcast`, then
    `POST /finish_weight_update {"weight_version": "<v>"}` and `/reset_prefix_cache`; nothing
    touches the disk or the host. When the transfer cannot be set up (no CUDA backend or no
    libnccl here, the endpoints missing, the server refusing the init) the sidecar logs a warning
    naming the reason and pushes through disk exports instead (`weight_transfer`,
    `weight_transfer_note`). A server that dies is restarted from the latest disk export, which
    is older than the weights pushed in memory since: the rollouts it samples before the next push
    carry that older `weights_version`, so `check_fresh` refuses them instead of training on them.
  * LoRA (grpo_jax/models/lora.py; the params carry adapters): `lora_sync="merged"` pushes the
    merged weights (base + scale * A @ B) through the path above, and the server knows nothing
    of LoRA. `lora_sync="adapter"` starts the server from an export of the base with
    `--enable-lora --max-lora-rank R --max-loras 1` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`,
    and each push writes the adapter alone as a PEFT directory (hf_export.save_adapter) and
    `POST /v1/load_lora_adapter {"lora_name": "policy-v<k>", "lora_path": DIR}` (answers a
    plain-text 200), then `/reset_prefix_cache` and `POST /v1/unload_lora_adapter` of the
    previous name; generation requests name the current adapter as their model. A restarted
    server loads the current adapter again. R is the smallest rank vLLM accepts (1, 8, 16, 32,
    64, 128, 256, 320, 512) that holds the adapter's.
  * Generation: one `POST /v1/completions` per prompt (prompt = its token ids, n samples) with
    `return_token_ids`, `logprobs=0` (the sampled token's log-prob only) and
    `return_tokens_as_token_ids` (the server runs with `--skip-tokenizer-init`). One request per
    prompt because vLLM seeds sample j of a request with `seed + j`: prompt i gets seed
    `base + i * n`, so no two rows of a batch share random draws, and the same rng gives the same
    rollout on the same server. The requests go out concurrently, so vLLM batches them.
  * Stopping: `ignore_eos=True` plus `stop_token_ids=eos_token_ids`, and the server runs with
    `--generation-config vllm`, so exactly the caller's EOS ids end a response, as in the native
    sampler (the checkpoint's generation_config.json adds neither stop ids nor sampling defaults).

Log-probs. The server runs with `--logprobs-mode` = `VLLMConfig.logprobs_mode` (config
rollout.logprobs_mode; verl passes the same field to vLLM), by default `processed_logprobs`: the
log-softmax of the logits after temperature and after top-k/top-p filtering (renormalised over
the kept tokens), at the sampled token; at temperature 0 vLLM samples greedily and returns
log_softmax(logits). The native sampler records the same quantity for each mode
(grpo_jax/sampler.py), so the two engines agree. vLLM's own default (`raw_logprobs`) ignores
the temperature. With top-k and top-p off, processed_logprobs is log_softmax(logits /
temperature), what the trainer recomputes as the old log-probs (verl semantics); with them on it
is log_softmax(logits / T) - log(kept probability mass), the log-probability of the
distribution the token was drawn from. The `*_logits` modes return logits, not log-probs.

Failures raise a `VLLMSidecarError` subclass whose message names the cause and the server log
path: `VLLMStartupError` (would not start or become healthy), `VLLMServerDiedError` (exited and
the restart limit is used up, or an attached server is gone), `VLLMTimeoutError` (a live server
did not answer in time), `VLLMResponseError` (HTTP error or malformed output). A managed server
that dies (vLLM answers HTTP 500 and exits when its engine dies) is restarted from the latest
weight export, with exponential back-off, at most `max_restarts` times per call, and the call is
retried; the weights version is unchanged.

Lifecycle: the server is started in a new process group and stopped by PID (SIGTERM to the group,
SIGKILL after `stop_timeout_s`) by `close()`, at interpreter exit (atexit, which also runs when
the trainer dies of an exception), and, on Linux, by the kernel when the trainer process is killed
outright (PR_SET_PDEATHSIG, set by a tiny launcher that then execs the server).
"""

import atexit
import collections
import concurrent.futures
import logging
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import requests

from grpo_jax import model as model_lib
from grpo_jax import sampler
from grpo_jax.models import hf, lora
from grpo_jax.rollout import nccl_transfer
from grpo_jax.rollout.vllm_config import (
    VLLM_LORA_RANKS,
    StaleRolloutError,
    VLLMConfig,
    VLLMResponseError,
    VLLMServerDiedError,
    VLLMSidecarError,
    VLLMStartupError,
    VLLMTimeoutError,
    check_fresh,
)
from grpo_jax.rollout.vllm_responses import Request, build_rollout

__all__ = [
    "StaleRolloutError", "VLLMConfig", "VLLMResponseError", "VLLMServerDiedError",
    "VLLMSidecarError", "VLLMStartupError", "VLLMTimeoutError", "check_fresh", "Request",
    "build_rollout", "VLLMSidecar",
]

log = logging.getLogger(__name__)


_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


_HEALTH_POLL_S = 0.5
_LOG_TAIL_LINES = 30
_ENGINE_DEATH_GRACE_S = 10.0
# Runs in the sidecar interpreter, then execs the server in place (same PID). On Linux it first
# asks the kernel to SIGTERM the server when the trainer dies, even by SIGKILL (PR_SET_PDEATHSIG,
# which survives exec), and exits if the trainer (argv[1]) is already gone.
_LAUNCHER = """import ctypes, os, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(sys.argv[1]):
        sys.exit("grpo_jax: the trainer exited before the vLLM server started")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class _ServerGone(Exception):
    """Internal: the managed server process is not running (restartable)."""


class VLLMSidecar:
    """A vLLM server that samples GRPO rollouts with the trainer's current weights.

    Usage:
      sidecar = VLLMSidecar(vllm_config, model_config, workdir)
      sidecar.start(params)                       # weights version 0
      rollout = sidecar.sample(prompt_ids, prompt_mask, rng, n=G, max_new_tokens=R, ...)
      ... train on the rollout (after check_fresh(rollout, sidecar.weights_version)) ...
      sidecar.push_weights(new_params)            # weights version 1, returns sync seconds
      sidecar.close()                             # or use it as a context manager

    Attributes:
      weights_version: version of the latest weights pushed (-1 before `start`).
      server_weights_version: version the server holds; older than `weights_version` only after a
        restart under weight_transfer="nccl" (see the module docstring), and what rollouts carry.
      last_sync_s: seconds the last weight push took (export + reload + cache reset, or the
        NCCL round).
      restarts: restarts of the managed server so far.
      log_path: the server log (stdout and stderr of every start, appended).
      weight_transfer: the push path in use, "disk" or "nccl" ("disk" after a fallback).
      weight_transfer_note: why a requested "nccl" fell back to "disk" ("" otherwise).
    """

    def __init__(
        self, config: VLLMConfig, model_config: model_lib.ModelConfig, workdir: str | os.PathLike
    ):
        """Prepares (does not start) a sidecar.

        Args:
          config: the `rollout.vllm` section.
          model_config: the policy's model config (vocabulary and export layout).
          workdir: directory for the server log and the weight exports.

        Raises:
          ValueError: a model vLLM would serve with other shapes than JAX.
        """
        c = model_config
        if c.arch == "qwen2" and c.num_heads * c.head_dim != c.hidden_size:
            # vLLM's Qwen2 (0.32) ignores config.json's head_dim and uses hidden_size // heads.
            raise ValueError(
                f"vLLM serves a qwen2 model only with num_heads * head_dim == hidden_size; got "
                f"{c.num_heads} * {c.head_dim} != {c.hidden_size}"
            )
        if config.lora_sync == "adapter" and not c.lora_rank:
            raise ValueError(
                "VLLMConfig.lora_sync='adapter' pushes LoRA adapters, but the model has none "
                "(ModelConfig.lora_rank=0)"
            )
        if config.lora_sync == "adapter" and c.lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, got "
                f"lora_rank={c.lora_rank}: use lora_sync='merged'"
            )
        self.config = config
        self.model_config = model_config
        self.workdir = pathlib.Path(workdir)
        self.log_path = self.workdir / "vllm_server.log"
        self.weights_version = -1
        self.server_weights_version = -1
        self.last_sync_s = math.nan
        self.restarts = 0
        self.weight_transfer = "disk"
        self.weight_transfer_note = ""
        self._export_dir: pathlib.Path | None = None
        self._export_version = -1
        # lora_sync="adapter": the current adapter's directory and served name, and the names
        # the running server has loaded.
        self._adapter_dir: pathlib.Path | None = None
        self._lora_name = ""
        self._loaded_adapters: list[str] = []
        self._comm: nccl_transfer.Communicator | None = None
        self._comm_device: jax.Device | None = None  # set while "nccl" is wanted and possible
        self._proc: subprocess.Popen | None = None
        self._model_name = "grpo_jax-policy"
        self._atexit_registered = False
        self._closed = False
        if config.url:
            self.url = config.url.rstrip("/")
            self._model_name = ""  # Read from /v1/models on start.
        else:
            self.url = ""
        self._max_model_len = config.max_model_len or model_config.max_position_embeddings

    # ----------------------------------------------------------------------------------------
    # LIFECYCLE

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def managed(self) -> bool:
        """True when this object started (and may restart) the server process."""
        return not self.config.url

    @property
    def pid(self) -> int | None:
        """PID of the managed server process, or None when not running or attached."""
        return None if self._proc is None else self._proc.pid

    def start(self, params) -> None:
        """Exports `params` as weights version 0 and starts (or attaches to) the server.

        Args:
          params: the policy parameters (`model.init_params` / `load_hf_checkpoint` layout).

        Raises:
          VLLMStartupError: the server exits or is not healthy within startup_timeout_s.
          VLLMSidecarError: an attached server is unreachable or rejects the weights.
        """
        if self.weights_version >= 0:
            raise VLLMSidecarError(
                f"sidecar already started (weights version {self.weights_version})"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if self.config.weight_transfer == "nccl":
            reason = nccl_transfer.unavailable_reason()
            if reason is None:
                self._comm_device = _transfer_device(params)
            else:
                self._fall_back(reason)
        base, adapters = self._split(params)
        export_dir = self._export(base, version=0)
        if adapters is not None:  # loaded by _launch / below, once the server runs
            self._adapter_dir = self._export_adapter(adapters, version=0)
            self._lora_name = _adapter_name(0)
        if self.managed:
            self._export_dir, self._export_version = export_dir, 0
            self._launch()
        else:
            self._wait_healthy(deadline=time.monotonic() + self.config.startup_timeout_s)
            self._model_name = self._served_model_name()
            self._reload(export_dir)
            self._export_dir, self._export_version = export_dir, 0
            if adapters is not None:
                self._load_adapter()
        self.weights_version = self.server_weights_version = 0
        if self._comm_device is not None:
            self._open_transfer()
        log.info(
            "vLLM sidecar ready at %s (weights version 0, %.1fs)",
            self.url,
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        """Stops a managed server (process group: SIGTERM, then SIGKILL). Idempotent."""
        if self._comm is not None and not self.managed:
            # Best effort: let the attached server accept another trainer later.
            try:
                requests.post(f"{self.url}/shutdown_weight_transfer_engine", timeout=10)
            except requests.RequestException:
                pass
        self._closed = True
        self._close_transfer()
        self._stop_process()

    def _launch(self) -> None:
        """Starts the managed server from the latest export and waits until it is healthy."""
        assert self._export_dir is not None
        port = self.config.port or _free_port(self.config.host)
        self.url = f"http://{self.config.host}:{port}"
        flags = {
            "--model": str(self._export_dir),
            "--served-model-name": self._model_name,
            "--host": self.config.host,
            "--port": str(port),
            "--dtype": self.config.dtype,
            "--max-model-len": str(self._max_model_len),
            "--gpu-memory-utilization": str(self.config.gpu_memory_utilization),
            "--seed": str(self.config.seed),
            "--tensor-parallel-size": str(self.config.tensor_parallel_size),
            "--logprobs-mode": self.config.logprobs_mode,  # See the module docstring.
            "--generation-config": "vllm",  # Ignore the export's sampling defaults.
        }
        if self._comm_device is not None:
            flags["--weight-transfer-config"] = '{"backend": "nccl"}'
        switches = ["--skip-tokenizer-init"]
        env = dict(os.environ) | {"VLLM_SERVER_DEV_MODE": "1"}
        if self._adapter_mode:
            rank = min(r for r in VLLM_LORA_RANKS if r >= self.model_config.lora_rank)
            flags |= {"--max-lora-rank": str(rank), "--max-loras": "1"}
            switches.append("--enable-lora")
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        cmd = [self.config.python, "-c", _LAUNCHER, str(os.getpid()), "-m", _SERVER_MODULE]
        cmd += [*(x for kv in flags.items() for x in kv), *switches]
        cmd += self.config.extra_args
        env |= dict(self.config.env)
        with open(self.log_path, "ab") as f:
            f.write(f"\n===== grpo_jax: starting vLLM server: {' '.join(cmd)}\n".encode())
            f.flush()
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # Own process group: stop() kills its workers too.
                )
            except OSError as e:
                raise VLLMStartupError(
                    f"could not run the vLLM server interpreter {self.config.python!r}: {e}; "
                    f"server log: {self.log_path}"
                ) from e
        if not self._atexit_registered:
            atexit.register(self._stop_process)
            self._atexit_registered = True
        log.info(
            "started vLLM server pid %d at %s; log %s", self._proc.pid, self.url, self.log_path
        )
        try:
            self._wait_healthy(deadline=time.monotonic() + self.config.startup_timeout_s)
        except BaseException:
            self._stop_process()
            raise
        self._loaded_adapters = []
        if self._adapter_dir is not None:  # a (re)started server: load the current adapter
            self._load_adapter()

    def _wait_healthy(self, *, deadline: float) -> None:
        """Polls /health until 200; raises VLLMStartupError on exit or at the deadline."""
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise VLLMStartupError(
                    f"vLLM server exited with code {self._proc.returncode} before becoming "
                    f"healthy; server log: {self.log_path}\n{self._log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise VLLMStartupError(
                    f"vLLM server at {self.url} not healthy within "
                    f"{self.config.startup_timeout_s:.0f}s (startup_timeout_s); "
                    f"server log: {self._log_where()}\n{self._log_tail()}"
                )
            time.sleep(_HEALTH_POLL_S)

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own process group.
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("vLLM server pid %d ignored SIGTERM; killing it", proc.pid)
            _signal_group(pgid, signal.SIGKILL)
            proc.wait(timeout=self.config.stop_timeout_s)
        # Workers that outlived the server (e.g. after it was SIGKILLed) share its group.
        _signal_group(pgid, signal.SIGKILL)

    def _served_model_name(self) -> str:
        body = self._request("GET", "/v1/models", None, timeout=30)
        try:
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as e:
            raise VLLMResponseError(
                f"malformed /v1/models answer from {self.url}: {str(body)[:300]}; "
                f"server log: {self._log_where()}"
            ) from e

    def _with_restarts(self, what: str, fn):
        """Runs fn(); when the managed server has died, restarts it with back-off and retries."""
        attempt = 0
        while True:
            try:
                return fn()
            except _ServerGone as gone:
                if attempt >= self.config.max_restarts:
                    raise VLLMServerDiedError(
                        f"vLLM server died during {what} ({gone}) and was restarted "
                        f"{attempt} times in this call (max_restarts={self.config.max_restarts}); "
                        f"server log: {self.log_path}\n{self._log_tail()}"
                    ) from None
                delay = self.config.restart_backoff_s * 2**attempt
                attempt += 1
                log.warning(
                    "vLLM server died during %s (%s); restart %d/%d in %.1fs; log %s",
                    what,
                    gone,
                    attempt,
                    self.config.max_restarts,
                    delay,
                    self.log_path,
                )
                self._stop_process()
                self._close_transfer()  # its other ranks died with the server
                time.sleep(delay)
                self.restarts += 1
                try:
                    self._launch()
                except VLLMStartupError as e:
                    log.warning("restart %d of the vLLM server failed: %s", attempt, e)
                    continue
                self.server_weights_version = self._export_version
                if self._export_version < self.weights_version:
                    log.warning(
                        "the restarted vLLM server holds the disk export v%d, not the weights "
                        "v%d pushed over NCCL since; rollouts sampled before the next push are "
                        "stale (check_fresh refuses them)",
                        self.server_weights_version,
                        self.weights_version,
                    )
                if self._comm_device is not None:
                    self._open_transfer()

    # ----------------------------------------------------------------------------------------
    # HTTP

    def _request(
        self, method: str, path: str, body: Any, *, timeout: float, text: bool = False
    ) -> Any:
        """One HTTP call; returns the parsed JSON body (None for an empty 200), or with `text`
        the body as text (vLLM's LoRA endpoints answer plain text).

        Raises:
          _ServerGone: the managed server process is not running (or not reachable, then dies).
          VLLMServerDiedError: an attached server is unreachable.
          VLLMTimeoutError: no answer within `timeout` from a live server.
          VLLMResponseError: HTTP status >= 400 or a body that is not JSON.
        """
        if self._closed:
            raise VLLMSidecarError(f"the vLLM sidecar was closed; server log: {self._log_where()}")
        if self.managed and (self._proc is None or self._proc.poll() is not None):
            raise _ServerGone(self._exit_description())
        try:
            r = requests.request(method, f"{self.url}{path}", json=body, timeout=timeout)
        except requests.Timeout as e:
            if self.managed and self._proc is not None and self._proc.poll() is not None:
                raise _ServerGone(self._exit_description()) from e
            raise VLLMTimeoutError(
                f"vLLM server at {self.url} did not answer {method} {path} within {timeout:.0f}s; "
                f"raise rollout.vllm.request_timeout_s / sync_timeout_s if the batch is large; "
                f"server log: {self._log_where()}"
            ) from e
        except requests.ConnectionError as e:
            if not self.managed:
                raise VLLMServerDiedError(
                    f"attached vLLM server at {self.url} is unreachable ({e}); it is not "
                    f"restarted by grpo_jax; server log: {self._log_where()}"
                ) from e
            # A refused connection from a live process means it is going down: give it a moment.
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise VLLMServerDiedError(
                    f"vLLM server pid {self._proc.pid} is running but refuses connections at "
                    f"{self.url} ({e}); server log: {self.log_path}\n{self._log_tail()}"
                ) from e
            raise _ServerGone(self._exit_description()) from e
        if r.status_code >= 500 and self.managed:
            # vLLM answers 500 when its engine died, then shuts the API server down: restart it.
            try:
                self._proc.wait(timeout=_ENGINE_DEATH_GRACE_S)
                raise _ServerGone(f"{self._exit_description()} after HTTP {r.status_code}")
            except subprocess.TimeoutExpired:
                pass
        if r.status_code >= 400:
            raise VLLMResponseError(
                f"vLLM server answered {method} {path} with HTTP {r.status_code}: "
                f"{r.text[:500]}; server log: {self._log_where()}"
            )
        if text:
            return r.text
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError as e:
            raise VLLMResponseError(
                f"vLLM server answered {method} {path} with non-JSON: {r.text[:300]!r}; "
                f"server log: {self._log_where()}"
            ) from e

    def _exit_description(self) -> str:
        if self._proc is None:
            return "server process not running"
        return f"pid {self._proc.pid} exited with code {self._proc.returncode}"

    def _log_where(self) -> str:
        if self.managed:
            return str(self.log_path)
        return f"(attached server {self.url}: see the log of whoever started it)"

    def _log_tail(self) -> str:
        if not self.managed or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            tail = collections.deque(f, maxlen=_LOG_TAIL_LINES)
        return "last lines of the server log:\n" + "".join(tail)

    # ----------------------------------------------------------------------------------------
    # WEIGHTS

    def _export(self, params, *, version: int) -> pathlib.Path:
        """Writes params as an untied HF checkpoint under workdir/vllm_weights/v{version}."""
        export_dir = self.workdir / "vllm_weights" / f"v{version:06d}"
        if export_dir.exists():
            shutil.rmtree(export_dir)
        # Untied: vLLM reloads lm_head.weight only if config.json says the head is untied.
        hf.save(self.model_config, params, export_dir, untie_embeddings=True)
        return export_dir

    def _reload(self, export_dir: pathlib.Path) -> None:
        body = self._request(
            "POST",
            "/collective_rpc",
            {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(export_dir)},
                "timeout": self.config.sync_timeout_s,
            },
            timeout=self.config.sync_timeout_s,
        )
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results or any(r is not None for r in results):
            raise VLLMResponseError(
                f"reload_weights from {export_dir} failed: expected {{'results': [null, ...]}}, "
                f"got {str(body)[:500]}; is the server running with VLLM_SERVER_DEV_MODE=1? "
                f"server log: {self._log_where()}"
            )
        self._reset_prefix_cache(f"reloading {export_dir}")

    def _reset_prefix_cache(self, after: str) -> None:
        body = self._request("POST", "/reset_prefix_cache", None, timeout=60)
        if not (isinstance(body, dict) and body.get("success") is True):
            raise VLLMResponseError(
                f"reset_prefix_cache after {after} did not succeed: {body}; "
                f"server log: {self._log_where()}"
            )

    def push_weights(self, params) -> float:
        """Makes the server sample with `params` from now on; bumps `weights_version`.

        Args:
          params: the updated policy parameters; with LoRA `lora.attach(base, adapters)`
            (merged before the push, or the adapter alone: `lora_sync`).

        Returns:
          The sync time in seconds (export + reload + prefix-cache reset, or the NCCL round),
          also logged and kept in `last_sync_s`.
        """
        if self.weights_version < 0:
            raise VLLMSidecarError("push_weights before start(): call start(params) first")
        t0 = time.perf_counter()
        version = self.weights_version + 1
        params, adapters = self._split(params)
        if adapters is not None:
            self._push_adapter(adapters, version)
        elif self._comm is not None:
            try:
                self._push_nccl(params, version)
            except _ServerGone as gone:
                # The server (the group's other ranks) died: restart it from a disk export of
                # these params; the restart re-opens the transfer for the next push.
                log.warning("vLLM server died during NCCL weight push v%d (%s)", version, gone)
                self._close_transfer()
                self._push_disk(params, version)
        else:
            self._push_disk(params, version)
        self.weights_version = self.server_weights_version = version
        self.last_sync_s = time.perf_counter() - t0
        log.info(
            "vLLM weight sync v%d (%s) took %.2fs", version, self.weight_transfer, self.last_sync_s
        )
        return self.last_sync_s

    @property
    def _adapter_mode(self) -> bool:
        return self.config.lora_sync == "adapter"

    def _split(self, params) -> tuple[Any, Any]:
        """(the weights to export, the adapters to push or None) of the policy `params`: the
        params themselves without LoRA; with it the merged weights ("merged") or the base and
        the adapters ("adapter")."""
        base, adapters = lora.split(params)
        if adapters is None:
            if self._adapter_mode:
                raise VLLMSidecarError(
                    "lora_sync='adapter' needs params with LoRA adapters (lora.attach(base, "
                    "adapters)); got params without them"
                )
            return params, None
        if self._adapter_mode:
            return base, adapters
        return lora.merge(self.model_config, params), None

    def _export_adapter(self, adapters, *, version: int) -> pathlib.Path:
        """Writes the adapters as a PEFT directory under workdir/vllm_adapters/v{version}."""
        adapter_dir = self.workdir / "vllm_adapters" / f"v{version:06d}"
        if adapter_dir.exists():
            shutil.rmtree(adapter_dir)
        hf.save_adapter(self.model_config, adapters, adapter_dir)
        return adapter_dir

    def _load_adapter(self) -> None:
        """Loads the current adapter into the server, then unloads the ones loaded before."""
        body = {"lora_name": self._lora_name, "lora_path": str(self._adapter_dir),
                "load_inplace": True}  # fmt: skip
        self._request("POST", "/v1/load_lora_adapter", body, timeout=self.config.sync_timeout_s,
                      text=True)  # fmt: skip
        self._reset_prefix_cache(f"loading the LoRA adapter {self._adapter_dir}")
        for name in self._loaded_adapters:
            if name != self._lora_name:
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name},
                              timeout=self.config.sync_timeout_s, text=True)  # fmt: skip
        self._loaded_adapters = [self._lora_name]

    def _push_adapter(self, adapters, version: int) -> None:
        adapter_dir = self._export_adapter(adapters, version=version)
        previous, self._adapter_dir = self._adapter_dir, adapter_dir
        self._lora_name = _adapter_name(version)
        self._export_version = version  # a restart starts from the base and loads this adapter
        self._with_restarts(f"adapter push v{version}", self._load_adapter)
        if previous is not None and previous != adapter_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def _push_disk(self, params, version: int) -> None:
        export_dir = self._export(params, version=version)
        previous, self._export_dir = self._export_dir, export_dir
        self._export_version = version
        # A restart during the push starts from the new export, which is then already loaded.
        self._with_restarts(f"weight push v{version}", lambda: self._reload(export_dir))
        if previous is not None and previous != export_dir:
            shutil.rmtree(previous, ignore_errors=True)

    # ----------------------------------------------------------------------------------------
    # IN-MEMORY WEIGHT TRANSFER (NCCL)

    def _fall_back(self, reason: str) -> None:
        log.warning(
            "vLLM weight_transfer='nccl' is unavailable (%s); pushing weights through disk "
            "exports (weight_transfer='disk') instead",
            reason,
        )
        self._close_transfer()
        self._comm_device = None
        self.weight_transfer, self.weight_transfer_note = "disk", reason

    def _close_transfer(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()

    def _open_transfer(self) -> None:
        """Joins the server's workers in an NCCL group as rank 0, or falls back to disk."""
        try:
            body = self._request("GET", "/get_world_size", None, timeout=30)
            workers = int(body["world_size"])
        except (VLLMResponseError, _ServerGone, KeyError, TypeError, ValueError) as e:
            self._fall_back(
                f"the server has no usable GET /get_world_size (vLLM >= 0.32 mounts it with "
                f"VLLM_SERVER_DEV_MODE=1): {e}"
            )
            return
        world_size = workers + 1
        try:
            unique_id = nccl_transfer.new_unique_id()
        except (OSError, RuntimeError) as e:
            self._fall_back(f"ncclGetUniqueId failed: {e}")
            return
        init_info = nccl_transfer.worker_init_info(unique_id, world_size=world_size)
        timeout = self.config.sync_timeout_s
        # A plain POST, not _request: a refusal (HTTP 500, e.g. no --weight-transfer-config)
        # must be seen at once, while this thread may be blocked joining the NCCL group.
        server = _Background(
            lambda: requests.post(
                f"{self.url}/init_weight_transfer_engine",
                json={"init_info": init_info},
                timeout=timeout,
            )
        )
        trainer = _Background(lambda: _joined(unique_id, world_size, self._comm_device))
        deadline = time.monotonic() + timeout
        refused = None
        while not trainer.done.wait(0.05):
            if server.done.is_set():
                refused = _refusal(server)
                if refused:
                    break
            if time.monotonic() > deadline:
                break
        if not trainer.done.is_set():
            # ncclCommInitRank has no timeout: its (daemon) thread stays blocked.
            self._fall_back(
                refused
                or f"the NCCL rendezvous with {workers} vLLM workers did not complete "
                f"within {timeout:.0f}s (sync_timeout_s)"
            )
            return
        if trainer.error is not None:
            self._fall_back(f"joining the NCCL group failed: {trainer.error}")
            return
        self._comm = trainer.value
        server.done.wait(timeout)
        refused = _refusal(server) if server.done.is_set() else "no answer"
        if refused:
            self._fall_back(refused)
            return
        self.weight_transfer, self.weight_transfer_note = "nccl", ""
        log.info("vLLM weight transfer over NCCL with %d workers", workers)

    def _push_nccl(self, params, version: int) -> None:
        tensors = hf.hf_tensors(self.model_config, params, untie_embeddings=True)
        info = nccl_transfer.update_info(tensors)
        timeout = self.config.sync_timeout_s
        self._request("POST", "/start_weight_update", None, timeout=timeout)
        # The workers receive inside /update_weights, so it runs beside the broadcasts.
        update = _Background(
            lambda: self._request("POST", "/update_weights", {"update_info": info}, timeout=timeout)
        )
        for _, x in hf.iter_device_tensors(self.model_config, params, untie_embeddings=True):
            if update.done.is_set() and update.error is not None:
                raise update.error  # refused before receiving: do not wait in NCCL for it
            self._comm.broadcast(x)
            del x
        if not update.done.wait(timeout):
            raise VLLMTimeoutError(
                f"vLLM server did not finish /update_weights within {timeout:.0f}s "
                f"(sync_timeout_s); server log: {self._log_where()}"
            )
        if update.error is not None:
            raise update.error
        self._request(
            "POST", "/finish_weight_update", {"weight_version": str(version)}, timeout=timeout
        )
        self._reset_prefix_cache(f"the NCCL weight push v{version}")

    # ----------------------------------------------------------------------------------------
    # GENERATION

    def sample(
        self,
        prompt_ids,
        prompt_mask,
        rng: jax.Array,
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
    ) -> sampler.Rollout:
        """Samples n completions per prompt on the server; same contract as `sampler.sample`.

        Args:
          prompt_ids: [P,Tp] int, left-padded prompts.
          prompt_mask: [P,Tp] int or bool, 1 on real tokens.
          rng: a typed or legacy JAX key; it fixes the per-prompt server seeds.
          n: samples per prompt (G).
          max_new_tokens: R.
          temperature: 0 for greedy, else > 0.
          top_p: nucleus mass in (0, 1]; 1 is off (see the module docstring for log-probs).
          top_k: -1 or 0 is off, else >= 1.
          eos_token_ids: ids that end a response.
          pad_token_id: id for left padding and for response positions after the first EOS.

        Returns:
          A `sampler.Rollout` with the native layout (prompts left-padded to
          sampler.bucket_length(Tp) and repeated n times, rows of a prompt adjacent), tagged with
          the current `weights_version`.

        Raises:
          VLLMSidecarError subclasses, see the module docstring.
        """
        request = self.request(
            prompt_ids, prompt_mask, rng, n=n, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
        )  # fmt: skip
        choices = self.complete(request.bodies)
        return request.rollout(choices, weights_version=self.server_weights_version,
                               vocab_size=self.model_config.vocab_size,
                               log_where=self._log_where())

    def request(self, prompt_ids, prompt_mask, rng, *, n, max_new_tokens, temperature=1.0,
                top_p=1.0, top_k=-1, eos_token_ids=(), pad_token_id=0) -> "Request":
        """The checked generation request of `sample` (same arguments): one body per prompt,
        seeded from `rng` by the prompt's index, without the served model's name."""
        if self.weights_version < 0:
            raise VLLMSidecarError("sample before start(): call start(params) first")
        prompt_ids_PT = np.asarray(jax.device_get(prompt_ids)).astype(np.int32)
        prompt_mask_PT = np.asarray(jax.device_get(prompt_mask)).astype(np.int32)
        eos_token_ids = sampler.check_sampling_args(
            prompt_ids_PT.shape,
            prompt_mask_PT.shape,
            vocab_size=self.model_config.vocab_size,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
        )
        if not np.all(prompt_mask_PT[:, -1] == 1):
            raise ValueError("prompts must be left-padded: the last column must be a real token")
        prompt_len = prompt_ids_PT.shape[1]
        if prompt_len + max_new_tokens > self._max_model_len:
            raise ValueError(
                f"prompt width {prompt_len} + max_new_tokens {max_new_tokens} exceeds the server's "
                f"max_model_len {self._max_model_len} (rollout.vllm.max_model_len)"
            )

        base_seed = int(jax.random.randint(sampler.as_typed_key(jnp.asarray(rng)), (), 0, 2**30))
        bodies = [
            {
                "prompt": [int(t) for t in ids_T[mask_T == 1]],
                "n": n,
                "max_tokens": max_new_tokens,
                "temperature": float(temperature),
                "top_p": float(top_p),
                "top_k": int(top_k) if top_k > 0 else -1,
                "seed": base_seed + i * n,  # vLLM seeds sample j with seed + j.
                "stop_token_ids": list(eos_token_ids),
                "ignore_eos": True,  # Only eos_token_ids stop, as in the native sampler.
                "logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
            }
            for i, (ids_T, mask_T) in enumerate(zip(prompt_ids_PT, prompt_mask_PT))
        ]
        return Request(prompt_ids_PT, prompt_mask_PT, bodies, n, max_new_tokens,
                       tuple(eos_token_ids), pad_token_id, self.config.logprobs_mode)

    def complete(self, bodies: list[dict]) -> list[Any]:
        """The `choices` of each request body (restarting a dead managed server)."""
        model = self._lora_name if self._adapter_mode else self._model_name
        bodies = [{"model": model, **body} for body in bodies]
        return self._with_restarts("generation", lambda: self._complete_all(bodies))

    def _complete_all(self, bodies: list[dict]) -> list[Any]:
        """Sends every request concurrently; returns their `choices` lists in prompt order."""
        workers = min(len(bodies), self.config.max_concurrent_requests)

        def one(body):
            answer = self._request(
                "POST", "/v1/completions", body, timeout=self.config.request_timeout_s
            )
            if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
                raise VLLMResponseError(
                    f"malformed /v1/completions answer (no 'choices' list): {str(answer)[:500]}; "
                    f"server log: {self._log_where()}"
                )
            return answer["choices"]

        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(one, body) for body in bodies]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise


def _adapter_name(version: int) -> str:
    """The name the server serves LoRA adapter weights version `version` under."""
    return f"grpo_jax-policy-lora-v{version}"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Background:
    """Runs fn() in a daemon thread (one blocked in NCCL must not hold up interpreter exit)."""

    def __init__(self, fn):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

        def run():
            try:
                self.value = fn()
            except Exception as e:  # noqa: BLE001 - re-raised by the waiting thread
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


def _joined(unique_id: bytes, world_size: int, device) -> nccl_transfer.Communicator:
    comm = nccl_transfer.Communicator(unique_id, world_size=world_size, device=device)
    comm.warm_up()  # matches the workers' warm-up all-reduce
    return comm


def _refusal(server: _Background) -> str | None:
    """Why /init_weight_transfer_engine failed, or None if it answered 200."""
    if server.error is not None:
        return f"POST /init_weight_transfer_engine failed: {server.error}"
    if server.value.status_code != 200:
        return (
            f"the server refused POST /init_weight_transfer_engine with HTTP "
            f"{server.value.status_code}: {server.value.text[:300]}"
        )
    return None


def _transfer_device(params) -> jax.Device:
    """The local device the NCCL sender uses: one holding the (replicated) gathered tensors."""
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array):
            return min(x.sharding.addressable_devices, key=lambda d: d.id)
    return jax.local_devices()[0]
