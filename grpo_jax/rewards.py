"""Outcome rewards: verl's GSM8K scorer, user reward functions and their weighted combination.

Pure Python, no JAX: rewards are string checks on decoded completions.

* `gsm8k_score` / `gsm8k_extract` reproduce `verl/utils/reward_score/gsm8k.py` (verl 0.9.1):
  only the last 300 characters are searched; "strict" takes the last `#### <number>`, removes
  commas and "$"; "flexible" takes the last number-like run that is not "" or "." (verl removes
  no commas there); the comparison is an exact string compare, so "18.0" != "18".
* `gsm8k_ground_truth` is verl's preprocessing (`examples/data_preprocess/gsm8k.py`): the text
  after "#### " with thousands commas removed.
* A user reward function is named "module:function" and called as `fn(solution_str,
  ground_truth) -> float`. `RewardFn` combines several with weights; a function that raises
  either aborts with an error naming the function and the sample (`on_error="raise"`) or scores
  0 and is counted (`on_error="zero"`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence

# verl: "Optimization: Regular expression matching on very long strings can be slow."
_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
EXTRACT_METHODS = ("strict", "flexible")
ON_ERROR_MODES = ("raise", "zero")


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


def load_function(spec: str) -> Callable[[str, str], float]:
    """Imports a reward function named "module:function" (e.g. "grpo_jax.rewards:gsm8k_score")."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function must be 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


@dataclasses.dataclass(frozen=True)
class RewardFn:
    """A weighted sum of reward functions, each called as fn(solution_str, ground_truth).

    Attributes:
      names: "module:function" of each function (used in errors and metrics).
      fns: the callables.
      weights: one weight per function.
      on_error: "raise" (error naming function and sample) or "zero" (score 0, counted).
    """

    names: tuple[str, ...]
    fns: tuple[Callable[[str, str], float], ...]
    weights: tuple[float, ...]
    on_error: str = "raise"

    def __post_init__(self):
        if not self.fns:
            raise ValueError("reward.fn: at least one reward function is required")
        if not (len(self.names) == len(self.fns) == len(self.weights)):
            raise ValueError(
                f"reward.weights: {len(self.weights)} weights for {len(self.fns)} functions"
            )
        if self.on_error not in ON_ERROR_MODES:
            raise ValueError(
                f"reward.on_error must be one of {ON_ERROR_MODES}, got {self.on_error!r}"
            )


def make_reward_fn(specs: str, weights: str = "", *, on_error: str = "raise") -> RewardFn:
    """Builds a RewardFn from comma-separated "module:function" specs and optional weights.

    Args:
      specs: e.g. "grpo_jax.rewards:gsm8k_score,my_pkg.fmt:reward" (config field reward.fn).
      weights: e.g. "1.0,0.1"; empty means weight 1 for every function (reward.weights).
      on_error: "raise" or "zero" (reward.on_error).
    """
    names = tuple(s.strip() for s in specs.split(",") if s.strip())
    if weights.strip():
        try:
            ws = tuple(float(w) for w in weights.split(","))
        except ValueError as e:
            raise ValueError(
                f"reward.weights must be comma-separated floats, got {weights!r}"
            ) from e
    else:
        ws = (1.0,) * len(names)
    return RewardFn(names, tuple(load_function(n) for n in names), ws, on_error)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Scores of one batch.

    Attributes:
      scores_B: the weighted total per sample.
      per_fn: per function name, the raw (unweighted) scores of every sample.
      num_errors: how many (function, sample) calls raised and were scored 0.
    """

    scores_B: list[float]
    per_fn: dict[str, list[float]]
    num_errors: int


def score_batch(
    reward_fn: RewardFn, solutions: Sequence[str], ground_truths: Sequence[str]
) -> RewardResult:
    """Scores every (solution, ground truth) pair with every function of `reward_fn`.

    Raises:
      RuntimeError: with on_error="raise", naming the function, the sample index and the text,
        when a function raises or returns a non-finite value.
    """
    if len(solutions) != len(ground_truths):
        raise ValueError(f"{len(solutions)} solutions but {len(ground_truths)} ground truths")
    per_fn = {name: [] for name in reward_fn.names}
    totals = [0.0] * len(solutions)
    num_errors = 0
    for name, fn, w in zip(reward_fn.names, reward_fn.fns, reward_fn.weights):
        for i, (sol, gt) in enumerate(zip(solutions, ground_truths)):
            try:
                value = float(fn(sol, gt))
                if not math.isfinite(value):
                    raise ValueError(f"returned non-finite value {value}")
            except Exception as e:  # noqa: BLE001 - user code may raise anything
                if reward_fn.on_error == "raise":
                    raise RuntimeError(
                        f"reward function {name} failed on sample {i} "
                        f"(ground truth {gt!r}, solution tail {sol[-200:]!r}): {e!r}"
                    ) from e
                logging.warning("reward function %s failed on sample %d: %r (scored 0)", name, i, e)
                num_errors += 1
                value = 0.0
            per_fn[name].append(value)
            totals[i] += w * value
    return RewardResult(totals, per_fn, num_errors)
