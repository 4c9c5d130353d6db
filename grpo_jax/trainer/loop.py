"""The GRPO training loop as a library function: `train(run, model, tokenizer, data, reward)`.

`train` owns what happens around each step (grpo_jax/trainer/step.py has the step itself):

  setup     mesh and rules, prompts tokenised, params placed in their shardings, AdamW state,
            the frozen reference (when a KL term needs it), the jitted programs, the rollout
            engine, the reward worker pool;
  LoRA      (model.lora_rank > 0, grpo_jax/models/lora.py) the given params are the frozen base;
            fresh adapters are what the state trains (and all the optimizer holds), the
            reference is the base itself with the adapters off (no copy), and checkpoints hold
            the adapters, the optimizer state and a pointer to the base (model.path, rank,
            alpha, targets), checked on resume;
  resume    from the newest readable checkpoint in the workdir (exact: params, optimizer state,
            rng, data position, counters, the reference when a warm-up produced it);
  warm-up   optional supervised steps on reference answers, then a fresh optimizer;
  loop      per step: the next prompts, `step.rollout_stage` (sample and score) and
            `step.train_stage` (log-probs, advantages, update), validation every
            trainer.test_freq steps and at the last step (verl: none with test_freq=-1), a
            checkpoint every trainer.save_freq steps (and after the last step with
            checkpoint.save_last), one metrics.jsonl line, the callbacks;
  async     (trainer.async_rollout, grpo_jax/rollout/async_rollout.py) the next step's rollout stage
            runs in a background thread, with the engine's own copy of the weights, while this
            step trains; never across a checkpoint, so resume stays exact;
  result    the final state and the metrics history.

Only process 0 writes metrics. With several JAX processes, each tokenises and scores its own
block of every batch (grpo_jax/distributed.py). A non-finite loss or gradient skips that
update; after trainer.max_consecutive_nonfinite consecutive skips the run stops with an error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
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
from grpo_jax.rollout import async_rollout
from grpo_jax.trainer import actor, checkpoint, metrics, perf, step, validation

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
        return lora_lib.merge(self.model_config, lora_lib.attach(self.base_params,
                                                                 self.state.params))


def make_optimizer(run: config_lib.RunConfig, total_steps: int):
    """(tx, schedule): verl's AdamW and its per-step learning rate."""
    o = run.actor.optim
    tx = actor.make_optimizer(
        grad_clip=run.actor.grad_clip, betas=tuple(o.betas), weight_decay=o.weight_decay
    )
    schedule = actor.lr_schedule(
        lr=o.lr,
        warmup_steps=o.warmup_steps(total_steps),
        total_steps=total_steps,
        kind=o.lr_scheduler_type,
        min_lr_ratio=o.min_lr_ratio,
    )
    return tx, schedule


def total_steps(run: config_lib.RunConfig, num_prompts: int) -> int:
    """trainer.total_training_steps, else total_epochs x full batches per epoch."""
    per_epoch = prompts.steps_per_epoch(num_prompts, run.data.train_batch_size)
    return run.trainer.total_training_steps or run.trainer.total_epochs * per_epoch


def make_engine(run, model_config, mesh, *, eos_ids, pad_id, workdir, rollout_mesh=None,
                rules=sharding.LOGICAL_RULES):
    """The configured rollout engine (rollout.name): native sampler or vLLM sidecar.

    The native sampler runs on `rollout_mesh` when given (rollout.num_devices), else on the
    trainer's mesh; with trainer.async_rollout it samples with a copy of the params of its own.
    """
    if run.rollout.name == "jax":
        return step.NativeEngine(model_config, rollout_mesh or mesh, eos_ids=eos_ids,
                                 pad_id=pad_id, own_params=run.trainer.async_rollout,
                                 rules=rules)
    if jax.process_count() > 1:
        raise ValueError(
            f"rollout.name={run.rollout.name!r}: the vLLM sidecar serves one trainer process, and "
            f"this run has {jax.process_count()} JAX processes; use rollout.name=jax (the "
            "native sampler on the global mesh) for multi-process runs"
        )
    from grpo_jax.rollout import vllm_pool, vllm_sidecar

    configs = run.rollout.sidecar_configs()
    if len(configs) == 1:
        sidecar = vllm_sidecar.VLLMSidecar(configs[0], model_config, os.path.join(workdir, "vllm"))
    else:
        sidecar = vllm_pool.VLLMServers(configs, model_config, os.path.join(workdir, "vllm"))
    return step.SidecarEngine(sidecar, eos_ids=eos_ids, pad_id=pad_id)


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
      mesh, rules: the device mesh and logical-axis rules; default from run.mesh. Call inside
        `sharding.use_mesh(mesh, rules)` (train does it when it builds the mesh itself).
      callbacks: called as fn(step, metrics_row) after every step's row is written.
    """
    if mesh is None:
        mesh = train_mesh(run)
        rules = sharding.rules_from_config(run.mesh.rules)
        with sharding.use_mesh(mesh, rules):
            return train(
                run,
                model_config=model_config,
                params=params,
                tokenizer=tokenizer,
                train_data=train_data,
                val_data=val_data,
                reward_fn=reward_fn,
                mesh=mesh,
                rules=rules,
                callbacks=callbacks,
            )
    rules = sharding.rules_from_config(None) if rules is None else rules
    if reward_fn is None:
        reward_fn = loading.reward_fn(run.reward, run.custom_reward_function)
    elif not isinstance(reward_fn, reward_fns.RewardFn):
        reward_fn = reward_fns.RewardFn.of(reward_fn, on_error=run.reward.on_error)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    run.check_mesh(dp)
    workdir = run.trainer.default_local_dir
    os.makedirs(workdir, exist_ok=True)
    is_main = distributed.is_main_process()

    # DATA, PARAMS, OPTIMIZER
    encode = functools.partial(
        prompts.encode,
        tokenizer,
        max_prompt_length=run.data.max_prompt_length,
        filter_overlong_prompts=run.data.filter_overlong_prompts,
        truncation=run.data.truncation,
        share=distributed.share(),
    )
    layout = loading.layout(run.data)
    train_set = encode(_examples(train_data, "train_data", layout, run.data.on_malformed))
    val_set = (
        encode(_examples(val_data, "val_data", layout, run.data.on_malformed)) if val_data else None
    )
    steps = total_steps(run, len(train_set))
    eos_ids, pad_id = loading.special_ids(tokenizer, model_config)
    tx, schedule = make_optimizer(run, steps)
    if run.model.lora_rank or model_config.lora_rank:
        model_config = lora_lib.configure(
            model_config, rank=run.model.lora_rank, alpha=run.model.lora_alpha,
            target_modules=run.model.target_modules,
        )  # fmt: skip
    param_sh = sharding.param_shardings(model_config, mesh, rules)
    params = jax.device_put(params, param_sh)
    if model_config.lora_rank:  # the params are the frozen base; the state trains adapters
        base = params
        train_sh = sharding.adapter_shardings(model_config, mesh, rules)
        init_key = jax.random.fold_in(jax.random.key(run.trainer.seed), _LORA_INIT_STREAM)
        trainable = lora_lib.init_adapters(model_config, init_key, shardings=train_sh)
        abstract_trainable = model_lib.abstract_adapters(model_config)
    else:
        base, train_sh, trainable = None, param_sh, params
        abstract_trainable = model_lib.abstract_params(model_config)
    state_sh = actor.TrainState(
        sharding.replicated(mesh),
        train_sh,
        sharding.tx_state_shardings(tx, abstract_trainable, train_sh, mesh),
    )
    state = jax.jit(functools.partial(actor.init_state, tx=tx), out_shardings=state_sh)(
        trainable
    )
    # The frozen reference: the initial params (`state` holds a copy: never donated); with LoRA
    # the base itself, adapters disabled (verl), so no second copy of the weights.
    ref_params = params if run.needs_reference else None
    ref_in_ckpt = run.needs_reference and run.warmup.steps > 0
    del params, trainable
    root_key = jax.random.key_data(jax.random.key(run.trainer.seed))
    programs = step.make_programs(run, model_config, tx, dp=dp)
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
    writer = metrics.Writer(workdir, tensorboard=run.trainer.tensorboard, enabled=is_main)
    loop = _LoopState(
        state, ref_params, root_key, prompts.Position(), 0, run.algorithm.kl_ctrl.kl_coef,
        base=base, lora_base=lora_pointer(run, model_config),
    )  # fmt: skip
    start_step, first_row = 0, {}
    restored = None
    if run.trainer.resume_mode == "auto":
        restored = checkpoint.restore_latest(
            mngr, loop.abstract(state_sh, train_sh, mesh, with_ref=ref_in_ckpt),
            check_meta=loop.check_meta,
        )  # fmt: skip
    if restored is not None:
        start_step, tree, meta = restored
        loop = loop.restored(tree, meta, with_ref=ref_in_ckpt)
        writer.truncate_after(start_step)
        if is_main:
            truncate_generations(workdir, start_step)
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
            truncate_generations(workdir, -1)
        if run.warmup.steps:
            loop.state, first_row = warm_up(
                run,
                loop.state,
                tx,
                train_set,
                tokenizer,
                mesh,
                eos_id=eos_ids[0],
                pad_id=pad_id,
                micro_rows=programs.micro_rows,
                model_config=model_config,
                base_params=base,
            )
            if run.needs_reference:  # the reference is the warmed-up policy (a copy)
                warmed = jax.tree.map(jnp.copy, loop.state.params)  # with LoRA: the adapters
                loop.ref_params = actor.policy_params(base, warmed)

    engine = make_engine(run, model_config, mesh, eos_ids=eos_ids, pad_id=pad_id, workdir=workdir,
                         rollout_mesh=rollout_mesh(run, mesh), rules=rules)
    pool = (
        reward_pool_lib.Pool(run.reward.num_workers, timeout_s=run.reward.timeout_s)
        if run.reward.num_workers
        else None
    )
    ctx = step.StepContext(run, programs, engine, tokenizer, reward_fn, mesh, pool, base)
    val_sampling = step.SamplingParams(
        run.rollout.val_kwargs.n,
        run.data.max_response_length,
        run.rollout.val_kwargs.sampling_temperature,
        run.rollout.val_kwargs.top_p,
        run.rollout.val_kwargs.top_k,
    )

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
            seed=run.trainer.seed,
            pool=pool,
            policy_version=int(jax.device_get(state.step)),
            num_generations=run.trainer.log_val_generations,
        )
        if result.generations and is_main:
            write_generations(workdir, step_done, result.generations)
        return result.metrics

    history = []
    try:
        engine.start(ctx.policy(loop.state), int(jax.device_get(loop.state.step)))
        if start_step == 0 and run.trainer.val_before_train and val_set is not None:
            first_row |= evaluate(loop.state, 0)
        if first_row:
            writer.write(0, first_row)
            history.append({"step": 0, **first_row})
        history += _steps(
            run,
            ctx,
            loop,
            train_set,
            schedule,
            start_step,
            steps,
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
        writer.close()
    return Result(loop.state, model_config, history, workdir, base)


def train_mesh(run: config_lib.RunConfig):
    """The trainer's mesh (run.mesh.shape) over every device but the sampler's own (the last
    rollout.num_devices, see rollout_mesh)."""
    devices = jax.devices()
    if run.rollout.num_devices:
        devices = devices[: max(0, len(devices) - run.rollout.num_devices)]
    return sharding.make_mesh(tuple(run.mesh.shape), devices=devices)


def rollout_mesh(run: config_lib.RunConfig, mesh):
    """The sampler's own data-parallel mesh (rollout.num_devices of the devices `mesh` does not
    use), or None when it shares the trainer's."""
    k = run.rollout.num_devices
    if not k:
        return None
    if jax.process_count() > 1:
        raise ValueError(
            f"rollout.num_devices={k}: devices of the sampler's own are supported in one process "
            f"(this run has {jax.process_count()}); use rollout.num_devices=0 (the sampler "
            "shares the trainer's mesh, with its own copy of the params)"
        )
    used = set(mesh.devices.flat)
    free = [d for d in jax.devices() if d not in used]
    if len(free) < k:
        raise ValueError(
            f"rollout.num_devices={k}, but only {len(free)} of the {jax.device_count()} devices "
            f"are not in the trainer's mesh {dict(mesh.shape)}: lower rollout.num_devices or "
            "give the trainer a smaller mesh.shape"
        )
    return sharding.make_mesh((-1, 1, 1), devices=free[:k])


GENERATIONS_FILE = "val_generations.jsonl"


def write_generations(workdir: str, step_done: int, generations: Sequence[dict], *,
                      log: bool = True) -> None:
    """Appends one validation's logged samples to workdir/val_generations.jsonl (and the log)."""
    with open(os.path.join(workdir, GENERATIONS_FILE), "a") as f:
        for g in generations:
            f.write(json.dumps({"step": step_done, **g}, default=str) + "\n")
    for g in generations if log else ():
        logging.info("val sample (step %d, score %.3g): %r -> %r", step_done, g["score"],
                     g["input"], g["output"])


def truncate_generations(workdir: str, step: int) -> None:
    """Drops the logged samples of validations after `step` (a resumed run redoes them)."""
    kept = {k: v for k, v in read_generations(workdir).items() if k <= step}
    path = os.path.join(workdir, GENERATIONS_FILE)
    if os.path.exists(path):
        os.remove(path)
    for k, rows in kept.items():
        write_generations(workdir, k, rows, log=False)


def read_generations(workdir: str) -> dict[int, list[dict]]:
    """{step: samples} of workdir/val_generations.jsonl ({} when none were logged)."""
    path = os.path.join(workdir, GENERATIONS_FILE)
    out: dict[int, list[dict]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                out.setdefault(row.pop("step"), []).append(row)
    return out


def _examples(rows, name: str, layout, on_malformed: str) -> list[prompts.Example]:
    if all(isinstance(r, prompts.Example) for r in rows):
        return list(rows)
    return readers.parse_rows(rows, source=name, on_malformed=on_malformed, layout=layout)


# The rng stream of the LoRA adapters' initialisation (fold_in of trainer.seed's key).
_LORA_INIT_STREAM = 0x10A


def lora_pointer(run: config_lib.RunConfig, model_config: model_lib.ModelConfig) -> dict | None:
    """What a LoRA checkpoint records of its base (None without LoRA): the adapters are only
    meaningful on the same base weights with the same rank, alpha and targets."""
    if not model_config.lora_rank:
        return None
    m = run.model
    return {
        "model.path": m.path,
        "model.source": m.source,
        "model.tiny.seed": m.tiny.seed if m.source == "random" else None,
        "model.param_dtype": m.param_dtype,
        "model.lora_rank": model_config.lora_rank,
        "model.lora_alpha": model_config.lora_alpha,
        "model.target_modules": ",".join(model_config.lora_targets),
    }


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


def _steps(
    run, ctx, loop, train_set, schedule, start, steps, mngr, writer, evaluate, callbacks, is_main
) -> list[dict]:
    import tqdm

    bar = tqdm.tqdm(
        total=steps,
        initial=start,
        disable=not (is_main and run.trainer.progress_bar),
        desc="grpo",
        dynamic_ncols=True,
    )
    with_ref = run.needs_reference and run.warmup.steps > 0
    history, last_val = [], {}
    t = run.trainer

    def next_prompts(count: int) -> prompts.PromptBatch:
        idx, loop.position = prompts.next_indices(
            len(train_set), loop.position, count, seed=run.data.seed, shuffle=run.data.shuffle
        )
        rows = distributed.process_rows(count) if jax.process_count() > 1 else None
        return prompts.make_batch(train_set, idx, pad_token_id=ctx.engine.pad_id, rows=rows)

    def sample(i: int, policy, version: int, sampled_at: int):
        """Batch i, sampled by `policy` (policy version `version`) in loop step `sampled_at`,
        and the data position after its prompts."""
        rng = jax.random.fold_in(jax.random.wrap_key_data(loop.root_key), i)
        batch = step.rollout_stage(ctx, policy, next_prompts, rng, policy_version=version,
                                   sampled_at=sampled_at)
        return batch, loop.position

    def saves_after(done: int) -> bool:
        return (t.save_freq > 0 and done % t.save_freq == 0) or (
            done == steps and run.checkpoint.save_last)

    # trainer.async_rollout: the batch of step i + 1 is sampled during step i's update (see
    # grpo_jax/rollout/async_rollout.py), never across a checkpoint.
    ahead = async_rollout.Ahead() if t.async_rollout else None
    elsewhere = getattr(ctx.engine, "mesh", None) not in (None, ctx.mesh)
    try:
        for i in range(start, steps):
            t_step, compiled = time.perf_counter(), perf.compile_seconds()
            done = i + 1
            timing = {}
            version = int(jax.device_get(loop.state.step))
            batch = None
            if ahead is not None and ahead.pending:
                t0 = time.perf_counter()
                batch, position = ahead.take()
                # the trainer's wait: the part of sampling the update did not cover
                timing["timing_s/wait_rollout"] = time.perf_counter() - t0
            synced = ctx.engine.sync(ctx.policy(loop.state), version)
            if synced is not None:  # the params changed in the last update
                timing["timing_s/weight_sync"] = synced
            if batch is None:  # sampled now, by the params being updated
                batch, position = sample(i, ctx.policy(loop.state), version, i)
            staleness = async_rollout.check_staleness(batch.sampled_at, i, t.max_staleness)
            if ahead is not None and done < steps and not saves_after(done):
                # Batch i + 1, sampled by the engine's copy of these params during the update.
                ahead.submit(sample, i + 1, None, version, i)
            if elsewhere:  # sampled on the sampler's own devices
                batch = step.on_mesh(batch, ctx.mesh)
            loop.state, row = step.train_stage(
                ctx, loop.state, loop.ref_params, batch, schedule(i), kl_coef=loop.kl_coef
            )
            if t.async_rollout:
                row["async/staleness"] = staleness
                row["async/policy_version_lag"] = version - batch.policy_version
            if run.algorithm.use_kl_in_reward:  # the controller moves after the step (verl)
                loop.kl_coef = step.next_kl_coef(
                    run.algorithm.kl_ctrl, loop.kl_coef, row["actor/reward_kl_penalty"],
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
            row["training/epoch"] = position.epoch
            row["training/global_step"] = i + 1
            timing["timing_s/step"] = time.perf_counter() - t_step  # verl: validation excluded
            timing["timing_s/compile"] = perf.compile_seconds() - compiled
            tests = t.test_freq > 0 and (done % t.test_freq == 0 or done == steps)
            if evaluate is not None and tests:
                if ahead is not None:
                    ahead.wait()  # the batch in flight, on the same engine, finishes first
                last_val = _timed(timing, "testing", evaluate, loop.state, done)
                row |= last_val
            row |= timing
            row["perf/time_per_step"] = timing["timing_s/step"]
            row["perf/throughput"] = (
                row["perf/total_num_tokens"] / timing["timing_s/step"] / jax.device_count()
            )
            if saves_after(done):
                t0 = time.perf_counter()
                checkpoint.save(mngr, done, loop.tree(with_ref=with_ref), loop.meta(done, row))
                row["timing_s/save_checkpoint"] = time.perf_counter() - t0
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


def warm_up(
    run, state, tx, train_set, tokenizer, mesh, *, eos_id, pad_id, micro_rows, model_config,
    base_params=None,
) -> tuple[actor.TrainState, dict]:
    """Supervised warm-up on the reference answers (warmup.steps), then a fresh optimizer.

    With LoRA (`base_params` the frozen base) it trains the adapters.

    Returns:
      (state, metrics): update count 0 and a fresh optimizer state; the last warm-up NLL.
    """
    w = run.warmup
    missing = [ex.line for ex in train_set.examples if ex.answer is None]
    if missing:
        raise ValueError(
            f"warmup.steps={w.steps} needs a reference answer per prompt (extra_info.answer, or "
            f"the answer of a raw GSM8K row); {len(missing)} prompts have none (lines "
            f"{missing[:5]}...)"
        )
    sft_fn = jax.jit(
        functools.partial(
            actor.sft_step,
            model_config=model_config,
            tx=tx,
            micro_batch_size=min(micro_rows, w.batch_size),
        ),
        donate_argnums=0,
    )
    base = () if base_params is None else (base_params,)
    position = prompts.Position()
    nll = float("nan")
    for i in range(w.steps):
        idx, position = prompts.next_indices(
            len(train_set), position, w.batch_size, seed=run.data.seed + 1, shuffle=True
        )
        batch = sft_batch(
            train_set,
            idx,
            tokenizer,
            mesh,
            eos_id=eos_id,
            pad_id=pad_id,
            max_response_length=run.data.max_response_length,
        )
        state, m = sft_fn(state, batch, jnp.float32(w.lr), *base)
        nll = float(m["sft/nll"])
        if i % 10 == 0 or i == w.steps - 1:
            logging.info("warm-up step %d/%d: nll %.4f", i + 1, w.steps, nll)
    fresh = actor.TrainState(jnp.zeros_like(state.step), state.params, tx.init(state.params))
    return fresh, {"warmup/nll": nll, "warmup/steps": w.steps}


def sft_batch(train_set, indices, tokenizer, mesh, *, eos_id, pad_id, max_response_length):
    """Prompt + reference answer (+ EOS) for the supervised warm-up, answers right-padded."""
    pb = prompts.make_batch(train_set, indices, pad_token_id=pad_id)
    r = max_response_length
    answers = [ex.answer for ex in pb.examples]
    ans_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    resp_PT = np.full((len(indices), r), pad_id, np.int32)
    mask_PT = np.zeros((len(indices), r), np.int32)
    for p, ids in enumerate(ans_ids):
        ids = (list(ids) + [eos_id])[:r]
        resp_PT[p, : len(ids)] = ids
        mask_PT[p, : len(ids)] = 1
    arrays = dict(
        input_ids_BS=np.concatenate([pb.prompt_ids_PT, resp_PT], 1),
        attention_mask_BS=np.concatenate([pb.prompt_mask_PT, mask_PT], 1),
        response_ids_BT=resp_PT,
        response_mask_BT=mask_PT,
        advantages_BT=np.zeros(resp_PT.shape, np.float32),
    )
    return actor.TrainBatch(**{k: distributed.to_device(v, mesh) for k, v in arrays.items()})


def _timed(timing: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    timing[f"timing_s/{key}"] = time.perf_counter() - t0
    return out
