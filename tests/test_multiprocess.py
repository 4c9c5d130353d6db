"""Multi-process runs: two real JAX processes (2 CPU devices each, one 4-device mesh) train
exactly as one process on 4 devices. Each process tokenises its share of the prompts, holds its
block of every batch and scores its own completions (grpo_jax.distributed); the metrics, the
validation and the final params must not depend on how the batch was split.
"""

import json
import os

import jax
import numerics
import numpy as np
import pytest
import workers

from grpo_jax import config, distributed, loading, sharding
from grpo_jax.data import demo_task, prompts
from grpo_jax.trainer import loop


def calls_counting_tokenizer():
    tok = demo_task.char_tokenizer()
    seen = []
    call = type(tok).__call__

    class Counting(type(tok)):
        def __call__(self, texts, **kw):
            seen.extend(texts if isinstance(texts, list) else [texts])
            return call(self, texts, **kw)

    tok.__class__ = Counting
    return tok, seen


def test_encode_in_shares_equals_encode_whole():
    """Each share tokenises only its rows, yet knows every kept prompt's length; reading a
    prompt of another share tokenises it then, with the same truncation."""
    examples = [prompts.Example(prompt="ab" * (3 * k % 40 + 1), line=k + 1) for k in range(23)]
    kw = dict(max_prompt_length=60, filter_overlong_prompts=False, truncation="left")
    whole = prompts.encode(demo_task.char_tokenizer(), examples, **kw)

    def local_lengths(p):
        ids = prompts._tokenize(demo_task.char_tokenizer(), examples[p::2])
        out = np.full(12, -1, np.int64)
        out[: len(ids)] = [len(i) for i in ids]
        return out

    for p in range(2):
        tok, seen = calls_counting_tokenizer()
        share = prompts.Share(p, 2, lambda local: np.concatenate([local_lengths(0),
                                                               local_lengths(1)]))
        part = prompts.encode(tok, examples, **kw, share=share)
        assert len(seen) == len(examples[p::2])  # only its share
        assert part.lengths == whole.lengths and part.examples == whole.examples
        assert [part.prompt_ids[i] for i in range(len(part))] == list(whole.prompt_ids)
        assert max(whole.lengths) == 60  # some prompts were truncated
        batch = prompts.make_batch(part, [3, 4, 5, 6], pad_token_id=0, rows=(2, 4))
        full = prompts.make_batch(whole, [3, 4, 5, 6], pad_token_id=0)
        np.testing.assert_array_equal(batch.prompt_ids_PT, full.prompt_ids_PT[2:4])
        assert batch.examples == full.examples and batch.rows == (2, 4)


def test_gather_helpers_are_identity_in_one_process():
    assert distributed.share() is None
    assert distributed.process_rows(8) == (0, 8)
    assert distributed.gather_objects(["a", 1.5]) == ["a", 1.5]
    np.testing.assert_array_equal(distributed.gather_rows(np.arange(3)), np.arange(3))


def digit_share_reward(solution_str, ground_truth):
    """Varies between the random model's samples (which never stop before the token limit)."""
    del ground_truth
    return sum(ch.isdigit() for ch in solution_str) / max(1, len(solution_str))


def _run_config(workdir: str) -> config.RunConfig:
    return config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                                 optim=config.OptimConfig(lr=1e-3)),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=8),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=2, save_freq=1, test_freq=2,
                                     val_before_train=True, progress_bar=False,
                                     tensorboard=False, default_local_dir=workdir),
        checkpoint=config.CheckpointConfig(export_hf=False),
    )


def train_and_summarise(workdir: str, devices) -> dict:
    """Trains the tiny random model 2 steps on a 4-device data-parallel mesh (validating before
    and after) and returns its metrics rows and a fingerprint of the final params."""
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((-1, 1, 1), devices=devices)
    run = _run_config(workdir)
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)
        train_rows, val_rows = demo_task.arithmetic_rows(32, 8, max_operand=20, seed=0)
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=train_rows, val_data=val_rows,
                            reward_fn=digit_share_reward, mesh=mesh)
        leaves = [distributed.to_host(x) for x in jax.tree.leaves(result.state.params)]
    return {
        "history": result.history,
        "param_sums": [float(np.sum(x, dtype=np.float64)) for x in leaves],
        "param_abs": [float(np.sum(np.abs(x), dtype=np.float64)) for x in leaves],
    }


_WORKER = """
import sys
pid, port, workdir = int(sys.argv[2]), sys.argv[3], sys.argv[4]
from grpo_jax import distributed
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
import jax
import test_multiprocess as t
import workers
workers.answer(t.train_and_summarise(workdir, jax.devices()))
"""


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
def test_two_processes_train_as_one(tmp_path):
    two = workers.run(_WORKER, tmp_path / "workers", args=(tmp_path / "two",), timeout=600)
    one = train_and_summarise(str(tmp_path / "one"), jax.devices()[:4])

    def measured(summary):
        return {k: v for k, v in summary.items() if k != "history"} | {"history": [
            {k: v for k, v in row.items()
             if not k.startswith(("timing", "perf/", "actor/perf/"))}
            for row in summary["history"]]}

    assert measured(two[0]) == measured(two[1])  # both processes end with the same state
    got, want = two[0], one
    # Each leaf's sum after 3 steps whose gradients were reduced over 2 processes instead of 1
    # (tests/numerics.py): rounding at the scale of the sum of the leaf's |values| (measured up
    # to 26 ulps under scripts/test_cpu_variants.sh; a doubled row share: 1.7e6).
    numerics.assert_close(got["param_sums"], want["param_sums"], ulps=256,
                          scale=want["param_abs"], err_msg="param sums")  # fmt: skip
    numerics.assert_close(got["param_abs"], want["param_abs"], ulps=64, err_msg="param |sums|")
    assert [r["step"] for r in got["history"]] == [0, 1, 2]
    for g, w in zip(got["history"], want["history"], strict=True):
        keys = [k for k in w if not k.startswith(("timing", "perf/", "actor/perf/"))
                and isinstance(w[k], (int, float))]
        assert set(keys) <= set(g)
        for k in keys:  # sums of O(1) terms: rounding at the scale max(|value|, 1)
            numerics.assert_close(g[k], w[k], ulps=64, scale=max(abs(w[k]), 1.0), err_msg=k)
    assert "val-core/arithmetic/acc/mean@1" in got["history"][-1]
    assert got["history"][1]["critic/score/max"] > got["history"][1]["critic/score/min"]
    # Only process 0 wrote metrics; the checkpoints are one multi-process orbax save per step.
    rows = [json.loads(ln) for ln in open(os.path.join(tmp_path / "two", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]
