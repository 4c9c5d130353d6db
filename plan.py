r"""Memory planner: will this GRPO config fit, and how large can the micro-batch be?

Run (on the target hardware, or on any CPU by simulating the device count):
  python plan.py --config=configs/gsm8k.py --model=qwen2.5-7b --hbm_gib=141 --devices=8 \
      --config.model.dtype=bfloat16 --config.model.enable_gradient_checkpointing=True
  python train.py --config=... --plan          # the same report, from the trainer

Nothing is materialised: parameters, optimizer state and batches are ``jax.ShapeDtypeStruct``s
carrying their ``NamedSharding``s, and each phase of one GRPO step is AOT-lowered and compiled
for the configured model and mesh (``jax.jit(...).lower(...).compile().memory_analysis()``):

  * sample: ``sampler.sample`` on ``data.train_batch_size`` prompts x ``rollout.n`` (KV cache);
  * logprob: ``trainer.compute_log_probs`` (reference / old log-probs), when the config needs it;
  * train: ``trainer.train_step`` on one mini-batch with ``actor.ppo_micro_batch_size_per_gpu``.

Per device it prints parameters, optimizer state and reference parameters (exact, from the
shardings; with LoRA, model.lora_rank > 0, the frozen base, the adapters and their optimizer
state, no reference copy, and what full fine-tuning would hold instead), XLA's argument /
output / temporary sizes for each phase (temporaries are the
activations, gradients being accumulated and the float32 logits chunks), the KV cache and logits
sizes (analytic), the peak of each phase, and then searches (compiling each candidate) for the
largest micro-batch per device, and the largest number of prompts per sampling call, that fit in
``usable_fraction * hbm_gib``.

--devices=N sets ``--xla_force_host_platform_device_count=N`` on the CPU backend before JAX is
imported, so an 8-GPU or TPU v5p-8 plan can be computed on a laptop. Caveat: the numbers are then
XLA:CPU's buffer assignment for the same sharded program. Parameter, optimizer, batch and KV-cache
bytes are exact; temporaries can differ from the GPU/TPU compilers (other fusion decisions, no
cuDNN/Pallas flash attention), so keep the default 10 % headroom and re-run on the real hardware
(without --devices) before a long job.

Peak of a phase = its compiled arguments + outputs - donated (aliased) buffers + temporaries +
what stays resident outside it (the reference parameters; during sampling and log-prob passes
also the optimizer state, which is not an argument there).
"""

import dataclasses
import functools
import math
import os
import sys


def _fake_device_count(argv) -> int:
    for arg in argv:
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 0


if __name__ == "__main__" and _fake_device_count(sys.argv):
    # Must happen before JAX initialises its backends (the reason for this module-level code).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_fake_device_count(sys.argv)}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from grpo_jax import config as config_lib
from grpo_jax import lora, loop, sampler, sharding, step, trainer
from grpo_jax import model as model_lib

GIB = 2**30

# Architectures from the models' config.json, so planning needs no download.
PRESETS = {
    "tiny": {},  # ModelConfig.tiny()
    "qwen2.5-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_layers": 28,
        "num_heads": 12,
        "num_kv_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_layers": 36,
        "num_heads": 16,
        "num_kv_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_layers": 28,
        "num_heads": 28,
        "num_kv_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
}
_QWEN25 = {
    "arch": "qwen2",
    "qkv_bias": True,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}


def preset_config(name: str, *, dtype, param_dtype, remat: bool) -> model_lib.ModelConfig:
    """The ModelConfig of preset ``name`` (see PRESETS) with the run's dtypes and remat."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    if name == "tiny":
        return model_lib.ModelConfig.tiny(dtype=dtype, param_dtype=param_dtype, remat=remat)
    return model_lib.ModelConfig(
        **_QWEN25, **PRESETS[name], dtype=dtype, param_dtype=param_dtype, remat=remat
    )


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

    @classmethod
    def from_run(cls, run: config_lib.RunConfig) -> "Workload":
        n = run.rollout.n
        return cls(
            prompt_len=sampler.bucket_length(run.data.max_prompt_length),
            response_len=run.data.max_response_length,
            n=n,
            prompts=run.data.train_batch_size,
            mini_rows=run.actor.ppo_mini_batch_size * n,
            micro_per_device=run.actor.ppo_micro_batch_size_per_gpu,
            logprob_micro_per_device=run.rollout.log_prob_micro_batch_size_per_gpu,
            needs_ref=run.needs_reference,  # the library's rules, not re-derived here
            needs_old=run.needs_old_log_probs,
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


class Planner:
    """Compiles the phases of one GRPO step for a model, mesh and run, without weights.

    The phases are the library's own jitted programs (`step.make_programs`), lowered on
    sharded ShapeDtypeStructs, so the plan is of exactly what train.py runs.
    """

    def __init__(self, model_config, mesh, run: config_lib.RunConfig, *, tx, rules):
        m = run.model
        if m.lora_rank:  # the trained params are the adapters; the base is frozen
            model_config = lora.configure(
                model_config, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules
            )
        self.cfg, self.mesh, self.run = model_config, mesh, run
        self.w = Workload.from_run(run)
        self.tx = tx
        self.loss_config = run.actor.loss_config(temperature=run.rollout.temperature)
        self.dp = mesh.shape["data"] * mesh.shape["fsdp"]
        self.rules = rules
        self.lora = bool(model_config.lora_rank)
        abstract = model_lib.abstract_params(model_config)
        self.param_sh = sharding.param_shardings(model_config, mesh, rules)
        self.base = sharding.abstract_with_shardings(abstract, self.param_sh)
        if self.lora:
            trained = model_lib.abstract_adapters(model_config)
            trained_sh = sharding.adapter_shardings(model_config, mesh, rules)
            adapters = sharding.abstract_with_shardings(trained, trained_sh)
            self.params = lora.attach(self.base, adapters)  # the policy: base + adapters
        else:
            trained, trained_sh, self.params = abstract, self.param_sh, self.base
        abstract_state = jax.eval_shape(functools.partial(trainer.init_state, tx=tx), trained)
        state_sh = trainer.TrainState(
            sharding.replicated(mesh),
            trained_sh,
            sharding.tx_state_shardings(tx, trained, trained_sh, mesh),
        )
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
        self._compiled = {}

    def lora_saved_bytes(self) -> int:
        """Resident bytes per device that LoRA saves over full fine-tuning of the same model:
        (full optimizer state + reference copy) - (adapters + their optimizer state + reference).
        0 without LoRA."""
        if not self.lora:
            return 0
        full = self.full_opt_bytes + self.full_ref_bytes
        return full - (self.adapter_bytes + self.opt_bytes + self.ref_bytes)

    def programs(self, micro_per_device: int | None = None) -> step.Programs:
        """The run's programs, with another micro-batch size when given (the search)."""
        run = self.run
        if micro_per_device is not None:
            actor = dataclasses.replace(run.actor, ppo_micro_batch_size_per_gpu=micro_per_device)
            run = dataclasses.replace(run, actor=actor)
        return step.make_programs(run, self.cfg, self.tx, dp=self.dp)

    def _batch(self, rows: int) -> trainer.TrainBatch:
        w, tp = self.w, self.w.prompt_len
        s, t = tp + w.response_len, w.response_len

        def arr(shape, dtype):
            return jax.ShapeDtypeStruct(
                shape, dtype, sharding=sharding.batch_sharding(self.mesh, 2)
            )

        return trainer.TrainBatch(
            input_ids_BS=arr((rows, s), jnp.int32),
            attention_mask_BS=arr((rows, s), jnp.int32),
            response_ids_BT=arr((rows, t), jnp.int32),
            response_mask_BT=arr((rows, t), jnp.int32),
            advantages_BT=arr((rows, t), jnp.float32),
            old_log_probs_BT=arr((rows, t), jnp.float32) if w.needs_old else None,
            ref_log_probs_BT=arr((rows, t), jnp.float32) if w.needs_ref else None,
        )

    def train(self, micro_per_device: int) -> PhaseMemory:
        """One ``train_step`` (state donated) on the step's batch, one mini-batch of it."""
        return self._memo(("train", micro_per_device), self._train)

    def logprob(self) -> PhaseMemory:
        """``compute_log_probs`` over the step's batch (reference or old policy)."""
        return self._memo(("logprob",), self._logprob)

    def sample(self, prompts: int) -> PhaseMemory:
        """``sampler.sample`` of ``prompts`` x n completions of response_len tokens."""
        return self._memo(("sample", prompts), self._sample)

    def _memo(self, key, compile_fn) -> PhaseMemory:
        # Each compile takes seconds to minutes; the report and the searches reuse results.
        # Traced inside use_mesh so that the model's sharding.constrain calls see the mesh.
        if key not in self._compiled:
            with sharding.use_mesh(self.mesh, self.rules):
                self._compiled[key] = compile_fn(*key[1:])
        return self._compiled[key]

    def _train(self, micro_per_device: int) -> PhaseMemory:
        w = self.w
        micro_rows = min(micro_per_device * self.dp, w.mini_rows)
        if w.mini_rows % micro_rows:
            raise ValueError(
                f"{micro_per_device} sequences/device x {self.dp} devices must divide the "
                f"mini-batch of {w.mini_rows} sequences"
            )
        update = self.programs(micro_per_device).update
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(self.mesh))
        lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(self.mesh))
        batch = self._batch(w.prompts * w.n)
        base = (self.base,) if self.lora else ()  # LoRA: the frozen base is an argument
        return PhaseMemory.of(update.lower(self.state, batch, scalar, lr, *base).compile())

    def _logprob(self) -> PhaseMemory:
        programs = self.programs()
        # The old-log-prob pass also returns the entropy; it is the larger of the two.
        fn = programs.log_probs_entropy if self.w.needs_old else programs.log_probs
        batch = self._batch(self.w.prompts * self.w.n)
        return PhaseMemory.of(fn.lower(self.params, batch).compile())

    def _sample(self, prompts: int) -> PhaseMemory:
        w = self.w
        ids = jax.ShapeDtypeStruct(
            (prompts, w.prompt_len), jnp.int32, sharding=sharding.batch_sharding(self.mesh, 2)
        )
        rng = jax.eval_shape(lambda: jax.random.key(0))
        rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=sharding.replicated(self.mesh))

        def sample(p, i, m, r):
            if self.lora:  # as step.NativeEngine: the merged kernels live during the call
                p = lora.merge(self.cfg, p)
            return sampler.sample(
                self.cfg, p, i, m, r, n=w.n, max_new_tokens=w.response_len, temperature=1.0
            )

        fn = jax.jit(sample)
        return PhaseMemory.of(fn.lower(self.params, ids, ids, rng).compile())

    # Analytic sizes, for the report (the compiled temporaries already contain them).
    def kv_cache_bytes(self, prompts: int) -> int:
        c, w = self.cfg, self.w
        rows = prompts * w.n / self.dp
        kv_heads = c.num_kv_heads / self.mesh.shape["tensor"]
        slots = w.prompt_len + w.response_len - 1
        return int(2 * c.num_layers * rows * slots * kv_heads * c.head_dim * c.dtype.itemsize)

    def sample_logits_bytes(self, prompts: int) -> int:
        return int(prompts * self.w.n / self.dp * self.cfg.vocab_size * 4)

    def train_logits_bytes(self) -> int:
        """One float32 [chunk, V] logits chunk of the chunked log-prob pass."""
        return self.loss_config.chunk_size * self.cfg.vocab_size * 4

    def train_peak(self, m: PhaseMemory) -> int:
        return m.total + self.ref_bytes

    def side_peak(self, m: PhaseMemory) -> int:
        """Sampling / log-prob passes: params are an argument, optimizer state stays resident."""
        return m.total + self.opt_bytes + self.ref_bytes


def _largest(candidates, fits) -> tuple[int | None, dict]:
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


def _gb(x: float) -> str:
    return f"{x / GIB:8.2f}"


def plan(planner: Planner, *, hbm_bytes: int, search: bool = True, max_micro: int = 64) -> str:
    """Compiles every phase, searches the batch sizes that fit, returns the report text."""
    p, w = planner, planner.w
    budget = hbm_bytes
    lines = [
        (
            f"model: L={p.cfg.num_layers} D={p.cfg.hidden_size} N={p.cfg.num_heads} "
            f"K={p.cfg.num_kv_heads} H={p.cfg.head_dim} F={p.cfg.intermediate_size} "
            f"V={p.cfg.vocab_size} params={p.cfg.param_dtype} compute={p.cfg.dtype} remat={p.cfg.remat}"
        ),
        (
            f"mesh: {dict(p.mesh.shape)} on {p.mesh.devices.size} x {p.mesh.devices.flat[0].platform}"
            f" | budget {budget / GIB:.1f} GiB/device"
        ),
        (
            f"step: P={w.prompts} prompts x n={w.n}, Tp={w.prompt_len}, T={w.response_len}, "
            f"mini-batch {w.mini_rows} seqs, micro {w.micro_per_device}/device, "
            f"ref={'yes' if w.needs_ref else 'no'}, old log-probs={'yes' if w.needs_old else 'no'}"
        ),
        "",
        "per-device GiB          | resident | argument |   output |  donated |     temp |     PEAK",
        "------------------------|----------|----------|----------|----------|----------|---------",
        f"{'base params (frozen)' if p.lora else 'params':<24}| {_gb(p.param_bytes)} |",
        *([f"LoRA adapters (f32)     | {_gb(p.adapter_bytes)} |"] if p.lora else []),
        f"optimizer state         | {_gb(p.opt_bytes)} |",
        f"reference params        | {_gb(p.ref_bytes)} |",
    ]

    def row(name, m: PhaseMemory, peak):
        return (
            f"{name:<24}|          | {_gb(m.argument)} | {_gb(m.output)} | {_gb(m.alias)} |"
            f" {_gb(m.temp)} | {_gb(peak)}"
        )

    sample_m = p.sample(w.prompts)
    lines.append(row(f"sample (P={w.prompts})", sample_m, p.side_peak(sample_m)))
    peaks = [p.side_peak(sample_m)]
    if w.needs_ref or w.needs_old:
        lp = p.logprob()
        lines.append(row(f"log-probs ({w.logprob_micro_per_device}/dev)", lp, p.side_peak(lp)))
        peaks.append(p.side_peak(lp))
    train_m = p.train(w.micro_per_device)
    lines.append(row(f"train ({w.micro_per_device}/dev)", train_m, p.train_peak(train_m)))
    peaks.append(p.train_peak(train_m))
    lines += [
        "",
        f"KV cache (sample, analytic)      {_gb(p.kv_cache_bytes(w.prompts))} GiB/device",
        f"logits [rows,V] f32 (sample)     {_gb(p.sample_logits_bytes(w.prompts))} GiB/device",
        (
            f"logits chunk f32 (train, one)    {_gb(p.train_logits_bytes())} GiB "
            f"(loss chunk_size={p.loss_config.chunk_size} rows)"
        ),
        *_lora_lines(p),
        f"step peak {max(peaks) / GIB:.2f} GiB/device -> "
        + ("FITS" if max(peaks) <= budget else "DOES NOT FIT")
        + f" in {budget / GIB:.1f} GiB",
    ]
    if search:
        # Micro-batches per device that divide the mini-batch evenly, powers of two.
        micro = [
            m
            for m in (2**i for i in range(12))
            if m <= max_micro and m * p.dp <= w.mini_rows and w.mini_rows % (m * p.dp) == 0
        ]
        best_micro, seen = _largest(micro, lambda m: _fits(p.train(m), p.train_peak, budget))
        prompts = [q * p.dp for q in (2**i for i in range(12)) if q * p.dp <= w.prompts]
        best_p, seen_p = _largest(prompts, lambda q: _fits(p.sample(q), p.side_peak, budget))
        tried = ", ".join(f"{m}:{v / GIB:.1f}" for m, v in sorted(seen.items()))
        tried_p = ", ".join(f"{q}:{v / GIB:.1f}" for q, v in sorted(seen_p.items()))
        lines += [
            (
                f"largest micro-batch per device that fits: {best_micro} "
                f"(tried micro:peak GiB {tried})"
            ),
            (
                f"largest prompts per sampling call (x n={w.n}) that fits: {best_p} "
                f"(tried P:peak GiB {tried_p})"
            ),
        ]
    return "\n".join(lines)


def _lora_lines(p: Planner) -> list[str]:
    """With LoRA: the adapters, and what full fine-tuning would hold resident instead."""
    if not p.lora:
        return []
    c = p.cfg
    return [
        (
            f"LoRA r={c.lora_rank} alpha={c.lora_alpha:g} on {','.join(c.lora_targets)}: "
            f"{lora.num_params(c) / 1e6:.2f}M trainable params"
        ),
        (
            f"LoRA vs full fine-tuning, resident GiB/device: optimizer {_gb(p.opt_bytes).strip()}"
            f" vs {_gb(p.full_opt_bytes).strip()}, reference {_gb(p.ref_bytes).strip()} vs "
            f"{_gb(p.full_ref_bytes).strip()}, adapters +{_gb(p.adapter_bytes).strip()}: saves "
            f"{p.lora_saved_bytes() / GIB:.2f} GiB/device"
        ),
    ]


def _fits(m: PhaseMemory, peak_fn, budget) -> tuple[bool, int]:
    peak = peak_fn(m)
    return peak <= budget, peak


def planner_from_config(c, *, model_name: str = "", mesh=None) -> Planner:
    """Planner for a train.py config; ``model_name`` picks a PRESET, else config.json at path."""
    run = config_lib.from_dict(config_lib.RunConfig, c.to_dict())
    dtype, param_dtype = jnp.dtype(run.model.dtype), jnp.dtype(run.model.param_dtype)
    remat = bool(run.model.enable_gradient_checkpointing)
    if model_name:
        cfg = preset_config(model_name, dtype=dtype, param_dtype=param_dtype, remat=remat)
    elif run.model.path and os.path.isdir(run.model.path):
        cfg = dataclasses.replace(
            model_lib.ModelConfig.from_hf(run.model.path),
            dtype=dtype,
            param_dtype=param_dtype,
            remat=remat,
        )
    else:
        raise ValueError(
            "plan: give --model=<preset> (train.py: --plan_model=<preset>; one of "
            + ", ".join(sorted(PRESETS))
            + ") or a local "
            f"HF checkpoint directory in config.model.path (got {run.model.path!r})"
        )
    mesh = sharding.make_mesh(tuple(run.mesh.shape)) if mesh is None else mesh
    tx, _ = loop.make_optimizer(run, total_steps=1)
    # config.mesh.rules (None = sharding.LOGICAL_RULES) overrides the logical-axis rules.
    rules = sharding.rules_from_config(run.mesh.rules)
    return Planner(cfg, mesh, run, tx=tx, rules=rules)


def run(
    c,
    *,
    model_name: str = "",
    hbm_gib: float,
    usable_fraction: float = 0.9,
    search: bool = True,
    max_micro: int = 64,
) -> str:
    """Entry point for ``train.py --plan``: the report for config ``c`` (see module docstring)."""
    planner = planner_from_config(c, model_name=model_name)
    return plan(
        planner, hbm_bytes=int(hbm_gib * GIB * usable_fraction), search=search, max_micro=max_micro
    )


def _define_flags():
    """Flags of the plan.py script (not defined on import: train.py imports this module)."""
    return {
        "config": config_flags.DEFINE_config_file("config", None, "train.py config file."),
        "model": flags.DEFINE_string("model", "", f"model preset: {', '.join(PRESETS)}"),
        "hbm_gib": flags.DEFINE_float("hbm_gib", 80.0, "GiB per device (H200 141, v5p 95)"),
        "usable_fraction": flags.DEFINE_float("usable_fraction", 0.9, "usable part of hbm_gib"),
        "devices": flags.DEFINE_integer("devices", 0, "simulate N CPU devices (0: real ones)"),
        "search": flags.DEFINE_bool("search", True, "search the largest batch sizes that fit"),
        "max_micro": flags.DEFINE_integer("max_micro", 64, "largest micro-batch/device to try"),
    }


def main(argv, fl):
    del argv
    if fl["config"].value is None:
        raise app.UsageError("--config is required, e.g. --config=configs/gsm8k.py")
    devices = fl["devices"].value
    if devices and len(jax.devices()) != devices:
        raise app.UsageError(f"--devices={devices} but JAX sees {len(jax.devices())} devices")
    report = run(
        fl["config"].value,
        model_name=fl["model"].value,
        hbm_gib=fl["hbm_gib"].value,
        usable_fraction=fl["usable_fraction"].value,
        search=fl["search"].value,
        max_micro=fl["max_micro"].value,
    )
    print(report)


if __name__ == "__main__":
    _flags = _define_flags()
    app.run(functools.partial(main, fl=_flags))
