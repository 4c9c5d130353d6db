"""Rollout engines: what samples a step's completions, behind one interface (`Engine`).

`NativeEngine` runs grpo_jax.sampler on the trainer's devices (or devices of its own);
`SidecarEngine` drives a vLLM server (grpo_jax/rollout/vllm_sidecar.py) fed the trainer's weights.
Both return a `sampler.Rollout`. Policy versions are the trainer's (TrainState.step): `start` and
`sync` tell the engine which params are which version, and `sample` with `policy_version`
refuses a rollout sampled under other weights (vllm_sidecar.StaleRolloutError). With LoRA the
params an engine gets are `lora.attach(base, adapters)`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import jax

from grpo_jax import distributed, sampler, sharding
from grpo_jax import model as model_lib
from grpo_jax.models import lora
from grpo_jax.rollout import paged, vllm_sidecar


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one generate call samples with (rollout.* or rollout.val_kwargs.*)."""

    n: int
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    # record each token's MoE experts (Rollout.routed_experts; router replay R3)
    record_routing: bool = False

    def __post_init__(self):
        sampler.check_sampling_settings(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )

    def kwargs(self) -> dict:
        greedy = self.temperature == 0
        return dict(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=-1 if greedy else self.top_k,
        )


class Engine(Protocol):
    """A rollout engine (the interface `NativeEngine` and `SidecarEngine` implement).

    Attributes:
      mesh: where `sample` returns its arrays (and wants device prompts), or None when it takes
        a whole batch of host prompts in one process (a server).
      eos_ids, pad_id: the token ids it stops at and pads with.
    """

    mesh: jax.sharding.Mesh | None
    eos_ids: tuple[int, ...]
    pad_id: int

    def start(self, params, version: int = 0) -> None:
        """Before the first rollout: the policy `params` of policy version `version`."""

    def sync(self, params, version: int) -> float | None:
        """After an update: the engine samples with `params` (version `version`) from now on.
        Returns the seconds spent copying or pushing weights, None when nothing was done."""

    def sample(
        self,
        params,
        prompt_ids_PT,
        prompt_mask_PT,
        rng,
        sp: SamplingParams,
        policy_version: int | None = None,
    ) -> sampler.Rollout:
        """n completions per prompt (sp), by `params` or by the weights the last sync gave."""

    def close(self) -> None:
        """Releases the engine's weights, server or devices."""


class NativeEngine:
    """grpo_jax.sampler on the trainer's own devices and params (nothing to start or sync).

    LoRA params (`lora.attach(base, adapters)`) are merged (`lora.merge`, W + scale * A @ B)
    before each call, so the sampler runs the base model's program: on SmolLM2-135M with r=32
    on all linear layers (8 prompts x 4 x 128 tokens, float32, CPU) that was ~6 % more tokens/s
    than base + adapter unmerged (75 vs 71 median, merge time of 0.4 s per call included;
    benchmarks/bench_lora.py, README "LoRA"). The merged kernels exist only during the call.

    With `own_params` (asynchronous rollouts) the engine samples with a copy of the weights of
    its own, placed on its `mesh` (the trainer's devices, or devices of its own) by `start` /
    `sync`, so the trainer can update (and donate) its params while this engine samples; like
    the vLLM sidecar it then checks that it holds the policy version a caller asks for.

    `logprobs_mode` (rollout.logprobs_mode, sampler.LOGPROBS_MODES) is what its rollouts'
    log_probs hold, as vLLM's server-wide --logprobs-mode.

    A call of more than `max_num_seqs` rows (rollout.max_num_seqs) per data shard decodes them
    through `rollout.paged.sample_paged` (continuous batching over a KV page pool per shard, the
    same rollout; `num_pages`, rollout.num_gpu_blocks_override, sizes each shard's pool); up
    to that, all rows at once through `sampler.sample`. Multi-turn rollouts (`turns`, from
    rollout.multi_turn.Agent) always take the paged engine, whose rows wait on their tools out
    of their slots and keep their KV pages between turns. Both record the experts of every
    token (`SamplingParams.record_routing`, router replay R3) alike.
    """

    def __init__(
        self,
        model_config: model_lib.ModelConfig,
        mesh,
        *,
        eos_ids,
        pad_id,
        own_params: bool = False,
        rules=sharding.LOGICAL_RULES,
        logprobs_mode: str = "processed_logprobs",
        max_num_seqs: int = paged.MAX_NUM_SEQS,
        max_num_batched_tokens: int = paged.MAX_NUM_BATCHED_TOKENS,
        num_pages: int | None = None,
    ):
        sampler.check_logprobs_mode(logprobs_mode)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.num_pages = num_pages  # rollout.num_gpu_blocks_override: the pool a data shard
        self.model_config, self.mesh = model_config, mesh
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id
        self.own_params, self.rules = own_params, rules
        self.logprobs_mode = logprobs_mode
        self.params, self.version = None, None

    def start(self, params, version: int = 0) -> None:
        if self.own_params:
            self._hold(params, version)

    def sync(self, params, version: int) -> float | None:
        """With own_params: copies `params` as policy `version` (seconds; None when held)."""
        if not self.own_params or version == self.version:
            return None
        t0 = time.perf_counter()
        self._hold(params, version)
        return time.perf_counter() - t0

    def _hold(self, params, version: int) -> None:
        if lora.split(params)[1] is not None:
            params = lora.merge(self.model_config, params)  # a new array per merged kernel
        shardings = sharding.param_shardings(self.model_config, self.mesh, self.rules)
        # A copy, on the engine's devices: the trainer donates its own buffers to the update.
        self.params = jax.block_until_ready(jax.device_put(params, shardings, may_alias=False))
        self.version = version

    def sample(
        self,
        params,
        prompt_ids_PT,
        prompt_mask_PT,
        rng,
        sp: SamplingParams,
        policy_version: int | None = None,
        *,
        turns: paged.Turns | None = None,
        finished: paged.Finished | None = None,
    ):
        """`Engine.sample`; with `turns`, a multi-turn rollout through `paged.sample_paged`.

        `finished(row, response_ids)` (`paged.Finished`) hears of each row as soon as it is done
        for good when the call takes the paged engine; the grouped sampler (`sampler.sample`,
        up to max_num_seqs rows a shard) ends all rows at once and reports none of them."""
        if self.own_params:
            if policy_version is not None and policy_version != self.version:
                raise vllm_sidecar.StaleRolloutError(
                    f"the rollout engine holds policy version {self.version}, but version "
                    f"{policy_version} was asked for: sync the engine (engine.sync(params, "
                    "version)) before sampling"
                )
            params = self.params
            rng = jax.device_put(rng, sharding.replicated(self.mesh))  # the loop's key
        elif lora.split(params)[1] is not None:
            params = lora.merge(self.model_config, params)
        if not isinstance(prompt_ids_PT, jax.Array):  # bucketed on the host: no device pad
            prompt_ids_PT, prompt_mask_PT = sampler.bucket_prompts(
                prompt_ids_PT, prompt_mask_PT, pad_token_id=self.pad_id
            )
        ids, mask = (
            x if isinstance(x, jax.Array) else distributed.to_device(x, self.mesh)
            for x in (prompt_ids_PT, prompt_mask_PT)
        )
        # With sequence parallelism the rows split over the sequence devices too.
        axes, rules = sharding.rollout_rows(self.mesh, self.rules, ids.shape[0])
        if axes == sharding.BATCH_AXES:
            return self._sample(params, ids, mask, rng, sp, rules, turns, finished)
        rows = sharding.batch_sharding(self.mesh, 2, axes)
        ids, mask = jax.device_put(ids, rows), jax.device_put(mask, rows)
        rollout = self._sample(params, ids, mask, rng, sp, rules, turns, finished)
        return jax.tree.map(  # back on the batch's sharding, as the trainer's arrays
            lambda x: jax.device_put(x, sharding.batch_sharding(self.mesh, x.ndim)
                                     if x.ndim else sharding.replicated(self.mesh)), rollout)

    def _sample(self, params, ids, mask, rng, sp: SamplingParams, rules, turns, finished):
        with sharding.use_mesh(self.mesh, rules):  # also from another thread (async)
            kwargs = dict(eos_token_ids=self.eos_ids, pad_token_id=self.pad_id,
                          logprobs_mode=self.logprobs_mode, **sp.kwargs())  # fmt: skip
            # Continuous batching over pages when a data shard has more rows than slots
            # (max_num_seqs is per shard, as vLLM's is per rollout replica).
            if turns is not None or paged.pages(ids.shape[0] * sp.n, paged.shard_layout(ids)[2],
                                                self.max_num_seqs):  # fmt: skip
                return paged.sample_paged(
                    self.model_config, params, ids, mask, rng, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    num_pages=self.num_pages, turns=turns, record_routing=sp.record_routing,
                    finished=finished, **kwargs,
                )  # fmt: skip
            return sampler.sample(
                self.model_config, params, ids, mask, rng, record_routing=sp.record_routing,
                **kwargs,
            )  # fmt: skip

    def close(self) -> None:
        self.params = None


class SidecarEngine:
    """A vLLM server (grpo_jax.vllm_sidecar) fed the trainer's weights after every update.

    Policy versions are the trainer's (TrainState.step, optimizer steps taken): start and sync
    record which server weights version holds which policy version, and `sample` refuses a
    rollout whose weights are not the policy version the caller is about to update
    (vllm_sidecar.StaleRolloutError), e.g. after an update without a sync, or a server restarted
    from an older export.
    """

    mesh = None  # takes host prompts: the whole batch, in one process

    def __init__(self, sidecar, *, eos_ids, pad_id):
        self.sidecar = sidecar
        self.eos_ids, self.pad_id = tuple(eos_ids), pad_id
        self.policy_of: dict[int, int] = {}  # server weights version -> trainer policy version

    def start(self, params, version: int = 0) -> None:
        self.sidecar.start(params)
        self.policy_of[self.sidecar.weights_version] = version

    def sync(self, params, version: int) -> float | None:
        """Pushes `params` as policy `version`; None (nothing done) when the server has it."""
        if self.policy_of.get(self.sidecar.weights_version) == version:
            return None
        seconds = self.sidecar.push_weights(params)
        self.policy_of[self.sidecar.weights_version] = version
        return seconds

    def sample(
        self,
        params,
        prompt_ids_PT,
        prompt_mask_PT,
        rng,
        sp: SamplingParams,
        policy_version: int | None = None,
    ):
        del params  # the server holds the weights pushed by the last sync
        rollout = self.sidecar.sample(
            prompt_ids_PT,
            prompt_mask_PT,
            rng,
            eos_token_ids=self.eos_ids,
            pad_token_id=self.pad_id,
            **sp.kwargs(),
        )
        served = int(jax.device_get(rollout.weights_version))
        if policy_version is None:
            vllm_sidecar.check_fresh(rollout, self.sidecar.weights_version)
        elif self.policy_of.get(served) != policy_version:
            raise vllm_sidecar.StaleRolloutError(
                f"the vLLM server sampled with weights version {served} (trainer policy version "
                f"{self.policy_of.get(served)}), but the policy being updated is at version "
                f"{policy_version}: sync the engine after every update (engine.sync(params, "
                "version)) and sample again"
            )
        return rollout

    def close(self) -> None:
        self.sidecar.close()
