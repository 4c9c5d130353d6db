"""Checkpoint save/restore of state + host metadata, and fallback past an unreadable latest step."""

import json
import os
import sys

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


# ---------------------------------------------------------------------------------------------
# A checkpoint written before the codebase moved into subpackages


def _state_digest(tree) -> tuple[str, dict, dict]:
    """sha256 over every leaf (path, dtype, bytes), and per-leaf sums and |sums| (float64)."""
    import hashlib

    h, sums, abs_sums = hashlib.sha256(), {}, {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        x, name = np.asarray(x), jax.tree_util.keystr(path)
        h.update(name.encode())
        h.update(str(x.dtype).encode())
        h.update(x.tobytes())
        sums[name] = float(np.sum(x, dtype=np.float64))
        abs_sums[name] = float(np.sum(np.abs(x), dtype=np.float64))
    return h.hexdigest(), sums, abs_sums


def test_a_checkpoint_written_before_the_move_resumes_as_it_would_have(tmp_path):
    """tests/fixtures/pre_wings_smoke holds the step-2 checkpoint and metrics of
    `train.py --config=configs/gsm8k.py:smoke` (3 steps, save_freq 1) written by grpo_jax d4b0d38,
    the last commit of the flat layout, and step3.json the state that code saved after step 3.
    Today's code resumes from step 2 and must save the same step-3 state: bit for bit on the CPU
    that wrote the fixture (its ISA is recorded), within float32 rounding elsewhere (step 3 runs
    on this CPU's kernels), and the same step-3 metrics."""
    import shutil
    import subprocess

    import numerics
    import orbax.checkpoint as ocp
    from conftest import machine_line

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "pre_wings_smoke")
    want = json.load(open(os.path.join(fixture, "step3.json")))
    workdir = tmp_path / "run"
    shutil.copytree(fixture, workdir, ignore=shutil.ignore_patterns("step3.json"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # d4b0d38's smoke config: padded micro-batches and no remat (gsm8k.py now packs and
    # checkpoints, as verl's recipe), so the resumed step 3 runs the same computation.
    cmd = want["command"].replace("<dir>", str(workdir)).split() + [
        "--config.actor.use_dynamic_bsz=False",
        "--config.rollout.log_prob_use_dynamic_bsz=False",
        "--config.model.enable_gradient_checkpointing=False",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, *cmd[1:]], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 2" in out.stderr
    state = ocp.StandardCheckpointer().restore(str(workdir / "checkpoints" / "3" / "state"))
    digest, sums, abs_sums = _state_digest(state)
    assert sorted(sums) == sorted(want["leaf_sums"])  # the same tree, path by path
    if machine_line().split(";")[0] == want["machine"]:
        assert digest == want["state_sha256"]
    else:  # another CPU's rounding in step 3 only (tests/numerics.py)
        # The smoke model scores 0 on every sample, so step 3's advantages are all 0 and its
        # gradient is the rounding noise of the on-policy ratio and KL (grad norm ~4e-10): Adam's
        # moments, and the zero-initialised biases that only that noise moves, differ between
        # CPUs by 1-30 % of themselves (an AMX Xeon against the fixture's EPYC). They compare
        # bit for bit on the fixture's CPU above; elsewhere the counters must be equal and every
        # weight of real size (|sum| over 1e-3 of the largest) within rounding of its own scale.
        params = [n for n in sums if n.startswith("['train']['params']")]
        largest = max(want["leaf_abs_sums"][n] for n in params)
        names = sorted(n for n in params if want["leaf_abs_sums"][n] >= 1e-3 * largest)
        assert len(names) >= 8, names  # embedding, norms and every projection's kernel
        numerics.assert_close([sums[n] for n in names], [want["leaf_sums"][n] for n in names],
                              ulps=1024, scale=[want["leaf_abs_sums"][n] for n in names])  # fmt: skip
        for n in ("['train']['step']", "['train']['opt_state'][1]['count']"):
            assert sums[n] == want["leaf_sums"][n], n
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    # step 2 twice: the resumed run validates before training, under the resumed step (verl)
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3]
    assert "val-core/arithmetic/acc/mean@1" in rows[3]
    assert all(k == "step" or k.startswith("val-") for k in rows[3])
    got = {k: v for k, v in rows[4].items()
           if not k.startswith(("timing", "perf/", "actor/perf/"))}  # fmt: skip
    assert got.keys() == want["row"].keys() | _METRICS_SINCE_FIXTURE
    for k, v in want["row"].items():
        if k not in _REDEFINED_SINCE_FIXTURE:
            numerics.assert_close(got[k], v, ulps=1024, scale=max(abs(v), 1.0), err_msg=k)


# verl 0.9.1's compute_data_metrics keys (and grpo_jax's truncated ratios) added after the
# fixture was written, and the clip ratios, which now compare with the batch's longest as
# verl's v1 trainer does (tests/test_train_metrics.py checks both against verl).
_METRICS_SINCE_FIXTURE = {
    *(f"response_length_non_aborted/{k}" for k in ("mean", "max", "min", "clip_ratio")),
    "response/aborted_ratio", "response_length/truncated_ratio", "prompt_length/truncated_ratio",
    *(f"{p}/{k}" for p in ("num_turns", "training/num_turns") for k in ("mean", "max", "min")),
}  # fmt: skip
_REDEFINED_SINCE_FIXTURE = {"response_length/clip_ratio", "prompt_length/clip_ratio"}
