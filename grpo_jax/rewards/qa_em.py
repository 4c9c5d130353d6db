"""Search-R1 exact-match QA scorer: verl 0.9.1's `verl/utils/reward_score/search_r1_like_qa_em.py`.

Pure Python. The answer is the last `<answer>...</answer>` span of the completion; it and each
gold answer are normalised the SQuAD way (lower case, ASCII punctuation removed, the articles
"a", "an", "the" removed as whole words, whitespace collapsed) and compared for equality
(`qa_em_score`) or containment (`qa_subem_score`, verl's `compute_score_subem`). Quirks kept:

* The ground truth is a dict whose "target" is one gold answer (a str) or an iterable of them
  (a list, or the NumPy array a parquet row gives); anything else raises, as in verl.
* The answer span is non-greedy across newlines, stripped, and the *last* span counts; with no
  closed span the score is int 0 (not `format_score`), a well-formed wrong answer scores
  `format_score`. `default_compute_score` makes the int a float, as verl's dispatch does.
* A correct answer in a completion holding more than 10 "<answer>" or more than 10 "</answer>"
  tags scores `score / 4` (exact match only; the substring variant has no such penalty).
* Punctuation is removed before articles, so "the-end" becomes "theend" and keeps its "the";
  `\\b` is Unicode-aware, so "à" next to "a" is a word character.
* `method` is accepted and ignored, as in verl.

One difference, not a score: verl draws `random.randint(1, 64)` from Python's global generator on
every call to decide whether to print the example; these functions touch no global state.
"""

from __future__ import annotations

import re
import string

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
# verl: "prevent output a lot of </answer>".
MAX_ANSWER_TAGS = 10


def normalize_answer(text: str) -> str:
    """SQuAD answer normalisation, in verl's order: lower, punctuation, articles, whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def _golden_answers(target) -> list:
    return [target] if isinstance(target, str) else list(target)


def em_check(prediction: str, golden_answers) -> int:
    """1 when the normalised prediction equals a normalised gold answer, else 0 (verl's int)."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in _golden_answers(golden_answers)))


def subem_check(prediction: str, golden_answers) -> int:
    """1 when a normalised gold answer is a substring of the normalised prediction, else 0."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) in pred for g in _golden_answers(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>`, or None when there is none."""
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def qa_em_score(
    solution_str: str,
    ground_truth: dict,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> int | float:
    """verl's search_r1_like_qa_em.compute_score (exact match).

    Args:
      solution_str: the decoded completion.
      ground_truth: {"target": a gold answer or an iterable of them}.
      method: ignored, as in verl.
      format_score: the score of an answer that is present but wrong.
      score: the score of a correct answer (a quarter of it with more than 10 answer tags).

    Returns:
      int 0 without an answer span, else `score`, `score / 4` or `format_score` as given.
    """
    del method  # verl's signature; it reads no method
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, ground_truth["target"]):
        return format_score
    too_many = (
        solution_str.count("<answer>") > MAX_ANSWER_TAGS
        or solution_str.count("</answer>") > MAX_ANSWER_TAGS
    )
    return score / 4 if too_many else score


def qa_subem_score(
    solution_str: str,
    ground_truth: dict,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> int | float:
    """verl's search_r1_like_qa_em.compute_score_subem: a gold answer inside the answer span."""
    del method
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, ground_truth["target"]) else format_score
