"""verl's GRPO-path algorithms inside the loop: DAPO's dynamic sampling and overlong penalty,
rollout correction and bypass mode, remax / gdpo / a user estimator or loss named in the config,
and the adaptive KL controller (with exact resume). The maths of each piece is parity-tested
against verl in test_verl_parity.py; here the loop must feed it the right inputs."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import reference

from grpo_jax import advantage, config, distributed, loading, loss, sampler, sharding
from grpo_jax.data import demo_task
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.trainer import loop, programs, rollout_stage, train_stage

# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_filtered_groups_follow_verls_std_rule():
    """verl/trainer/ppo/v1/replay_buffer.py: ReplayBuffer._dapo_filtered_keys filters a group
    when `len(values) > 1 and float(np.std(values)) == 0.0`: exact equality, no tolerance."""
    f32 = float(np.float32(0.1))
    groups = [
        [1.0, 1.0, 1.0],  # filtered
        [1.0, 1.0 + 1e-9, 1.0],  # kept: any difference counts
        [0.0, 1.0, 0.0],  # kept
        [0.1, 0.1, 0.1],  # kept: the float64 mean of three 0.1s is not 0.1, so std is 1.4e-17
        [f32, f32, f32],  # filtered: a float32 value's mean of three is exact
        [1e6, 1e6 + 0.5, 1e6],  # kept
    ]
    got = rollout_stage.filtered_groups(np.array(groups))
    assert got.tolist() == [True, False, False, False, True, False]
    # a one-sample group is never filtered (len(values) > 1)
    assert rollout_stage.filtered_groups(np.array([[0.5], [1.0]])).tolist() == [False, False]


def test_overlong_penalty_is_verl_dapo_formula():
    lengths = np.array([0, 700, 768, 769, 900, 1024])
    got = rollout_stage.overlong_penalty(lengths, max_response_length=1024, buffer_len=256,
                                penalty_factor=0.5)
    # verl's DAPO reward manager: min(-(len - (max - buffer)) / buffer * factor, 0)
    want = [min(-(n - 768) / 256 * 0.5, 0) for n in lengths]
    np.testing.assert_allclose(got, want)
    assert got[-1] == -0.5 and got[2] == 0


def test_adaptive_kl_controller_is_verl_formula():
    ctrl = config.KLCtrlConfig(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000)
    beta = ctrl.kl_coef
    for kl, want_err in ((0.5, 0.2), (0.11, 0.1), (0.0, -0.2)):
        new = train_stage.next_kl_coef(ctrl, beta, kl, n_steps=64)
        np.testing.assert_allclose(new, beta * (1 + want_err * 64 / 1000), rtol=1e-12)
        beta = new
    fixed = dataclasses.replace(ctrl, type="fixed")
    assert train_stage.next_kl_coef(fixed, 0.05, 0.5, n_steps=64) == 0.05


def test_estimator_kwargs_follow_verl_trainer():
    def run(name, **alg):
        return config.RunConfig(algorithm=config.AlgorithmConfig(adv_estimator=name, **alg))

    assert programs.estimator_kwargs(run("grpo", norm_adv_by_std_in_grpo=False)) == {
        "norm_adv_by_std_in_grpo": False
    }
    assert programs.estimator_kwargs(run("grpo_passk")) == {"norm_adv_by_std_in_grpo": True}
    assert programs.estimator_kwargs(run("reinforce_plus_plus", gamma=0.9)) == {"gamma": 0.9}
    for name in ("rloo", "opo", "gpg", "gdpo", "grpo_vectorized", "rloo_vectorized"):
        assert programs.estimator_kwargs(run(name)) == {}


def test_make_advantage_returns_the_estimators_returns():
    """critic/returns logs the estimator's returns, not its advantages (they differ for
    reinforce_plus_plus: whitened returns vs discounted returns)."""
    run = config.RunConfig(
        algorithm=config.AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=1.0)
    )
    rewards_BT = jnp.array([[0, 1.0], [0, 0.0], [1.0, 0], [0, 2.0]])
    mask = jnp.ones((4, 2))
    adv, returns = programs.make_advantage(run)(rewards_BT, mask, jnp.array([0, 0, 1, 1]), {})
    want_adv, want_returns = advantage.compute_advantage(
        "reinforce_plus_plus", rewards_BT, mask, jnp.array([0, 0, 1, 1]), gamma=1.0
    )
    np.testing.assert_allclose(returns, want_returns, rtol=1e-6)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-6)
    assert not np.allclose(adv, returns)


# ---------------------------------------------------------------------------------------------
# DAPO's dynamic sampling (rollout_stage.dynamic_sample) against verl 0.9.1's Sync DAPO


class _DigitsTokenizer:
    """Decodes a response to "<prompt>:<sample>", its first two tokens."""

    def batch_decode(self, rows, skip_special_tokens):
        return [f"{int(r[0])}:{int(r[1])}" for r in rows]


def _dynamic_sample(monkeypatch, outputs, *, n, train_batch_size, lengths=None,
                    adv_estimator="grpo", **fg):  # fmt: skip
    """rollout_stage.dynamic_sample over a fake engine: the k-th prompt read is prompt k, its
    j-th sample has `lengths[k][j]` tokens (default 2) and the reward function returns
    `outputs[k][j]` (a float or a dict). Returns (batch, the counts asked of next_prompts)."""
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    max_len = 8

    def fake_generate(engine, params, prompts, rng, sp, *, policy_version=None):
        ids = np.zeros((len(prompts.indices) * sp.n, max_len), np.int32)
        mask = np.zeros_like(ids)
        for p, k in enumerate(prompts.indices):
            for j in range(sp.n):
                ids[p * sp.n + j, :2] = k, j
                mask[p * sp.n + j, : (lengths[k][j] if lengths else 2)] = 1
        put = functools.partial(distributed.to_device, mesh=mesh)
        return sampler.Rollout(
            put(np.repeat(prompts.prompt_ids_PT, sp.n, 0)),
            put(np.repeat(prompts.prompt_mask_PT, sp.n, 0)),
            put(ids), put(mask), put(np.zeros(ids.shape, np.float32)),
            put(np.repeat(np.arange(len(prompts.indices), dtype=np.int32), sp.n)),
            jnp.int32(0),
        )  # fmt: skip

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        k, j = map(int, solution_str.split(":"))
        return outputs[k][j]

    asked, read = [], [0]

    def next_prompts(count, pad_to=None):
        asked.append(count)
        idx = list(range(read[0], read[0] + count))
        read[0] += count
        idx += idx[-1:] * ((pad_to or count) - count)
        return prompts_lib.PromptBatch(
            np.ones((len(idx), 1), np.int32), np.ones((len(idx), 1), np.int32),
            tuple(prompts_lib.Example(prompt=str(k), ground_truth=k) for k in idx), tuple(idx),
        )  # fmt: skip

    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=train_batch_size, max_response_length=max_len),
        actor=config.ActorConfig(ppo_mini_batch_size=train_batch_size),
        rollout=config.RolloutConfig(n=n),
        algorithm=config.AlgorithmConfig(
            adv_estimator=adv_estimator, filter_groups=config.FilterGroupsConfig(enable=True, **fg)
        ),
        reward=config.RewardConfig(
            overlong_buffer=config.OverlongBufferConfig(enable=True, len=4, log=True)
        ),
    )
    ctx = types.SimpleNamespace(
        run=run, engine=None, tokenizer=_DigitsTokenizer(), mesh=mesh, pool=None, agent=None,
        reward_model=None,
        reward_fn=reward_fns.RewardFn.of(reward), programs=types.SimpleNamespace(dp=1),
    )  # fmt: skip
    monkeypatch.setattr(rollout_stage, "generate", fake_generate)
    batch = rollout_stage.dynamic_sample(ctx, None, next_prompts, jax.random.key(0), {})
    return batch, asked


def _kept(batch):
    return sorted({ex.ground_truth for ex in batch.examples})


# Group kinds of 3 samples: what verl's rule filters differs between "acc" (the plain float)
# and "reward" (rm_scores: float32) only for the 0.1s (test_filtered_groups_follow_verls_std_rule).
_KINDS = ([1.0] * 3, [0.0, 1.0, 0.0], [0.1] * 3, [0.0, 0.0, 1e-9], [0.5] * 3, [1.0, 0.0, 0.0],
          [0.0] * 3)  # fmt: skip


@pytest.mark.parametrize("metric", ["acc", "reward"])
@pytest.mark.parametrize("inflight", [1, 2])
def test_dapo_refills_as_verls_sync_replay_buffer(verl, monkeypatch, metric, inflight):
    """The prompts read per round, the kept groups and the training/filter_groups/* metrics
    of one step are those of verl's own ReplayBuffer.sample (tests/verl_replay.py) given the
    same metric values, every round finishing before the next poll."""
    # The first round: three uniform groups and the 0.1s; later rounds a fixed mix, so that
    # credits outrun the bound on prompts in flight and carry over (with inflight 1 and 2)
    kinds = [0, 4, 6, 2] + [(4 * k * k + 2) % 7 for k in range(4, 400)]
    outputs = [list(_KINDS[i]) for i in kinds]
    extra = {} if inflight == 1 else {"max_inflight_gen_batches": inflight}
    batch, asked = _dynamic_sample(monkeypatch, outputs, n=3, train_batch_size=4, metric=metric,
                                   **extra)  # fmt: skip
    ref = verl.run(reference.fn("verl_replay:sync_dapo_sample")(
        outputs, train_batch_size=4, max_inflight_gen_batches=inflight, metric=metric
    )).value  # fmt: skip
    assert asked == ref["dispatched"]
    assert len(batch.examples) == 4 * 3 and len(_kept(batch)) == 4
    # verl keeps the oldest groups in set order among one step's; grpo_jax the first sampled
    assert set(_kept(batch)) <= set(ref["selected"]) | set(ref["surplus"])
    assert len(ref["dispatched"]) > 2 and ref["metrics"]  # the case refills, rounds on
    assert batch.filter_metrics == ref["metrics"]
    values = rollout_stage.group_values(batch.result, metric, group_size=3)
    assert not rollout_stage.filtered_groups(values).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_dapo_refills_as_verls_sync_replay_buffer_on_generated_values(verl, monkeypatch, seed,
                                                                      n):  # fmt: skip
    """As above on random metric values from {0, 0.5, 1}: exact ties within a group (the
    filtered ones), groups of one sample (n = 1, never filtered; grpo needs n >= 2, so
    reinforce_plus_plus there) and mixed groups."""
    r = np.random.default_rng(seed)
    # some groups uniform by construction, so a round filters and refills
    values = (0.0, 0.5, 1.0)
    outputs = [[float(r.choice(values))] * n if r.random() < 0.4 else r.choice(values, n).tolist()
               for _ in range(400)]  # fmt: skip
    inflight = 1 + seed % 2
    extra = {} if inflight == 1 else {"max_inflight_gen_batches": inflight}
    estimator = "grpo" if n > 1 else "reinforce_plus_plus"
    batch, asked = _dynamic_sample(monkeypatch, outputs, n=n, train_batch_size=4, metric="acc",
                                   adv_estimator=estimator, **extra)  # fmt: skip
    ref = verl.run(reference.fn("verl_replay:sync_dapo_sample")(
        outputs, train_batch_size=4, max_inflight_gen_batches=inflight, metric="acc"
    )).value  # fmt: skip
    assert asked == ref["dispatched"]
    assert len(batch.examples) == 4 * n and len(_kept(batch)) == 4
    assert set(_kept(batch)) <= set(ref["selected"]) | set(ref["surplus"])
    assert batch.filter_metrics == ref["metrics"]
    if n == 1:  # a one-sample group is never filtered: the first 4 prompts, no refill
        assert asked == [4] and _kept(batch) == [0, 1, 2, 3]
    else:
        assert len(ref["dispatched"]) > 1  # uniform groups were filtered and refilled


# verl's reward_extra_info for each kind of scorer output (experimental/reward_loop/
# reward_manager/dapo.py: DAPORewardManager.run_single): a dict's keys, "score" included; a
# plain score as "acc"; with overlong_buffer.log "overlong_reward" and "overlong". "reward" is
# the score plus the overlong penalty (trainer/ppo/v1/replay_buffer.py reads rm_scores).
# Prompt 0: right twice, the second sample 8 tokens long (penalty (8 - 4) / 4 = -1); prompt 1:
# right and wrong; prompt 2: right twice; prompt 3: wrong (8 tokens) and right.
_LENGTHS = [[2, 8], [2, 2], [2, 2], [8, 2]] + [[2, 2]] * 8


@pytest.mark.parametrize(
    "kind, metric, kept",
    [
        ("plain", "reward", [0, 1]),  # prompt 0's rewards differ: 1 and 0
        ("plain", "acc", [1, 3]),  # prompt 0 right twice: filtered, 2 refills, prompt 2 too
        ("plain", "overlong", [0, 3]),  # prompts 1 and 2 are short twice
        ("plain", "overlong_reward", [0, 3]),
        ("plain", "score", "lack that key"),  # a plain score is no "score" in verl
        ("dict", "score", [1, 3]),
        ("dict", "acc", "lack that key"),  # verl adds "acc" for plain scores only
        ("dict_acc", "acc", [0, 1]),  # the scorer's own "acc" (flipped on prompt 0's 2nd)
        ("dict_acc", "reward", [0, 1]),
    ],
)
def test_filter_metric_is_verls_reward_extra_info(monkeypatch, kind, metric, kept):
    right = [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]] + [[0.0, 1.0]] * 8

    def output(k, j):
        s = right[k][j]
        if kind == "plain":
            return s
        if kind == "dict":
            return {"score": s, "pred": str(s)}
        return {"score": s, "acc": float(s != 1.0 or (k, j) == (0, 0))}

    outputs = [[output(k, j) for j in range(2)] for k in range(len(right))]
    run = functools.partial(_dynamic_sample, monkeypatch, outputs, n=2, train_batch_size=2,
                            lengths=_LENGTHS, metric=metric)  # fmt: skip
    if isinstance(kept, str):
        with pytest.raises(ValueError, match=kept):
            run()
    else:
        assert _kept(run()[0]) == kept


def test_filter_groups_config_is_verls(verl, caplog):
    """Defaults of verl's trainer YAML; max_num_gen_batches is ignored and data.gen_batch_size
    overridden to 1, with warnings (trainer/ppo/v1/trainer_base.py: _resolve_filter_groups_metric,
    _init_dataloader); max_inflight_gen_batches must be positive (replay_buffer.py)."""
    yaml = verl.run(reference.fn("verl_replay:filter_groups_defaults")()).value
    ours = dataclasses.asdict(config.FilterGroupsConfig())
    assert ours == {k: v for k, v in yaml.items() if k != "_target_"}
    run = config.RunConfig(
        data=config.DataConfig(gen_batch_size=24),
        algorithm=config.AlgorithmConfig(filter_groups=config.FilterGroupsConfig(
            enable=True, metric="score", max_num_gen_batches=10
        )),
    )  # fmt: skip
    assert run.read_chunk == 1
    ignored = run.ignored_settings()
    assert len(ignored) == 2 and "max_num_gen_batches=10 is ignored" in ignored[0]
    assert "gen_batch_size=24 is overridden to 1" in ignored[1]
    with pytest.raises(config.ConfigError, match="max_inflight_gen_batches=0 must be a positive"):
        config.FilterGroupsConfig(enable=True, max_inflight_gen_batches=0)
    with pytest.raises(config.ConfigError, match="metric='' must be set"):
        config.FilterGroupsConfig(enable=True, metric="")
    # without DAPO, verl reads the data gen_batch_size prompts at a time (a divisor of a step's)
    assert config.RunConfig(data=config.DataConfig(gen_batch_size=64)).read_chunk == 64
    with pytest.raises(config.ConfigError, match="must divide data.train_batch_size"):
        config.RunConfig(data=config.DataConfig(gen_batch_size=48))


def test_a_refill_reads_the_data_one_prompt_at_a_time():
    """verl reads DAPO's prompts from a dataloader of batch size 1, started again at the end of
    an epoch: a refill spanning two epochs takes the rest of one and the start of the next."""
    order0 = prompts_lib.epoch_order(10, epoch=0, seed=3, shuffle=True)
    order1 = prompts_lib.epoch_order(10, epoch=1, seed=3, shuffle=True)
    idx, pos = prompts_lib.read(10, prompts_lib.Position(0, 8), 4, chunk=1, seed=3, shuffle=True)
    assert idx.tolist() == [*order0[8:], *order1[:2]] and pos == prompts_lib.Position(1, 2)
    # a step's batch read whole, as without DAPO: the epoch's remainder is dropped
    idx, pos = prompts_lib.read(10, prompts_lib.Position(0, 8), 4, chunk=4, seed=3, shuffle=True)
    assert idx.tolist() == order1[:4].tolist() and pos == prompts_lib.Position(1, 4)


def test_sample_sizes_bound_the_sampler_compiles():
    sizes = {rollout_stage.sample_size(c, unit=2, train_batch_size=12, cap=24) for c in
             range(1, 25)}  # fmt: skip
    assert sizes == {2, 4, 8, 12, 16, 24}
    assert rollout_stage.sample_size(12, unit=2, train_batch_size=12, cap=24) == 12


# ---------------------------------------------------------------------------------------------
# User extensions named in the config


def half_advantage(token_level_rewards, response_mask, group_ids, *, num_groups=None, **kw):
    """A user estimator: GRPO's advantage, halved (so the test can see it was used)."""
    adv, ret = advantage.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, group_ids, num_groups=num_groups
    )
    return 0.5 * adv, 0.5 * ret


def reinforce_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, **kw):
    """A user policy loss: plain REINFORCE, -A log pi, token-mean."""

    value = loss.agg_loss(-advantages * log_prob, response_mask, loss_agg_mode,
                          batch_num_tokens=kw["batch_num_tokens"],
                          global_batch_size=kw["global_batch_size"], dp_size=kw["dp_size"])
    return value, {"actor/user_loss_called": jnp.float32(1.0)}


def test_config_names_module_function_extensions_and_they_run():
    # A config checks that "module:function" imports but registers nothing; the estimator and
    # the loss are imported by name where they are first used.
    spec_adv = f"{__name__}:half_advantage"
    spec_loss = f"{__name__}:reinforce_loss"
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2),
        algorithm=config.AlgorithmConfig(adv_estimator=spec_adv),
        actor=config.ActorConfig(
            ppo_mini_batch_size=2, policy_loss=config.PolicyLossConfig(loss_mode=spec_loss)
        ),
    )
    assert spec_adv not in advantage.adv_estimator_names()
    value, _ = loss.compute_policy_loss(
        jnp.zeros((1, 2)), jnp.full((1, 2), -1.0), jnp.ones((1, 2)), jnp.ones((1, 2)),
        loss_agg_mode="token-mean", policy_loss_mode=spec_loss,
    )  # fmt: skip
    assert np.isfinite(float(value)) and spec_loss in loss.policy_loss_mode_names()
    rewards_BT = jnp.array([[0, 1.0], [0, 0.0], [1.0, 0], [0, 0]])
    mask = jnp.ones((4, 2))
    ids = jnp.array([0, 0, 1, 1])
    got, got_returns = programs.make_advantage(run)(rewards_BT, mask, ids, {})
    want, want_returns = advantage.compute_grpo_outcome_advantage(rewards_BT, mask, ids,
                                                                  num_groups=2)
    np.testing.assert_allclose(got, 0.5 * want, rtol=1e-6)
    np.testing.assert_allclose(got_returns, 0.5 * want_returns, rtol=1e-6)
    with pytest.raises(config.ConfigError, match="adv_estimator: advantage estimator .*cannot"):
        config.AlgorithmConfig(adv_estimator="no_such_module_xyz:f")


# ---------------------------------------------------------------------------------------------
# The loop, on the tiny random model (one device)


def odd_length_reward(solution_str, ground_truth):
    """Varies within groups: some groups informative, some not."""
    del ground_truth
    return float(len(solution_str) % 2)


def digit_rewards(data_source, solution_str, ground_truth, extra_info=None):
    """Two components for gdpo (dict keys), both varying."""
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": float(digits > 1), "digits": float(digits), "odd": float(len(solution_str) % 2)}


def _run(tmp_path, *, steps=2, reward_fn=odd_length_reward, callbacks=(), **sections):
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    base = dict(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                                 optim=config.OptimConfig(lr=1e-3)),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=8),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=steps, save_freq=1, test_freq=-1,
                                     val_before_train=False, progress_bar=False,
                                     tensorboard=False, default_local_dir=str(tmp_path)),
    )
    for name, value in sections.items():
        base[name] = value(base.get(name)) if callable(value) else value
    run = config.RunConfig(**base)
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)
        train_rows, _ = demo_task.arithmetic_rows(64, 4, max_operand=20, seed=0)
        return loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                          train_data=train_rows, reward_fn=reward_fn, mesh=mesh,
                          callbacks=callbacks)


def _rows(result):
    return [r for r in result.history if "actor/pg_loss" in r]


@pytest.mark.slow
def test_dapo_dynamic_sampling_keeps_only_informative_groups(tmp_path, monkeypatch):
    kept_values = []
    real_select = rollout_stage.select_groups

    def spy(sampled, groups, mesh):
        out = real_select(sampled, groups, mesh)
        kept_values.append(rollout_stage.group_values(out.result, "acc", group_size=4))
        return out

    monkeypatch.setattr(rollout_stage, "select_groups", spy)
    result = _run(
        tmp_path,
        algorithm=config.AlgorithmConfig(
            filter_groups=config.FilterGroupsConfig(enable=True, metric="acc")
        ),
        reward=lambda r: dataclasses.replace(
            r, overlong_buffer=config.OverlongBufferConfig(enable=True, len=4, log=True)
        ),
        actor=lambda a: dataclasses.replace(a, clip_ratio_high=0.28),
    )
    rows = _rows(result)
    assert len(rows) == 2
    for row in rows:
        assert set(k for k in row if "filter_groups" in k) <= {
            "training/filter_groups/evicted_samples",
            "training/filter_groups/discarded_surplus_samples",
        }
        assert "reward_extra/overlong_reward/mean" in row
        # advantages of a batch of informative groups are not all zero
        assert row["critic/advantages/max"] > 0 > row["critic/advantages/min"]
    assert kept_values and not any(rollout_stage.filtered_groups(v).any() for v in kept_values)


@pytest.mark.slow
def test_rollout_correction_logs_verl_metrics_and_rejects(tmp_path):
    result = _run(
        tmp_path,
        algorithm=config.AlgorithmConfig(
            rollout_correction=config.RolloutCorrectionConfig(
                rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                rollout_rs_threshold="0.5_2.0",
            )
        ),
    )
    for row in _rows(result):
        # the native sampler and the trainer compute the same fp32 log-probs
        assert row["training/rollout_probs_diff_max"] < 1e-3
        assert abs(row["rollout_corr/rollout_is_mean"] - 1) < 1e-3
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 0


@pytest.mark.slow
def test_bypass_mode_uses_rollout_log_probs_and_bypass_loss(tmp_path):
    result = _run(
        tmp_path,
        algorithm=config.AlgorithmConfig(
            rollout_correction=config.RolloutCorrectionConfig(bypass_mode=True,
                                                              loss_type="reinforce",
                                                              rollout_is="sequence")
        ),
        actor=lambda a: dataclasses.replace(
            a, policy_loss=config.PolicyLossConfig(loss_mode="bypass_mode")
        ),
    )
    for row in _rows(result):
        assert "timing_s/old_log_prob" not in row  # no recomputation
        assert "rollout_corr/rollout_is_mean" in row  # from inside the bypass loss


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["remax", "gdpo", "user"])
def test_estimators_that_need_more_than_token_rewards(tmp_path, estimator):
    extra = {}
    if estimator == "gdpo":
        extra = dict(gdpo_reward_keys="digits,odd", gdpo_reward_weights="1.0,0.5")
    name = f"{__name__}:half_advantage" if estimator == "user" else estimator
    result = _run(
        tmp_path,
        reward_fn=digit_rewards,
        algorithm=config.AlgorithmConfig(adv_estimator=name, **extra),
    )
    rows = _rows(result)
    assert all(np.isfinite(r["actor/pg_loss"]) for r in rows)
    if estimator == "remax":
        assert all("timing_s/gen_max" in r for r in rows)


@pytest.mark.slow
def test_adaptive_kl_moves_and_resumes_exactly(tmp_path):
    alg = config.AlgorithmConfig(
        use_kl_in_reward=True,
        kl_ctrl=config.KLCtrlConfig(type="adaptive", kl_coef=0.05, target_kl=1e-6, horizon=16),
    )
    full = _rows(_run(tmp_path / "full", steps=3, algorithm=alg))
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in full]
    assert coeffs[0] == 0.05 and coeffs[1] != coeffs[0]
    for prev, nxt in zip(full, coeffs[1:]):
        want = train_stage.next_kl_coef(alg.kl_ctrl, prev["actor/reward_kl_penalty_coeff"],
                                 prev["actor/reward_kl_penalty"], n_steps=16)
        np.testing.assert_allclose(nxt, want, rtol=1e-12)
    _run(tmp_path / "resumed", steps=2, algorithm=alg)
    resumed = _rows(_run(tmp_path / "resumed", steps=3, algorithm=alg))
    assert resumed[-1]["actor/reward_kl_penalty_coeff"] == coeffs[2]
    assert resumed[-1]["actor/pg_loss"] == full[2]["actor/pg_loss"]


def test_correction_config_errors():
    with pytest.raises(config.ConfigError, match="bypass_mode=True"):
        config.RunConfig(
            actor=config.ActorConfig(policy_loss=config.PolicyLossConfig(loss_mode="bypass_mode"))
        )
    with pytest.raises(config.ConfigError, match="gdpo_reward_weights"):
        config.AlgorithmConfig(gdpo_reward_keys="a,b", gdpo_reward_weights="1.0")


@pytest.mark.slow
def test_packed_loop_step_equals_the_padded_one(tmp_path):
    """use_dynamic_bsz / log_prob_use_dynamic_bsz (token-budget packing, shared group prompts)
    give the padded loop's numbers: same rollout, old and reference log-probs, loss, gradient."""
    longer = lambda d: dataclasses.replace(d, max_response_length=24)  # noqa: E731
    kw = dict(steps=1, data=longer, actor=lambda a: dataclasses.replace(a, use_kl_loss=True,
                                                                       kl_loss_type="low_var_kl"))
    padded = _rows(_run(tmp_path / "padded", **kw))[0]
    got = _rows(
        _run(
            tmp_path / "packed",
            steps=1,
            data=longer,
            actor=lambda a: dataclasses.replace(a, use_kl_loss=True, kl_loss_type="low_var_kl",
                                                use_dynamic_bsz=True,
                                                ppo_max_token_len_per_gpu=128),
            rollout=lambda r: dataclasses.replace(r, log_prob_use_dynamic_bsz=True,
                                                  log_prob_max_token_len_per_gpu=128),
        )
    )[0]
    assert got["actor/micro_batches"] > 1
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/ppo_kl",
                "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
        # Sums over tokens of O(1) terms in another order (tests/numerics.py): rounding at the
        # scale max(|value|, 1), measured below 1 ulp; a normaliser one token off moves pg_loss
        # by 2,500 ulps, a dropped token by more.
        numerics.assert_close(got[key], padded[key], ulps=64,
                              scale=max(abs(padded[key]), 1.0), err_msg=key)  # fmt: skip
