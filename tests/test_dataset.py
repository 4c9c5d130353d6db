"""Reading prompt datasets (grpo_jax/data/readers.py): every source and layout, and bad rows.

The verl-layout parquet is built the way verl's examples/data_preprocess/gsm8k.py builds it
(HF `datasets` map over the raw rows, then `to_parquet`); that script is not in verl's wheel or
sdist, so the test repeats its construction with the same calls and fields. Tests on the real
GSM8K need ../shared/data/gsm8k and skip cleanly without it.
"""

import json
import os

import pytest

from grpo_jax import config, errors, loading
from grpo_jax.data import demo_task, readers
from grpo_jax.rewards import scorers

GSM8K_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")
INSTRUCTION = readers.VERL_GSM8K_INSTRUCTION


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _raw_rows(n, offset=0):
    return [
        {
            "question": f"Tom has {offset + i} apples and buys {i + 2} more. How many now?",
            "answer": f"{offset + i}+{i + 2}=<<{offset + i}+{i + 2}={offset + 2 * i + 2}>>"
            f"{offset + 2 * i + 2}\n#### {offset + 2 * i + 2:,}",
        }
        for i in range(n)
    ]


GOOD = json.dumps({"question": "2+3?", "answer": "2+3=5\n#### 5"})


def test_malformed_rows_skipped_with_line_numbers(tmp_path, caplog):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            GOOD,
            "{not json",
            json.dumps({"question": "", "answer": "#### 1"}),
            json.dumps({"question": "q"}),
            json.dumps({"question": "q", "answer": "no number"}),
            json.dumps({"question": "big", "answer": "#### 1,234"}),
            json.dumps({"prompt": [{"role": "user"}]}),
            json.dumps({"text": "no prompt here"}),
        ],
    )
    exs = readers.read_jsonl(path, on_malformed="skip")
    assert [(e.line, e.ground_truth) for e in exs] == [(1, "5"), (6, "1234")]
    assert "6 malformed row(s)" in caplog.text
    for line in (
        "line 2: invalid JSON",
        "line 3: missing or empty 'question'",
        "line 4: missing 'answer'",
        "line 5: answer has no",
        "line 7: 'prompt' must be a string or chat messages with 'role' and 'content'",
        "line 8: no 'prompt' column (set data.prompt_key)",
    ):
        assert line in caplog.text


def test_malformed_rows_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [GOOD, json.dumps({"question": "q", "answer": "x"})])
    with pytest.raises(ValueError, match=r"1 malformed row\(s\): line 2"):
        readers.read_jsonl(path, on_malformed="error")
    with pytest.raises(ValueError, match=r"skip.*error.*'drop'"):
        readers.read_jsonl(path, on_malformed="drop")


def test_raw_gsm8k_row_becomes_verls_row():
    (ex,) = readers.parse_rows(_raw_rows(1, 1000), source="t", on_malformed="error")
    # verl's preprocessing: question + " " + instruction, one user turn; commas dropped.
    assert ex.prompt == (
        {"role": "user", "content": _raw_rows(1, 1000)[0]["question"] + INSTRUCTION},
    )
    assert (ex.ground_truth, ex.data_source) == ("1002", "openai/gsm8k")
    assert ex.answer == _raw_rows(1, 1000)[0]["answer"] and ex.extra_info["index"] == 0


def _verl_gsm8k_parquet(raw_rows, path, split):
    """The rows of verl's examples/data_preprocess/gsm8k.py, written the way it writes them."""
    import datasets

    def process_fn(example, idx):
        question_raw, answer_raw = example.pop("question"), example.pop("answer")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question_raw + INSTRUCTION}],
            "ability": "math",
            "reward_model": {
                "style": "rule",
                "ground_truth": scorers.gsm8k_ground_truth(answer_raw),
            },
            "extra_info": {
                "split": split,
                "index": idx,
                "answer": answer_raw,
                "question": question_raw,
            },
        }

    ds = datasets.Dataset.from_list(raw_rows).map(function=process_fn, with_indices=True)
    ds.to_parquet(str(path))
    return str(path)


def _real_or_synthetic(n):
    path = os.path.join(GSM8K_DIR, "test.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            return [json.loads(line) for _, line in zip(range(n), f, strict=False)]
    return _raw_rows(n)


def test_verl_parquet_equals_the_raw_jsonl_path(tmp_path):
    raw = _real_or_synthetic(40)
    parquet = _verl_gsm8k_parquet(raw, tmp_path / "test.parquet", "test")
    jsonl = _write_jsonl(tmp_path / "test.jsonl", raw)
    from_verl = readers.read_files([parquet], on_malformed="error")
    from_raw = readers.read_files([jsonl], on_malformed="error")
    assert len(from_verl) == len(from_raw) == 40
    for a, b in zip(from_verl, from_raw, strict=True):
        assert (a.prompt, a.ground_truth, a.data_source, a.answer) == (
            b.prompt,
            b.ground_truth,
            b.data_source,
            b.answer,
        )
        assert a.extra_info["question"] == b.extra_info["question"]
        assert a.columns["ability"] == "math"  # verl's other columns reach TRL-style rewards


def test_several_files_are_concatenated_and_keep_their_sources(tmp_path):
    gsm = _write_jsonl(tmp_path / "a.jsonl", _raw_rows(3))
    other = _write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"prompt": f"Say {i}.", "data_source": "echo", "reward_model": {"ground_truth": str(i)}}
            for i in range(2)
        ],
    )
    exs = readers.read_files([gsm, other], on_malformed="error")
    assert [e.data_source for e in exs] == ["openai/gsm8k"] * 3 + ["echo"] * 2
    assert exs[3].prompt == "Say 0." and exs[4].ground_truth == "1"


def test_trl_layout_and_column_mapping(tmp_path):
    rows = [
        {
            "question_msgs": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+1?"},
            ],
            "solution": "2",
            "src": "toy",
            "level": 3,
        }
    ]
    layout = readers.Layout(
        prompt_key="question_msgs", reward_fn_key="src", ground_truth_key="solution"
    )
    (ex,) = readers.parse_rows(rows, source="t", on_malformed="error", layout=layout)
    assert [m["role"] for m in ex.prompt] == ["system", "user"]
    assert (ex.ground_truth, ex.data_source, ex.columns["level"]) == ("2", "toy", 3)
    # No ground truth at the configured path: None (TRL-style rewards read their own columns).
    (ex,) = readers.parse_rows([{"prompt": "hi"}], source="t", on_malformed="error")
    assert (ex.ground_truth, ex.data_source) == (None, "unknown")


def test_hf_datasets_local_dir_with_configs(tmp_path):
    """A local copy of the hub's openai/gsm8k layout (config "main" in README.md)."""
    import datasets

    root = tmp_path / "gsm8k"
    (root / "main").mkdir(parents=True)
    for split, rows in (("train", _raw_rows(6)), ("test", _raw_rows(2, 50))):
        datasets.Dataset.from_list(rows).to_parquet(str(root / "main" / f"{split}-0.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
        "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n"
    )
    cfg = config.DataConfig(source="hf", path=str(root), hf_name="main")
    train = loading.examples(cfg, "train")
    val = loading.examples(cfg, "val")
    assert len(train) == 6 and len(val) == 2 and val[0].ground_truth == "52"


def _prepare_tfds_offline(data_dir, rows_by_file):
    """Prepares tfds' gsm8k builder from local files: its download step is pointed at them."""
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text.gsm8k  # noqa: F401 - registers the builder

    def local_download_and_extract(self, url_or_urls):
        return {k: rows_by_file[url.rsplit("/", 1)[-1]] for k, url in url_or_urls.items()}

    original = tfds.download.DownloadManager.download_and_extract
    tfds.download.DownloadManager.download_and_extract = local_download_and_extract
    try:
        builder = tfds.builder("gsm8k", data_dir=str(data_dir), file_format="array_record")
        builder.download_and_prepare()
    finally:
        tfds.download.DownloadManager.download_and_extract = original


def test_tfds_source_reads_a_prepared_dataset_without_tensorflow(tmp_path):
    with pytest.raises(ImportError):
        import tensorflow  # noqa: F401 - the path must not need it
    files = {}
    for name, rows in (
        ("train", _raw_rows(5)),
        ("test", _raw_rows(3, 40)),
        ("train_socratic", _raw_rows(2)),
        ("test_socratic", _raw_rows(2)),
    ):
        files[f"{name}.jsonl"] = _write_jsonl(tmp_path / f"{name}.jsonl", rows)
    _prepare_tfds_offline(tmp_path / "tfds", files)
    cfg = config.DataConfig(source="tfds", tfds_data_dir=str(tmp_path / "tfds"))
    train, val = loading.examples(cfg, "train"), loading.examples(cfg, "val")
    want = readers.read_jsonl(files["test.jsonl"], on_malformed="error")
    assert len(train) == 5
    assert sorted(e.ground_truth for e in val) == sorted(e.ground_truth for e in want)
    assert {e.data_source for e in val} == {"openai/gsm8k"}


def test_tfds_without_network_names_the_source_and_the_way_out(tmp_path, monkeypatch):
    """A first use of tfds downloads; with no network the run ends with what to do instead."""
    import requests
    import tensorflow_datasets as tfds

    def offline(name, split, data_dir):
        raise requests.exceptions.ConnectionError("Failed to resolve 'raw.githubusercontent.com'")

    monkeypatch.setattr(tfds, "data_source", offline)
    cfg = config.DataConfig(source="tfds", tfds_data_dir=str(tmp_path / "tfds"))
    with pytest.raises(errors.InputError) as e:
        loading.examples(cfg, "train")
    msg = str(e.value)
    for part in ("data.source='tfds'", "'gsm8k'", str(tmp_path / "tfds"), "needs network",
                 "data.tfds_data_dir", "data.source=files"):  # fmt: skip
        assert part in msg, msg


def test_a_file_given_to_a_hub_source_is_an_error_not_ignored():
    for kw, field in (
        ({"source": "tfds", "path": "train.parquet"}, "data.path='train.parquet'"),
        ({"source": "tfds", "val_path": "test.parquet"}, "data.val_path='test.parquet'"),
        ({"source": "hf", "path": "gsm8k", "val_path": "t.jsonl"}, "data.val_path='t.jsonl'"),
        ({"source": "arithmetic", "path": "a.jsonl"}, "data.path='a.jsonl'"),
    ):
        with pytest.raises(config.ConfigError) as e:
            config.DataConfig(**kw).check_source()
        assert f"{field} is not read with source={kw['source']!r}" in str(e.value)
        assert "data.source=files" in str(e.value)
    config.DataConfig(source="tfds").check_source()
    config.DataConfig(source="arithmetic").check_source()
    config.DataConfig(source="hf", path="openai/gsm8k").check_source()
    config.DataConfig(source="files", path="a.jsonl", val_path="b.jsonl").check_source()


def test_arithmetic_rows_parse_and_are_disjoint():
    train, val = demo_task.arithmetic_rows(300, 50, max_operand=29, seed=0, instruction=" Sum?")
    exs = readers.parse_rows(train, source="demo", on_malformed="error")
    for e in exs:
        question = e.prompt[0]["content"].removesuffix(" Sum?")
        a, b = map(int, question.split("+"))
        assert (e.ground_truth, e.data_source, e.answer) == (
            str(a + b),
            "arithmetic",
            f"#### {a + b}",
        )
    questions = {r["extra_info"]["question"] for r in train}
    assert not {r["extra_info"]["question"] for r in val} & questions


@pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason="../shared/data/gsm8k is absent")
def test_real_gsm8k_splits_parse_completely():
    cfg = config.DataConfig(
        path=os.path.join(GSM8K_DIR, "train.jsonl"),
        val_path=os.path.join(GSM8K_DIR, "test.jsonl"),
        on_malformed="error",
    )
    train, val = loading.examples(cfg, "train"), loading.examples(cfg, "val")
    assert (len(train), len(val)) == (7473, 1319)
    # 14 test ground truths carry a thousands comma that verl's preprocessing removes.
    assert all("," not in e.ground_truth for e in train + val)
