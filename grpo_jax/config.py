"""The typed configuration of a GRPO run: one frozen dataclass per section, with verl's names.

This module owns every knob of a run, its default and its checks. The sections and leaf names are
verl 0.9.1's (`actor_rollout_ref.actor.X` -> `actor.X`, `actor_rollout_ref.rollout.X` ->
`rollout.X`, `data.X`, `algorithm.X`, `trainer.X`, `custom_reward_function.X`), so a verl run
script ports line by line (README "verl override mapping"); the defaults are verl's
(docs/verl-semantics.md section 7) unless a comment says otherwise. `configs/common.py` turns
`RunConfig()` into the ml_collections tree that `train.py --config.X=...` overrides, so this file
is the single list of fields; library users build the dataclasses directly.

Checks:
  * Per field, in each section's `__post_init__`. Where a library function owns a rule (the
    sampler's temperature / top-p / top-k, the actor loss's modes and clip bounds), the section
    calls that function, so each rule lives in one place; the message names the dotted field.
  * Across sections, in `RunConfig.__post_init__` (group size vs estimator, mini-batch vs batch,
    paths the source needs, reward weights vs functions, ...).
  * Against the device mesh, in `RunConfig.check_mesh(dp)` once the mesh is known.
A section raises `ConfigError` listing all of its problems; `from_dict` collects the problems of
every section before raising, so one run of a bad config reports them together.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from grpo_jax import advantage, errors, loss, registry, sampler
from grpo_jax import model as model_lib
from grpo_jax import rollout_correction as rc
from grpo_jax.data import prompts, readers
from grpo_jax.models import attention as model_attention
from grpo_jax.models import lora
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import genrm
from grpo_jax.rollout import vllm_pool, vllm_sidecar
from grpo_jax.trainer import actor as actor_lib
from grpo_jax.trainer import trackers


class ConfigError(errors.InputError):
    """An invalid config; `problems` lists each one as 'dotted.field=value: why'."""

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


class _Checks:
    """Collects the problems of one section; `done()` raises them together."""

    def __init__(self, section: str):
        self.section, self.problems = section, []

    def need(self, ok: bool, field: str, value: Any, why: str) -> None:
        if not ok:
            self.problems.append(f"{self.section}.{field}={value!r} {why}")

    def choice(self, field: str, value: Any, allowed: Sequence[Any]) -> None:
        self.need(value in allowed, field, value, f"must be one of {list(allowed)}")

    def call(self, fn, *args, **kwargs) -> Any:
        """Runs a library validator; its ValueError ('name=value ...') is prefixed by section."""
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            self.problems.append(f"{self.section}.{e}")
            return None

    def done(self) -> None:
        collector = _COLLECTOR.get()
        if collector is not None:  # inside from_dict: gather, raise once at the end
            collector += self.problems
        elif self.problems:
            raise ConfigError(self.problems)


# While `from_dict` builds a config, sections add their problems here instead of raising, so
# the checks across sections still run and every problem is reported in one error.
_COLLECTOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("collector", default=None)


def _positive(checks: _Checks, obj, *names: str) -> None:
    for name in names:
        checks.need(getattr(obj, name) >= 1, name, getattr(obj, name), "must be >= 1")


# ---------------------------------------------------------------------------------------------
# data


DATA_SOURCES = ("files", "jsonl", "hf", "tfds", "arithmetic")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """The built-in arithmetic task (data.source="arithmetic"; grpo_jax/data/demo_task.py)."""

    num_train: int = 2000  # training questions
    num_val: int = 200  # held-out questions
    max_operand: int = 99  # operands are drawn from [0, max_operand]
    modulus: int = 0  # > 0: the answer is (a + b) mod modulus ("a+b%m")
    seed: int = 0  # generator seed (train and val are disjoint when the space allows)

    def __post_init__(self):
        c = _Checks("data.arithmetic")
        _positive(c, self, "num_train", "num_val")
        for name in ("max_operand", "modulus", "seed"):
            c.need(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Section `data`: where prompts come from, their format, batch sizes and lengths.

    Sources (grpo_jax/data/readers.py): "files" (parquet / jsonl / json files in verl's layout, raw
    GSM8K jsonl, or any layout with a `prompt_key` column; "jsonl" is the same), "hf" (anything
    `datasets.load_dataset` loads: a hub id when online, or a local dataset dir or script),
    "tfds" (a tensorflow-datasets builder, read through array_record without TensorFlow) and
    "arithmetic" (the built-in demo task).
    """

    source: str = "files"
    path: str | None = None  # train file(s), comma-separated; for "hf" the dataset id or dir
    val_path: str | None = None  # validation file(s); for "hf"/"tfds" the val_split is used
    train_split: str = "train"  # hf / tfds split for training
    val_split: str = "test"  # hf / tfds split for validation
    hf_name: str | None = None  # hf: the dataset config name (GSM8K on the hub: "main")
    tfds_name: str = "gsm8k"  # tfds builder name
    tfds_data_dir: str | None = None  # tfds data_dir (None = tfds' default ~/tensorflow_datasets)
    prompt_key: str = "prompt"  # column with chat messages (verl) or a plain prompt string (TRL)
    reward_fn_key: str = "data_source"  # column that selects the scorer (verl)
    ground_truth_key: str = "reward_model.ground_truth"  # dotted path of the ground truth
    prompt_suffix: str = readers.VERL_GSM8K_INSTRUCTION  # appended to raw GSM8K questions only
    train_batch_size: int = 1024  # prompts per step
    # Prompts per read of the data order (verl's dataloader batch size; must divide
    # train_batch_size); None = train_batch_size. With algorithm.filter_groups it is 1 (verl).
    gen_batch_size: int | None = None
    val_batch_size: int = 256  # prompts per validation generate call
    # Caps on the prompts read (verl): -1 = all; else that many, drawn before the overlong
    # filter as verl's RLHFDataset draws them: a seeded random subset (data.seed) with
    # data.shuffle, the first ones without (prompts.select_samples).
    train_max_samples: int = -1
    val_max_samples: int = -1
    max_prompt_length: int = 512  # tokens after the chat template
    max_response_length: int = 512  # generated tokens per completion
    prompt_length_bucket: int = 64  # the update's prompt width rounds up to this (fewer compiles)
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length
    truncation: str = "error"  # "error" | "left" | "right" for overlong prompts not dropped
    shuffle: bool = True  # reshuffle the train set every epoch (seeded)
    seed: int = 1  # shuffle seed
    on_malformed: str = "skip"  # "skip" (count + warn with line numbers) | "error"
    # Keyword arguments of the tokenizer's apply_chat_template for chat-message prompts, train
    # and validation alike (verl), e.g. {"enable_thinking": False} for Qwen3. On the command
    # line a Python dict literal: --config.data.apply_chat_template_kwargs="{'enable_thinking':
    # False}" (a key that the config file sets can also be overridden alone).
    apply_chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    arithmetic: ArithmeticConfig = ArithmeticConfig()

    def __post_init__(self):
        c = _Checks("data")
        c.choice("source", self.source, DATA_SOURCES)
        c.choice("truncation", self.truncation, prompts.TRUNCATION_MODES)
        c.choice("on_malformed", self.on_malformed, readers.ON_MALFORMED_MODES)
        _positive(c, self, "train_batch_size", "val_batch_size", "max_prompt_length")
        _positive(c, self, "max_response_length", "prompt_length_bucket")
        for name in ("train_max_samples", "val_max_samples"):
            value = getattr(self, name)
            c.need(value == -1 or value >= 1, name, value, "must be -1 (all) or >= 1")
        c.call(prompts.check_chat_template_kwargs, self.apply_chat_template_kwargs)
        c.need(self.seed >= 0, "seed", self.seed, "must be >= 0")
        c.need(self.gen_batch_size is None or self.gen_batch_size >= 1, "gen_batch_size",
               self.gen_batch_size, "must be >= 1 or None")
        c.done()

    def check_source(self) -> None:
        """What loading from `source` needs (the loader and train.py call it; a library user who
        passes examples directly never does)."""
        c = _Checks("data")
        if self.source in ("files", "jsonl"):
            c.need(bool(self.paths), "path", self.path, f"is required with source={self.source!r}")
            c.need(
                bool(self.val_paths),
                "val_path",
                self.val_path,
                f"is required with source={self.source!r}",
            )
        if self.source == "hf":
            c.need(bool(self.paths), "path", self.path, "must name the dataset for source='hf'")
        # A file named where the source does not read it would be ignored: the run would train
        # on other data than the one given.
        splits = f"splits {self.train_split!r} / {self.val_split!r}"
        unread, reads = {
            "tfds": (("path", "val_path"), f"tfds' {self.tfds_name!r}, {splits}"),
            "hf": (("val_path",), f"{self.path!r}, {splits}"),
            "arithmetic": (("path", "val_path"), "the built-in arithmetic task (data.arithmetic)"),
        }.get(self.source, ((), ""))
        for name in unread:
            value = getattr(self, name)
            c.need(
                not value,
                name,
                value,
                f"is not read with source={self.source!r}, which reads {reads}: set "
                "data.source=files to train on your files, or drop it",
            )
        c.done()

    @property
    def paths(self) -> tuple[str, ...]:
        return registry.split_list(self.path)

    @property
    def val_paths(self) -> tuple[str, ...]:
        return registry.split_list(self.val_path)


# ---------------------------------------------------------------------------------------------
# model


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the random model of model.source="random" (tests, smoke runs)."""

    hidden_size: int = 64  # D
    intermediate_size: int = 128  # F
    num_layers: int = 2  # L
    num_heads: int = 4  # N
    num_kv_heads: int = 2  # K
    head_dim: int = 16  # H
    seed: int = 0  # init seed
    # > 0: a Qwen3-MoE instead of the dense Qwen2 layers, every layer a mixture of this many
    # experts of width moe_intermediate_size, num_experts_per_tok of them a token
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32

    def __post_init__(self):
        c = _Checks("model.tiny")
        _positive(c, self, "hidden_size", "intermediate_size", "num_layers", "num_heads")
        _positive(c, self, "num_kv_heads", "head_dim")
        c.need(self.num_experts >= 0, "num_experts", self.num_experts, "must be >= 0 (0: dense)")
        if self.num_experts > 0:
            _positive(c, self, "moe_intermediate_size")
            c.need(1 <= self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                   self.num_experts_per_tok,
                   f"must be in [1, model.tiny.num_experts={self.num_experts}]")  # fmt: skip
        if self.num_heads >= 1 and self.num_kv_heads >= 1:
            c.need(
                self.num_heads % self.num_kv_heads == 0,
                "num_heads",
                self.num_heads,
                f"must be a multiple of model.tiny.num_kv_heads={self.num_kv_heads} (grouped-query "
                "attention)",
            )
        c.done()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Section `model`: which weights and tokenizer, and how the model computes."""

    path: str | None = None  # HF checkpoint dir, hub id, or a .gguf file (source "hf")
    source: str = "hf"  # "hf" (load model.path) | "random" (init model.tiny)
    tokenizer: str = "hf"  # "hf" (from model.path, GGUF included) | "char" (built-in)
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    param_dtype: str = "float32"  # parameter / optimizer dtype: "float32" | "bfloat16"
    enable_gradient_checkpointing: bool = False  # remat each layer in the update (verl name)
    # What a rematerialised layer keeps (model.REMAT_POLICIES): "nothing_saveable" (its input
    # only), "dots_with_no_batch_dims_saveable" (the projections; attention is recomputed),
    # "dots_except_mlp_in_saveable" (those but the MLP's gate/up), "dots_saveable" (every
    # matmul output).
    gradient_checkpointing_policy: str = "nothing_saveable"
    # How causal self-attention runs in the update and the log-prob passes
    # (grpo_jax/models/attention.py): "xla" (dense float32 scores, T^2 a row and head),
    # "blockwise" (online softmax over key blocks: memory linear in the row length), "cudnn"
    # (GPU, bf16/fp16), "splash" (TPU; Pallas interpret mode elsewhere, for tests), "auto"
    # (splash on TPU, cudnn on GPU where it can run, else blockwise; on the CPU blockwise for
    # rows of 2,048 tokens or more, else xla).
    attention_impl: str = "auto"
    # LoRA (grpo_jax/models/lora.py; verl's actor_rollout_ref.model.*): rank r of the adapters
    # trained on the frozen base; 0 = full fine-tuning. The reference is then the base, adapters
    # off.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    # "all-linear" (every projection but the output head, as PEFT) or comma-separated names out
    # of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    target_modules: str = "all-linear"
    tiny: TinyModelConfig = TinyModelConfig()

    def __post_init__(self):

        c = _Checks("model")
        c.choice("source", self.source, ("hf", "random"))
        c.choice("tokenizer", self.tokenizer, ("hf", "char"))
        c.choice("dtype", self.dtype, ("float32", "bfloat16"))
        c.choice("param_dtype", self.param_dtype, ("float32", "bfloat16"))
        c.choice(
            "gradient_checkpointing_policy",
            self.gradient_checkpointing_policy,
            model_lib.REMAT_POLICIES,
        )
        c.choice("attention_impl", self.attention_impl, model_lib.ATTENTION_IMPLS)
        c.need(self.lora_rank >= 0, "lora_rank", self.lora_rank, "must be >= 0 (0 = no LoRA)")
        c.need(self.lora_alpha > 0, "lora_alpha", self.lora_alpha, "must be > 0")
        c.call(lora.parse_target_modules, self.target_modules)
        c.done()

    def check_source(self) -> None:
        """What loading needs (the loader and train.py call it; not needed for a given model)."""
        c = _Checks("model")
        if "hf" in (self.source, self.tokenizer):
            c.need(
                bool(self.path),
                "path",
                self.path,
                "is required with model.source='hf' or "
                "model.tokenizer='hf' (an HF checkpoint dir, hub id or .gguf file)",
            )
        c.done()


# ---------------------------------------------------------------------------------------------
# actor

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Section `actor.optim`: AdamW and its learning-rate schedule."""

    lr: float = 1e-6  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (b1, b2)
    weight_decay: float = 0.01  # decoupled weight decay
    lr_warmup_steps: int = -1  # linear warm-up steps; <= 0 = use lr_warmup_steps_ratio (verl)
    lr_warmup_steps_ratio: float = 0.0  # warm-up as a fraction of the total training steps
    lr_scheduler_type: str = "constant"  # "constant" | "cosine" (after the warm-up)
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr

    def __post_init__(self):
        c = _Checks("actor.optim")
        c.need(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be finite and > 0")
        c.need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            self.betas,
            "must be two values in [0, 1)",
        )
        c.need(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        c.choice("lr_scheduler_type", self.lr_scheduler_type, actor_lib.LR_SCHEDULES)
        for name in ("lr_warmup_steps_ratio", "min_lr_ratio"):
            c.need(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        c.done()

    def warmup_steps(self, total_steps: int) -> int:
        """verl: lr_warmup_steps when > 0, else lr_warmup_steps_ratio * total_steps."""
        if self.lr_warmup_steps > 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * total_steps)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Section `actor.policy_loss` (verl's PolicyLossConfig): the loss and its own settings."""

    # loss.POLICY_LOSS_MODES, a name given to loss.register_policy_loss, or "module:function"
    # (imported when the loss is first computed).
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # clip_cov: covariance window
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: float | None = None  # dro: the quadratic penalty's beta (required for dro)

    def __post_init__(self):

        c = _Checks("actor.policy_loss")
        c.call(loss.check_policy_loss_mode, "loss_mode", self.loss_mode)
        c.need(self.loss_mode != "dro" or (self.dro_beta or 0) > 0, "dro_beta", self.dro_beta,
               "must be > 0 for loss_mode='dro'")
        c.done()


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclasses.dataclass(frozen=True)
class RouterReplayConfig:
    """Section `actor.router_replay` (verl 0.9.1's engine RouterReplayConfig, there under
    actor.megatron / actor.veomni): which recorded experts a mixture-of-experts model's passes
    route to, instead of the routers' own top-k (docs/models.md, "Router replay").

    mode:
      "disabled": every pass routes by its own router.
      "R2": the old-log-prob pass records its routing and the update replays it (the reference
        pass routes by its own router, as verl's). Without an old-log-prob pass (on-policy,
        one mini-batch) the update's policy is the recording one, so it routes natively.
      "R3": the rollout records each token's experts (rollout.enable_rollout_routing_replay)
        and the old-log-prob pass and the update replay them (the reference pass does not).
    verl's record_file / replay_file are not mirrored: its engines read neither.
    """

    mode: str = "disabled"  # ROUTER_REPLAY_MODES

    def __post_init__(self):
        c = _Checks("actor.router_replay")
        c.choice("mode", self.mode, ROUTER_REPLAY_MODES)
        c.done()


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """Section `actor`: the update (mini/micro-batches, PPO clip, KL loss, entropy, optimizer).

    Paper symbols: clip_ratio_low/high = epsilon_low/high (DAPO clip-higher when they differ),
    kl_loss_coef = beta (GRPO eq. 3 uses k3 = "low_var_kl"), clip_ratio_c = dual-clip c.
    """

    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n sequences)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per device per accumulation step
    use_dynamic_bsz: bool = False  # pack sequences into token-budget micro-batches instead
    # that budget, tokens per device (grpo_jax/trainer/packing.py)
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1  # passes over the batch (mu)
    # Ulysses sequence parallelism (verl's name; 1 = off): each row's tokens are split over
    # this many devices (the mesh's "sequence" axis) for the update and the log-prob passes,
    # attention splitting the heads instead (grpo_jax/sharding.py). As in verl, the token
    # budget ppo_max_token_len_per_gpu is per device, so a row may hold sp times as many.
    ulysses_sequence_parallel_size: int = 1
    # Each ppo epoch, the batch's rows are shuffled before being cut into mini-batches, within
    # each data-parallel block as verl's per-rank dataloader (train_stage.mini_batch_order); the
    # draws are seeded by data_loader_seed and the block, the same every step (verl).
    shuffle: bool = False
    data_loader_seed: int = 42
    clip_ratio: float = 0.2  # epsilon; verl's ActorConfig sets low/high explicitly (below)
    # epsilon_low / epsilon_high (DAPO clip-higher: high 0.28). verl's default is 0.2 each, not
    # clip_ratio; None (verl's YAML null) means clip_ratio, as every verl policy loss reads it.
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0  # dual-clip c (> 1), negative advantages only
    tau_pos: float = 1.0  # sapo: the gate's temperature for positive advantages
    tau_neg: float = 1.05  # sapo: ... for negative advantages
    loss_agg_mode: str = "token-mean"  # loss.AGG_MODES
    loss_scale_factor: float | None = None  # Dr.GRPO constant of seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # entropy bonus weight
    calculate_entropy: bool = False  # also compute the update pass's entropy (actor/entropy_loss)
    use_kl_loss: bool = False  # add beta * KL(policy || ref) to the loss (GRPO paper)
    kl_loss_coef: float = 0.001  # beta
    kl_loss_type: str = "low_var_kl"  # kl | abs | mse | low_var_kl, "+" variants
    grad_clip: float = 1.0  # global grad-norm clip; a non-finite norm skips the update
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    optim: OptimConfig = OptimConfig()
    router_replay: RouterReplayConfig = RouterReplayConfig()  # MoE models

    def __post_init__(self):
        c = _Checks("actor")
        _positive(c, self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs")
        _positive(c, self, "ppo_max_token_len_per_gpu", "ulysses_sequence_parallel_size")
        c.need(self.grad_clip > 0, "grad_clip", self.grad_clip, "must be > 0")
        c.need(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        c.need(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "loss_scale_factor",
            self.loss_scale_factor,
            "must be > 0 or None",
        )
        c.need(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "must be > 0")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            c.need(value is None or value > 0, name, value, "must be > 0 or None (clip_ratio)")

        kwargs = self._loss_kwargs()
        try:
            loss.check_policy_loss_mode("loss_mode", kwargs["policy_loss_mode"])
        except ValueError:
            kwargs["policy_loss_mode"] = "vanilla"  # section actor.policy_loss reported it
        c.call(actor_lib.check_loss_settings, **kwargs)
        c.done()

    def _loss_kwargs(self) -> dict:
        return dict(
            policy_loss_mode=self.policy_loss.loss_mode,
            loss_agg_mode=self.loss_agg_mode,
            clip_ratio_c=self.clip_ratio_c,
            kl_loss_type=self.kl_loss_type,
        )

    def _loss_config(self, *, temperature: float):
        """The actor section's part of the update's LossConfig (RunConfig.loss_config completes
        it)."""

        pl = self.policy_loss
        extra = {"clip_cov_ratio": pl.clip_cov_ratio, "clip_cov_lb": pl.clip_cov_lb,
                 "clip_cov_ub": pl.clip_cov_ub, "kl_cov_ratio": pl.kl_cov_ratio,
                 "ppo_kl_coef": pl.ppo_kl_coef, "tau_pos": self.tau_pos, "tau_neg": self.tau_neg,
                 "dro_beta": pl.dro_beta}
        return actor_lib.LossConfig(
            **self._loss_kwargs(),
            policy_loss_kwargs=tuple(sorted(extra.items())),
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            entropy_coeff=self.entropy_coeff,
            calculate_entropy=self.calculate_entropy,
            use_kl_loss=self.use_kl_loss,
            kl_loss_coef=self.kl_loss_coef,
            loss_scale_factor=self.loss_scale_factor,
            temperature=temperature,
        )


# ---------------------------------------------------------------------------------------------
# rollout


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

        c = _Checks("rollout.val_kwargs")
        _positive(c, self, "n")
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

        c = _Checks("rollout.multi_turn")
        for name in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, name)
            c.need(value is None or value >= 1, name, value, "must be >= 1 or None (no limit)")
        _positive(c, self, "max_parallel_calls", "max_tool_response_length")
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
    # verl's switch for the rollout to record each token's MoE experts (Rollout.routed_experts),
    # required by actor.router_replay.mode="R3" and refused with any other mode.
    enable_rollout_routing_replay: bool = False
    val_kwargs: ValKwargs = ValKwargs()
    vllm: VLLMSettings = VLLMSettings()
    multi_turn: MultiTurnConfig = MultiTurnConfig()

    def __post_init__(self):

        c = _Checks("rollout")
        c.choice("name", self.name, ("jax", "vllm"))
        c.choice("logprobs_mode", self.logprobs_mode, sampler.LOGPROBS_MODES)
        _positive(c, self, "n", "log_prob_micro_batch_size_per_gpu", "max_num_seqs",
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


# ---------------------------------------------------------------------------------------------
# algorithm, reward, warm-up, trainer, checkpoint, mesh


@dataclasses.dataclass(frozen=True)
class KLCtrlConfig:
    """Section `algorithm.kl_ctrl`: the coefficient of the in-reward KL penalty.

    "fixed" keeps kl_coef; "adaptive" is verl's AdaptiveKLController (Ziegler et al. 2019):
    after each step beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * B / horizon, B the
    step's sequences. Its value is checkpointed, so a resumed run continues it exactly.
    """

    type: str = "fixed"  # "fixed" | "adaptive"
    kl_coef: float = 0.001  # beta of the in-reward KL (the adaptive controller's start)
    horizon: int = 10000  # adaptive: sequences over which beta can move by ~20 %
    target_kl: float = 0.1  # adaptive: the KL it steers towards

    def __post_init__(self):
        c = _Checks("algorithm.kl_ctrl")
        c.choice("type", self.type, ("fixed", "adaptive"))
        c.need(self.kl_coef >= 0, "kl_coef", self.kl_coef, "must be >= 0")
        c.need(self.horizon >= 1, "horizon", self.horizon, "must be >= 1")
        c.need(self.target_kl > 0, "target_kl", self.target_kl, "must be > 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig:
    """Section `algorithm.filter_groups`: DAPO's dynamic sampling (arXiv 2503.14476), as verl
    0.9.1's Sync DAPO replay buffer (verl/trainer/ppo/v1/replay_buffer.py: ReplayBuffer.sample).

    A group is filtered when its `metric` has the same value on all its samples, verl's
    `len(values) > 1 and np.std(values) == 0.0` (so a one-sample group never is). Each
    filtered group earns two more prompts; they are sampled, at most max_inflight_gen_batches
    x data.train_batch_size at a time, until data.train_batch_size groups are kept; the surplus
    of the last round is dropped. rollout_stage.dynamic_sample says how that follows verl.
    """

    enable: bool = False
    # "reward": the sequence reward, overlong penalty included (verl's rm_scores summed, in
    # float32); any other name: that key of verl's reward_extra_info, i.e. a key of the
    # scorer's dict ("score", "acc", ...), "acc" for a scorer returning a plain number (its
    # score before the overlong penalty), "overlong_reward" / "overlong" with
    # reward.overlong_buffer.log (rewards/functions.py: reward_extra_info).
    metric: str = "reward"
    max_num_gen_batches: int = 0  # ignored, with a warning, as verl 0.9.1 does
    # Prompts sampled at once for the refills, in units of data.train_batch_size (verl's bound
    # on the Sync DAPO prompts pending or running)
    max_inflight_gen_batches: int = 1

    def __post_init__(self):
        c = _Checks("algorithm.filter_groups")
        c.need(not self.enable or bool(self.metric), "metric", self.metric,
               "must be set when group filtering is enabled")
        c.need(not self.enable or self.max_inflight_gen_batches >= 1,
               "max_inflight_gen_batches", self.max_inflight_gen_batches,
               "must be a positive integer")
        c.done()


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Section `algorithm.rollout_correction` (verl 0.9.1; grpo_jax/rollout_correction.py).

    Compares the rollout engine's log-probs with the trainer's recomputed old log-probs:
    importance weights (`rollout_is` token or sequence, truncated at `rollout_is_threshold`)
    multiply the policy loss, rejection (`rollout_rs` with `rollout_rs_threshold`) masks tokens
    or sequences. `bypass_mode` (verl 0.9.1's v1 trainer) skips the old-log-prob pass and
    the correction, takes the engine's log-probs as the old ones and keeps
    actor.policy_loss.loss_mode; loss_mode="bypass_mode" selects verl's bypass loss instead,
    which computes weights / rejection against the current policy inside the loss and reads
    `loss_type`. The `rollout_corr/*` and `training/rollout_probs_diff_*` metrics are logged
    whenever the old log-probs are recomputed (verl: by default, rollout.calculate_log_probs).
    """

    rollout_is: str | None = None  # None | "token" | "sequence"
    rollout_is_threshold: float | None = 2.0  # TIS upper bound (the library takes "lo_hi" too)
    rollout_is_batch_normalize: bool = False  # weights to batch mean 1
    rollout_rs: str | None = None  # rejection options, comma-separated (rollout_correction.py)
    # required with rollout_rs: one value or one per option; k1 options take "lower_upper"
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False  # old log-probs = the engine's (no recomputation)
    loss_type: str = "ppo_clip"  # the bypass_mode loss's: "ppo_clip" | "reinforce"

    def __post_init__(self):

        c = _Checks("algorithm.rollout_correction")
        if self.rollout_is is not None:
            c.choice("rollout_is", self.rollout_is, rc.ROLLOUT_IS_LEVELS)
        c.choice("loss_type", self.loss_type, rc.LOSS_TYPES)
        if self.rollout_is_threshold is not None:
            c.call(rc.parse_rollout_is_threshold, self.rollout_is_threshold)
        if self.rollout_rs is not None:
            options = c.call(rc.parse_rollout_rs, self.rollout_rs)
            c.need(self.rollout_rs_threshold is not None, "rollout_rs_threshold",
                   self.rollout_rs_threshold, "is required with rollout_rs")
            if options and self.rollout_rs_threshold is not None:
                c.call(rc.parse_rollout_rs_thresholds, options, self.rollout_rs_threshold)
        c.done()

    @property
    def active(self) -> bool:
        """Whether anything changes the loss (weights, rejection or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Section `algorithm`: the advantage estimator, the KL-in-reward penalty, DAPO's dynamic
    sampling and rollout correction."""

    # advantage.ADV_ESTIMATORS, a name given to advantage.register_adv_est, or "module:function"
    # (imported and registered under that name).
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide by the group std (False = Dr.GRPO)
    gamma: float = 1.0  # reinforce_plus_plus's discount
    # gdpo: the reward components, keys of the scorer's dict outputs (comma-separated); "" =
    # one component per function of reward.fn (with reward.weights), or the score alone.
    gdpo_reward_keys: str = ""
    gdpo_reward_weights: str = ""  # gdpo: comma-separated weights of those keys; "" = ones
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(old || ref) from the reward
    kl_penalty: str = "kl"  # estimator of the in-reward KL (actor.kl_loss_type names)
    kl_ctrl: KLCtrlConfig = KLCtrlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()

    def __post_init__(self):

        c = _Checks("algorithm")
        c.call(advantage.check_adv_estimator, "adv_estimator", self.adv_estimator)
        c.call(
            loss.check_choice,
            "kl_penalty",
            self.kl_penalty,
            [k for k in loss.KL_TYPES if "full" not in k],
        )
        try:
            weights = self.gdpo_weight_values
        except ValueError:
            c.need(False, "gdpo_reward_weights", self.gdpo_reward_weights,
                   "must be comma-separated floats")
        else:
            keys = registry.split_list(self.gdpo_reward_keys)
            c.need(not weights or len(weights) == len(keys), "gdpo_reward_weights",
                   self.gdpo_reward_weights,
                   f"has {len(weights)} weights for {len(keys)} gdpo_reward_keys")
        c.done()

    @property
    def gdpo_weight_values(self) -> tuple[float, ...]:
        return tuple(float(w) for w in registry.split_list(self.gdpo_reward_weights))

    @property
    def uses_groups(self) -> bool:
        """Whether the estimator's baseline comes from the other samples of a group."""
        return self.adv_estimator not in ("reinforce_plus_plus", "remax")




@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """Section `reward.overlong_buffer`: DAPO's soft penalty on overlong responses.

    verl's DAPO reward manager (reward_kwargs.overlong_buffer_cfg): a response longer than
    data.max_response_length - len gets penalty_factor x (its excess / len), capped at
    penalty_factor, subtracted from its score.
    """

    enable: bool = False
    len: int = 512  # tokens before max_response_length where the penalty starts
    penalty_factor: float = 1.0  # the penalty at max_response_length
    log: bool = False  # log reward_extra/overlong_reward and reward_extra/overlong

    def __post_init__(self):
        c = _Checks("reward.overlong_buffer")
        c.need(self.len >= 1, "len", self.len, "must be >= 1")
        c.need(self.penalty_factor >= 0, "penalty_factor", self.penalty_factor, "must be >= 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class SandboxFusionConfig:
    """Section `reward.sandbox_fusion` (verl's, same names): run code rewards on SandboxFusion.

    With `url` set, `scorers.default_compute_score` sends the code sources ("codecontests",
    "apps", "codeforces", "taco") to that service (rewards/sandbox_fusion.py) instead of
    grpo_jax's local sandbox (rewards/code.py), as verl does. reward.fn must then include
    default_compute_score (and custom_reward_function.path be unset), or the run refuses to
    start: verl would silently not use the URL. verl's semaphore bounds the requests of all its
    reward workers together; here each of the reward.num_workers processes may have
    max_concurrent / num_workers (rounded up) in flight. An unreachable service stops the run
    with an error naming the URL (verl scores its tests -1).
    """

    url: str | None = None  # the full run_code endpoint, e.g. "http://host:8080/run_code"
    max_concurrent: int = 64  # requests in flight, all reward workers together
    memory_limit_mb: int = 1024  # sent with each request: the run's memory limit

    def __post_init__(self):
        c = _Checks("reward.sandbox_fusion")
        _positive(c, self, "max_concurrent")
        _positive(c, self, "memory_limit_mb")
        if self.url is not None:
            c.need(
                self.url.startswith(("http://", "https://")), "url", self.url,
                "must be an http(s) URL of the run_code endpoint",
            )  # fmt: skip
        c.done()


# The name in reward.fn that stands for the reward model's score (reward_model section).
REWARD_MODEL_SPEC = "reward_model"


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Section `reward`: the reward functions, how they are combined and run
    (grpo_jax/rewards/functions.py).

    A function is named "module:function" and may have any of three signatures, told apart by
    its parameter names: verl's `compute_score(data_source, solution_str, ground_truth,
    extra_info=None) -> float | dict`, TRL's batched `fn(prompts, completions, **columns) ->
    list[float]`, or `fn(solution_str, ground_truth) -> float`.

    `overlap_with_rollout` streams the scoring: with the native engine's continuous batching
    (rollout.max_num_seqs below a shard's rows) each row that finishes is decoded and its calls
    submitted to the reward workers (or, with num_workers=0, to one helper thread) while the
    other rows decode, and the stage then waits only for the calls still running; the rewards
    are the same as scoring the batch after generation. Reward models and judges, multi-turn
    rollouts (a row's reward needs the tool results its agent gathers), several JAX processes
    and the vLLM sidecar score the batch after generation whatever it says; so do TRL-style
    functions (one call for the whole batch).
    """

    fn: str = "grpo_jax.rewards.scorers:default_compute_score"  # comma-separated specs
    weights: str = ""  # comma-separated weights, "" = all 1.0
    on_error: str = "raise"  # "raise" (stop, naming function + sample) | "zero" (score 0, counted)
    num_workers: int = 2  # scorer processes; 0 = score in the trainer (no timeout)
    # per call of a function (one sample, or one batch for TRL-style); a code reward takes up to
    # ~20 s locally (verl's 5 s first pass and 10 s tests, rewards/code.py)
    timeout_s: float = 30.0
    # score each rollout row as soon as it finishes, while the others still decode (verl's agent
    # loop does; verl has no switch for it); False scores the whole batch after generation
    overlap_with_rollout: bool = True
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    sandbox_fusion: SandboxFusionConfig = SandboxFusionConfig()

    def __post_init__(self):
        c = _Checks("reward")
        c.choice("on_error", self.on_error, reward_fns.ON_ERROR_MODES)
        c.need(bool(self.specs), "fn", self.fn, "is empty: give at least one 'module:function'")
        c.need(self.num_workers >= 0, "num_workers", self.num_workers, "must be >= 0")
        c.need(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        try:
            weights = self.weight_values
        except ValueError:
            c.need(False, "weights", self.weights, "must be comma-separated floats")
        else:
            c.need(
                len(weights) == len(self.specs),
                "weights",
                self.weights,
                f"has {len(weights)} weights for {len(self.specs)} functions in reward.fn",
            )
        c.done()

    @property
    def specs(self) -> tuple[str, ...]:
        return registry.split_list(self.fn)

    @property
    def weight_values(self) -> tuple[float, ...]:
        given = registry.split_list(self.weights)
        return tuple(float(w) for w in given) if given else (1.0,) * len(self.specs)


@dataclasses.dataclass(frozen=True)
class CustomRewardFunction:
    """Section `custom_reward_function` (verl): a scorer in a Python file replaces reward.fn.

    verl semantics: `path` is a .py file, `name` the function in it (default compute_score),
    called as compute_score(data_source, solution_str, ground_truth, extra_info).
    """

    path: str | None = None  # a .py file; None = use reward.fn
    name: str = "compute_score"  # the function in that file


@dataclasses.dataclass(frozen=True)
class RewardModelPath:
    """Section `reward_model.model` (verl's legacy names)."""

    # a local HF checkpoint dir (or hub id): a *ForSequenceClassification model, or with
    # reward_model.genrm.enable a *ForCausalLM judge; its tokenizer and chat template build the
    # reward model's input (verl 0.9.1: reward.reward_model.model_path)
    path: str | None = None


@dataclasses.dataclass(frozen=True)
class RewardModelRollout:
    """Section `reward_model.rollout` (verl's legacy names, its YAML defaults): how a
    generative judge samples its verdict (reward_model.genrm.enable; the native sampler on the
    trainer's mesh). verl's judge sampling is whatever its custom reward function sends with
    each chat request (its reference one: temperature 0.7, top_p 0.8, max_tokens 4096)."""

    temperature: float = 1.0  # of the judge's sampling (do_sample=True)
    top_p: float = 1.0  # nucleus mass, 1 = off
    top_k: int = -1  # -1 = off
    do_sample: bool = True  # False = greedy (temperature, top_p, top_k unused)
    prompt_length: int = 2048  # the longest judge prompt in tokens (a longer one is an error)
    response_length: int = 2048  # the judge's new tokens per verdict

    def __post_init__(self):
        c = _Checks("reward_model.rollout")
        c.call(sampler.check_sampling_settings, temperature=self.temperature, top_p=self.top_p,
               top_k=self.top_k)  # fmt: skip
        _positive(c, self, "prompt_length", "response_length")
        c.done()

    @property
    def effective_temperature(self) -> float:
        """The sampler's temperature: 0 (greedy) unless do_sample."""
        return self.temperature if self.do_sample else 0.0


@dataclasses.dataclass(frozen=True)
class GenRMConfig:
    """Section `reward_model.genrm` (grpo_jax; verl does this in a custom reward function): a
    generative judge's prompt and verdict parsing (grpo_jax/rewards/genrm.py). The defaults
    are verl 0.9.1's reference GenRM function (tests/experimental/reward_loop/reward_fn.py)."""

    enable: bool = False  # reward_model.model.path is a causal LM judge, not a classifier
    # str.format template of the judge's user message, with {solution} and optionally
    # {problem} and {ground_truth}; rendered with the judge's chat template
    prompt_template: str = genrm.DEFAULT_TEMPLATE
    # where {problem} comes from: "extra_info.<key>" (verl's: extra_info["question"]) or
    # "prompt" (the prompt's last user turn)
    problem_key: str = "extra_info.question"
    # "" = verl's reference parse (the integer after the last blank line), or "module:function"
    # taking the judge's text and returning a float, or None when it cannot be parsed
    parser: str = ""
    unparsable_score: float = 0.0  # the score of a verdict that does not parse (verl: 0)

    def __post_init__(self):
        c = _Checks("reward_model.genrm")
        if self.enable:
            c.call(_template_check, self.prompt_template)
            c.need(self.problem_key == "prompt" or (self.problem_key.startswith("extra_info.")
                   and len(self.problem_key) > len("extra_info.")), "problem_key",
                   self.problem_key, "must be 'prompt' or 'extra_info.<key>'")  # fmt: skip
            c.need(not self.parser or ":" in self.parser, "parser", self.parser,
                   "must be '' (verl's parse) or 'module:function'")  # fmt: skip
        c.need(math.isfinite(self.unparsable_score), "unparsable_score", self.unparsable_score,
               "must be finite")  # fmt: skip
        c.done()


def _template_check(template: str) -> None:
    try:
        genrm.template_fields(template)
    except ValueError as e:
        raise ValueError(f"prompt_template {e}") from e


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Section `reward_model`: a discriminative reward model (grpo_jax/rewards/reward_model.py)
    or, with genrm.enable, a generative judge (grpo_jax/rewards/genrm.py).

    verl 0.9.1 semantics (experimental/reward_loop/reward_loop.py): each rollout is re-written as
    the prompt's chat plus the decoded response (EOS removed) in the reward model's own chat
    template, scored by the classifier at its last token (the last label's raw logit), and
    without a custom reward function that score *is* the sequence reward. Here "reward_model"
    may also be listed in reward.fn, with a weight in reward.weights, to add it to rule rewards.
    A judge's score takes the same place. Validation rows are scored the same way (verl's
    _validate runs the reward model too).
    """

    enable: bool = False
    model: RewardModelPath = RewardModelPath()
    # rows per device of one scoring pass or judge generate call (verl <= 0.5's
    # reward_model.micro_batch_size_per_gpu; 0.9.1 batches inside vLLM)
    micro_batch_size_per_gpu: int = 8
    # tokens of a classifier input, longer ones cut on the right (verl <= 0.5's max_length,
    # truncation "right"); None = no limit (rows padded to the batch's longest). A judge's
    # prompt is bounded by rollout.prompt_length instead.
    max_length: int | None = None
    rollout: RewardModelRollout = RewardModelRollout()
    genrm: GenRMConfig = GenRMConfig()

    def __post_init__(self):
        c = _Checks("reward_model")
        if self.enable:
            what = "*ForCausalLM judge" if self.genrm.enable else "*ForSequenceClassification"
            c.need(bool(self.model.path), "model.path", self.model.path,
                   f"must name a {what} checkpoint (enable=True)")  # fmt: skip
        c.need(self.enable or not self.genrm.enable, "genrm.enable", self.genrm.enable,
               "needs reward_model.enable=True")  # fmt: skip
        _positive(c, self, "micro_batch_size_per_gpu")
        c.need(self.max_length is None or self.max_length >= 1, "max_length", self.max_length,
               "must be >= 1 or None")  # fmt: skip
        c.need(self.max_length is None or not self.genrm.enable, "max_length", self.max_length,
               "is for a classifier; a judge's prompt is bounded by "
               "reward_model.rollout.prompt_length")  # fmt: skip
        c.done()


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Section `warmup`: optional supervised steps on the reference answers before GRPO."""

    steps: int = 0  # 0 = none
    batch_size: int = 64  # prompts per SFT step
    lr: float = 1e-3  # constant AdamW lr of the warm-up

    def __post_init__(self):
        c = _Checks("warmup")
        c.need(self.steps >= 0, "steps", self.steps, "must be >= 0")
        _positive(c, self, "batch_size")
        c.need(self.lr > 0, "lr", self.lr, "must be > 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Section `trainer`: run length, validation and checkpoint cadence, the workdir."""

    default_local_dir: str = "runs/grpo"  # workdir: metrics, checkpoints, plot, HF export
    total_epochs: int = 30  # passes over the train set
    # None = epochs x steps per epoch; a larger value still ends at the epochs (verl) but stays
    # the lr schedule's horizon (trainer/setup.py total_steps)
    total_training_steps: int | None = None
    save_freq: int = -1  # checkpoint every N steps; -1 = never (see checkpoint.save_last)
    test_freq: int = -1  # validate every N steps and at the last step; -1 = never
    val_before_train: bool = True  # validate before the first step
    # Validate (the restored checkpoint's policy, when the workdir has one) and exit without
    # training, no checkpoint and no HF export (verl; needs val_before_train)
    val_only: bool = False
    # Directories that receive every step's rollouts / every validation's samples as JSONL,
    # one file per step `{step}.jsonl` (verl 0.9.1's v1 trainer: keys input, output, gts,
    # score, step, uid; validation adds reward and the scorer's extra keys); None = no dump.
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    resume_mode: str = "auto"  # "auto" (latest checkpoint in the workdir) | "disable"
    # verl's mini-batch make-up (grpo_jax/trainer/balance.py): each step's rows are split over
    # the data-parallel ranks in equal parts of balanced workload, and mini-batch k takes the
    # k-th slice of every rank's part, so it depends on the mesh. False (grpo_jax's default;
    # verl's YAML says true and its v1 trainer always balances): mini-batches of whole groups in
    # data order, the same on any mesh. On one data-parallel device the two are the same.
    balance_batch: bool = False
    seed: int = 0  # rollout rng seed
    max_consecutive_nonfinite: int = 10  # stop after this many skipped (non-finite) updates
    progress_bar: bool = True  # tqdm bar with ETA
    # validation samples logged per validation (workdir/val_generations.jsonl, the log, and
    # the trackers: a W&B table, MLflow table artifacts)
    log_val_generations: int = 0
    # Experiment tracking (grpo_jax/trainer/trackers.py): where each metrics row goes besides
    # workdir/metrics.jsonl, among "console", "tensorboard", "wandb", "mlflow". verl's default
    # ["console", "wandb"] needs the wandb package and a W&B login; grpo_jax's default keeps the
    # terminal and workdir/tensorboard, nothing to install. The command line takes
    # `console,wandb`, `"['console','wandb']"` or Hydra's `[console,wandb]`.
    logger: tuple[str, ...] = ("console", "tensorboard")
    project_name: str = "verl_examples"  # W&B project / MLflow experiment (verl)
    experiment_name: str = "gsm8k"  # W&B / MLflow run name (verl)
    # Deprecated (grpo_jax's switch before trainer.logger): False turns TensorBoard off whatever
    # trainer.logger says; True leaves it to trainer.logger.
    tensorboard: bool = True
    # Peak TFLOP/s per device for perf/mfu/actor; 0 = grpo_jax.trainer.perf's table of accelerators
    # (bf16 dense), and no MFU on devices it does not list (CPU).
    device_peak_tflops: float = 0.0
    # Asynchronous rollouts (one step off-policy): the next step's batch is sampled, with the
    # params before this step's update, while this step updates (README "Asynchronous
    # rollouts"). max_staleness bounds the steps between the params that sampled a batch and
    # the policy it updates; a batch beyond it is sampled again.
    async_rollout: bool = False
    max_staleness: int = 1
    # JAX's persistent compilation cache, which train.py turns on: programs compiled by one run
    # are read back by the next (keyed by the program, compile options, XLA flags and the
    # jax/jaxlib versions, so a change to any of them compiles afresh). "" = off; the
    # JAX_COMPILATION_CACHE_DIR environment variable, when set, takes precedence.
    compilation_cache_dir: str = "~/.cache/grpo_jax/jax_compilation_cache"

    def __post_init__(self):
        c = _Checks("trainer")
        object.__setattr__(self, "logger", trackers.parse_backends(self.logger))
        for name in self.logger:
            c.need(name in trackers.BACKENDS, "logger", list(self.logger),
                   f"has {name!r}, not one of {list(trackers.BACKENDS)}")
            why = trackers.missing_package(name) if name in trackers.BACKENDS else None
            c.need(why is None, "logger", list(self.logger), f"has {name!r}, which {why}")
        c.need(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        c.need(not self.async_rollout or self.max_staleness >= 1, "max_staleness",
               self.max_staleness, "must be >= 1 with async_rollout=True (its batches are "
               "sampled one step before the update that uses them)")
        c.choice("resume_mode", self.resume_mode, ("auto", "disable"))
        # verl ignores val_only without val_before_train and trains; here that is refused.
        c.need(not self.val_only or self.val_before_train, "val_only", self.val_only,
               "needs trainer.val_before_train=True (val_only validates before training and "
               "exits)")
        c.need(self.device_peak_tflops >= 0, "device_peak_tflops", self.device_peak_tflops,
               "must be >= 0 (0 = look the device up)")
        _positive(c, self, "total_epochs", "max_consecutive_nonfinite")
        c.need(self.log_val_generations >= 0, "log_val_generations", self.log_val_generations,
               "must be >= 0")
        for name in ("save_freq", "test_freq"):
            value = getattr(self, name)
            c.need(value == -1 or value >= 1, name, value, "must be -1 (never) or >= 1")
        c.need(
            self.total_training_steps is None or self.total_training_steps >= 1,
            "total_training_steps",
            self.total_training_steps,
            "must be >= 1 or None",
        )
        c.done()

    @property
    def backends(self) -> tuple[str, ...]:
        """The trackers this run starts: trainer.logger, less TensorBoard when the deprecated
        trainer.tensorboard is False."""
        return tuple(b for b in self.logger if self.tensorboard or b != "tensorboard")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Section `checkpoint` (verl: trainer.max_actor_ckpt_to_keep)."""

    max_to_keep: int = 3  # orbax checkpoints kept
    save_last: bool = True  # also save after the last step (verl saves only per save_freq)
    export_hf: bool = True  # write workdir/hf (safetensors + tokenizer) at the end

    def __post_init__(self):
        c = _Checks("checkpoint")
        _positive(c, self, "max_to_keep")
        c.done()


@dataclasses.dataclass(frozen=True)
class RefConfig:
    """Section `ref` (verl's actor_rollout_ref.ref): the reference policy's log-prob pass."""

    # None = the actor's (verl's ${oc.select:actor_rollout_ref.actor.ulysses_...}). grpo_jax
    # runs every pass on one mesh, so a value must equal the actor's (docs/verl-differences.md).
    ulysses_sequence_parallel_size: int | None = None

    def __post_init__(self):
        c = _Checks("ref")
        sp = self.ulysses_sequence_parallel_size
        c.need(sp is None or sp >= 1, "ulysses_sequence_parallel_size", sp,
               "must be >= 1 or None (the actor's)")  # fmt: skip
        c.done()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Section `mesh`: the device mesh (data, fsdp, tensor), or (data, fsdp, sequence, tensor),
    and its logical-axis rules. With three entries the sequence axis is
    actor.ulysses_sequence_parallel_size devices, and -1 fills what is left."""

    shape: tuple[int, ...] = (-1, 1, 1)  # -1 fills with the remaining devices
    rules: tuple | None = None  # ((logical name, mesh axes), ...); None = LOGICAL_RULES
    distributed: str = "auto"  # jax.distributed start-up: "auto" (detect) | "on" | "off"

    def __post_init__(self):
        c = _Checks("mesh")
        c.need(
            len(self.shape) in (3, 4),
            "shape",
            self.shape,
            "must have 3 entries (data, fsdp, tensor) or 4 (data, fsdp, sequence, tensor)",
        )
        c.choice("distributed", self.distributed, ("auto", "on", "off"))
        c.done()


# ---------------------------------------------------------------------------------------------
# the whole run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every section of a GRPO run; `__post_init__` holds the checks across sections."""

    data: DataConfig = DataConfig()
    model: ModelSpec = ModelSpec()
    actor: ActorConfig = ActorConfig()
    ref: RefConfig = RefConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    custom_reward_function: CustomRewardFunction = CustomRewardFunction()
    reward_model: RewardModelConfig = RewardModelConfig()
    warmup: WarmupConfig = WarmupConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        c = _Checks("")
        a, d, r = self.actor, self.data, self.rollout
        sp = a.ulysses_sequence_parallel_size
        ref_sp = self.ref.ulysses_sequence_parallel_size
        c.need(ref_sp in (None, sp), "ref.ulysses_sequence_parallel_size", ref_sp,
               f"must equal actor.ulysses_sequence_parallel_size={sp} or be None (grpo_jax runs "
               "the reference pass on the actor's mesh)")  # fmt: skip
        if len(self.mesh.shape) == 4:
            c.need(self.mesh.shape[2] in (-1, sp), "mesh.shape", self.mesh.shape,
                   f"its sequence entry (the third of data, fsdp, sequence, tensor) must be "
                   f"actor.ulysses_sequence_parallel_size={sp} or -1")  # fmt: skip
        if sp > 1 and not (a.use_dynamic_bsz and self.log_prob_use_dynamic_bsz):
            # Padded micro-batches are rows of prompt_length_bucket multiples + the responses.
            for name in ("prompt_length_bucket", "max_response_length"):
                c.need(getattr(d, name) % sp == 0, f"data.{name}", getattr(d, name),
                       f"must be a multiple of actor.ulysses_sequence_parallel_size={sp} (each "
                       "padded row's tokens split evenly; or pack: actor.use_dynamic_bsz=True)")
        rm, in_fn = self.reward_model, REWARD_MODEL_SPEC in self.reward.specs
        c.need(rm.enable or not in_fn, "reward.fn", self.reward.fn,
               f"lists {REWARD_MODEL_SPEC!r}: it needs reward_model.enable=True")  # fmt: skip
        if rm.enable:
            c.need(not self.custom_reward_function.path, "custom_reward_function.path",
                   self.custom_reward_function.path,
                   "with reward_model.enable: a custom function cannot query the reward model "
                   "here (verl's can, over HTTP); list 'reward_model' in reward.fn instead")
            c.need(self.algorithm.adv_estimator not in ("gdpo", "remax"),
                   "algorithm.adv_estimator", self.algorithm.adv_estimator,
                   "does not take reward_model.enable yet (its extra reward passes score rule "
                   "rewards only)")  # fmt: skip
        ob = self.reward.overlong_buffer
        if ob.enable:
            c.need(ob.len <= d.max_response_length, "reward.overlong_buffer.len", ob.len,
                   f"must be <= data.max_response_length={d.max_response_length}")
        if self.algorithm.uses_groups:
            c.need(
                r.n >= 2,
                "rollout.n",
                r.n,
                f"must be >= 2 for {self.algorithm.adv_estimator} "
                "(group baselines need at least two samples per prompt)",
            )
        if a.ppo_mini_batch_size >= 1:  # else its own section reported it
            c.need(
                d.train_batch_size % a.ppo_mini_batch_size == 0,
                "actor.ppo_mini_batch_size",
                a.ppo_mini_batch_size,
                f"must divide data.train_batch_size={d.train_batch_size}",
            )
        c.need(
            not d.gen_batch_size
            or self.algorithm.filter_groups.enable
            or d.train_batch_size % d.gen_batch_size == 0,
            "data.gen_batch_size",
            d.gen_batch_size,
            f"must divide data.train_batch_size={d.train_batch_size} (a step's prompts are read "
            "gen_batch_size at a time)",
        )
        c.need(
            r.vllm.lora_sync != "adapter" or self.model.lora_rank > 0,
            "rollout.vllm.lora_sync",
            r.vllm.lora_sync,
            "pushes LoRA adapters: it needs model.lora_rank > 0 (use 'merged')",
        )
        c.need(
            r.num_devices == 0 or self.trainer.async_rollout,
            "rollout.num_devices",
            r.num_devices,
            "gives the sampler devices of its own, which only pays with trainer.async_rollout="
            "True (else they would idle while the trainer updates)",
        )
        for name in ("train_batch_size", "val_batch_size"):
            size = getattr(d, name)
            c.need(not r.num_devices or size % r.num_devices == 0, "rollout.num_devices",
                   r.num_devices, f"must divide data.{name}={size} (the sampler's prompts split "
                   "over its devices)")
        rc = self.algorithm.rollout_correction
        c.need(
            a.policy_loss.loss_mode != "bypass_mode" or rc.bypass_mode,
            "actor.policy_loss.loss_mode",
            a.policy_loss.loss_mode,
            "needs algorithm.rollout_correction.bypass_mode=True (the loss takes the rollout "
            "engine's log-probs as the old ones)",
        )
        # verl would pass the logits on as rollout log-probs; here that is refused.
        c.need(
            not (r.logprobs_mode.endswith("_logits") and rc.active),
            "rollout.logprobs_mode",
            r.logprobs_mode,
            "makes the engine report logits, not log-probs: algorithm.rollout_correction "
            "(rollout_is, rollout_rs, bypass_mode) needs a *_logprobs mode",
        )
        self._check_router_replay(c)
        c.problems = [p.removeprefix(".") for p in c.problems]
        c.done()

    def _check_router_replay(self, c: _Checks) -> None:
        """actor.router_replay.mode against the other sections (verl 0.9.1's rules, and what the
        engines here can record)."""
        mode, r = self.actor.router_replay.mode, self.rollout
        record = r.enable_rollout_routing_replay
        c.need(record == (mode == "R3"), "rollout.enable_rollout_routing_replay", record,
               "records the rollout's experts for actor.router_replay.mode='R3' and only for it "
               f"(mode is {mode!r}; verl refuses R2 with it): set both or neither")  # fmt: skip
        if mode == "R3":
            c.need(r.name == "jax", "rollout.name", r.name,
                   "cannot record the experts with actor.router_replay.mode='R3': the vLLM "
                   "sidecar samples through /v1/completions, which returns no expert ids (vLLM "
                   "0.32's --enable-return-routed-experts answers on its token-in-token-out "
                   "/inference/v1/generate only, which the sidecar does not use); use "
                   "rollout.name=jax, or mode='R2' (recorded in the old-log-prob pass)")
        if mode == "R2":
            bypass = self.algorithm.rollout_correction.bypass_mode
            c.need(not bypass, "algorithm.rollout_correction.bypass_mode", bypass,
                   "skips the old-log-prob pass, where actor.router_replay.mode='R2' records "
                   "the routing (verl refuses it too): use mode='R3' or bypass_mode=False")
            c.need(not (self.needs_old_log_probs and self.log_prob_use_dynamic_bsz),
                   "rollout.log_prob_use_dynamic_bsz", self.rollout.log_prob_use_dynamic_bsz,
                   "packs the old-log-prob pass, which records actor.router_replay.mode='R2' "
                   "routing on padded micro-batches only: set "
                   "rollout.log_prob_use_dynamic_bsz=False (the update may still pack) or use "
                   "mode='R3'")  # fmt: skip

    def check_model_for_router_replay(self, num_moe_layers: int) -> None:
        """actor.router_replay needs a mixture-of-experts model (checked once it is loaded)."""
        mode = self.actor.router_replay.mode
        if mode != "disabled" and num_moe_layers == 0:
            raise ConfigError([
                f"actor.router_replay.mode={mode!r} replays the experts of a mixture-of-experts "
                "model, and this model is dense (no MoE layers): set "
                "actor.router_replay.mode=disabled"
            ])

    def loss_config(self):
        """The update's static `trainer.LossConfig`: actor.* plus what other sections add (the
        rollout temperature; the rollout-correction settings for the bypass_mode loss)."""
        lc = self.actor._loss_config(temperature=self.rollout.temperature)
        if self.actor.policy_loss.loss_mode == "bypass_mode":
            rc = self.algorithm.rollout_correction
            settings = tuple(
                (k, getattr(rc, k))
                for k in ("loss_type", "rollout_is", "rollout_is_threshold",
                          "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")
            )
            lc = dataclasses.replace(
                lc, policy_loss_kwargs=lc.policy_loss_kwargs + (("rollout_correction", settings),)
            )
        # Without an old-log-prob pass (on-policy) the update's forward is where verl's
        # actor/entropy (the pre-update policy's) comes from.
        return dataclasses.replace(
            lc, calculate_entropy=self.actor.calculate_entropy or not self.needs_old_log_probs
        )

    @property
    def needs_reference(self) -> bool:
        """A KL term (in the loss or in the reward) needs the frozen reference policy."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def on_policy(self) -> bool:
        """One optimizer step per batch: the old policy is the current one (ratio 1).

        Then the update takes old = stop_gradient(current log-probs), as verl's legacy actor
        does, instead of a separate old-log-prob pass; the KL-in-reward still needs the pass.
        """
        return self.data.train_batch_size == self.actor.ppo_mini_batch_size and (
            self.actor.ppo_epochs == 1
        )

    @property
    def needs_old_log_probs(self) -> bool:
        """Whether a step runs the old-log-prob pass before the update.

        Off-policy updates, the KL in the reward and rollout correction need it; bypass_mode
        takes the engine's log-probs as the old ones instead (for the KL in the reward too).
        """
        rc = self.algorithm.rollout_correction
        if rc.bypass_mode:
            return False
        return not self.on_policy or self.algorithm.use_kl_in_reward or rc.active

    @property
    def log_prob_use_dynamic_bsz(self) -> bool:
        """Whether the old / reference log-prob passes pack token-budget micro-batches:
        rollout.log_prob_use_dynamic_bsz, or when None the actor's use_dynamic_bsz (verl)."""
        own = self.rollout.log_prob_use_dynamic_bsz
        return self.actor.use_dynamic_bsz if own is None else own

    @property
    def log_prob_max_token_len_per_gpu(self) -> int:
        """Those passes' token budget per device: rollout.log_prob_max_token_len_per_gpu, or
        when None the actor's ppo_max_token_len_per_gpu (verl)."""
        own = self.rollout.log_prob_max_token_len_per_gpu
        return self.actor.ppo_max_token_len_per_gpu if own is None else own

    @property
    def read_chunk(self) -> int:
        """Prompts the data order is read in (verl's dataloader batch size): data.gen_batch_size
        (default data.train_batch_size), 1 with DAPO (verl 0.9.1 overrides it), so that each
        refill reads exactly the prompts it needs."""
        if self.algorithm.filter_groups.enable:
            return 1
        return self.data.gen_batch_size or self.data.train_batch_size

    def ignored_settings(self) -> list[str]:
        """The settings verl 0.9.1 accepts and ignores with a warning (logged at the start)."""
        fg, out = self.algorithm.filter_groups, []
        if fg.enable and fg.max_num_gen_batches > 0:
            out.append(
                f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} is ignored "
                "(as by verl 0.9.1's V1 ReplayBuffer): dynamic sampling has no limit; "
                "max_inflight_gen_batches bounds the prompts sampled at once"
            )
        if fg.enable and self.data.gen_batch_size not in (None, 1):
            out.append(
                f"data.gen_batch_size={self.data.gen_batch_size} is overridden to 1 (as by verl "
                "0.9.1 with algorithm.filter_groups): refills read exactly the prompts they need"
            )
        vk = self.rollout.val_kwargs
        if not vk.do_sample and vk.temperature > 0:
            out.append(
                f"rollout.val_kwargs.do_sample=False is ignored (as by verl 0.9.1, whose rollout "
                f"reads only temperature, top_p and top_k from val_kwargs): validation samples at "
                f"rollout.val_kwargs.temperature={vk.temperature}; set it to 0 for greedy"
            )
        return out

    @property
    def mini_batches_per_step(self) -> int:
        return self.data.train_batch_size // self.actor.ppo_mini_batch_size

    def check_sequence_parallel(self, num_heads: int, tensor: int, row_len: int) -> None:
        """Ulysses splits the query heads over tensor x sequence devices and a packed row's
        `row_len` tokens over the sequence devices: both must divide."""
        sp = self.actor.ulysses_sequence_parallel_size
        if sp == 1:
            return
        problems = []
        if num_heads % (sp * tensor):
            fits = [s for s in range(1, sp) if num_heads % (s * tensor) == 0]
            problems.append(
                f"actor.ulysses_sequence_parallel_size={sp}: the model's {num_heads} attention "
                f"heads cannot be split over {sp} x {tensor} (tensor) devices; "
                f"{max(fits) if fits else 1} would work"
            )
        if row_len % sp:
            problems.append(
                f"actor.ulysses_sequence_parallel_size={sp} does not divide the packed row "
                f"length {row_len} (data.max_prompt_length + data.max_response_length rounded "
                "up to 128): use a power of two up to 128"
            )
        if problems:
            raise ConfigError(problems)

    def check_mesh(self, dp: int, backend: str | None = None) -> None:
        """Batch sizes that must split over the dp = data x fsdp devices of the mesh, and an
        attention implementation that can run on `backend` (default: JAX's) at model.dtype."""
        problems = []
        impl = self.model.attention_impl
        reason = model_attention.unsupported(
            impl, backend=backend or jax.default_backend(), dtype=self.model.dtype
        )
        if reason:
            problems.append(
                f"model.attention_impl={impl!r} cannot run here: {reason}; "
                "model.attention_impl=auto picks one that can"
            )
        n, a, d = self.rollout.n, self.actor, self.data
        mini = a.ppo_mini_batch_size * n
        micro = a.ppo_micro_batch_size_per_gpu * dp
        if mini % micro and micro % mini:
            problems.append(
                f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} x {dp} "
                f"devices = {micro} must divide the mini-batch of ppo_mini_batch_size x rollout.n"
                f" = {mini} sequences"
            )
        # warmup.warm_up runs the update's padded micro-batches (programs.make_programs)
        sft_micro = min(micro, mini, self.warmup.batch_size)
        if self.warmup.steps and self.warmup.batch_size % sft_micro:
            problems.append(
                f"warmup.batch_size={self.warmup.batch_size} must be a multiple of the "
                f"{sft_micro}-row micro-batches of its steps (actor.ppo_micro_batch_size_per_gpu"
                f" x {dp} devices)"
            )
        lp = self.rollout.log_prob_micro_batch_size_per_gpu * dp
        batch = d.train_batch_size * n
        if batch % lp and lp % batch:
            problems.append(
                f"rollout.log_prob_micro_batch_size_per_gpu x {dp} devices = {lp} must divide "
                f"the batch of {batch} sequences"
            )
        for name in ("train_batch_size", "val_batch_size"):
            if getattr(d, name) % dp:
                problems.append(
                    f"data.{name}={getattr(d, name)} must be a multiple of the {dp} data devices"
                )
        if problems:
            raise ConfigError(problems)


# ---------------------------------------------------------------------------------------------
# dicts <-> dataclasses


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def from_dict(cls, values: Mapping[str, Any], *, section: str = ""):
    """Builds dataclass `cls` from nested dicts (e.g. `ConfigDict.to_dict()`).

    Unknown keys are problems; the problems of every section, and those across sections, are
    collected and raised together as one ConfigError. Lists become tuples.
    """
    if _COLLECTOR.get() is None:
        problems: list[str] = []
        token = _COLLECTOR.set(problems)
        try:
            built = from_dict(cls, values, section=section)
        finally:
            _COLLECTOR.reset(token)
        if problems:
            raise ConfigError(problems)
        return built
    problems = []
    kwargs = {}
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            problems.append(f"{section}{key}: unknown field (allowed: {sorted(names)})")
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, tp = values[f.name], hints[f.name]
        if _is_dataclass_type(tp):
            if not isinstance(value, Mapping):
                problems.append(f"{section}{f.name}: expected a section, got {value!r}")
                continue
            kwargs[f.name] = from_dict(tp, value, section=f"{section}{f.name}.")
            continue
        kwargs[f.name] = _to_tuples(value)
    _COLLECTOR.get().extend(problems)
    return cls(**kwargs)


def _to_tuples(value):
    if isinstance(value, (list, tuple)):
        return tuple(_to_tuples(v) for v in value)
    return value


def to_dict(obj) -> dict:
    """The nested-dict form of a config dataclass (tuples kept), e.g. for workdir/config.json."""
    return {
        f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v
        for f in dataclasses.fields(obj)
    }


def accepts_none(path: str, cls=None) -> bool | None:
    """Whether the field at dotted `path` of `cls` (default RunConfig) may be None (verl's
    `null`): its annotation includes None. None when `path` names no field."""
    tp = cls or RunConfig
    for name in path.split("."):
        if not _is_dataclass_type(tp):
            return None
        hints = _field_types(tp)
        if name not in hints:
            return None
        tp = hints[name]
    if _is_dataclass_type(tp):
        return None
    return type(None) in typing.get_args(tp)


def defaults_with_types(cls) -> dict[str, Any]:
    """{field: default or ("placeholder", type)} for `cls` and its sections, recursively.

    configs/common.py builds the ml_collections tree from this; a None default comes with the
    type its annotation allows, so an override is type-checked.
    """
    return _defaults_of(cls())


def _defaults_of(instance) -> dict[str, Any]:
    out = {}
    hints = _field_types(type(instance))
    for f in dataclasses.fields(instance):
        value, tp = getattr(instance, f.name), hints[f.name]
        if _is_dataclass_type(tp):
            out[f.name] = _defaults_of(value)
        elif value is None:
            out[f.name] = ("placeholder", _first_concrete_type(tp))
        else:
            out[f.name] = value
    return out


def _first_concrete_type(tp):
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) else ()
    for arg in args or (tp,):
        origin = typing.get_origin(arg) or arg
        if origin is not type(None):
            return origin
    raise TypeError(f"no concrete type in {tp}")
