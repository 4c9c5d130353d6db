"""Section `data` (verl's data.*): the prompts, their files or generator, the batch and lengths."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from grpo_jax import registry
from grpo_jax.config.checks import Checks, positive
from grpo_jax.data import prompts, readers

DATA_SOURCES = ("files", "jsonl", "hf", "tfds", "arithmetic")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """The built-in arithmetic task (data.source="arithmetic"; grpo_jax/data/demo_task.py)."""

    num_train: int = 2000  # training questions
    num_val: int = 200  # held-out questions
    max_operand: int = 99  # operands are drawn from [0, max_operand]
    modulus: int = 0  # > 0: the answer is (a + b) mod modulus ("a+b%m")
    seed: int = 0  # generator seed (train and val are disjoint when the space allows)

    def __post_init__(self):
        c = Checks("data.arithmetic")
        positive(c, self, "num_train", "num_val")
        for name in ("max_operand", "modulus", "seed"):
            c.need(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        c.done()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Section `data`: where prompts come from, their format, batch sizes and lengths.

    Sources (grpo_jax/data/readers.py): "files" (parquet / jsonl / json files in verl's layout, raw
    GSM8K jsonl, or any layout with a `prompt_key` column; "jsonl" is the same), "hf" (anything
    `datasets.load_dataset` loads: a hub id when online, or a local dataset dir or script),
    "tfds" (a tensorflow-datasets builder, read through array_record without TensorFlow) and
    "arithmetic" (the built-in demo task).
    """

    source: str = "files"
    path: str | None = None  # train file(s), comma-separated; for "hf" the dataset id or dir
    val_path: str | None = None  # validation file(s); for "hf"/"tfds" the val_split is used
    train_split: str = "train"  # hf / tfds split for training
    val_split: str = "test"  # hf / tfds split for validation
    hf_name: str | None = None  # hf: the dataset config name (GSM8K on the hub: "main")
    tfds_name: str = "gsm8k"  # tfds builder name
    tfds_data_dir: str | None = None  # tfds data_dir (None = tfds' default ~/tensorflow_datasets)
    prompt_key: str = "prompt"  # column with chat messages (verl) or a plain prompt string (TRL)
    reward_fn_key: str = "data_source"  # column that selects the scorer (verl)
    ground_truth_key: str = "reward_model.ground_truth"  # dotted path of the ground truth
    prompt_suffix: str = readers.VERL_GSM8K_INSTRUCTION  # appended to raw GSM8K questions only
    train_batch_size: int = 1024  # prompts per step
    # Prompts per read of the data order (verl's dataloader batch size; must divide
    # train_batch_size); None = train_batch_size. With algorithm.filter_groups it is 1 (verl).
    gen_batch_size: int | None = None
    val_batch_size: int = 256  # prompts per validation generate call
    # Caps on the prompts read (verl): -1 = all; else that many, drawn before the overlong
    # filter as verl's RLHFDataset draws them: a seeded random subset (data.seed) with
    # data.shuffle, the first ones without (prompts.select_samples).
    train_max_samples: int = -1
    val_max_samples: int = -1
    max_prompt_length: int = 512  # tokens after the chat template
    max_response_length: int = 512  # generated tokens per completion
    prompt_length_bucket: int = 64  # the update's prompt width rounds up to this (fewer compiles)
    # How wide a batch of prompts is padded (left): "dataset" (the longest prompt of the train or
    # validation set: one sampler program set for the whole run), "batch" (the batch's longest:
    # less padding to decode over, but a batch of a new width bucket compiles the sampler's
    # programs again) or "max_prompt_length" (verl's RLHFDataset). data/prompts.py's doc.
    prompt_padding: str = "dataset"
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length
    truncation: str = "error"  # "error" | "left" | "right" for overlong prompts not dropped
    shuffle: bool = True  # reshuffle the train set every epoch (seeded)
    seed: int = 1  # shuffle seed
    on_malformed: str = "skip"  # "skip" (count + warn with line numbers) | "error"
    # Keyword arguments of the tokenizer's apply_chat_template for chat-message prompts, train
    # and validation alike (verl), e.g. {"enable_thinking": False} for Qwen3. On the command
    # line a Python dict literal: --config.data.apply_chat_template_kwargs="{'enable_thinking':
    # False}" (a key that the config file sets can also be overridden alone).
    apply_chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    arithmetic: ArithmeticConfig = ArithmeticConfig()

    def __post_init__(self):
        c = Checks("data")
        c.choice("source", self.source, DATA_SOURCES)
        c.choice("truncation", self.truncation, prompts.TRUNCATION_MODES)
        c.choice("prompt_padding", self.prompt_padding, prompts.PADDINGS)
        c.choice("on_malformed", self.on_malformed, readers.ON_MALFORMED_MODES)
        positive(c, self, "train_batch_size", "val_batch_size", "max_prompt_length")
        positive(c, self, "max_response_length", "prompt_length_bucket")
        for name in ("train_max_samples", "val_max_samples"):
            value = getattr(self, name)
            c.need(value == -1 or value >= 1, name, value, "must be -1 (all) or >= 1")
        c.call(prompts.check_chat_template_kwargs, self.apply_chat_template_kwargs)
        c.need(self.seed >= 0, "seed", self.seed, "must be >= 0")
        c.need(self.gen_batch_size is None or self.gen_batch_size >= 1, "gen_batch_size",
               self.gen_batch_size, "must be >= 1 or None")
        c.done()

    def check_source(self) -> None:
        """What loading from `source` needs (the loader and train.py call it; a library user who
        passes examples directly never does)."""
        c = Checks("data")
        if self.source in ("files", "jsonl"):
            c.need(bool(self.paths), "path", self.path, f"is required with source={self.source!r}")
            c.need(
                bool(self.val_paths),
                "val_path",
                self.val_path,
                f"is required with source={self.source!r}",
            )
        if self.source == "hf":
            c.need(bool(self.paths), "path", self.path, "must name the dataset for source='hf'")
        # A file named where the source does not read it would be ignored: the run would train
        # on other data than the one given.
        splits = f"splits {self.train_split!r} / {self.val_split!r}"
        unread, reads = {
            "tfds": (("path", "val_path"), f"tfds' {self.tfds_name!r}, {splits}"),
            "hf": (("val_path",), f"{self.path!r}, {splits}"),
            "arithmetic": (("path", "val_path"), "the built-in arithmetic task (data.arithmetic)"),
        }.get(self.source, ((), ""))
        for name in unread:
            value = getattr(self, name)
            c.need(
                not value,
                name,
                value,
                f"is not read with source={self.source!r}, which reads {reads}: set "
                "data.source=files to train on your files, or drop it",
            )
        c.done()

    @property
    def paths(self) -> tuple[str, ...]:
        return registry.split_list(self.path)

    @property
    def val_paths(self) -> tuple[str, ...]:
        return registry.split_list(self.val_path)
