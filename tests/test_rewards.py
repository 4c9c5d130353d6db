"""verl GSM8K scorer parity on hand-written cases, and the user reward-function plumbing."""

import pytest

from grpo_jax import rewards


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
    assert rewards.gsm8k_extract(text, method=method) == expected


def test_only_last_300_chars_are_searched():
    # The "#### 5" sits 301+ characters from the end, so verl never sees it.
    early = "#### 5" + "x" * 300
    assert rewards.gsm8k_extract(early) is None
    # Exactly at the boundary: "#### 5" + 294 chars = 300 characters, fully inside the window.
    edge = "#### 5" + "x" * 294
    assert rewards.gsm8k_extract(edge) == "5"


def test_score_exact_string_compare():
    assert rewards.gsm8k_score("#### 18", "18") == 1.0
    # "18.0" != "18": verl compares strings, not numbers.
    assert rewards.gsm8k_score("#### 18.0", "18") == 0.0
    # thousands commas are removed before the compare.
    assert rewards.gsm8k_score("#### 1,000", "1000") == 1.0
    assert rewards.gsm8k_score("#### 17", "18", format_score=0.1) == 0.1
    assert rewards.gsm8k_score("no answer", "18", format_score=0.1) == 0.0
    assert rewards.gsm8k_score("#### 18", "18", score=2.0) == 2.0
    assert rewards.gsm8k_score("it is 18", "18", method="flexible") == 1.0


def test_unknown_method_lists_allowed():
    with pytest.raises(ValueError, match=r"strict.*flexible.*'loose'"):
        rewards.gsm8k_score("#### 1", "1", method="loose")


def test_ground_truth():
    assert rewards.gsm8k_ground_truth("48/2 = 24\n#### 72") == "72"
    assert rewards.gsm8k_ground_truth("...\n#### 1,200") == "1200"
    assert rewards.gsm8k_ground_truth("#### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        rewards.gsm8k_ground_truth("no marker 72")


def _length_reward(solution, ground_truth):
    return len(solution) / 10.0


def _boom(solution, ground_truth):
    if "boom" in solution:
        raise KeyError("boom")
    return 1.0


def test_weighted_combination():
    fn = rewards.make_reward_fn(
        f"grpo_jax.rewards:gsm8k_score,{__name__}:_length_reward", "1.0,0.5"
    )
    res = rewards.score_batch(fn, ["#### 7", "#### 8"], ["7", "7"])
    # sample 0: 1.0*1 + 0.5*(6/10) = 1.3; sample 1: 1.0*0 + 0.5*0.6 = 0.3
    assert res.scores_B == pytest.approx([1.3, 0.3])
    assert res.per_fn["grpo_jax.rewards:gsm8k_score"] == [1.0, 0.0]
    assert res.num_errors == 0


def test_raising_reward_fn_raise_mode_names_fn_and_sample():
    fn = rewards.make_reward_fn(f"{__name__}:_boom", on_error="raise")
    with pytest.raises(RuntimeError, match=rf"{__name__}:_boom failed on sample 1"):
        rewards.score_batch(fn, ["ok", "boom!", "ok"], ["1", "1", "1"])


def test_raising_reward_fn_zero_mode_counts():
    fn = rewards.make_reward_fn(f"{__name__}:_boom", on_error="zero")
    res = rewards.score_batch(fn, ["ok", "boom!", "boom"], ["1", "1", "1"])
    assert res.scores_B == [1.0, 0.0, 0.0]
    assert res.num_errors == 2


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_colon", "module:function"),
        ("not_a_module_xyz:f", "cannot import"),
        ("grpo_jax.rewards:nope", "has no 'nope'"),
        ("grpo_jax.rewards:_SOLUTION_CLIP_CHARS", "not callable"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        rewards.make_reward_fn(spec)


def test_bad_weights_and_modes():
    with pytest.raises(ValueError, match="2 weights for 1 functions"):
        rewards.make_reward_fn("grpo_jax.rewards:gsm8k_score", "1,2")
    with pytest.raises(ValueError, match="comma-separated floats"):
        rewards.make_reward_fn("grpo_jax.rewards:gsm8k_score", "one")
    with pytest.raises(ValueError, match=r"raise.*zero.*'ignore'"):
        rewards.make_reward_fn("grpo_jax.rewards:gsm8k_score", on_error="ignore")
