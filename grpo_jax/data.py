"""Prompt data: loading GSM8K-format rows, verl's prompt, tokenisation, and a resumable order.

* Sources: a local jsonl in the raw OpenAI GSM8K format ({"question", "answer"} per line),
  GSM8K from tensorflow-datasets, or in-memory rows (the embedded demo). Malformed rows (bad
  JSON, a missing or empty question, an answer without a "#### <number>" line) are counted with
  their line numbers and either skipped (with a warning) or rejected (`on_malformed`).
* Prompt (verl examples/data_preprocess/gsm8k.py): question + " Let's think step by step and
  output the final answer after \"####\".", one user turn, wrapped in the tokenizer's chat
  template with add_generation_prompt=True. Ground truth: `rewards.gsm8k_ground_truth`.
* Overlong prompts (> max_prompt_length tokens): dropped when filter_overlong_prompts, else
  handled per truncation: "error" raises, "left" keeps the last tokens, "right" the first.
* Order: the train set is visited in epochs; epoch e uses the permutation
  `default_rng([seed, e]).permutation(n)` (identity when shuffle is off). verl's dataloader
  drops the last incomplete batch, and so do we. The whole state is `Position(epoch, index)`,
  stored in checkpoints, so a resumed run sees exactly the batches the original would have.
"""

import dataclasses
import json
import logging
from collections.abc import Sequence

import numpy as np

from grpo_jax import rewards

TRUNCATION_MODES = ("error", "left", "right")
ON_MALFORMED_MODES = ("skip", "error")


@dataclasses.dataclass(frozen=True)
class Example:
    """One question. `line` is the 1-based jsonl line (or row index + 1) it came from."""

    question: str
    answer: str  # the raw answer text (reasoning + "#### N"); SFT warm-up target
    ground_truth: str  # the number after "####", commas removed
    line: int


def parse_rows(rows: Sequence[dict], *, source: str, on_malformed: str) -> list[Example]:
    """Validates raw {"question", "answer"} rows into Examples.

    Args:
      rows: raw rows; an entry that is not a dict (e.g. a JSON parse failure recorded as an
        error string) counts as malformed.
      source: name used in messages (a file path or "tfds:gsm8k/train").
      on_malformed: "skip" or "error" (data.on_malformed).

    Raises:
      ValueError: on_malformed == "error" and some row is malformed (all bad lines are listed).
    """
    if on_malformed not in ON_MALFORMED_MODES:
        raise ValueError(
            f"data.on_malformed must be one of {ON_MALFORMED_MODES}, got {on_malformed!r}"
        )
    examples, bad = [], []
    for i, row in enumerate(rows):
        line = i + 1
        if not isinstance(row, dict):
            bad.append((line, str(row)))
            continue
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            bad.append((line, "missing or empty 'question'"))
            continue
        if not isinstance(answer, str):
            bad.append((line, "missing 'answer'"))
            continue
        try:
            gt = rewards.gsm8k_ground_truth(answer)
        except ValueError:
            bad.append((line, "answer has no '#### <number>' line"))
            continue
        try:
            float(gt)  # the "####" regex also admits "," or "1.2.3", which are not numbers
        except ValueError:
            bad.append((line, f"non-numeric answer {gt!r} after '####'"))
            continue
        examples.append(Example(question, answer, gt, line))
    if bad:
        listing = "; ".join(f"line {n}: {why}" for n, why in bad[:20])
        more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
        msg = f"{source}: {len(bad)} malformed row(s): {listing}{more}"
        if on_malformed == "error":
            raise ValueError(msg + " (set data.on_malformed='skip' to drop them)")
        logging.warning("%s; skipped", msg)
    if not examples:
        raise ValueError(f"{source}: no valid rows")
    return examples


def read_jsonl(path: str, *, on_malformed: str) -> list[Example]:
    """Reads a raw-format GSM8K jsonl; unparsable lines count as malformed."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            if not text.strip():
                rows.append("empty line")
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                rows.append(f"invalid JSON ({e.msg})")
                continue
            is_object = isinstance(row, dict)
            rows.append(row if is_object else f"not a JSON object (a JSON {type(row).__name__})")
    return parse_rows(rows, source=path, on_malformed=on_malformed)


def read_tfds(split: str, *, on_malformed: str) -> list[Example]:  # pragma: no cover - network
    """GSM8K `split` from tensorflow-datasets (downloads and prepares on first use)."""
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401 - registers the gsm8k builder

    builder = tfds.builder("gsm8k")
    builder.download_and_prepare()
    rows = [
        {"question": r["question"].decode(), "answer": r["answer"].decode()}
        for r in tfds.as_numpy(builder.as_dataset(split=split))
    ]
    return parse_rows(rows, source=f"tfds:gsm8k/{split}", on_malformed=on_malformed)


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Tokenised prompts (variable length, not padded) and their examples."""

    examples: tuple[Example, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    num_filtered: int  # prompts dropped by filter_overlong_prompts

    def __len__(self):
        return len(self.examples)


def chat_prompt(tokenizer, question: str, *, suffix: str) -> str:
    """verl's GSM8K prompt in the tokenizer's chat template (one user turn + generation prompt)."""
    messages = [{"role": "user", "content": question + suffix}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(
    tokenizer,
    examples: Sequence[Example],
    *,
    suffix: str,
    max_prompt_length: int,
    filter_overlong_prompts: bool,
    truncation: str,
) -> PromptSet:
    """Tokenises every prompt and applies verl's overlong-prompt policy (see module doc)."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    kept, ids_list, num_filtered = [], [], 0
    texts = [chat_prompt(tokenizer, ex.question, suffix=suffix) for ex in examples]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ex, ids in zip(examples, encoded):
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
      ground_truths: P ground-truth strings.
      indices: P indices into the PromptSet.
    """

    prompt_ids_PT: np.ndarray
    prompt_mask_PT: np.ndarray
    ground_truths: tuple[str, ...]
    indices: tuple[int, ...]


def make_batch(prompts: PromptSet, indices: Sequence[int], *, pad_token_id: int) -> PromptBatch:
    """Left-pads the prompts at `indices` into one PromptBatch."""
    seqs = [prompts.prompt_ids[i] for i in indices]
    t = max(len(s) for s in seqs)
    ids_PT = np.full((len(seqs), t), pad_token_id, np.int32)
    mask_PT = np.zeros((len(seqs), t), np.int32)
    for p, s in enumerate(seqs):
        ids_PT[p, t - len(s) :] = s
        mask_PT[p, t - len(s) :] = 1
    gts = tuple(prompts.examples[i].ground_truth for i in indices)
    return PromptBatch(ids_PT, mask_PT, gts, tuple(int(i) for i in indices))


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
