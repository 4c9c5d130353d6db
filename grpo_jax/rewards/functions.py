"""Reward functions: the three signatures, weighted sums of several, and scoring a batch safely.

Pure Python, no JAX: rewards are checks on decoded completions. The scorers themselves (verl's
GSM8K, MATH, DAPO, ... and `default_compute_score`) live in grpo_jax/rewards/scorers.py.

* Signatures, told apart by the parameter names of the function (`signature_style`):
  - "verl": `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, one call
    per sample, returning a float, or a dict whose "score" is the reward and whose other keys
    are logged (verl's `custom_reward_function`).
  - "trl": `fn(prompts, completions, **columns) -> list[float]`, one call per batch (TRL's
    GRPOTrainer). Prompts are the dataset's prompts; completions are strings, or, for chat
    prompts, `[{"role": "assistant", "content": text}]` as TRL passes them; every other column
    of the row is a keyword argument (`ground_truth`, `data_source` and `extra_info` too).
  - "pair": `fn(solution_str, ground_truth) -> float` (grpo_jax 0.1's).
* `RewardFn` is a weighted sum of named functions (config `reward.fn`, `reward.weights`, or
  verl's `custom_reward_function.path` / `.name`, which replaces reward.fn).
* `score_batch` runs the calls in a `reward_pool.Pool` (per-call timeout, crash isolation) or
  inline. A call that raises (or returns a non-finite value or a malformed result) either stops
  the run with an error naming the function, the sample and the completion
  (`on_error="raise"`) or scores 0 and is counted (`on_error="zero"`). A call that times out or
  whose worker dies always scores 0 and is counted, as verl's scorers give their timeout_score
  of 0: a strange completion costs that sample, never the run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from grpo_jax import registry
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import pool as reward_pool
from grpo_jax.rewards import scorers

# The GSM8K scorer's public names, kept from grpo_jax 0.1 (now in reward_score).
gsm8k_extract = scorers.gsm8k_extract
gsm8k_score = scorers.gsm8k_score
gsm8k_ground_truth = scorers.gsm8k_ground_truth
EXTRACT_METHODS = scorers.EXTRACT_METHODS
ON_ERROR_MODES = ("raise", "zero")  # reward.on_error
STYLES = ("verl", "trl", "pair")


def signature_style(fn: Callable, name: str = "") -> str:
    """ "verl", "trl" or "pair" from the parameter names (see the module docstring)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward function {name or fn!r}: cannot read its signature ({e})") from e
    names = list(params)
    if "completions" in params:
        return "trl"
    if names[:3] == ["data_source", "solution_str", "ground_truth"]:
        return "verl"
    positional = [
        p
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) == 2:
        return "pair"
    raise ValueError(
        f"reward function {name or fn!r} has parameters {names}; expected verl's "
        "(data_source, solution_str, ground_truth, extra_info=None), TRL's (prompts, "
        "completions, **kwargs) or (solution_str, ground_truth)"
    )


def load_function(spec: str) -> Callable:
    """Imports a reward function named "module:function"
    ("grpo_jax.rewards.scorers:gsm8k_score")."""
    fn = registry.import_callable(spec)
    signature_style(fn, spec)
    return fn


def load_file_function(path: str, name: str) -> Callable:
    """verl's custom_reward_function: function `name` of the Python file `path`."""
    if not os.path.isfile(path):
        raise ValueError(f"custom_reward_function.path={path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"custom_reward_function.path={path!r} failed to import: {e!r}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r}: {path!r} defines no such function")
    signature_style(fn, f"{path}:{name}")
    return fn


@dataclasses.dataclass(frozen=True)
class RewardFn:
    """A weighted sum of reward functions.

    Attributes:
      names: a name per function (used in errors and metrics).
      fns: the callables (any of the three signatures).
      weights: one weight per function.
      on_error: "raise" or "zero" (what a raising call does).
    """

    names: tuple[str, ...]
    fns: tuple[Callable, ...]
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
        for name, fn in zip(self.names, self.fns, strict=True):
            signature_style(fn, name)

    @classmethod
    def of(cls, *fns: Callable, weights: Sequence[float] | None = None, on_error="raise"):
        """From callables (library use): names are their __name__s."""
        names = tuple(getattr(f, "__name__", repr(f)) for f in fns)
        weights = tuple(weights) if weights is not None else (1.0,) * len(fns)
        return cls(names, tuple(fns), tuple(float(w) for w in weights), on_error)


def make_reward_fn(specs: str, weights: str = "", *, on_error: str = "raise") -> RewardFn:
    """A RewardFn from comma-separated "module:function" specs and optional weights.

    Args:
      specs: e.g. "grpo_jax.rewards.scorers:gsm8k_score,my_pkg.fmt:reward" (config reward.fn).
      weights: e.g. "1.0,0.1"; empty means weight 1 for every function (reward.weights).
      on_error: "raise" or "zero" (reward.on_error).
    """
    names = registry.split_list(specs)
    if not names:
        raise ValueError(f"reward.fn={specs!r} is empty: give at least one 'module:function'")
    try:
        values = tuple(float(w) for w in registry.split_list(weights)) or (1.0,) * len(names)
    except ValueError:
        raise ValueError(f"reward.weights={weights!r} must be comma-separated floats") from None
    if len(values) != len(names):
        raise ValueError(
            f"reward.weights={weights!r} has {len(values)} weights for {len(names)} functions "
            "in reward.fn"
        )
    if on_error not in ON_ERROR_MODES:
        raise ValueError(f"reward.on_error={on_error!r} must be one of {list(ON_ERROR_MODES)}")
    return RewardFn(names, tuple(load_function(s) for s in names), values, on_error)


def from_file(path: str, name: str = "compute_score", *, on_error: str = "raise") -> RewardFn:
    """verl's custom_reward_function: the scorer `name` of the Python file `path`, alone."""
    return RewardFn((f"{path}:{name}",), (load_file_function(path, name),), (1.0,), on_error)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Scores of one batch.

    Attributes:
      scores_B: the weighted total per sample.
      per_fn: per function name, the raw (unweighted) score of every sample.
      extras: per extra key of dict results (e.g. "acc", "pred"), one value per sample (None
        where a sample's result lacked it); with several functions the keys are
        "<function>/<key>".
      num_errors: calls that raised or returned a bad value and were scored 0 (on_error="zero").
      num_lost: calls that timed out or whose worker died (scored 0 whatever on_error says).
      dict_results: per function name, whether each sample's call returned a dict (see
        `reward_extra_info`).
    """

    scores_B: list[float]
    per_fn: dict[str, list[float]]
    extras: dict[str, list[Any]]
    num_errors: int
    num_lost: int
    dict_results: dict[str, list[bool]] = dataclasses.field(default_factory=dict)

    def take(self, rows: Sequence[int]) -> RewardResult:
        """The results of the samples `rows` (error counts are the batch's)."""
        return RewardResult(
            [self.scores_B[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in self.per_fn.items()},
            {k: [v[i] for i in rows] for k, v in self.extras.items()},
            self.num_errors,
            self.num_lost,
            {k: [v[i] for i in rows] for k, v in self.dict_results.items()},
        )

    @classmethod
    def concat(cls, parts: Sequence[RewardResult]) -> RewardResult:
        """The results of consecutive batches as one (an extra key missing from a part is None
        on that part's samples)."""
        keys = list(dict.fromkeys(k for p in parts for k in p.extras))
        names = list(dict.fromkeys(k for p in parts for k in p.per_fn))
        return cls(
            [s for p in parts for s in p.scores_B],
            {k: [v for p in parts for v in p.per_fn.get(k, [0.0] * len(p.scores_B))]
             for k in names},
            {k: [v for p in parts for v in p.extras.get(k, [None] * len(p.scores_B))]
             for k in keys},
            sum(p.num_errors for p in parts),
            sum(p.num_lost for p in parts),
            {k: [v for p in parts for v in p.dict_results.get(k, [False] * len(p.scores_B))]
             for k in names},
        )


class RewardError(RuntimeError):
    """A reward function failed under on_error="raise"."""


def _completion(example: prompts_lib.Example, text: str):
    return text if isinstance(example.prompt, str) else [{"role": "assistant", "content": text}]


def _calls(
    style: str, fn: Callable, solutions: Sequence[str], examples: Sequence[prompts_lib.Example]
):
    if style == "trl":
        rows = [
            {
                **ex.columns,
                "ground_truth": ex.ground_truth,
                "data_source": ex.data_source,
                "extra_info": ex.extra_info,
            }
            for ex in examples
        ]
        keys = dict.fromkeys(k for row in rows for k in row)
        columns = {k: [row.get(k) for row in rows] for k in keys}
        kwargs = dict(
            prompts=[ex.prompt for ex in examples],
            completions=[_completion(ex, s) for ex, s in zip(examples, solutions, strict=True)],
            **columns,
        )
        return [(fn, (), kwargs)]
    if style == "verl":
        return [
            (fn, (ex.data_source, s, ex.ground_truth, ex.extra_info), {})
            for s, ex in zip(solutions, examples, strict=True)
        ]
    return [(fn, (s, ex.ground_truth), {}) for s, ex in zip(solutions, examples, strict=True)]


def _as_score(value) -> tuple[float, dict]:
    """A call's result -> (score, extra keys); raises ValueError on a malformed one."""
    extra = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score': {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned non-finite value {score}")
    return score, extra


def score_batch(
    reward_fn: RewardFn,
    solutions: Sequence[str],
    examples: Sequence[prompts_lib.Example],
    *,
    pool: reward_pool.Pool | None = None,
) -> RewardResult:
    """Scores every completion with every function of `reward_fn` (see the module docstring).

    Args:
      reward_fn: the functions and weights.
      solutions: B decoded completions (special tokens skipped).
      examples: the B Examples they answer (repeated n times per prompt).
      pool: worker processes; None runs the calls in this process without a timeout.

    Raises:
      RewardError: with on_error="raise", naming the function, the sample and the completion.
    """
    return Scoring(reward_fn, examples, pool=pool).result(solutions)


class Scoring:
    """One batch's scoring, fed row by row: `score_batch` with rows submitted early.

    `add(i, solution)` submits sample i's calls at once (to the pool's workers, or inline to a
    helper thread of this object, one call at a time, as verl's reward loop runs its scorers in
    an executor); `result(solutions)` submits the rest (the samples not added, and TRL-style
    functions, whose one call takes the whole batch), waits for every call and builds the
    RewardResult exactly as `score_batch` does: the same scores, extras, error handling and
    counts, whatever was added when. Without `add` it is `score_batch` (inline calls then run
    on the caller's thread).

    Args:
      reward_fn: the functions and weights.
      examples: the B Examples the completions answer.
      pool: worker processes; None runs the calls in this process without a timeout.
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        examples: Sequence[prompts_lib.Example],
        *,
        pool: reward_pool.Pool | None = None,
    ):
        self.reward_fn, self.examples, self.pool = reward_fn, list(examples), pool
        self.styles = [signature_style(f, name) for name, f in zip(reward_fn.names, reward_fn.fns)]
        self.added: dict[int, str] = {}  # sample -> its completion
        # (function, sample) -> (pool ticket, future or call; when it was submitted)
        self._jobs: dict[tuple[int, int], tuple[object, float]] = {}
        self._spans: list[tuple[float, float]] = []  # (submitted, done) of every call
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None

    def add(self, i: int, solution: str) -> None:
        """Submits sample i's calls (every function but the TRL-style ones)."""
        if i in self.added:
            raise ValueError(f"sample {i} was added twice")
        self.added[i] = solution
        if self.pool is None and self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "reward-inline")
        for f, (fn, style) in enumerate(zip(self.reward_fn.fns, self.styles, strict=True)):
            if style != "trl":
                (call,) = _calls(style, fn, [solution], [self.examples[i]])
                self._jobs[f, i] = self._submit(call)

    def _submit(self, call) -> tuple[object, float]:
        t = time.perf_counter()
        if self.pool is not None:
            return self.pool.submit(call), t
        if self._helper is not None:
            return self._helper.submit(reward_pool.run_one, call), t
        return call, t  # run by `_outcomes` on the caller's thread

    def _outcomes(self, jobs: list) -> list[reward_pool.Outcome]:
        if self.pool is not None:
            return self.pool.wait(jobs)
        if self._helper is not None:
            return [job.result() for job in jobs]
        return reward_pool.run_inline(jobs)

    def overlapped_s(self, until: float) -> float:
        """Wall seconds before `until` (a time.perf_counter() value, e.g. when generation
        ended) in which some call of this batch was queued or running (after `result`)."""
        total, reach = 0.0, -math.inf
        for start, stop in sorted(self._spans):
            start, stop = max(start, reach), min(stop, until)
            if stop > start:
                total += stop - start
            reach = max(reach, stop)
        return total

    def result(self, solutions: Sequence[str]) -> RewardResult:
        """Every sample's scores: `solutions` are the B completions (those added included, which
        must be the same strings)."""
        examples, reward_fn = self.examples, self.reward_fn
        if len(solutions) != len(examples):
            raise ValueError(f"{len(solutions)} solutions but {len(examples)} examples")
        for i, text in self.added.items():
            if solutions[i] != text:
                raise ValueError(f"sample {i} was scored as {text!r} but is now {solutions[i]!r}")
        batch = len(solutions)
        calls, owners = [], []
        for f, (fn, style) in enumerate(zip(reward_fn.fns, self.styles, strict=True)):
            if style == "trl":
                calls.append(self._submit(_calls(style, fn, solutions, examples)[0]))
                owners.append(f)
                continue
            for i in range(batch):
                if (f, i) not in self._jobs:
                    self._jobs[f, i] = self._submit(_calls(style, fn, [solutions[i]],
                                                           [examples[i]])[0])  # fmt: skip
                calls.append(self._jobs[f, i])
                owners.append(f)
        try:
            outcomes = self._outcomes([job for job, _ in calls])
        finally:
            if self._helper is not None:
                self._helper.shutdown(wait=False)
        self._spans = [(t, o.done_at) for (_, t), o in zip(calls, outcomes, strict=True)]
        styles = self.styles

        per_fn = {name: [0.0] * batch for name in reward_fn.names}
        dict_results = {name: [False] * batch for name in reward_fn.names}
        extras: dict[str, list[Any]] = {}
        totals = [0.0] * batch
        num_errors = num_lost = 0
        prefix = len(reward_fn.names) > 1
        samples_of = {f: 0 for f in range(len(reward_fn.fns))}  # next sample index per function

        def fail(name, i, why, *, lost):
            nonlocal num_errors, num_lost
            where = (
                f"reward function {name} on sample {i} (ground truth "
                f"{examples[i].ground_truth!r}, completion tail {solutions[i][-200:]!r})"
            )
            if lost:
                num_lost += 1
                logging.warning("%s: %s; scored 0", where, why)
                return
            if reward_fn.on_error == "raise":
                raise RewardError(
                    f"{where} failed: {why} (reward.on_error='zero' scores such "
                    "samples 0 and counts them)"
                )
            num_errors += 1
            logging.warning("%s failed: %s; scored 0", where, why.strip().splitlines()[-1])

        for f, outcome in zip(owners, outcomes, strict=True):
            name, style = reward_fn.names[f], styles[f]
            if style == "trl":
                indices = range(batch)
                results = outcome.value
                if outcome.error is None and not (
                    isinstance(results, Sequence) and len(results) == batch
                ):
                    got = len(results) if isinstance(results, Sequence) else type(results).__name__
                    outcome = reward_pool.Outcome(
                        error=f"returned {got!r} results, expected a list of {batch} scores"
                    )
            else:
                indices = [samples_of[f]]
                samples_of[f] += 1
                results = [outcome.value]
            for j, i in enumerate(indices):
                if outcome.error is not None:
                    fail(name, i, outcome.error, lost=outcome.lost)
                    continue
                try:
                    score, extra = _as_score(results[j])
                except (TypeError, ValueError) as e:
                    fail(name, i, repr(e), lost=False)
                    continue
                per_fn[name][i] = score
                dict_results[name][i] = isinstance(results[j], dict)
                totals[i] += reward_fn.weights[f] * score
                for k, v in extra.items():
                    extras.setdefault(f"{name}/{k}" if prefix else k, [None] * batch)[i] = v
        return RewardResult(totals, per_fn, extras, num_errors, num_lost, dict_results)


def reward_extra_info(result: RewardResult, key: str) -> list[Any]:
    """verl's `reward_extra_info[key]` of every sample, None where verl would not have the key.

    verl 0.9.1's reward managers (experimental/reward_loop/reward_manager/naive.py and dapo.py,
    `run_single`) put every key of a dict result there, "score" included, and a plain score as
    "acc" (before the overlong penalty); the DAPO manager adds "overlong_reward" and
    "overlong" with overlong_buffer.log. verl has one scorer; with several reward functions
    (reward.fn "a,b") the keys are those of `extras`, "<function>/<key>".
    """
    values = list(result.extras.get(key, [None] * len(result.scores_B)))
    if len(result.per_fn) != 1 or key not in ("score", "acc"):
        return values
    (name,) = result.per_fn
    raw, is_dict = result.per_fn[name], result.dict_results[name]
    if key == "score":  # only a dict result has it
        return [s if d else None for s, d in zip(raw, is_dict, strict=True)]
    return [v if d else s for v, s, d in zip(values, raw, is_dict, strict=True)]
