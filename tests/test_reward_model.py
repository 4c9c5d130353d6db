"""Discriminative reward models: the score head against transformers' *ForSequenceClassification,
sharded against one device, and the loop's reward with reward_model.enable."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import test_model

from grpo_jax import model, sharding
from grpo_jax.models import reward_head

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
