"""Prompts: the `Example` row type, tokenisation with the chat template, batches and their order.

* `Example` is one prompt of any task: the prompt (chat messages, as verl stores them, or a plain
  string, as TRL's standard format), its ground truth, its `data_source` (which picks the scorer
  and groups validation metrics), verl's `extra_info`, the row's other columns (passed to
  TRL-style reward functions) and, when the task has one, a reference solution for the optional
  supervised warm-up. grpo_jax/dataset.py reads files, HF datasets and tfds into Examples.
* Tokenisation: messages go through the tokenizer's chat template with add_generation_prompt
  (verl's RLHFDataset); a string prompt is used as it is (TRL). Overlong prompts
  (> max_prompt_length tokens) are dropped when filter_overlong_prompts, else handled per
  truncation: "error" raises, "left" keeps the last tokens, "right" the first.
* Order: the train set is visited in epochs; epoch e uses the permutation
  `default_rng([seed, e]).permutation(n)` (identity when shuffle is off). verl's dataloader
  drops the last incomplete batch, and so do we. The whole state is `Position(epoch, index)`,
  stored in checkpoints, so a resumed run sees exactly the batches the original would have.
"""

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpo_jax import config as config_lib

TRUNCATION_MODES = config_lib.TRUNCATION_MODES


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and what its reward needs.

    Attributes:
      prompt: chat messages ({"role", "content"} dicts) or a plain string.
      ground_truth: what the scorer compares against (verl's reward_model.ground_truth).
      data_source: selects the scorer (verl's `data_source`); validation groups by it.
      extra_info: verl's per-row `extra_info` dict, passed to verl-style scorers.
      columns: the row's other columns, passed as keyword arguments to TRL-style rewards.
      answer: a reference solution, for the supervised warm-up (None when the task has none).
      line: the 1-based row (jsonl line) it came from, for messages.
    """

    prompt: str | tuple[Mapping[str, Any], ...]
    ground_truth: Any = None
    data_source: str = "unknown"
    extra_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    columns: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    answer: str | None = None
    line: int = 0


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Tokenised prompts (variable length, not padded) and their examples."""

    examples: tuple[Example, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    num_filtered: int  # prompts dropped by filter_overlong_prompts

    def __len__(self):
        return len(self.examples)


def prompt_text(tokenizer, prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """The text the model sees: messages in the chat template with the generation prompt."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer.chat_template is None:
        raise ValueError(
            "the prompts are chat messages but the tokenizer has no chat template; give plain "
            "string prompts or a tokenizer with a template"
        )
    messages = [dict(m) for m in prompt]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_prompt(tokenizer, question: str, *, suffix: str) -> str:
    """verl's GSM8K prompt: question + suffix as one user turn, in the chat template."""
    return prompt_text(tokenizer, [{"role": "user", "content": question + suffix}])


def encode(
    tokenizer,
    examples: Sequence[Example],
    *,
    max_prompt_length: int,
    filter_overlong_prompts: bool,
    truncation: str,
) -> PromptSet:
    """Tokenises every prompt and applies verl's overlong-prompt policy (see module doc)."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    kept, ids_list, num_filtered = [], [], 0
    texts = [prompt_text(tokenizer, ex.prompt) for ex in examples]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ex, ids in zip(examples, encoded, strict=True):
        if len(ids) > max_prompt_length:
            if filter_overlong_prompts:
                num_filtered += 1
                continue
            if truncation == "error":
                raise ValueError(
                    f"prompt of line {ex.line} has {len(ids)} tokens > data.max_prompt_length="
                    f"{max_prompt_length}; set data.filter_overlong_prompts=True or "
                    f"data.truncation to 'left' or 'right'"
                )
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        kept.append(ex)
        ids_list.append(tuple(int(t) for t in ids))
    if num_filtered:
        logging.warning(
            "filtered %d prompt(s) longer than %d tokens", num_filtered, max_prompt_length
        )
    if not kept:
        raise ValueError(f"every prompt is longer than data.max_prompt_length={max_prompt_length}")
    return PromptSet(tuple(kept), tuple(ids_list), num_filtered)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """P prompts, left-padded to the longest one (host numpy).

    Attributes:
      prompt_ids_PT: int32, pad_token_id on the left.
      prompt_mask_PT: int32, 1 on real tokens.
      examples: the P Examples.
      indices: P indices into the PromptSet.
    """

    prompt_ids_PT: np.ndarray
    prompt_mask_PT: np.ndarray
    examples: tuple[Example, ...]
    indices: tuple[int, ...]

    @property
    def ground_truths(self) -> tuple[Any, ...]:
        return tuple(ex.ground_truth for ex in self.examples)


def make_batch(prompts: PromptSet, indices: Sequence[int], *, pad_token_id: int) -> PromptBatch:
    """Left-pads the prompts at `indices` into one PromptBatch."""
    seqs = [prompts.prompt_ids[i] for i in indices]
    t = max(len(s) for s in seqs)
    ids_PT = np.full((len(seqs), t), pad_token_id, np.int32)
    mask_PT = np.zeros((len(seqs), t), np.int32)
    for p, s in enumerate(seqs):
        ids_PT[p, t - len(s) :] = s
        mask_PT[p, t - len(s) :] = 1
    examples = tuple(prompts.examples[i] for i in indices)
    return PromptBatch(ids_PT, mask_PT, examples, tuple(int(i) for i in indices))


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the next batch starts: `index` prompts of epoch `epoch`'s order are consumed."""

    epoch: int = 0
    index: int = 0


def epoch_order(n: int, *, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The visiting order of epoch `epoch`: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Full batches per epoch (the last incomplete batch is dropped, as verl's dataloader)."""
    if batch_size > n:
        raise ValueError(f"data.train_batch_size={batch_size} exceeds the {n} training prompts")
    return n // batch_size


def next_indices(
    n: int, position: Position, batch_size: int, *, seed: int, shuffle: bool
) -> tuple[np.ndarray, Position]:
    """The prompt indices of the next batch and the position after it."""
    if position.index + batch_size > steps_per_epoch(n, batch_size) * batch_size:
        position = Position(position.epoch + 1, 0)
    order = epoch_order(n, epoch=position.epoch, seed=seed, shuffle=shuffle)
    idx = order[position.index : position.index + batch_size]
    return idx, Position(position.epoch, position.index + batch_size)
