"""Multi-process runs: two real JAX processes (2 CPU devices each, one 4-device mesh) train
exactly as one process on 4 devices. Each process tokenises its share of the prompts, holds its
block of every batch and scores its own completions (grpo_jax.distributed); the metrics, the
validation and the final params must not depend on how the batch was split. The paged engine
(continuous batching, `rollout.paged`) schedules every data shard in every process from the
gathered slot states, so its rollout and schedule are the one-process engine's.
"""

import json
import os
from unittest import mock

import jax
import numerics
import numpy as np
import pytest
import workers

from grpo_jax import config, distributed, loading, model, sampler, sharding
from grpo_jax.data import demo_task, prompts
from grpo_jax.rollout import paged
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


def _run_config(workdir: str, max_num_seqs: int) -> config.RunConfig:
    return config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=32, max_response_length=8,
                               val_batch_size=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                                 optim=config.OptimConfig(lr=1e-3)),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=8,
                                     max_num_seqs=max_num_seqs),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=2, save_freq=1, test_freq=2,
                                     val_before_train=True, progress_bar=False,
                                     tensorboard=False, default_local_dir=workdir),
        checkpoint=config.CheckpointConfig(export_hf=False),
    )


def train_and_summarise(workdir: str, devices, max_num_seqs: int = paged.MAX_NUM_SEQS) -> dict:
    """Trains the tiny random model 2 steps on a 4-device data-parallel mesh (validating before
    and after) and returns its metrics rows, a fingerprint of the final params and the calls
    of the paged engine (a step's 8 rows are 2 a data shard: paged below 2 max_num_seqs)."""
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((-1, 1, 1), devices=devices)
    run = _run_config(workdir, max_num_seqs)
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=64)
        train_rows, val_rows = demo_task.arithmetic_rows(32, 8, max_operand=20, seed=0)
        with mock.patch.object(paged, "sample_paged", wraps=paged.sample_paged) as spy:
            result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                                train_data=train_rows, val_data=val_rows,
                                reward_fn=digit_share_reward, mesh=mesh)
        leaves = [distributed.to_host(x) for x in jax.tree.leaves(result.state.params)]
    return {
        "history": result.history,
        "param_sums": [float(np.sum(x, dtype=np.float64)) for x in leaves],
        "param_abs": [float(np.sum(np.abs(x), dtype=np.float64)) for x in leaves],
        "paged_calls": spy.call_count,
    }


_WORKER = """
import sys
pid, port, workdir, max_num_seqs = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
from grpo_jax import distributed
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
import jax
import test_multiprocess as t
import workers
workers.answer(t.train_and_summarise(workdir, jax.devices(), max_num_seqs))
"""


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
@pytest.mark.parametrize("max_num_seqs", [paged.MAX_NUM_SEQS, 1], ids=["grouped", "paged"])
def test_two_processes_train_as_one(tmp_path, max_num_seqs):
    # max_num_seqs=1: each step's rollout is the paged engine's (2 rows a shard, 1 slot: a
    # shard's second row waits for the first's slot), scheduled alike in both processes.
    two = workers.run(_WORKER, tmp_path / "workers", args=(tmp_path / "two", max_num_seqs),
                      timeout=600)  # fmt: skip
    one = train_and_summarise(str(tmp_path / "one"), jax.devices()[:4], max_num_seqs)
    assert one["paged_calls"] == (2 if max_num_seqs == 1 else 0)  # the training steps'

    def measured(summary):
        return {k: v for k, v in summary.items() if k != "history"} | {"history": [
            {k: v for k, v in row.items()
             if not k.startswith(("timing", "perf/", "actor/perf/"))}
            for row in summary["history"]]}

    assert measured(two[0]) == measured(two[1])  # both processes end with the same state
    got, want = two[0], one
    assert got["paged_calls"] == want["paged_calls"]
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


def _paged_case():
    """8 prompts of 1 to 13 tokens (ids in [4, V)), n = 3: 24 rows, 6 a data shard of 4."""
    import test_paged

    return test_paged._prompts([5, 9, 1, 13, 3, 7, 2, 11], model.ModelConfig.tiny().vocab_size,
                               seed=4)  # fmt: skip


_PAGED = dict(n=3, max_new_tokens=12, max_num_seqs=2, page_size=4, max_num_batched_tokens=8,
              segment_steps=3)  # fmt: skip


def paged_rollouts(devices, eos: dict) -> dict:
    """`paged.sample_paged` of the tiny random model on a 4-device data mesh (4 shards of 6
    rows, 2 slots each: rows wait and take the slots that finished rows free), greedy and
    sampled, with each its EOS (`eos[temperature]`): the rollouts on the host and the
    schedules."""
    config = model.ModelConfig.tiny()
    mesh = sharding.make_mesh((-1, 1, 1), devices=devices)
    ids, mask = _paged_case()
    out = {}
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        params = sharding.init_sharded_params(config, mesh, jax.random.key(0))
        sids, smask = (distributed.to_device(x, mesh) for x in (ids, mask))
        for temperature, eos_id in eos.items():
            stats = {}
            rollout = paged.sample_paged(
                config, params, sids, smask, jax.random.key(2), temperature=float(temperature),
                eos_token_ids=(eos_id,), stats=stats, **_PAGED,
            )  # fmt: skip
            host = {k: distributed.to_host(getattr(rollout, k)).tolist()
                    for k in ("prompt_ids", "group_ids", "response_ids", "response_mask",
                              "log_probs")}  # fmt: skip
            host["sharding"] = rollout.response_ids.sharding.is_equivalent_to(sids.sharding, 2)
            # JSON's view of the schedule: tuples as lists
            host["stats"] = json.loads(json.dumps(stats))
            out[str(temperature)] = host
    return out


_PAGED_WORKER = """
import json, sys
pid, port, eos = int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
from grpo_jax import distributed
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
import jax
jax.config.update("jax_default_matmul_precision", "float32")  # as tests/conftest.py
import test_multiprocess as t
import workers
from grpo_jax.rollout import paged
try:  # multi-turn rows: refused before any program runs
    paged.sample_paged(None, None, None, None, None, n=1, max_new_tokens=1, turns=object())
except ValueError as e:
    refusal = str(e)
workers.answer({"rollouts": t.paged_rollouts(jax.devices(), eos), "turns": refusal})
"""


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
def test_two_processes_page_the_rollout_as_one_process(tmp_path):
    import test_paged

    config = model.ModelConfig.tiny()
    params = model.init_params(config, jax.random.key(0))
    ids, mask = _paged_case()
    kw = dict(n=_PAGED["n"], max_new_tokens=_PAGED["max_new_tokens"], pad_token_id=0)
    # An EOS the rollout draws part-way (a token of row 0's), so that rows end at different
    # times and waiting rows take their slots.
    eos = {}
    for temperature, t in ((0.0, 3), (1.0, 4)):
        drawn = sampler.sample(config, params, ids, mask, jax.random.key(2),
                               temperature=temperature, **kw).response_ids  # fmt: skip
        eos[str(temperature)] = int(drawn[0, t])
    two = workers.run(_PAGED_WORKER, tmp_path, args=(json.dumps(eos),), timeout=300)
    one = paged_rollouts(jax.devices()[:4], eos)
    assert two[0] == two[1]  # every process holds the whole rollout, and the same schedule
    assert "lockstep rounds" in two[0]["turns"]
    for temperature, got in two[0]["rollouts"].items():
        want = one[temperature]
        # The same schedule as one process's (every program call, in order), in which rows
        # waited for slots and ended at different times.
        assert got["stats"] == want["stats"]
        assert got["stats"]["shards"] == 4 and got["stats"]["max_num_seqs"] == 2
        admits = [rows for kind, rows in got["stats"]["trace"] if kind == "admit"]
        assert len(admits) > 2 and sorted(sum(admits, [])) == list(range(24))
        lengths = np.sum(got["response_mask"], axis=1)
        assert lengths.min() < 12 and lengths.max() == 12
        for k in ("prompt_ids", "group_ids", "response_ids", "response_mask"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        np.testing.assert_allclose(got["log_probs"], want["log_probs"], rtol=0, atol=1e-5)
        assert got["sharding"]
        # and the grouped sampler's rollout (tests/test_paged.py's tolerances)
        ref = sampler.sample(config, params, ids, mask, jax.random.key(2),
                             temperature=float(temperature), eos_token_ids=(eos[temperature],),
                             **kw)  # fmt: skip
        out = sampler.Rollout(**{k: np.asarray(got[k]) for k in (
            "prompt_ids", "group_ids", "response_ids", "response_mask", "log_probs")},
            prompt_mask=np.repeat(mask, _PAGED["n"], axis=0), weights_version=-1)  # fmt: skip
        test_paged._assert_same_rollout(config, params, ids, mask, jax.random.key(2), ref, out,
                                        temperature=float(temperature), top_k=-1, top_p=1.0)
