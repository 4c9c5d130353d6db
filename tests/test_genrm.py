"""The generative reward model (an LLM judge, verl's GenRM): verl's verdict parse, the judge's
greedy verdicts against transformers' `generate`, and the loop with a judge in training and
validation."""

import json

import jax
import numpy as np
import pytest
import reference
import test_model
import test_reward_model

from grpo_jax import config, loading, sharding
from grpo_jax.data import demo_task
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.errors import InputError
from grpo_jax.rewards import genrm

SPECIALS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
# The judge speaks digits, blanks and newlines only (other characters read as <unk>), so its
# verdicts are sometimes numbers verl's parse accepts and sometimes not.
JUDGE_CHARS = list("0123456789\n ")
JUDGE_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def verl_parse(text: str):
    """verl 0.9.1's reference GenRM parse (tests/experimental/reward_loop/reward_fn.py,
    compute_score_gsm8k), restated: the int after the last blank line, else its score 0."""
    try:
        return int(text.split("\n\n")[-1].strip()), True
    except Exception:
        return 0, False


def judge_tokenizer():
    return test_reward_model.char_level_tokenizer(SPECIALS, JUDGE_CHARS, JUDGE_TEMPLATE)


def save_judge(path, seed: int = 0):
    """A random tiny Qwen2ForCausalLM judge with O(1) weights and its tokenizer, saved by
    transformers to `path`; returns (hf model, tokenizer)."""
    torch, transformers = reference.hf()
    tok = judge_tokenizer()
    hf_config = transformers.Qwen2Config(**(test_model._HF_COMMON | {
        "vocab_size": len(tok), "max_position_embeddings": 1024, "eos_token_id": 1,
        "pad_token_id": 0, "bos_token_id": None,
    }))  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.Qwen2ForCausalLM(hf_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise / p.shape[-1] ** 0.25)
    hf.eval().save_pretrained(path)
    tok.save_pretrained(path)
    # The judge's tokenizer as anyone loads it from the checkpoint (transformers picks its class
    # from config.json, which changes what an unknown character becomes).
    return hf, transformers.AutoTokenizer.from_pretrained(path)


def _run(path, *, tmp_path=None, genrm_cfg=None, rollout=None, fn="reward_model", **kw):
    return config.RunConfig(
        reward=config.RewardConfig(num_workers=0, fn=fn, **kw),
        reward_model=config.RewardModelConfig(
            enable=True, model=config.RewardModelPath(str(path)), micro_batch_size_per_gpu=4,
            rollout=rollout or config.RewardModelRollout(do_sample=False, response_length=6,
                                                         prompt_length=1024),
            genrm=genrm_cfg or config.GenRMConfig(enable=True)),
    )  # fmt: skip


def test_parse_is_verls_rule():
    cases = ["7", "The answer.\n\n 9 \n", "8\n\n", "score: 7", "3\n8", "+4", "1_0", "", "\n\n10",
             "7\n\n\n", "٣", "2.5", "0x1"]  # fmt: skip
    for text in cases:
        ref, ok = verl_parse(text)
        ours = genrm.parse_verdict(text)
        assert (ours is not None) == ok, text
        if ok:
            assert ours == ref


def test_default_template_is_verls_reference_prompt():
    # verl's GRM_PROMPT_TEMPLATE (stripped): {problem} and {solution} only, the 1-10 scale.
    assert genrm.template_fields(genrm.DEFAULT_TEMPLATE) == ("problem", "solution")
    text = genrm.judge_prompt(genrm.DEFAULT_TEMPLATE, problem="2+2", solution="4", ground_truth=4)
    assert text.startswith("You are given a problem and a proposed solution.\n\nProblem:\n2+2\n")
    assert "addresses the problem. \nGive a score from 1 to 10" in text
    assert text.endswith("Only output the score as a single number (integer).")


def test_config_errors_name_the_fields():
    with pytest.raises(config.ConfigError, match=r"reward_model\.genrm\.prompt_template names"):
        config.GenRMConfig(enable=True, prompt_template="{question} {solution}")
    with pytest.raises(config.ConfigError, match=r"prompt_template has no \{solution\}"):
        config.GenRMConfig(enable=True, prompt_template="{problem}")
    with pytest.raises(config.ConfigError, match=r"reward_model\.genrm\.problem_key"):
        config.GenRMConfig(enable=True, problem_key="question")
    with pytest.raises(config.ConfigError, match=r"reward_model\.rollout\.temperature"):
        config.RewardModelRollout(temperature=-1.0)
    with pytest.raises(config.ConfigError, match=r"reward_model\.genrm\.enable=True needs "):
        config.RewardModelConfig(genrm=config.GenRMConfig(enable=True))
    with pytest.raises(config.ConfigError, match=r"reward_model\.model\.path.*ForCausalLM"):
        config.RewardModelConfig(enable=True, genrm=config.GenRMConfig(enable=True))
    ex = prompts_lib.Example("q", extra_info={"answer": "4"}, line=3)
    with pytest.raises(KeyError, match=r"problem_key='extra_info.question'.*line 3"):
        genrm.problem_of(ex, "extra_info.question")


def _examples(k: int):
    rng = np.random.default_rng(0)
    out = []
    for i in range(k):
        a, b = rng.integers(0, 99, 2)
        out.append(prompts_lib.Example([{"role": "user", "content": f"{a}+{b}"}],
                                       ground_truth=str(a + b),
                                       extra_info={"question": f"{a}+{b}"}))  # fmt: skip
    return out


@pytest.mark.reference("hf")
def test_greedy_verdicts_equal_transformers_generate(tmp_path):
    torch, _ = reference.hf()
    hf, tok = save_judge(tmp_path / "judge")
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    examples = _examples(10)
    solutions = [f"{i * 37 % 101}\n\n{i}" for i in range(len(examples))]
    judges = {}
    with sharding.use_mesh(mesh):
        for unparsable in (0.0, -3.0):
            run = _run(tmp_path / "judge",
                       genrm_cfg=config.GenRMConfig(enable=True, unparsable_score=unparsable))
            judges[unparsable] = loading.judge(run, mesh, sharding.LOGICAL_RULES)
            scores, extras = genrm.score(judges[unparsable], solutions, examples,
                                         jax.random.key(0))  # fmt: skip
            judges[unparsable] = (scores, extras)
    # transformers: the same user message in the judge's chat template, generate greedy one row
    # at a time, decoded without special tokens, parsed by verl's rule.
    refs = []
    for solution, ex in zip(solutions, examples, strict=True):
        message = genrm.DEFAULT_TEMPLATE.format(problem=ex.extra_info["question"],
                                                solution=solution)  # fmt: skip
        ids = tok.apply_chat_template([{"role": "user", "content": message}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              do_sample=False, max_new_tokens=6, eos_token_id=1, pad_token_id=0)
        refs.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))  # fmt: skip
    scores, extras = judges[0.0]
    assert extras[genrm.RESPONSE_KEY] == refs
    parsed = [verl_parse(t) for t in refs]
    np.testing.assert_array_equal(scores, [float(v) for v, _ in parsed])
    assert extras[genrm.UNPARSABLE_KEY] == [not ok for _, ok in parsed]
    assert 0 < sum(ok for _, ok in parsed) < len(parsed)  # both kinds occur: the test has teeth
    scores_m3, _ = judges[-3.0]
    np.testing.assert_array_equal(scores_m3, [float(v) if ok else -3.0 for v, ok in parsed])


@pytest.mark.reference("hf")
def test_judge_errors_name_the_fields(tmp_path):
    hf_dir = tmp_path / "judge"
    save_judge(hf_dir)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    short = _run(hf_dir, rollout=config.RewardModelRollout(prompt_length=8))
    judge = loading.judge(short, mesh, sharding.LOGICAL_RULES)
    with pytest.raises(ValueError, match=r"reward_model\.rollout\.prompt_length=8"):
        genrm.prompt_rows(judge, ["4"], _examples(1))
    # A classifier checkpoint is not a judge (and a judge is not a classifier).
    cls_run = config.RunConfig(reward_model=config.RewardModelConfig(
        enable=True, model=config.RewardModelPath(str(hf_dir))))  # fmt: skip
    with pytest.raises(InputError, match=r"reward_model\.genrm\.enable=True"):
        loading.reward_model(cls_run, demo_task.char_tokenizer(), mesh, sharding.LOGICAL_RULES)


@pytest.mark.reference("hf")
def test_loop_trains_and_validates_with_a_judge(tmp_path, monkeypatch):
    save_judge(tmp_path / "judge")
    tok = demo_task.char_tokenizer()
    calls = []
    real = genrm.score

    def spy(judge, solutions, examples, rng):
        out = real(judge, solutions, examples, rng)
        calls.append((list(solutions), out))
        return out

    monkeypatch.setattr(genrm, "score", spy)
    base = _run(tmp_path / "judge", rollout=config.RewardModelRollout(
        temperature=1.0, response_length=4, prompt_length=1024))  # fmt: skip
    result = test_reward_model.train_tiny(tmp_path, tok, validate=True, reward=base.reward,
                                          reward_model=base.reward_model, reward_fn=_never)
    # validation before training, the step, validation after it: 2, 4 and 2 responses judged
    assert [len(s) for s, _ in calls] == [2, 4, 2]
    dumped = [json.loads(line) for line in open(tmp_path / "rollouts" / "1.jsonl")]
    (_, (scores, extras)) = calls[1]
    assert [r["output"] for r in dumped] == calls[1][0]
    np.testing.assert_allclose([r["score"] for r in dumped], scores, rtol=1e-6)
    metrics = result.history[-1]
    assert metrics["reward/genrm_unparsable"] == sum(extras[genrm.UNPARSABLE_KEY])
    assert metrics["timing_s/reward"] > 0
    val = [json.loads(line) for line in open(tmp_path / "val" / "1.jsonl")]
    (_, (val_scores, _)) = calls[2]
    np.testing.assert_allclose([r["score"] for r in val], val_scores, rtol=1e-6)


def _never(solution_str, ground_truth):
    raise AssertionError("the judge's score replaces the rule reward")
