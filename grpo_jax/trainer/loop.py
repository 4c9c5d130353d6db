"""The GRPO training loop as a library function: `train(run, model, tokenizer, data, reward)`.

`train` owns what happens around each step (the step itself: rollout_stage.py and train_stage.py):

  setup     mesh and rules, prompts capped (data.train_max_samples / val_max_samples) and
            tokenised (data.apply_chat_template_kwargs), params placed in their shardings,
            AdamW state, the frozen reference (when a KL term needs it), the jitted programs,
            the rollout engine, the reward worker pool;
  LoRA      (model.lora_rank > 0, grpo_jax/models/lora.py) the given params are the frozen base;
            fresh adapters are what the state trains (and all the optimizer holds), the
            reference is the base itself with the adapters off (no copy), and checkpoints hold
            the adapters, the optimizer state and a pointer to the base (model.path, rank,
            alpha, targets), checked on resume;
  resume    from the newest readable checkpoint in the workdir (exact: params, optimizer state,
            rng, data position, counters, the reference when a warm-up produced it);
  warm-up   optional supervised steps on reference answers, then a fresh optimizer;
  validate  before the first step with trainer.val_before_train (verl: after a resume too,
            logged under the resumed step, in a row of its own);
  loop      per step: the next prompts, `rollout_stage.rollout_stage` (sample and score) and
            `train_stage.train_stage` (log-probs, advantages, update), validation every
            trainer.test_freq steps and at the last step (verl: none with test_freq=-1, and
            none when total_epochs ends the run before trainer.total_training_steps), a
            checkpoint every trainer.save_freq steps (and after the last step with
            checkpoint.save_last), one metrics.jsonl line, the callbacks;
  async     (trainer.async_rollout, grpo_jax/rollout/async_rollout.py) the next step's rollout stage
            runs in a background thread, with the engine's own copy of the weights, while this
            step trains; never across a checkpoint, so resume stays exact;
  outputs   (verl's trainer.rollout_data_dir / validation_data_dir) every step's and every
            validation's samples as <dir>/<step>.jsonl (trainer/dumps.py);
  trackers  (verl's trainer.logger: console, TensorBoard, W&B, MLflow; trainer/trackers.py) each
            metrics row after its metrics.jsonl line, and the logged validation samples; a
            resumed run continues the same tracker runs, a failing tracker is turned off;
  val_only  (trainer.val_only) the validation before training, of the restored policy when
            there is a checkpoint, and no step;
  result    the final state and the metrics history.

Only process 0 writes metrics. With several JAX processes, each tokenises and scores its own
block of every batch (grpo_jax/distributed.py). A non-finite loss or gradient skips that
update; after trainer.max_consecutive_nonfinite consecutive skips the run stops with an error.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import distributed, loading, sharding
from grpo_jax import model as model_lib
from grpo_jax.data import prompts, readers
from grpo_jax.models import lora as lora_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool_lib
from grpo_jax.rollout import async_rollout, engines
from grpo_jax.trainer import (
    actor,
    checkpoint,
    dumps,
    metrics,
    perf,
    programs,
    rollout_stage,
    setup,
    train_stage,
    validation,
    warmup,
)
from grpo_jax.trainer import (
    batch as batch_lib,
)
from grpo_jax.trainer import (
    trackers as trackers_lib,
)

Callback = Callable[[int, dict], None]


@dataclasses.dataclass(frozen=True)
class Result:
    """What `train` returns.

    Attributes:
      state: the final trainer.TrainState (params, optimizer state, update count); with LoRA
        its params are the adapters.
      model_config: the model's config (for export; with LoRA it carries the adapters' rank,
        alpha and targets).
      history: every metrics row written by this call, {"step": ..., ...}.
      workdir: where metrics and checkpoints went.
      base_params: with LoRA, the frozen base params (else None).
    """

    state: actor.TrainState
    model_config: model_lib.ModelConfig
    history: list[dict]
    workdir: str
    base_params: Any = None

    def policy_params(self):
        """The trained policy as full params: with LoRA the base with the adapters merged in."""
        if self.base_params is None:
            return self.state.params
        return lora_lib.merge(
            self.model_config, lora_lib.attach(self.base_params, self.state.params)
        )


def train(
    run: config_lib.RunConfig,
    *,
    model_config: model_lib.ModelConfig,
    params,
    tokenizer,
    train_data: Sequence[prompts.Example | Mapping[str, Any]],
    val_data: Sequence[prompts.Example | Mapping[str, Any]] = (),
    reward_fn: reward_fns.RewardFn | Callable | None = None,
    mesh=None,
    rules=None,
    callbacks: Sequence[Callback] = (),
    tools: Sequence[Any] | None = None,
    donate_params: bool = False,
    trackers: Sequence[trackers_lib.Tracker] = (),
) -> Result:
    """Runs GRPO (see the module docstring) and returns the final state and metrics.

    Args:
      run: every setting (grpo_jax.config); the workdir is run.trainer.default_local_dir.
      model_config, params: the policy (and the reference, copied before the first update);
        with LoRA (run.model.lora_rank > 0) the frozen base, which is also the reference.
      tokenizer: an HF tokenizer (with a chat template for chat-message prompts).
      train_data, val_data: the prompts: data.Examples (grpo_jax.dataset reads files into
        them) or raw rows (dicts in any layout grpo_jax.dataset knows, e.g. {"prompt": chat
        messages or a string, ...other columns}).
      reward_fn: a rewards.RewardFn, a single reward callable (any of rewards' three
        signatures), or None for run.reward / run.custom_reward_function.
      mesh, rules: the device mesh and logical-axis rules; default from run.mesh (train enters
        `sharding.use_mesh(mesh, rules)` itself).
      callbacks: called as fn(step, metrics_row) after every step's row is written.
      tools: with rollout.multi_turn.enable, the tool objects (verl's BaseTool interface:
        grpo_jax/tools/base.py) instead of rollout.multi_turn.tool_config_path's YAML.
      donate_params: the caller will not use `params` again (train.py): without LoRA and without
        a reference (no KL loss, no KL in the reward) the train state takes over their buffers
        instead of copying them, and they are deleted; one copy of the weights fewer for the
        whole run (0.54 GB for SmolLM2-135M in float32). Otherwise no effect.
      trackers: experiment trackers of the caller's own (trackers.Tracker: `name`, `log(step,
        row)`, `log_generations(step, samples)`, `close()`), fed like run.trainer.logger's: a
        tracker that raises is reported once and turned off, and the run goes on.
    """
    if mesh is None:
        mesh, rules = setup.train_mesh(run), sharding.rules_from_config(run.mesh.rules)
    rules = sharding.rules_from_config(None) if rules is None else rules
    with sharding.use_mesh(mesh, rules):
        return _train(run, model_config, params, tokenizer, train_data, val_data, reward_fn, mesh,
                      rules, callbacks, tools, donate_params, trackers)  # fmt: skip


def _train(
    run, model_config, params, tokenizer, train_data, val_data, reward_fn, mesh, rules, callbacks,
    tools=None, donate_params=False, trackers=(),
) -> Result:
    if reward_fn is None:
        reward_fn = loading.reward_fn(run.reward, run.custom_reward_function)
    elif not isinstance(reward_fn, reward_fns.RewardFn):
        reward_fn = reward_fns.RewardFn.of(reward_fn, on_error=run.reward.on_error)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    sp = dict(mesh.shape).get("sequence", 1)
    if sp != run.actor.ulysses_sequence_parallel_size:
        raise config_lib.ConfigError([
            f"actor.ulysses_sequence_parallel_size={run.actor.ulysses_sequence_parallel_size} "
            f"but the mesh {dict(mesh.shape)} has a sequence axis of {sp}: build the mesh with "
            "sharding.make_mesh(..., sequence=actor.ulysses_sequence_parallel_size)"
        ])  # fmt: skip
    run.check_mesh(dp)
    for message in run.ignored_settings():
        logging.warning(message)
    workdir = run.trainer.default_local_dir
    os.makedirs(workdir, exist_ok=True)
    is_main = distributed.is_main_process()

    # DATA, PARAMS, OPTIMIZER
    tool_set = setup.tool_set(run, tools)  # rollout.multi_turn: the tools, or None
    encode = functools.partial(
        prompts.encode,
        tokenizer,
        max_prompt_length=run.data.max_prompt_length,
        filter_overlong_prompts=run.data.filter_overlong_prompts,
        truncation=run.data.truncation,
        share=distributed.share(),
        chat_template_kwargs=setup.chat_template_kwargs(run, tool_set),
    )
    columns = loading.layout(run.data)
    train_set = encode(_examples(train_data, "train_data", columns, run.data, "train"))
    val_set = None
    if val_data:
        val_set = encode(_examples(val_data, "val_data", columns, run.data, "val"))
    steps = setup.total_steps(run, len(train_set))
    # verl's total_training_steps: the schedule's horizon even when the epochs end the run first
    last_step = setup.total_training_steps(run, len(train_set))
    run.check_model_for_router_replay(model_config.num_moe_layers)
    eos_ids, pad_id = loading.special_ids(tokenizer, model_config)
    tx, schedule = setup.make_optimizer(run, last_step)
    layout = setup.state_layout(run, model_config, mesh, rules, tx)
    model_config, state_sh = layout.model_config, layout.state_shardings
    state, params = setup.init_state(run, layout, params, tx, donate=donate_params)
    base = params if model_config.lora_rank else None  # LoRA: the state trains the adapters
    # The frozen reference: the initial params (`state` holds a copy: never donated); with LoRA
    # the base itself, adapters disabled (verl), so no second copy of the weights.
    ref_params = params if run.needs_reference else None
    ref_in_ckpt = run.needs_reference and run.warmup.steps > 0
    del params
    root_key = jax.random.key_data(jax.random.key(run.trainer.seed))
    progs = programs.make_programs(run, model_config, tx, dp=dp)
    run.check_sequence_parallel(model_config.num_heads, mesh.shape["tensor"], progs.row_len)
    logging.info(
        "model %s; %d train / %d val prompts (%d / %d filtered); %d steps",
        model_config,
        len(train_set),
        len(val_set or ()),
        train_set.num_filtered,
        val_set.num_filtered if val_set else 0,
        steps,
    )

    # RESUME
    mngr = checkpoint.manager(
        os.path.join(workdir, "checkpoints"), max_to_keep=run.checkpoint.max_to_keep
    )
    loop = _LoopState(
        state, ref_params, root_key, prompts.Position(), 0, run.algorithm.kl_ctrl.kl_coef,
        base=base, lora_base=setup.lora_pointer(run, model_config),
    )  # fmt: skip
    start_step, first_row = 0, {}
    restored = None
    if run.trainer.resume_mode == "auto":
        restored = checkpoint.restore_latest(
            mngr, loop.abstract(state_sh, layout.trained_shardings, mesh, with_ref=ref_in_ckpt),
            check_meta=loop.check_meta,
        )  # fmt: skip
    # verl validates at the start of fit() whenever trainer.val_before_train, after a resume
    # too, logging under the resumed step: a row of its own, after that step's training row.
    revalidate = run.trainer.val_before_train and val_set is not None
    # Only the main process logs; a resumed run continues its W&B / MLflow runs (trackers.py).
    tracked = None
    if is_main:
        tracked = trackers_lib.start(
            run.trainer.backends, workdir=workdir, project=run.trainer.project_name,
            experiment=run.trainer.experiment_name, resume=restored is not None, extra=trackers,
            params=trackers_lib.flatten(config_lib.to_dict(run)),
        )  # fmt: skip
    writer = metrics.Writer(workdir, trackers=tracked, enabled=is_main)
    if restored is not None:
        start_step, tree, meta = restored
        loop = loop.restored(tree, meta, with_ref=ref_in_ckpt)
        # an earlier resume from this step validated too: that row and its samples are redone
        writer.truncate_after(start_step, drop=lambda r: _is_resume_validation(r, start_step))
        if is_main:  # what a tracker lacks (a kill's losses), or all of it for a new one: the
            # restored step's samples too, before the resume's validation replaces them
            generations = validation.read_generations(workdir)
            writer.catch_up({s: v for s, v in generations.items() if s <= start_step})
            validation.truncate_generations(workdir, start_step - 1 if revalidate else start_step)
        if start_step not in [r["step"] for r in metrics.read(workdir)]:
            writer.write(start_step, meta["metrics"])  # killed between the save and the row
        logging.info(
            "resumed from step %d (data epoch %d, index %d)",
            start_step,
            loop.position.epoch,
            loop.position.index,
        )
    else:
        writer.truncate_after(-1)
        if is_main:
            validation.truncate_generations(workdir, -1)
        if run.warmup.steps:
            loop.state, first_row = warmup.warm_up(
                run,
                loop.state,
                tx,
                train_set,
                tokenizer,
                mesh,
                eos_id=eos_ids[0],
                pad_id=pad_id,
                micro_rows=progs.micro_rows,
                model_config=model_config,
                base_params=base,
            )
            if run.needs_reference:  # the reference is the warmed-up policy (a copy)
                warmed = jax.tree.map(jnp.copy, loop.state.params)  # with LoRA: the adapters
                loop.ref_params = actor.policy_params(base, warmed)

    engine = setup.make_engine(
        run, model_config, mesh, eos_ids=eos_ids, pad_id=pad_id, workdir=workdir,
        rollout_mesh=setup.rollout_mesh(run, mesh), rules=rules,
    )  # fmt: skip
    pool = (
        reward_pool_lib.Pool(run.reward.num_workers, timeout_s=run.reward.timeout_s)
        if run.reward.num_workers
        else None
    )
    agent = setup.make_agent(run, tool_set, tokenizer, eos_ids=eos_ids, pad_id=pad_id, dp=dp)
    rm = loading.reward_model(run, tokenizer, mesh, rules)
    ctx = programs.StepContext(run, progs, engine, tokenizer, reward_fn, mesh, pool, base, agent,
                               rm)  # fmt: skip
    val_sampling = engines.SamplingParams(
        run.rollout.val_kwargs.n,
        run.data.max_response_length,
        run.rollout.val_kwargs.sampling_temperature,
        run.rollout.val_kwargs.top_p,
        run.rollout.val_kwargs.top_k,
    )
    val_width = 0 if val_set is None else prompts.pad_width(
        val_set, run.data.prompt_padding, max_prompt_length=run.data.max_prompt_length
    )  # fmt: skip

    def evaluate(state, step_done: int):
        engine.sync(ctx.policy(state), int(jax.device_get(state.step)))  # after an update: push
        result = validation.run(
            engine,
            ctx.policy(state),
            val_set,
            reward_fn=reward_fn,
            tokenizer=tokenizer,
            sampling=val_sampling,
            batch_size=run.data.val_batch_size,
            pad_id=pad_id,
            prompt_width=val_width,
            seed=run.trainer.seed,
            pool=pool,
            policy_version=int(jax.device_get(state.step)),
            num_generations=run.trainer.log_val_generations,
            overlong_buffer=run.reward.overlong_buffer,
            keep_outputs=bool(run.trainer.validation_data_dir),
            agent=agent,
            reward_model=rm,
        )
        if result.generations and is_main:
            validation.write_generations(workdir, step_done, result.generations)
            writer.log_generations(step_done, result.generations)
        if run.trainer.validation_data_dir and is_main:
            dumps.write_validation(
                run.trainer.validation_data_dir, step_done, tokenizer, val_set,
                outputs=result.outputs, scores=result.result.scores_B,
                extras=result.result.extras, n=val_sampling.n,
            )  # fmt: skip
        return result.metrics

    history = []
    if run.trainer.val_only and val_set is None:
        raise ValueError("trainer.val_only=True validates, but there are no validation prompts")
    try:
        engine.start(ctx.policy(loop.state), int(jax.device_get(loop.state.step)))
        if run.trainer.val_only:  # verl: validate (a restored policy too) and stop
            row = first_row | evaluate(loop.state, start_step)
            writer.write(start_step, row)
            return Result(loop.state, model_config, [{"step": start_step, **row}], workdir, base)
        if revalidate:  # under step 0, or under the resumed step (verl's global_steps)
            first_row |= evaluate(loop.state, start_step)
        if first_row:
            writer.write(start_step, first_row)
            history.append({"step": start_step, **first_row})
        history += _steps(
            run,
            ctx,
            loop,
            train_set,
            schedule,
            start_step,
            steps,
            last_step,
            mngr,
            writer,
            evaluate if val_set is not None else None,
            callbacks,
            is_main,
        )
    finally:
        engine.close()
        if pool is not None:
            pool.close()
        if agent is not None:
            agent.close()
        writer.close()
    return Result(loop.state, model_config, history, workdir, base)


def _is_resume_validation(row: dict, step: int) -> bool:
    """Whether a metrics row is the validation a resume from `step` (> 0) ran before training:
    it sits at that step without the step's training metrics."""
    return step > 0 and row["step"] == step and "training/global_step" not in row


def _examples(rows, name: str, layout, data: config_lib.DataConfig, split: str):
    """The split's Examples, capped by data.train_max_samples / val_max_samples (verl's subset,
    drawn before the overlong filter)."""
    if not all(isinstance(r, prompts.Example) for r in rows):
        rows = readers.parse_rows(rows, source=name, on_malformed=data.on_malformed, layout=layout)
    cap = data.train_max_samples if split == "train" else data.val_max_samples
    keep = prompts.select_samples(len(rows), cap, shuffle=data.shuffle, seed=data.seed)
    if len(keep) < len(rows):
        logging.info("data.%s_max_samples=%d: %d of %d %s prompts", split, cap, len(keep),
                     len(rows), split)  # fmt: skip
    return [rows[i] for i in keep]


@dataclasses.dataclass
class _LoopState:
    """What changes from step to step and goes into a checkpoint.

    With LoRA, `base` is the frozen base (never checkpointed: `lora_base` points at it), the
    state's params are the adapters, and a warmed-up reference is checkpointed as its adapters.
    """

    state: actor.TrainState
    ref_params: Any
    root_key: jax.Array
    position: prompts.Position
    consecutive_bad: int
    kl_coef: float  # the in-reward KL coefficient of the next step (algorithm.kl_ctrl)
    base: Any = None
    lora_base: dict | None = None

    def tree(self, *, with_ref: bool) -> dict:
        tree = {"train": self.state, "rng": self.root_key}
        if not with_ref:
            return tree
        ref = self.ref_params if self.base is None else self.ref_params[lora_lib.ADAPTERS]
        return tree | {"ref": ref}

    def abstract(self, state_sh, ref_sh, mesh, *, with_ref: bool):
        shardings = {"train": state_sh, "rng": sharding.replicated(mesh)}
        if with_ref:
            shardings["ref"] = ref_sh
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(lambda: self.tree(with_ref=with_ref)),
            shardings,
        )

    def check_meta(self, step: int, meta: dict) -> None:
        """Refuses a checkpoint of another LoRA base (or LoRA vs full fine-tuning)."""
        saved = meta.get("lora_base")
        if saved != self.lora_base:

            def what(p):
                return "full fine-tuning (no LoRA)" if p is None else f"LoRA on the base {p}"

            raise ValueError(
                f"the checkpoint of step {step} in the workdir holds {what(saved)}, but this "
                f"run is {what(self.lora_base)}: resume with the same model.path and "
                "model.lora_rank / lora_alpha / target_modules, or use another "
                "trainer.default_local_dir"
            )

    def restored(self, tree, meta, *, with_ref: bool) -> _LoopState:
        ref = self.ref_params
        if with_ref:
            ref = actor.policy_params(self.base, tree["ref"])
        return dataclasses.replace(
            self,
            state=tree["train"],
            ref_params=ref,
            root_key=tree["rng"],
            position=prompts.Position(meta["data_epoch"], meta["data_index"]),
            consecutive_bad=meta["consecutive_nonfinite"],
            kl_coef=meta.get("kl_coef", self.kl_coef),
        )

    def meta(self, step: int, row: dict) -> dict:
        # `row` is the step's metrics row: a kill after the save but before it is written would
        # otherwise lose it for good (the resumed run starts after this step).
        return {
            "step": step,
            "data_epoch": self.position.epoch,
            "data_index": self.position.index,
            "consecutive_nonfinite": self.consecutive_bad,
            "kl_coef": self.kl_coef,
            "metrics": row,
        } | ({"lora_base": self.lora_base} if self.lora_base is not None else {})


class _PromptReader:
    """`next_prompts(count, pad_to=None)` for a rollout: the next `count` prompts of the train
    set's epoch order, read `run.read_chunk` at a time from a data position on, the batch padded
    with the last one to `pad_to` prompts and left-padded to `width` columns at least
    (data.prompt_padding); `position` is where it stopped."""

    def __init__(self, train_set: prompts.PromptSet, position: prompts.Position, run, pad_id,
                 width: int = 0):  # fmt: skip
        self.train_set, self.position, self.run, self.pad_id = train_set, position, run, pad_id
        self.width = width

    def __call__(self, count: int, pad_to: int | None = None) -> prompts.PromptBatch:
        idx, self.position = prompts.read(
            len(self.train_set), self.position, count, chunk=self.run.read_chunk,
            seed=self.run.data.seed, shuffle=self.run.data.shuffle,
        )  # fmt: skip
        size = pad_to or count
        idx = np.concatenate([idx, np.repeat(idx[-1:], size - count)])
        rows = distributed.process_rows(size) if jax.process_count() > 1 else None
        return prompts.make_batch(
            self.train_set, idx, pad_token_id=self.pad_id, rows=rows, width=self.width
        )


def _steps(
    run, ctx, loop, train_set, schedule, start, steps, last_step, mngr, writer, evaluate,
    callbacks, is_main,
) -> list[dict]:
    """Steps start + 1 .. steps; `last_step` is verl's total_training_steps (validated at; past
    `steps` when the epochs end the run first, so that run has no last-step validation)."""
    import tqdm

    bar = tqdm.tqdm(
        total=steps,
        initial=start,
        disable=not (is_main and run.trainer.progress_bar),
        desc="grpo",
        dynamic_ncols=True,
    )
    with_ref = run.needs_reference and run.warmup.steps > 0
    steps_per_epoch = prompts.steps_per_epoch(len(train_set), run.data.train_batch_size)
    history, last_val = [], {}
    t = run.trainer
    width = prompts.pad_width(
        train_set, run.data.prompt_padding, max_prompt_length=run.data.max_prompt_length
    )

    def sample(i: int, position: prompts.Position, policy, version: int, sampled_at: int):
        """Batch i from the data `position` on, sampled by `policy` (policy version `version`)
        in loop step `sampled_at`, and the data position after its prompts. It reads and writes
        nothing of the loop's: a batch sampled ahead (in a background thread) hands its position
        over when it is taken."""
        reader = _PromptReader(train_set, position, run, ctx.engine.pad_id, width)
        rng = jax.random.fold_in(jax.random.wrap_key_data(loop.root_key), i)
        batch = rollout_stage.rollout_stage(
            ctx, policy, reader, rng, policy_version=version, sampled_at=sampled_at
        )
        return batch, reader.position

    def saves_after(done: int) -> bool:
        return (t.save_freq > 0 and done % t.save_freq == 0) or (
            done == steps and run.checkpoint.save_last
        )

    # trainer.async_rollout: the batch of step i + 1 is sampled during step i's update (see
    # grpo_jax/rollout/async_rollout.py), never across a checkpoint.
    ahead = async_rollout.Ahead() if t.async_rollout else None
    elsewhere = ctx.engine.mesh not in (None, ctx.mesh)
    try:
        for i in range(start, steps):
            t_step, compiled = time.perf_counter(), perf.compile_stats()
            done = i + 1
            timing = {}
            version = int(jax.device_get(loop.state.step))
            batch = None
            if ahead is not None and ahead.pending:
                t0 = time.perf_counter()
                batch, loop.position = ahead.take()
                # the trainer's wait: the part of sampling the update did not cover
                timing["timing_s/wait_rollout"] = time.perf_counter() - t0
            synced = ctx.engine.sync(ctx.policy(loop.state), version)
            if synced is not None:  # the params changed in the last update
                timing["timing_s/weight_sync"] = synced
            if batch is None:  # sampled now, by the params being updated
                batch, loop.position = sample(i, loop.position, ctx.policy(loop.state), version, i)
            staleness = async_rollout.check_staleness(batch.sampled_at, i, t.max_staleness)
            if ahead is not None and done < steps and not saves_after(done):
                # Batch i + 1, sampled by the engine's copy of these params during the update.
                ahead.submit(sample, i + 1, loop.position, None, version, i)
            if elsewhere:  # sampled on the sampler's own devices
                batch = batch_lib.on_mesh(batch, ctx.mesh)
            perf.trim_host_memory()  # the rollout's freed buffers, before the update's peak
            loop.state, row = train_stage.train_stage(
                ctx, loop.state, loop.ref_params, batch, schedule(i), kl_coef=loop.kl_coef
            )
            if t.async_rollout:
                row["async/staleness"] = staleness
                row["async/policy_version_lag"] = version - batch.policy_version
            if run.algorithm.use_kl_in_reward:  # the controller moves after the step (verl)
                loop.kl_coef = train_stage.next_kl_coef(
                    run.algorithm.kl_ctrl,
                    loop.kl_coef,
                    row["actor/reward_kl_penalty"],
                    n_steps=run.data.train_batch_size * run.rollout.n,
                )
            bad = loop.consecutive_bad + 1 if row["actor/update_skipped"] else 0
            loop.consecutive_bad = bad
            if bad >= t.max_consecutive_nonfinite:
                raise RuntimeError(
                    f"{bad} consecutive steps had non-finite losses or gradients (limit "
                    f"trainer.max_consecutive_nonfinite={t.max_consecutive_nonfinite}); last grad "
                    f"norm {row['actor/grad_norm']}"
                )
            row["actor/nonfinite_consecutive"] = loop.consecutive_bad
            # verl's v1 trainer: the epoch of the step's index, (global_step - 1) //
            # steps_per_epoch, however many prompts the step read (DAPO reads more)
            row["training/epoch"] = i // steps_per_epoch
            row["training/global_step"] = i + 1
            # verl steps its scheduler after the step's last mini-batch and logs the learning
            # rate it returns then: the next step's (schedule(i) trained this step)
            row["actor/lr"] = float(schedule(i + 1))
            timing["timing_s/step"] = time.perf_counter() - t_step  # verl: validation excluded
            compiled = perf.compile_stats() - compiled
            timing["timing_s/compile"] = compiled.seconds
            tests = t.test_freq > 0 and (done % t.test_freq == 0 or done == last_step)
            if evaluate is not None and tests:
                if ahead is not None:
                    ahead.wait()  # the batch in flight, on the same engine, finishes first
                last_val = perf.timed(timing, "testing", evaluate, loop.state, done)
                row |= last_val
            row |= timing | compiled.metrics()
            if compiled.programs:
                names = collections.Counter(compiled.names)
                logging.info("step %d compiled %d programs (%d from the cache): %s", done,
                             compiled.programs, compiled.cache_hits,
                             ", ".join(f"{k} x{v}" if v > 1 else k for k, v in names.items()))
            row |= perf.throughput(
                row["perf/total_num_tokens"], timing["timing_s/step"], devices=jax.device_count()
            )
            if saves_after(done):
                t0 = time.perf_counter()
                checkpoint.save(mngr, done, loop.tree(with_ref=with_ref), loop.meta(done, row))
                row["timing_s/save_checkpoint"] = time.perf_counter() - t0
            if t.rollout_data_dir and is_main:  # verl: after the step's metrics
                dumps.write_rollouts(t.rollout_data_dir, done, ctx.tokenizer, batch)
            writer.write(done, row)
            history.append({"step": done, **row})
            for callback in callbacks:
                callback(done, row)
            bar.set_postfix(score=f"{row['critic/score/mean']:.3f}")
            bar.update(1)
    finally:
        if ahead is not None:
            ahead.close()
        bar.close()
    return history
