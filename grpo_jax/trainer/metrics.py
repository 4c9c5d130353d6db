"""A step's metrics: computed (verl's names and definitions) and written, one JSON line per step
in workdir/metrics.jsonl, mirrored to TensorBoard.

Keys are verl's (`critic/score/mean`, `actor/pg_loss`, `timing_s/gen`, `val/gsm8k/acc`, ...);
values are Python floats. Only the main process writes. On resume, lines of steps after the
restored checkpoint are dropped first, so a resumed run's file equals an uninterrupted run's.
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rewards import functions as reward_fns

METRICS_FILE = "metrics.jsonl"


def reward_metrics(result: reward_fns.RewardResult) -> dict[str, float]:
    """critic/score/*, the per-function means, extra keys, errors and timeouts."""
    out = stats("critic/score", result.scores_B)
    if len(result.per_fn) > 1:
        out |= {f"reward/{name}/mean": float(np.mean(v)) for name, v in result.per_fn.items()}
    for key, values in result.extras.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number))]
        if numeric:
            out[f"reward_extra/{key}/mean"] = float(np.mean(numeric))
    out["reward/num_errors"] = result.num_errors
    out["reward/num_lost"] = result.num_lost  # timed out or worker died
    return out


def length_metrics(
    response_mask_BT, prompt_mask_BP, *, max_response_length, max_prompt_length
) -> dict[str, float]:
    """verl's response_length/* and prompt_length/* metrics, plus the token count."""
    lengths = np.asarray(response_mask_BT).sum(1)
    prompt_lengths = np.asarray(prompt_mask_BP).sum(1)
    out = stats("response_length", lengths) | stats("prompt_length", prompt_lengths)
    out["response_length/clip_ratio"] = float(np.mean(lengths == max_response_length))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_lengths == max_prompt_length))
    out["perf/total_num_tokens"] = int(lengths.sum() + prompt_lengths.sum())
    return out


def stats(prefix: str, x) -> dict[str, float]:
    """{prefix}/mean, /max, /min of x (host values)."""
    x = np.asarray(x, np.float64)
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def masked_stats(prefix: str, x, valid) -> dict:
    """{prefix}/mean, /max, /min of x where `valid`, on the device (jnp scalars)."""
    valid = valid.astype(bool)
    count = jnp.maximum(jnp.sum(valid), 1)
    return {
        f"{prefix}/mean": jnp.sum(jnp.where(valid, x, 0.0)) / count,
        f"{prefix}/max": jnp.max(jnp.where(valid, x, -jnp.inf)),
        f"{prefix}/min": jnp.min(jnp.where(valid, x, jnp.inf)),
    }


@jax.jit
def advantage_stats(adv_BT, returns_BT, rewards_BT, mask_BT) -> dict:
    """verl's critic/advantages/*, critic/returns/* (over valid tokens) and critic/rewards/*
    (per sequence) as device scalars: 9 numbers fetched with the step's other metrics, not
    [B, T] arrays."""
    valid_BT = mask_BT != 0
    rewards_B = jnp.sum(rewards_BT, 1)
    return (
        masked_stats("critic/advantages", adv_BT, valid_BT)
        | masked_stats("critic/returns", returns_BT, valid_BT)
        | masked_stats("critic/rewards", rewards_B, jnp.ones_like(rewards_B, bool))
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


def tensorboard_tag(key: str) -> str:
    """A metric key as a legal TensorBoard tag ([-/\\w.] only): verl's "val-core/.../mean@4"
    becomes "val-core/.../mean_at_4"; metrics.jsonl keeps the key itself."""
    return re.sub(r"[^-/\w.]", "_", key.replace("@", "_at_"))


class Writer:
    """Appends metric records; `enabled=False` (non-main processes) makes it a no-op by design."""

    def __init__(self, workdir: str, *, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        if enabled and tensorboard:
            import tensorboardX

            self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Keeps only records with step <= `step` (rewrites the file atomically)."""
        if not self.enabled:
            return
        kept = [r for r in read(os.path.dirname(self.path)) if r.get("step", 0) <= step]
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
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(tensorboard_tag(k), float(v), int(step))
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
