"""verl GSM8K scorer on hand-written cases, and the reward plumbing: signatures, weights, the
worker pool's timeouts and crash isolation, and on_error."""

import dataclasses

import pytest

from grpo_jax import config, loading
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so the answer is\n#### 18", "strict", "18"),
        # strict takes the LAST "#### " match.
        ("#### 3 wait, no\n#### 4", "strict", "4"),
        # commas and "$" are removed in strict mode.
        ("#### 1,234", "strict", "1234"),
        ("#### -7", "strict", "-7"),
        ("#### 18.0", "strict", "18.0"),
        # "####18" (no space) is not the strict format.
        ("####18", "strict", None),
        ("The answer is 18.", "strict", None),
        # flexible: last number-like run; "18." is one run (dots belong to the class).
        ("The answer is 18.", "flexible", "18."),
        ("3 apples and 1,234 pears", "flexible", "1,234"),  # flexible keeps commas (verl)
        ("5 then . end", "flexible", "5"),  # "." alone is skipped
        ("no digits", "flexible", None),
        # every run invalid: verl's loop leaves the first run, "." (quirk kept for parity).
        ("a . b", "flexible", "."),
    ],
)
def test_extract_matches_verl(text, method, expected):
    assert reward_fns.gsm8k_extract(text, method=method) == expected


def test_only_last_300_chars_are_searched():
    # The "#### 5" sits 301+ characters from the end, so verl never sees it.
    early = "#### 5" + "x" * 300
    assert reward_fns.gsm8k_extract(early) is None
    # Exactly at the boundary: "#### 5" + 294 chars = 300 characters, fully inside the window.
    edge = "#### 5" + "x" * 294
    assert reward_fns.gsm8k_extract(edge) == "5"


def test_score_exact_string_compare():
    assert reward_fns.gsm8k_score("#### 18", "18") == 1.0
    # "18.0" != "18": verl compares strings, not numbers.
    assert reward_fns.gsm8k_score("#### 18.0", "18") == 0.0
    # thousands commas are removed before the compare.
    assert reward_fns.gsm8k_score("#### 1,000", "1000") == 1.0
    assert reward_fns.gsm8k_score("#### 17", "18", format_score=0.1) == 0.1
    assert reward_fns.gsm8k_score("no answer", "18", format_score=0.1) == 0.0
    assert reward_fns.gsm8k_score("#### 18", "18", score=2.0) == 2.0
    assert reward_fns.gsm8k_score("it is 18", "18", method="flexible") == 1.0


def test_unknown_method_lists_allowed():
    with pytest.raises(ValueError, match=r"strict.*flexible.*'loose'"):
        reward_fns.gsm8k_score("#### 1", "1", method="loose")


def test_ground_truth():
    assert reward_fns.gsm8k_ground_truth("48/2 = 24\n#### 72") == "72"
    assert reward_fns.gsm8k_ground_truth("...\n#### 1,200") == "1200"
    assert reward_fns.gsm8k_ground_truth("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        reward_fns.gsm8k_ground_truth("no marker 72")


def _length_reward(solution, ground_truth):
    return len(solution) / 10.0


def _boom(solution, ground_truth):
    if "boom" in solution:
        raise KeyError("boom")
    return 1.0


def _examples(ground_truths, prompt="q"):
    return [
        prompts_lib.Example(prompt, gt, "openai/gsm8k", {"k": i}, {"level": i})
        for i, gt in enumerate(ground_truths)
    ]


def test_weighted_combination():
    fn = reward_fns.make_reward_fn(
        f"grpo_jax.rewards.functions:gsm8k_score,{__name__}:_length_reward", "1.0,0.5"
    )
    res = reward_fns.score_batch(fn, ["#### 7", "#### 8"], _examples(["7", "7"]))
    # sample 0: 1.0*1 + 0.5*(6/10) = 1.3; sample 1: 1.0*0 + 0.5*0.6 = 0.3
    assert res.scores_B == pytest.approx([1.3, 0.3])
    assert res.per_fn["grpo_jax.rewards.functions:gsm8k_score"] == [1.0, 0.0]
    assert res.num_errors == 0


def _verl_style(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str.strip() == ground_truth
    return {"score": float(hit), "acc": hit, "pred": solution_str.strip(), "k": extra_info["k"]}


def _trl_style(prompts, completions, level, ground_truth, **kwargs):
    # TRL passes chat completions as [{"role": "assistant", "content": ...}] for chat prompts.
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t == g) + 0.1 * lv for t, g, lv in zip(texts, ground_truth, level, strict=True)]


def test_the_three_signatures():
    assert reward_fns.signature_style(_verl_style) == "verl"
    assert reward_fns.signature_style(_trl_style) == "trl"
    assert reward_fns.signature_style(_length_reward) == "pair"
    with pytest.raises(ValueError, match="expected verl's"):
        reward_fns.signature_style(lambda a, b, c: 0.0)
    # verl: a dict's "score" is the reward, its other keys are kept per sample.
    res = reward_fns.score_batch(
        reward_fns.RewardFn.of(_verl_style), ["7", "8"], _examples(["7", "7"])
    )
    assert res.scores_B == [1.0, 0.0]
    assert res.extras == {"acc": [True, False], "pred": ["7", "8"], "k": [0, 1]}
    # TRL: one call for the batch, columns as keyword lists, chat completions for chat prompts.
    chat = _examples(["7", "7"], prompt=({"role": "user", "content": "q"},))
    res = reward_fns.score_batch(reward_fns.RewardFn.of(_trl_style), ["7", "8"], chat)
    assert res.scores_B == pytest.approx([1.0, 0.1])


def test_custom_reward_function_file_replaces_reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 2.0 if solution_str == ground_truth else 0.5\n"
    )
    custom = config.CustomRewardFunction(path=str(path))
    fn = loading.reward_fn(config.RewardConfig(), custom)
    assert reward_fns.score_batch(fn, ["1", "2"], _examples(["1", "1"])).scores_B == [2.0, 0.5]
    with pytest.raises(ValueError, match="defines no such function"):
        loading.reward_fn(config.RewardConfig(), config.CustomRewardFunction(str(path), "nope"))


def test_raising_reward_fn_raise_mode_names_fn_and_sample():
    fn = reward_fns.make_reward_fn(f"{__name__}:_boom", on_error="raise")
    with pytest.raises(reward_fns.RewardError, match=rf"{__name__}:_boom on sample 1"):
        reward_fns.score_batch(fn, ["ok", "boom!", "ok"], _examples(["1", "1", "1"]))


def test_raising_reward_fn_zero_mode_counts():
    fn = reward_fns.make_reward_fn(f"{__name__}:_boom", on_error="zero")
    res = reward_fns.score_batch(fn, ["ok", "boom!", "boom"], _examples(["1", "1", "1"]))
    assert res.scores_B == [1.0, 0.0, 0.0]
    assert res.num_errors == 2


def _hangs_or_dies(solution, ground_truth):
    import os
    import time

    if solution == "hang":
        time.sleep(600)
    if solution == "die":
        os._exit(3)  # a crash of the process, not an exception
    return 1.0


def test_pool_times_out_a_hanging_call_and_survives_a_dead_worker():
    fn = reward_fns.RewardFn.of(_hangs_or_dies, on_error="raise")
    with reward_pool.Pool(2, timeout_s=2.0) as pool:
        res = reward_fns.score_batch(
            fn, ["ok", "hang", "die", "ok", "ok"], _examples(["1"] * 5), pool=pool
        )
        # The hang and the crash cost their sample only, even with on_error="raise".
        assert res.scores_B == [1.0, 0.0, 0.0, 1.0, 1.0]
        assert (res.num_lost, res.num_errors, pool.restarts) == (2, 0, 2)
        # The replaced workers serve the next batch.
        assert (
            reward_fns.score_batch(fn, ["ok"] * 4, _examples(["1"] * 4), pool=pool).scores_B
            == [1.0] * 4
        )


def test_pool_runs_closures_and_reports_exceptions():
    offset = 0.25  # a closure over a local: cloudpickle ships it by value

    def shifted(solution, ground_truth):
        if solution == "bad":
            raise ValueError("bad completion")
        return float(solution == ground_truth) + offset

    with reward_pool.Pool(1, timeout_s=30.0) as pool:
        res = reward_fns.score_batch(
            reward_fns.RewardFn.of(shifted, on_error="zero"),
            ["1", "bad"],
            _examples(["1", "1"]),
            pool=pool,
        )
        assert res.scores_B == [1.25, 0.0] and res.num_errors == 1
        with pytest.raises(reward_fns.RewardError, match="ValueError: bad completion"):
            reward_fns.score_batch(
                reward_fns.RewardFn.of(shifted), ["bad"], _examples(["1"]), pool=pool
            )


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_colon", "module:function"),
        ("not_a_module_xyz:f", "cannot import"),
        ("grpo_jax.rewards.functions:nope", "has no 'nope'"),
        ("grpo_jax.rewards.functions:STYLES", "not callable"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        reward_fns.make_reward_fn(spec)


def test_bad_weights_and_modes():
    with pytest.raises(ValueError, match="has 2 weights for 1 functions"):
        reward_fns.make_reward_fn("grpo_jax.rewards.functions:gsm8k_score", "1,2")
    with pytest.raises(ValueError, match="comma-separated floats"):
        reward_fns.make_reward_fn("grpo_jax.rewards.functions:gsm8k_score", "one")
    with pytest.raises(ValueError, match=r"on_error='ignore' must be one of \['raise', 'zero'\]"):
        reward_fns.make_reward_fn("grpo_jax.rewards.functions:gsm8k_score", on_error="ignore")


def test_pool_submit_returns_while_the_call_runs(tmp_path):
    """`submit` queues and returns: the call runs on a worker while the caller goes on (here it
    waits for a file the caller writes only after submit returned), and `wait` collects it."""
    go = tmp_path / "go"

    def waits_for_go(solution, ground_truth):
        import os
        import time

        while not os.path.exists(go):
            time.sleep(0.01)
        return float(solution == ground_truth)

    with reward_pool.Pool(1, timeout_s=60.0) as pool:
        first = pool.submit((waits_for_go, ("1", "1"), {}))
        second = pool.submit((waits_for_go, ("2", "1"), {}))
        go.write_text("")  # only now can either call return
        assert [o.value for o in pool.wait([second, first])] == [0.0, 1.0]


def _styled_rewards():
    """Three functions, one per signature, with dict results, raising, non-finite and
    hanging calls: (RewardFn, solutions, examples)."""

    def verl_style(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            import time

            time.sleep(600)
        if solution_str == "boom":
            raise ValueError("boom")
        return {"score": float(solution_str == ground_truth), "len": len(solution_str)}

    def pair_style(solution_str, ground_truth):
        return float("nan") if solution_str == "nan" else 0.5 * len(solution_str)

    def trl_style(prompts, completions, ground_truth, **kw):
        return [float(c == g) for c, g in zip(completions, ground_truth)]

    fn = reward_fns.RewardFn(
        ("verl_style", "pair_style", "trl_style"), (verl_style, pair_style, trl_style),
        (1.0, 0.5, 2.0), on_error="zero",
    )  # fmt: skip
    solutions = ["1", "boom", "2", "hang", "nan", "12", "1", "x"]
    return fn, solutions, _examples(["1", "1", "2", "1", "1", "12", "3", "x"])


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "pool"])
def test_scoring_rows_as_they_come_equals_score_batch(workers):
    """`Scoring.add` in any order, some rows left to `result`: the RewardResult of
    `score_batch` exactly (scores, per-function scores, extras, errors and lost calls)."""
    fn, solutions, examples = _styled_rewards()
    if workers == 0:  # inline: no timeout, so no hanging call
        solutions[3] = "0"
    pool = reward_pool.Pool(workers, timeout_s=2.0) if workers else None
    try:
        want = reward_fns.score_batch(fn, solutions, examples, pool=pool)
        scoring = reward_fns.Scoring(fn, examples, pool=pool)
        for i in (5, 1, 3, 0, 6):
            scoring.add(i, solutions[i])
        got = scoring.result(solutions)
    finally:
        if pool is not None:
            pool.close()
    assert got == want
    assert (got.num_errors, got.num_lost) == (2, workers // 2)
    assert got.extras["verl_style/len"][0] == 1 and got.extras["verl_style/len"][1] is None
    with pytest.raises(ValueError, match="sample 5 was scored as '12' but is now '13'"):
        scoring = reward_fns.Scoring(fn, examples)
        scoring.add(5, "12")
        scoring.result(solutions[:5] + ["13"] + solutions[6:])


def test_scoring_raises_as_score_batch_does():
    """on_error="raise": the first failing call in score_batch's order (function by function,
    sample by sample) stops it with the same message, whichever rows were added first."""
    fn, solutions, examples = _styled_rewards()
    fn = dataclasses.replace(fn, on_error="raise")
    solutions[3] = "0"
    with pytest.raises(reward_fns.RewardError) as want:
        reward_fns.score_batch(fn, solutions, examples)
    scoring = reward_fns.Scoring(fn, examples)
    scoring.add(4, solutions[4])  # pair_style's non-finite value: later in score_batch's order
    scoring.add(1, solutions[1])
    with pytest.raises(reward_fns.RewardError) as got:
        scoring.result(solutions)
    assert str(got.value) == str(want.value) and "verl_style on sample 1" in str(got.value)
