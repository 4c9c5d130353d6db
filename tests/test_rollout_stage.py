"""The rollout stage's streamed rewards (reward.overlap_with_rollout): on the tiny model with the
paged engine, each row is scored as soon as it finishes, and the step's texts and rewards are
those of scoring the batch after generation."""

import dataclasses
import os
import time
import types

import jax
import numpy as np
import pytest

from grpo_jax import config, model, sharding
from grpo_jax.data import demo_task
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.rewards import pool as reward_pool
from grpo_jax.rollout import engines
from grpo_jax.trainer import rollout_stage


def _reward_fn(started):
    """A verl-style function that marks its start in the directory `started`; dict results,
    and on_error="zero" errors on a quarter of the completions."""

    def counted(data_source, solution_str, ground_truth, extra_info=None):
        import os
        import uuid

        open(os.path.join(started, uuid.uuid4().hex), "w").close()
        if len(solution_str) % 4 == 0:
            raise ValueError("a length divisible by 4")
        return {"score": len(solution_str) % 3 / 2, "chars": len(solution_str)}

    return reward_fns.RewardFn(("counted",), (counted,), (1.0,), on_error="zero")


@pytest.fixture(scope="module")
def tiny():
    tok = demo_task.char_tokenizer()
    cfg = model.ModelConfig.tiny(vocab_size=len(tok))
    return tok, cfg, model.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "pool"])
def test_streamed_rewards_equal_the_batch_ones_and_start_during_generation(
    tiny, tmp_path, monkeypatch, workers
):
    tok, cfg, params = tiny
    started = tmp_path / "started"
    started.mkdir()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    # 4 prompts x 2 rows through 2 slots: the paged engine, rows finishing segment by segment
    engine = engines.NativeEngine(cfg, mesh, eos_ids=(tok.eos_token_id,),
                                  pad_id=tok.pad_token_id, max_num_seqs=2)  # fmt: skip
    questions = ["1+2", "30+4", "5+67", "8+9"]
    ids, mask = _encode(tok, questions)
    prompts = prompts_lib.PromptBatch(
        ids, mask, tuple(prompts_lib.Example(q, str(eval(q))) for q in questions), (0, 1, 2, 3)
    )
    heard_before_return = []
    real_sample = engines.NativeEngine.sample

    def sample(self, *args, **kwargs):
        out = jax.block_until_ready(real_sample(self, *args, **kwargs))
        scorer = kwargs.get("finished")
        if scorer is not None:
            heard_before_return.append(len(scorer.scoring.added))
            # The rollout is not handed back before a reward call has started: scoring that
            # waited for the engine to return would never start (and this test would fail).
            deadline = time.monotonic() + 120
            while not os.listdir(started) and time.monotonic() < deadline:
                time.sleep(0.01)
            heard_before_return.append(len(os.listdir(started)))
        return out

    monkeypatch.setattr(engines.NativeEngine, "sample", sample)
    pool = reward_pool.Pool(workers, timeout_s=60.0) if workers else None
    batches, timings = {}, {}
    try:
        for overlap in (True, False):
            run = config.RunConfig(
                data=config.DataConfig(train_batch_size=4, max_response_length=12),
                actor=config.ActorConfig(ppo_mini_batch_size=4),
                rollout=config.RolloutConfig(n=2, max_num_seqs=2),
                reward=config.RewardConfig(num_workers=workers, on_error="zero",
                                           overlap_with_rollout=overlap),  # fmt: skip
            )
            ctx = types.SimpleNamespace(
                run=run, engine=engine, tokenizer=tok, mesh=mesh, pool=pool, agent=None,
                reward_model=None, reward_fn=_reward_fn(str(started)),
            )  # fmt: skip
            timings[overlap] = {}
            batches[overlap] = rollout_stage.sample_and_score(
                ctx, params, prompts, jax.random.key(3), timings[overlap]
            )
    finally:
        if pool is not None:
            pool.close()
    on, off = batches[True], batches[False]
    np.testing.assert_array_equal(on.host.response_ids_BT, off.host.response_ids_BT)
    assert on.texts == off.texts and on.result == off.result
    assert on.result.num_errors > 0 and len(set(on.result.scores_B)) > 1  # a varied batch
    # every row was heard from the engine before it returned, and a call had started then
    assert heard_before_return[0] == 8 and heard_before_return[1] >= 1
    assert timings[True]["timing_s/reward_overlapped"] > 0
    assert "timing_s/reward_overlapped" not in timings[False]
    assert {"timing_s/gen", "timing_s/reward"} <= set(timings[True]) & set(timings[False])


def _encode(tok, texts):
    """Left-padded prompt ids and mask."""
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), tok.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def test_only_function_rewards_of_single_turn_native_rollouts_stream():
    engine = engines.NativeEngine.__new__(engines.NativeEngine)
    ctx = types.SimpleNamespace(run=config.RunConfig(), engine=engine, agent=None,
                                reward_model=None)  # fmt: skip
    prompts = prompts_lib.PromptBatch(np.ones((1, 1)), np.ones((1, 1)), (), (0,))
    assert rollout_stage.streams_rewards(ctx, prompts)
    for change in ({"agent": object()}, {"reward_model": object()}, {"engine": object()},
                   {"run": config.RunConfig(reward=config.RewardConfig(
                       overlap_with_rollout=False))}):  # fmt: skip
        assert not rollout_stage.streams_rewards(types.SimpleNamespace(**{**vars(ctx), **change}),
                                                 prompts)  # fmt: skip
    several = dataclasses.replace(prompts, rows=(0, 1))
    assert not rollout_stage.streams_rewards(ctx, several)
