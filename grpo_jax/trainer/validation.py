"""Validation: sample the validation prompts, score them, and report per data source.

The metrics are verl 0.9.1's, names and values (its V1 trainer's `_validate` and
`_val_metrics_update`, and metric_utils.process_validation_metrics; docs/verl.md,
"Validation"):

  variables  per sample, "reward" (the sequence reward with DAPO's overlong penalty under
             reward.overlong_buffer, in float32 like verl's rm_scores) and every key of verl's
             reward_extra_info: "acc" = the score for a scorer returning a number, every key of
             a dict result ("score" included) otherwise, "overlong_reward" / "overlong" with
             reward.overlong_buffer.log (`verl_variables`);
  per prompt `<var>/mean@N` and, for N = rollout.val_kwargs.n > 1, `std@N` and, for k in
             2, 4, 8, ... below N and N itself (`subset_sizes`), the mean and std over 1000
             bootstrap draws of k samples (seed 42, verl's very draws: `bootstrap_indices`) of
             the best (`best@k/mean`, `best@k/std`), the worst (`worst@k/...`) and, when every
             sample has a "pred", the majority vote's value (`maj@k/...`) (`prompt_metrics`);
             string variables ("pred") are not measured;
  per source the mean over its prompts (`source_metrics`), plus "acc_success_only" and
             zero-padded "acc" where a source reports "acc" (verl's V1 expected counts);
  keys       `val-core/<source>/<var>/<metric>` for the core variable ("acc" when the source has
             it, else "reward") and its mean@ / best@ / maj@ metrics at the largest N, mean and
             std alike; `val-aux/...` for the rest (`prefixed`); and val-aux/num_turns/* (2 per
             sample: single-turn). GSM8K's accuracy is thus val-core/openai/gsm8k/acc/mean@1.

grpo_jax also logs val-aux/response_length/mean (verl does not). The first
trainer.log_val_generations samples of each validation go to workdir/val_generations.jsonl
(`write_generations`). Sampling uses rollout.val_kwargs' temperature, top_p and top_k; like
verl's rollout, nothing reads val_kwargs.do_sample (config.ValKwargs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Sequence

import jax
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import distributed
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import reward_model as reward_model_lib
from grpo_jax.rollout import engines
from grpo_jax.trainer import rollout_stage


def validate(
    engine: engines.Engine, params, prompts: prompts_lib.PromptSet, **kwargs
) -> dict[str, float]:
    """The metrics of `run(engine, params, prompts, **kwargs)` (same arguments)."""
    return run(engine, params, prompts, **kwargs).metrics


@dataclasses.dataclass(frozen=True)
class Validation:
    """One validation pass: verl's metrics, and the first samples (trainer.log_val_generations)
    as {"input", "output", "score", "ground_truth"} dicts; with `run(..., keep_outputs=True)`
    every sample's completion and reward results, n per prompt in prompt order
    (trainer.validation_data_dir)."""

    metrics: dict[str, float]
    generations: list[dict]
    outputs: list[str] | None = None
    result: reward_fns.RewardResult | None = None


def run(
    engine: engines.Engine,
    params,
    prompts: prompts_lib.PromptSet,
    *,
    reward_fn: reward_fns.RewardFn,
    tokenizer,
    sampling: engines.SamplingParams,
    batch_size: int,
    pad_id: int,
    seed: int,
    prompt_width: int = 0,
    pool=None,
    policy_version: int | None = None,
    num_generations: int = 0,
    overlong_buffer: config_lib.OverlongBufferConfig = config_lib.OverlongBufferConfig(),
    keep_outputs: bool = False,
    agent=None,
    reward_model=None,
) -> Validation:
    """`validate`, returning a Validation with the first `num_generations` samples (and with
    `keep_outputs` every completion, gathered from every process).

    The prompts go in chunks of `batch_size`; the last chunk is padded with its last prompt so
    every call has one compiled shape (the padding rows are not scored), each chunk left-padded
    to `prompt_width` columns at least (prompts_lib.pad_width). `overlong_buffer`
    (reward.overlong_buffer) penalises overlong responses as in training: verl's DAPO reward
    manager scores validation the same way. With `agent` (rollout.multi_turn) the samples are
    multi-turn trajectories, as verl validates them, and num_turns is theirs. With
    `reward_model` (loading.reward_model: a classifier or a judge) the rows are scored as in
    training (rollout_stage.score_with_model), as verl's _validate does: its score replaces the
    rule reward, or joins it when reward.fn lists rule functions too.
    """
    n = sampling.n
    results, sources, lengths, generations, outputs, turns = [], [], [], [], [], []
    procs = jax.process_count()
    if procs > 1 and batch_size % procs:
        raise ValueError(
            f"data.val_batch_size={batch_size} must be a multiple of the {procs} JAX processes "
            "(each samples and scores its block of every validation batch)"
        )
    for start in range(0, len(prompts), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        real = len(idx)
        idx += [idx[-1]] * (batch_size - real)
        rows = distributed.process_rows(batch_size) if procs > 1 else None
        pb = prompts_lib.make_batch(
            prompts, idx, pad_token_id=pad_id, rows=rows, width=prompt_width
        )
        rollout, examples, _ = rollout_stage.sample_rollout(
            engine, params, pb, jax.random.key(seed), sampling, agent=agent,
            policy_version=policy_version,
        )  # fmt: skip
        lo, hi = (0, batch_size) if rows is None else rows
        hi = min(hi, real)  # padding prompts are not scored
        lo = min(lo, hi)
        ids = distributed.to_host(rollout.response_ids)[lo * n : hi * n]
        mask = distributed.to_host(rollout.response_mask)[lo * n : hi * n]
        texts = rollout_stage.decode(tokenizer, ids, mask)
        all_examples, examples = examples, examples[lo * n : hi * n]
        if rollout.num_turns is not None:  # multi-turn (one process)
            turns += distributed.to_host(rollout.num_turns)[lo * n : hi * n].tolist()
        if reward_model is None or reward_model.with_rules:
            res = reward_fns.score_batch(reward_fn, texts, examples, pool=pool)
        else:  # verl: the reward model's score replaces the rule reward
            res = None
        if reward_model is not None:
            res = _with_model_scores(
                res, reward_model, tokenizer, pb, rollout, all_examples, n=n, real=real,
                rows=(lo, hi), rng=jax.random.fold_in(jax.random.key(seed), start),
            )  # fmt: skip
        res = rollout_stage.with_overlong_penalty(
            res, mask.sum(1), overlong_buffer, max_response_length=sampling.max_new_tokens
        )
        for text, ex, sc in zip(texts, examples, res.scores_B, strict=True):
            if len(generations) < num_generations:  # this process's samples
                generations.append(
                    {
                        "input": _prompt_text(ex.prompt),
                        "output": text,
                        "score": sc,
                        "ground_truth": ex.ground_truth,
                    }
                )
        chunk_lengths = mask.sum(1).tolist()
        chunk_texts = texts if keep_outputs else []
        if rows is not None:  # every process's results, in row order
            parts = distributed.gather_objects([(res, chunk_lengths, chunk_texts)])
            res = reward_fns.RewardResult.concat([r for r, _, _ in parts])
            chunk_lengths = [v for _, c, _ in parts for v in c]
            chunk_texts = [t for _, _, ts in parts for t in ts]
        outputs += chunk_texts
        results.append(res)
        sources += [ex.data_source for ex in pb.examples[:real] for _ in range(n)]
        lengths += chunk_lengths
    merged = reward_fns.RewardResult.concat(results)  # a key missing from a chunk is None there
    out = metrics_of(sources, verl_variables(merged), n=n, num_turns=turns or None)
    out["val-aux/response_length/mean"] = float(np.mean(lengths))  # not verl's
    if keep_outputs:
        return Validation(out, generations, outputs, merged)
    return Validation(out, generations)


def _with_model_scores(result, rm, tokenizer, pb, rollout, examples, *, n: int, real: int,
                       rows: tuple[int, int], rng):  # fmt: skip
    """`result` (the rule rewards of this process's rows, or None) with the reward model's
    scores: every process scores the chunk's `real` prompts (the scoring programs run on the
    whole batch, as in training) and keeps its own `rows`."""
    prompt_ids, prompt_mask = rollout_stage.full_prompts(pb)
    B = real * n
    scores_B, extras = rollout_stage.model_scores(
        rm, tokenizer, np.repeat(prompt_ids, n, axis=0)[:B], np.repeat(prompt_mask, n, axis=0)[:B],
        distributed.to_host(rollout.response_ids)[:B],
        distributed.to_host(rollout.response_mask)[:B], examples[:B], rng,
    )  # fmt: skip
    lo, hi = rows[0] * n, rows[1] * n
    own = {k: v[lo:hi] for k, v in extras.items()}
    return reward_model_lib.combine(result, scores_B[lo:hi], rm.weight, own)


def _prompt_text(prompt) -> str:
    """A prompt for display: a plain string, or the chat's last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt)


N_BOOTSTRAP = 1000  # verl's bootstrap draws per estimate (process_validation_metrics)
BOOTSTRAP_SEED = 42  # verl's seed, reset before every estimate
NUM_TURNS = 2  # verl's single-turn agent loop: the prompt and one response


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for n samples of a prompt: 2, 4, 8, ... below n, then n
    itself; none for n = 1 (verl's gen_ns)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


@functools.lru_cache(maxsize=64)
def bootstrap_indices(n: int, k: int, *, draws: int = N_BOOTSTRAP, seed: int = BOOTSTRAP_SEED):
    """[draws, k] sample indices, drawn with replacement from range(n) (read-only).

    The same draws as verl's bootstrap_metric, which reseeds NumPy's global legacy generator with
    `seed` and calls np.random.choice: a fresh RandomState(seed) gives that very stream without
    touching the global one. So every prompt, every variable and best, worst and maj reuse the
    same draws for a given (n, k), as in verl; they are drawn once per (n, k) here.
    """
    idx = np.random.RandomState(seed).choice(n, size=(draws, k), replace=True)
    idx.flags.writeable = False
    return idx


def majority_values(values_N: np.ndarray, votes: Sequence, idx_RK: np.ndarray) -> np.ndarray:
    """The majority-vote value of each draw (verl's calc_maj_val, for all draws at once).

    In draw r (samples idx_RK[r]), the winning vote is the most frequent one, ties going to the
    vote seen first in the draw; its value is that of its first sample in the draw. Votes are
    compared as dict keys, as verl does (so 1 and 1.0 are one vote).

    Args:
      values_N: the n values of one prompt.
      votes: their n votes ("pred"), hashable.
      idx_RK: [R, k] draws (bootstrap_indices).

    Returns:
      [R] values.
    """
    codes: dict = {}
    code_N = np.array([codes.setdefault(v, len(codes)) for v in votes], np.int64)
    out_R = np.empty(len(idx_RK), np.float64)
    k = idx_RK.shape[1]
    step = max(1, 2**22 // (k * k))  # bound the [rows, k, k] comparison's memory
    for lo in range(0, len(idx_RK), step):
        idx_rK = idx_RK[lo : lo + step]
        vote_rK = code_N[idx_rK]
        count_rK = np.sum(vote_rK[:, :, None] == vote_rK[:, None, :], axis=2)
        # The first position holding a most frequent vote is that vote's first sample, and no
        # other most frequent vote appears earlier: verl's winner (first-inserted on ties).
        first_r = np.argmax(count_rK == count_rK.max(axis=1, keepdims=True), axis=1)
        out_R[lo : lo + step] = values_N[idx_rK[np.arange(len(idx_rK)), first_r]]
    return out_R


def _mean_std(x_R: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x_R)), float(np.std(x_R))


def prompt_metrics(values: Sequence, votes: Sequence | None, *, seed: int = BOOTSTRAP_SEED):
    """verl's metrics of one variable over the n samples of one prompt.

    `mean@n` and, for n > 1, `std@n` (population std) and for each k of `subset_sizes(n)` the
    bootstrap mean and std (N_BOOTSTRAP draws of k samples with replacement) of the best, the
    worst and, when `votes` is given, the majority-vote value: `best@k/mean`, `best@k/std`,
    `worst@k/...`, `maj@k/...`.
    """
    values_N = np.asarray([float(v) for v in values], np.float64)
    n = len(values_N)
    out = {f"mean@{n}": float(np.mean(values_N))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values_N))
    for k in subset_sizes(n):
        idx_RK = bootstrap_indices(n, k, seed=seed)
        draws_RK = values_N[idx_RK]
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = _mean_std(draws_RK.max(axis=1))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = _mean_std(draws_RK.min(axis=1))
        if votes is not None:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = _mean_std(
                majority_values(values_N, votes, idx_RK)
            )
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float, bool, np.number, np.bool_))


def source_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence,
    variables: dict[str, Sequence],
    *,
    expected_counts: dict | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {variable: {metric: value}}}: verl 0.9.1's process_validation_metrics.

    Samples are grouped by data source and prompt (`sample_uids`). For each prompt and variable,
    the samples where it is None are left out; a variable whose first value is a string
    ("pred") is not measured. The others get `prompt_metrics` over the prompt's remaining n
    samples, with majority votes when every one of the prompt's samples has a "pred" and as
    many as there are values; each metric is then averaged over the source's prompts (a prompt
    without a variable, or with another n, does not count toward its metrics).

    `expected_counts` ({(data_source, uid): n}, verl's V1 trainer: the prompt's
    rollout.val_kwargs.n) adds, for a source where some sample has an "acc", "acc_success_only"
    (the prompt's "acc" values) and pads each prompt's "acc" with zeros up to n samples.

    Raises:
      ValueError: a variable other than a string one holds a value that is not a number.
    """
    grouped: dict = {}  # source -> uid -> variable -> values, in order of first appearance
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=True)):
        per_var = grouped.setdefault(source, {}).setdefault(uid, {})
        for var, values in variables.items():
            per_var.setdefault(var, []).append(values[i])
    if expected_counts:
        for source, by_uid in grouped.items():
            if not any(v is not None for pv in by_uid.values() for v in pv.get("acc", ())):
                continue  # only sources that report an accuracy
            for (s, uid), count in expected_counts.items():
                if s != source:
                    continue
                per_var = by_uid.setdefault(uid, {})
                acc = [v for v in per_var.get("acc", ()) if v is not None]
                per_var["acc_success_only"] = acc
                per_var["acc"] = acc + [0.0] * max(count - len(acc), 0)
    out: dict = {}
    for source, by_uid in grouped.items():
        collected: dict = {}  # variable -> metric -> per-prompt values
        for per_var in by_uid.values():
            preds = per_var.get("pred")
            for var, raw in per_var.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                if not all(_is_number(v) for v in values):
                    bad = next(v for v in values if not _is_number(v))
                    raise ValueError(
                        f"validation: the reward function's {var!r} is {bad!r} "
                        f"({type(bad).__name__}) on a sample of data source {source!r}; "
                        "validation averages every key of the reward dict except string ones, "
                        "so return numbers (or strings, e.g. 'pred', which are not averaged)"
                    )
                votes = preds
                if preds is None or len(preds) != len(values) or any(p is None for p in preds):
                    votes = None
                for name, value in prompt_metrics(values, votes, seed=seed).items():
                    collected.setdefault(var, {}).setdefault(name, []).append(value)
        out[source] = {
            var: {name: float(np.mean(per_prompt)) for name, per_prompt in metrics.items()}
            for var, metrics in collected.items()
        }
    return out


def prefixed(per_source: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Flat `val-core/<source>/<var>/<metric>` and `val-aux/...` keys (verl's V1 trainer,
    _val_metrics_update).

    Per source the core variable is "acc" when the source has it, else "reward"; its
    `mean@`, `best@` and `maj@` metrics at the variable's largest n (mean and std alike) are
    val-core, everything else val-aux.
    """
    out = {}
    for source, per_var in per_source.items():
        core_var = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                core = (
                    var == core_var
                    and name.startswith(("mean", "maj", "best"))
                    and f"@{n_max}" in name  # verl's test, substring and all
                )
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = value
    return out


def turn_metrics(num_turns: Sequence[int]) -> dict[str, float]:
    """verl's val-aux/num_turns/{min,max,mean} (2 per sample for single-turn chats)."""
    turns = np.asarray(num_turns, np.float64)
    return {
        "val-aux/num_turns/min": float(turns.min()),
        "val-aux/num_turns/max": float(turns.max()),
        "val-aux/num_turns/mean": float(turns.mean()),
    }


def verl_variables(result: reward_fns.RewardResult) -> dict[str, list]:
    """verl's per-sample validation variables of scored samples: "reward" (the sequence reward,
    overlong penalty included, in float32 like verl's rm_scores) and every key of verl's
    reward_extra_info (rewards/functions.py: reward_extra_info: "acc" for a plain score, the
    dict's keys, "score" included, for a dict one; "overlong_reward" / "overlong" with
    reward.overlong_buffer.log). Keys no sample has are left out."""
    out = {"reward": [float(np.float32(s)) for s in result.scores_B]}
    keys = dict.fromkeys(["score", "acc", *result.extras])
    for key in keys:
        values = reward_fns.reward_extra_info(result, key)
        if any(v is not None for v in values):
            out[key] = values
    return out


def metrics_of(
    data_sources: Sequence[str], variables: dict[str, Sequence], *, n: int,
    num_turns: Sequence[int] | None = None,
) -> dict[str, float]:
    """verl's validation metrics of samples whose n samples per prompt are adjacent, each
    prompt its own uid: `source_metrics` (with verl's V1 expected counts), `prefixed`, and
    num_turns (`num_turns`, default NUM_TURNS each)."""
    uids = [i // n for i in range(len(data_sources))]
    expected = {(data_sources[i * n], i): n for i in range(len(data_sources) // n)}
    per_source = source_metrics(data_sources, uids, variables, expected_counts=expected)
    if num_turns is None:
        num_turns = [NUM_TURNS] * len(data_sources)
    return prefixed(per_source) | turn_metrics(num_turns)


def group_metrics(
    sources: Sequence[str],
    variables: dict[str, Sequence],
    preds: Sequence,
    *,
    n: int,
) -> dict[str, float]:
    """`metrics_of` with the votes given apart (`preds`, None where a sample has none)."""
    if any(p is not None for p in preds):
        variables = {**variables, "pred": list(preds)}
    return metrics_of(sources, variables, n=n)


GENERATIONS_FILE = "val_generations.jsonl"
LOGGED_SAMPLES = 2  # written to the log as well as the file


def write_generations(
    workdir: str, step_done: int, generations: Sequence[dict], *, log: bool = True
) -> None:
    """Appends one validation's logged samples to workdir/val_generations.jsonl (and the log)."""
    with open(os.path.join(workdir, GENERATIONS_FILE), "a") as f:
        for g in generations:
            f.write(json.dumps({"step": step_done, **g}, default=str) + "\n")
    for g in generations[:LOGGED_SAMPLES] if log else ():
        logging.info(
            "val sample (step %d, score %.3g): %r -> %r",
            step_done,
            g["score"],
            g["input"],
            g["output"],
        )
    if log and len(generations) > LOGGED_SAMPLES:
        logging.info("%d validation samples of step %d in %s", len(generations), step_done,
                     os.path.join(workdir, GENERATIONS_FILE))


def compare_generations(before: Sequence[dict], after: Sequence[dict], *, samples: int = 2
                        ) -> list[str]:
    """Report lines pairing two validations' logged samples by their input: how many scored
    higher, lower and the same after, and up to `samples` examples of each change (the same
    input's completion before and after, the ones that got worse included)."""
    first = {}
    for g in before:
        first.setdefault(g["input"], g)
    pairs = [(first[g["input"]], g) for g in dict((g["input"], g) for g in after).values()
             if g["input"] in first]
    if not pairs:
        return []
    kinds = {"higher": [], "lower": [], "the same": []}
    for b, a in pairs:
        kind = "higher" if a["score"] > b["score"] else "lower" if a["score"] < b["score"] else (
            "the same")
        kinds[kind].append((b, a))
    lines = [f"{len(pairs)} inputs logged at both validations: "
             + ", ".join(f"{len(v)} scored {k}" for k, v in kinds.items())]
    for kind, rows in kinds.items():
        for b, a in rows[:samples]:
            lines.append(f"  {kind}: {b['input']!r}")
            lines.append(f"    before {b['output']!r} (score {b['score']:.3g})")
            lines.append(f"    after  {a['output']!r} (score {a['score']:.3g})")
    return lines


def truncate_generations(workdir: str, step: int) -> None:
    """Drops the logged samples of validations after `step` (a resumed run redoes them)."""
    kept = {k: v for k, v in read_generations(workdir).items() if k <= step}
    path = os.path.join(workdir, GENERATIONS_FILE)
    if os.path.exists(path):
        os.remove(path)
    for k, rows in kept.items():
        write_generations(workdir, k, rows, log=False)


def read_generations(workdir: str) -> dict[int, list[dict]]:
    """{step: samples} of workdir/val_generations.jsonl ({} when none were logged)."""
    path = os.path.join(workdir, GENERATIONS_FILE)
    out: dict[int, list[dict]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                out.setdefault(row.pop("step"), []).append(row)
    return out
