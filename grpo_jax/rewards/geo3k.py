"""Geometry3K scorer: verl 0.9.1's `verl/utils/reward_score/geo3k.py` (hiyouga/geometry3k).

score = (1 - format_score) * accuracy + format_score * format, with format_score 0.1 by default:
accuracy is 1.0 when mathruler's PRM800K grader (`prm800k.grade_answer`, variant "mathruler")
accepts the content of the last `\\boxed{...}`, format is 1.0 when the whole completion matches
`<think>.*</think>.*\\boxed\\{.*\\}.*` (newlines included). So the scores are 0.0, 0.1, 0.9 and 1.0,
computed in verl's float order ((1 - 0.1) * 1.0 + 0.1 * 1.0 is exactly 1.0). Quirks kept:

* The box is found by mathruler's `extract_boxed_content`: the last "\\boxed{" (with the brace;
  "\\boxed 5" and "\\fbox" are not boxes), then up to the "}" that takes the depth below 0,
  stripped. With no box, or one that never closes, the answer is the *string* "None", which is
  then graded like any answer (a ground truth "None" is matched by a completion without a box).
* The format check needs the literal text "<think>" at the very start and a "\\boxed{...}" after
  "</think>"; a box inside the thinking only does not count.
* `use_boxed=False` grades the whole completion as the answer.

verl imports mathruler (0.1.0), which its own requirements do not install (only its `verl-core`
extra lists it), so on a plain verl install this data source raises ModuleNotFoundError; the
parity tests run verl with mathruler installed (scripts/build_verl_venv.sh). grpo_jax needs no
mathruler: the grader is prm800k.py.
"""

from __future__ import annotations

import re

from grpo_jax.rewards import prm800k

_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_BOX_OPEN = "\\boxed{"
NO_BOX = "None"  # mathruler's answer when there is no closed box: a string, not None


def extract_boxed_content(text: str) -> str:
    """mathruler's extract_boxed_content: the stripped content of the last "\\boxed{...}"."""
    start = text.rfind(_BOX_OPEN)
    if start == -1:
        return NO_BOX
    content = text[start + len(_BOX_OPEN) :]
    depth = 0
    for i, ch in enumerate(content):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if depth == -1:
            return content[:i].strip()
    return NO_BOX


def format_reward(predict_str: str) -> float:
    """1.0 when the completion is "<think>...</think>...\\boxed{...}...", else 0.0."""
    return 1.0 if _FORMAT_RE.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when mathruler's grader accepts the boxed answer (or the whole text), else 0.0."""
    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if prm800k.grade_answer(answer, ground_truth, variant="mathruler") else 0.0


def geo3k_score(
    predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1
) -> float:
    """verl's geo3k.compute_score: accuracy weighted 1 - format_score, format weighted the rest."""
    return (1.0 - format_score) * acc_reward(
        predict_str, ground_truth, use_boxed
    ) + format_score * format_reward(predict_str)
