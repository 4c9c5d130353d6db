"""A discriminative reward model scoring rollouts on the trainer's mesh, and how its score joins
the rule rewards (config section `reward_model`).

verl 0.9.1 (experimental/reward_loop/reward_loop.py, RewardLoopWorker):
  * Input (`_preprocess_reward_inputs`): the row's raw prompt (chat messages) plus
    ``{"role": "assistant", "content": response}``, the response decoded with the policy's
    tokenizer and its EOS text removed, rendered with the *reward model's* chat template
    (``add_generation_prompt=False``), a leading BOS text stripped (the server adds it back).
  * Score (`compute_score_disrm`): vLLM's ``/classify`` with ``use_activation=False``, the last
    label's raw logit at the sequence's last token (reward_head.reward).
  * Combination (`compute_score`): without a custom reward function the score *replaces* the
    rule reward (rm_scores, placed on the last valid response token as every sequence reward
    is); a custom function may query the model itself over HTTP.

Here: with "reward_model" absent from reward.fn the score is the sequence reward alone (verl's
rule: the rule functions are not run); listed in reward.fn it is one weighted term of the sum,
next to the rule
functions (``Σ w_i rule_i + w_rm * rm``). When the reward model's tokenizer has the policy's
vocabulary the rollout's own ids (prompt + response, EOS included) are scored, with no
re-templating; otherwise the text is re-templated as verl does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from grpo_jax import sharding
from grpo_jax.models import reward_head
from grpo_jax.rewards import functions as reward_fns

NAME = "reward_model"  # its key in RewardResult.per_fn (the metric reward/reward_model/mean)


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """A loaded reward model and how it is run (built by loading.reward_model).

    Attributes:
      config, params, score_DL: the backbone and its head (hf.load_hf_sequence_classifier).
      tokenizer: the reward model's tokenizer.
      same_ids: score the rollout's own token ids (the tokenizers share a vocabulary).
      weight: its weight in the sequence reward (1.0 for verl's score alone).
      with_rules: whether reward.fn lists rule functions to add it to (else the score, times
        `weight`, is the whole sequence reward: verl's rule when reward.fn omits it).
      mesh, rules: where it runs (the trainer's).
      micro_rows: rows per scoring pass (micro_batch_size_per_gpu x batch devices).
      max_length: tokens of an input (longer ones cut on the right); None = no limit.
    """

    config: Any
    params: Any
    score_DL: Any
    tokenizer: Any
    same_ids: bool
    weight: float
    with_rules: bool
    mesh: Any
    rules: Any
    micro_rows: int
    max_length: int | None = None


def chat_text(rm_tokenizer, policy_tokenizer, prompt, response_ids: Sequence[int]) -> str:
    """verl's reward-model input text: the prompt's chat + the decoded response (EOS text
    removed) in the reward model's chat template, a leading BOS text stripped."""
    response = policy_tokenizer.decode(list(response_ids))
    if policy_tokenizer.eos_token:
        response = response.replace(policy_tokenizer.eos_token, "")
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    chat.append({"role": "assistant", "content": response})
    text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = rm_tokenizer.bos_token
    return text[len(bos) :] if bos is not None and text.startswith(bos) else text


def input_rows(rm: RewardModel, policy_tokenizer, prompt_ids_BP, prompt_mask_BP,
               response_ids_BT, response_mask_BT, examples) -> list[list[int]]:  # fmt: skip
    """Each rollout's reward-model token ids (unpadded, cut to rm.max_length)."""
    rows = []
    for b, (p_ids, p_mask, r_ids, r_mask) in enumerate(
        zip(prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT, strict=True)
    ):
        response = [int(t) for t in r_ids[r_mask.astype(bool)]]
        if rm.same_ids:
            ids = [int(t) for t in p_ids[p_mask.astype(bool)]] + response
        else:
            text = chat_text(rm.tokenizer, policy_tokenizer, examples[b].prompt, response)
            ids = rm.tokenizer(text, add_special_tokens=True)["input_ids"]
        rows.append(ids[: rm.max_length] if rm.max_length else ids)
    return rows


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, *, multiple: int,
             num_rows: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Right-padded (ids, mask) [num_rows, T], T the longest row rounded up to `multiple` (so
    the scoring program is compiled for few widths); rows past len(rows) are all padding."""
    T = max(1, max((len(r) for r in rows), default=1))
    T = -(-T // multiple) * multiple
    ids = np.full((num_rows, T), pad_id, np.int32)
    mask = np.zeros((num_rows, T), np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    return ids, mask


def score_rows(rm: RewardModel, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Scores [B] float32 of token rows, rm.micro_rows at a time, split over the mesh's batch
    axes (the params stay in their FSDP / tensor sharding)."""
    pad = rm.config.pad_token_id if rm.config.pad_token_id is not None else 0
    out = []
    with sharding.use_mesh(rm.mesh, rm.rules):
        for start in range(0, len(rows), rm.micro_rows):
            chunk = rows[start : start + rm.micro_rows]
            ids, mask = pad_rows(chunk, pad, multiple=64, num_rows=rm.micro_rows)
            put = jax.device_put
            ids_d = put(ids, sharding.batch_sharding(rm.mesh, 2))
            mask_d = put(mask, sharding.batch_sharding(rm.mesh, 2))
            # vLLM's last-token pooling of the unpadded input (the row's last real token).
            index = reward_head.last_token_masked(mask_d)
            logits = reward_head.scores(rm.config, rm.params, rm.score_DL, ids_d, mask_d, index)
            out.append(np.asarray(jax.device_get(reward_head.reward(logits)))[: len(chunk)])
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0,), np.float32)


def combine(result: reward_fns.RewardResult | None, rm_scores_B: np.ndarray, weight: float,
            extras: dict[str, list] | None = None) -> reward_fns.RewardResult:  # fmt: skip
    """The sequence rewards with the reward model's: ``weight * rm`` alone (`result` None: no
    rule functions) or added to ``result.scores_B``; per_fn gains its raw score and extras the
    model's per-sample `extras` (a judge's verdicts)."""
    rm = [float(x) for x in rm_scores_B]
    extras = extras or {}
    if result is None:
        scores = [weight * r for r in rm]
        return reward_fns.RewardResult(scores, {NAME: rm}, dict(extras), 0, 0,
                                       {NAME: [False] * len(rm)})  # fmt: skip
    total = [s + weight * r for s, r in zip(result.scores_B, rm, strict=True)]
    return dataclasses.replace(
        result,
        scores_B=total,
        per_fn=result.per_fn | {NAME: rm},
        extras=result.extras | extras,
        dict_results=result.dict_results | {NAME: [False] * len(rm)},
    )


def no_rules(solution_str, ground_truth) -> float:
    """The rule reward when reward.fn lists only the reward model (validation scores it 0)."""
    del solution_str, ground_truth
    return 0.0
