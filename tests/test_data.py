"""Data pipeline: malformed rows, verl prompt + chat template, overlong policy, resumable order."""

import json

import numpy as np
import pytest

from grpo_jax import data, demo_task


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


GOOD = json.dumps({"question": "2+3?", "answer": "2+3=5\n#### 5"})


def test_malformed_rows_skipped_with_line_numbers(tmp_path, caplog):
    path = _write(
        tmp_path,
        [
            GOOD,
            "{not json",
            json.dumps({"question": "", "answer": "#### 1"}),
            json.dumps({"question": "q"}),
            json.dumps({"question": "q", "answer": "no number"}),
            json.dumps({"question": "big", "answer": "#### 1,234"}),
        ],
    )
    exs = data.read_jsonl(path, on_malformed="skip")
    assert [(e.line, e.ground_truth) for e in exs] == [(1, "5"), (6, "1234")]
    assert "4 malformed row(s)" in caplog.text
    for line in (
        "line 2: invalid JSON",
        "line 3: missing or empty 'question'",
        "line 4: missing 'answer'",
        "line 5: answer has no",
    ):
        assert line in caplog.text


def test_malformed_rows_rejected(tmp_path):
    path = _write(tmp_path, [GOOD, json.dumps({"question": "q", "answer": "x"})])
    with pytest.raises(ValueError, match=r"1 malformed row\(s\): line 2"):
        data.read_jsonl(path, on_malformed="error")
    with pytest.raises(ValueError, match=r"skip.*error.*'drop'"):
        data.read_jsonl(path, on_malformed="drop")


def _examples(questions):
    return [data.Example(q, f"#### {i}", str(i), i + 1) for i, q in enumerate(questions)]


def test_prompt_is_verl_instruction_in_chat_template():
    tok = demo_task.char_tokenizer()
    suffix = ' Let\'s think step by step and output the final answer after "####".'
    text = data.chat_prompt(tok, "2+3?", suffix=suffix)
    assert text == "<|user|>2+3?" + suffix + "<|assistant|>"
    ps = data.encode(
        tok,
        _examples(["2+3?"]),
        suffix=suffix,
        max_prompt_length=512,
        filter_overlong_prompts=False,
        truncation="error",
    )
    # char tokenizer: <|user|> + 4 chars of "2+3?" + the suffix + <|assistant|>
    assert len(ps.prompt_ids[0]) == 1 + 4 + len(suffix) + 1
    assert tok.decode(ps.prompt_ids[0], skip_special_tokens=True) == "2+3?" + suffix


def test_overlong_filter_and_truncation():
    tok = demo_task.char_tokenizer()
    exs = _examples(["ab", "abcdef"])  # 4 and 8 tokens with the two role markers
    kw = dict(suffix="", max_prompt_length=5)
    ps = data.encode(tok, exs, filter_overlong_prompts=True, truncation="error", **kw)
    assert len(ps) == 1 and ps.num_filtered == 1 and ps.examples[0].question == "ab"
    with pytest.raises(ValueError, match="line 2 has 8 tokens > data.max_prompt_length=5"):
        data.encode(tok, exs, filter_overlong_prompts=False, truncation="error", **kw)
    left = data.encode(tok, exs, filter_overlong_prompts=False, truncation="left", **kw)
    right = data.encode(tok, exs, filter_overlong_prompts=False, truncation="right", **kw)
    assert tok.decode(left.prompt_ids[1], skip_special_tokens=False) == "cdef<|assistant|>"
    assert tok.decode(right.prompt_ids[1], skip_special_tokens=False) == "<|user|>abcd"
    with pytest.raises(ValueError, match=r"error.*left.*right.*'middle'"):
        data.encode(tok, exs, filter_overlong_prompts=False, truncation="middle", **kw)


def test_make_batch_left_pads():
    ps = data.PromptSet(tuple(_examples(["a", "b"])), ((7, 8, 9), (5,)), 0)
    b = data.make_batch(ps, [1, 0], pad_token_id=0)
    np.testing.assert_array_equal(b.prompt_ids_PT, [[0, 0, 5], [7, 8, 9]])
    np.testing.assert_array_equal(b.prompt_mask_PT, [[0, 0, 1], [1, 1, 1]])
    assert b.ground_truths == ("1", "0")


def _run(n, bs, steps, pos=data.Position(), seed=3):
    out = []
    for _ in range(steps):
        idx, pos = data.next_indices(n, pos, bs, seed=seed, shuffle=True)
        out.append(idx.tolist())
    return out, pos


def test_order_epochs_drop_last_and_exact_resume():
    # n=10, bs=4: 2 full batches per epoch, the last 2 prompts of each epoch's order dropped.
    batches, pos = _run(10, 4, 5)
    assert pos == data.Position(epoch=2, index=4)
    ep0 = data.epoch_order(10, epoch=0, seed=3, shuffle=True)
    ep1 = data.epoch_order(10, epoch=1, seed=3, shuffle=True)
    assert sorted(ep0.tolist()) == list(range(10))
    assert batches[0] + batches[1] == ep0[:8].tolist()
    assert batches[2] + batches[3] == ep1[:8].tolist()
    assert ep0.tolist() != ep1.tolist()  # reshuffled each epoch
    # Resuming from a saved position reproduces the uninterrupted sequence exactly.
    first, mid = _run(10, 4, 3)
    rest, _ = _run(10, 4, 2, pos=data.Position(mid.epoch, mid.index))
    assert first + rest == batches
    assert data.epoch_order(5, epoch=4, seed=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="train_batch_size=11 exceeds the 10"):
        data.steps_per_epoch(10, 11)


def test_arithmetic_rows_parse_and_are_disjoint():
    train, val = demo_task.arithmetic_rows(300, 50, max_operand=29, seed=0)
    exs = data.parse_rows(train, source="demo", on_malformed="error")
    for e in exs:
        a, b = map(int, e.question.split("+"))
        assert e.ground_truth == str(a + b)
    assert not {r["question"] for r in val} & {r["question"] for r in train}
