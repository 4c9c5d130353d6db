"""Prompts: the `Example` row type, tokenisation with the chat template, batches and their order.

* `Example` is one prompt of any task: the prompt (chat messages, as verl stores them, or a plain
  string, as TRL's standard format), its ground truth, its `data_source` (which picks the scorer
  and groups validation metrics), verl's `extra_info`, the row's other columns (passed to
  TRL-style reward functions) and, when the task has one, a reference solution for the optional
  supervised warm-up. grpo_jax/data/readers.py reads files, HF datasets and tfds into Examples.
* Tokenisation: messages go through the tokenizer's chat template with add_generation_prompt
  and data.apply_chat_template_kwargs (verl's RLHFDataset and agent loop, e.g. Qwen3's
  enable_thinking); a string prompt is used as it is (TRL). Overlong prompts
  (> max_prompt_length tokens) are dropped when filter_overlong_prompts, else handled per
  truncation: "error" raises, "left" keeps the last tokens, "right" the first.
* Size: data.train_max_samples / val_max_samples cap a split before the overlong filter, as
  verl's RLHFDataset: a random subset seeded by data.seed with data.shuffle, else the first
  rows (`select_samples`).
* Order: the train set is visited in epochs; epoch e uses the permutation
  `default_rng([seed, e]).permutation(n)` (identity when shuffle is off). verl's dataloader
  drops the last incomplete batch, and so do we. The whole state is `Position(epoch, index)`,
  stored in checkpoints, so a resumed run sees exactly the batches the original would have.
* Width (data.prompt_padding): a batch is left-padded to its longest prompt ("batch"), to the
  longest prompt of its whole set ("dataset", the default) or to data.max_prompt_length
  (verl's RLHFDataset, "max_prompt_length") (`pad_width`). The sampler compiles its programs
  per width bucket of 64 (`sampler.bucket_length`): with "batch" a later batch of another
  bucket compiles them again (GSM8K's batches of 8 fall in 3 buckets), with "dataset" one
  bucket serves the whole run.
"""

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

TRUNCATION_MODES = ("error", "left", "right")  # data.truncation of an overlong prompt
PADDINGS = ("batch", "dataset", "max_prompt_length")  # data.prompt_padding (module doc)
# apply_chat_template arguments that tokenisation sets itself (a prompt's text, with the
# generation prompt), so data.apply_chat_template_kwargs may not.
RESERVED_CHAT_TEMPLATE_KWARGS = (
    "conversation", "add_generation_prompt", "tokenize", "return_dict", "return_tensors",
)  # fmt: skip


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
    prompt_ids: Sequence[tuple[int, ...]]  # per prompt (in shares: tokenised when first read)
    num_filtered: int  # prompts dropped by filter_overlong_prompts
    lengths: tuple[int, ...] | None = None  # per prompt, known without reading prompt_ids

    def __len__(self):
        return len(self.examples)

    def length(self, i: int) -> int:
        return self.lengths[i] if self.lengths is not None else len(self.prompt_ids[i])


def check_chat_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """data.apply_chat_template_kwargs: a mapping of names to values, none of them an argument
    that tokenisation sets itself.

    Raises:
      ValueError: 'apply_chat_template_kwargs=... why' (grpo_jax/config/ prefixes the section).
    """
    if not isinstance(kwargs, Mapping):
        raise ValueError(
            f"apply_chat_template_kwargs={kwargs!r} must be a dict of keyword arguments, e.g. "
            "{'enable_thinking': False}"
        )
    bad = [k for k in kwargs if not isinstance(k, str) or k in RESERVED_CHAT_TEMPLATE_KWARGS]
    if bad:
        raise ValueError(
            f"apply_chat_template_kwargs={dict(kwargs)!r}: {bad} cannot be given (names are "
            f"strings; {list(RESERVED_CHAT_TEMPLATE_KWARGS)} are set by the tokenisation)"
        )


def prompt_text(
    tokenizer,
    prompt: str | Sequence[Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text the model sees: messages in the chat template with the generation prompt and
    `chat_template_kwargs` (data.apply_chat_template_kwargs); a string prompt as it is."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer.chat_template is None:
        raise ValueError(
            "the prompts are chat messages but the tokenizer has no chat template; give plain "
            "string prompts or a tokenizer with a template"
        )
    messages = [dict(m) for m in prompt]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )


def chat_prompt(
    tokenizer, question: str, *, suffix: str, chat_template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """verl's GSM8K prompt: question + suffix as one user turn, in the chat template."""
    return prompt_text(
        tokenizer, [{"role": "user", "content": question + suffix}], chat_template_kwargs
    )


def select_samples(total: int, max_samples: int, *, shuffle: bool, seed: int) -> np.ndarray:
    """The rows kept of a split of `total` under data.train_max_samples / val_max_samples.

    verl's RLHFDataset: all rows when max_samples is -1 or not below total; else, with
    data.shuffle, `max_samples` distinct rows drawn by default_rng(seed).choice (in the drawn
    order, which is verl's numpy call: the same rows as verl's with the same data.seed), and
    without, the first `max_samples`.
    """
    if max_samples < 0 or max_samples >= total:
        return np.arange(total)
    if shuffle:
        return np.random.default_rng(seed).choice(total, size=max_samples, replace=False)
    return np.arange(max_samples)


@dataclasses.dataclass(frozen=True)
class Share:
    """Which share of a dataset this process tokenises (multi-process runs).

    Attributes:
      index, count: this process's rank and the number of processes; process p tokenises the
        rows p, p + count, p + 2 count, ...
      gather: this process's int array -> every process's, concatenated in process order
        (grpo_jax.distributed.gather_rows); only prompt lengths go through it.
    """

    index: int
    count: int
    gather: Callable[[np.ndarray], np.ndarray]


class _ShareTokens(Sequence):
    """The prompt ids of a PromptSet tokenised in shares: this process's share is held, and any
    other prompt is tokenised (and kept) when a batch of this process first asks for it."""

    def __init__(self, tokenize: Callable[[Example], tuple[int, ...]], examples, held: dict):
        self._tokenize, self._examples, self._held = tokenize, examples, held

    def __len__(self):
        return len(self._examples)

    def __getitem__(self, i):
        if i not in self._held:
            self._held[i] = self._tokenize(self._examples[i])
        return self._held[i]


def _tokenize(tokenizer, examples: Sequence[Example], chat_template_kwargs=None) -> list[list[int]]:
    texts = [prompt_text(tokenizer, ex.prompt, chat_template_kwargs) for ex in examples]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def encode(
    tokenizer,
    examples: Sequence[Example],
    *,
    max_prompt_length: int,
    filter_overlong_prompts: bool,
    truncation: str,
    share: Share | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> PromptSet:
    """Tokenises the prompts (chat messages with `chat_template_kwargs`) and applies verl's
    overlong-prompt policy (see module doc).

    With a `share` of several processes, each tokenises only its share (every count-th row) and
    the processes exchange the prompt lengths, so every process knows which prompts are kept
    and how long they are (batch widths, the data order) without tokenising the others; a
    prompt of another share is tokenised when one of this process's batches needs it.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    n = len(examples)
    index, count = (0, 1) if share is None else (share.index, share.count)
    mine = range(index, n, count)
    tokens = _tokenize(tokenizer, [examples[i] for i in mine], chat_template_kwargs)
    held = dict(zip(mine, tokens, strict=True))
    if count == 1:
        lengths = [len(held[i]) for i in range(n)]
    else:
        per = -(-n // count)
        local = np.full(per, -1, np.int64)
        local[: len(mine)] = [len(held[i]) for i in mine]
        table = share.gather(local).reshape(count, per)
        lengths = [int(table[i % count, i // count]) for i in range(n)]

    def fit(ids):
        ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        return tuple(int(t) for t in ids)

    kept, kept_len, num_filtered = [], [], 0
    held_kept = {}
    for i, (ex, length) in enumerate(zip(examples, lengths, strict=True)):
        if length > max_prompt_length:
            if filter_overlong_prompts:
                num_filtered += 1
                continue
            if truncation == "error":
                raise ValueError(
                    f"prompt of line {ex.line} has {length} tokens > data.max_prompt_length="
                    f"{max_prompt_length}; set data.filter_overlong_prompts=True or "
                    f"data.truncation to 'left' or 'right'"
                )
        if i in held:
            held_kept[len(kept)] = fit(held[i])
        kept.append(ex)
        kept_len.append(min(length, max_prompt_length))
    if num_filtered:
        logging.warning(
            "filtered %d prompt(s) longer than %d tokens", num_filtered, max_prompt_length
        )
    if not kept:
        raise ValueError(f"every prompt is longer than data.max_prompt_length={max_prompt_length}")
    if count == 1:
        ids = tuple(held_kept[j] for j in range(len(kept)))
    else:
        ids = _ShareTokens(
            lambda ex: fit(_tokenize(tokenizer, [ex], chat_template_kwargs)[0]),
            tuple(kept),
            held_kept,
        )
    return PromptSet(tuple(kept), ids, num_filtered, tuple(kept_len))


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """P prompts, left-padded to the longest one (host numpy).

    Attributes:
      prompt_ids_PT: int32, pad_token_id on the left; with `rows`, only those rows.
      prompt_mask_PT: int32, 1 on real tokens; with `rows`, only those rows.
      examples: the P Examples (all of them, whatever `rows` is).
      indices: P indices into the PromptSet.
      rows: None when the arrays hold all P rows; else (start, stop), the block of rows this
        process holds (multi-process: the others hold the rest, see grpo_jax.distributed).
    """

    prompt_ids_PT: np.ndarray
    prompt_mask_PT: np.ndarray
    examples: tuple[Example, ...]
    indices: tuple[int, ...]
    rows: tuple[int, int] | None = None

    @property
    def ground_truths(self) -> tuple[Any, ...]:
        return tuple(ex.ground_truth for ex in self.examples)


def pad_width(prompts: PromptSet, padding: str, *, max_prompt_length: int) -> int:
    """The width every batch of `prompts` is padded to at least under data.prompt_padding =
    `padding` (module doc): 0 for "batch" (each batch its own longest prompt)."""
    if padding not in PADDINGS:
        raise ValueError(f"data.prompt_padding must be one of {PADDINGS}, got {padding!r}")
    if padding == "batch":
        return 0
    if padding == "max_prompt_length":
        return max_prompt_length
    return max(prompts.length(i) for i in range(len(prompts)))


def make_batch(
    prompts: PromptSet,
    indices: Sequence[int],
    *,
    pad_token_id: int,
    rows: tuple[int, int] | None = None,
    width: int = 0,
) -> PromptBatch:
    """Left-pads the prompts at `indices` into one PromptBatch, as wide as its longest prompt
    or `width` (`pad_width`), whichever is more.

    With `rows` = (start, stop) (multi-process: this process's block of the batch), only those
    rows are tokenised and held, padded to the width of the whole batch.
    """
    t = max(width, *(prompts.length(i) for i in indices))
    held = indices if rows is None else indices[rows[0] : rows[1]]
    seqs = [prompts.prompt_ids[i] for i in held]
    ids_PT = np.full((len(seqs), t), pad_token_id, np.int32)
    mask_PT = np.zeros((len(seqs), t), np.int32)
    for p, s in enumerate(seqs):
        ids_PT[p, t - len(s) :] = s
        mask_PT[p, t - len(s) :] = 1
    examples = tuple(prompts.examples[i] for i in indices)
    return PromptBatch(ids_PT, mask_PT, examples, tuple(int(i) for i in indices), rows)


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


def read(
    n: int, position: Position, count: int, *, chunk: int, seed: int, shuffle: bool
) -> tuple[np.ndarray, Position]:
    """`count` prompt indices read `chunk` at a time (verl's dataloader of batch_size `chunk`,
    drop_last, started again at the end of an epoch), and the position after them.

    Raises:
      ValueError: `count` is not a multiple of `chunk` (verl's _next_train_batch).
    """
    if count <= 0 or count % chunk:
        raise ValueError(f"{count} prompts cannot be read {chunk} at a time")
    parts, orders = [], {}
    for _ in range(count // chunk):
        if position.index + chunk > steps_per_epoch(n, chunk) * chunk:
            position = Position(position.epoch + 1, 0)
        if position.epoch not in orders:
            orders[position.epoch] = epoch_order(n, epoch=position.epoch, seed=seed,
                                                 shuffle=shuffle)
        parts.append(orders[position.epoch][position.index : position.index + chunk])
        position = Position(position.epoch, position.index + chunk)
    return np.concatenate(parts), position
