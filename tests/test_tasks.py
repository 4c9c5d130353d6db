"""Any task through train.py: a verl-format parquet with two data sources, each scored by its own
verl scorer (default_compute_score dispatches on data_source), validated per source."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(n, split):
    rows = []
    for i in range(n):
        a, b = i % 7, i // 7
        if i % 2:  # GSM8K: strict "####" scorer
            rows.append(
                {
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": f"{a}+{b}? End with #### N."}],
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"split": split, "index": i},
                }
            )
        else:  # DAPO math: "Answer: N", a dict score with acc and pred
            rows.append(
                {
                    "data_source": "math_dapo",
                    "prompt": [{"role": "user", "content": f"{a}*{b}? Say Answer: N."}],
                    "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                    "extra_info": {"split": split, "index": i},
                }
            )
    return rows


@pytest.mark.slow
def test_two_sources_train_and_validate_per_source(tmp_path):
    import datasets

    for split, n in (("train", 16), ("test", 6)):
        datasets.Dataset.from_list(_rows(n, split)).to_parquet(str(tmp_path / f"{split}.parquet"))
    workdir = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "--config=configs/gsm8k.py:smoke",
        "--config.data.source=files",
        f"--config.data.path={tmp_path / 'train.parquet'}",
        f"--config.data.val_path={tmp_path / 'test.parquet'}",
        "--config.data.max_prompt_length=48",
        "--config.reward.fn=grpo_jax.rewards.scorers:default_compute_score",
        "--config.rollout.val_kwargs.n=2",
        "--config.rollout.val_kwargs.do_sample=True",
        "--config.rollout.val_kwargs.temperature=1.0",
        "--config.trainer.test_freq=2",
        "--config.trainer.progress_bar=False",
        f"--config.trainer.default_local_dir={workdir}",
    ]
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1"
    )
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in (rows[0], rows[2]):  # before training, and the last step's validation
        # GSM8K's scorer returns a float, which verl also reports as "acc", the core variable.
        for name in ("mean@2", "best@2/mean", "best@2/std"):
            assert 0 <= row[f"val-core/openai/gsm8k/acc/{name}"] <= 1
        assert "val-aux/openai/gsm8k/acc/std@2" in row
        assert "val-aux/openai/gsm8k/reward/mean@2" in row
        # DAPO's scorer returns {"score", "acc", "pred"}: acc is core, and pred gives maj@2.
        for name in ("mean@2", "best@2/mean", "maj@2/mean"):
            assert 0 <= row[f"val-core/math_dapo/acc/{name}"] <= 1
        assert -1 <= row["val-aux/math_dapo/reward/mean@2"] <= 1  # DAPO scores wrong as -1
    assert "critic/score/mean" in rows[1] and "reward_extra/acc/mean" in rows[1]
