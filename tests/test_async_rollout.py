"""Asynchronous rollouts (trainer.async_rollout, grpo_jax/rollout/async_rollout.py): the next batch is
sampled by the engine's own copy of the params while the trainer updates, one step off-policy,
never across a checkpoint. Exact resume under SIGKILL is in tests/test_faults.py; the vLLM
sidecar in async mode is in tests/test_vllm.py."""

import threading
import time

import jax
import numpy as np
import pytest

from grpo_jax import config, loading, sharding
from grpo_jax.data import demo_task
from grpo_jax.rollout import async_rollout
from grpo_jax.trainer import loop, setup


def test_check_staleness_refuses_beyond_the_bound():
    assert async_rollout.check_staleness(3, 4, 1) == 1
    assert async_rollout.check_staleness(4, 4, 0) == 0
    with pytest.raises(async_rollout.StalenessError, match="staleness 2 .*max_staleness=1"):
        async_rollout.check_staleness(2, 4, 1)
    with pytest.raises(async_rollout.StalenessError, match="staleness -1"):
        async_rollout.check_staleness(5, 4, 1)


def test_ahead_runs_in_the_background_and_reraises():
    ahead = async_rollout.Ahead()
    started, release = threading.Event(), threading.Event()

    def slow(x):
        started.set()
        release.wait(10)
        return x * 2

    ahead.submit(slow, 21)
    assert started.wait(10) and ahead.pending  # running while this thread goes on
    with pytest.raises(RuntimeError, match="already in flight"):
        ahead.submit(slow, 1)
    release.set()
    assert ahead.take() == 42 and not ahead.pending
    ahead.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ahead.take()
    ahead.close()


def test_config_checks():
    with pytest.raises(config.ConfigError, match="max_staleness=0 must be >= 1 with async"):
        config.TrainerConfig(async_rollout=True, max_staleness=0)
    with pytest.raises(config.ConfigError, match="rollout.num_devices=2 gives the sampler"):
        config.RunConfig(rollout=config.RolloutConfig(num_devices=2))
    with pytest.raises(config.ConfigError, match="must divide data.train_batch_size=6"):
        config.RunConfig(rollout=config.RolloutConfig(num_devices=4),
                         data=config.DataConfig(train_batch_size=6, val_batch_size=8),
                         actor=config.ActorConfig(ppo_mini_batch_size=6),
                         trainer=config.TrainerConfig(async_rollout=True))
    with pytest.raises(config.ConfigError, match="num_devices=2 is for the native sampler"):
        config.RolloutConfig(name="vllm", num_devices=2)


def digit_reward(solution_str, ground_truth):
    del ground_truth
    return sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))


def _run(tmp_path, *, lr=1e-3, steps=4, devices=1, callbacks=(), lora_rank=0, **trainer_kw):
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:devices])
    trainer_kw = dict(total_training_steps=steps, save_freq=-1, test_freq=-1,
                      val_before_train=False, progress_bar=False, tensorboard=False,
                      default_local_dir=str(tmp_path)) | trainer_kw
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=8,
                                 optim=config.OptimConfig(lr=lr)),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=8),
        algorithm=config.AlgorithmConfig(rollout_correction=config.RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=2.0)),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(**trainer_kw),
        checkpoint=config.CheckpointConfig(export_hf=False, save_last=False),
        model=config.ModelSpec(source="random", tokenizer="char", path=None, lora_rank=lora_rank,
                               lora_alpha=2.0 * max(1, lora_rank)),
    )
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)
        rows, _ = demo_task.arithmetic_rows(64, 4, max_operand=20, seed=0)
        return loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                          train_data=rows, reward_fn=digit_reward, mesh=mesh,
                          callbacks=callbacks)


def _learning(row):
    return {k: v for k, v in row.items()
            if not k.startswith(("timing", "perf/", "actor/perf/", "async/"))
            and isinstance(v, float | int)}


def test_async_with_frozen_params_equals_sync(tmp_path):
    """With lr=1e-30 (updates below float32 resolution) the params never change, so a batch
    sampled a step early is the batch a synchronous run samples: every learning metric
    matches; only the staleness differs."""
    sync = _run(tmp_path / "sync", lr=1e-30, steps=3)
    asyn = _run(tmp_path / "async", lr=1e-30, steps=3, async_rollout=True)
    assert [r["async/staleness"] for r in asyn.history] == [0, 1, 1]
    for s, a in zip(sync.history, asyn.history, strict=True):
        np.testing.assert_allclose(list(_learning(a).values()), list(_learning(s).values()),
                                   rtol=1e-6, atol=1e-7)
        assert _learning(a).keys() == _learning(s).keys()


def test_async_batches_are_off_policy_and_corrected(tmp_path):
    """lr > 0: the batch of step t+1 comes from the params before update t, so its rollout
    log-probs differ from the old (current-policy) ones and rollout correction sees it, while a
    synchronous run's differ only by float noise."""
    sync = _run(tmp_path / "sync", steps=3)
    asyn = _run(tmp_path / "async", steps=3, async_rollout=True)
    noise = max(r["training/rollout_probs_diff_max"] for r in sync.history)
    assert noise < 1e-4
    assert asyn.history[0]["training/rollout_probs_diff_max"] < 1e-4  # sampled on-policy
    for r in asyn.history[1:]:
        assert r["async/staleness"] == 1 and r["async/policy_version_lag"] == 1
        assert r["training/rollout_probs_diff_max"] > 10 * noise
        assert "rollout_corr/rollout_is_mean" in r
    np.testing.assert_allclose(asyn.history[0]["critic/score/mean"],
                               sync.history[0]["critic/score/mean"], rtol=1e-6)


def test_sampling_overlaps_the_update(tmp_path, monkeypatch):
    """The next batch is sampled while the trainer computes log-probs and updates: the
    background sample runs during step 1's train stage."""
    from grpo_jax.rollout import engines
    from grpo_jax.trainer import train_stage

    events = []
    real_sample, real_update = engines.NativeEngine.sample, train_stage.train_stage

    def sample(self, *a, **kw):
        name = threading.current_thread().name
        events.append(("sample-start", name))
        out = jax.block_until_ready(real_sample(self, *a, **kw))
        time.sleep(0.5)
        events.append(("sample-end", name))
        return out

    def update(*a, **kw):
        events.append(("update-start", None))
        time.sleep(0.5)
        state, row = real_update(*a, **kw)
        out = jax.block_until_ready(state), row
        events.append(("update-end", None))
        return out

    monkeypatch.setattr(engines.NativeEngine, "sample", sample)
    monkeypatch.setattr(train_stage, "train_stage", update)
    _run(tmp_path, steps=2, async_rollout=True)
    assert events[0] == ("sample-start", "MainThread") and events[1][0] == "sample-end"
    background = [k for k, (what, who) in enumerate(events) if who and who != "MainThread"]
    start, end = background  # batch 2, sampled during step 1's update
    first_update = events.index(("update-start", None)), events.index(("update-end", None))
    assert start < first_update[1] and end > first_update[0], events


def test_no_batch_is_in_flight_at_a_checkpoint(tmp_path):
    """Steps that end with a checkpoint sample nothing ahead: the next step samples its batch
    with the saved params (staleness 0), as a resumed run would."""
    out = _run(tmp_path, steps=4, async_rollout=True, save_freq=2)
    assert [r["async/staleness"] for r in out.history] == [0, 1, 0, 1]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
def test_train_mesh_leaves_the_samplers_devices_out():
    """train.py and loop.train build the trainer's mesh without rollout.num_devices."""
    run = config.RunConfig(rollout=config.RolloutConfig(num_devices=2),
                           data=config.DataConfig(train_batch_size=4, val_batch_size=4),
                           actor=config.ActorConfig(ppo_mini_batch_size=4),
                           trainer=config.TrainerConfig(async_rollout=True))
    mesh = setup.train_mesh(run)
    n = len(jax.devices())
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[: n - 2]]
    assert [d.id for d in setup.rollout_mesh(run, mesh).devices.flat] == [
        d.id for d in jax.devices()[n - 2 :]]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
def test_split_mesh_samples_on_its_own_devices(tmp_path, monkeypatch):
    """rollout.num_devices: the sampler's copy of the params lives on devices the trainer's
    mesh does not use, and the batch moves to the trainer's mesh for the update."""
    from grpo_jax.rollout import engines

    seen = []
    real = engines.NativeEngine.sample

    def sample(self, *a, **kw):
        seen.append({d.id for d in self.mesh.devices.flat})
        seen.append({d.id for x in jax.tree.leaves(self.params) for d in x.devices()})
        return real(self, *a, **kw)

    monkeypatch.setattr(engines.NativeEngine, "sample", sample)
    tok = demo_task.char_tokenizer()
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4),
        rollout=config.RolloutConfig(n=4, num_devices=2, log_prob_micro_batch_size_per_gpu=8),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=3, async_rollout=True, test_freq=3,
                                     val_before_train=False, progress_bar=False,
                                     tensorboard=False, default_local_dir=str(tmp_path)),
        mesh=config.MeshConfig(shape=(-1, 1, 1)),
        checkpoint=config.CheckpointConfig(export_hf=False),
    )
    train_mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:2])
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    with sharding.use_mesh(train_mesh):
        model_config, params = loading.model(spec, tok, train_mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)
        rows, val = demo_task.arithmetic_rows(64, 4, max_operand=20, seed=0)
        out = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                         train_data=rows, val_data=val, reward_fn=digit_reward,
                         mesh=train_mesh)
    rollout_ids = {d.id for d in jax.devices()[2:4]}
    assert seen and all(s == rollout_ids for s in seen)
    assert [r["async/staleness"] for r in out.history] == [0, 1, 1]
    assert "val-core/arithmetic/acc/mean@1" in out.history[-1]
    assert {d.id for x in jax.tree.leaves(out.state.params) for d in x.devices()} == {0, 1}


def test_resume_of_an_async_run_is_exact(tmp_path):
    """A run stopped after a checkpoint and resumed equals the uninterrupted async run."""
    full = _run(tmp_path / "full", steps=4, async_rollout=True, save_freq=2)

    class Stop(Exception):
        pass

    def stop_after(step, row):
        if step == 3:  # mid-way between checkpoints, with batch 4 in flight
            raise Stop

    with pytest.raises(Stop):
        _run(tmp_path / "cut", steps=4, async_rollout=True, save_freq=2,
             callbacks=[stop_after])
    resumed = _run(tmp_path / "cut", steps=4, async_rollout=True, save_freq=2)
    assert [r["step"] for r in resumed.history] == [3, 4]
    for a, b in zip(resumed.history, full.history[2:], strict=True):
        assert _learning(a) == _learning(b)
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(full.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lora_async_samples_with_a_merged_copy(tmp_path, monkeypatch):
    """LoRA: the engine holds base + adapters merged (no adapters), the trainer's adapters
    train; the batch sampled ahead used the adapters of the step before."""
    from grpo_jax.models import lora
    from grpo_jax.rollout import engines

    held = []
    real = engines.NativeEngine._hold

    def hold(self, params, version):
        real(self, params, version)
        held.append((version, lora.split(self.params)[1] is None))

    monkeypatch.setattr(engines.NativeEngine, "_hold", hold)
    out = _run(tmp_path, steps=3, async_rollout=True, lora_rank=4)
    assert [v for v, _ in held] == [0, 1, 2] and all(merged for _, merged in held)
    assert [r["async/staleness"] for r in out.history] == [0, 1, 1]
    assert max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves(out.state.params)) > 0
