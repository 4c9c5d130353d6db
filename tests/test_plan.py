"""Tests for the memory planner (plan.py) on 8 fake CPU devices with the tiny model."""

import math

import jax
import jax.numpy as jnp
import pytest

import plan
from configs import gsm8k
from grpo_jax import model, sharding

# Tiny model (V=128, D=32, N=4, K=2, H=8, F=64, L=2, tied, qkv bias) on mesh (2,2,2): vocab,
# heads, kv_heads, mlp split 2 ways over tensor, embed 2 ways over fsdp. Elements per device:
#   embedding [128,32] -> 64*16 = 1024        input/post norms [2,32] -> 2 * 2*16 = 64
#   q [2,32,4,8] -> 2*16*2*8 = 512, bias [2,4,8] -> 32       o [2,4,8,32] -> 2*2*8*16 = 512
#   k, v [2,32,2,8] -> 2 * 256, biases [2,2,8] -> 2 * 16     gate, up, down -> 3 * 2*16*32 = 3072
#   final norm [32] -> 16
# total 1024+64+512+32+512+512+32+3072+16 = 5776 float32 = 23104 bytes.
TINY_PARAM_BYTES_222 = 23104


def _smoke_config(shape=(2, 2, 2)):
    """The smoke config with batch sizes that split over dp = 4: 8 prompts x n=2 = 16 rows,
    mini-batches of 4 prompts (8 rows), micro-batches of 1 row per device (4 rows)."""
    c = gsm8k.get_config("smoke")
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
    return plan.planner_from_config(c, model_name="tiny")


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
    best, seen = plan._largest([1, 2], lambda m: plan._fits(p.train(m), p.train_peak, budget))
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

    assert plan._largest([1, 2, 4, 8, 16, 32, 64], fits)[0] == 8
    assert len(calls) == 3  # log2(7) rounded up: 8, 32, 16
    assert plan._largest([2, 4], lambda c: (False, c))[0] is None


def test_sampler_memory_grows_with_prompts_and_kv_cache_is_analytic(planner_222):
    p = planner_222
    a, b = p.sample(4), p.sample(8)
    assert b.temp > a.temp
    # KV cache: 2 (k, v) x L=2 x rows/device x slots x K/tensor x H x 4 bytes, with
    # rows = 8 prompts * 2 / dp 4 = 4, slots = Tp 64 + T 8 - 1 = 71, K/tensor = 1, H = 8.
    assert p.kv_cache_bytes(8) == 2 * 2 * 4 * 71 * 1 * 8 * 4


def test_report_says_whether_it_fits(planner_222):
    p = planner_222
    fits = plan.plan(p, hbm_bytes=2**30, search=False)
    assert "FITS in 1.0 GiB" in fits and "DOES NOT FIT" not in fits
    peak = max(p.side_peak(p.sample(8)), p.side_peak(p.logprob()), p.train_peak(p.train(1)))
    assert f"step peak {peak / 2**30:.2f} GiB/device" in fits
    assert "DOES NOT FIT" in plan.plan(p, hbm_bytes=peak - 1, search=False)
    assert "FITS" in plan.plan(p, hbm_bytes=peak, search=False)


def test_presets_match_published_parameter_counts():
    # Qwen2.5-7B: embed + untied head 2*152064*3584; per layer q,o 2*3584^2 + k,v 2*3584*512 +
    # qkv bias 3584+2*512 + MLP 3*3584*18944 + 2 norms 2*3584; 28 layers; final norm 3584.
    def count(name):
        cfg = plan.preset_config(name, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
        return sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(cfg)))

    per_layer = 2 * 3584**2 + 2 * 3584 * 512 + 3584 + 2 * 512 + 3 * 3584 * 18944 + 2 * 3584
    assert count("qwen2.5-7b") == 2 * 152064 * 3584 + 28 * per_layer + 3584 == 7_615_616_512
    assert count("qwen2.5-0.5b") == 494_032_768  # the model card's 0.49B
    with pytest.raises(ValueError, match="unknown model preset"):
        plan.preset_config("gpt5", dtype=jnp.float32, param_dtype=jnp.float32, remat=False)


def test_missing_model_is_a_clear_error():
    c = _smoke_config()
    with pytest.raises(ValueError, match="give --model"):
        plan.planner_from_config(c)


def test_rules_override_reaches_the_planner():
    # config.mesh.rules replicating embed (no FSDP): every device holds the whole embed axis, so
    # all but the q/k/v biases double. The biases have no embed axis and are split 2 ways over
    # tensor: ([2,4,8] + 2 * [2,2,8]) / 2 = 64 floats = 256 bytes per device either way.
    c = _smoke_config()
    c.mesh.rules = tuple((k, None) if k == "embed" else (k, v) for k, v in sharding.LOGICAL_RULES)
    p = plan.planner_from_config(c, model_name="tiny")
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
    report = plan.plan(p, hbm_bytes=2**30, search=False)
    # full: opt 2 x 23104 + 4, ref 23104; LoRA: adapters 8192, opt 2 x 8192 + 4, ref 0
    saved = (2 * TINY_PARAM_BYTES_222 + 4 + TINY_PARAM_BYTES_222) - 3 * TINY_LORA4_BYTES_222 - 4
    assert p.lora_saved_bytes() == saved == 44736
    assert f"saves {saved / 2**30:.2f} GiB/device" in report
    assert "base params (frozen)" in report and "LoRA adapters (f32)" in report
    assert "LoRA r=4 alpha=16 on q_proj," in report
