"""`RunConfig`: every section of a run, and the checks across sections and against the mesh."""

from __future__ import annotations

import dataclasses

import jax

from grpo_jax.config.actor import ActorConfig, RefConfig
from grpo_jax.config.algorithm import AlgorithmConfig
from grpo_jax.config.checks import Checks, ConfigError
from grpo_jax.config.data import DataConfig
from grpo_jax.config.model import ModelSpec
from grpo_jax.config.reward import (
    REWARD_MODEL_SPEC,
    CustomRewardFunction,
    RewardConfig,
    RewardModelConfig,
)
from grpo_jax.config.rollout import RolloutConfig
from grpo_jax.config.trainer import CheckpointConfig, MeshConfig, TrainerConfig, WarmupConfig
from grpo_jax.models import attention as model_attention


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
        c = Checks("")
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

    def _check_router_replay(self, c: Checks) -> None:
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
