"""Sections `trainer` (verl's trainer.*: run length, cadence, the workdir), `warmup`,
`checkpoint` and `mesh`."""

from __future__ import annotations

import dataclasses

from grpo_jax.config.checks import Checks, positive
from grpo_jax.trainer import trackers


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Section `warmup`: optional supervised steps on the reference answers before GRPO."""

    steps: int = 0  # 0 = none
    batch_size: int = 64  # prompts per SFT step
    lr: float = 1e-3  # constant AdamW lr of the warm-up

    def __post_init__(self):
        c = Checks("warmup")
        c.need(self.steps >= 0, "steps", self.steps, "must be >= 0")
        positive(c, self, "batch_size")
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
        c = Checks("trainer")
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
        positive(c, self, "total_epochs", "max_consecutive_nonfinite")
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
        c = Checks("checkpoint")
        positive(c, self, "max_to_keep")
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
        c = Checks("mesh")
        c.need(
            len(self.shape) in (3, 4),
            "shape",
            self.shape,
            "must have 3 entries (data, fsdp, tensor) or 4 (data, fsdp, sequence, tensor)",
        )
        c.choice("distributed", self.distributed, ("auto", "on", "off"))
        c.done()
