"""configs/code.py:tiny end to end: scripts/prepare_code_data.py's parquets, train.py for its two
steps, and every training sample's reward as verl's code scorer gives it (re-scored here from
the rollout dump), some of them above 0."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from grpo_jax.rewards import scorers

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_code_tiny_trains_on_code_rewards(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")  # fmt: skip
    data = tmp_path / "data"
    subprocess.run([sys.executable, "scripts/prepare_code_data.py", str(data)], cwd=ROOT,
                   env=env, check=True, capture_output=True)  # fmt: skip
    workdir, dumps = tmp_path / "run", tmp_path / "rollouts"
    cmd = [
        sys.executable, "train.py", "--config=configs/code.py:tiny",
        f"--config.data.path={data / 'train.parquet'}",
        f"--config.data.val_path={data / 'test.parquet'}",
        f"--config.trainer.rollout_data_dir={dumps}",
        "--config.trainer.progress_bar=False",
        f"--config.trainer.default_local_dir={workdir}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    samples = [json.loads(line) for f in sorted(dumps.glob("*.jsonl")) for line in open(f)]
    assert len(samples) == 2 * 4 * 4  # steps x prompts x rollout.n
    # Every problem has 3 tests: a score is a pass rate of them, and equals verl's scorer's.
    for s in samples:
        assert s["score"] in (0.0, 1 / 3, 2 / 3, 1.0)
        assert s["score"] == scorers.default_compute_score("apps", s["output"], s["gts"])
    assert any(s["score"] > 0 for s in samples)
    assert 0 <= rows[2]["val-core/apps/acc/mean@1"] <= 1
