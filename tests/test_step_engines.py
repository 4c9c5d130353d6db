"""Rollout engines refuse stale weights; verl's perf metrics (timing per token, global_seqlen,
memory, MFU from verl's FLOP estimate)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

from grpo_jax import sampler
from grpo_jax.rollout import engines, vllm_sidecar
from grpo_jax.trainer import perf


class FakeSidecar:
    """The VLLMSidecar surface SidecarEngine uses: versions bump on push; a restart from an
    older export can be simulated by lowering `server_weights_version`."""

    def __init__(self):
        self.weights_version = -1
        self.server_weights_version = -1

    def start(self, params):
        self.weights_version = self.server_weights_version = 0

    def push_weights(self, params):
        self.weights_version += 1
        self.server_weights_version = self.weights_version
        return 0.01

    def sample(self, prompt_ids, prompt_mask, rng, **kw):
        b = prompt_ids.shape[0] * kw["n"]
        zeros = jnp.zeros((b, kw["max_new_tokens"]), jnp.int32)
        return sampler.Rollout(
            jnp.repeat(prompt_ids, kw["n"], 0), jnp.repeat(prompt_mask, kw["n"], 0), zeros,
            zeros, zeros.astype(jnp.float32), jnp.repeat(jnp.arange(prompt_ids.shape[0]), kw["n"]),
            jnp.int32(self.server_weights_version),
        )


def _sample(engine, version):
    sp = engines.SamplingParams(2, 3, 1.0)
    ids, mask = np.ones((2, 4), np.int32), np.ones((2, 4), np.int32)
    return engine.sample(None, ids, mask, jax.random.key(0), sp, policy_version=version)


def test_sidecar_engine_refuses_rollouts_of_another_policy_version():
    engine = engines.SidecarEngine(FakeSidecar(), eos_ids=(1,), pad_id=0)
    engine.start(None, version=10)  # resumed at optimizer step 10
    _sample(engine, 10)
    # The trainer updated (step 10 -> 12) but nobody synced: the server still has version 10.
    with pytest.raises(vllm_sidecar.StaleRolloutError, match="policy version 10.*at version 12"):
        _sample(engine, 12)
    assert engine.sync(None, 12) == 0.01
    assert engine.sync(None, 12) is None  # already there: no second push
    _sample(engine, 12)
    # A server restarted from the start-up export serves the old weights again: refused.
    engine.sidecar.server_weights_version = 0
    with pytest.raises(vllm_sidecar.StaleRolloutError, match="version 10"):
        _sample(engine, 12)


def test_timing_per_token_is_verl_normalisation():
    timing = {"timing_s/gen": 2.0, "timing_s/update_actor": 3.0, "timing_s/ref": 1.0,
              "timing_s/reward": 9.0}
    got = perf.timing_per_token(timing, prompt_tokens=600, response_tokens=400)
    assert got == {"timing_per_token_ms/gen": 5.0, "timing_per_token_ms/update_actor": 3.0,
                   "timing_per_token_ms/ref": 1.0}


def test_global_seqlen_matches_verl_on_contiguous_partitions(verl):
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, 24).tolist()
    dp = 4
    parts = [list(range(r * 6, (r + 1) * 6)) for r in range(dp)]
    theirs = verl.run(
        reference.fn("verl.utils.seqlen_balancing:log_seqlen_unbalance")(
            seqlen_list=lengths, partitions=parts, prefix="global_seqlen"
        )
    ).value
    ours = perf.global_seqlen(lengths, dp)
    for key, value in ours.items():
        assert value == pytest.approx(float(theirs[key])), key


def test_estimate_flops_is_verls_formula(verl):
    """perf.estimate_flops equals verl 0.9.1's _estimate_qwen2_flops (x the seconds it divides
    by, and its 1e12), and by hand on a 1-layer model."""
    from grpo_jax import model

    config = model.ModelConfig.tiny(num_layers=3)
    lengths = [5, 17, 300, 64]
    hf = reference.fn("types:SimpleNamespace")(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        num_hidden_layers=config.num_layers, num_key_value_heads=config.num_kv_heads,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        head_dim=config.head_dim,
    )  # fmt: skip
    estimate = reference.fn("verl.utils.flops_counter:_estimate_qwen2_flops")
    theirs = verl.run(estimate(hf, sum(lengths), lengths, 2.0)).value
    assert perf.estimate_flops(config, lengths) == pytest.approx(float(theirs) * 2.0 * 1e12)
    # By hand: D=4, F=8, N=2, K=1, H=2, V=10, one layer, sequences of 1 and 3 tokens:
    # layer params 3*4*8 + 4*(2*4 + 2*2) = 144, dense 144 + 2*10*4 = 224, tokens 4;
    # attention 6 * (1 + 9) * H=2 * N=2 * L=1 = 240.
    one = model.ModelConfig.tiny(hidden_size=4, intermediate_size=8, num_heads=2,
                                 num_kv_heads=1, head_dim=2, vocab_size=10, num_layers=1)  # fmt: skip
    assert perf.estimate_flops(one, [1, 3]) == 6 * 224 * 4 + 240
    got = perf.mfu(2e12, 2.0, devices=2, peak_flops=1e12)
    assert got == {"perf/actor_tflops_per_device": 0.5, "perf/mfu/actor": 0.5}
    assert "perf/mfu/actor" not in perf.mfu(2e12, 2.0, devices=2, peak_flops=None)
    assert perf.peak_flops_per_device(0.18) == pytest.approx(0.18e12)


def test_compile_stats_count_new_programs_only(tmp_path):
    @jax.jit
    def fn(x):
        return jnp.sin(x) * 3.0 + 1.0

    before = perf.compile_stats()
    fn(np.ones((7, 5), np.float32)).block_until_ready()  # a shape no other test compiles
    compiled = perf.compile_stats()
    assert compiled.seconds > before.seconds and (compiled - before).programs == 1
    fn(np.zeros((7, 5), np.float32)).block_until_ready()  # the same program: no compile
    assert perf.compile_stats() == compiled
    assert (compiled - before).metrics() == {
        "perf/compiled_programs": 1, "perf/compile_cache_hits": 0
    }


def test_memory_metrics_report_process_peak():
    got = perf.memory()
    assert got["perf/cpu_memory_used_gb"] > 0.05  # this process holds jax at least
