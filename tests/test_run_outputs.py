"""What a run reads and writes besides its metrics, with verl 0.9.1's fields: the sample caps
(data.train_max_samples / val_max_samples), the chat-template arguments
(data.apply_chat_template_kwargs), the generation dumps (trainer.rollout_data_dir /
validation_data_dir) and trainer.val_only; through `train.py --config=configs/gsm8k.py:smoke`
and, for a tokenizer whose template reads enable_thinking, through `loop.train`; and that
`loop.train(donate_params=True)` (train.py) changes nothing but the copy of the weights.
"""

import json
import os
import subprocess
import sys

import jax
import pytest
from test_data import qwen3_like_tokenizer

from grpo_jax import config, loading, sharding
from grpo_jax.data import demo_task, prompts
from grpo_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUT_KEYS = ["input", "output", "gts", "score", "step", "uid"]  # verl v1 _log_rollout_data


def _smoke(workdir, *overrides):
    cmd = [sys.executable, "train.py", "--config=configs/gsm8k.py:smoke",
           f"--config.trainer.default_local_dir={workdir}", "--config.trainer.progress_bar=False",
           "--config.trainer.tensorboard=False", *overrides]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one device
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _questions(rows, keep):
    return [rows[i]["prompt"][0]["content"] for i in keep]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """Two smoke steps with both dumps and 8 train / 4 val prompts kept."""
    tmp = tmp_path_factory.mktemp("smoke")
    records = _smoke(
        tmp / "run",
        f"--config.trainer.rollout_data_dir={tmp / 'rollouts'}",
        f"--config.trainer.validation_data_dir={tmp / 'val'}",
        "--config.data.train_max_samples=8",
        "--config.data.val_max_samples=4",
    )
    return tmp, records


def test_dumps_are_verls_files_and_keys(smoke_run):
    tmp, records = smoke_run
    assert sorted(os.listdir(tmp / "rollouts")) == ["1.jsonl", "2.jsonl"]
    assert os.listdir(tmp / "val") == ["0.jsonl"]  # val_before_train; smoke's test_freq is -1
    n = 5  # the smoke's rollout.n, 4 prompts a step
    for step in (1, 2):
        rows = _jsonl(tmp / "rollouts" / f"{step}.jsonl")
        assert len(rows) == 4 * n and all(list(r) == ROLLOUT_KEYS for r in rows)
        assert {r["step"] for r in rows} == {step}
        assert [r["uid"] for r in rows] == [f"{g}_{j}_0" for g in range(4) for j in range(n)]
        for g in range(4):  # a prompt's samples are adjacent
            assert len({(r["input"], r["gts"]) for r in rows[g * n : g * n + n]}) == 1
        # the dumped scores are the step's rewards
        mean = sum(r["score"] for r in rows) / len(rows)
        assert abs(mean - records[step]["critic/score/mean"]) < 1e-6
    val = _jsonl(tmp / "val" / "0.jsonl")
    assert [list(r)[:5] for r in val] == [ROLLOUT_KEYS[:5]] * 4
    assert all(r["reward"] == r["score"] and r["step"] == 0 for r in val)
    mean = sum(r["score"] for r in val) / len(val)
    assert abs(mean - records[0]["val-aux/arithmetic/reward/mean@1"]) < 1e-6


def test_sample_caps_keep_verls_rows(smoke_run):
    # verl's RLHFDataset with data.shuffle: default_rng(data.seed).choice of the rows, here of
    # the smoke's 64 train / 8 val arithmetic questions (its data.seed 1).
    tmp, _ = smoke_run
    train_rows, val_rows = demo_task.arithmetic_rows(64, 8, max_operand=99, seed=0)
    kept = _questions(train_rows, prompts.select_samples(64, 8, shuffle=True, seed=1))
    dumped = {r["input"] for s in (1, 2) for r in _jsonl(tmp / "rollouts" / f"{s}.jsonl")}
    assert dumped <= set(kept) and len(dumped) == 8  # 2 steps x 4 prompts of the 8 kept
    val_kept = _questions(val_rows, prompts.select_samples(8, 4, shuffle=True, seed=1))
    assert [r["input"] for r in _jsonl(tmp / "val" / "0.jsonl")] == val_kept


def test_val_only_validates_the_restored_policy_and_exits(smoke_run):
    tmp, records = smoke_run
    hf = tmp / "run" / "hf" / "model.safetensors"
    exported = os.path.getmtime(hf)
    again = _smoke(tmp / "run", "--config.trainer.val_only=True",
                   f"--config.trainer.validation_data_dir={tmp / 'val'}",
                   "--config.data.val_max_samples=4")  # fmt: skip
    assert again[:-1] == records  # one row added: the restored step 2's validation
    assert again[-1]["step"] == 2 and "val-core/arithmetic/acc/mean@1" in again[-1]
    assert "actor/pg_loss" not in again[-1]
    assert sorted(os.listdir(tmp / "val")) == ["0.jsonl", "2.jsonl"]
    assert sorted(os.listdir(tmp / "run" / "checkpoints")) == ["1", "2"]  # nothing trained
    assert os.path.getmtime(hf) == exported  # no export
    fresh = _smoke(tmp / "fresh", "--config.trainer.val_only=True")
    assert [r["step"] for r in fresh] == [0] and "val-core/arithmetic/acc/mean@1" in fresh[0]
    assert not os.path.exists(tmp / "fresh" / "hf")
    assert not os.listdir(tmp / "fresh" / "checkpoints")


def test_chat_template_kwargs_reach_train_and_val_prompts(tmp_path):
    # Qwen3's enable_thinking=False: its template appends an empty think block to the generation
    # prompt; both dumps show it on every prompt, train and validation alike.
    tok = qwen3_like_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=96, max_response_length=4,
                               val_batch_size=2,
                               apply_chat_template_kwargs={"enable_thinking": False}),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=4),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=1, progress_bar=False, tensorboard=False,
                                     default_local_dir=str(tmp_path / "run"),
                                     rollout_data_dir=str(tmp_path / "rollouts"),
                                     validation_data_dir=str(tmp_path / "val")),
        checkpoint=config.CheckpointConfig(save_last=False),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    train_rows, val_rows = demo_task.arithmetic_rows(4, 2, max_operand=9, seed=0)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=128)  # fmt: skip
        loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                   train_data=train_rows, val_data=val_rows,
                   reward_fn=lambda solution_str, ground_truth: 0.0, mesh=mesh)  # fmt: skip
    block = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    train_inputs = [r["input"] for r in _jsonl(tmp_path / "rollouts" / "1.jsonl")]
    val_inputs = [r["input"] for r in _jsonl(tmp_path / "val" / "0.jsonl")]
    assert len(train_inputs) == 4 and len(val_inputs) == 2
    assert all(text.endswith(block) for text in train_inputs + val_inputs)


def _tiny_run(tmp_path, name, *, donate, use_kl_loss):
    """Two steps of the random tiny model from freshly loaded params: (result, those params)."""
    tok = qwen3_like_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=96, max_response_length=4),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                                 use_kl_loss=use_kl_loss),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=4),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=2, progress_bar=False, tensorboard=False,
                                     default_local_dir=str(tmp_path / name)),
        checkpoint=config.CheckpointConfig(save_last=False),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    train_rows, _ = demo_task.arithmetic_rows(4, 2, max_operand=9, seed=0)
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=128)  # fmt: skip
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=train_rows, mesh=mesh, donate_params=donate,
                            reward_fn=lambda solution_str, ground_truth: len(solution_str) % 3)
    return result, params


def test_donated_params_change_nothing_but_the_copy(tmp_path):
    # train.py drops the params it loaded (loop.train(donate_params=True)). Without a reference
    # the train state takes over their buffers, so the caller's arrays are deleted (one copy of
    # the weights fewer for the run) and the run is bitwise the one that copies them.
    kept, kept_params = _tiny_run(tmp_path, "copied", donate=False, use_kl_loss=False)
    taken, taken_params = _tiny_run(tmp_path, "donated", donate=True, use_kl_loss=False)
    assert not any(a.is_deleted() for a in jax.tree.leaves(kept_params))
    assert all(a.is_deleted() for a in jax.tree.leaves(taken_params))
    for a, b in zip(jax.tree.leaves(kept.state), jax.tree.leaves(taken.state), strict=True):
        assert (a == b).all()
    assert [r.get("actor/pg_loss") for r in kept.history] == [
        r.get("actor/pg_loss") for r in taken.history
    ]
    # With a KL loss the params are the reference: kept, whatever the caller says.
    _, ref_params = _tiny_run(tmp_path, "reference", donate=True, use_kl_loss=True)
    assert not any(a.is_deleted() for a in jax.tree.leaves(ref_params))
