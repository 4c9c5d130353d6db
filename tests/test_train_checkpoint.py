"""Checkpoint save/restore of state + host metadata, and fallback past an unreadable latest step."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.trainer import checkpoint


def _tree(v):
    return {
        "train": {"w": jnp.full((3,), v, jnp.float32), "step": jnp.int32(v)},
        "rng": jax.random.key_data(jax.random.key(7)),
    }


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_roundtrip_keep_and_fallback(tmp_path):
    mngr = checkpoint.manager(str(tmp_path), max_to_keep=2)
    assert checkpoint.restore_latest(mngr, _abstract(_tree(0))) is None
    for step in (1, 2, 3):
        checkpoint.save(
            mngr, step, _tree(step), {"step": step, "data_epoch": 0, "data_index": 4 * step}
        )
    assert sorted(mngr.all_steps()) == [2, 3]  # max_to_keep=2 deleted step 1
    step, tree, meta = checkpoint.restore_latest(mngr, _abstract(_tree(0)))
    assert (step, meta["data_index"]) == (3, 12)
    np.testing.assert_array_equal(tree["train"]["w"], [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(tree["rng"], jax.random.key_data(jax.random.key(7)))
    # Corrupt the newest step's array data: restore falls back to step 2.
    for root, _, files in os.walk(tmp_path / "3" / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    mngr = checkpoint.manager(str(tmp_path), max_to_keep=2)
    step, tree, meta = checkpoint.restore_latest(mngr, _abstract(_tree(0)))
    assert (step, meta["data_index"]) == (2, 8)
    np.testing.assert_array_equal(tree["train"]["w"], [2.0, 2.0, 2.0])


def test_max_to_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.max_to_keep must be >= 1, got 0"):
        checkpoint.manager(str(tmp_path), max_to_keep=0)
