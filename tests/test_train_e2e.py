"""End to end: `train.py --config=configs/gsm8k.py` on a tiny local Qwen2 checkpoint and jsonl.

Everything is built offline: a byte-level BPE tokenizer with Qwen's ChatML template (trained
with `tokenizers` on the test's own rows) and a random tiny Qwen2 model saved as HF safetensors
by `model.save_hf_checkpoint`. The run uses 2 fake CPU devices, so the batch really is sharded.
It trains 2 steps and must write metrics, checkpoints, a plot and the HF export; a second
invocation with 3 total steps resumes from the step-2 checkpoint and runs exactly 1 more step.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from grpo_jax import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _rows(n, offset):
    rows = []
    for i in range(n):
        a, b = offset + i, 2 * i + 1
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples now?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}",
            }
        )
    return rows


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _build_tokenizer(path, texts):
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    train_rows, test_rows = _rows(12, 1), _rows(4, 50)
    _write_jsonl(tmp / "train.jsonl", train_rows)
    _write_jsonl(tmp / "test.jsonl", test_rows)
    model_dir = str(tmp / "qwen2_tiny")
    texts = [r["question"] + " " + r["answer"] for r in train_rows] + ["user assistant"]
    tok = _build_tokenizer(model_dir, texts)
    cfg = model.ModelConfig.tiny(
        vocab_size=320,
        eos_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=256,
    )
    params = model.init_params(cfg, jax.random.key(1))
    model.save_hf_checkpoint(cfg, params, model_dir)
    return tmp, model_dir, params


def _train(tmp, model_dir, steps):
    cmd = [
        sys.executable,
        "train.py",
        "--config=configs/gsm8k.py",
        f"--config.model.path={model_dir}",
        f"--config.data.path={tmp / 'train.jsonl'}",
        f"--config.data.val_path={tmp / 'test.jsonl'}",
        f"--config.trainer.default_local_dir={tmp / 'run'}",
        "--config.data.source=jsonl",
        "--config.data.train_batch_size=4",
        "--config.actor.ppo_mini_batch_size=2",
        "--config.actor.ppo_micro_batch_size_per_gpu=5",
        "--config.rollout.log_prob_micro_batch_size_per_gpu=10",
        "--config.data.val_batch_size=4",
        "--config.data.max_prompt_length=96",
        "--config.data.max_response_length=8",
        "--config.data.prompt_length_bucket=16",
        f"--config.trainer.total_training_steps={steps}",
        "--config.trainer.save_freq=1",
        "--config.trainer.test_freq=2",
        "--config.trainer.progress_bar=False",
        "--config.actor.optim.lr=1e-3",
    ]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl")]


@pytest.mark.slow
def test_two_steps_then_resume_one(setup):
    tmp, model_dir, init = setup
    run = tmp / "run"
    records = _train(tmp, model_dir, 2)
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/pg_clipfrac",
        "actor/entropy",
        "actor/grad_norm",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/old_log_prob",
        "timing_s/ref",
        "perf/throughput",
        "timing_per_token_ms/gen",
        "timing_per_token_ms/update_actor",
        "global_seqlen/mean",
        "perf/cpu_memory_used_gb",
        "perf/actor_tflops_per_device",
        "training/rollout_probs_diff_mean",  # verl logs rollout-vs-trainer diffs by default
        "rollout_corr/kl",
    ):
        assert key in records[1] and key in records[2], key
    acc = "val-core/openai/gsm8k/acc/mean@1"  # verl's name (GSM8K's float score is its "acc")
    assert acc in records[0] and acc in records[2]
    assert 0.0 <= records[2][acc] <= 1.0
    # 2 mini-batches per step (4 prompts / 2): one skipped update would show here.
    assert records[1]["actor/update_skipped"] == 0.0
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"][-3:]
    with open(run / "plot.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    cfg, exported = model.load_hf_checkpoint(str(run / "hf"))
    assert os.path.exists(run / "hf" / "tokenizer.json")
    # Two updates at lr 1e-3 moved the weights (AdamW's first steps are ~lr per coordinate).
    diffs = [
        np.max(np.abs(np.asarray(a) - np.asarray(b)))
        for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(init))
    ]
    assert max(diffs) > 1e-4

    # Resume: same command with 3 steps -> restores step 2, runs step 3 only.
    resumed = _train(tmp, model_dir, 3)
    # step 2 twice: the resumed run validates before training (val_before_train), as verl
    assert [r["step"] for r in resumed] == [0, 1, 2, 2, 3]
    assert resumed[:3] == records  # earlier lines untouched
    assert acc in resumed[3] and all(k == "step" or k.startswith("val-") for k in resumed[3])
    assert acc in resumed[4]  # final eval
    assert "3" in os.listdir(run / "checkpoints")
