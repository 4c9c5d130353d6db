"""Section `rollout` (verl's actor_rollout_ref.rollout.*): the sampler or vLLM sidecar, its
validation settings and multi-turn tool calls."""

from __future__ import annotations

import dataclasses
import shlex
import typing

from grpo_jax import loss, registry, sampler
from grpo_jax import model as model_lib
from grpo_jax.config.checks import Checks, positive
from grpo_jax.rollout import vllm_pool, vllm_sidecar


@dataclasses.dataclass(frozen=True)
class ValKwargs:
    """Section `rollout.val_kwargs`: sampling for validation (verl: greedy, one sample).

    As in verl 0.9.1, validation samples with `temperature`, `top_p` and `top_k` and never reads
    `do_sample` (its agent loop copies only those three from val_kwargs: V1
    agent_loop_tq.generate_sequences), so temperature 0 is what makes validation greedy; n > 1
    at temperature 0 gives n equal greedy responses. do_sample=False with a temperature above 0
    is warned about (RunConfig.ignored_settings).
    """

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False  # accepted and ignored, as by verl 0.9.1 (see above)
    n: int = 1  # samples per validation prompt (mean@n, best@k / worst@k / maj@k, k <= n)

    def __post_init__(self):

        c = Checks("rollout.val_kwargs")
        positive(c, self, "n")
        c.call(
            sampler.check_sampling_settings,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        c.done()

    @property
    def sampling_temperature(self) -> float:
        """The temperature validation samples at: `temperature`, whatever do_sample says."""
        return self.temperature


class _VLLMSection:
    """Section `rollout.vllm`: the sidecar server. Its fields are vllm_sidecar.VLLMConfig's (see
    there what each means), but for `extra_args` (shell-split) and `env` ("NAME=VALUE,...")
    written as strings, so both travel through the command line; `url` may list several
    servers, comma-separated, and `num_servers` starts that many (grpo_jax/rollout/vllm_pool.py);
    the tensor parallelism is rollout.tensor_model_parallel_size and the log-probs' mode
    rollout.logprobs_mode (verl's names).
    """

    def sidecar_config(
        self, *, tensor_parallel_size: int = 1, logprobs_mode: str = "processed_logprobs"
    ) -> vllm_sidecar.VLLMConfig:
        """The vllm_sidecar.VLLMConfig of the first server (raises ValueError naming a bad
        value)."""
        env = []
        for item in registry.split_list(self.env):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"env={self.env!r}: entry {item!r} must be NAME=VALUE")
            env.append((name, value))
        fields = dataclasses.asdict(self) | {"extra_args": shlex.split(self.extra_args)}
        fields |= {"env": tuple(env), "tensor_parallel_size": tensor_parallel_size,
                   "logprobs_mode": logprobs_mode}  # fmt: skip
        urls = self.urls
        if self.num_servers < 1:
            raise ValueError(f"num_servers={self.num_servers} must be >= 1")
        if len(urls) > 1 and self.num_servers not in (1, len(urls)):
            raise ValueError(f"num_servers={self.num_servers} but url lists {len(urls)} servers")
        fields.pop("num_servers")
        fields["url"] = urls[0] if urls else ""
        return vllm_sidecar.VLLMConfig(**fields)

    @property
    def urls(self) -> tuple[str, ...]:
        return registry.split_list(self.url)

    def sidecar_configs(
        self, *, tensor_parallel_size: int = 1, logprobs_mode: str = "processed_logprobs"
    ) -> list:
        """One vllm_sidecar.VLLMConfig per server (num_servers, or each url)."""
        one = self.sidecar_config(
            tensor_parallel_size=tensor_parallel_size, logprobs_mode=logprobs_mode
        )
        return vllm_pool.server_configs(one, self.num_servers, self.urls)


def _vllm_section_fields():
    """rollout.vllm's fields: vllm_sidecar.VLLMConfig's, written once there."""
    types = typing.get_type_hints(vllm_sidecar.VLLMConfig)
    fields = []
    for f in dataclasses.fields(vllm_sidecar.VLLMConfig):
        if f.name in ("tensor_parallel_size", "logprobs_mode"):  # rollout.* (verl's names)
            continue
        if f.name in ("extra_args", "env"):  # strings on the command line, parsed above
            fields.append((f.name, str, dataclasses.field(default="")))
        else:
            fields.append((f.name, types[f.name], dataclasses.field(default=f.default)))
        if f.name == "url":
            fields.append(("num_servers", int, dataclasses.field(default=1)))
    return fields


VLLMSettings = dataclasses.make_dataclass(
    "VLLMSettings", _vllm_section_fields(), bases=(_VLLMSection,), frozen=True
)
VLLMSettings.__module__, VLLMSettings.__doc__ = __name__, _VLLMSection.__doc__


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """Section `rollout.multi_turn`: rollouts in which the model calls tools (verl 0.9.1's
    names, defaults and meanings; grpo_jax/rollout/multi_turn.py)."""

    enable: bool = False
    max_assistant_turns: int | None = None  # model turns per trajectory; None = no limit
    max_user_turns: int | None = None  # tool (or user) turns per trajectory; None = no limit
    max_parallel_calls: int = 1  # calls of one turn that run; later ones are dropped (verl)
    max_tool_response_length: int = 256  # characters of a tool's response kept
    tool_response_truncate_side: str = "middle"  # "left" | "right" | "middle"
    format: str = "hermes"  # the tool-call format the model writes and the parser reads
    tool_config_path: str | None = None  # verl's tool YAML (tools: class_name, config, schema)
    # verl <= 0.5's scripted user turns (BaseInteraction); verl 0.9.1's agent loop has none,
    # and neither has grpo_jax yet: setting it is an error.
    interaction_config_path: str | None = None
    # grpo_jax's (verl has none): seconds one tool call may take before the model gets a
    # timeout error as its response (the call is abandoned, the run goes on)
    tool_timeout: float = 30.0
    # grpo_jax's: check a call's arguments against the tool's JSON schema and answer the model
    # with the violation instead of running the tool; False passes anything through (verl)
    validate_tool_arguments: bool = True

    def __post_init__(self):

        c = Checks("rollout.multi_turn")
        for name in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, name)
            c.need(value is None or value >= 1, name, value, "must be >= 1 or None (no limit)")
        positive(c, self, "max_parallel_calls", "max_tool_response_length")
        c.choice("tool_response_truncate_side", self.tool_response_truncate_side,
                 ("left", "right", "middle"))
        c.choice("format", self.format, ("hermes",))
        c.need(self.tool_timeout > 0, "tool_timeout", self.tool_timeout, "must be > 0 seconds")
        c.need(self.interaction_config_path is None, "interaction_config_path",
               self.interaction_config_path,
               "is not supported (verl 0.9.1's tool agent loop has no interactions either)")
        c.done()


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Section `rollout`: the rollout engine and its sampling settings."""

    name: str = "jax"  # "jax" (native sampler) | "vllm" (sidecar server)
    n: int = 5  # G, completions per prompt (verl: 1, for its default gae; its GRPO recipes: 5)
    temperature: float = 1.0  # sampling temperature; log-probs are divided by it too (verl)
    top_p: float = 1.0  # nucleus sampling; 1 = off
    top_k: int = -1  # -1 = off
    # What the engine reports as each sampled token's log-prob (vLLM's --logprobs-mode, verl's
    # default): "processed_logprobs" = under the temperature-scaled, top-k / top-p renormalised
    # distribution it was drawn from; "raw_logprobs" = log_softmax(logits), before temperature;
    # "processed_logits" / "raw_logits" = the logit (not a log-prob: no rollout correction).
    logprobs_mode: str = "processed_logprobs"
    log_prob_micro_batch_size_per_gpu: int = 16  # sequences per device for old/ref log-probs
    # Packed token-budget micro-batches instead, and that budget in tokens per device. None
    # follows the actor (verl's oc.select of actor.use_dynamic_bsz / ppo_max_token_len_per_gpu);
    # RunConfig.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu are the values used.
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: int | None = None
    # vLLM's --tensor-parallel-size (rollout.name="vllm"); verl's default is 2, for its GPUs.
    tensor_model_parallel_size: int = 1
    # With trainer.async_rollout and name="jax": devices of their own for the sampler (the last
    # num_devices of jax.devices(); the trainer's mesh takes the rest), which receive a copy of
    # the weights after every update (verl one-step-off: rollout.nnodes x n_gpus_per_node).
    # 0 = the sampler shares the trainer's devices (with a copy of the params).
    num_devices: int = 0
    # The native engine's continuous batching (vLLM's names and verl's defaults): a step with
    # more than max_num_seqs rows (prompts x n) per data shard decodes at most that many at a
    # time on each shard from its pool of KV pages, refilling the slots of finished rows
    # (grpo_jax/rollout/paged.py); prompts are prefilled in chunks of at most
    # max_num_batched_tokens tokens. Up to max_num_seqs rows a shard, the whole step decodes at
    # once from the grouped cache (sampler.sample).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # The paged engine's KV pool: pages (vLLM's blocks, 16 tokens) per data shard (vLLM's
    # --num-gpu-blocks-override; verl passes it through engine_kwargs.vllm). None = a pool of
    # max_num_seqs full responses and their prompts, in which no row is ever preempted; fewer
    # pages grow each row's pages as it decodes and preempt the newest rows when they run out
    # (vLLM's recompute preemption; the tokens are the same). It must hold one row's full
    # length (prompt + response), else the first paged call fails naming this field.
    num_gpu_blocks_override: int | None = None
    # What the native engine's KV cache (grouped or paged) stores (vLLM's --kv-cache-dtype;
    # model.KV_CACHE_DTYPES): "auto" = the compute dtype (model.dtype), but float32 for a
    # bfloat16 model on XLA:CPU, where bf16 dots over the cache decode slower (model.cache_dtype,
    # docs/models.md); "bfloat16" halves the cache of a float32 model (its attention still
    # computes in float32; on XLA:CPU a decode step takes 1.5x as long, bench_kv_cache.py). The
    # vLLM server's is its own: rollout.vllm.extra_args.
    kv_cache_dtype: str = "auto"
    # verl's switch for the rollout to record each token's MoE experts (Rollout.routed_experts),
    # required by actor.router_replay.mode="R3" and refused with any other mode.
    enable_rollout_routing_replay: bool = False
    val_kwargs: ValKwargs = ValKwargs()
    vllm: VLLMSettings = VLLMSettings()
    multi_turn: MultiTurnConfig = MultiTurnConfig()

    def __post_init__(self):

        c = Checks("rollout")
        c.choice("name", self.name, ("jax", "vllm"))
        c.choice("logprobs_mode", self.logprobs_mode, sampler.LOGPROBS_MODES)
        positive(c, self, "n", "log_prob_micro_batch_size_per_gpu", "max_num_seqs",
                  "max_num_batched_tokens")  # fmt: skip
        c.need(
            self.log_prob_max_token_len_per_gpu is None or self.log_prob_max_token_len_per_gpu >= 1,
            "log_prob_max_token_len_per_gpu",
            self.log_prob_max_token_len_per_gpu,
            "must be >= 1 or None (actor.ppo_max_token_len_per_gpu)",
        )
        c.need(self.num_devices >= 0, "num_devices", self.num_devices, "must be >= 0")
        c.need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
               "num_gpu_blocks_override", self.num_gpu_blocks_override,
               "must be >= 2 pages (one is the trash page) or None (a pool that never preempts)")
        c.choice("kv_cache_dtype", self.kv_cache_dtype, model_lib.KV_CACHE_DTYPES)
        c.need(self.kv_cache_dtype == "auto" or self.name == "jax", "kv_cache_dtype",
               self.kv_cache_dtype, "is the native engine's (name='jax'); the vLLM server takes "
               "--kv-cache-dtype in rollout.vllm.extra_args")  # fmt: skip
        c.need(self.num_devices == 0 or self.name == "jax", "num_devices", self.num_devices,
               "is for the native sampler (name='jax'); the vLLM server has its own devices")
        # Training divides the log-probs by the temperature, so the log-prob rule (> 0) applies
        # here; it implies the sampler's (>= 0), whose top-p and top-k rules come next.

        ok = c.call(loss.check_temperature, self.temperature) is not None
        c.call(
            sampler.check_sampling_settings,
            temperature=self.temperature if ok else 1.0,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        if self.name == "vllm":
            try:
                self.sidecar_configs()
            except ValueError as e:
                c.problems.append(f"rollout.vllm: {e}")
        c.done()

    def sidecar_config(self):
        """vllm_sidecar.VLLMConfig of rollout.vllm with rollout.tensor_model_parallel_size and
        rollout.logprobs_mode."""
        return self.vllm.sidecar_config(
            tensor_parallel_size=self.tensor_model_parallel_size, logprobs_mode=self.logprobs_mode
        )

    def sidecar_configs(self) -> list:
        """One vllm_sidecar.VLLMConfig per server (rollout.vllm.num_servers or urls)."""
        return self.vllm.sidecar_configs(
            tensor_parallel_size=self.tensor_model_parallel_size, logprobs_mode=self.logprobs_mode
        )
