"""What a run sets up before its first step: meshes, the optimizer, the sharded train state,
the rollout engine. The loop (loop.py) and the memory planner (grpo_jax/planner/) share it, so
the planner compiles exactly the state and programs the loop runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax import sharding
from grpo_jax.data import prompts
from grpo_jax.models import lora
from grpo_jax.rollout import chat_turns, engines, multi_turn, vllm_pool, vllm_sidecar
from grpo_jax.tools import executor as tool_executor
from grpo_jax.tools import hermes
from grpo_jax.tools import loading as tool_loading
from grpo_jax.trainer import actor


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


def total_training_steps(run: config_lib.RunConfig, num_prompts: int) -> int:
    """verl's `total_training_steps`: trainer.total_training_steps, else total_epochs x full
    batches per epoch. The learning-rate schedule's horizon (warm-up ratio, cosine decay) and
    the step verl treats as the last (validation there); the run itself may stop earlier
    (`total_steps`)."""
    per_epoch = prompts.steps_per_epoch(num_prompts, run.data.train_batch_size)
    return run.trainer.total_training_steps or run.trainer.total_epochs * per_epoch


def total_steps(run: config_lib.RunConfig, num_prompts: int) -> int:
    """The training steps the run takes: `total_training_steps`, capped at total_epochs x full
    batches per epoch.

    verl 0.9.1 (v1 PPOTrainer.fit) loops while its epoch, (global_steps - 1) // steps_per_epoch
    (steps_per_epoch = prompts // data.train_batch_size), is below trainer.total_epochs and
    global_steps <= total_training_steps, so a trainer.total_training_steps beyond the epochs'
    steps ends at the epochs; a smaller one ends the run first.
    """
    per_epoch = prompts.steps_per_epoch(num_prompts, run.data.train_batch_size)
    return min(total_training_steps(run, num_prompts), run.trainer.total_epochs * per_epoch)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where a run's params and train state live (abstract: no array is allocated).

    Attributes:
      model_config: the model, with the run's LoRA settings (model.lora_rank) applied.
      param_shardings: the model params' (with LoRA: the frozen base's).
      trained: jax.ShapeDtypeStructs of what the optimizer trains: the params, or with LoRA the
        adapters only.
      trained_shardings: their shardings.
      state_shardings: the actor.TrainState's (step, trained params, optimizer state).
    """

    model_config: model_lib.ModelConfig
    param_shardings: Any
    trained: Any
    trained_shardings: Any
    state_shardings: actor.TrainState


def state_layout(
    run: config_lib.RunConfig, model_config: model_lib.ModelConfig, mesh, rules, tx
) -> StateLayout:
    """The run's StateLayout on `mesh` with logical-axis `rules` and optimizer `tx`."""
    if run.model.lora_rank or model_config.lora_rank:
        model_config = lora.configure(
            model_config, rank=run.model.lora_rank, alpha=run.model.lora_alpha,
            target_modules=run.model.target_modules,
        )  # fmt: skip
    param_sh = sharding.param_shardings(model_config, mesh, rules)
    if model_config.lora_rank:  # the params are the frozen base; the state trains adapters
        trained = model_lib.abstract_adapters(model_config)
        trained_sh = sharding.adapter_shardings(model_config, mesh, rules)
    else:
        trained, trained_sh = model_lib.abstract_params(model_config), param_sh
    state_sh = actor.TrainState(
        sharding.replicated(mesh),
        trained_sh,
        sharding.tx_state_shardings(tx, trained, trained_sh, mesh),
    )
    return StateLayout(model_config, param_sh, trained, trained_sh, state_sh)


# The rng stream of the LoRA adapters' initialisation: fold_in of trainer.seed's key, outside
# the range of loop steps, whose rollouts draw from fold_in(that key, step) (loop.py), and apart
# from the update's stream (actor.UPDATE_STREAM). It was 0x10A, the rollout key of step 266.
LORA_INIT_STREAM = 0x7FFF10A0


def init_state(run: config_lib.RunConfig, layout: StateLayout, params, tx, *, donate: bool = False):
    """(state, params): a fresh actor.TrainState on its devices (step 0, the optimizer state of
    its trained params) and `params` placed in their shardings (with LoRA: the frozen base).

    The state trains a copy of `params`, or with LoRA fresh adapters (PEFT's initialisation,
    from trainer.seed). With `donate` (the caller drops `params`) and neither LoRA nor a
    reference (run.needs_reference) keeping them, the state takes over their buffers instead:
    the returned `params` are None and the caller's arrays are deleted, one copy of the weights
    fewer for the whole run.
    """
    donate = donate and not layout.model_config.lora_rank and not run.needs_reference
    params = jax.device_put(params, layout.param_shardings)
    if layout.model_config.lora_rank:
        key = jax.random.fold_in(jax.random.key(run.trainer.seed), LORA_INIT_STREAM)
        trainable = lora.init_adapters(layout.model_config, key,
                                       shardings=layout.trained_shardings)  # fmt: skip
    else:
        trainable = params
    init = jax.jit(
        functools.partial(actor.init_state, tx=tx),
        out_shardings=layout.state_shardings,
        donate_argnums=0 if donate else (),
    )
    state = init(trainable)
    return state, None if donate else params


def train_mesh(run: config_lib.RunConfig):
    """The trainer's mesh (run.mesh.shape) over every device but the sampler's own (the last
    rollout.num_devices, see rollout_mesh)."""
    devices = jax.devices()
    if run.rollout.num_devices:
        devices = devices[: max(0, len(devices) - run.rollout.num_devices)]
    sp = run.actor.ulysses_sequence_parallel_size
    try:
        return sharding.make_mesh(tuple(run.mesh.shape), devices=devices, sequence=sp)
    except ValueError as e:
        if sp == 1:
            raise
        fits = [s for s in range(1, sp) if len(devices) % s == 0]
        raise config_lib.ConfigError([
            f"actor.ulysses_sequence_parallel_size={sp} with mesh.shape={tuple(run.mesh.shape)} "
            f"does not fit the {len(devices)} devices ({e}); a size that divides them "
            f"(e.g. {max(fits)}) with an fsdp or data entry of -1 would"
        ]) from None


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


def make_engine(
    run: config_lib.RunConfig,
    model_config: model_lib.ModelConfig,
    mesh,
    *,
    eos_ids,
    pad_id,
    workdir: str,
    rollout_mesh=None,
    rules=sharding.LOGICAL_RULES,
) -> engines.Engine:
    """The configured rollout engine (rollout.name): native sampler or vLLM sidecar.

    The native sampler runs on `rollout_mesh` when given (rollout.num_devices), else on the
    trainer's mesh; with trainer.async_rollout it samples with a copy of the params of its own.
    """
    if run.rollout.name == "jax":
        return engines.NativeEngine(
            dataclasses.replace(model_config, kv_cache_dtype=run.rollout.kv_cache_dtype),
            rollout_mesh or mesh,
            eos_ids=eos_ids,
            pad_id=pad_id,
            own_params=run.trainer.async_rollout,
            rules=rules,
            logprobs_mode=run.rollout.logprobs_mode,
            max_num_seqs=run.rollout.max_num_seqs,
            max_num_batched_tokens=run.rollout.max_num_batched_tokens,
            num_pages=run.rollout.num_gpu_blocks_override,
        )
    if jax.process_count() > 1:
        raise ValueError(
            f"rollout.name={run.rollout.name!r}: the vLLM sidecar serves one trainer process, and "
            f"this run has {jax.process_count()} JAX processes; use rollout.name=jax (the "
            "native sampler on the global mesh) for multi-process runs"
        )
    configs = run.rollout.sidecar_configs()
    if len(configs) == 1:
        sidecar = vllm_sidecar.VLLMSidecar(configs[0], model_config, os.path.join(workdir, "vllm"))
    else:
        sidecar = vllm_pool.VLLMServers(configs, model_config, os.path.join(workdir, "vllm"))
    return engines.SidecarEngine(sidecar, eos_ids=eos_ids, pad_id=pad_id)


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


def tool_set(run: config_lib.RunConfig, tools=None) -> list | None:
    """rollout.multi_turn's tools: `tools` (loop.train(tools=...)) or those of
    rollout.multi_turn.tool_config_path; None when multi-turn is off.

    Raises:
      config_lib.ConfigError: multi-turn is on and no tools are given, or tools are given with
        it off.
    """
    mt = run.rollout.multi_turn
    if not mt.enable:
        if tools:
            raise config_lib.ConfigError([
                "tools were given but rollout.multi_turn.enable=False: set it to True to run "
                "multi-turn rollouts with them"
            ])  # fmt: skip
        return None
    try:
        if tools:
            return tool_loading.check_tools(list(tools), source="loop.train(tools=...)")
        if mt.tool_config_path:
            return tool_loading.load_tools(mt.tool_config_path)
    except tool_loading.ToolConfigError as e:
        raise config_lib.ConfigError(e.problems) from None
    raise config_lib.ConfigError([
        "rollout.multi_turn.enable=True needs tools: set rollout.multi_turn.tool_config_path "
        "to a verl tool YAML (tools: - class_name, config, tool_schema), or pass "
        "loop.train(tools=[...])"
    ])  # fmt: skip


def chat_template_kwargs(run: config_lib.RunConfig, tools) -> dict:
    """data.apply_chat_template_kwargs, plus the tools' schemas (the template's `tools=`, which
    lists them in the prompt) for multi-turn rollouts."""
    kwargs = dict(run.data.apply_chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tool_loading.tool_schemas(tools)
    return kwargs


def make_agent(run: config_lib.RunConfig, tools, tokenizer, *, eos_ids, pad_id, dp: int):
    """The multi-turn rollout driver (rollout/multi_turn.py), or None without tools."""
    if not tools:
        return None
    mt = run.rollout.multi_turn
    turns = chat_turns.ChatTurns(
        tokenizer,
        tools=tool_loading.tool_schemas(tools),
        stop_ids=eos_ids,
        chat_template_kwargs=run.data.apply_chat_template_kwargs,
    )
    runner = tool_executor.ToolExecutor(
        tools, max_parallel_calls=mt.max_parallel_calls, timeout_s=mt.tool_timeout,
        validate_arguments=mt.validate_tool_arguments,
    )
    settings = multi_turn.Settings(
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_parallel_calls=mt.max_parallel_calls,
        max_tool_response_length=mt.max_tool_response_length,
        tool_response_truncate_side=mt.tool_response_truncate_side,
        format=mt.format,
    )
    unit = math.lcm(dp, run.rollout.num_devices or 1)
    return multi_turn.Agent(turns, runner, hermes.parse, settings, unit=unit, pad_id=pad_id)
