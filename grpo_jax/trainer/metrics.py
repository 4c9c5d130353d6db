"""A step's metrics: computed (verl's names and definitions) and written, one JSON line per step
in workdir/metrics.jsonl, then sent to the run's trackers (trackers.py: TensorBoard, W&B, ...).

Keys are verl's (`critic/score/mean`, `actor/pg_loss`, `timing_s/gen`, `val/gsm8k/acc`, ...);
values are Python floats. Only the main process writes. On resume, lines of steps after the
restored checkpoint are dropped first, so a resumed run's file equals an uninterrupted run's.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import genrm, reward_model
from grpo_jax.trainer import trackers as trackers_lib

METRICS_FILE = "metrics.jsonl"


# verl's single-turn agent loop reports two turns per sample (the prompt and the response);
# grpo_jax samples single-turn only.
SINGLE_TURN_NUM_TURNS = 2


def data_metrics(
    result: reward_fns.RewardResult,
    response_mask_BT,
    prompt_mask_BP,
    *,
    max_response_length: int,
    max_prompt_length: int,
    num_turns_B=None,
) -> dict[str, float]:
    """The host part of verl 0.9.1's compute_data_metrics (critic-free) of a step's batch:
    `reward_metrics`, `length_metrics` and `turn_metrics`. (critic/advantages/*,
    critic/returns/* and critic/rewards/* come from `advantage_stats`, on the device.)

    Args:
      result: the batch's rewards.
      response_mask_BT, prompt_mask_BP: the masks as sampled (before rejection sampling).
      max_response_length, max_prompt_length: data.max_response_length / max_prompt_length.
      num_turns_B: each sample's turns (multi-turn rollouts), None for single-turn (2 each).
    """
    length_B = np.asarray(response_mask_BT).sum(1)
    return (
        reward_metrics(result, response_length_B=length_B)
        | length_metrics(
            response_mask_BT,
            prompt_mask_BP,
            max_response_length=max_response_length,
            max_prompt_length=max_prompt_length,
        )
        | turn_metrics(np.full(len(length_B), SINGLE_TURN_NUM_TURNS) if num_turns_B is None
                       else num_turns_B)
    )


def reward_metrics(result: reward_fns.RewardResult, *, response_length_B) -> dict[str, float]:
    """critic/score/*, the per-function means, extra keys, errors and timeouts.

    critic/score/* skip aborted samples (`response_length_B` 0), as verl's compute_data_metrics.
    """
    out = non_aborted_stats("critic/score", result.scores_B, response_length_B)
    if len(result.per_fn) > 1 or reward_model.NAME in result.per_fn:
        out |= {f"reward/{name}/mean": float(np.mean(v)) for name, v in result.per_fn.items()}
    for key, values in result.extras.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number))]
        if numeric:
            out[f"reward_extra/{key}/mean"] = float(np.mean(numeric))
    if genrm.UNPARSABLE_KEY in result.extras:  # a judge's verdicts that did not parse
        out["reward/genrm_unparsable"] = int(sum(map(bool, result.extras[genrm.UNPARSABLE_KEY])))
    out["reward/num_errors"] = result.num_errors
    out["reward/num_lost"] = result.num_lost  # timed out or worker died
    return out


def length_metrics(
    response_mask_BT, prompt_mask_BP, *, max_response_length, max_prompt_length
) -> dict[str, float]:
    """verl 0.9.1's response_length/*, response_length_non_aborted/*, response/aborted_ratio and
    prompt_length/* (compute_data_metrics), plus perf/total_num_tokens and grpo_jax's
    response_length/truncated_ratio and prompt_length/truncated_ratio.

    verl's v1 trainer keeps prompts and responses unpadded and pads them to the batch's longest
    before compute_data_metrics, which compares each length with the padded width: so
    `clip_ratio` is the fraction of samples as long as the batch's longest (never 0), not of
    those cut at data.max_response_length. That fraction, verl's v0 meaning, is
    `truncated_ratio` here (and for prompts, the fraction at data.max_prompt_length).
    A sample is aborted when its response is empty.
    """
    lengths = np.asarray(response_mask_BT).sum(1).astype(np.float64)
    prompt_lengths = np.asarray(prompt_mask_BP).sum(1).astype(np.float64)
    aborted = lengths == 0
    kept = lengths[~aborted]
    out = stats("response_length", lengths)
    out["response_length/clip_ratio"] = float(np.mean(lengths == lengths.max()))
    out |= non_aborted_stats("response_length_non_aborted", lengths, lengths)
    out["response_length_non_aborted/clip_ratio"] = (
        float(np.mean(kept == lengths.max())) if kept.size else math.nan
    )
    out["response/aborted_ratio"] = float(np.mean(aborted))
    out |= stats("prompt_length", prompt_lengths)
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_lengths == prompt_lengths.max()))
    out["response_length/truncated_ratio"] = float(np.mean(lengths == max_response_length))
    out["prompt_length/truncated_ratio"] = float(np.mean(prompt_lengths == max_prompt_length))
    out["perf/total_num_tokens"] = int(lengths.sum() + prompt_lengths.sum())
    return out


def turn_metrics(num_turns_B) -> dict[str, float]:
    """verl's num_turns/* (compute_data_metrics) and training/num_turns/* (v1 trainer), both
    over the batch's samples."""
    out = {}
    for prefix in ("num_turns", "training/num_turns"):
        out |= stats(prefix, num_turns_B)
    return out


def stats(prefix: str, x) -> dict[str, float]:
    """{prefix}/mean, /max, /min of x (host values)."""
    x = np.asarray(x, np.float64)
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def non_aborted_stats(prefix: str, x_B, response_length_B) -> dict[str, float]:
    """`stats` of the samples with a non-empty response; NaN when every sample is aborted
    (verl warns and logs NaN)."""
    kept = np.asarray(response_length_B) > 0
    if not kept.any():
        return {f"{prefix}/{name}": math.nan for name in ("mean", "max", "min")}
    return stats(prefix, np.asarray(x_B)[kept])


def masked_stats(prefix: str, x, valid) -> dict:
    """{prefix}/mean, /max, /min of x where `valid`, on the device (jnp scalars); NaN when
    nothing is valid (verl's compute_data_metrics)."""
    valid = valid.astype(bool)
    count = jnp.sum(valid)
    some = count > 0
    return {
        f"{prefix}/mean": jnp.where(
            some, jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(count, 1), jnp.nan
        ),
        f"{prefix}/max": jnp.where(some, jnp.max(jnp.where(valid, x, -jnp.inf)), jnp.nan),
        f"{prefix}/min": jnp.where(some, jnp.min(jnp.where(valid, x, jnp.inf)), jnp.nan),
    }


@jax.jit
def advantage_stats(adv_BT, returns_BT, rewards_BT, mask_BT, sampled_mask_BT) -> dict:
    """verl's critic/advantages/*, critic/returns/* (over the valid tokens of `mask_BT`, the
    response mask after rejection sampling) and critic/rewards/* (per sequence, skipping the
    aborted samples: no token in `sampled_mask_BT`, the mask as sampled) as device scalars: 9
    numbers fetched with the step's other metrics, not [B, T] arrays."""
    valid_BT = mask_BT != 0
    rewards_B = jnp.sum(rewards_BT, 1)
    response_length_B = jnp.sum(sampled_mask_BT != 0, 1)
    return (
        masked_stats("critic/advantages", adv_BT, valid_BT)
        | masked_stats("critic/returns", returns_BT, valid_BT)
        | masked_stats("critic/rewards", rewards_B, response_length_B > 0)
    )


def reduce_metrics(values: dict[str, list]) -> dict[str, float]:
    """verl's reduce_metrics (verl/utils/metric/utils.py) of per-mini-batch values: the largest
    for a key containing "max", the smallest for one containing "min", else the mean."""
    out = {}
    for key, v in values.items():
        reduce = np.max if "max" in key else np.min if "min" in key else np.mean
        out[key] = float(reduce(np.asarray(v, np.float64)))
    return out


def read(workdir: str) -> list[dict]:
    """All records of workdir/metrics.jsonl (a torn last line from a kill is ignored)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


class Writer:
    """Appends metric records, then hands each to the run's experiment trackers (trackers.py:
    TensorBoard, W&B, MLflow, the console); `enabled=False` (non-main processes) makes it a
    no-op by design."""

    def __init__(self, workdir: str, *, trackers: trackers_lib.Trackers | None = None,
                 enabled: bool = True):  # fmt: skip
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self.trackers = trackers if enabled and trackers is not None else trackers_lib.Trackers()

    def truncate_after(self, step: int, *, drop=None) -> None:
        """Keeps only records with step <= `step`, less those for which `drop(record)` is true
        (rewrites the file atomically)."""
        if not self.enabled:
            return
        kept = [
            r
            for r in read(os.path.dirname(self.path))
            if r.get("step", 0) <= step and not (drop is not None and drop(r))
        ]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, step: int, values: dict) -> None:
        """Appends {"step": step, **values} and flushes it to disk."""
        if not self.enabled:
            return
        record = {"step": int(step)}
        for k, v in sorted(values.items()):
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.trackers.log(int(step), values)  # after the file: it is the source of truth

    def log_generations(self, step: int, samples) -> None:
        """Hands one validation's logged samples (input, output, score) to the trackers."""
        if self.enabled:
            self.trackers.log_generations(int(step), samples)

    def catch_up(self, generations: dict) -> None:
        """On a resume, after `truncate_after`: hands the trackers what metrics.jsonl and the
        logged validation samples (`generations`, {step: samples}) hold that they missed."""
        if self.enabled:
            self.trackers.catch_up(read(os.path.dirname(self.path)), generations)

    def close(self) -> None:
        self.trackers.close()
