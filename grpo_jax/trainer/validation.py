"""Validation: sample the validation prompts, score them, and report per data source.

Metric names are verl 0.9.1's (`process_validation_metrics`): for every data source and every
scored variable (the reward, plus each numeric key of a dict-valued score such as "acc"),
`<var>/mean@N` and, when `rollout.val_kwargs.n` = N > 1, `std@N`, `best@N/mean`, `worst@N/mean`
and, when the scorer returns a "pred" answer, `maj@N/mean` (the score of the majority answer).
They are prefixed `val-core/<data_source>/` for verl's core variable ("acc" when the scorer
reports it, else "reward") and its mean/best/maj metrics, and `val-aux/<data_source>/` for the
rest. The first trainer.log_val_generations samples of each validation go to
workdir/val_generations.jsonl (`write_generations`).

Deliberate difference: verl estimates best@N / worst@N / maj@N with a bootstrap over subsets of
size N drawn with replacement; here they are exact over the N samples of each prompt (max, min
and majority of those N), which is what the names say and needs no random seed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import jax
import numpy as np

from grpo_jax import distributed
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
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
    pool=None,
    policy_version: int | None = None,
    num_generations: int = 0,
    keep_outputs: bool = False,
) -> Validation:
    """`validate`, returning a Validation with the first `num_generations` samples (and with
    `keep_outputs` every completion, gathered from every process).

    The prompts go in chunks of `batch_size`; the last chunk is padded with its last prompt so
    every call has one compiled shape (the padding rows are not scored).
    """
    n = sampling.n
    results, sources, lengths, generations, outputs = [], [], [], [], []
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
        pb = prompts_lib.make_batch(prompts, idx, pad_token_id=pad_id, rows=rows)
        rollout = rollout_stage.generate(
            engine, params, pb, jax.random.key(seed), sampling, policy_version=policy_version
        )
        lo, hi = (0, batch_size) if rows is None else rows
        hi = min(hi, real)  # padding prompts are not scored
        lo = min(lo, hi)
        ids = distributed.to_host(rollout.response_ids)[lo * n : hi * n]
        mask = distributed.to_host(rollout.response_mask)[lo * n : hi * n]
        texts = rollout_stage.decode(tokenizer, ids, mask)
        examples = [ex for ex in pb.examples[lo:hi] for _ in range(n)]
        res = reward_fns.score_batch(reward_fn, texts, examples, pool=pool)
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
    scores, extras = merged.scores_B, merged.extras
    preds = extras.get("pred", [None] * len(scores))
    out = group_metrics(sources, {"reward": scores, **extras}, preds, n=n)
    out["val-aux/response_length/mean"] = float(np.mean(lengths))
    if keep_outputs:
        return Validation(out, generations, outputs, merged)
    return Validation(out, generations)


def _prompt_text(prompt) -> str:
    """A prompt for display: a plain string, or the chat's last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt)


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float, bool, np.number)) for v in values)


def group_metrics(
    sources: Sequence[str],
    variables: dict[str, Sequence],
    preds: Sequence,
    *,
    n: int,
) -> dict[str, float]:
    """verl-named metrics from per-sample values; the n samples of a prompt are adjacent.

    Per data source, a variable counts when it is numeric on every sample of that source (a
    scorer's "acc" on MATH rows, say, but not on GSM8K rows whose scorer returns a float), and
    the core variable is "acc" when the source has it, else "reward" (verl).
    """
    out = {}
    sources_P = np.asarray(sources, dtype=object).reshape(-1, n)[:, 0]
    preds_PN = np.asarray(preds, dtype=object).reshape(-1, n)
    for source in dict.fromkeys(sources_P):
        rows = sources_P == source
        columns = {}
        for var, values in variables.items():
            vals_PN = np.asarray(values, dtype=object).reshape(-1, n)[rows]
            if var != "pred" and _numeric(vals_PN.ravel()):
                columns[var] = vals_PN.astype(np.float64)
        core_var = "acc" if "acc" in columns else "reward"
        has_pred = n > 1 and all(p is not None for p in preds_PN[rows].ravel())
        for var, vals in columns.items():
            metrics = {f"mean@{n}": vals.mean(axis=1)}
            if n > 1:
                metrics |= {
                    f"std@{n}": vals.std(axis=1),
                    f"best@{n}/mean": vals.max(axis=1),
                    f"worst@{n}/mean": vals.min(axis=1),
                }
                if has_pred:
                    metrics[f"maj@{n}/mean"] = np.array(
                        [_majority(v, p) for v, p in zip(vals, preds_PN[rows], strict=True)]
                    )
            for name, per_prompt in metrics.items():
                core = var == core_var and name.split("@")[0] in ("mean", "best", "maj")
                prefix = "val-core" if core else "val-aux"
                out[f"{prefix}/{source}/{var}/{name}"] = float(np.mean(per_prompt))
    return out


def _majority(values, preds) -> float:
    """The value of the first sample whose prediction is the most common one (verl calc_maj_val)."""
    counts = collections.Counter(str(p) for p in preds)
    top = max(counts.values())
    for v, p in zip(values, preds, strict=True):
        if counts[str(p)] == top:
            return float(v)
    raise AssertionError("unreachable: some prediction is the most common")


GENERATIONS_FILE = "val_generations.jsonl"


def write_generations(
    workdir: str, step_done: int, generations: Sequence[dict], *, log: bool = True
) -> None:
    """Appends one validation's logged samples to workdir/val_generations.jsonl (and the log)."""
    with open(os.path.join(workdir, GENERATIONS_FILE), "a") as f:
        for g in generations:
            f.write(json.dumps({"step": step_done, **g}, default=str) + "\n")
    for g in generations if log else ():
        logging.info(
            "val sample (step %d, score %.3g): %r -> %r",
            step_done,
            g["score"],
            g["input"],
            g["output"],
        )


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
