"""What a config names, loaded: the model and tokenizer (`config.ModelSpec`: an HF checkpoint, a
GGUF file or a random model), the prompts (`config.DataConfig`) and the reward
(`config.RewardConfig`).

Used by train.py and the loop, and by library users who want the same loading: `tokenizer(spec)`,
then `model(spec, tokenizer, mesh, rules)`, which places every parameter in its sharding as it is
read (grpo_jax.model.load); `special_ids` for the EOS and pad ids both engines use;
`examples(data, "train")` for a split's prompts; `reward_fn(reward, custom)` for the scorer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax import registry, sharding
from grpo_jax.data import demo_task, prompts, readers
from grpo_jax.errors import InputError
from grpo_jax.models import hf as hf_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import genrm, sandbox_fusion, scorers
from grpo_jax.rewards import reward_model as reward_model_lib
from grpo_jax.rollout import engines


def looks_like_hub_id(path: str) -> bool:
    """'name' or 'org/name' as the Hugging Face hub spells repo ids; a path that starts with
    '/', '.' or '~', has more than one '/', or names a .gguf file is a local path."""
    if path.startswith(("/", ".", "~")) or path.lower().endswith(".gguf"):
        return False
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) is not None


def check_model_path(spec: config_lib.ModelSpec) -> None:
    """model.path names something that exists here, or a hub id (fetched on first use)."""
    if spec.path and not os.path.exists(spec.path) and not looks_like_hub_id(spec.path):
        raise InputError(
            f"model.path={spec.path!r} does not exist: give an HF checkpoint directory or a "
            ".gguf file (a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct' is fetched, which needs "
            "network access)"
        )


def tokenizer(spec: config_lib.ModelSpec):
    """The tokenizer: built-in characters, the GGUF file's own, or AutoTokenizer(model.path)."""
    spec.check_source()
    if spec.tokenizer == "char":
        return demo_task.char_tokenizer()
    check_model_path(spec)
    if spec.path.endswith(".gguf"):
        from grpo_jax.models import gguf

        return gguf.load_tokenizer(spec.path)
    import transformers

    with _hub_errors(spec.path):
        return transformers.AutoTokenizer.from_pretrained(spec.path)


@contextlib.contextmanager
def _hub_errors(path: str):
    """An OSError reading or fetching model.path (transformers', the GGUF reader's), as the
    field's error."""
    try:
        yield
    except OSError as e:
        if os.path.exists(path):
            where = "a local checkpoint"
        else:
            where = "an HF hub id (fetching needs network access)"
        raise InputError(f"model.path={path!r}: cannot load it as {where}: {e}") from e


def model(
    spec: config_lib.ModelSpec, tok, mesh, rules, *, max_positions: int
) -> tuple[model_lib.ModelConfig, dict]:
    """(ModelConfig, params) placed in their shardings, from model.path or random (model.tiny).

    Args:
      spec: the model section.
      tok: the tokenizer (its vocabulary must fit the model's).
      mesh, rules: where the params go (sharding.shard_fn).
      max_positions: positions the random model must support (prompt + response + margin).
    """
    spec.check_source()
    dtype, param_dtype = jnp.dtype(spec.dtype), jnp.dtype(spec.param_dtype)
    if spec.source == "hf":
        check_model_path(spec)
        with _hub_errors(spec.path):
            cfg, params = model_lib.load(
                spec.path, dtype=param_dtype, shardings=sharding.shard_fn(mesh, rules)
            )
        cfg = dataclasses.replace(
            cfg,
            dtype=dtype,
            remat=spec.enable_gradient_checkpointing,
            remat_policy=spec.gradient_checkpointing_policy,
            attention_impl=spec.attention_impl,
        )
        if len(tok) > cfg.vocab_size:
            raise InputError(
                f"the tokenizer of model.path={spec.path!r} has {len(tok)} tokens, more than the "
                f"model's vocabulary of {cfg.vocab_size}"
            )
        return cfg, params
    t = spec.tiny
    # Qwen3-MoE layers (Qwen3's attention) with model.tiny.num_experts, else Qwen2's dense ones
    arch = {"arch": "qwen2"}
    if t.num_experts:
        arch = dict(arch="qwen3_moe", qkv_bias=False, qk_norm=True, num_experts=t.num_experts,
                    num_experts_per_tok=t.num_experts_per_tok, norm_topk_prob=True,
                    moe_intermediate_size=t.moe_intermediate_size)  # fmt: skip
    cfg = model_lib.ModelConfig(
        **arch,
        vocab_size=len(tok),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=spec.enable_gradient_checkpointing,
        remat_policy=spec.gradient_checkpointing_policy,
        attention_impl=spec.attention_impl,
        max_position_embeddings=max_positions,
        eos_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
    )
    return cfg, sharding.init_sharded_params(cfg, mesh, jax.random.key(t.seed), rules)


def special_ids(tok, cfg: model_lib.ModelConfig) -> tuple[tuple[int, ...], int]:
    """(EOS ids: the model's and the tokenizer's, pad id: the tokenizer's, else the first EOS)."""
    eos = tuple(sorted(set(cfg.eos_token_ids) | {tok.eos_token_id} - {None}))
    if not eos:
        raise ValueError("neither the model config nor the tokenizer defines an EOS token")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return eos, pad


def layout(cfg: config_lib.DataConfig) -> readers.Layout:
    """Which columns of a row hold what (data.prompt_key, reward_fn_key, ground_truth_key)."""
    return readers.Layout(
        cfg.prompt_key, cfg.reward_fn_key, cfg.ground_truth_key, cfg.prompt_suffix
    )


def examples(cfg: config_lib.DataConfig, split: str) -> list[prompts.Example]:
    """The examples of `split` ("train" or "val") from the configured source, all of them
    (loop.train applies data.train_max_samples / val_max_samples)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    cfg.check_source()
    kw = {"on_malformed": cfg.on_malformed, "layout": layout(cfg)}
    hub_split = cfg.train_split if split == "train" else cfg.val_split
    if cfg.source in ("files", "jsonl"):
        field = "data.path" if split == "train" else "data.val_path"
        try:
            rows = readers.read_files(cfg.paths if split == "train" else cfg.val_paths, **kw)
        except InputError as e:
            raise InputError(f"{field}: {e}") from e
    elif cfg.source == "hf":
        rows = readers.read_hf(cfg.paths[0], split=hub_split, name=cfg.hf_name, **kw)
    elif cfg.source == "tfds":
        rows = readers.read_tfds(cfg.tfds_name, split=hub_split, data_dir=cfg.tfds_data_dir, **kw)
    else:
        ar = cfg.arithmetic
        train_rows, val_rows = demo_task.arithmetic_rows(
            ar.num_train,
            ar.num_val,
            max_operand=ar.max_operand,
            modulus=ar.modulus,
            seed=ar.seed,
            instruction=cfg.prompt_suffix,
        )
        raw = train_rows if split == "train" else val_rows
        rows = readers.parse_rows(raw, source=f"arithmetic/{split}", **kw)
    return rows  # data.*_max_samples caps them in loop.train, whatever their source


def reward_fn(
    cfg: config_lib.RewardConfig,
    custom: config_lib.CustomRewardFunction = config_lib.CustomRewardFunction(),
) -> reward_fns.RewardFn:
    """The run's reward: verl's custom_reward_function when its path is set, else reward.fn.

    With reward.sandbox_fusion.url set, `scorers.default_compute_score` in reward.fn gets
    verl's keywords (sandbox_fusion_url, concurrent_semaphore, memory_limit_mb), as verl binds
    them to its default scorer; a custom function does not (verl's neither).
    """
    sf = cfg.sandbox_fusion
    if custom.path:
        if sf.url is not None:
            raise ValueError(
                f"reward.sandbox_fusion.url={sf.url!r} only reaches "
                "grpo_jax.rewards.scorers:default_compute_score, not custom_reward_function "
                f"{custom.path}:{custom.name}; unset one of them"
            )
        return reward_fns.from_file(custom.path, custom.name, on_error=cfg.on_error)
    specs, weights = rule_specs(cfg)
    if not specs:  # reward.fn lists only the reward model
        return reward_fns.RewardFn.of(reward_model_lib.no_rules, on_error=cfg.on_error)
    reward = reward_fns.make_reward_fn(",".join(specs), ",".join(map(str, weights)),
                                       on_error=cfg.on_error)  # fmt: skip
    if sf.url is None:
        return reward
    if scorers.default_compute_score not in reward.fns:
        raise ValueError(
            f"reward.sandbox_fusion.url={sf.url!r} only reaches "
            f"grpo_jax.rewards.scorers:default_compute_score, which reward.fn={cfg.fn!r} does "
            "not include"
        )
    # verl's semaphore is shared by all its reward workers; each of ours takes its share.
    workers = max(cfg.num_workers, 1)
    limit = sandbox_fusion.RequestLimit(-(-sf.max_concurrent // workers))
    bound = functools.partial(
        scorers.default_compute_score,
        sandbox_fusion_url=sf.url,
        concurrent_semaphore=limit,
        memory_limit_mb=sf.memory_limit_mb,
    )
    fns = tuple(bound if fn is scorers.default_compute_score else fn for fn in reward.fns)
    return dataclasses.replace(reward, fns=fns)


def rule_specs(cfg: config_lib.RewardConfig) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """reward.fn's functions and weights without the reward model's entry."""
    pairs = [(s, w) for s, w in zip(cfg.specs, cfg.weight_values, strict=True)
             if s != config_lib.REWARD_MODEL_SPEC]  # fmt: skip
    return tuple(s for s, _ in pairs), tuple(w for _, w in pairs)


def reward_model(
    run: config_lib.RunConfig, policy_tokenizer, mesh, rules
) -> reward_model_lib.RewardModel | genrm.Judge | None:
    """The reward_model section loaded on the trainer's mesh (None unless enabled): the
    classifier placed in its shardings, its tokenizer, and its place in the sequence reward;
    with reward_model.genrm.enable a judge (`judge`) instead."""
    cfg = run.reward_model
    if not cfg.enable:
        return None
    path = cfg.model.path
    if not os.path.isdir(path) and not looks_like_hub_id(path):
        raise InputError(
            f"reward_model.model.path={path!r} does not exist: give a local HF checkpoint "
            "directory (or a hub id, fetched): a *ForSequenceClassification model, or a "
            "*ForCausalLM judge with reward_model.genrm.enable=True"
        )
    if cfg.genrm.enable:
        return judge(run, mesh, rules)
    import transformers

    try:
        rm_config, params, score_DL = hf_lib.load_hf_sequence_classifier(
            path, dtype=jnp.dtype(run.model.param_dtype), shardings=sharding.shard_fn(mesh, rules)
        )
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        hint = " (a causal LM judge? set reward_model.genrm.enable=True)" if "not one of" in str(
            e) else ""  # fmt: skip
        raise InputError(f"reward_model.model.path={path!r}: {e}{hint}") from e
    rm_config = dataclasses.replace(rm_config, dtype=jnp.dtype(run.model.dtype))
    dp = mesh.shape["data"] * mesh.shape["fsdp"]  # the batch axes (sharding.BATCH_AXES)
    return reward_model_lib.RewardModel(
        config=rm_config,
        params=params,
        score_DL=jax.device_put(score_DL, sharding.replicated(mesh)),
        tokenizer=tok,
        same_ids=tok.get_vocab() == policy_tokenizer.get_vocab(),
        mesh=mesh,
        rules=rules,
        micro_rows=cfg.micro_batch_size_per_gpu * dp,
        max_length=cfg.max_length,
        **_reward_model_place(run),
    )


def _reward_model_place(run: config_lib.RunConfig) -> dict:
    """The reward model's weight in the sequence reward and whether rule functions join it."""
    specs = run.reward.specs
    in_fn = config_lib.REWARD_MODEL_SPEC in specs
    weight = run.reward.weight_values[specs.index(config_lib.REWARD_MODEL_SPEC)] if in_fn else 1.0
    return {"weight": weight, "with_rules": in_fn and bool(rule_specs(run.reward)[0])}


def judge(run: config_lib.RunConfig, mesh, rules) -> genrm.Judge:
    """The generative judge of reward_model.genrm.enable: the causal LM at
    reward_model.model.path loaded like the policy (grpo_jax.model.load) on the trainer's mesh,
    its tokenizer, and a native rollout engine of its own sampling with reward_model.rollout."""
    cfg, path = run.reward_model, run.reward_model.model.path
    import transformers

    try:
        judge_config, params = model_lib.load(
            path, dtype=jnp.dtype(run.model.param_dtype), shardings=sharding.shard_fn(mesh, rules)
        )
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise InputError(
            f"reward_model.model.path={path!r} (reward_model.genrm.enable: a *ForCausalLM "
            f"judge): {e}"
        ) from e
    if tok.chat_template is None:
        raise InputError(
            f"reward_model.model.path={path!r}: the judge's tokenizer has no chat template (its "
            "prompt is a chat message, as verl sends it)"
        )
    judge_config = dataclasses.replace(judge_config, dtype=jnp.dtype(run.model.dtype))
    parse = (
        genrm.parse_verdict
        if not cfg.genrm.parser
        else registry.import_callable(cfg.genrm.parser, what="reward_model.genrm.parser")
    )
    eos_ids, pad_id = special_ids(tok, judge_config)
    r = cfg.rollout
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    return genrm.Judge(
        config=judge_config,
        params=params,
        tokenizer=tok,
        engine=engines.NativeEngine(judge_config, mesh, eos_ids=eos_ids, pad_id=pad_id,
                                    rules=rules),  # fmt: skip
        sampling=engines.SamplingParams(
            1, r.response_length, r.effective_temperature, r.top_p, r.top_k
        ),
        template=cfg.genrm.prompt_template,
        problem_key=cfg.genrm.problem_key,
        parse=parse,
        unparsable_score=cfg.genrm.unparsable_score,
        prompt_length=r.prompt_length,
        micro_rows=cfg.micro_batch_size_per_gpu * dp,
        **_reward_model_place(run),
    )
