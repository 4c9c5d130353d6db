"""Reading prompt datasets into `data.Example`s: files, HF datasets, tfds and the built-in task.

Sources (config `data.source`):
  * "files" (or "jsonl"): local parquet, jsonl or json files, one or a comma-separated list.
  * "hf": anything `datasets.load_dataset(data.path, data.hf_name, split=...)` loads (a hub id
    when online, a local dataset directory, a loading script).
  * "tfds": a tensorflow-datasets builder read through `tfds.data_source` (array_record), which
    needs no TensorFlow; a dataset already prepared in `data.tfds_data_dir` is read offline.
  * "arithmetic": the built-in addition task (grpo_jax/data/demo_task.py).

Row layouts, recognised per row:
  * verl's (examples/data_preprocess/*.py): `prompt` holds chat messages, `data_source` names
    the scorer, `reward_model.ground_truth` is the ground truth, `extra_info` a dict. The column
    names are configurable with verl's `data.prompt_key` / `data.reward_fn_key`, plus our
    `data.ground_truth_key` (a dotted path).
  * TRL's: `prompt` is a plain string or chat messages; every other column is passed to TRL-style
    reward functions as a keyword argument.
  * Raw GSM8K ({"question", "answer"} with a final "#### <number>" line, as
    ../shared/data/gsm8k or the OpenAI release): turned into verl's GSM8K row, i.e. the question
    plus `data.prompt_suffix` as one user turn, the number after "####" (commas removed) as the
    ground truth and "openai/gsm8k" as the data source.
Malformed rows (bad JSON, no prompt, an empty prompt, messages without role/content, a raw GSM8K
answer without a numeric "####" line) are counted with their line numbers and skipped with a
warning or rejected (`data.on_malformed`).
"""

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_jax.data import prompts
from grpo_jax.errors import InputError
from grpo_jax.rewards import scorers

GSM8K_SOURCE = "openai/gsm8k"
ON_MALFORMED_MODES = ("skip", "error")  # data.on_malformed
# verl's GSM8K instruction (examples/data_preprocess/gsm8k.py), appended to raw GSM8K questions.
VERL_GSM8K_INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which columns hold what (config section `data`)."""

    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    ground_truth_key: str = "reward_model.ground_truth"
    prompt_suffix: str = VERL_GSM8K_INSTRUCTION


class _Malformed(Exception):
    """A row that is not an Example; the message says why."""


def _dotted(row: Mapping[str, Any], path: str):
    """row["a"]["b"] for path "a.b"; KeyError when a part is missing."""
    value = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def _messages(value, key: str) -> str | tuple[dict, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise _Malformed(f"empty '{key}'")
        return value
    if isinstance(value, Sequence) and value:
        messages = []
        for m in value:
            if isinstance(m, Mapping):
                # parquet gives every message every key of the column (None where absent) and
                # lists as arrays: keep what is there, as lists
                m = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in m.items()
                     if v is not None or k == "content"}
                if m.get("tool_calls") and m.get("content") is None:  # OpenAI: calls only
                    m["content"] = ""
            if not (
                isinstance(m, Mapping)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise _Malformed(
                    f"'{key}' must be a string or chat messages with 'role' and "
                    f"'content' strings, got {m!r:.80}"
                )
            # every key is kept (an assistant turn's tool_calls, a tool turn's name or
            # tool_call_id): the chat template renders them
            messages.append(dict(m))
        return tuple(messages)
    raise _Malformed(f"'{key}' must be a non-empty string or list of chat messages")


def parse_row(row, *, index: int, layout: Layout) -> prompts.Example:
    """One raw row -> Example (see the module docstring); raises _Malformed."""
    if not isinstance(row, Mapping):
        raise _Malformed(str(row))
    line = index + 1
    if layout.prompt_key in row:
        prompt = _messages(row[layout.prompt_key], layout.prompt_key)
        source = row.get(layout.reward_fn_key, "unknown")
        if not isinstance(source, str) or not source:
            raise _Malformed(f"'{layout.reward_fn_key}' must be a non-empty string")
        try:
            ground_truth = _dotted(row, layout.ground_truth_key)
        except KeyError:
            ground_truth = None
        extra = row.get("extra_info") or {}
        if not isinstance(extra, Mapping):
            raise _Malformed(f"'extra_info' must be a dict, got {type(extra).__name__}")
        answer = extra.get("answer")
        columns = {k: v for k, v in row.items() if k != layout.prompt_key}
        return prompts.Example(
            prompt,
            ground_truth,
            source,
            dict(extra),
            columns,
            answer if isinstance(answer, str) else None,
            line,
        )
    if "question" in row or "answer" in row:
        return _raw_gsm8k(row, line=line, suffix=layout.prompt_suffix)
    raise _Malformed(
        f"no '{layout.prompt_key}' column (set data.prompt_key), and not a raw "
        "GSM8K row with 'question' and 'answer'"
    )


def _raw_gsm8k(row: Mapping[str, Any], *, line: int, suffix: str) -> prompts.Example:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise _Malformed("missing or empty 'question'")
    if not isinstance(answer, str):
        raise _Malformed("missing 'answer'")
    try:
        ground_truth = scorers.gsm8k_ground_truth(answer)
    except ValueError:
        raise _Malformed("answer has no '#### <number>' line") from None
    try:
        float(ground_truth)  # the "####" regex also admits "," or "1.2.3", which are not numbers
    except ValueError:
        raise _Malformed(f"non-numeric answer {ground_truth!r} after '####'") from None
    prompt = ({"role": "user", "content": question + suffix},)
    extra = {"index": line - 1, "question": question, "answer": answer}
    return prompts.Example(prompt, ground_truth, GSM8K_SOURCE, extra, dict(row), answer, line)


def parse_rows(
    rows: Sequence[Any], *, source: str, on_malformed: str, layout: Layout = Layout()
) -> list[prompts.Example]:
    """Validates raw rows into Examples.

    Args:
      rows: raw rows; an entry that is not a dict (e.g. a JSON parse failure recorded as an
        error string) counts as malformed.
      source: name used in messages (a file path or "tfds:gsm8k/train").
      on_malformed: "skip" or "error" (data.on_malformed).
      layout: the column names.

    Raises:
      ValueError: on_malformed == "error" and some row is malformed (all bad lines are listed),
        or no row is valid.
    """
    if on_malformed not in ON_MALFORMED_MODES:
        raise ValueError(
            f"data.on_malformed must be one of {ON_MALFORMED_MODES}, got "
            f"{on_malformed!r}"
        )
    examples, bad = [], []
    for i, row in enumerate(rows):
        try:
            examples.append(parse_row(row, index=i, layout=layout))
        except _Malformed as e:
            bad.append((i + 1, str(e)))
    if bad:
        listing = "; ".join(f"line {n}: {why}" for n, why in bad[:20])
        more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
        msg = f"{source}: {len(bad)} malformed row(s): {listing}{more}"
        if on_malformed == "error":
            raise InputError(msg + " (set data.on_malformed='skip' to drop them)")
        logging.warning("%s; skipped", msg)
    if not examples:
        raise InputError(f"{source}: no valid rows")
    return examples


def read_jsonl_rows(path: str) -> list[Any]:
    """The rows of a jsonl file; an unparsable line becomes an error string (malformed)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise InputError(f"data file {path!r} is not UTF-8 text, so not jsonl ({e})") from e
        for text in lines:
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
    return rows


def read_rows(path: str) -> list[Any]:
    """The rows of one local file, by extension: .parquet, .jsonl, .json (a list of rows)."""
    if not os.path.isfile(path):
        raise InputError(f"data file {path!r} does not exist (or is not a file)")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow  # installed with `datasets`
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as e:
            raise InputError(f"data file {path!r} is not a readable parquet file ({e})") from e
    if ext == ".jsonl":
        return read_jsonl_rows(path)
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"data file {path!r} is not valid JSON ({e})") from e
        if not isinstance(rows, list):
            raise InputError(f"{path}: a .json dataset must be a list of rows")
        return rows
    raise InputError(
        f"data file {path!r}: unknown format {ext!r} (use .parquet, .jsonl or .json)"
    )


def read_files(
    paths: Sequence[str], *, on_malformed: str, layout: Layout = Layout()
) -> list[prompts.Example]:
    """Every row of every file, in order (verl concatenates data.train_files the same way)."""
    out = []
    for path in paths:
        out += parse_rows(read_rows(path), source=path, on_malformed=on_malformed, layout=layout)
    return out


def read_jsonl(path: str, *, on_malformed: str, layout: Layout = Layout()) -> list[prompts.Example]:
    """One jsonl file (any layout above)."""
    return read_files([path], on_malformed=on_malformed, layout=layout)


def read_hf(
    path: str,
    *,
    split: str,
    name: str | None = None,
    on_malformed: str,
    layout: Layout = Layout(),
) -> list[prompts.Example]:
    """A split of `datasets.load_dataset(path, name)` (hub id, local dir or files)."""
    import datasets

    ds = datasets.load_dataset(path, name, split=split)
    return parse_rows(
        list(ds), source=f"hf:{path}/{split}", on_malformed=on_malformed, layout=layout
    )


def _decoded(value):
    """tfds Text features come back as bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, Mapping):
        return {k: _decoded(v) for k, v in value.items()}
    return value


def read_tfds(
    name: str,
    *,
    split: str,
    data_dir: str | None = None,
    on_malformed: str,
    layout: Layout = Layout(),
) -> list[prompts.Example]:
    """A tfds split through `tfds.data_source` (array_record; no TensorFlow needed).

    The first use downloads and prepares the dataset into `data_dir` (network); a dataset that is
    already prepared there, by tfds or copied from elsewhere, is read offline.
    """
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401 - registers the text builders (gsm8k among them)

    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir)
    except OSError as e:  # requests' connection errors among them
        raise InputError(
            f"data.source='tfds' could not prepare {name!r} (split {split!r}) in "
            f"{data_dir or '~/tensorflow_datasets'}: {e}. tfds downloads a dataset on its first "
            "use, which needs network: prepare it where there is network and point "
            "data.tfds_data_dir at a copy, or set data.source=files with data.path / "
            "data.val_path"
        ) from e
    rows = [_decoded(source[i]) for i in range(len(source))]
    return parse_rows(rows, source=f"tfds:{name}/{split}", on_malformed=on_malformed, layout=layout)
