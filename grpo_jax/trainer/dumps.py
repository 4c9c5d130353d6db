"""Generation dumps: trainer.rollout_data_dir and trainer.validation_data_dir, as verl writes them.

verl 0.9.1's v1 trainer (verl/trainer/ppo/v1/trainer_base.py: `_log_rollout_data`, the end of
`_validate`, `_write_generations`) writes one JSONL file per step, `<dir>/<step>.jsonl`, a line
per sample with the keys
  input   the prompt as the model saw it (chat template applied), decoded without special tokens
  output  the completion, decoded without special tokens
  gts     the ground truth (verl's reward_model.ground_truth)
  score   the sequence reward (verl's rm_scores summed: DAPO's overlong penalty included)
  step    the step (0 for the validation before training)
  uid     `<group>_<sample>_0` (verl: `<uuid4>_<sample>_<turn>`; its rows sorted by it, so a
          prompt's samples are adjacent), and, for validation only, `reward` (= score) and each
          extra key of the scorer's results ("acc", "pred", ...), None where a sample lacks it.
A redone step (a resumed run) overwrites its file. Only process 0 writes (the caller's check).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpo_jax.data import prompts as prompts_lib
from grpo_jax.trainer import rollout_stage


def uids(num_groups: int, n: int) -> list[str]:
    """The `uid` of each of num_groups x n samples (a group's n samples adjacent)."""
    return [f"{g}_{j}_0" for g in range(num_groups) for j in range(n)]


def decode_prompts(tokenizer, prompt_ids_BP: np.ndarray, prompt_mask_BP: np.ndarray) -> list[str]:
    """The left-padded prompts' text, special tokens skipped (verl decodes them so)."""
    return tokenizer.batch_decode(
        [row[mask.astype(bool)] for row, mask in zip(prompt_ids_BP, prompt_mask_BP, strict=True)],
        skip_special_tokens=True,
    )


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"a dumped value of type {type(obj).__name__} is not JSON serialisable")


def write(
    directory: str,
    step: int,
    *,
    inputs: Sequence[str],
    outputs: Sequence[str],
    gts: Sequence[Any],
    scores: Sequence[float],
    extras: Mapping[str, Sequence[Any]],
) -> str:
    """Writes `<directory>/<step>.jsonl` (module docstring) and returns its path.

    `extras` are further per-sample columns; as in verl, one whose length is not the number of
    samples is left out.
    """
    n = len(inputs)
    columns = {"input": inputs, "output": outputs, "gts": gts, "score": scores, "step": [step] * n}
    for name, values in extras.items():
        if len(values) == n:
            columns[name] = values
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            row = {k: v[i] for k, v in columns.items()}
            f.write(json.dumps(row, ensure_ascii=False, default=_json_default) + "\n")
    return path


def write_rollouts(directory: str, step: int, tokenizer, batch) -> str:
    """A training step's batch (trainer.rollout_data_dir): verl's rollout keys, no reward
    extras (the v1 trainer dumps none)."""
    host, n = batch.host, batch.group_size
    return write(
        directory,
        step,
        inputs=decode_prompts(tokenizer, host.prompt_ids_BP, host.prompt_mask_BP),
        outputs=rollout_stage.decode(tokenizer, host.response_ids_BT, host.response_mask_BT),
        gts=[ex.ground_truth for ex in batch.examples],
        scores=[float(s) for s in batch.result.scores_B],
        extras={"uid": uids(len(batch.examples) // n, n)},
    )


def write_validation(
    directory: str,
    step: int,
    tokenizer,
    prompt_set: prompts_lib.PromptSet,
    *,
    outputs: Sequence[str],
    scores: Sequence[float],
    extras: Mapping[str, Sequence[Any]],
    n: int,
) -> str:
    """One validation's samples (trainer.validation_data_dir): every prompt of `prompt_set`
    with its n completions, scores and the scorer's extra keys."""
    num = len(prompt_set)
    inputs = tokenizer.batch_decode(
        [list(prompt_set.prompt_ids[i]) for i in range(num)], skip_special_tokens=True
    )
    return write(
        directory,
        step,
        inputs=[text for text in inputs for _ in range(n)],
        outputs=outputs,
        gts=[ex.ground_truth for ex in prompt_set.examples for _ in range(n)],
        scores=scores,
        extras={"reward": list(scores), **extras, "uid": uids(num, n)},
    )
