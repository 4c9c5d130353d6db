"""Rule-based outcome scorers: verl 0.9.1's `verl/utils/reward_score/` for GSM8K and MATH.

Pure Python, no JAX and no torch: a score is a string check on one decoded completion. Every
function here returns what the verl function it names returns, for every input; the quirks listed
below are verl's and are kept on purpose, because the point is to reproduce verl's reward numbers.
No scorer has a timeout of its own: the caller runs scorers in worker processes with its timeout.

* GSM8K, `gsm8k.py` (`gsm8k_extract`, `gsm8k_score`, `gsm8k_ground_truth`): only the last 300
  characters are searched; "strict" takes the last `#### <number>`, removes commas and "$";
  "flexible" takes the last number-like run that is not "" or "." (verl removes no commas there);
  the comparison is an exact string compare, so "18.0" != "18". `gsm8k_ground_truth` is verl's
  preprocessing (`examples/data_preprocess/gsm8k.py`): the text after "#### ", commas removed.

* MATH, `math_reward.py` (Hendrycks MATH / lm-evaluation-harness): `math_score` is
  `compute_score`, `last_boxed_only_string` and `remove_boxed` are verl's functions of the same
  names, `strip_math_string` is `strip_string` (with `fix_fracs`, `fix_a_slash_b`, `fix_sqrt`,
  `remove_right_units`) and `math_is_equiv` is `is_equiv`. Quirks kept:
  - `\\boxed ` (with a space) anywhere wins over any `\\boxed{`: the answer is the text after the
    last `\\boxed ` up to the next "$", even when a later `\\boxed{...}` exists.
  - `\\fbox{...}` is found (when there is no `\\boxed` at all) but `remove_boxed` rejects it, so an
    fbox answer always scores 0; so does `\\boxed` followed by neither "{" nor " ".
  - the ground truth is not un-boxed; both sides go through the same normalisation. When that
    normalisation fails (two `\\text{ ` units, or `\\frac` / `\\sqrt` with nothing after it) the
    raw strings are compared instead.
  - "0.5" (only as the whole answer) becomes `\\frac{1}{2}`; "a/b" becomes `\\frac{a}{b}` only when
    a and b print back as the same ints ("03/4" stays); an "x = " prefix is dropped only when
    there is exactly one "=" and at most 2 characters before it.
  - any exception makes the score 0 (verl prints it; here it is logged at debug level).

* DAPO, `math_dapo.py`: `math_dapo_score` is `compute_score` (a dict with "score" 1.0 or -1.0,
  "acc" a bool and "pred"), `normalize_final_answer` is verl's function of that name (the
  Minerva normalisation). Quirks kept:
  - only the last 300 characters are scored; the prediction is the last
    `(?i)Answer\\s*:\\s*([^\\n]+)` match (the `\\s*` after the colon may cross a newline), and both
    it and the ground truth are normalised before an exact compare.
  - with no "Answer:" line the last `\\boxed{...}` of the last 100 characters (of the clipped
    text) is compared to the ground truth *as is*, without normalisation; with neither,
    pred is "[INVALID]" and the score -1. A prediction that normalises to "[INVALID]" also falls
    back to the box.
  - `strict_box_verify=True` uses only the box (pred None when there is none).
  - `pause_tokens_index` (4 ints) moves the 100-character box window to end at
    `pause_tokens_index[-1]`, an index into the *clipped* text; a start below 100 makes it a
    negative (from the end) slice start, as in verl. A list of another length raises ValueError
    (verl: AssertionError), and only when the box path is taken, as in verl.
  - a non-str ground truth raises (verl's does too: nothing is caught there).

* Math-Verify, `math_verify.py`: `math_verify_score` wraps the ground truth in `\\boxed{}`, parses
  it with LaTeX extraction and the completion with expression + LaTeX extraction, and scores 1.0
  when any (gold, prediction) pair verifies. verl runs this in a pool of spawned processes with a
  30 s timeout (and math-verify's own 5 s signal alarms inside); here it runs in-process with
  math-verify's timeouts disabled (`parsing_timeout=None`, `timeout_seconds=None`), so it works
  in any thread and the caller's worker timeout bounds it. Any exception scores 0, as in verl.
  The `math-verify` package is imported lazily. Its LaTeX parser (latex2sympy2_extended) ships
  one grammar build per antlr4 runtime and they differ (under 4.13 "14\\%" parses, under 4.9 it
  does not); verl's install has antlr4 4.9.3 (hydra-core pins it), so
  requirements.txt pins `antlr4-python3-runtime==4.9.3` for verl's scores.

* `default_compute_score` is verl's dispatch by `data_source` (`verl.utils.reward_score.
  default_compute_score`) for the sources above and for those scored in their own modules:
  PRIME math (the numina_* sources, prime_math.py, with the PRM800K grader in prm800k.py),
  Geometry3K (geo3k.py), Search-R1 exact match (the searchR1_* sources, qa_em.py) and the code
  sources "codecontests", "apps", "codeforces" and "taco" (rewards/code.py: verl's prime_code,
  run in grpo_jax's sandbox; with sandbox_fusion_url, rewards/sandbox_fusion.py); with verl's
  return conversion (a dict is returned as is, a number or bool as a float, a tuple, e.g. a
  (score, metadata) pair, as the float of its first entry). Any other source raises
  NotImplementedError.
"""

from __future__ import annotations

import logging
import re

from grpo_jax.rewards import code as code_reward
from grpo_jax.rewards import geo3k, math_reward, prime_math, qa_em, sandbox_fusion

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# GSM8K (verl/utils/reward_score/gsm8k.py).

# verl: "Optimization: Regular expression matching on very long strings can be slow."
_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
EXTRACT_METHODS = ("strict", "flexible")


def gsm8k_extract(solution_str: str, *, method: str = "strict") -> str | None:
    """Extracts the final answer string from a completion, exactly as verl's extract_solution.

    Args:
      solution_str: the decoded completion.
      method: "strict" (last `#### <number>`, commas and "$" removed) or "flexible" (last
        number-like run that is not "" or ".", commas kept).

    Returns:
      The answer string, or None when nothing matches.
    """
    if method not in EXTRACT_METHODS:
        raise ValueError(f"gsm8k method must be one of {EXTRACT_METHODS}, got {method!r}")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = _STRICT_RE.findall(solution_str)
        if not solutions:
            return None
        return solutions[-1].replace(",", "").replace("$", "")
    answers = _NUMBER_RE.findall(solution_str)
    final_answer = None
    # verl's loop: when every run is invalid the loop ends on the first run (e.g. "."), which
    # verl then returns; kept for parity.
    for final_answer in reversed(answers):
        if final_answer not in ("", "."):
            break
    return final_answer


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K compute_score: `score` on an exact string match, `format_score` on a
    well-formed wrong answer, 0 when no answer is found."""
    answer = gsm8k_extract(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


def gsm8k_ground_truth(answer_text: str) -> str:
    """The ground truth of a raw GSM8K answer: the number after "#### ", commas removed.

    Raises:
      ValueError: when the answer has no "#### <number>" line.
    """
    match = _STRICT_RE.search(answer_text)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_text[-80:]!r}")
    return match.group(1).replace(",", "")


# ---------------------------------------------------------------------------------------------
# Boxed answers and MATH: rewards/math_reward.py (shared with the PRIME math and Geometry3K
# graders); the public names stay here.

closing_brace = math_reward.closing_brace
last_boxed_only_string = math_reward.last_boxed_only_string
remove_boxed = math_reward.remove_boxed
strip_math_string = math_reward.strip_math_string
math_is_equiv = math_reward.math_is_equiv
math_score = math_reward.math_score


# ---------------------------------------------------------------------------------------------
# DAPO (verl/utils/reward_score/math_dapo.py, Minerva normalisation).

# Applied in order: the articles first, so "a " inside a word ("banana 5") goes too, as in verl.
_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Removed everywhere, also inside words ("cm" in "\\mathrm{cm}", "units" in "unitsquare"), in order.
_DAPO_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# (pattern, replacement), applied in order with re.sub (no DOTALL: "." stops at a newline).
_DAPO_REWRITES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"(.*?)\$(.*?)\$(.*)", r"$\2$"),  # keep the first $...$ of each line
        (r"\\text\{(.*?)\}", r"\1"),
        (r"\\textbf\{(.*?)\}", r"\1"),
        (r"\\overline\{(.*?)\}", r"\1"),
        (r"\\boxed\{(.*)\}", r"\1"),  # greedy: to the last "}" of the line
        (r"frac([^{])(.)", r"frac{\1}{\2}"),  # \fracab -> \frac{a}{b}
        (r"sqrt([^{])", r"sqrt{\1}"),  # \sqrta -> \sqrt{a}
    )
)
_MINERVA_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_INVALID = "[INVALID]"
_DAPO_CLIP_CHARS = 300  # verl: "The longest answer in MATH-500 has 159 characters"
_DAPO_BOX_WINDOW_CHARS = 100


def normalize_final_answer(final_answer: str) -> str:
    """verl's math_dapo.normalize_final_answer (Minerva, Lewkowycz et al. 2022, appendix D).

    Keeps the text after the last "=", drops articles, spaces, units and dollar signs, unwraps
    `\\text`, `\\textbf`, `\\overline` and `\\boxed`, braces shorthand `\\frac12` / `\\sqrt2`, and
    removes thousands commas from a plain integer.
    """
    s = final_answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        s = s.replace(before, after)
    for removed in _DAPO_REMOVED:
        s = s.replace(removed, "")
    for pattern, replacement in _DAPO_REWRITES:
        s = pattern.sub(replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():  # str.isdigit, so also e.g. "²" as in verl
        s = s.replace(",", "")
    return s.strip()


def _dapo_last_boxed_content(text: str) -> str | None:
    """Content of the last "\\boxed{...}" of `text` (math_dapo's box: braces only, no fbox)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{") : end]


def _dapo_box_check(
    solution_str: str, ground_truth: str, pause_tokens_index: list[int] | None
) -> tuple[bool, str | None]:
    """(correct, pred) of math_dapo.is_correct_strict_box: the raw box content vs ground truth."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(
                f"pause_tokens_index must hold 4 indices, got {len(pause_tokens_index)}"
            )
        window = solution_str[pause_tokens_index[-1] - _DAPO_BOX_WINDOW_CHARS :]
    else:
        window = solution_str[-_DAPO_BOX_WINDOW_CHARS:]
    pred = _dapo_last_boxed_content(window)
    return pred == ground_truth, pred


def math_dapo_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """verl's math_dapo.compute_score: Minerva "Answer:" check, falling back to the last box.

    Args:
      solution_str: the decoded completion; only its last 300 characters count.
      ground_truth: the reference answer (normalised for the "Answer:" check, raw for the box).
      strict_box_verify: use only the `\\boxed{}` check.
      pause_tokens_index: 4 indices; the box window ends at the last one (see the module doc).

    Returns:
      {"score": 1.0 or -1.0, "acc": bool, "pred": the normalised "Answer:" text, the raw box
      content, "[INVALID]", or None (strict box check without a box)}.

    Raises:
      ValueError: when the box check runs with a pause_tokens_index not of length 4.
    """
    solution_str = solution_str[-_DAPO_CLIP_CHARS:]
    if strict_box_verify:
        correct, pred = _dapo_box_check(solution_str, ground_truth, pause_tokens_index)
    else:
        matches = _MINERVA_ANSWER_RE.findall(solution_str)
        pred = normalize_final_answer(matches[-1] if matches else _DAPO_INVALID)
        correct = pred == normalize_final_answer(ground_truth)
        if pred == _DAPO_INVALID:
            box_correct, box_pred = _dapo_box_check(solution_str, ground_truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ---------------------------------------------------------------------------------------------
# Math-Verify (verl/utils/reward_score/math_verify.py, huggingface/Math-Verify).


def _import_math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "math_verify_score needs the math-verify package (verl 0.9.1 pins 0.9.0): "
            "pip install math-verify"
        ) from e
    return math_verify


def math_verify_score(solution_str: str, ground_truth: str) -> float:
    """verl's math_verify.compute_score: 1.0 when Math-Verify finds the answers equal, else 0.0.

    Runs in-process without math-verify's signal timeouts (see the module doc).

    Args:
      solution_str: the decoded completion (expressions and LaTeX anywhere in it are tried).
      ground_truth: the reference answer, not boxed; it is parsed as `\\boxed{ground_truth}`.

    Raises:
      ImportError: when math-verify is not installed.
    """
    mv = _import_math_verify()
    try:
        gold = mv.parse(
            "\\boxed{" + ground_truth + "}", (mv.LatexExtractionConfig(),), parsing_timeout=None
        )
        preds = mv.parse(
            solution_str,
            (mv.ExprExtractionConfig(), mv.LatexExtractionConfig()),
            parsing_timeout=None,
        )
        if not (gold and preds):
            return 0.0
        equal = any(mv.verify(g, p, timeout_seconds=None) for p in preds for g in gold)
        return 1.0 if equal else 0.0
    except Exception as e:  # noqa: BLE001 - verl prints the error and scores 0
        _log.debug("math_verify_score: scored 0 after %r", e)
        return 0.0


# ---------------------------------------------------------------------------------------------
# Dispatch by data_source (verl.utils.reward_score.default_compute_score).

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_SOURCE_PREFIX = "aime"
PRIME_MATH_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
GEO3K_SOURCES = ("hiyouga/geometry3k",)
SEARCH_R1_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)


def _unsupported_source_message(data_source) -> str:
    sources = (
        GSM8K_SOURCES
        + MATH_SOURCES
        + DAPO_SOURCES
        + PRIME_MATH_SOURCES
        + GEO3K_SOURCES
        + SEARCH_R1_SOURCES
        + code_reward.SOURCES
    )
    supported = ", ".join(repr(s) for s in sources)
    return (
        f"no rule-based reward for data_source={data_source!r} (nor has verl 0.9.1). "
        f"grpo_jax.reward_score.default_compute_score supports {supported} and any data_source "
        f"starting with {DAPO_SOURCE_PREFIX!r}. For another data source, plug in a custom reward: "
        "set custom_reward_function.path (a Python file) and custom_reward_function.name (the "
        "function in it) in the config, or reward.fn=module:function."
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info=None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore=None,
    memory_limit_mb: int | None = None,
    **kwargs,
) -> float | dict:
    """verl 0.9.1's default_compute_score for its math, geometry, QA and code data sources.

    Args:
      data_source: the dataset's data_source field, e.g. "openai/gsm8k".
      solution_str: the decoded completion.
      ground_truth: the reference answer (for code: JSON of the tests).
      extra_info: unused, as in verl for these sources.
      sandbox_fusion_url: code sources only: a SandboxFusion `/run_code` URL to run the tests
        on (verl's reward.sandbox_fusion.url); None runs them in grpo_jax's sandbox.
      concurrent_semaphore: with sandbox_fusion_url, bounds the requests in flight.
      memory_limit_mb: with sandbox_fusion_url, each run's memory limit (verl sends None as
        is when it is None).
      **kwargs: ignored, as verl ignores what its reward managers add.

    Returns:
      A float (GSM8K: strict `gsm8k_score`; MATH: `math_score`; numina_*: the first entry of
      `prime_math.prime_math_score`; hiyouga/geometry3k: `geo3k.geo3k_score`; searchR1_*:
      `qa_em.qa_em_score`, which reads ground_truth["target"]; code: the pass rate of
      `code.compute_score` or `sandbox_fusion.compute_score`) or the dict of `math_dapo_score`
      ("math_dapo", "math", "math_dapo_reasoning", "aime*").

    Raises:
      NotImplementedError: for any other data_source, naming it, the supported ones and how to
        plug in a custom reward.
    """
    del extra_info, kwargs  # verl's signature; no supported scorer reads them
    if data_source in code_reward.SOURCES:
        if sandbox_fusion_url:
            result = sandbox_fusion.compute_score(
                sandbox_fusion_url,
                concurrent_semaphore,
                memory_limit_mb,
                solution_str,
                ground_truth,
                continuous=True,
            )
        else:
            result = code_reward.compute_score(solution_str, ground_truth, continuous=True)
        return float(result[0])  # verl's conversion of a (score, metadata) pair
    if data_source in GSM8K_SOURCES:
        result = gsm8k_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        result = math_score(solution_str, ground_truth)
    elif data_source in DAPO_SOURCES or data_source.startswith(DAPO_SOURCE_PREFIX):
        result = math_dapo_score(solution_str, ground_truth)
    elif data_source in PRIME_MATH_SOURCES:
        result = prime_math.prime_math_score(solution_str, ground_truth)
    elif data_source in GEO3K_SOURCES:
        result = geo3k.geo3k_score(solution_str, ground_truth)
    elif data_source in SEARCH_R1_SOURCES:
        result = qa_em.qa_em_score(solution_str, ground_truth)
    else:
        raise NotImplementedError(_unsupported_source_message(data_source))
    # verl's conversion: a dict is returned as is, a number becomes a float, a tuple (prime_math's
    # (correct, format_ok, answer)) the float of its first entry.
    if isinstance(result, dict):
        return result
    return float(result[0]) if isinstance(result, tuple) else float(result)
