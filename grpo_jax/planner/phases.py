"""`Planner`: the phases of one GRPO step (sample, logprob, train, apply) compiled for a model,
mesh and run on sharded ShapeDtypeStructs, XLA's memory analysis of each, and the search
for the largest batch knob that fits; `from_run` builds one from a config."""

import contextlib
import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from grpo_jax import config as config_lib
from grpo_jax import errors, sampler, sharding
from grpo_jax import model as model_lib
from grpo_jax.models import attention, gguf, lora, matmul, moe, paged_kernel
from grpo_jax.models import paged as paged_model
from grpo_jax.planner.devices import GIB, compiles_natively
from grpo_jax.planner.presets import PRESETS, preset_config
from grpo_jax.rollout import paged
from grpo_jax.trainer import actor as actor_lib
from grpo_jax.trainer import packing, programs, setup

# The XLA pass the planner skips for GPU / TPU plans in 16-bit compute (Planner.compiler_options).
CPU_ONLY_HOIST = "while-loop-invariant-code-motion"


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shapes of one GRPO step, read from the train.py config.

    Attributes:
      prompt_len: Tp, ``data.max_prompt_length`` bucketed as the sampler does.
      response_len: T, ``data.max_response_length``.
      n: G, ``rollout.n``.
      prompts: P, ``data.train_batch_size`` (prompts sampled in one call).
      mini_rows: ``actor.ppo_mini_batch_size * n`` sequences per optimizer step.
      micro_per_device: ``actor.ppo_micro_batch_size_per_gpu``.
      logprob_micro_per_device: ``rollout.log_prob_micro_batch_size_per_gpu``.
      needs_ref: a KL term needs reference parameters and log-probs.
      needs_old: the step runs the old-log-prob pass before the first update
        (``RunConfig.needs_old_log_probs``: off-policy, or the KL in the reward).
      packed: ``actor.use_dynamic_bsz``: the update runs packed token-budget micro-batches.
      tokens_per_device: ``actor.ppo_max_token_len_per_gpu``, their budget.
      logprob_packed: ``rollout.log_prob_use_dynamic_bsz``, the same for the log-prob passes.
      logprob_tokens_per_device: ``rollout.log_prob_max_token_len_per_gpu``.
      row_len: the packed row length (``packing.row_length`` of prompt + response).
      vllm: ``rollout.name == "vllm"``: the sidecar samples, JAX compiles no sampling phase.
      max_num_seqs: ``rollout.max_num_seqs``, the paged engine's slots per data shard.
      max_num_batched_tokens: ``rollout.max_num_batched_tokens``, its prefill chunk budget.
      num_pages: ``rollout.num_gpu_blocks_override``, its KV pool a data shard (None: the pool
        of max_num_seqs full responses, which never preempts).
      sequence_parallel: ``actor.ulysses_sequence_parallel_size``: a group of that many devices
        packs that many times a device's token budget (verl), in rows split over the group.
    """

    prompt_len: int
    response_len: int
    n: int
    prompts: int
    mini_rows: int
    micro_per_device: int
    logprob_micro_per_device: int
    needs_ref: bool
    needs_old: bool
    packed: bool
    tokens_per_device: int
    logprob_packed: bool
    logprob_tokens_per_device: int
    row_len: int
    vllm: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    sequence_parallel: int = 1
    num_pages: int | None = None

    @classmethod
    def from_run(cls, run: config_lib.RunConfig) -> "Workload":
        n, d, a, r = run.rollout.n, run.data, run.actor, run.rollout
        return cls(
            prompt_len=sampler.bucket_length(d.max_prompt_length),
            response_len=d.max_response_length,
            n=n,
            prompts=d.train_batch_size,
            mini_rows=a.ppo_mini_batch_size * n,
            micro_per_device=a.ppo_micro_batch_size_per_gpu,
            logprob_micro_per_device=r.log_prob_micro_batch_size_per_gpu,
            needs_ref=run.needs_reference,  # the library's rules, not re-derived here
            needs_old=run.needs_old_log_probs,
            packed=a.use_dynamic_bsz,
            tokens_per_device=a.ppo_max_token_len_per_gpu,
            logprob_packed=run.log_prob_use_dynamic_bsz,
            logprob_tokens_per_device=run.log_prob_max_token_len_per_gpu,
            row_len=packing.row_length(
                d.max_prompt_length,
                d.max_response_length,
                a.ppo_max_token_len_per_gpu * a.ulysses_sequence_parallel_size,
            ),
            vllm=r.name == "vllm",
            max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=r.max_num_batched_tokens,
            sequence_parallel=a.ulysses_sequence_parallel_size,
            num_pages=r.num_gpu_blocks_override,
        )


def bytes_per_device(abstract_tree, sharding_tree) -> int:
    """Bytes one device holds of a sharded pytree (the largest shard of each array)."""
    leaves = jax.tree.leaves(abstract_tree)
    shardings = jax.tree.leaves(sharding_tree)
    return sum(
        math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x, s in zip(leaves, shardings, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    """XLA's per-device memory analysis of one compiled phase (bytes)."""

    argument: int
    output: int
    alias: int
    temp: int
    refused_by_compiler: bool = False  # `refused`: temp is the compiler's count, the rest 0

    @classmethod
    def of(cls, compiled) -> "PhaseMemory":
        m = compiled.memory_analysis()
        return cls(
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
        )

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def refused(cls, error: Exception) -> "PhaseMemory | None":
        """The phase the TPU compiler refused to compile because it does not fit the chip
        ("Ran out of memory on HBM, the total memory required for HLO temporaries (217.29G)
        exceeds available HBM (95.74G)"): its temporaries as the compiler counted them (GiB),
        arguments and outputs unknown (0), so its peak is a lower bound, over the chip. None
        for any other error."""
        found = re.search(r"required for HLO temporaries \(([0-9.]+)G\)", str(error))
        if "RESOURCE_EXHAUSTED" not in str(error) or found is None:
            return None
        return cls(0, 0, 0, int(float(found.group(1)) * GIB), refused_by_compiler=True)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One compiled phase of the step: what it is, XLA's memory, and its per-device peak.

    Attributes:
      name: "sample", "logprob", "train" (padded or packed micro-batches) or "apply" (the
        optimizer step after the packed micro-batches).
      label: its row in the report.
      memory: XLA's memory analysis.
      peak: bytes per device while it runs, what stays resident outside it included.
    """

    name: str
    label: str
    memory: PhaseMemory
    peak: int


@dataclasses.dataclass(frozen=True)
class Knob:
    """The config field that sizes one phase's batch, and the values the planner may try.

    Attributes:
      field: the dotted config field.
      value: its value in the config.
      candidates: values to try, ascending (the current one among them).
      peak: value -> the phase's peak in bytes per device (compiles; memoised by the Planner).
    """

    field: str
    value: int
    candidates: tuple[int, ...]
    peak: Callable[[int], int]


class Planner:
    """Compiles the phases of one GRPO step for a model, mesh and run, without weights.

    The phases are the library's own jitted programs (`programs.make_programs`), lowered on
    sharded ShapeDtypeStructs, so the plan is of exactly what train.py runs.
    """

    def __init__(self, model_config, mesh, run: config_lib.RunConfig, *, tx, rules):
        # The loop's own layout of the params and train state (with LoRA: the frozen base and
        # the adapters the state trains), abstract.
        layout = setup.state_layout(run, model_config, mesh, rules, tx)
        model_config = layout.model_config
        self.cfg, self.mesh, self.run = model_config, mesh, run
        self.w = Workload.from_run(run)
        self.tx = tx
        self.loss_config = run.loss_config()  # the one the update trains with
        self.dp = mesh.shape["data"] * mesh.shape["fsdp"]
        self.rules = rules
        self.lora = bool(model_config.lora_rank)
        self.model_name = ""  # from_run sets it, so that `variant` can re-plan a changed run
        self.backend = None  # from_run sets it: the backend "auto" attention is resolved for
        # "cudnn" / "splash" when the blockwise kernel is planned in its place
        self.stand_in_for = None
        self._variants = {}
        abstract = model_lib.abstract_params(model_config)
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
        self.param_sh = layout.param_shardings
        self.base = sharding.abstract_with_shardings(abstract, self.param_sh)
        trained, trained_sh = layout.trained, layout.trained_shardings
        if self.lora:
            adapters = sharding.abstract_with_shardings(trained, trained_sh)
            self.params = lora.attach(self.base, adapters)  # the policy: base + adapters
        else:
            self.params = self.base
        abstract_state = jax.eval_shape(functools.partial(actor_lib.init_state, tx=tx), trained)
        state_sh = layout.state_shardings
        self.state = sharding.abstract_with_shardings(abstract_state, state_sh)
        self.param_bytes = bytes_per_device(abstract, self.param_sh)
        self.adapter_bytes = bytes_per_device(trained, trained_sh) if self.lora else 0
        self.opt_bytes = bytes_per_device(abstract_state.opt_state, state_sh.opt_state)
        # With LoRA the reference is the base itself (adapters off): nothing more is resident.
        self.ref_bytes = self.param_bytes if self.w.needs_ref and not self.lora else 0
        # What full fine-tuning of the same model holds (the LoRA saving in the report).
        full_opt = jax.eval_shape(tx.init, abstract)
        self.full_opt_bytes = bytes_per_device(
            full_opt, sharding.tx_state_shardings(tx, abstract, self.param_sh, mesh)
        )
        self.full_ref_bytes = self.param_bytes if self.w.needs_ref else 0
        batch = self._batch(self.w.prompts * self.w.n)
        # The step's whole batch stays on the devices while the packed passes run.
        self.batch_bytes = bytes_per_device(batch, jax.tree.map(lambda x: x.sharding, batch))
        self._compiled = {}

    def lora_saved_bytes(self) -> int:
        """Resident bytes per device that LoRA saves over full fine-tuning of the same model:
        (full optimizer state + reference copy) - (adapters + their optimizer state + reference).
        0 without LoRA."""
        if not self.lora:
            return 0
        full = self.full_opt_bytes + self.full_ref_bytes
        return full - (self.adapter_bytes + self.opt_bytes + self.ref_bytes)

    @property
    def resident_bytes(self) -> int:
        """What no batch size changes: the trained params (or frozen base + adapters), their
        optimizer state and the reference copy."""
        return self.param_bytes + self.adapter_bytes + self.opt_bytes + self.ref_bytes

    def jax_share(self) -> float:
        """The part of each device JAX may use: all of it, or with the vLLM sidecar, which
        stays resident on the GPUs it runs on, 1 - rollout.vllm.gpu_memory_utilization."""
        return 1.0 - self.run.rollout.vllm.gpu_memory_utilization if self.w.vllm else 1.0

    def programs(
        self, micro_per_device: int | None = None, logprob_micro_per_device: int | None = None
    ) -> programs.Programs:
        """The run's programs, with other padded micro-batch sizes when given (the searches)."""
        run = self.run
        if micro_per_device is not None:
            actor = dataclasses.replace(run.actor, ppo_micro_batch_size_per_gpu=micro_per_device)
            run = dataclasses.replace(run, actor=actor)
        if logprob_micro_per_device is not None:
            rollout = dataclasses.replace(
                run.rollout, log_prob_micro_batch_size_per_gpu=logprob_micro_per_device
            )
            run = dataclasses.replace(run, rollout=rollout)
        return programs.make_programs(run, self.cfg, self.tx, dp=self.dp)

    def variant(self, overrides) -> "Planner":
        """The planner of this run with ``overrides`` ((dotted field, value), ...) applied."""
        overrides = tuple(overrides)
        if overrides not in self._variants:  # memoised too: advise asks again for the same
            run = with_overrides(self.run, overrides)
            self._variants[overrides] = from_run(run, model_name=self.model_name,
                                                 backend=self.backend,
                                                 devices=list(self.mesh.devices.flat))  # fmt: skip
        return self._variants[overrides]

    def _arr(self, shape, dtype):
        # Rows that do not split over the data devices (a packed mini-batch of 10 sequences
        # on 4) stay whole on each device, as the trainer's slice of the step batch does.
        if shape[0] % self.dp:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.replicated(self.mesh))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(self.mesh, 2))

    def _batch(self, rows: int) -> actor_lib.TrainBatch:
        w, arr = self.w, self._arr
        s, t = w.prompt_len + w.response_len, w.response_len
        return actor_lib.TrainBatch(
            input_ids_BS=arr((rows, s), jnp.int32),
            attention_mask_BS=arr((rows, s), jnp.int32),
            response_ids_BT=arr((rows, t), jnp.int32),
            response_mask_BT=arr((rows, t), jnp.int32),
            advantages_BT=arr((rows, t), jnp.float32),
            old_log_probs_BT=arr((rows, t), jnp.float32) if w.needs_old else None,
            ref_log_probs_BT=arr((rows, t), jnp.float32) if w.needs_ref else None,
        )

    def packed_rows(self, tokens_per_device: int) -> int:
        """Rows of a full packed micro-batch over all data devices (packing.pack's cap)."""
        sp = self.w.sequence_parallel
        rows = (tokens_per_device * sp * self.dp // self.w.row_len) // self.dp * self.dp
        if rows < 1:
            raise ValueError(
                f"a token budget of {tokens_per_device} tokens per device x {sp} sequence-"
                f"parallel devices holds no packed row of {self.w.row_len} tokens "
                f"(max_prompt_length + max_response_length, rounded up to {packing.LEN_BUCKET}): "
                f"it must be at least {-(-self.w.row_len // sp)}"
            )
        return rows

    def _micro(self, tokens_per_device: int) -> actor_lib.PackedMicro:
        # The largest micro-batch packing makes: every row full, every slot a response token
        # (as `rows` slot groups of one row each: a group holds at most its rows x row_len
        # response tokens, so this bounds packing's pooled slots).
        rows, row_len = self.packed_rows(tokens_per_device), self.w.row_len
        tokens = self._arr((rows, row_len), jnp.int32)
        return actor_lib.PackedMicro(*(tokens,) * 7)

    def train(self, micro_per_device: int) -> PhaseMemory:
        """One ``train_step`` (state donated) on the step's batch, one mini-batch of it."""
        return self._memo(("train", micro_per_device), self._train)

    def packed_train(self, tokens_per_device: int) -> PhaseMemory:
        """``packed_micro_grads`` (gradients donated) on the largest packed micro-batch."""
        return self._memo(("packed_train", tokens_per_device), self._packed_train)

    def apply(self) -> PhaseMemory:
        """``apply_gradients`` (state donated) after the packed micro-batches."""
        return self._memo(("apply",), self._apply)

    def logprob(self, micro_per_device: int | None = None) -> PhaseMemory:
        """``compute_log_probs`` over the step's batch (reference or old policy)."""
        micro = self.w.logprob_micro_per_device if micro_per_device is None else micro_per_device
        return self._memo(("logprob", micro), self._logprob)

    def packed_logprob(self, tokens_per_device: int) -> PhaseMemory:
        """``packed_log_probs_into`` (accumulators donated) on the largest packed micro-batch."""
        return self._memo(("packed_logprob", tokens_per_device), self._packed_logprob)

    def sample(self, prompts: int, max_num_seqs: int | None = None) -> PhaseMemory:
        """The native engine on ``prompts`` x n completions of response_len tokens: the paged
        engine's call (`paged_sample`) when a data shard has more rows than max_num_seqs
        (default rollout.max_num_seqs), as engines.NativeEngine decides, else
        ``sampler.sample``."""
        seqs = self.w.max_num_seqs if max_num_seqs is None else max_num_seqs
        if self.is_paged(prompts, seqs):
            return self._memo(("paged_sample", prompts, seqs), self._paged_sample)
        return self._memo(("sample", prompts), self._sample)

    def sample_shards(self, prompts: int) -> int:
        """The data shards the native engine splits ``prompts`` over (engines.NativeEngine:
        data x fsdp, x sequence with sequence parallelism; whole on every device when they do
        not split, as `_arr`)."""
        shards = math.prod(self.mesh.shape[a] for a in self._sample_rows(prompts)[0])
        return 1 if prompts % shards else shards

    def _sample_rows(self, prompts: int):
        """(batch axes, rules) engines.NativeEngine samples ``prompts`` under."""
        return sharding.rollout_rows(self.mesh, self.rules, prompts)

    def _sample_sharding(self, prompts: int, ndim: int):
        axes = self._sample_rows(prompts)[0]
        if prompts % math.prod(self.mesh.shape[a] for a in axes) or ndim == 0:
            return sharding.replicated(self.mesh)
        return sharding.batch_sharding(self.mesh, ndim, axes)

    def is_paged(self, prompts: int, max_num_seqs: int | None = None) -> bool:
        """Whether the native engine pages a call of ``prompts`` (engines.NativeEngine's rule)."""
        seqs = self.w.max_num_seqs if max_num_seqs is None else max_num_seqs
        return paged.pages(prompts * self.w.n, self.sample_shards(prompts), seqs)

    def pool_plan(self, prompts: int, max_num_seqs: int | None = None) -> paged.PoolPlan:
        """The paged engine's pool and batches on each data shard (`paged.plan_pool`)."""
        w = self.w
        return paged.plan_pool(
            num_prompts=prompts // self.sample_shards(prompts), n=w.n,
            prompt_width=w.prompt_len, max_new_tokens=w.response_len,
            max_num_seqs=w.max_num_seqs if max_num_seqs is None else max_num_seqs,
            max_num_batched_tokens=w.max_num_batched_tokens, num_pages=w.num_pages,
        )  # fmt: skip

    @property
    def native(self) -> bool:
        """The programs compile for the planned backend itself (TPU devices of a
        `tpu_topology`), not on CPU devices standing in for it."""
        return compiles_natively(self.mesh, self.backend)

    @property
    def moe_stand_in(self) -> bool:
        """The MoE experts are planned with ``moe.capacity_stand_in``: compiled on CPU devices
        for a GPU or TPU, where XLA:CPU's ragged_dot (a dense masked dot over every expert, E
        times the buffers) is not the accelerator's grouped matmul. A `tpu_topology` plan
        compiles the real one."""
        return self.cfg.num_experts > 0 and self.backend in ("gpu", "tpu") and not self.native

    def accelerator_stood_in_for(self) -> str | None:
        """The accelerator the plan's programs are for (None: JAX's default backend), whether
        CPU devices stand in for it or the TPU compiler compiles for it from this CPU-only
        process: the bf16 projections then trace as on it (`matmul.lowering_for`)."""
        return self.backend if self.backend in ("gpu", "tpu") else None

    def compiler_options(self) -> dict:
        """XLA options of the planner's compiles (on CPU devices) for an accelerator's plan.

        XLA:CPU has no bfloat16 dynamic slices: its float normalisation upcasts the slices of
        the scanned layer stack (the remat's saved layer inputs, [L, rows, T, D]) to float32,
        and loop-invariant code motion then hoists that upcast of the whole stack out of the
        backward loop, a float32 copy of every layer's saved input that a GPU or TPU (bf16
        native) never allocates: 13.5 GiB of Qwen3-8B's 50.1 GiB update peak at 24,576 tokens
        a device (docs/scaling.md). Planning a GPU or TPU in 16-bit compute, the compiles skip
        that pass; what remains is still above the native-bf16 buffers (the CPU's float32
        temporaries of the bf16 dots). Plans for the CPU itself compile as XLA:CPU runs."""
        if (
            self.backend in ("gpu", "tpu")
            and not self.native
            and jnp.dtype(self.cfg.dtype).itemsize == 2
        ):
            return {"xla_disable_hlo_passes": CPU_ONLY_HOIST}
        return {}

    def _compile(self, lowered) -> PhaseMemory:
        try:
            return PhaseMemory.of(lowered.compile(compiler_options=self.compiler_options()))
        except jax.errors.JaxRuntimeError as e:
            # The TPU compiler (a `tpu_topology` plan) refuses a program over the chip's HBM;
            # XLA:CPU never does. Its count of the temporaries is still the plan's answer.
            refused = PhaseMemory.refused(e) if self.native else None
            if refused is None:
                raise
            return refused

    def _memo(self, key, compile_fn) -> PhaseMemory:
        # Each compile takes seconds to minutes; the report and the searches reuse results.
        # Traced inside use_mesh so that the model's activation constraints see the mesh.
        if key not in self._compiled:
            stand_in = moe.capacity_stand_in() if self.moe_stand_in else contextlib.nullcontext()
            lowering = matmul.lowering_for(self.accelerator_stood_in_for())
            with sharding.use_mesh(self.mesh, self.rules), stand_in, lowering:
                self._compiled[key] = compile_fn(*key[1:])
        return self._compiled[key]

    def _scalars(self):
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(self.mesh))
        lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(self.mesh))
        return scalar, lr

    def _key(self):
        key = jax.eval_shape(lambda: jax.random.key(0))
        return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(self.mesh))

    def _train(self, micro_per_device: int) -> PhaseMemory:
        w = self.w
        micro_rows = min(micro_per_device * self.dp, w.mini_rows)
        if w.mini_rows % micro_rows:
            raise ValueError(
                f"{micro_per_device} sequences/device x {self.dp} devices must divide the "
                f"mini-batch of {w.mini_rows} sequences"
            )
        update = self.programs(micro_per_device).update
        batch = self._batch(w.prompts * w.n)
        base = (self.base,) if self.lora else ()  # LoRA: the frozen base is an argument
        lowered = update.lower(self.state, batch, *self._scalars(), *base, rng=self._key())
        return self._compile(lowered)

    def _packed_train(self, tokens_per_device: int) -> PhaseMemory:
        params = self.state.params  # the gradients have the trained params' shapes and shardings
        base = (self.base,) if self.lora else ()
        # The [B, T] fields only, as train_stage.update passes them.
        mini_batch = self._batch(self.w.mini_rows)
        mini_batch = mini_batch.replace(input_ids_BS=None, attention_mask_BS=None)
        micro = self._micro(tokens_per_device)
        fn = self.programs().packed_grads
        lowered = fn.lower(params, params, micro, mini_batch, *base, rng=self._key())
        return self._compile(lowered)

    def _apply(self) -> PhaseMemory:
        _, lr = self._scalars()
        fn = self.programs().apply
        return self._compile(fn.lower(self.state, self.state.params, lr, lr))

    def _logprob(self, micro_per_device: int) -> PhaseMemory:
        programs = self.programs(logprob_micro_per_device=micro_per_device)
        # The old-log-prob pass also returns the entropy; it is the larger of the two.
        fn = programs.log_probs_entropy if self.w.needs_old else programs.log_probs
        batch = self._batch(self.w.prompts * self.w.n)
        return self._compile(fn.lower(self.params, batch))

    def _packed_logprob(self, tokens_per_device: int) -> PhaseMemory:
        programs = self.programs()
        fn = programs.packed_log_probs_entropy if self.w.needs_old else programs.packed_log_probs
        lp_BT = self._arr((self.w.prompts * self.w.n, self.w.response_len), jnp.float32)
        micro = self._micro(tokens_per_device)
        return self._compile(fn.lower(self.params, micro, lp_BT, lp_BT))

    def _sample(self, prompts: int) -> PhaseMemory:
        w = self.w
        ids = jax.ShapeDtypeStruct((prompts, w.prompt_len), jnp.int32,
                                   sharding=self._sample_sharding(prompts, 2))  # fmt: skip
        rng = self._key()

        def sample(p, i, m, r):
            if self.lora:  # as engines.NativeEngine: the merged kernels live during the call
                p = lora.merge(self.cfg, p)
            return sampler.sample(
                self.cfg, p, i, m, r, n=w.n, max_new_tokens=w.response_len, temperature=1.0
            )

        fn = jax.jit(sample)
        with nn.logical_axis_rules(self._sample_rows(prompts)[1]):
            return self._compile(fn.lower(self.params, ids, ids, rng))

    def _paged_sample(self, prompts: int, max_num_seqs: int) -> PhaseMemory:
        shards = self.sample_shards(prompts)
        fn, inputs = paged.peak_program(
            self.cfg, self.pool_plan(prompts, max_num_seqs), shards=shards,
            shard_axes=self._sample_rows(prompts)[0] if shards > 1 else None,
            max_new_tokens=self.w.response_len, attention=self.paged_attention(), n=self.w.n,
        )  # fmt: skip

        def call(p, r, *args):
            if self.lora:  # as engines.NativeEngine: the merged kernels live during the call
                p = lora.merge(self.cfg, p)
            return fn(p, r, *args)

        def arg(shape, dtype):
            if shards > 1 and shape:
                return jax.ShapeDtypeStruct(
                    shape, dtype, sharding=self._sample_sharding(prompts, len(shape))
                )
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.replicated(self.mesh))

        args = [arg(shape, dtype) for shape, dtype in inputs]
        with nn.logical_axis_rules(self._sample_rows(prompts)[1]):
            return self._compile(jax.jit(call).lower(self.params, self._key(), *args))

    def paged_attention(self) -> str:
        """The paged engine's decode attention as the planned backend resolves "auto"; the
        Pallas TPU kernel only where the TPU compiler compiles it (`--tpu_topology`): on CPU
        devices standing in for a TPU it would not compile."""
        if not compiles_natively(self.mesh, self.backend):
            return "xla"
        return paged_kernel.resolve("auto", self.backend, kv_dtype=model_lib.cache_dtype(self.cfg))

    # Analytic sizes, for the report (the compiled temporaries already contain them).
    def kv_cache_bytes(self, prompts: int) -> int:
        """The native engine's KV cache per device: the paged engine's pool (one a data
        shard, split by KV head over the tensor axis), or model.GroupKVCache: each prompt's
        slots once, each row's response blocks."""
        c, w = self.cfg, self.w
        if self.is_paged(prompts):
            plan = self.pool_plan(prompts)
            return int(paged_model.pool_bytes(c, plan.num_pages, plan.page_size)
                       / self.mesh.shape["tensor"])  # fmt: skip
        num_blocks, block = model_lib.decode_blocks(w.response_len - 1)
        slots = ((prompts * w.prompt_len + prompts * w.n * num_blocks * block)
                 / self.sample_shards(prompts))  # fmt: skip
        kv_heads = c.num_kv_heads / self.mesh.shape["tensor"]
        itemsize = model_lib.cache_dtype(c).itemsize  # from_run resolved "auto" for the backend
        return int(2 * c.num_layers * slots * kv_heads * c.head_dim * itemsize)

    def sample_logits_bytes(self, prompts: int) -> int:
        return int(prompts * self.w.n / self.sample_shards(prompts) * self.cfg.vocab_size * 4)

    def train_logits_bytes(self) -> int:
        """One float32 [chunk, V] logits chunk of the chunked log-prob pass."""
        return self.loss_config.chunk_size * self.cfg.vocab_size * 4

    def train_peak(self, m: PhaseMemory) -> int:
        return m.total + self.ref_bytes

    def side_peak(self, m: PhaseMemory) -> int:
        """Sampling / log-prob passes: params are an argument, optimizer state stays resident."""
        return m.total + self.opt_bytes + self.ref_bytes

    def packed_peak(self, m: PhaseMemory) -> int:
        """Packed passes: what they take (the trained params, gradients or accumulators and one
        micro-batch) plus what stays resident: the step's batch, the reference copy and, but for
        the optimizer step, the optimizer state."""
        return m.total + self.opt_bytes + self.ref_bytes + self.batch_bytes

    def apply_peak(self, m: PhaseMemory) -> int:
        return m.total + self.ref_bytes + self.batch_bytes

    def phases(self) -> list[Phase]:
        """Every phase one step of the run compiles, in the order the step runs them."""
        w, out = self.w, []
        if not w.vllm:
            m = self.sample(w.prompts)
            label = f"sample (P={w.prompts}" + (
                f", S={w.max_num_seqs})" if self.is_paged(w.prompts) else ")"
            )
            out.append(Phase("sample", label, m, self.side_peak(m)))
        if w.needs_ref or w.needs_old:
            if w.logprob_packed:
                m = self.packed_logprob(w.logprob_tokens_per_device)
                label = f"log-probs ({w.logprob_tokens_per_device} tok/dev)"
                out.append(Phase("logprob", label, m, self.packed_peak(m)))
            else:
                m = self.logprob()
                label = f"log-probs ({w.logprob_micro_per_device}/dev)"
                out.append(Phase("logprob", label, m, self.side_peak(m)))
        if w.packed:
            m = self.packed_train(w.tokens_per_device)
            label = f"train ({w.tokens_per_device} tok/dev)"
            out.append(Phase("train", label, m, self.packed_peak(m)))
            m = self.apply()
            out.append(Phase("apply", "optimizer step", m, self.apply_peak(m)))
        else:
            m = self.train(w.micro_per_device)
            label = f"train ({w.micro_per_device}/dev)"
            out.append(Phase("train", label, m, self.train_peak(m)))
        return out

    def knob(self, phase: str, *, max_micro: int = 64) -> Knob | None:
        """The batch-size field of ``phase`` and the values it may take (None: "apply").

        Padded micro-batches try powers of two per device that split the (mini-)batch evenly;
        token budgets try every whole number of packed rows per device (1 .. max_micro); the
        sampling batch tries data.train_batch_size / 2**k that still splits over the devices.
        """
        w, dp = self.w, self.dp
        if phase == "sample" and self.is_paged(w.prompts):
            # Fewer rows decoding at once a shard: the same rollout, more decode steps. Powers
            # of 2 and the midpoints 1.5 x 2^k (8, 12, 16, 24, 32, 48, ...).
            rows = w.prompts * w.n // self.sample_shards(w.prompts)
            values = {v for k in range(3, 16) for v in (2**k, 3 * 2 ** (k - 1)) if v < rows}
            values |= {w.max_num_seqs}
            return Knob("rollout.max_num_seqs", w.max_num_seqs, tuple(sorted(values)),
                        lambda s: self.side_peak(self.sample(w.prompts, s)))  # fmt: skip
        if phase == "sample":
            # A smaller step batch: the mini-batch cannot be larger (with_knob lowers it too).
            values = {w.prompts // 2**k for k in range(12) if w.prompts % 2**k == 0}
            values = [q for q in values if q % dp == 0]
            return Knob("data.train_batch_size", w.prompts, tuple(sorted(values)),
                        lambda q: self.side_peak(self.sample(q)))  # fmt: skip
        packed = {"train": w.packed, "logprob": w.logprob_packed}.get(phase)
        if packed is None:
            return None
        if packed:
            field, tokens = (
                ("actor.ppo_max_token_len_per_gpu", w.tokens_per_device)
                if phase == "train"
                else ("rollout.log_prob_max_token_len_per_gpu", w.logprob_tokens_per_device)
            )
            values = {r * w.row_len for r in range(1, max_micro + 1)} | {tokens}
            compile_fn = self.packed_train if phase == "train" else self.packed_logprob
            return Knob(field, tokens, tuple(sorted(values)),
                        lambda t: self.packed_peak(compile_fn(t)))  # fmt: skip
        if phase == "train":
            rows, value = w.mini_rows, w.micro_per_device
            field, peak = (
                "actor.ppo_micro_batch_size_per_gpu",
                lambda m: self.train_peak(self.train(m)),
            )
        else:
            rows, value = w.prompts * w.n, w.logprob_micro_per_device
            field, peak = (
                "rollout.log_prob_micro_batch_size_per_gpu",
                lambda m: self.side_peak(self.logprob(m)),
            )
        values = {m for m in (2**i for i in range(12)) if m <= max_micro and m * dp <= rows
                  and rows % (m * dp) == 0} | {value}  # fmt: skip
        return Knob(field, value, tuple(sorted(values)), peak)

    def with_knob(self, knob: Knob, value: int) -> tuple[tuple[str, Any], ...]:
        """The config overrides that set ``knob`` to ``value`` (and what must follow it)."""
        out = ((knob.field, value),)
        if knob.field == "data.train_batch_size":
            mini = self.run.actor.ppo_mini_batch_size
            if value < mini or value % mini:
                out += (("actor.ppo_mini_batch_size", math.gcd(value, mini)),)
        return out


def with_overrides(run: config_lib.RunConfig, overrides) -> config_lib.RunConfig:
    """``run`` with ((dotted field, value), ...) set (and checked, as a config is)."""
    values = config_lib.to_dict(run)
    for dotted, value in overrides:
        *sections, leaf = dotted.split(".")
        node = values
        for section in sections:
            node = node[section]
        node[leaf] = value
    return config_lib.from_dict(config_lib.RunConfig, values)


def largest(candidates, fits) -> tuple[int | None, dict]:
    """Binary search for the largest candidate (sorted ascending) with fits(c) True.

    Assumes monotonicity (memory grows with the batch). Returns (best or None, {c: result}).
    """
    seen = {}
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        ok, result = fits(candidates[mid])
        seen[candidates[mid]] = result
        if ok:
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best, seen


def from_run(
    run: config_lib.RunConfig,
    *,
    model_name: str = "",
    mesh=None,
    backend: str | None = None,
    devices=None,
) -> Planner:
    """The Planner of a run; ``model_name`` picks a PRESET, else the HF config.json in
    model.path (a local directory). ``backend`` ("gpu", "tpu", None: JAX's own) is what
    model.attention_impl="auto" is resolved for. ``devices``: the mesh's devices when no
    ``mesh`` is given (default: JAX's), e.g. a `tpu_topology`'s."""
    dtype, param_dtype = jnp.dtype(run.model.dtype), jnp.dtype(run.model.param_dtype)
    remat = bool(run.model.enable_gradient_checkpointing)
    path = run.model.path
    if model_name:
        cfg = preset_config(model_name, dtype=dtype, param_dtype=param_dtype, remat=remat)
    elif path and os.path.isdir(path):
        cfg = dataclasses.replace(
            model_lib.ModelConfig.from_hf(path), dtype=dtype, param_dtype=param_dtype, remat=remat
        )
    elif path and path.lower().endswith(".gguf"):  # the file's header, no weights read
        cfg = dataclasses.replace(
            gguf.read_config(path), dtype=dtype, param_dtype=param_dtype, remat=remat
        )
    else:
        raise errors.InputError(
            "plan: give --model=<preset> (train.py: --plan_model=<preset>; one of "
            + ", ".join(sorted(PRESETS))
            + ") or a local "
            f"HF checkpoint directory or .gguf file in config.model.path (got {path!r})"
        )
    # What a rematerialised layer keeps changes the update's memory (loading.py does the same).
    row = run.data.max_prompt_length + run.data.max_response_length
    impl = attention.resolve(
        run.model.attention_impl, row, backend, dtype=dtype, head_dim=cfg.head_dim
    )
    if mesh is None:
        mesh = sharding.make_mesh(
            tuple(run.mesh.shape),
            devices=devices,
            sequence=run.actor.ulysses_sequence_parallel_size,
        )
    native = compiles_natively(mesh, backend)
    # cuDNN's and splash's kernels do not compile on CPU devices (splash only in interpret
    # mode, whose memory is not the TPU's): there the blockwise kernel (linear memory too)
    # stands in for them, and the report says so. The TPU compiler compiles splash itself.
    stand_in_for = impl if impl in ("cudnn", "splash") and not native else None
    cfg = dataclasses.replace(
        cfg,
        remat_policy=run.model.gradient_checkpointing_policy,
        attention_impl="blockwise" if stand_in_for else impl,
        # rollout.kv_cache_dtype; "auto" resolved for the planned backend, not for the fake
        # devices it compiles on.
        kv_cache_dtype=model_lib.cache_dtype(
            dataclasses.replace(cfg, kv_cache_dtype=run.rollout.kv_cache_dtype), backend
        ).name,
    )
    tx, _ = setup.make_optimizer(run, total_steps=1)
    # config.mesh.rules (None = sharding.LOGICAL_RULES) overrides the logical-axis rules.
    rules = sharding.rules_from_config(run.mesh.rules)
    planner = Planner(cfg, mesh, run, tx=tx, rules=rules)
    planner.model_name = model_name
    planner.backend = backend
    planner.stand_in_for = stand_in_for
    return planner
