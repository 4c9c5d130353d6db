"""Config files build, variants parse, and invalid values fail before any heavy work."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from configs import code as code_config  # noqa: E402
from configs import common, demo, gsm8k, gsm8k_dapo, gsm8k_drgrpo, gsm8k_lora  # noqa: E402
from configs import math as math_config  # noqa: E402
from grpo_jax import config, loss  # noqa: E402


def _set(c, dotted, value):
    section, _, leaf = dotted.rpartition(".")
    node = c
    for part in section.split("."):
        node = node[part]
    node[leaf] = value


def test_the_config_tree_is_the_dataclasses():
    """configs/common.py derives the tree from grpo_jax/config.py: same fields, same defaults."""
    tree = common.grpo_config()
    assert config.from_dict(config.RunConfig, tree.to_dict()) == config.RunConfig()
    assert config.to_dict(config.RunConfig()).keys() == tree.to_dict().keys()
    # A None default is a typed placeholder: the CLI still type-checks an override.
    with pytest.raises(TypeError):
        tree.model.path = 3


def test_gsm8k_lora_is_verls_grpo_lora_baseline():
    # verl-data gsm8k/Qwen2.5-0.5B-bsz64_2-prompt512-resp1024-lorarank32-score0.543.log
    run = train.check_config(gsm8k_lora.get_config("model=qwen2.5-0.5b"))
    m, a = run.model, run.actor
    assert (m.lora_rank, m.lora_alpha, m.target_modules) == (32, 32.0, "all-linear")
    assert (a.optim.lr, a.entropy_coeff, a.kl_loss_coef, a.kl_loss_type) == (
        3e-5, 0.001, 0.001, "low_var_kl",
    )  # fmt: skip
    assert (run.data.train_batch_size, a.ppo_mini_batch_size, run.rollout.n) == (64, 64, 5)
    assert run.trainer.total_epochs == 1
    smoke = train.check_config(gsm8k_lora.get_config("smoke"))
    assert smoke.model.source == "random" and 0 < smoke.model.lora_rank < 32


def test_gsm8k_has_verl_recipe_defaults():
    c = gsm8k.get_config()
    assert (c.rollout.n, c.actor.use_kl_loss, c.actor.kl_loss_coef) == (5, True, 0.001)
    assert (c.actor.kl_loss_type, c.actor.loss_agg_mode, c.actor.clip_ratio) == (
        "low_var_kl",
        "token-mean",
        0.2,
    )
    assert (c.actor.optim.lr, c.data.max_prompt_length, c.data.max_response_length) == (
        1e-6,
        512,
        1024,
    )
    assert c.data.prompt_suffix == (
        ' Let\'s think step by step and output the final answer after "####".'
    )


def test_variants():
    assert gsm8k.get_config("model=qwen2.5-0.5b").model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    smoke = gsm8k.get_config("smoke")
    assert (smoke.model.source, smoke.trainer.total_training_steps) == ("random", 2)
    with pytest.raises(ValueError, match=r"model must be one of .*qwen2.5-0.5b"):
        gsm8k.get_config("model=gpt5")
    with pytest.raises(ValueError, match=r"unknown config arg\(s\) \['bogus'\]"):
        gsm8k.get_config("bogus=1")
    dr = gsm8k_drgrpo.get_config()
    assert (dr.actor.loss_agg_mode, dr.actor.loss_scale_factor) == (
        "seq-mean-token-sum-norm",
        1024.0,
    )
    assert dr.algorithm.norm_adv_by_std_in_grpo is False and dr.actor.use_kl_loss is False


def test_parse_arg_big_vision_semantics():
    a = common.parse_arg("", model="", smoke=False)
    assert (a.model, a.smoke) == ("", False)
    # A bare word that is a key means key=True; otherwise it is the first key's value.
    assert common.parse_arg("smoke", model="", smoke=False).smoke is True
    assert common.parse_arg("qwen3-0.6b", model="", smoke=False).model == "qwen3-0.6b"
    b = common.parse_arg("steps=7,seed=3", steps=1, seed=0)
    assert (b.steps, b.seed) == (7, 3)
    with pytest.raises(ValueError, match="expected a bool"):
        common.parse_arg("smoke=maybe", smoke=False)


@pytest.mark.parametrize(
    "get",
    [
        gsm8k.get_config,
        gsm8k_drgrpo.get_config,
        gsm8k_dapo.get_config,
        gsm8k_lora.get_config,
        lambda: gsm8k_lora.get_config("smoke"),
        demo.get_config,
        lambda: demo.get_config("tiny"),
        math_config.get_config,
        code_config.get_config,
        lambda: code_config.get_config("tiny"),
    ],
)
def test_shipped_configs_validate(get):
    c = get()
    if c.model.source == "hf" and not c.model.path:
        c.model.path = "org/model"  # the only required field without a default (a hub id)
    run = train.check_config(c)
    assert isinstance(run, config.RunConfig)


def test_kv_cache_dtype_is_the_native_engines():
    # The vLLM server's cache dtype is its own engine argument; a value set here would be lost.
    with pytest.raises(config.ConfigError, match=r"kv_cache_dtype='bfloat16' is the native"):
        config.RolloutConfig(name="vllm", kv_cache_dtype="bfloat16")
    assert config.RolloutConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("rollout.n", 1, r"rollout.n=1 must be >= 2 for grpo"),
        ("rollout.temperature", 0.0, r"rollout.temperature=0.0 must be > 0"),
        ("rollout.top_p", 1.5, r"rollout.top_p=1.5 must be in \(0, 1\]"),
        ("rollout.val_kwargs.top_k", -3, r"rollout.val_kwargs.top_k=-3 must be -1 or 0"),
        ("actor.kl_loss_type", "full", r"actor.kl_loss_type='full': 'full' needs full reference"),
        ("actor.optim.lr", -1.0, r"actor.optim.lr=-1.0 must be finite and > 0"),
        (
            "actor.ppo_mini_batch_size",
            3,
            r"actor.ppo_mini_batch_size=3 must divide data.train_batch_size=16",
        ),
        (
            "actor.loss_agg_mode",
            "mean",
            r"actor.loss_agg_mode='mean' must be one of \['token-mean', 'token-sum'",
        ),
        ("actor.kl_loss_type", "k4", r"actor.kl_loss_type='k4' must be one of \[.*'low_var_kl'"),
        ("rollout.name", "sglang", r"rollout.name='sglang' must be one of \['jax', 'vllm'\]"),
        ("data.source", "csv", r"data.source='csv' must be one of \['files', 'jsonl', 'hf'"),
        (
            "data.truncation",
            "middle",
            r"data.truncation='middle' must be one of \['error', 'left', 'right'\]",
        ),
        (
            "algorithm.adv_estimator",
            "gae",
            r"algorithm.adv_estimator='gae' must be one of \['grpo', 'grpo_vectorized', ",
        ),
        (
            "reward.on_error",
            "ignore",
            r"reward.on_error='ignore' must be one of \['raise', 'zero'\]",
        ),
        (
            "reward.fn",
            "nope_module:f",
            r"reward.fn: reward function 'nope_module:f': cannot import",
        ),
        ("actor.clip_ratio_c", 1.0, r"actor.clip_ratio_c=1.0 must be > 1"),
        (
            "rollout.logprobs_mode",
            "logprobs",
            r"rollout.logprobs_mode='logprobs' must be one of \['processed_logprobs', 'raw_log",
        ),
        ("trainer.save_freq", 0, r"trainer.save_freq=0 must be -1 \(never\) or >= 1"),
        ("reward.timeout_s", 0.0, r"reward.timeout_s=0.0 must be > 0"),
        (
            "rollout.kv_cache_dtype",
            "fp8",
            r"rollout.kv_cache_dtype='fp8' must be one of \['auto', 'float32', 'bfloat16'",
        ),
    ],
)
def test_invalid_values_name_field_and_allowed(field, value, match):
    c = demo.get_config("tiny")
    _set(c, field, value)
    with pytest.raises(ValueError, match=match):
        train.check_config(c)


def test_logits_modes_refuse_rollout_correction():
    # The *_logits modes put logits where the rollout's log-probs go; verl would feed them to
    # the IS weights and rejection as log-probs. Here the combination is refused up front.
    rc = config.RolloutCorrectionConfig(rollout_is="token")
    config.RunConfig(rollout=config.RolloutConfig(logprobs_mode="raw_logprobs"),
                     algorithm=config.AlgorithmConfig(rollout_correction=rc))  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.logprobs_mode='processed_logits' makes the "
                       r"engine report logits, not log-probs"):  # fmt: skip
        config.RunConfig(rollout=config.RolloutConfig(logprobs_mode="processed_logits"),
                         algorithm=config.AlgorithmConfig(rollout_correction=rc))  # fmt: skip


def test_vllm_section_checked_up_front():
    c = demo.get_config("tiny")
    c.rollout.name = "vllm"  # neither rollout.vllm.python nor rollout.vllm.url is set
    with pytest.raises(ValueError, match=r"rollout.vllm: .*exactly one of python .* and url"):
        train.check_config(c)
    c.rollout.vllm.python = sys.executable
    c.rollout.vllm.env = "NOEQUALS"
    with pytest.raises(
        ValueError, match=r"rollout.vllm: env='NOEQUALS': entry 'NOEQUALS' must be NAME=VALUE"
    ):
        train.check_config(c)


def test_all_problems_reported_together():
    c = demo.get_config("tiny")
    c.data.truncation = "middle"
    c.rollout.name = "tpu"
    c.actor.optim.betas = (0.9, 1.5)
    with pytest.raises(config.ConfigError) as e:
        train.check_config(c)
    assert len(e.value.problems) == 3, e.value.problems
    for want in ("data.truncation='middle'", "rollout.name='tpu'", "actor.optim.betas=(0.9, 1.5)"):
        assert want in str(e.value)


def test_file_and_hf_sources_need_paths():
    c = gsm8k.get_config()
    c.data.source = "files"
    with pytest.raises(config.ConfigError) as e:
        train.check_config(c)
    assert "data.path=None is required with source='files'" in str(e.value)
    assert "data.val_path=None is required" in str(e.value)
    assert "model.path=None is required" in str(e.value)
    c.data.source = "hf"
    with pytest.raises(config.ConfigError, match="data.path=None must name the dataset"):
        train.check_config(c)


def test_mesh_divisibility():
    c = demo.get_config("tiny")  # 16 prompts x 8 samples; micro 128 per device
    train.check_config(c).check_mesh(1)
    c.actor.ppo_micro_batch_size_per_gpu = 48
    with pytest.raises(
        ValueError,
        match=r"48 x 2 devices = 96 must divide the mini-batch of "
        r"ppo_mini_batch_size x rollout.n = 128",
    ):
        train.check_config(c).check_mesh(2)
    with pytest.raises(ValueError, match=r"train_batch_size=16 must be a multiple of the 3"):
        train.check_config(demo.get_config("tiny")).check_mesh(3)


def test_unknown_field_rejected_by_the_cli():
    # lock_config=True: a typo'd override is an error naming the field, before any work.
    out = subprocess.run(
        [sys.executable, "train.py", "--config=configs/demo.py:tiny", "--config.actor.kl_coef=0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode != 0
    assert "unknown config field actor.kl_coef (" in out.stderr


def _loss_config(c):
    """The LossConfig the update trains with (RunConfig.loss_config), from a config file."""
    return config.from_dict(config.RunConfig, c.to_dict()).loss_config()


def test_loss_config_is_the_one_the_update_trains_with():
    lc = _loss_config(gsm8k_drgrpo.get_config())
    assert (lc.loss_agg_mode, lc.loss_scale_factor, lc.use_kl_loss) == (
        "seq-mean-token-sum-norm",
        1024.0,
        False,
    )
    lc = _loss_config(gsm8k.get_config())
    assert (lc.kl_loss_type, lc.kl_loss_coef, lc.clip_ratio, lc.temperature) == (
        "low_var_kl",
        0.001,
        0.2,
        1.0,
    )
    # verl's ActorConfig sets both clip bounds to 0.2: clip_ratio alone changes neither.
    c = gsm8k.get_config()
    c.actor.clip_ratio = 0.28
    lc = _loss_config(c)
    assert (lc.clip_ratio_low, lc.clip_ratio_high) == (0.2, 0.2)
    # What other sections add, which the actor section alone cannot: the bypass loss's
    # rollout-correction settings, and the update's entropy when no old-log-prob pass runs.
    c = gsm8k.get_config()
    c.actor.policy_loss.loss_mode = "bypass_mode"
    c.algorithm.rollout_correction.bypass_mode = True
    c.algorithm.rollout_correction.loss_type = "reinforce"
    run = config.from_dict(config.RunConfig, c.to_dict())
    settings = dict(dict(run.loss_config().policy_loss_kwargs)["rollout_correction"])
    assert settings["loss_type"] == "reinforce"
    assert run.loss_config().calculate_entropy == (not run.needs_old_log_probs or
                                                  run.actor.calculate_entropy)  # fmt: skip


@pytest.mark.parametrize(
    "low, high, want",
    [
        # One token per advantage sign, old log-prob 0, clip_ratio = 0.1:
        #   A = +1, r = 1.15: the high side clips at 1 + eps_high, L = -min(r, 1 + eps_high);
        #   A = -1, r = 0.85: the low side clips at 1 - eps_low, L = max(r, 1 - eps_low)
        #   (the dual clip, 3, does not bind); token-mean of the two.
        (None, None, (-1.1 + 0.9) / 2),  # both null: both read clip_ratio 0.1
        (None, 0.2, (-1.15 + 0.9) / 2),  # low null -> 0.1; high 0.2 leaves r = 1.15 unclipped
        (0.2, None, (-1.1 + 0.85) / 2),  # high null -> 0.1; low 0.2 leaves r = 0.85 unclipped
    ],
)
def test_null_clip_ratio_low_high_fall_back_to_clip_ratio(low, high, want):
    # verl's YAML may set actor.clip_ratio_low / clip_ratio_high to null; every policy loss then
    # reads actor.clip_ratio (core_algos.compute_policy_loss_vanilla: `clip_ratio_low if not
    # None else clip_ratio`).
    c = gsm8k.get_config()
    c.actor.clip_ratio = 0.1
    c.actor.clip_ratio_low = low
    c.actor.clip_ratio_high = high
    lc = _loss_config(c)
    assert (lc.clip_ratio, lc.clip_ratio_low, lc.clip_ratio_high) == (0.1, low, high)
    lp = np.log(np.array([[1.15, 0.85]], np.float32))
    value, _ = loss.actor_loss(
        np.zeros_like(lp),
        lp,
        np.array([[1.0, -1.0]], np.float32),
        np.ones_like(lp),
        policy_loss_mode=lc.policy_loss_mode,
        loss_agg_mode=lc.loss_agg_mode,
        clip_ratio=lc.clip_ratio,
        clip_ratio_low=lc.clip_ratio_low,
        clip_ratio_high=lc.clip_ratio_high,
        clip_ratio_c=lc.clip_ratio_c,
    )
    np.testing.assert_allclose(float(value), want, rtol=1e-6)


def test_library_defaults_are_verls():
    run = config.RunConfig()
    assert (run.actor.clip_ratio_low, run.actor.clip_ratio_high, run.actor.clip_ratio_c) == (
        0.2,
        0.2,
        3.0,
    )
    assert (run.trainer.save_freq, run.trainer.test_freq, run.actor.calculate_entropy) == (
        -1,
        -1,
        False,
    )
    assert (run.data.max_prompt_length, run.data.max_response_length) == (512, 512)
    # lr_warmup_steps <= 0 falls back to the ratio, as verl.
    optim = config.OptimConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.1)
    assert (
        optim.warmup_steps(50) == 5 and config.OptimConfig(lr_warmup_steps=3).warmup_steps(50) == 3
    )


def _parse_cli(*overrides, config_file="configs/gsm8k.py:smoke"):
    """The config train.py would get from these command-line overrides (absl + ml_collections,
    in-process, with train.py's locked config flag)."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["train.py", f"--config={config_file}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                    sys_argv=argv)  # fmt: skip
    fv(argv)
    return fv.config


def test_chat_template_kwargs_from_the_command_line(tmp_path):
    # verl's data.apply_chat_template_kwargs: {} by default; a Python dict literal overrides it
    # whole, and a key that the config file sets can be overridden alone.
    assert train.check_config(_parse_cli()).data.apply_chat_template_kwargs == {}
    c = _parse_cli("--config.data.apply_chat_template_kwargs={'enable_thinking': False}")
    assert train.check_config(c).data.apply_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(AttributeError, match="enable_thinking"):  # not declared: the dict form
        _parse_cli("--config.data.apply_chat_template_kwargs.enable_thinking=False")
    qwen3 = tmp_path / "qwen3_cfg.py"
    qwen3.write_text(
        "from configs import gsm8k\n\n\ndef get_config(arg=None):\n"
        "    c = gsm8k.get_config('smoke')\n"
        "    c.data.apply_chat_template_kwargs.enable_thinking = False\n"
        "    return c\n"
    )
    c = _parse_cli(config_file=str(qwen3))
    assert train.check_config(c).data.apply_chat_template_kwargs == {"enable_thinking": False}
    c = _parse_cli("--config.data.apply_chat_template_kwargs.enable_thinking=True",
                   config_file=str(qwen3))  # fmt: skip
    assert train.check_config(c).data.apply_chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokenize": True}, r"data.apply_chat_template_kwargs=\{'tokenize': True\}: \['tokeni"),
        ({"add_generation_prompt": False}, r"\['add_generation_prompt'\] cannot be given"),
    ],
)
def test_chat_template_kwargs_refuses_what_tokenisation_sets(kwargs, match):
    c = gsm8k.get_config("smoke")
    c.data.apply_chat_template_kwargs = kwargs
    with pytest.raises(config.ConfigError, match=match):
        train.check_config(c)
    with pytest.raises(config.ConfigError, match=r"data.apply_chat_template_kwargs='on' must be "
                       r"a dict"):  # fmt: skip
        config.DataConfig(apply_chat_template_kwargs="on")


def test_max_samples_fields():
    # verl: -1 = all; a cap must be positive.
    assert (config.DataConfig().train_max_samples, config.DataConfig().val_max_samples) == (-1, -1)
    c = gsm8k.get_config("smoke")
    c.data.train_max_samples = 0
    with pytest.raises(config.ConfigError, match=r"data.train_max_samples=0 must be -1 \(all\)"):
        train.check_config(c)
    c.data.train_max_samples = 8
    assert train.check_config(c).data.train_max_samples == 8


def test_log_prob_packing_follows_the_actor_unless_set():
    # verl: rollout.log_prob_use_dynamic_bsz = ${oc.select:actor...use_dynamic_bsz,false} and
    # log_prob_max_token_len_per_gpu = ${oc.select:actor...ppo_max_token_len_per_gpu,16384}.
    run = config.RunConfig()
    assert (run.log_prob_use_dynamic_bsz, run.log_prob_max_token_len_per_gpu) == (False, 16384)
    packed = config.ActorConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=3000)
    run = config.RunConfig(actor=packed)
    assert (run.log_prob_use_dynamic_bsz, run.log_prob_max_token_len_per_gpu) == (True, 3000)
    own = config.RolloutConfig(log_prob_use_dynamic_bsz=False, log_prob_max_token_len_per_gpu=500)
    run = config.RunConfig(actor=packed, rollout=own)
    assert (run.log_prob_use_dynamic_bsz, run.log_prob_max_token_len_per_gpu) == (False, 500)
    # Through the command line: the actor's override carries over, an explicit False stays.
    c = _parse_cli("--config.actor.use_dynamic_bsz=True",
                   "--config.actor.ppo_max_token_len_per_gpu=1024")  # fmt: skip
    c.rollout.log_prob_use_dynamic_bsz = None  # the smoke variant's own value, unset
    c.rollout.log_prob_max_token_len_per_gpu = None
    run = train.check_config(c)
    assert (run.log_prob_use_dynamic_bsz, run.log_prob_max_token_len_per_gpu) == (True, 1024)
    c = _parse_cli("--config.actor.use_dynamic_bsz=True",
                   "--config.rollout.log_prob_use_dynamic_bsz=False")  # fmt: skip
    assert train.check_config(c).log_prob_use_dynamic_bsz is False
    # The gsm8k recipe sets only the actor's, as verl's scripts do.
    run = train.check_config(gsm8k.get_config("model=qwen2.5-0.5b"))
    assert (run.log_prob_use_dynamic_bsz, run.log_prob_max_token_len_per_gpu) == (True, 24000)
    with pytest.raises(config.ConfigError, match=r"rollout.log_prob_max_token_len_per_gpu=0 must"):
        config.RolloutConfig(log_prob_max_token_len_per_gpu=0)


def test_val_only_and_dump_dirs_and_actor_shuffle_defaults():
    t, a = config.TrainerConfig(), config.ActorConfig()
    assert (t.val_only, t.rollout_data_dir, t.validation_data_dir) == (False, None, None)
    assert (a.shuffle, a.data_loader_seed) == (False, 42)  # verl's actor.yaml
    c = _parse_cli(
        "--config.trainer.val_only=True",
        "--config.trainer.val_before_train=False",
        "--config.trainer.rollout_data_dir=/tmp/r",
        "--config.actor.shuffle=True",
    )
    with pytest.raises(config.ConfigError, match=r"trainer.val_only=True needs "
                       r"trainer.val_before_train=True"):  # fmt: skip
        train.check_config(c)
    c.trainer.val_before_train = True
    run = train.check_config(c)
    assert (run.trainer.val_only, run.trainer.rollout_data_dir, run.actor.shuffle) == (
        True, "/tmp/r", True)  # fmt: skip
