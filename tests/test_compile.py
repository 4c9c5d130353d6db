"""Compiles that pay once: a run compiles every program in its first step (a bounded set of
shapes: prompt-length buckets, the sampler's compaction ladder, packing's row counts), and
JAX's persistent compilation cache, on by default in train.py (trainer.compilation_cache_dir),
serves a second run every program the first one compiled; the run it serves computes the same
numbers bitwise."""

import json
import os
import subprocess
import sys

from grpo_jax import sampler
from grpo_jax.trainer import metrics, perf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# gsm8k.py:smoke with packed micro-batches in every pass (update, old and reference log-probs)
# under a 4-row budget and 48-token responses that the random model ends at random lengths:
# the steps pack different row counts (micro-batches of 1, 2 or 4 rows) and the sampler's rows
# finish at different times. Its prompts (`_write_prompts`) come in widths of three 64-column
# buckets, shuffled, so the batches differ in width as well (data.prompt_padding="dataset", the
# default, pads every batch to the longest prompt).
QUESTION_CHARS = (10, 90, 150, 40)  # char tokenizer: + 2 role tokens
WORKLOAD = (
    "--config.data.source=files",
    "--config.data.max_prompt_length=256",
    "--config.trainer.total_training_steps=6",
    "--config.trainer.save_freq=-1",
    "--config.data.max_response_length=48",
    "--config.actor.use_dynamic_bsz=True",
    "--config.actor.ppo_max_token_len_per_gpu=512",
    "--config.rollout.log_prob_use_dynamic_bsz=True",
    "--config.rollout.log_prob_max_token_len_per_gpu=512",
)


def _write_prompts(path):
    """GSM8K-layout rows whose questions are QUESTION_CHARS characters long, in turn."""
    words = "Ann has 3 apples and buys 4 more; how many apples does Ann have now? " * 3
    with open(path, "w") as f:
        for i in range(64):
            question = words[: QUESTION_CHARS[i % len(QUESTION_CHARS)]]
            f.write(json.dumps({"question": question, "answer": f"so #### {i % 9}"}) + "\n")
    return f"--config.data.path={path}", f"--config.data.val_path={path}"


def _train(workdir, cache, *args):
    # No JAX_* cache variables: the defaults of train.py (every program cached, however fast
    # it compiled: the tiny model's do in well under a second).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "train.py", "--config=configs/gsm8k.py:smoke",
         f"--config.trainer.default_local_dir={workdir}",
         f"--config.trainer.compilation_cache_dir={cache}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return [row for row in metrics.read(str(workdir)) if "perf/compiled_programs" in row]


def test_only_the_first_step_compiles_and_a_second_run_reads_the_cache(tmp_path):
    cache = tmp_path / "cache"
    workload = (*WORKLOAD, *_write_prompts(tmp_path / "prompts.jsonl"))
    first = _train(tmp_path / "a", cache, *workload)
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    assert first[0]["perf/compiled_programs"] > 0
    # The bounded shape set: no step after the first meets a new program.
    assert [r["perf/compiled_programs"] for r in first[1:]] == [0] * 5
    # ... although the steps differ: response lengths, packed micro-batches per mini-batch,
    # and the longest prompt of the batch in the sampler's buckets (sampler.bucket_length).
    assert len({r["response_length/mean"] for r in first}) > 1
    assert len({r["actor/micro_batches"] for r in first}) > 1
    assert len({sampler.bucket_length(int(r["prompt_length/max"])) for r in first}) > 1
    assert sum(r["perf/compile_cache_hits"] for r in first) == 0
    assert os.listdir(cache)  # the programs were written
    second = _train(tmp_path / "b", cache, *workload)
    programs = sum(r["perf/compiled_programs"] for r in second)
    assert programs > 0 and sum(r["perf/compile_cache_hits"] for r in second) == programs
    for a, b in zip(first, second, strict=True):  # the cached programs compute the same
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert a[key] == b[key], key


def test_empty_directory_turns_the_cache_off(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert perf.use_compilation_cache("") is None  # trainer.compilation_cache_dir=""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    assert perf.use_compilation_cache("~/other") == "/somewhere"  # the variable wins
