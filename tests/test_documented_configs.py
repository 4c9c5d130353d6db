"""Every CPU form of a config that the docs show runs: `python train.py --config=configs/<file>.py:
<variant>` with the :smoke or :tiny variant, wherever README.md, docs/*.md or a config's docstring
shows one. Each runs here as written, for one step (trainer.total_training_steps=1, the workdir
in tmp), unless another test already runs it (`ELSEWHERE`); a form the docs add must be listed in
one or the other. The other forms (a hub model, Qwen3-8B on GPUs) need downloads or accelerators.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

import train
from configs import gsm8k_dapo
from grpo_jax import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORM = re.compile(r"train\.py\s+--config=(configs/\w+\.py:(?:smoke|tiny))\b")

RUN_HERE = (
    "configs/gsm8k_dapo.py:smoke",
    "configs/gsm8k_lora.py:smoke",
    "configs/gsm8k_qwen3_8b.py:smoke",
    "configs/gsm8k_tool.py:smoke",
    "configs/math.py:smoke",
)
ELSEWHERE = {
    # 6 steps with 48-token responses, twice (the compilation cache); test_tasks.py: on a parquet
    "configs/gsm8k.py:smoke": "test_compile.py::test_only_the_first_step_compiles_and_a_second_"
    "run_reads_the_cache",
    # the fault tests' runs (BASE_OVERRIDES: fewer prompts, the same model, warm-up and loop)
    "configs/demo.py:tiny": "test_faults.py, test_bad_input.py",
    # on scripts/prepare_code_data.py's parquets (data/code by default), samples re-scored
    "configs/code.py:tiny": "test_code_train.py::test_code_tiny_trains_on_code_rewards",
}


def _documented() -> set[str]:
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("configs/*.py")]
    return {m.group(1) for f in files for m in FORM.finditer(f.read_text())}


def test_every_documented_cpu_form_is_run_by_a_test():
    assert _documented() == set(RUN_HERE) | set(ELSEWHERE)


def test_a_warm_up_batch_that_does_not_split_is_reported_before_any_work():
    """gsm8k_dapo.py:smoke's warm-up once failed in its first step: 64 rows in 5-row
    micro-batches (actor.ppo_micro_batch_size_per_gpu=5 on one device)."""
    c = gsm8k_dapo.get_config("smoke")
    train.check_config(c).check_mesh(1)
    c.warmup.batch_size = 64
    with pytest.raises(config.ConfigError, match="warmup.batch_size=64 must be a multiple of"):
        train.check_config(c).check_mesh(1)


@pytest.mark.slow
@pytest.mark.parametrize("form", RUN_HERE)
def test_documented_cpu_form_runs_one_step(tmp_path, form):
    workdir = tmp_path / "run"
    cmd = [
        sys.executable, "train.py", f"--config={form}",
        "--config.trainer.total_training_steps=1",
        f"--config.trainer.default_local_dir={workdir}",
    ]  # fmt: skip
    # As a shell runs it: one CPU device (conftest.py gives this process 8) and train.py's
    # persistent compilation cache (trainer.compilation_cache_dir), so a second run mostly
    # loads its programs (a cache hit runs the same executable).
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1] and math.isfinite(steps[0]["actor/pg_loss"])
    if "qwen3_8b" in form:  # trainer.balance_batch=True, verl's: one rank holds every row
        assert steps[0]["global_seqlen/balanced_max"] == steps[0]["global_seqlen/max"]
    if "tool" in form:  # the multi-turn rollout ran (the random model writes no call)
        assert "multi_turn/tool_calls/mean" in steps[0]
