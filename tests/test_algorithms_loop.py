"""verl's GRPO-path algorithms inside the loop: DAPO's dynamic sampling and overlong penalty,
rollout correction and bypass mode, remax / gdpo / a user estimator or loss named in the config,
and the adaptive KL controller (with exact resume). The maths of each piece is parity-tested
against verl in test_verl_parity.py; here the loop must feed it the right inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest

from grpo_jax import advantage, config, loading, loss, sharding
from grpo_jax.data import demo_task
from grpo_jax.trainer import loop, programs, rollout_stage, train_stage

# ---------------------------------------------------------------------------------------------
# Pure pieces


def test_informative_groups_ignore_float_noise_only():
    values = np.array(
        [
            [1.0, 1.0, 1.0],  # uniform
            [1.0, 1.0 + 1e-9, 1.0],  # float noise: still uniform
            [0.0, 1.0, 0.0],  # informative
            [1e6, 1e6 + 0.5, 1e6],  # within 1e-6 x |mean|: uniform
            [1e6, 1e6 + 2.0, 1e6],  # beyond it: informative
            [-1.0, -1.0, -0.9],
        ]
    )
    assert rollout_stage.informative_groups(values).tolist() == [False, False, True, False, True, True]


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
        kept_values.append(rollout_stage.group_values(out, "acc"))
        return out

    monkeypatch.setattr(rollout_stage, "select_groups", spy)
    result = _run(
        tmp_path,
        data=lambda d: dataclasses.replace(d, gen_batch_size=4),
        algorithm=config.AlgorithmConfig(
            filter_groups=config.FilterGroupsConfig(enable=True, metric="acc",
                                                    max_num_gen_batches=30)
        ),
        reward=lambda r: dataclasses.replace(
            r, overlong_buffer=config.OverlongBufferConfig(enable=True, len=4, log=True)
        ),
        actor=lambda a: dataclasses.replace(a, clip_ratio_high=0.28),
    )
    rows = _rows(result)
    assert len(rows) == 2
    for row in rows:
        assert row["train/num_gen_batches"] >= 1
        assert row["train/num_filtered_groups"] >= 0
        assert "reward_extra/overlong_reward/mean" in row
        # advantages of a batch of informative groups are not all zero
        assert row["critic/advantages/max"] > 0 > row["critic/advantages/min"]
    assert kept_values and all(rollout_stage.informative_groups(v).all() for v in kept_values)


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


def test_filter_and_correction_config_errors():
    with pytest.raises(config.ConfigError, match="data.gen_batch_size"):
        config.RunConfig(data=config.DataConfig(gen_batch_size=8))
    with pytest.raises(config.ConfigError, match="bypass_mode=True"):
        config.RunConfig(
            actor=config.ActorConfig(policy_loss=config.PolicyLossConfig(loss_mode="bypass_mode"))
        )
    with pytest.raises(config.ConfigError, match="seq_final_reward"):
        config.RunConfig(algorithm=config.AlgorithmConfig(
            use_kl_in_reward=True,
            filter_groups=config.FilterGroupsConfig(enable=True, metric="seq_final_reward")))
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
