"""Discriminative reward models: the score head against transformers' *ForSequenceClassification,
sharded against one device, and the loop's reward with reward_model.enable."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import test_model

from grpo_jax import config, loading, model, sharding
from grpo_jax.data import demo_task
from grpo_jax.errors import InputError
from grpo_jax.models import reward_head
from grpo_jax.rewards import reward_model as reward_model_lib
from grpo_jax.trainer import loop

_COMMON = test_model._HF_COMMON | {"pad_token_id": 0}
PAD = 0
# (config class, model class, overrides)
CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 1}),
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 3}),
}


def save_hf_classifier(case: str, path, seed: int = 0, **overrides):
    """A random tiny transformers classifier with O(1) weights, saved to `path`; returns it."""
    torch, transformers = reference.hf()
    cfg_name, cls_name, case_overrides = CASES[case]
    hf_config = getattr(transformers, cfg_name)(**(_COMMON | case_overrides | overrides))
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(hf_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise / p.shape[-1] ** 0.25)
    hf.eval().save_pretrained(path)
    return hf


def _right_padded(seed=3, lengths=(9, 6, 3, 1)):
    """Right-padded rows of varied lengths (pads hold PAD, real ids never do)."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids_BT = np.full((len(lengths), T), PAD, np.int64)
    mask_BT = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        ids_BT[b, :n] = rng.integers(1, _COMMON["vocab_size"], n)
        mask_BT[b, :n] = 1
    return ids_BT, mask_BT


@pytest.mark.reference("hf")
@pytest.mark.parametrize("case", sorted(CASES))
def test_scores_equal_transformers(case, tmp_path):
    torch, _ = reference.hf()
    hf = save_hf_classifier(case, tmp_path / "rm")
    config, params, score_DL = model.load_hf_sequence_classifier(tmp_path / "rm")
    assert score_DL.shape == (config.hidden_size, hf.config.num_labels)
    ids_BT, mask_BT = _right_padded()
    with torch.no_grad():
        ref_BL = hf(
            input_ids=torch.from_numpy(ids_BT), attention_mask=torch.from_numpy(mask_BT)
        ).logits.numpy()
    index_B = reward_head.last_token_hf(jnp.asarray(ids_BT), config.pad_token_id)
    np.testing.assert_array_equal(np.asarray(index_B), mask_BT.sum(1) - 1)
    ours_BL = np.asarray(
        reward_head.scores(config, params, score_DL, jnp.asarray(ids_BT), jnp.asarray(mask_BT),
                           index_B)
    )  # fmt: skip
    assert np.abs(ref_BL).max() > 0.5  # far from flat: the comparison has teeth
    np.testing.assert_allclose(ours_BL, ref_BL, atol=1e-4, rtol=1e-4)
    # The mask's last token is HF's pooled token when pads never occur inside a row.
    np.testing.assert_array_equal(
        np.asarray(reward_head.last_token_masked(jnp.asarray(mask_BT))), np.asarray(index_B)
    )


@pytest.mark.reference("hf")
def test_hf_pooling_rule_edge_cases(tmp_path):
    torch, _ = reference.hf()
    # A pad id inside a row, left padding, and a row of pads only: HF's rightmost non-pad rule.
    ids = jnp.array([[5, PAD, 7, PAD], [PAD, PAD, 3, 4], [PAD, PAD, PAD, PAD]])
    np.testing.assert_array_equal(np.asarray(reward_head.last_token_hf(ids, PAD)), [2, 3, 0])
    with pytest.raises(ValueError, match="no padding token"):
        reward_head.last_token_hf(ids, None)
    np.testing.assert_array_equal(np.asarray(reward_head.last_token_hf(ids[:1], None)), [3])
    # pad_token_id None: HF scores the last position of a single row.
    hf = save_hf_classifier("qwen2", tmp_path / "rm", pad_token_id=None)
    config, params, score_DL = model.load_hf_sequence_classifier(tmp_path / "rm")
    assert config.pad_token_id is None
    ids_1T = np.array([[4, 9, 17, 3, 22]])
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids_1T)).logits.numpy()
    ours = reward_head.scores(
        config, params, score_DL, jnp.asarray(ids_1T), jnp.ones((1, 5), jnp.int32),
        reward_head.last_token_hf(jnp.asarray(ids_1T), None),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.reference("hf")
def test_sharded_scores_equal_one_device(tmp_path):
    save_hf_classifier("qwen2", tmp_path / "rm")
    config, params, score_DL = model.load_hf_sequence_classifier(tmp_path / "rm")
    ids_BT, mask_BT = _right_padded(lengths=(9, 6, 3, 1, 2, 8, 5, 4))
    index_B = reward_head.last_token_masked(jnp.asarray(mask_BT))
    one = np.asarray(reward_head.scores(config, params, score_DL, jnp.asarray(ids_BT),
                                        jnp.asarray(mask_BT), index_B))  # fmt: skip
    mesh = sharding.make_mesh((1, 8, 1))
    _, sharded_params, sharded_head = model.load_hf_sequence_classifier(
        tmp_path / "rm", shardings=sharding.shard_fn(mesh)
    )
    leaves = jax.tree.leaves(sharded_params)
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in leaves)  # fmt: skip
    rows = sharding.batch_sharding(mesh, 2)
    with sharding.use_mesh(mesh):
        many = reward_head.scores(
            config, sharded_params, sharded_head, jax.device_put(ids_BT, rows),
            jax.device_put(mask_BT, rows),
            jax.device_put(np.asarray(index_B), sharding.batch_sharding(mesh, 1)),
        )  # fmt: skip
    np.testing.assert_allclose(np.asarray(many), one, atol=1e-5, rtol=1e-5)


def test_bad_checkpoint_kind_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="not one of"):
        model.load_hf_sequence_classifier(tmp_path)


def _rule(solution_str, ground_truth):
    return float(len(solution_str) % 3)


@pytest.mark.reference("hf")
def test_loop_adds_weighted_model_score_to_rule_reward(tmp_path, monkeypatch):
    torch, _ = reference.hf()
    tok = demo_task.char_tokenizer()
    hf = save_hf_classifier("qwen2", tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    calls = []
    real = reward_model_lib.score_rows

    def spy(rm, rows):
        out = real(rm, rows)
        calls.append((rows, out))
        return out

    monkeypatch.setattr(reward_model_lib, "score_rows", spy)
    result = train_tiny(
        tmp_path, tok,
        reward=config.RewardConfig(num_workers=0, fn="reward_model,test_reward_model:_rule",
                                   weights="0.5,1.0"),
        reward_model=config.RewardModelConfig(
            enable=True, model=config.RewardModelPath(str(tmp_path / "rm")),
            micro_batch_size_per_gpu=2),
        reward_fn=_rule,
    )  # fmt: skip
    (rows, rm_scores), = calls
    assert len(rows) == 4
    # The model's scores, recomputed by transformers on the same ids one row at a time.
    with torch.no_grad():
        ref = [hf(input_ids=torch.tensor([r])).logits[0, -1].item() for r in rows]
    np.testing.assert_allclose(rm_scores, ref, atol=1e-4, rtol=1e-4)
    dumped = [json.loads(line) for line in open(tmp_path / "rollouts" / "1.jsonl")]
    for row, ids, rm in zip(dumped, rows, rm_scores, strict=True):
        assert tok.decode(ids, skip_special_tokens=True).endswith(row["output"])
        np.testing.assert_allclose(row["score"], 0.5 * rm + _rule(row["output"], None), rtol=1e-5)
    metrics = result.history[-1]
    assert metrics["timing_s/reward"] > 0
    np.testing.assert_allclose(metrics["reward/reward_model/mean"], np.mean(rm_scores), rtol=1e-5)


# The reward model's own chat template: a role tag per turn, the turn's text, a bar.
RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"


def char_level_tokenizer(specials, chars, chat_template):
    """A fast tokenizer of one token per character (specials[0] pad, [1] EOS, [2] unknown)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(list(specials) + list(chars))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[2]))
    tok.add_special_tokens(list(specials))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], eos_token=specials[1],
        unk_token=specials[2], chat_template=chat_template,
    )  # fmt: skip


def rm_char_tokenizer():
    """A character tokenizer unlike the policy's (demo_task.char_tokenizer): other specials,
    the characters in reverse order, and RM_TEMPLATE."""
    import string

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"), reverse=True)
    return char_level_tokenizer(["<pad>", "</s>", "<unk>"], chars, RM_TEMPLATE)


@pytest.mark.reference("hf")
def test_model_with_its_own_tokenizer_scores_its_template_in_training_and_validation(
    tmp_path, monkeypatch
):
    torch, transformers = reference.hf()
    tok = demo_task.char_tokenizer()
    hf = save_hf_classifier("qwen2", tmp_path / "rm")
    rm_char_tokenizer().save_pretrained(tmp_path / "rm")
    rm_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")  # as loading reads it
    assert rm_tok.get_vocab() != tok.get_vocab()  # the re-template path (same_ids False)
    calls = []
    real = reward_model_lib.score_rows

    def spy(rm, rows):
        assert not rm.same_ids
        out = real(rm, rows)
        calls.append((rows, out))
        return out

    monkeypatch.setattr(reward_model_lib, "score_rows", spy)
    result = train_tiny(
        tmp_path, tok, validate=True,
        reward=config.RewardConfig(num_workers=0, fn="reward_model"),
        reward_model=config.RewardModelConfig(
            enable=True, model=config.RewardModelPath(str(tmp_path / "rm"))),
        reward_fn=_no_rule,
    )  # fmt: skip
    # validation before the step (2 prompts), the step (2 x 2), validation after it
    assert [len(rows) for rows, _ in calls] == [2, 4, 2]
    _, val_rows = demo_task.arithmetic_rows(4, 2, max_operand=9, seed=0)
    questions = {r["prompt"][0]["content"] for r in val_rows}
    for (rows, scores), dump in zip(calls[1:], ["rollouts/1.jsonl", "val/1.jsonl"], strict=True):
        dumped = [json.loads(line) for line in open(tmp_path / dump)]
        for row, ids, score in zip(dumped, rows, scores, strict=True):
            # The reward model's template of (prompt, response), written out by hand. The
            # response is the policy's decoded text without its EOS (verl keeps its other
            # special tokens, which the dump's output skips).
            text = rm_tok.decode(ids)
            head = f"[user]{row['input']}|[assistant]"
            assert text.startswith(head) and text.endswith("|"), text
            response = text[len(head) : -1]
            assert "<eos>" not in response
            for special in (demo_task.USER, demo_task.ASSISTANT, demo_task.PAD):  # dump skips them
                response = response.replace(special, "")
            # (the RM's tokenizer, loaded as transformers does for a qwen2 config.json, drops
            # whitespace: the output as it reads it)
            assert response == rm_tok.decode(rm_tok(row["output"])["input_ids"])
            assert ids == rm_tok(text)["input_ids"]
            with torch.no_grad():
                ref = hf(input_ids=torch.tensor([ids])).logits[0, -1].item()
            np.testing.assert_allclose(score, ref, atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(row["score"], score, rtol=1e-6)  # it is the reward
        inputs = {row["input"] for row in dumped}
        assert (inputs <= questions) == dump.startswith("val")  # validation rows are the val set
    val = [m for m in result.history if any(k.startswith("val-") for k in m)][-1]
    core = {k: v for k, v in val.items() if k.startswith("val-core/") and k.endswith("/mean@1")}
    assert core, sorted(val)
    for value in core.values():
        np.testing.assert_allclose(value, np.mean(calls[2][1]), rtol=1e-5)


def _no_rule(solution_str, ground_truth):
    raise AssertionError("the reward model's score replaces the rule reward")


def train_tiny(tmp_path, tok, *, reward, reward_model, reward_fn, validate=False):
    """loop.train for one step of 2 prompts x 2 on one device (a random char-level policy),
    dumping rollouts to tmp_path/rollouts and, with `validate`, validating 2 prompts after the
    step into tmp_path/val; returns the loop's result."""
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=96, max_response_length=4,
                               val_batch_size=2),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=4),
        reward=reward,
        reward_model=reward_model,
        trainer=config.TrainerConfig(
            total_training_steps=1, progress_bar=False, tensorboard=False,
            default_local_dir=str(tmp_path / "run"), rollout_data_dir=str(tmp_path / "rollouts"),
            validation_data_dir=str(tmp_path / "val") if validate else None,
            val_before_train=validate, test_freq=1 if validate else -1),
        checkpoint=config.CheckpointConfig(save_last=False),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    train_rows, val_rows = demo_task.arithmetic_rows(4, 2, max_operand=9, seed=0)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=128)  # fmt: skip
        return loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                          train_data=train_rows, val_data=val_rows if validate else (),
                          mesh=mesh, reward_fn=reward_fn)  # fmt: skip


def test_bad_reward_model_path_names_the_field(tmp_path):
    run = config.RunConfig(reward_model=config.RewardModelConfig(
        enable=True, model=config.RewardModelPath(str(tmp_path / "missing"))))  # fmt: skip
    with pytest.raises(InputError, match=r"reward_model\.model\.path="):
        loading.reward_model(run, demo_task.char_tokenizer(), None, None)
    with pytest.raises(config.ConfigError, match=r"reward_model\.model\.path"):
        config.RunConfig(reward_model=config.RewardModelConfig(enable=True))
    with pytest.raises(config.ConfigError, match="needs reward_model.enable"):
        config.RunConfig(reward=config.RewardConfig(fn="reward_model"))
