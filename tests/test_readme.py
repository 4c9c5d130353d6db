"""The README's snippets run as written: "Training from Python" (then a resume, in one
interpreter) and "The maths alone".

The snippet is a laptop's or a notebook's: one device. The test suite's own process has 8 fake
CPU devices (conftest.py), on which the default data-parallel mesh would hold 8 copies of the
model and its Adam moments, so the snippet runs in a fresh interpreter with the default single
CPU device, like a notebook kernel: exactly the README's text is exec'd there, then the resume,
all as library calls (no train.py).
"""

import json
import os
import re
import subprocess
import sys

import pytest
import reference

from grpo_jax.data import demo_task
from grpo_jax.trainer import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in the fresh interpreter: the snippet, then the same call with 3 steps (a resume).
DRIVER = """
import dataclasses, gc, json, sys
namespace = {}
exec(compile(open(sys.argv[1]).read(), "README.md", "exec"), namespace)
run, first = namespace["run"], [r["step"] for r in namespace["result"].history]
del namespace["result"]  # its train state (params + Adam moments): the resume restores its own
gc.collect()
more = dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, total_training_steps=3))
again = namespace["loop"].train(
    more, model_config=namespace["model_config"], params=namespace["params"],
    tokenizer=namespace["tokenizer"], train_data=namespace["prompts"],
    reward_fn=namespace["reward"],
)
print(json.dumps({"first": first, "last": again.history[-1],
                  "again": [r["step"] for r in again.history], "updates": int(again.state.step)}))
"""


def _snippet(section: str = "## Training from Python") -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().split(section, 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_maths_alone_snippet_runs():
    namespace = {}
    exec(compile(_snippet("## The maths alone"), "README.md", "exec"), namespace)
    assert float(namespace["value"]) == float(namespace["value"])  # finite, not NaN
    assert set(namespace["metrics"]) >= {"actor/pg_loss", "actor/kl_loss"}
    # Groups {1, 0} and {1, 0} in reward: mean 0.5, unbiased std sqrt(0.5), so the advantages
    # are +-0.5 / (sqrt(0.5) + 1e-6) (verl's epsilon).
    adv, want = namespace["adv"], 0.5 / (0.5**0.5 + 1e-6)
    assert abs(float(adv[0, 0]) - want) < 1e-6 and abs(float(adv[1, 0]) + want) < 1e-6


@pytest.mark.slow
def test_training_from_python_snippet_runs_and_resumes(tmp_path):
    try:
        demo_task.smollm2_gguf()
    except FileNotFoundError as e:
        reference.require("hf", str(e))
    (tmp_path / "snippet.py").write_text(_snippet())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "snippet.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    workdir = tmp_path / "runs" / "sums"
    assert got["first"] == [1, 2] and got["again"] == [3]  # the resume ran step 3 only
    assert got["updates"] == 3  # one optimizer update per step, none repeated
    assert got["last"]["actor/update_skipped"] == 0 and got["last"]["response_length/mean"] > 0
    assert [r["step"] for r in metrics.read(str(workdir))] == [1, 2, 3]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]  # save_freq=2, then the last
    assert os.path.exists(workdir / "hf" / "model.safetensors")
