"""Several vLLM servers as one rollout backend (rollout.vllm.num_servers, or a list of urls).

`VLLMServers` has the interface of `vllm_sidecar.VLLMSidecar` that the loop's SidecarEngine
uses (start, push_weights, sample, weights_version, close), over N sidecars:

  prompts   each sample() splits the P prompts into N contiguous blocks of equal size (within
            one), one per live server, sent concurrently; the request bodies (and so the
            per-prompt seeds) are the ones a single server would get, and the rollout is
            assembled in prompt order, in the native layout;
  weights   every push goes to every live server (concurrently); the weights version is the
            same on all of them;
  failures  each server restarts itself after a crash (rollout.vllm.max_restarts, with
            back-off). One that stays dead, or fails a push, is dropped: the pool logs an
            error naming the server, its log and why, re-sends its prompts to the others, and
            goes on with N - 1 (`dropped` lists them). With no server left it raises
            VLLMServerDiedError naming each server's failure.

Managed servers get ports port, port + 1, ... (or free ones with port 0), GPUs of their own
(server i: CUDA_VISIBLE_DEVICES = GPUs [i * tp, (i + 1) * tp) for tensor parallelism tp, unless
rollout.vllm.env sets it), and workdirs workdir/server<i>; attached ones are the
comma-separated rollout.vllm.url. Each server writes its own weight export per push.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from grpo_jax import model as model_lib
from grpo_jax import sampler
from grpo_jax.rollout import vllm_sidecar as sidecar_lib

log = logging.getLogger(__name__)


def server_configs(config: sidecar_lib.VLLMConfig, num_servers: int,
                   urls: Sequence[str] = ()) -> list[sidecar_lib.VLLMConfig]:
    """The config of each server: the given urls (attached), or `num_servers` managed ones.

    Several managed servers get GPUs of their own: server i sees GPUs [i * tp, (i + 1) * tp)
    (CUDA_VISIBLE_DEVICES, tp = its tensor_parallel_size), unless rollout.vllm.env sets
    CUDA_VISIBLE_DEVICES itself.
    """
    if urls:
        return [dataclasses.replace(config, url=u, python="") for u in urls]
    out = []
    for i in range(num_servers):
        env = config.env
        if num_servers > 1 and "CUDA_VISIBLE_DEVICES" not in dict(env):
            tp = config.tensor_parallel_size
            gpus = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
            env = (*env, ("CUDA_VISIBLE_DEVICES", gpus))
        out.append(dataclasses.replace(config, port=config.port + i if config.port else 0,
                                       env=env))
    return out


class VLLMServers:
    """N vLLM sidecars behind the VLLMSidecar interface (see the module docstring)."""

    def __init__(self, configs: Sequence[sidecar_lib.VLLMConfig],
                 model_config: model_lib.ModelConfig, workdir: str | os.PathLike):
        if not configs:
            raise ValueError("VLLMServers needs at least one server config")
        self.model_config = model_config
        self.servers = [
            sidecar_lib.VLLMSidecar(c, model_config, os.path.join(workdir, f"server{i}"))
            for i, c in enumerate(configs)
        ]
        self.live = list(range(len(self.servers)))
        self.dropped: list[tuple[int, str]] = []  # (server index, why)
        self.prompts_served = [0] * len(self.servers)  # per server, over every sample()
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.servers),
                                                           thread_name_prefix="vllm-pool")

    # The attributes SidecarEngine and check_fresh read.
    @property
    def weights_version(self) -> int:
        return min(self.servers[i].weights_version for i in self.live)

    @property
    def server_weights_version(self) -> int:
        return min(self.servers[i].server_weights_version for i in self.live)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    def _where(self, i: int) -> str:
        s = self.servers[i]
        return f"vLLM server {i} ({s.url or 'not started'}, log {s.log_path})"

    def _drop(self, i: int, error: BaseException) -> None:
        why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.error("%s is dropped (%s); %d server(s) go on", self._where(i), why,
                  len(self.live) - 1)
        self.live.remove(i)
        self.dropped.append((i, why))
        try:
            self.servers[i].close()
        except Exception as e:  # noqa: BLE001 - already failed; report and go on
            log.warning("closing %s: %s", self._where(i), e)
        if not self.live:
            raise sidecar_lib.VLLMServerDiedError(
                "every vLLM server failed: "
                + "; ".join(f"{self._where(j)}: {w}" for j, w in self.dropped)
            ) from error

    def _on_each(self, what: str, fn) -> dict[int, Any]:
        """fn(server) on every live server concurrently; drops those that fail."""
        futures = {i: self._pool.submit(fn, self.servers[i]) for i in list(self.live)}
        out = {}
        for i, f in futures.items():
            try:
                out[i] = f.result()
            except sidecar_lib.VLLMSidecarError as e:
                log.error("%s failed on %s", what, self._where(i))
                self._drop(i, e)
        return out

    def start(self, params) -> None:
        self._on_each("start", lambda s: s.start(params))

    def push_weights(self, params) -> float:
        """Pushes to every live server; returns the slowest push's seconds."""
        seconds = self._on_each("weight push", lambda s: s.push_weights(params))
        versions = {self.servers[i].weights_version for i in self.live}
        if len(versions) != 1:  # a server dropped mid-way is gone; the live ones agree
            raise sidecar_lib.VLLMSidecarError(f"servers disagree on the weights: {versions}")
        return max(seconds.values())

    def sample(self, prompt_ids, prompt_mask, rng, **kw) -> sampler.Rollout:
        """`VLLMSidecar.sample` over the live servers (same contract and request bodies)."""
        request = self.servers[self.live[0]].request(prompt_ids, prompt_mask, rng, **kw)
        choices: list[Any] = [None] * len(request.bodies)
        todo = np.arange(len(request.bodies))
        while len(todo):
            blocks = dict(zip(list(self.live), np.array_split(todo, len(self.live)), strict=True))
            futures = {
                i: self._pool.submit(self.servers[i].complete,
                                     [request.bodies[p] for p in block])
                for i, block in blocks.items() if len(block)
            }
            failed = []
            for i, f in futures.items():
                try:
                    for p, c in zip(blocks[i], f.result(), strict=True):
                        choices[p] = c
                    self.prompts_served[i] += len(blocks[i])
                except sidecar_lib.VLLMSidecarError as e:
                    failed.append(blocks[i])
                    self._drop(i, e)  # raises when none is left
            todo = np.concatenate(failed) if failed else np.arange(0)
        return request.rollout(
            choices, weights_version=self.server_weights_version,
            vocab_size=self.model_config.vocab_size,
            log_where="; ".join(self._where(i) for i in self.live),
        )  # fmt: skip

    def close(self) -> None:
        for s in self.servers:
            s.close()
        self._pool.shutdown(wait=False)
