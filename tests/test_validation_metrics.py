"""Validation metrics (grpo_jax/trainer/validation.py) against verl 0.9.1's own code.

verl's `metric_utils.process_validation_metrics` and `bootstrap_metric` run in the session's verl
worker (tests/reference.py), and so does its V1 trainer's `_val_metrics_update`, compiled from
the installed source (tests/verl_validation.py); they get the same per-sample variables as ours
(several data sources; n in {1, 2, 4, 5, 9}; float scorers, whose score verl reports as "acc",
and dict scorers with and without "acc" and "pred"; string, numeric and missing votes; samples
lacking "acc"), and every key and value must agree. The bootstrap draws are verl's (NumPy's
legacy generator seeded 42 before every estimate), so the values agree bit for bit.
"""

import os

import jax
import numpy as np
import pytest
import reference

from grpo_jax import config, loading, sharding
from grpo_jax.data import demo_task
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.trainer import loop, metrics, rollout_stage, validation

METRIC_UTILS = "verl.trainer.ppo.metric_utils:"


def _samples(n: int, seed: int):
    """(data_sources, uids, variables) of verl's shape: every variable one value per sample,
    None where the sample's reward dict lacks that key; the n samples of a prompt adjacent."""
    rng = np.random.default_rng(seed)
    sources, uids = [], []
    variables = {k: [] for k in ("reward", "acc", "score", "pred", "overlong")}

    def add(source, uid, **values):
        sources.append(source)
        uids.append(uid)
        for k, column in variables.items():
            column.append(values.get(k))

    for p in range(4):
        uid = f"gsm-{p}"  # a float scorer: verl's reward manager reports the score as "acc"
        for _ in range(n):
            s = float(rng.choice([0.0, 1.0]))
            add("openai/gsm8k", uid, reward=s, acc=s)
    for p in range(3):
        uid = f"dapo-{p}"  # {"score", "acc", "pred"}, with the DAPO overlong flag
        for _ in range(n):
            pred = str(rng.choice(["7", "8", "9"]))
            s = 1.0 if pred == "7" else -1.0
            penalty = -float(rng.choice([0.0, 0.25]))
            add("math_dapo", uid, reward=float(np.float32(s + penalty)), score=s, acc=s == 1.0,
                pred=pred, overlong=penalty < 0)  # fmt: skip
    for p in range(3):
        uid = f"votes-{p}"  # {"score", "pred"} with integer votes: no "acc", pred is measured
        for i in range(n):
            pred = int(rng.integers(0, 3))
            s = float(rng.uniform(0.0, 1.0))
            # one prompt has a sample without a vote: no maj@k for that prompt
            add("votes", uid, reward=float(np.float32(s)), score=s,
                pred=None if (p == 2 and i == 0) else pred)  # fmt: skip
    for p in range(3):
        uid = f"mixed-{p}"  # some samples' dicts lack "acc": verl's V1 trainer pads it with 0
        for i in range(n):
            s = float(rng.choice([0.0, 0.5, 1.0]))
            add("mixed", uid, reward=s, score=s, acc=None if i % 2 else s,
                pred=str(rng.choice(["a", "b"])))  # fmt: skip
    return sources, uids, variables


NS = (1, 2, 4, 5, 9)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("expected", [False, True])
def test_source_metrics_match_verl_process_validation_metrics(verl, n, expected):
    sources, uids, variables = _samples(n, seed=n)
    counts = {(s, u): n for s, u in zip(sources, uids, strict=True)} if expected else None
    want = verl.run(
        reference.fn(METRIC_UTILS + "process_validation_metrics")(
            sources, uids, variables, expected_acc_counts=counts
        )
    ).value
    got = validation.source_metrics(sources, uids, variables, expected_counts=counts)
    assert got == want


@pytest.mark.parametrize("n", NS)
def test_logged_metrics_match_verl_v1_trainer(verl, n):
    sources, uids, variables = _samples(n, seed=10 + n)
    want = verl.run(
        reference.fn("verl_validation:val_metrics")(sources, uids, variables, [2] * len(uids), n)
    ).value
    # metrics_of numbers the prompts itself: the same grouping as the string uids above
    got = validation.metrics_of(sources, variables, n=n)
    assert got == want
    if n > 1:
        core = {k for k in got if k.startswith("val-core/")}
        assert f"val-core/math_dapo/acc/maj@{n}/std" in core  # verl: std of core metrics too
        if n > 2:  # smaller subsets are val-aux
            assert "val-aux/math_dapo/acc/maj@2/mean" in got


@pytest.mark.parametrize("n,k", [(5, 2), (5, 4), (5, 5), (9, 8), (3, 3)])
def test_bootstrap_matches_verl_bootstrap_metric(verl, n, k):
    rng = np.random.default_rng(n * 10 + k)
    values = rng.choice([0.0, 0.5, 1.0], n).tolist()
    votes = rng.choice(["x", "y", "z"], n).tolist()
    boot = reference.fn(METRIC_UTILS + "bootstrap_metric")
    want_best, want_worst = verl.run(
        boot(values, k, [reference.fn("numpy:max"), reference.fn("numpy:min")])
    ).value
    maj = reference.fn("functools:partial")(
        reference.fn(METRIC_UTILS + "calc_maj_val"), vote_key="pred", val_key="val"
    )
    vote_data = [{"val": v, "pred": p} for v, p in zip(values, votes, strict=True)]
    [want_maj] = verl.run(boot(vote_data, k, [maj])).value
    idx_RK = validation.bootstrap_indices(n, k)
    draws_RK = np.asarray(values)[idx_RK]
    assert (float(draws_RK.max(1).mean()), float(draws_RK.max(1).std())) == tuple(want_best)
    assert (float(draws_RK.min(1).mean()), float(draws_RK.min(1).std())) == tuple(want_worst)
    maj_R = validation.majority_values(np.asarray(values), votes, idx_RK)
    assert (float(maj_R.mean()), float(maj_R.std())) == tuple(want_maj)


def test_bootstrap_leaves_numpy_global_generator_alone():
    np.random.seed(3)
    want = np.random.random()
    np.random.seed(3)
    validation.prompt_metrics([0.0, 1.0, 1.0, 0.0], ["a", "b", "b", "a"])
    assert np.random.random() == want


def test_majority_ties_go_to_the_vote_seen_first_in_the_draw():
    # Hand-made draws: [b, a, a, b] ties 2-2, b is first, its first sample (index 1) has 0.25;
    # [c, a, a] has a twice: its first sample is index 0 (0.0).
    values = np.array([0.0, 0.25, 0.5, 1.0])
    votes = ["a", "b", "a", "c"]
    idx_RK = np.array([[1, 0, 2, 1], [3, 2, 0, 3]])
    assert validation.majority_values(values, votes, idx_RK).tolist() == [0.25, 1.0]
    assert validation.majority_values(values, votes, np.array([[3, 0, 2]])).tolist() == [0.0]


def test_subset_sizes_are_verls():
    assert validation.subset_sizes(1) == []
    assert validation.subset_sizes(2) == [2]
    assert validation.subset_sizes(5) == [2, 4, 5]
    assert validation.subset_sizes(8) == [2, 4, 8]
    assert validation.subset_sizes(17) == [2, 4, 8, 16, 17]


def _result(scores, extras=None, dicts=False):
    b = len(scores)
    return reward_fns.RewardResult(
        list(scores), {"f": list(scores)}, dict(extras or {}), 0, 0, {"f": [dicts] * b}
    )


def test_a_float_scorer_logs_acc_as_the_core_metric():
    # verl's reward managers report a plain score as "acc" too, and "acc" is the core variable:
    # GSM8K validation is val-core/openai/gsm8k/acc/mean@1, the reward val-aux.
    variables = validation.verl_variables(_result([1.0, 0.0, 0.1]))
    assert variables == {"reward": [1.0, 0.0, float(np.float32(0.1))], "acc": [1.0, 0.0, 0.1]}
    got = validation.metrics_of(["openai/gsm8k"] * 3, variables, n=1)
    assert got["val-core/openai/gsm8k/acc/mean@1"] == pytest.approx(1.1 / 3)
    assert "val-aux/openai/gsm8k/reward/mean@1" in got
    assert "val-aux/openai/gsm8k/acc_success_only/mean@1" in got  # verl V1's twin of acc
    assert got["val-aux/num_turns/mean"] == 2.0
    assert not any(k.startswith("val-core/") and "/reward/" in k for k in got)


def test_dict_scores_keep_their_keys_and_score():
    result = _result([1.0, -1.0], {"acc": [True, False], "pred": ["3", "4"]}, dicts=True)
    variables = validation.verl_variables(result)
    assert variables == {"reward": [1.0, -1.0], "score": [1.0, -1.0], "acc": [True, False],
                         "pred": ["3", "4"]}  # fmt: skip
    got = validation.metrics_of(["math"] * 2, variables, n=2)
    assert got["val-core/math/acc/mean@2"] == 0.5
    assert got["val-core/math/acc/maj@2/mean"] == pytest.approx(0.5, abs=0.1)
    assert "val-aux/math/score/best@2/mean" in got and "val-aux/math/reward/std@2" in got
    assert not any("/pred/" in k for k in got)  # string votes are not measured


def test_validation_reward_carries_the_overlong_penalty():
    # verl 0.9.1's DAPO reward manager scores validation like training: the penalty is in the
    # "reward" (and "acc" keeps the plain score).
    ob = config.OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    result = rollout_stage.with_overlong_penalty(
        _result([1.0, 1.0]), np.array([4, 8]), ob, max_response_length=8
    )
    variables = validation.verl_variables(result)
    assert variables["reward"] == [1.0, 0.0] and variables["acc"] == [1.0, 1.0]
    assert variables["overlong"] == [False, True] and variables["overlong_reward"] == [0.0, -1.0]


def test_a_non_numeric_reward_key_is_a_clear_error():
    variables = {"reward": [1.0, 0.0], "detail": [{"a": 1}, {"a": 2}]}
    with pytest.raises(ValueError, match="'detail'.*data source 'src'"):
        validation.metrics_of(["src"] * 2, variables, n=1)


def test_group_metrics_keeps_its_signature():
    got = validation.group_metrics(["s"] * 4, {"reward": [1.0, 0.0, 1.0, 1.0]}, ["a", "b", "a",
                                   "a"], n=2)  # fmt: skip
    assert got["val-core/s/reward/mean@2"] == 0.75
    assert "val-core/s/reward/maj@2/mean" in got


def _train(workdir, steps: int, reward_fn):
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((-1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=8,
                                 optim=config.OptimConfig(lr=1e-3)),
        rollout=config.RolloutConfig(n=4, log_prob_micro_batch_size_per_gpu=8),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=steps, save_freq=1, test_freq=-1,
                                     val_before_train=True, log_val_generations=2,
                                     progress_bar=False, tensorboard=False,
                                     default_local_dir=str(workdir)),
        checkpoint=config.CheckpointConfig(export_hf=False, save_last=False),
        model=config.ModelSpec(source="random", tokenizer="char", path=None),
    )  # fmt: skip
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(run.model, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)  # fmt: skip
        rows, val = demo_task.arithmetic_rows(16, 4, max_operand=20, seed=0)
        return loop.train(
            run,
            model_config=model_config,
            params=params,
            tokenizer=tok,
            train_data=rows,
            val_data=val,
            reward_fn=reward_fn,
            mesh=mesh,
        )


def _digits(solution_str, ground_truth):
    del ground_truth
    return sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))


def test_resume_validates_again_under_the_resumed_step(tmp_path):
    """verl's fit() validates first whenever trainer.val_before_train, after loading a checkpoint
    too, and logs it under the checkpoint's step. A second resume from the same checkpoint
    replaces that row (and its logged samples) rather than adding another."""
    key = "val-core/arithmetic/acc/mean@1"  # a float scorer's score is verl's "acc"
    first = _train(tmp_path, 2, _digits)
    assert [r["step"] for r in first.history] == [0, 1, 2] and key in first.history[0]
    again = _train(tmp_path, 2, _digits)  # nothing left to train: validates only (as verl)
    assert [r["step"] for r in again.history] == [2]
    (row,) = again.history
    assert key in row and all(k == "step" or k.startswith("val-") for k in row)
    resumed = _train(tmp_path, 3, _digits)
    assert [r["step"] for r in resumed.history] == [2, 3]
    assert resumed.history[0] == row  # the same checkpoint, greedy: the same validation
    rows = metrics.read(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3]
    assert "training/global_step" in rows[2] and rows[3] == row
    logged = validation.read_generations(str(tmp_path))
    assert sorted(logged) == [0, 2] and len(logged[2]) == 2


def test_val_do_sample_is_ignored_as_by_verl():
    # verl 0.9.1's rollout copies only temperature, top_p and top_k from val_kwargs
    # (agent_loop_tq.generate_sequences): do_sample=False does not make validation greedy.
    vk = config.ValKwargs(temperature=0.7, do_sample=False, n=4)
    assert vk.sampling_temperature == 0.7
    assert config.ValKwargs(temperature=0.0, do_sample=True).sampling_temperature == 0.0
    run = config.RunConfig(rollout=config.RolloutConfig(val_kwargs=vk))
    assert any("rollout.val_kwargs.do_sample=False is ignored" in m for m in run.ignored_settings())
    greedy = config.RunConfig(rollout=config.RolloutConfig(val_kwargs=config.ValKwargs()))
    assert not any("do_sample" in m for m in greedy.ignored_settings())


def test_report_pairs_the_same_inputs_before_and_after(tmp_path):
    """The end-of-run report compares the first and last validation on the same inputs and
    shows the changes that went the wrong way as well as the right one."""
    import train

    before = [{"input": f"{i}+1", "output": "x", "score": float(i % 2), "ground_truth": "0"}
              for i in range(6)]
    after = [dict(g, output="y", score=1.0) for g in before]
    after[1] = dict(after[1], score=0.0)  # one right answer lost
    after.reverse()  # paired by input, not by position
    validation.write_generations(str(tmp_path), 0, before)
    validation.write_generations(str(tmp_path), 6, after)
    text = train.report(str(tmp_path), samples=1)
    assert ("6 inputs logged at both validations: 3 scored higher, 1 scored lower, "
            "2 scored the same") in text
    lost = text.split("  lower: ")[1].splitlines()
    assert lost[0] == "'1+1'"
    assert lost[1].strip() == "before 'x' (score 1)" and lost[2].strip() == "after  'y' (score 0)"
    one = str(tmp_path / "one")
    os.makedirs(one)
    validation.write_generations(one, 0, before)
    assert "validation samples at step 0:" in train.report(one)
