r"""GRPO training entry point: `python train.py --config=configs/gsm8k.py[:variant] [--config.X=v]`.

One step (verl-semantics.md section 1): sample rollout.n completions per prompt (native JAX
sampler or vLLM sidecar) -> decode -> rewards (grpo_jax.rewards) -> group advantages
(grpo_jax.advantage) -> old log-probs (only when off-policy) and reference log-probs -> ppo_epochs
x mini-batches of jitted `trainer.train_step` (state donated). Every `trainer.test_freq` steps and
at the end: greedy pass@1 on the validation split (`val/<source>/acc`). Every `trainer.save_freq`
steps: an orbax checkpoint (state, rng, data position); a run restarts from the latest one in
`trainer.default_local_dir`. At the end: HF safetensors export (workdir/hf) and plot.png.

The config is validated (`check_config`) before any model, data or device work. Only process 0
writes metrics, plots and the HF export.
"""

import dataclasses
import functools
import json
import logging
import os
import shlex
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from grpo_jax import advantage as advantage_lib
from grpo_jax import (
    checkpoint,
    data,
    demo_task,
    distributed,
    metrics,
    plot,
    rewards,
    sampler,
    sharding,
    trainer,
)
from grpo_jax import loss as loss_lib
from grpo_jax import model as model_lib

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:arg]).", lock_config=True
)
_PLAN = flags.DEFINE_bool(
    "plan", False, "Print the per-device memory plan of this config and mesh (plan.py) and exit."
)
_PLAN_MODEL = flags.DEFINE_string(
    "plan_model", "", "With --plan: a plan.py preset (e.g. qwen2.5-7b); default config.model."
)
_PLAN_HBM = flags.DEFINE_float("plan_hbm_gib", 80.0, "With --plan: memory per device, GiB.")

# Enum-like string fields and their allowed values (checked before any heavy work).
CHOICES = {
    "data.source": ("tfds", "jsonl", "arithmetic"),
    "data.truncation": data.TRUNCATION_MODES,
    "data.on_malformed": data.ON_MALFORMED_MODES,
    "mesh.distributed": ("auto", "on", "off"),
    "model.source": ("hf", "random"),
    "model.tokenizer": ("hf", "char"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "actor.loss_agg_mode": loss_lib.AGG_MODES,
    "actor.kl_loss_type": loss_lib.KL_TYPES,
    "actor.policy_loss.loss_mode": loss_lib.POLICY_LOSS_MODES,
    "actor.optim.lr_scheduler_type": trainer.LR_SCHEDULES,
    "rollout.name": ("jax", "vllm"),
    "algorithm.adv_estimator": ("grpo", "rloo"),
    "algorithm.kl_penalty": tuple(k for k in loss_lib.KL_TYPES if not k.startswith("full")),
    "algorithm.kl_ctrl.type": ("fixed",),
    "reward.on_error": rewards.ON_ERROR_MODES,
    "trainer.resume_mode": ("auto", "disable"),
}


def _get(c: ml_collections.ConfigDict, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


def check_config(c: ml_collections.ConfigDict) -> None:
    """Validates the whole config; raises ValueError listing every problem (field + allowed)."""
    errors = []
    for field, allowed in CHOICES.items():
        value = _get(c, field)
        if value not in allowed:
            errors.append(f"{field}={value!r} must be one of {list(allowed)}")

    def need(cond, msg):
        if not cond:
            errors.append(msg)

    a, d, r, t = c.actor, c.data, c.rollout, c.trainer
    if c.algorithm.adv_estimator in ("grpo", "rloo"):
        need(
            r.n >= 2,
            f"rollout.n={r.n} must be >= 2 for {c.algorithm.adv_estimator} "
            "(group baselines need at least two samples per prompt)",
        )
    for name in (
        "data.train_batch_size",
        "data.val_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor.ppo_mini_batch_size",
        "actor.ppo_micro_batch_size_per_gpu",
        "actor.ppo_epochs",
        "rollout.log_prob_micro_batch_size_per_gpu",
        "rollout.val_kwargs.n",
        "trainer.total_epochs",
        "checkpoint.max_to_keep",
        "warmup.batch_size",
        "trainer.max_consecutive_nonfinite",
        "data.prompt_length_bucket",
    ):
        need(_get(c, name) >= 1, f"{name}={_get(c, name)} must be >= 1")
    if a.ppo_mini_batch_size >= 1 and d.train_batch_size >= 1:
        need(
            d.train_batch_size % a.ppo_mini_batch_size == 0,
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide "
            f"data.train_batch_size={d.train_batch_size}",
        )
    need(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0")
    need(
        r.val_kwargs.temperature >= 0,
        f"rollout.val_kwargs.temperature={r.val_kwargs.temperature} must be >= 0",
    )
    need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    need(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k={r.top_k} must be -1 (off) or >= 1")
    need(
        np.isfinite(a.optim.lr) and a.optim.lr > 0,
        f"actor.optim.lr={a.optim.lr} must be finite and > 0",
    )
    need(
        len(a.optim.betas) == 2 and all(0 <= b < 1 for b in a.optim.betas),
        f"actor.optim.betas={a.optim.betas} must be two values in [0, 1)",
    )
    need(a.grad_clip > 0, f"actor.grad_clip={a.grad_clip} must be > 0")
    need(a.clip_ratio > 0, f"actor.clip_ratio={a.clip_ratio} must be > 0")
    need(a.clip_ratio_c > 1, f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1")
    need(a.kl_loss_coef >= 0, f"actor.kl_loss_coef={a.kl_loss_coef} must be >= 0")
    need(
        not a.kl_loss_type.startswith("full"),
        f"actor.kl_loss_type={a.kl_loss_type!r}: 'full' needs full reference logits, which the "
        "chunked trainer never builds; use kl, abs, mse or low_var_kl (optionally with '+')",
    )
    need(
        a.loss_scale_factor is None or a.loss_scale_factor > 0,
        f"actor.loss_scale_factor={a.loss_scale_factor} must be > 0 or None",
    )
    need(t.save_freq == -1 or t.save_freq >= 1, f"trainer.save_freq={t.save_freq}: -1 or >= 1")
    need(t.test_freq == -1 or t.test_freq >= 1, f"trainer.test_freq={t.test_freq}: -1 or >= 1")
    need(
        t.total_training_steps is None or t.total_training_steps >= 1,
        f"trainer.total_training_steps={t.total_training_steps} must be >= 1 or None",
    )
    need(c.warmup.steps >= 0, f"warmup.steps={c.warmup.steps} must be >= 0")
    need(
        d.val_max_samples == -1 or d.val_max_samples >= 1,
        f"data.val_max_samples={d.val_max_samples}: -1 (all) or >= 1",
    )
    need(
        len(c.mesh.shape) == 3,
        f"mesh.shape={c.mesh.shape} must have 3 entries (data, fsdp, tensor)",
    )
    # Values that would otherwise fail late (after data or model loading) or without naming
    # their field (tests/test_bad_input.py).
    need(c.warmup.lr > 0, f"warmup.lr={c.warmup.lr} must be > 0")
    need(a.optim.weight_decay >= 0, f"actor.optim.weight_decay={a.optim.weight_decay} must be >= 0")
    for name in ("actor.optim.lr_warmup_steps_ratio", "actor.optim.min_lr_ratio"):
        need(0 <= _get(c, name) <= 1, f"{name}={_get(c, name)} must be in [0, 1]")
    for name in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        need(
            _get(c, name) is None or _get(c, name) > 0,
            f"{name}={_get(c, name)} must be > 0 or None",
        )
    need(
        c.algorithm.kl_ctrl.kl_coef >= 0,
        f"algorithm.kl_ctrl.kl_coef={c.algorithm.kl_ctrl.kl_coef} must be >= 0",
    )
    for name in ("data.seed", "data.arithmetic.seed", "data.arithmetic.max_operand"):
        need(_get(c, name) >= 0, f"{name}={_get(c, name)} must be >= 0")
    for name in (
        "data.arithmetic.num_train",
        "data.arithmetic.num_val",
        "model.tiny.hidden_size",
        "model.tiny.intermediate_size",
        "model.tiny.num_layers",
        "model.tiny.num_heads",
        "model.tiny.num_kv_heads",
        "model.tiny.head_dim",
    ):
        need(_get(c, name) >= 1, f"{name}={_get(c, name)} must be >= 1")
    tiny = c.model.tiny
    if tiny.num_heads >= 1 and tiny.num_kv_heads >= 1:
        need(
            tiny.num_heads % tiny.num_kv_heads == 0,
            f"model.tiny.num_heads={tiny.num_heads} must be a multiple of "
            f"model.tiny.num_kv_heads={tiny.num_kv_heads} (grouped-query attention)",
        )
    if d.source == "jsonl":
        need(
            bool(d.path) and bool(d.val_path),
            "data.source='jsonl' needs data.path and data.val_path (raw GSM8K jsonl files)",
        )
    if c.model.source == "hf" or c.model.tokenizer == "hf":
        need(
            bool(c.model.path),
            "model.path is required with model.source='hf' or "
            "model.tokenizer='hf' (an HF checkpoint dir or hub id)",
        )
    if r.name == "vllm":
        try:
            _vllm_config(c)
        except ValueError as e:
            errors.append(f"rollout.vllm: {e}")
    specs = [s.strip() for s in c.reward.fn.split(",") if s.strip()]
    need(bool(specs), "reward.fn is empty: give at least one 'module:function'")
    for spec in specs:
        try:
            rewards.load_function(spec)
        except ValueError as e:
            errors.append(f"reward.fn: {e}")
    if c.reward.weights.strip():
        try:
            weights = [float(w) for w in c.reward.weights.split(",")]
        except ValueError:
            errors.append(f"reward.weights={c.reward.weights!r} must be comma-separated floats")
        else:
            need(
                len(weights) == len(specs),
                f"reward.weights={c.reward.weights!r}: {len(weights)} weights for "
                f"{len(specs)} functions in reward.fn",
            )
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def _vllm_config(c):
    from grpo_jax import vllm_sidecar  # only the vllm path needs it

    v = dict(c.rollout.vllm)
    v["extra_args"] = tuple(shlex.split(v["extra_args"]))
    env = []
    for item in filter(None, (s.strip() for s in v["env"].split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"env entry {item!r} must be NAME=VALUE")
        env.append((name, value))
    v["env"] = tuple(env)
    return vllm_sidecar.VLLMConfig(**v)


def check_workdir(workdir: str) -> None:
    """Creates trainer.default_local_dir and proves it writable, before any heavy work."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"trainer.default_local_dir={workdir!r} is not writable ({e}); "
            "point it at a writable directory"
        ) from e


def check_mesh(c, dp: int) -> None:
    """Batch sizes that must split over the dp = data x fsdp devices of the mesh."""
    errors = []
    n = c.rollout.n
    mini = c.actor.ppo_mini_batch_size * n
    micro = c.actor.ppo_micro_batch_size_per_gpu * dp
    if mini % micro and micro % mini:
        errors.append(
            f"actor.ppo_micro_batch_size_per_gpu={c.actor.ppo_micro_batch_size_per_gpu}"
            f" x {dp} devices = {micro} must divide the mini-batch of "
            f"ppo_mini_batch_size x rollout.n = {mini} sequences"
        )
    lp = c.rollout.log_prob_micro_batch_size_per_gpu * dp
    batch = c.data.train_batch_size * n
    if batch % lp and lp % batch:
        errors.append(
            f"rollout.log_prob_micro_batch_size_per_gpu x {dp} devices = {lp} must "
            f"divide the batch of {batch} sequences"
        )
    for name in ("data.train_batch_size", "data.val_batch_size"):
        if _get(c, name) % dp:
            errors.append(f"{name}={_get(c, name)} must be a multiple of the {dp} data devices")
    if errors:
        raise ValueError("invalid config for the mesh:\n  " + "\n  ".join(errors))


# ------------------------------------------------------------------------------------------
# SETUP
# ------------------------------------------------------------------------------------------


def make_loss_config(c) -> trainer.LossConfig:
    """The `actor` section (+ rollout.temperature) as the update's static LossConfig."""
    a = c.actor
    return trainer.LossConfig(
        policy_loss_mode=a.policy_loss.loss_mode,
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio=a.clip_ratio,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff,
        calculate_entropy=a.calculate_entropy,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        loss_scale_factor=a.loss_scale_factor,
        temperature=c.rollout.temperature,
    )


def load_tokenizer(c):
    if c.model.tokenizer == "char":
        return demo_task.char_tokenizer()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(c.model.path)
    if tok.chat_template is None:
        raise ValueError(
            f"tokenizer of {c.model.path} has no chat template (verl's prompt needs one)"
        )
    return tok


def load_examples(c, split: str) -> list[data.Example]:
    d = c.data
    if d.source == "jsonl":
        return data.read_jsonl(
            d.path if split == "train" else d.val_path, on_malformed=d.on_malformed
        )
    if d.source == "tfds":
        return data.read_tfds(
            d.train_split if split == "train" else d.val_split, on_malformed=d.on_malformed
        )
    ar = d.arithmetic
    train_rows, val_rows = demo_task.arithmetic_rows(
        ar.num_train, ar.num_val, max_operand=ar.max_operand, modulus=ar.modulus, seed=ar.seed
    )
    rows = train_rows if split == "train" else val_rows
    return data.parse_rows(rows, source=f"arithmetic/{split}", on_malformed=d.on_malformed)


def encode_split(c, tokenizer, split: str) -> data.PromptSet:
    examples = load_examples(c, split)
    if split == "val" and c.data.val_max_samples > 0:
        examples = examples[: c.data.val_max_samples]
    return data.encode(
        tokenizer,
        examples,
        suffix=c.data.prompt_suffix,
        max_prompt_length=c.data.max_prompt_length,
        filter_overlong_prompts=c.data.filter_overlong_prompts,
        truncation=c.data.truncation,
    )


def load_model(c, tokenizer, mesh, rules):
    """(ModelConfig, params) placed in their shardings, from HF safetensors or random init."""
    dtype = jnp.dtype(c.model.dtype)
    param_dtype = jnp.dtype(c.model.param_dtype)
    if c.model.source == "hf":
        cfg, params = model_lib.load_hf_checkpoint(
            c.model.path, dtype=param_dtype, shardings=sharding.shard_fn(mesh, rules)
        )
        cfg = dataclasses.replace(cfg, dtype=dtype, remat=c.model.enable_gradient_checkpointing)
        if len(tokenizer) > cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens > model vocab {cfg.vocab_size}"
            )
        return cfg, params
    t = c.model.tiny
    cfg = model_lib.ModelConfig(
        arch="qwen2",
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=c.model.enable_gradient_checkpointing,
        max_position_embeddings=c.data.max_prompt_length + c.data.max_response_length + 64,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    params = sharding.init_sharded_params(cfg, mesh, jax.random.key(t.seed), rules)
    return cfg, params


def special_ids(tokenizer, cfg) -> tuple[tuple[int, ...], int]:
    """(EOS ids: the model's and the tokenizer's, pad id: the tokenizer's, else the first EOS)."""
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tokenizer.eos_token_id} - {None}))
    if not eos:
        raise ValueError("neither the model config nor the tokenizer defines an EOS token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return eos, pad


def to_device(x: np.ndarray, mesh) -> jax.Array:
    """Host array (the same on every process) -> global array, leading axis over the batch axes."""
    shd = sharding.batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, shd, lambda idx: x[idx])


def to_host(x: jax.Array) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@dataclasses.dataclass
class Run:
    """Everything main() sets up once; the loop functions below read it."""

    c: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    tokenizer: object
    model_config: model_lib.ModelConfig
    eos_ids: tuple[int, ...]
    pad_id: int
    reward_fn: rewards.RewardFn
    train_set: data.PromptSet
    val_set: data.PromptSet
    val_name: str
    sidecar: object  # vllm_sidecar.VLLMSidecar or None


def generate(run: Run, params, prompt_ids_PT, prompt_mask_PT, rng, *, n, temperature):
    """One rollout with the configured engine; returns the sampler.Rollout."""
    kw = dict(
        n=n,
        max_new_tokens=run.c.data.max_response_length,
        temperature=temperature,
        top_p=run.c.rollout.top_p if temperature > 0 else 1.0,
        top_k=run.c.rollout.top_k if temperature > 0 else -1,
        eos_token_ids=run.eos_ids,
        pad_token_id=run.pad_id,
    )
    if run.sidecar is None:
        ids, mask = to_device(prompt_ids_PT, run.mesh), to_device(prompt_mask_PT, run.mesh)
        return sampler.sample(run.model_config, params, ids, mask, rng, **kw)
    from grpo_jax import vllm_sidecar

    rollout = run.sidecar.sample(prompt_ids_PT, prompt_mask_PT, rng, **kw)
    vllm_sidecar.check_fresh(rollout, run.sidecar.weights_version)
    return rollout


def decode(tokenizer, response_ids_BT: np.ndarray, response_mask_BT: np.ndarray) -> list[str]:
    """Valid response tokens -> text (special tokens such as EOS skipped, as verl)."""
    lengths = response_mask_BT.sum(1)
    return tokenizer.batch_decode(
        [row[:n] for row, n in zip(response_ids_BT, lengths)], skip_special_tokens=True
    )


def evaluate(run: Run, params) -> dict[str, float]:
    """Greedy (val_kwargs) pass@1 over the validation prompts: val/<source>/acc."""
    c, vs = run.c, run.val_set
    n = c.rollout.val_kwargs.n
    bs = c.data.val_batch_size
    scores, lengths = [], []
    for start in range(0, len(vs), bs):
        idx = list(range(start, min(start + bs, len(vs))))
        real = len(idx)
        idx += [idx[-1]] * (bs - real)  # pad the last chunk: one compiled shape
        pb = data.make_batch(vs, idx, pad_token_id=run.pad_id)
        rollout = generate(
            run,
            params,
            pb.prompt_ids_PT,
            pb.prompt_mask_PT,
            jax.random.key(c.trainer.seed),
            n=n,
            temperature=c.rollout.val_kwargs.temperature,
        )
        ids, mask = (
            to_host(rollout.response_ids)[: real * n],
            to_host(rollout.response_mask)[: real * n],
        )
        texts = decode(run.tokenizer, ids, mask)
        res = rewards.score_batch(
            run.reward_fn, texts, np.repeat(pb.ground_truths[:real], n).tolist()
        )
        scores += res.scores_B
        lengths += mask.sum(1).tolist()
    return {
        f"val/{run.val_name}/acc": float(np.mean(scores)),
        "val/response_length/mean": float(np.mean(lengths)),
    }


def sft_batch(run: Run, indices) -> trainer.TrainBatch:
    """Prompt + reference answer (+ EOS) for the supervised warm-up, answers right-padded."""
    pb = data.make_batch(run.train_set, indices, pad_token_id=run.pad_id)
    r = run.c.data.max_response_length
    answers = [run.train_set.examples[i].answer for i in indices]
    ans_ids = run.tokenizer(answers, add_special_tokens=False)["input_ids"]
    resp_PT = np.full((len(indices), r), run.pad_id, np.int32)
    mask_PT = np.zeros((len(indices), r), np.int32)
    for p, ids in enumerate(ans_ids):
        ids = (list(ids) + [run.eos_ids[0]])[:r]
        resp_PT[p, : len(ids)] = ids
        mask_PT[p, : len(ids)] = 1
    arrays = dict(
        input_ids_BS=np.concatenate([pb.prompt_ids_PT, resp_PT], 1),
        attention_mask_BS=np.concatenate([pb.prompt_mask_PT, mask_PT], 1),
        response_ids_BT=resp_PT,
        response_mask_BT=mask_PT,
        advantages_BT=np.zeros(resp_PT.shape, np.float32),
    )
    return trainer.TrainBatch(**{k: to_device(v, run.mesh) for k, v in arrays.items()})


def _stats(prefix: str, x) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def _timed(timing: dict, key: str, fn, *args, **kw):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kw))
    timing[f"timing_s/{key}"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------
# MAIN
# ------------------------------------------------------------------------------------------


class _QuietLibraryInfo(logging.Filter):
    """Drops orbax's per-save INFO chatter from the terminal; warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().addFilter(_QuietLibraryInfo())
    c = _CONFIG.value
    if c is None:
        raise app.UsageError("--config is required, e.g. --config=configs/demo.py")
    check_config(c)
    if _PLAN.value:
        import plan

        print(plan.run(c, model_name=_PLAN_MODEL.value, hbm_gib=_PLAN_HBM.value))
        return
    distributed.maybe_initialize(mode=c.mesh.distributed)
    is_main = distributed.is_main_process()
    workdir = c.trainer.default_local_dir
    check_workdir(workdir)
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(c.to_json_best_effort(indent=2))

    mesh = sharding.make_mesh(tuple(c.mesh.shape))
    rules = sharding.rules_from_config(c.mesh.rules)
    # Every jitted function is traced inside the mesh and its logical-axis rules: model.py's
    # activation constraints act only there (without them FSDP leaves activations replicated).
    with sharding.use_mesh(mesh, rules):
        _train(c, mesh, rules, workdir, is_main)


def _train(c, mesh, rules, workdir, is_main):
    """The run proper (data, model, resume, loop, export), under `sharding.use_mesh`."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    check_mesh(c, dp)
    n = c.rollout.n
    a = c.actor

    # DATA, MODEL
    tokenizer = load_tokenizer(c)
    train_set, val_set = encode_split(c, tokenizer, "train"), encode_split(c, tokenizer, "val")
    steps_per_epoch = data.steps_per_epoch(len(train_set), c.data.train_batch_size)
    total_steps = c.trainer.total_training_steps or c.trainer.total_epochs * steps_per_epoch
    model_config, params = load_model(c, tokenizer, mesh, rules)
    eos_ids, pad_id = special_ids(tokenizer, model_config)
    reward_fn = rewards.make_reward_fn(c.reward.fn, c.reward.weights, on_error=c.reward.on_error)
    sidecar = None
    if c.rollout.name == "vllm":
        from grpo_jax import vllm_sidecar

        sidecar = vllm_sidecar.VLLMSidecar(
            _vllm_config(c), model_config, os.path.join(workdir, "vllm")
        )
    run = Run(
        c,
        mesh,
        tokenizer,
        model_config,
        eos_ids,
        pad_id,
        reward_fn,
        train_set,
        val_set,
        "arithmetic" if c.data.source == "arithmetic" else "gsm8k",
        sidecar,
    )
    logging.info(
        "model %s; %d train / %d val prompts (%d / %d filtered); %d steps",
        model_config,
        len(train_set),
        len(val_set),
        train_set.num_filtered,
        val_set.num_filtered,
        total_steps,
    )

    # OPTIMIZER, STATE
    loss_config = make_loss_config(c)
    tx = trainer.make_optimizer(
        grad_clip=a.grad_clip, betas=tuple(a.optim.betas), weight_decay=a.optim.weight_decay
    )
    warmup_steps = (
        a.optim.lr_warmup_steps
        if a.optim.lr_warmup_steps >= 0
        else int(a.optim.lr_warmup_steps_ratio * total_steps)
    )
    schedule = trainer.lr_schedule(
        lr=a.optim.lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        kind=a.optim.lr_scheduler_type,
        min_lr_ratio=a.optim.min_lr_ratio,
    )
    param_sh = sharding.param_shardings(model_config, mesh, rules)
    abstract_params = model_lib.abstract_params(model_config)
    state_sh = trainer.TrainState(
        sharding.replicated(mesh),
        param_sh,
        sharding.tx_state_shardings(tx, abstract_params, param_sh, mesh),
    )
    init_fn = jax.jit(functools.partial(trainer.init_state, tx=tx), out_shardings=state_sh)
    state = init_fn(params)  # a copy: `params` stays intact as the frozen reference
    needs_ref = a.use_kl_loss or c.algorithm.use_kl_in_reward
    ref_params = params if needs_ref else None
    ref_in_ckpt = needs_ref and c.warmup.steps > 0
    del params
    root_key = jax.random.key_data(jax.random.key(c.trainer.seed))

    mini_rows = a.ppo_mini_batch_size * n
    micro_rows = min(a.ppo_micro_batch_size_per_gpu * dp, mini_rows)
    step_fn = jax.jit(
        functools.partial(
            trainer.train_step,
            model_config=model_config,
            loss_config=loss_config,
            tx=tx,
            mini_batch_size=mini_rows,
            micro_batch_size=micro_rows,
        ),
        donate_argnums=0,
    )
    logp_fn = jax.jit(
        functools.partial(
            trainer.compute_log_probs,
            model_config,
            micro_batch_size=min(
                c.rollout.log_prob_micro_batch_size_per_gpu * dp, c.data.train_batch_size * n
            ),
            temperature=c.rollout.temperature,
            chunk_size=loss_config.chunk_size,
            calculate_entropy=False,
        )
    )
    adv_fn = jax.jit(
        functools.partial(
            advantage_lib.compute_grpo_outcome_advantage,
            norm_adv_by_std_in_grpo=c.algorithm.norm_adv_by_std_in_grpo,
        )
        if c.algorithm.adv_estimator == "grpo"
        else advantage_lib.compute_rloo_outcome_advantage,
        static_argnames="num_groups",
    )

    # RESUME
    mngr = checkpoint.manager(
        os.path.join(workdir, "checkpoints"), max_to_keep=c.checkpoint.max_to_keep
    )
    writer = metrics.Writer(workdir, tensorboard=c.trainer.tensorboard, enabled=is_main)
    position, start_step, consecutive_bad = data.Position(), 0, 0
    restored = None
    if c.trainer.resume_mode == "auto":
        # The reference is the policy after the warm-up; with a warm-up it is checkpointed too.
        tree, tree_sh = (
            {"train": state, "rng": root_key},
            {"train": state_sh, "rng": sharding.replicated(mesh)},
        )
        if ref_in_ckpt:
            tree["ref"], tree_sh["ref"] = ref_params, param_sh
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(lambda: tree),
            tree_sh,
        )
        restored = checkpoint.restore_latest(mngr, abstract)
    if restored is not None:
        start_step, tree, meta = restored
        state, root_key = tree["train"], tree["rng"]
        if ref_in_ckpt:
            ref_params = tree["ref"]
        position = data.Position(meta["data_epoch"], meta["data_index"])
        consecutive_bad = meta["consecutive_nonfinite"]
        writer.truncate_after(start_step)
        if start_step not in [r["step"] for r in metrics.read(workdir)]:
            writer.write(start_step, meta["metrics"])  # killed between the save and the row
        logging.info(
            "resumed from step %d (data epoch %d, index %d)",
            start_step,
            position.epoch,
            position.index,
        )
    warmup_record = {}
    if restored is None:
        writer.truncate_after(-1)
        if c.warmup.steps:
            state, warmup_record = warm_up(run, state, tx, micro_rows)
            if needs_ref:  # a copy: state.params is donated by every update
                ref_params = jax.tree.map(jnp.copy, state.params)

    def save(step, row):
        t0 = time.perf_counter()
        # `row` is the step's metrics row: a kill after the save but before writer.write would
        # otherwise lose it for good (the resumed run starts after this step).
        meta = {
            "step": step,
            "data_epoch": position.epoch,
            "data_index": position.index,
            "consecutive_nonfinite": consecutive_bad,
            "metrics": row,
        }
        tree = {"train": state, "rng": root_key} | ({"ref": ref_params} if ref_in_ckpt else {})
        checkpoint.save(mngr, step, tree, meta)
        return time.perf_counter() - t0

    if sidecar is not None:
        sidecar.start(state.params)  # weights in sync until the first update
    if start_step == 0 and c.trainer.val_before_train:
        warmup_record |= evaluate(run, state.params)
    if warmup_record:
        writer.write(0, warmup_record)

    # LOOP
    import tqdm

    bar = tqdm.tqdm(
        total=total_steps,
        initial=start_step,
        disable=not (is_main and c.trainer.progress_bar),
        desc="grpo",
        dynamic_ncols=True,
    )
    last_val = {}
    for step in range(start_step, total_steps):
        timing = {}
        t_step = time.perf_counter()
        idx, position = data.next_indices(
            len(train_set),
            position,
            c.data.train_batch_size,
            seed=c.data.seed,
            shuffle=c.data.shuffle,
        )
        pb = data.make_batch(train_set, idx, pad_token_id=pad_id)
        rng = jax.random.fold_in(jax.random.wrap_key_data(root_key), step)
        if sidecar is not None and step > start_step:  # params changed by the last update
            timing["timing_s/weight_sync"] = sidecar.push_weights(state.params)
        rollout = _timed(
            timing,
            "gen",
            generate,
            run,
            state.params,
            pb.prompt_ids_PT,
            pb.prompt_mask_PT,
            rng,
            n=n,
            temperature=c.rollout.temperature,
        )
        resp_ids, resp_mask = to_host(rollout.response_ids), to_host(rollout.response_mask)

        t0 = time.perf_counter()
        texts = decode(tokenizer, resp_ids, resp_mask)
        res = rewards.score_batch(reward_fn, texts, np.repeat(pb.ground_truths, n).tolist())
        timing["timing_s/reward"] = time.perf_counter() - t0

        batch, extra = build_batch(
            run,
            rollout,
            res.scores_B,
            state,
            ref_params,
            logp_fn,
            adv_fn,
            prompt_width=pb.prompt_ids_PT.shape[1],
            on_policy=(c.data.train_batch_size == a.ppo_mini_batch_size and a.ppo_epochs == 1),
            timing=timing,
        )
        lr = jnp.float32(schedule(step))
        t0 = time.perf_counter()
        updates = []
        for _ in range(a.ppo_epochs):
            for i in range(c.data.train_batch_size // a.ppo_mini_batch_size):
                state, m = step_fn(state, batch, jnp.int32(i), lr)
                updates.append(m)
        updates = jax.device_get(updates)
        timing["timing_s/update_actor"] = time.perf_counter() - t0
        skipped = sum(float(u["actor/update_skipped"]) for u in updates)
        consecutive_bad = consecutive_bad + 1 if skipped else 0
        if consecutive_bad >= c.trainer.max_consecutive_nonfinite:
            raise RuntimeError(
                f"{consecutive_bad} consecutive steps had non-finite losses or gradients (limit "
                f"trainer.max_consecutive_nonfinite={c.trainer.max_consecutive_nonfinite}); last "
                f"grad norms {[float(u['actor/grad_norm']) for u in updates]}"
            )

        record = {k: float(np.mean([u[k] for u in updates])) for k in updates[0]}
        record["actor/update_skipped"] = skipped
        record["actor/nonfinite_consecutive"] = consecutive_bad
        lengths = resp_mask.sum(1)
        prompt_lengths = np.repeat(pb.prompt_mask_PT.sum(1), n)
        record |= _stats("critic/score", res.scores_B) | extra
        record |= _stats("response_length", lengths) | _stats("prompt_length", prompt_lengths)
        record["response_length/clip_ratio"] = float(np.mean(lengths == c.data.max_response_length))
        record["reward/num_errors"] = res.num_errors
        for name, vals in res.per_fn.items():
            if len(res.per_fn) > 1:
                record[f"reward/{name}/mean"] = float(np.mean(vals))
        record["training/epoch"] = position.epoch
        done = step + 1
        if c.trainer.test_freq > 0 and done % c.trainer.test_freq == 0 or done == total_steps:
            last_val = _timed(timing, "testing", evaluate, run, state.params)
            record |= last_val
        num_tokens = int(lengths.sum() + prompt_lengths.sum())
        record["perf/total_num_tokens"] = num_tokens
        if c.trainer.save_freq > 0 and done % c.trainer.save_freq == 0 or done == total_steps:
            timing["timing_s/save_checkpoint"] = save(done, record | timing)
        timing["timing_s/step"] = time.perf_counter() - t_step
        record |= timing
        record["perf/throughput"] = num_tokens / timing["timing_s/step"] / jax.device_count()
        writer.write(done, record)
        bar.set_postfix(
            score=f"{record['critic/score/mean']:.3f}",
            **{k.split("/")[1]: f"{v:.3f}" for k, v in last_val.items() if k.endswith("acc")},
        )
        bar.update(1)
    bar.close()

    # EXPORT
    if sidecar is not None:
        sidecar.close()
    writer.close()
    if is_main:
        if c.checkpoint.export_hf:
            hf_dir = os.path.join(workdir, "hf")
            model_lib.save_hf_checkpoint(model_config, state.params, hf_dir)
            tokenizer.save_pretrained(hf_dir)
        plot.plot(workdir)
        final = {k: v for k, v in (metrics.read(workdir)[-1]).items() if k.startswith("val/")}
        logging.info("done: %s", json.dumps(final))
        print(json.dumps({"final": final, "workdir": workdir}))


def build_batch(
    run: Run,
    rollout,
    scores_B,
    state,
    ref_params,
    logp_fn,
    adv_fn,
    *,
    prompt_width,
    on_policy,
    timing,
):
    """Rewards -> advantages, plus old/ref log-probs: the TrainBatch and its extra metrics.

    The sampler's prompt columns are bucketed to its own multiple; the model input of the update
    keeps only the last bucket_length(prompt_width, data.prompt_length_bucket) of them (the
    dropped ones are all padding), so small prompts do not pay for the sampler's bucket.
    """
    c = run.c
    n = c.rollout.n
    resp_mask = rollout.response_mask
    width = min(
        rollout.prompt_ids.shape[1],
        sampler.bucket_length(prompt_width, c.data.prompt_length_bucket),
    )
    batch = trainer.TrainBatch(
        input_ids_BS=jnp.concatenate([rollout.prompt_ids[:, -width:], rollout.response_ids], 1),
        attention_mask_BS=jnp.concatenate([rollout.prompt_mask[:, -width:], resp_mask], 1),
        response_ids_BT=rollout.response_ids,
        response_mask_BT=resp_mask,
        advantages_BT=jnp.zeros(resp_mask.shape, jnp.float32),
    )
    extra = {}
    old_BT = ref_BT = None
    if not on_policy or c.algorithm.use_kl_in_reward:
        old_BT, _ = _timed(timing, "old_log_prob", logp_fn, state.params, batch)
    if ref_params is not None:
        ref_BT, _ = _timed(timing, "ref", logp_fn, ref_params, batch)
    # verl: the sequence score sits at the last valid response token of token_level_scores.
    length_B = jnp.sum(resp_mask, axis=1)
    last_BT = jax.nn.one_hot(jnp.maximum(length_B - 1, 0), resp_mask.shape[1], dtype=jnp.float32)
    scores = to_device(np.asarray(scores_B, np.float32), run.mesh)
    token_rewards_BT = scores[:, None] * last_BT
    if c.algorithm.use_kl_in_reward:
        beta = c.algorithm.kl_ctrl.kl_coef
        kld_BT = loss_lib.kl_penalty(old_BT, ref_BT, c.algorithm.kl_penalty) * resp_mask
        token_rewards_BT = token_rewards_BT - beta * kld_BT
        per_row = jnp.sum(kld_BT, 1) / jnp.maximum(length_B, 1)
        extra["actor/reward_kl_penalty"] = float(jnp.mean(per_row))
        extra["actor/reward_kl_penalty_coeff"] = beta
    t0 = time.perf_counter()
    adv_BT, _ = adv_fn(
        token_rewards_BT, resp_mask, rollout.group_ids, num_groups=resp_mask.shape[0] // n
    )
    timing["timing_s/adv"] = time.perf_counter() - t0
    valid = np.asarray(to_host(resp_mask), bool)
    adv_host = to_host(adv_BT)[valid]
    extra |= _stats("critic/advantages", adv_host)
    extra |= _stats("critic/rewards", to_host(jnp.sum(token_rewards_BT, 1)))
    batch = batch.replace(
        advantages_BT=adv_BT,
        old_log_probs_BT=None if on_policy else old_BT,
        ref_log_probs_BT=ref_BT,
    )
    return batch, extra


def warm_up(run: Run, state, tx, micro_rows):
    """Supervised warm-up on the reference answers (warmup.steps), then a fresh optimizer.

    Returns:
      (state, metrics): step 0 and a fresh optimizer state; the last warm-up NLL.
    """
    c = run.c
    bs = c.warmup.batch_size
    sft_fn = jax.jit(
        functools.partial(
            trainer.sft_step,
            model_config=run.model_config,
            tx=tx,
            micro_batch_size=min(micro_rows, bs),
        ),
        donate_argnums=0,
    )
    position = data.Position()
    nll = float("nan")
    for i in range(c.warmup.steps):
        idx, position = data.next_indices(
            len(run.train_set), position, bs, seed=c.data.seed + 1, shuffle=True
        )
        state, m = sft_fn(state, sft_batch(run, idx), jnp.float32(c.warmup.lr))
        nll = float(m["sft/nll"])
        if i % 10 == 0 or i == c.warmup.steps - 1:
            logging.info("warm-up step %d/%d: nll %.4f", i + 1, c.warmup.steps, nll)
    fresh = trainer.TrainState(jnp.zeros_like(state.step), state.params, tx.init(state.params))
    return fresh, {"warmup/nll": nll, "warmup/steps": c.warmup.steps}


def parse_flags(argv):
    """absl flag parsing that turns an unknown `--config.a.b` override into a clear error."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:
        key = str(e).strip("\"'")
        bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.") and key in a]
        raise SystemExit(
            f"unknown config field {key!r} in {bad or argv[1:]}: the config is locked, every "
            f"field is declared in configs/common.py (verl names; see README 'verl override "
            f"mapping')"
        ) from e


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
