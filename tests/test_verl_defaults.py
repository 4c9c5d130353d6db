"""Every default of grpo_jax's config against verl 0.9.1's trainer YAML: a field verl has must hold
verl's default unless DEVIATIONS lists it with the reason (docs/verl.md "Where grpo_jax
deliberately differs" states the same list), and a field verl lacks must be one of grpo_jax's own
(OWN). Adding a field, or changing a default, therefore means saying which it is."""

import dataclasses

import pytest
import reference

from grpo_jax import config

# grpo_jax field -> verl YAML path, where the name differs beyond the section prefix.
RENAMED = {
    "data.path": "data.train_files",
    "data.val_path": "data.val_files",
    "checkpoint.max_to_keep": "trainer.max_actor_ckpt_to_keep",
    "custom_reward_function.path": "reward.custom_reward_function.path",
    "custom_reward_function.name": "reward.custom_reward_function.name",
    # verl 0.9.1 moves its legacy reward_model.* under reward.reward_model (migrate_legacy_...)
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.model.path": "reward.reward_model.model_path",
    **{f"reward_model.rollout.{k}": f"reward.reward_model.rollout.{k}" for k in (
        "temperature", "top_p", "top_k", "do_sample", "prompt_length", "response_length")},
    "rollout.vllm.gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "rollout.vllm.dtype": "actor_rollout_ref.rollout.dtype",
    "rollout.vllm.max_model_len": "actor_rollout_ref.rollout.max_model_len",
    "rollout.vllm.seed": "actor_rollout_ref.rollout.seed",
    # FSDP's mixed precision: compute dtype and the parameters' (master) dtype
    "model.dtype": "actor_rollout_ref.actor.fsdp_config.dtype",
    "model.param_dtype": "actor_rollout_ref.actor.fsdp_config.model_dtype",
}
SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# grpo_jax default vs verl's, and why. docs/verl.md repeats this list.
DEVIATIONS = {
    "data.path": "verl's default is a placeholder path (~/data/rlhf/gsm8k/...); grpo_jax's "
    "None must be set for data.source=files, and its config check says so",
    "data.val_path": "the same placeholder",
    "data.val_batch_size": "verl's None validates the whole set at once; 256 prompts a "
    "generation batch bounds the native sampler's KV cache (the metrics are the same)",
    "data.seed": "verl's None leaves the max_samples draw unseeded (other rows every run) and "
    "the shuffle on torch's default generator; 1 seeds both, so runs repeat",
    "model.path": "verl's default is a placeholder (~/models/deepseek-llm-7b-chat); grpo_jax's "
    "None must be set for model.source=hf (a local directory, hub id or GGUF file)",
    "model.dtype": "float32 compute (verl: bfloat16 under FSDP mixed precision, float32 "
    "master weights, as param_dtype here): every CPU runs it, bf16 matmuls are slow or "
    "emulated on an AVX2-only CPU, and the parity tests run both sides in float32; "
    "the GPU / TPU recipe configs set bfloat16",
    "model.enable_gradient_checkpointing": "off in the library's defaults, where recomputing "
    "the forward pass only costs time for the small models they run; the shipped configs "
    "(configs/gsm8k.py, demo.py, gsm8k_qwen3_8b.py) turn it on as verl's scripts do",
    "actor.ppo_micro_batch_size_per_gpu": "verl's None is an error unless use_dynamic_bsz; 8 "
    "rows a device is a runnable default",
    "rollout.name": "verl's ??? must be given (vllm or sglang); grpo_jax's jax is its native "
    "sampler",
    "rollout.n": "verl's 1 is for its default estimator gae; GRPO needs groups, and grpo_jax "
    "has no critic",
    "rollout.log_prob_micro_batch_size_per_gpu": "verl's None is an error unless "
    "log_prob_use_dynamic_bsz; 16 rows a device is a runnable default",
    "rollout.log_prob_use_dynamic_bsz": "None follows the actor's, as verl's "
    "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz} does",
    "rollout.log_prob_max_token_len_per_gpu": "None follows the actor's, as verl's "
    "${oc.select:...ppo_max_token_len_per_gpu} does",
    "ref.ulysses_sequence_parallel_size": "None follows the actor's, as verl's "
    "${oc.select:actor_rollout_ref.actor.ulysses_sequence_parallel_size,1} does",
    "rollout.tensor_model_parallel_size": "verl's 2 is vLLM's on a GPU node; 1 runs anywhere "
    "(the native sampler shards by mesh instead)",
    "rollout.vllm.gpu_memory_utilization": "the sidecar stays resident while JAX trains (verl "
    "puts vLLM to sleep), so it takes 0.4 and leaves the rest to XLA",
    "rollout.vllm.seed": "vLLM's seed; verl's rollout.seed is 42, grpo_jax's sidecar 0, with "
    "trainer.seed driving every other draw",
    "rollout.vllm.max_model_len": "0 means the model's max_position_embeddings, what verl's "
    "None means (an int field: 0 for unset)",
    "reward.num_workers": "scorer processes; verl's 8 are Ray reward-loop workers, 2 fits the "
    "2-core machines grpo_jax is tested on (0 scores in the trainer)",
    "algorithm.adv_estimator": "verl's default gae needs a critic; grpo_jax is a GRPO trainer",
    "trainer.default_local_dir": "verl's interpolates trainer.project_name and "
    "experiment_name; grpo_jax's stays fixed, so naming a tracker run never moves the workdir "
    "and the checkpoints a resume looks for",
    "trainer.logger": "verl's ['console', 'wandb'] needs the wandb package and a W&B login; "
    "grpo_jax's ('console', 'tensorboard') is what it logged before trainer.logger existed, "
    "with nothing to install (wandb and mlflow are the extras grpo_jax[wandb] / [mlflow])",
    "trainer.balance_batch": "verl's mini-batches are cut from the data-parallel ranks' "
    "balanced parts, so they change with the mesh; grpo_jax's default keeps whole groups in "
    "data order, the same on any mesh (identical on one data-parallel device)",
    "checkpoint.max_to_keep": "verl's None keeps every checkpoint; 3 bounds the disk a long "
    "run fills (set a large number to keep them all)",
}

# grpo_jax's own fields: no counterpart in verl's trainer YAML.
OWN = (
    "data.source", "data.train_split", "data.val_split", "data.hf_name", "data.tfds_name",
    "data.tfds_data_dir", "data.ground_truth_key", "data.prompt_suffix",
    "data.prompt_length_bucket", "data.prompt_padding", "data.on_malformed", "data.arithmetic.",
    # verl reads data.apply_chat_template_kwargs with a get() and an empty default
    "data.apply_chat_template_kwargs",
    "model.source", "model.tokenizer",
    "model.gradient_checkpointing_policy", "model.attention_impl", "model.tiny.",
    "rollout.num_devices", "rollout.vllm.",
    # vLLM's --num-gpu-blocks-override, which verl passes in engine_kwargs.vllm (a free dict)
    "rollout.num_gpu_blocks_override",
    # vLLM's --kv-cache-dtype (not in verl's YAML), for the native engine
    "rollout.kv_cache_dtype",
    # grpo_jax's multi-turn knobs (docs/rollouts.md), and verl <= 0.5's interactions (refused)
    "rollout.multi_turn.tool_timeout", "rollout.multi_turn.validate_tool_arguments",
    "rollout.multi_turn.interaction_config_path",
    "algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights",
    # verl keeps it in its Megatron / VeOmni engine sections (actor.megatron.router_replay),
    # not in the FSDP trainer's YAML; same values and default (docs/verl.md)
    "actor.router_replay.",
    # the DAPO reward manager's reward_kwargs.overlong_buffer_cfg, not in the YAML
    "reward.fn", "reward.weights", "reward.on_error", "reward.timeout_s", "reward.overlong_buffer.",
    # verl's agent loop always scores a trajectory when it ends; grpo_jax can turn that off
    "reward.overlap_with_rollout",
    # verl <= 0.5's reward-model batching (0.9.1 serves the model with vLLM)
    "reward_model.micro_batch_size_per_gpu", "reward_model.max_length",
    # a judge's prompt and verdict parsing (verl writes them in a custom reward function)
    "reward_model.genrm.",
    "warmup.", "trainer.seed", "trainer.max_consecutive_nonfinite", "trainer.progress_bar",
    "trainer.tensorboard", "trainer.device_peak_tflops", "trainer.async_rollout",
    "trainer.max_staleness", "trainer.compilation_cache_dir",
    "checkpoint.save_last", "checkpoint.export_hf", "mesh.",
)


def _ours() -> dict:
    flat = {}

    def walk(obj, prefix):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            else:
                flat[prefix + field.name] = value

    walk(config.RunConfig(), "")
    return flat


def _own(name: str) -> bool:
    return name.startswith(OWN) and name not in RENAMED


def _verl_path(name: str) -> str | None:
    if name in RENAMED:
        return RENAMED[name]
    section = name.split(".")[0]
    if section in ("actor", "rollout", "model", "ref"):
        return f"actor_rollout_ref.{name}"
    return name


def _same(ours, theirs) -> bool:
    """Equal values; a YAML int equals a float of the same value (16 and 16.0), not a bool."""
    if isinstance(ours, tuple):
        ours = list(ours)
    theirs = SPELLINGS.get(theirs, theirs) if isinstance(theirs, str) else theirs
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (ours, theirs))
    return ours == theirs if numbers else type(ours) is type(theirs) and ours == theirs


@pytest.fixture(scope="module")
def verl_yaml(verl):
    return verl.run(reference.fn("verl_config:trainer_defaults")()).value


def test_defaults_are_verls_or_a_listed_deviation(verl_yaml):
    differ, unknown = {}, []
    for name, value in _ours().items():
        if _own(name):
            continue
        path = _verl_path(name)
        if path not in verl_yaml:
            unknown.append(f"{name} (verl: {path})")
            continue
        if not _same(value, verl_yaml[path]):
            differ[name] = (value, verl_yaml[path])
    assert not unknown, f"fields neither verl's nor listed in OWN: {unknown}"
    unlisted = {k: v for k, v in differ.items() if k not in DEVIATIONS}
    assert not unlisted, f"defaults that differ from verl's without a reason: {unlisted}"
    stale = sorted(set(DEVIATIONS) - set(differ))
    assert not stale, f"DEVIATIONS lists defaults that equal verl's now: {stale}"


def test_own_fields_are_not_verls(verl_yaml):
    # An OWN entry that verl's YAML has would hide a default from the comparison.
    names = [n for n in _ours() if _own(n)]
    clash = [n for n in names if _verl_path(n) in verl_yaml]
    assert not clash, clash


def test_the_docs_list_every_deviation():
    import pathlib

    doc = (pathlib.Path(__file__).parents[1] / "docs" / "verl.md").read_text()
    section = doc.split("## Where grpo_jax deliberately differs", 1)[1]
    missing = [name for name in DEVIATIONS if f"`{name}`" not in section]
    assert not missing, f"docs/verl.md's deviation section does not name {missing}"
