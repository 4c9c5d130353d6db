"""Prompts: the chat template, overlong policy, batches and the resumable order.

Reading files, HF datasets and tfds into Examples is tested in tests/test_dataset.py.
"""

import json

import numpy as np
import pytest
import reference

from grpo_jax.data import demo_task, prompts


def _examples(questions):
    return [
        prompts.Example(({"role": "user", "content": q},), str(i), line=i + 1)
        for i, q in enumerate(questions)
    ]


def test_prompt_is_verl_instruction_in_chat_template():
    tok = demo_task.char_tokenizer()
    suffix = ' Let\'s think step by step and output the final answer after "####".'
    text = prompts.chat_prompt(tok, "2+3?", suffix=suffix)
    assert text == "<|user|>2+3?" + suffix + "<|assistant|>"
    ps = prompts.encode(
        tok,
        _examples(["2+3?" + suffix]),
        max_prompt_length=512,
        filter_overlong_prompts=False,
        truncation="error",
    )
    # char tokenizer: <|user|> + 4 chars of "2+3?" + the suffix + <|assistant|>
    assert len(ps.prompt_ids[0]) == 1 + 4 + len(suffix) + 1
    assert tok.decode(ps.prompt_ids[0], skip_special_tokens=True) == "2+3?" + suffix
    # A plain-string prompt (TRL's standard format) is used as it is, without the template.
    plain = prompts.Example("2+3=")
    ps = prompts.encode(
        tok, [plain], max_prompt_length=8, filter_overlong_prompts=False, truncation="error"
    )
    assert tok.decode(ps.prompt_ids[0], skip_special_tokens=False) == "2+3="


def test_overlong_filter_and_truncation():
    tok = demo_task.char_tokenizer()
    exs = _examples(["ab", "abcdef"])  # 4 and 8 tokens with the two role markers
    kw = dict(max_prompt_length=5)
    ps = prompts.encode(tok, exs, filter_overlong_prompts=True, truncation="error", **kw)
    assert len(ps) == 1 and ps.num_filtered == 1 and ps.examples[0].prompt[0]["content"] == "ab"
    with pytest.raises(ValueError, match="line 2 has 8 tokens > data.max_prompt_length=5"):
        prompts.encode(tok, exs, filter_overlong_prompts=False, truncation="error", **kw)
    left = prompts.encode(tok, exs, filter_overlong_prompts=False, truncation="left", **kw)
    right = prompts.encode(tok, exs, filter_overlong_prompts=False, truncation="right", **kw)
    assert tok.decode(left.prompt_ids[1], skip_special_tokens=False) == "cdef<|assistant|>"
    assert tok.decode(right.prompt_ids[1], skip_special_tokens=False) == "<|user|>abcd"
    with pytest.raises(ValueError, match=r"error.*left.*right.*'middle'"):
        prompts.encode(tok, exs, filter_overlong_prompts=False, truncation="middle", **kw)


def test_make_batch_left_pads():
    ps = prompts.PromptSet(tuple(_examples(["a", "b"])), ((7, 8, 9), (5,)), 0)
    b = prompts.make_batch(ps, [1, 0], pad_token_id=0)
    np.testing.assert_array_equal(b.prompt_ids_PT, [[0, 0, 5], [7, 8, 9]])
    np.testing.assert_array_equal(b.prompt_mask_PT, [[0, 0, 1], [1, 1, 1]])
    assert b.ground_truths == ("1", "0")


def test_prompt_padding_gives_every_batch_one_width():
    """data.prompt_padding: "dataset" pads every batch to the set's longest prompt (one width,
    so one sampler program set, whichever prompts a batch draws); "batch" to its own longest;
    "max_prompt_length" to verl's fixed width. The tokens and their order are the same."""
    lengths = (3, 70, 5, 130, 9, 2)  # batches of 2 fall in three 64-column buckets
    ps = prompts.PromptSet(
        tuple(_examples(["q"] * len(lengths))),
        tuple(tuple(range(1, n + 1)) for n in lengths),
        0,
    )
    batches = [[0, 2], [1, 4], [3, 5]]
    width = {
        padding: prompts.pad_width(ps, padding, max_prompt_length=200)
        for padding in prompts.PADDINGS
    }
    assert width == {"batch": 0, "dataset": 130, "max_prompt_length": 200}
    for padding, expect in (("batch", [5, 70, 130]), ("dataset", [130] * 3),
                            ("max_prompt_length", [200] * 3)):  # fmt: skip
        got = [prompts.make_batch(ps, b, pad_token_id=0, width=width[padding]) for b in batches]
        assert [g.prompt_ids_PT.shape[1] for g in got] == expect, padding
        for g, b in zip(got, batches):
            for row, i in zip(range(2), b):
                mask = g.prompt_mask_PT[row].astype(bool)
                assert mask.sum() == lengths[i] and mask[-lengths[i] :].all()  # left-padded
                assert tuple(g.prompt_ids_PT[row][mask]) == ps.prompt_ids[i]
    with pytest.raises(ValueError, match="data.prompt_padding must be one of"):
        prompts.pad_width(ps, "longest", max_prompt_length=200)


def _run(n, bs, steps, pos=prompts.Position(), seed=3):
    out = []
    for _ in range(steps):
        idx, pos = prompts.next_indices(n, pos, bs, seed=seed, shuffle=True)
        out.append(idx.tolist())
    return out, pos


def test_order_epochs_drop_last_and_exact_resume():
    # n=10, bs=4: 2 full batches per epoch, the last 2 prompts of each epoch's order dropped.
    batches, pos = _run(10, 4, 5)
    assert pos == prompts.Position(epoch=2, index=4)
    ep0 = prompts.epoch_order(10, epoch=0, seed=3, shuffle=True)
    ep1 = prompts.epoch_order(10, epoch=1, seed=3, shuffle=True)
    assert sorted(ep0.tolist()) == list(range(10))
    assert batches[0] + batches[1] == ep0[:8].tolist()
    assert batches[2] + batches[3] == ep1[:8].tolist()
    assert ep0.tolist() != ep1.tolist()  # reshuffled each epoch
    # Resuming from a saved position reproduces the uninterrupted sequence exactly.
    first, mid = _run(10, 4, 3)
    rest, _ = _run(10, 4, 2, pos=prompts.Position(mid.epoch, mid.index))
    assert first + rest == batches
    assert prompts.epoch_order(5, epoch=4, seed=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="train_batch_size=11 exceeds the 10"):
        prompts.steps_per_epoch(10, 11)


# Qwen3's chat template ends the generation prompt with an empty think block when the caller
# passes enable_thinking=False (its own tokenizer_config.json; the lines below are that block,
# around a ChatML loop over the messages).
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def qwen3_like_tokenizer():
    """The character tokenizer with Qwen3's enable_thinking template."""
    tok = demo_task.char_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def test_chat_template_kwargs_reach_the_template():
    # data.apply_chat_template_kwargs (verl: RLHFDataset and the agent loop pass them to
    # apply_chat_template): Qwen3's enable_thinking=False appends the empty think block.
    tok = qwen3_like_tokenizer()
    exs = _examples(["2+3?", "10+1?"])

    def ids(kwargs):
        return prompts.encode(
            tok,
            exs,
            max_prompt_length=128,
            filter_overlong_prompts=False,
            truncation="error",
            chat_template_kwargs=kwargs,
        ).prompt_ids

    think = tuple(tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
    plain, off, on = ids(None), ids({"enable_thinking": False}), ids({"enable_thinking": True})
    assert on == plain == ids({})
    assert all(o == p + think for o, p in zip(off, plain, strict=True))
    assert tok.decode(off[0]) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n")  # fmt: skip
    # The overlong rule counts the tokens the template adds.
    longest = max(len(p) for p in plain)  # fits without the block, not with it
    with pytest.raises(ValueError, match=rf"line 1 has {len(plain[0]) + len(think)} tokens"):
        prompts.encode(
            tok,
            exs,
            max_prompt_length=longest,
            filter_overlong_prompts=False,
            truncation="error",
            chat_template_kwargs={"enable_thinking": False},
        )


def test_select_samples_is_verls_rlhf_dataset(verl, tmp_path):
    # data.train_max_samples / val_max_samples: the rows verl's RLHFDataset keeps, in its order:
    # a default_rng(data.seed) draw with data.shuffle, the first ones without, all for -1.
    total = 40
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(total):
            row = {
                "prompt": [{"role": "user", "content": f"q{i}"}],
                "data_source": "x",
                "reward_model": {"ground_truth": str(i)},
                "extra_info": {"index": i},
            }
            f.write(json.dumps(row) + "\n")
    for max_samples, shuffle, seed in [(7, True, 3), (7, True, 1), (7, False, 3), (-1, True, 3),
                                       (40, True, 3)]:  # fmt: skip
        want = verl.run(reference.fn("verl_dataset:kept_rows")(
            str(path), max_samples, shuffle, seed, str(tmp_path / "cache"))).value  # fmt: skip
        got = prompts.select_samples(total, max_samples, shuffle=shuffle, seed=seed)
        assert got.tolist() == want, (max_samples, shuffle, seed)
    assert len(set(prompts.select_samples(total, 39, shuffle=True, seed=0).tolist())) == 39
