"""A generative reward model (an LLM judge, verl's GenRM): a causal LM reads a prompt built
from the question and the rollout's response, writes a verdict, and the verdict's parsed number
is the reward (config section `reward_model` with `reward_model.genrm.enable`).

verl 0.9.1 has no built-in judge: with `reward_model.enable` and a `custom_reward_function`,
its reward loop serves the judge checkpoint (`reward_model.model.path`) on a rollout engine of
its own (`reward_model.rollout.*`) behind an OpenAI-compatible router, and the custom function
builds the prompt, sends a chat completion and parses the answer. Its reference function
(tests/experimental/reward_loop/reward_fn.py, `compute_score_gsm8k`, the one its docs show):
  * prompt: `GRM_PROMPT_TEMPLATE.format(problem=extra_info["question"], solution=solution_str)`
    (here DEFAULT_TEMPLATE), the response decoded with the policy's tokenizer and its special
    tokens skipped, sent as one user message, so the server renders it with the *judge's* chat
    template and its generation prompt (`judge_ids`);
  * verdict: the chat completion's text (special tokens skipped);
  * score: ``int(text.split("\\n\\n")[-1].strip())``, and 0 when that raises (`parse_verdict`).

Here the judge is loaded like the policy (grpo_jax.model.load) on the trainer's mesh and sampled
by the native sampler through a rollout engine of its own (rollout.engines.NativeEngine),
with reward_model.rollout's temperature / top_p / top_k (do_sample=False: greedy) and
response_length. An unparsable verdict scores `reward_model.genrm.unparsable_score` (verl's 0)
and is counted (extras "genrm_unparsable"; the metric reward/genrm_unparsable).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from grpo_jax.data import prompts as prompts_lib

# verl 0.9.1's reference judge prompt (tests/experimental/reward_loop/reward_fn.py).
DEFAULT_TEMPLATE = """You are given a problem and a proposed solution.

Problem:
{problem}

Solution:
{solution}

Please evaluate how well the solution addresses the problem. \nGive a score from 1 to 10, where:
- 1 means the solution is completely irrelevant or incorrect.
- 5 means the solution is partially correct but incomplete or not well reasoned.
- 10 means the solution is fully correct, well-reasoned, and directly solves the problem.

Only output the score as a single number (integer)."""

# What a template may name: the question, the policy's response, the row's ground truth.
TEMPLATE_FIELDS = ("problem", "solution", "ground_truth")
# Extra keys a judged batch adds to the reward results (one value per sample).
RESPONSE_KEY = "genrm_response"  # the judge's text (verl's reference function's key)
UNPARSABLE_KEY = "genrm_unparsable"  # True where the verdict did not parse


def template_fields(template: str) -> tuple[str, ...]:
    """The replacement fields of a str.format template, in order.

    Raises:
      ValueError: the template is malformed, or names a field not in TEMPLATE_FIELDS, or lacks
        {solution}.
    """
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"is not a str.format template: {e}") from e
    unknown = sorted(set(names) - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"names {unknown}; a template may name only {list(TEMPLATE_FIELDS)} "
                         "(write literal braces as {{ and }})")  # fmt: skip
    if "solution" not in names:
        raise ValueError("has no {solution}: the judge would not see the response")
    return tuple(names)


def problem_of(example: prompts_lib.Example, key: str) -> str:
    """The {problem} of a row: `extra_info[<name>]` for key "extra_info.<name>" (verl's
    reference reads extra_info["question"]), or the prompt's last user turn for "prompt".

    Raises:
      KeyError: the row's extra_info lacks the key (naming reward_model.genrm.problem_key).
    """
    if key == "prompt":
        if isinstance(example.prompt, str):
            return example.prompt
        users = [m["content"] for m in example.prompt if m.get("role") == "user"]
        return users[-1] if users else ""
    name = key.removeprefix("extra_info.")
    if name not in example.extra_info:
        raise KeyError(
            f"reward_model.genrm.problem_key={key!r}: the row at line {example.line} "
            f"({example.data_source}) has no extra_info[{name!r}] (its keys: "
            f"{sorted(example.extra_info)}); give one every row has, or 'prompt'"
        )
    return str(example.extra_info[name])


def judge_prompt(template: str, *, problem: str, solution: str, ground_truth: Any) -> str:
    """The judge's user message: `template` with the row's fields (str.format, as verl)."""
    return template.format(problem=problem, solution=solution, ground_truth=ground_truth)


def judge_ids(tokenizer, message: str) -> list[int]:
    """The judge's prompt tokens: one user message in its chat template with the generation
    prompt, tokenised without added specials (vLLM's chat completion: the template writes
    them)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_verdict(text: str) -> float | None:
    """verl's reference parse: the integer after the last blank line (surrounding whitespace
    ignored, Python's int() syntax), or None when there is none (verl then scores 0)."""
    try:
        return float(int(text.split("\n\n")[-1].strip()))
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Judge:
    """A loaded judge and how it is run (built by loading.reward_model).

    Attributes:
      config, params: the causal LM (grpo_jax.model.load), on the trainer's mesh.
      tokenizer: the judge's tokenizer (its chat template builds the prompt).
      engine: its rollout engine (rollout.engines.NativeEngine on the trainer's mesh).
      sampling: rollout.engines.SamplingParams of one verdict (reward_model.rollout).
      template: the prompt template (reward_model.genrm.prompt_template).
      problem_key: where {problem} comes from (reward_model.genrm.problem_key).
      parse: verdict text -> score, or None when unparsable (reward_model.genrm.parser).
      unparsable_score: the score of an unparsable verdict.
      prompt_length: the longest judge prompt in tokens (reward_model.rollout.prompt_length).
      weight, with_rules: as reward_model.RewardModel's.
      micro_rows: prompts per generate call (micro_batch_size_per_gpu x batch devices).
    """

    config: Any
    params: Any
    tokenizer: Any
    engine: Any
    sampling: Any
    template: str
    problem_key: str
    parse: Callable[[str], float | None]
    unparsable_score: float
    prompt_length: int
    weight: float
    with_rules: bool
    micro_rows: int


def prompt_rows(judge: Judge, solutions: Sequence[str],
                examples: Sequence[prompts_lib.Example]) -> list[list[int]]:  # fmt: skip
    """Each response's judge prompt tokens.

    Raises:
      ValueError: a prompt is longer than reward_model.rollout.prompt_length (vLLM refuses
        such a request, and verl's reward loop raises).
    """
    rows = []
    for solution, ex in zip(solutions, examples, strict=True):
        message = judge_prompt(
            judge.template,
            problem=problem_of(ex, judge.problem_key),
            solution=solution,
            ground_truth=ex.ground_truth,
        )
        ids = judge_ids(judge.tokenizer, message)
        if len(ids) > judge.prompt_length:
            raise ValueError(
                f"a judge prompt has {len(ids)} tokens, more than "
                f"reward_model.rollout.prompt_length={judge.prompt_length}: raise it (the "
                "prompt holds the question and the whole response)"
            )
        rows.append(ids)
    return rows


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, *,
             num_rows: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Left-padded (ids, mask) [num_rows, T] (the sampler's prompt layout), T the longest row;
    rows past len(rows) repeat the last one (padding of a fixed batch shape, dropped after)."""
    rows = list(rows) + [rows[-1]] * (num_rows - len(rows))
    T = max(len(r) for r in rows)
    ids = np.full((num_rows, T), pad_id, np.int32)
    mask = np.zeros((num_rows, T), np.int32)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    return ids, mask


def verdicts(judge: Judge, rows: Sequence[Sequence[int]], rng) -> list[str]:
    """The judge's text for each prompt row, judge.micro_rows rows per generate call (the last
    call padded to that shape); call i samples with fold_in(rng, i)."""
    out = []
    for i, start in enumerate(range(0, len(rows), judge.micro_rows)):
        chunk = rows[start : start + judge.micro_rows]
        ids, mask = left_pad(chunk, judge.engine.pad_id, num_rows=judge.micro_rows)
        rollout = judge.engine.sample(
            judge.params, ids, mask, jax.random.fold_in(rng, i), judge.sampling
        )
        resp = np.asarray(jax.device_get(rollout.response_ids))[: len(chunk)]
        lengths = np.asarray(jax.device_get(rollout.response_mask)).sum(1)[: len(chunk)]
        out += judge.tokenizer.batch_decode(
            [r[:n] for r, n in zip(resp, lengths, strict=True)], skip_special_tokens=True
        )
    return out


def score(judge: Judge, solutions: Sequence[str], examples: Sequence[prompts_lib.Example],
          rng) -> tuple[np.ndarray, dict[str, list]]:  # fmt: skip
    """Scores [B] float32 of B responses (decoded as verl's reward managers do: special tokens
    skipped) and the extras {RESPONSE_KEY: the verdicts, UNPARSABLE_KEY: where they did not
    parse (scored judge.unparsable_score)}."""
    if not solutions:
        return np.zeros((0,), np.float32), {RESPONSE_KEY: [], UNPARSABLE_KEY: []}
    texts = verdicts(judge, prompt_rows(judge, solutions, examples), rng)
    parsed = [judge.parse(t) for t in texts]
    scores = [judge.unparsable_score if p is None else float(p) for p in parsed]
    extras = {RESPONSE_KEY: texts, UNPARSABLE_KEY: [p is None for p in parsed]}
    return np.asarray(scores, np.float32), extras
