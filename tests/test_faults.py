"""Fault tolerance of train.py: exact resume after SIGKILL, corrupt checkpoints, non-finite
updates, unwritable and full disks (issue 8).

Every end-to-end test runs the real entry point, `python train.py --config=configs/demo.py:tiny`
with overrides that shrink it to a 2-step SFT warm-up, an eval, then 4 GRPO steps of 4 prompts x 4
samples with the KL loss against the post-warm-up reference, on a tiny model (`BASE_OVERRIDES`), as
a subprocess that can be SIGKILLed like a real job. The tests compare runs of the same code: they
fail with a clear message if train.py, grpo_jax/ or configs/ change while they run. The subprocesses
share a persistent JAX compilation cache (per test session), so a restart costs start-up, not a
recompile; a cache hit runs the same executable, so it cannot change results.

Exact resume compares a run that was killed and restarted with one that never stopped:
  * the metrics JSONL row by row, excluding `TIMING_PREFIX` / `TIMING_KEYS`: wall-clock
    durations (`timing_s/*`, `timing_per_token_ms/*`), rates derived from them
    (`perf/throughput`, `perf/mfu/actor`, ...), the process's memory peaks and what it compiled
    (`perf/compiled_programs`, `perf/compile_cache_hits`); they measure the machine and the
    process, not the training, and differ between any two runs. Every other value (rewards,
    losses, grad norms, lengths, lr, epoch, token counts, eval accuracy) must be bitwise equal;
  * the final params (the HF safetensors export), bitwise.
The reward is `fault_rewards.digit_reward` (a dense, text-dependent score) so that advantages,
gradients and updates are non-zero from the first step: with the demo's sparse reward a random
model scores 0, every advantage is 0 and the comparison would hold even if resume were broken.
The train set has 10 prompts, so 4 steps of 4 prompts cross an epoch boundary and the reshuffle
matters.
The multi-turn kill test runs test_multi_turn.py's tool loop instead (`_multi_turn_overrides`:
the tiny model warmed up to call an add tool, trajectories of tool calls on the paged engine),
and kills one launch while a tool call runs.

Figures for the issue (printed with `pytest -s`): kills survived, corrupt checkpoints recovered,
steps lost beyond the last save. The vLLM sidecar's restart with back-off is covered by
tests/test_vllm.py.
"""

import asyncio
import errno
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_multi_turn
from safetensors import numpy as safetensors_np

from grpo_jax.trainer import actor, checkpoint, metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS = 4
BASE_OVERRIDES = (
    f"--config.trainer.total_training_steps={STEPS}",
    "--config.data.arithmetic.num_train=10",  # 2 steps per epoch: step 3 starts epoch 1
    "--config.data.arithmetic.num_val=4",
    "--config.data.val_batch_size=4",
    "--config.data.train_batch_size=4",
    "--config.actor.ppo_mini_batch_size=4",  # one mini-batch: on-policy, no old log-prob pass
    "--config.actor.ppo_micro_batch_size_per_gpu=8",  # 2 micro-batches: accumulation runs
    "--config.rollout.n=4",
    "--config.warmup.steps=2",  # SFT warm-up, then a fresh optimizer: only in the first launch
    "--config.warmup.batch_size=4",
    "--config.actor.use_kl_loss=True",  # reference = post-warm-up policy, kept in checkpoints
    "--config.trainer.val_before_train=True",  # step-0 row: eval + warm-up NLL
    "--config.trainer.test_freq=-1",  # eval only at the end
    "--config.trainer.save_freq=1",
    "--config.checkpoint.max_to_keep=2",
    "--config.trainer.tensorboard=False",
    "--config.trainer.progress_bar=False",
    "--config.model.tiny.hidden_size=32",
    "--config.model.tiny.intermediate_size=64",
    "--config.reward.fn=fault_rewards:digit_reward",
)
# Wall-clock, memory and compile measurements, different in every run (module docstring).
TIMING_PREFIX = ("timing_s/", "timing_per_token_ms/", "perf/max_memory_", "actor/perf/")
TIMING_KEYS = (
    "perf/throughput",
    "perf/time_per_step",
    "perf/mfu/actor",
    "perf/actor_tflops_per_device",
    "perf/cpu_memory_used_gb",
    "perf/compiled_programs",  # what this process had yet to compile, or found in the cache
    "perf/compile_cache_hits",
)
RUN_TIMEOUT_S = 600
FIGURES = {
    "kills survived": 0,
    "corrupt checkpoints recovered": 0,
    "steps lost beyond the last save": 0,
}


# ------------------------------------------------------------------------------------------
# HELPERS
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    """Prints the issue's figures after this file's tests (visible with `pytest -s`)."""
    yield
    print("\nreliability figures:", json.dumps(FIGURES))


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(jax_cache: str) -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=jax_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([REPO, TESTS, env.get("PYTHONPATH", "")]),
    )
    return env


def _train_cmd(
    workdir: str, *extra: str, prefix: tuple[str, ...] = (), base: tuple[str, ...] = BASE_OVERRIDES
) -> list[str]:
    args = [
        "--config=configs/demo.py:tiny",
        f"--config.trainer.default_local_dir={workdir}",
        *base,
        *extra,
    ]
    return [sys.executable, *prefix, *(args if prefix else ["train.py", *args])]


def _launch(cmd: list[str], log_path: str, jax_cache: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - closed by _finish
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(jax_cache), stdout=log, stderr=subprocess.STDOUT
    )
    proc.log = log
    return proc


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.log.close()


def _run(cmd, log_path, jax_cache) -> tuple[int, str]:
    rc = _finish(_launch(cmd, log_path, jax_cache))
    with open(log_path) as f:
        return rc, f.read()


def _complete_steps(workdir: str) -> list[int]:
    """Finalised checkpoint steps: orbax renames `<step>.orbax-checkpoint-tmp` to `<step>`."""
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _comparable(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING_PREFIX) and k not in TIMING_KEYS}
        for r in rows
    ]


def _params(workdir: str) -> dict[str, np.ndarray]:
    return safetensors_np.load_file(os.path.join(workdir, "hf", "model.safetensors"))


def _assert_same_run(workdir: str, ref: str, *, revalidates: bool = True) -> None:
    """Metrics (minus timing) and final params of `workdir` equal those of `ref`, bitwise.
    `revalidates`: the run validates before training (BASE_OVERRIDES), so after each resume."""
    with open(ref + ".digest") as f:
        assert f.read() == _source_digest(), (
            "train.py, grpo_jax/ or configs/ changed while this test ran (a shared checkout being "
            "edited?): the two runs executed different code; rerun on a quiet tree"
        )
    rows, ref_rows = metrics.read(workdir), metrics.read(ref)
    # trainer.val_before_train: each resume validates first, in a row under the resumed step
    # (verl); at most one per step, and the training rows are those of the uninterrupted run.
    revals = [r for r in rows if r["step"] > 0 and "training/global_step" not in r]
    assert bool(revals) == revalidates
    assert all(k == "step" or k.startswith("val-") for r in revals for k in r)
    assert len({r["step"] for r in revals}) == len(revals), "a resume validation row twice"
    rows = [r for r in rows if r not in revals]
    assert [r["step"] for r in rows] == list(range(STEPS + 1)), "duplicate or missing rows"
    for got, want in zip(_comparable(rows), _comparable(ref_rows), strict=True):
        assert got == want, f"step {want['step']} differs: " + str(
            {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
        )
    params, ref_params = _params(workdir), _params(ref)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert params[name].dtype == value.dtype and params[name].tobytes() == value.tobytes(), name


def _resumed_from(log: str) -> int | None:
    m = re.search(r"resumed from step (\d+)", log)
    return int(m.group(1)) if m else None


# `python -c EXIT_AFTER_SAVE <train.py args>`: train.py, but the process dies (os._exit, no
# cleanup, like SIGKILL) right after its first checkpoint.save returns, i.e. after the step is
# final but before its metrics row is written. Too short a window to hit with a timed signal.
EXIT_AFTER_SAVE = """
import os, runpy, sys
from grpo_jax.trainer import checkpoint
real_save = checkpoint.save
def save(*args, **kwargs):
    real_save(*args, **kwargs)
    os._exit(137)
checkpoint.save = save
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def _source_digest() -> str:
    """Hash of the code a run executes: comparing two runs is void if it changed in between."""
    h = hashlib.sha256()
    for pattern in ("train.py", "grpo_jax/*.py", "configs/*.py"):
        for path in sorted(glob.glob(os.path.join(REPO, pattern))):
            with open(path, "rb") as f:
                h.update(path.encode() + f.read())
    return h.hexdigest()


def _uninterrupted(cmd: list[str], workdir: str, jax_cache: str) -> list[dict]:
    """Runs `cmd` (on `workdir`) to the end, to compare others with: its metrics rows. Records
    the code it ran (`_assert_same_run` checks that the compared runs ran the same)."""
    with open(workdir + ".digest", "w") as f:
        f.write(_source_digest())
    rc, log = _run(cmd, workdir + ".log", jax_cache)
    assert rc == 0, log[-4000:]
    return metrics.read(workdir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jax_cache):
    """The uninterrupted run every other run is compared with (also fills the compile cache)."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    rows = _uninterrupted(_train_cmd(workdir), workdir, jax_cache)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert rows[0]["warmup/steps"] == 2
    rows = rows[1:]
    # The comparison is only meaningful when every step really updates the params.
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["actor/update_skipped"] == 0, r
        assert r["critic/advantages/max"] > 0, r
    assert [r["training/epoch"] for r in rows] == [0, 0, 1, 1]
    return workdir


# ------------------------------------------------------------------------------------------
# EXACT RESUME
# ------------------------------------------------------------------------------------------


def _tmp_dirs(workdir: str) -> set[tuple[str, int]]:
    """(name, inode) of checkpoint temporary directories: a save in progress, or a killed one."""
    paths = glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp"))
    out = set()
    for p in paths:
        try:
            out.add((os.path.basename(p), os.stat(p).st_ino))
        except FileNotFoundError:  # finalised (renamed) between glob and stat
            pass
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _calls_running(tool_log: str, pid: int) -> int:
    """Tool calls process `pid` started and did not finish (LoggedAddTool's log)."""
    try:
        with open(tool_log) as f:
            lines = f.read().split()
    except FileNotFoundError:
        return 0
    return lines.count(f"{pid}:start") - lines.count(f"{pid}:end")


def _kill_and_resume(
    tmp_path, workdir: str, schedule, jax_cache: str, *, base=BASE_OVERRIDES, tool_log=None
) -> tuple[list[str], int]:
    """Launches train.py on `workdir` once per (kind, k, delay) of `schedule`, kills each launch
    as its kind says, and checks that every restart resumed from the newest checkpoint that was
    final at the last kill. Returns the kinds of the kills and the steps lost beyond a save.

    Kinds: "step": `delay` s after this launch wrote the metrics row of step >= k, i.e. inside
    the next step. "save": `delay` s after this launch's first checkpoint temporary directory
    appeared (leftovers of an earlier kill have other inodes and do not count); it must still
    be there after the kill, i.e. the write was really interrupted. "exit_after_save":
    EXIT_AFTER_SAVE (the checkpoint is final, its metrics row not written). "none": the launch
    runs to the end. "tool": as "step", but `delay` s after a tool call of this launch started
    (LoggedAddTool's `tool_log`), and the call must still be running at the kill.
    """
    kills, lost, expected_resume = [], 0, None
    for launch, (kind, k, delay) in enumerate(schedule):
        log_path = str(tmp_path / f"launch{launch}.log")
        stale = _tmp_dirs(workdir)
        prefix = ("-c", EXIT_AFTER_SAVE) if kind == "exit_after_save" else ()
        proc = _launch(_train_cmd(workdir, prefix=prefix, base=base), log_path, jax_cache)
        killed, at_kill = False, []
        # Rows after the resumed step are this launch's (older ones are truncated on resume).
        first_new = max(k or 0, (expected_resume or 0) + 1)
        while proc.poll() is None and kind in ("step", "tool", "save"):
            if kind == "save":
                killed = bool(_tmp_dirs(workdir) - stale)
            else:
                resumed = expected_resume is None or "resumed from step" in _read(log_path)
                rows = metrics.read(workdir) if resumed else []
                killed = bool(rows) and rows[-1]["step"] >= first_new
                if kind == "tool":
                    killed = killed and _calls_running(tool_log, proc.pid) > 0
            if killed:
                time.sleep(delay)
                at_kill = _complete_steps(workdir)
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        rc = _finish(proc)
        log = _read(log_path)
        resumed = _resumed_from(log)
        assert resumed == expected_resume, (
            f"launch {launch} resumed from {resumed}, newest checkpoint at the last kill was "
            f"{expected_resume}\n{log[-3000:]}"
        )
        lost += (expected_resume or 0) - (resumed or 0)
        if kind == "none":
            assert rc == 0, log[-4000:]
            break
        if kind == "exit_after_save":
            assert rc == 137, log[-4000:]
            killed, at_kill = True, _complete_steps(workdir)
            rows = metrics.read(workdir)
            assert rows[-1]["step"] == max(at_kill) - 1, "the row of the saved step was written"
            rc = -signal.SIGKILL
        assert killed and rc == -signal.SIGKILL, (
            f"launch {launch} ended (rc {rc}) before its '{kind}' kill point; {log[-3000:]}"
        )
        if kind == "save":
            assert _tmp_dirs(workdir) - stale, "the save finished before the kill; lower delay"
            # Nothing is deleted before the newer checkpoint is complete.
            assert expected_resume is None or expected_resume in at_kill, at_kill
        if kind == "tool":
            assert _calls_running(tool_log, proc.pid) > 0, "the call ended first; lower delay"
        kills.append(kind)
        expected_resume = max(at_kill) if at_kill else None
    return kills, lost


def test_exact_resume_after_random_sigkills(reference, tmp_path, jax_cache):
    """SIGKILL mid-step, mid-checkpoint-write and right after a save; restart each time; the
    finished run must be bitwise equal to `reference` (no duplicate, missing or orphan rows).

    The kill schedule is drawn from a fixed seed. Each kill records the newest finalised
    checkpoint; the restart must resume from exactly that step (0 steps lost beyond the save).
    """
    rng = random.Random(8)
    workdir = str(tmp_path / "run")
    schedule = [
        ("step", rng.randint(1, 2), rng.uniform(0.0, 0.1)),
        ("save", None, rng.uniform(0.0, 0.03)),
        ("exit_after_save", None, None),
        ("step", 3, rng.uniform(0.0, 0.05)),
        ("none", None, None),
    ]
    kills, lost = _kill_and_resume(tmp_path, workdir, schedule, jax_cache)
    assert kills == ["step", "save", "exit_after_save", "step"]
    _assert_same_run(workdir, reference)
    FIGURES["kills survived"] += len(kills)
    FIGURES["steps lost beyond the last save"] += lost
    assert lost == 0


ASYNC_OVERRIDES = ("--config.trainer.async_rollout=True", "--config.trainer.save_freq=2")


def test_exact_resume_of_async_rollouts_after_sigkills(tmp_path, jax_cache):
    """trainer.async_rollout: batch t+1 is sampled during update t, but never across a
    checkpoint (grpo_jax/rollout/async_rollout.py). SIGKILL inside step 2 (no checkpoint yet)
    and inside step 4 (with step 4's batch sampled during step 3's update); the restarted run
    must equal an uninterrupted async run bitwise, with no sample lost or used twice."""
    ref = str(tmp_path / "reference")
    rows = _uninterrupted(_train_cmd(ref, *ASYNC_OVERRIDES), ref, jax_cache)[1:]
    assert [r["async/staleness"] for r in rows] == [0, 1, 0, 1]  # none after a save
    assert [r["training/epoch"] for r in rows] == [0, 0, 1, 1]
    rng = random.Random(15)
    workdir = str(tmp_path / "run")
    for launch, (after_row, resume) in enumerate([(1, None), (3, None), (None, 2)]):
        log_path = str(tmp_path / f"launch{launch}.log")
        proc = _launch(_train_cmd(workdir, *ASYNC_OVERRIDES), log_path, jax_cache)
        while after_row is not None and proc.poll() is None:
            rows = metrics.read(workdir) if (resume is None or "resumed from step" in
                                             _read(log_path)) else []
            if rows and rows[-1]["step"] >= after_row:
                time.sleep(rng.uniform(0.0, 0.05))
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        rc = _finish(proc)
        log = _read(log_path)
        assert _resumed_from(log) == resume, log[-3000:]
        assert rc == (0 if after_row is None else -signal.SIGKILL), log[-3000:]
    _assert_same_run(workdir, ref)
    FIGURES["kills survived"] += 2


class LoggedAddTool(test_multi_turn.AddTool):
    """test_multi_turn's add tool, `config["sleep_s"]` slower, logging "<pid>:start" and
    "<pid>:end" around each call to `config["log"]`: the kill test sees a call in flight."""

    async def execute(self, instance_id, parameters, **kwargs):
        with open(self.config["log"], "a") as f:
            f.write(f"{os.getpid()}:start\n")
        await asyncio.sleep(self.config["sleep_s"])
        try:
            return await super().execute(instance_id, parameters, **kwargs)
        finally:
            with open(self.config["log"], "a") as f:
                f.write(f"{os.getpid()}:end\n")


def _multi_turn_overrides(directory) -> tuple[str, ...]:
    """test_multi_turn's tool loop as train.py overrides, in place of BASE_OVERRIDES: 10 sums
    whose warm-up answer is a call of the add tool (LoggedAddTool, through a verl tool YAML, calls
    logged to directory/tool_calls.log), the model warmed up 60 steps to write such calls, then
    4 prompts x 2 trajectories of at most 2 model turns on the paged engine, one mini-batch (no
    old-log-prob pass, so no rollout correction: the update never reads the engine's log-probs,
    docs/rollouts.md), packed micro-batches, the KL loss against the warmed-up reference."""
    rows = os.path.join(directory, "tool_rows.jsonl")
    with open(rows, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in test_multi_turn.tool_rows(10))
    tools = os.path.join(directory, "tools.yaml")
    tool = {"type": "native", "log": os.path.join(directory, "tool_calls.log"), "sleep_s": 0.3}
    with open(tools, "w") as f:
        json.dump({"tools": [{"class_name": "test_faults.LoggedAddTool", "config": tool,
                              "tool_schema": test_multi_turn.ADD_SCHEMA}]}, f)  # JSON is YAML
    return (
        f"--config.trainer.total_training_steps={STEPS}",
        "--config.data.source=files",
        f"--config.data.path={rows}",  # 2 steps per epoch: step 3 starts epoch 1
        f"--config.data.val_path={rows}",
        "--config.data.train_batch_size=4",
        "--config.data.max_prompt_length=48",
        "--config.data.max_response_length=128",
        "--config.rollout.n=2",
        "--config.rollout.multi_turn.enable=True",
        "--config.rollout.multi_turn.max_assistant_turns=2",
        f"--config.rollout.multi_turn.tool_config_path={tools}",
        "--config.rollout.log_prob_micro_batch_size_per_gpu=8",
        "--config.actor.ppo_mini_batch_size=4",
        "--config.actor.ppo_micro_batch_size_per_gpu=4",
        "--config.actor.use_dynamic_bsz=True",
        "--config.actor.ppo_max_token_len_per_gpu=512",
        "--config.actor.use_kl_loss=True",
        "--config.actor.optim.lr=1e-4",  # at 1e-3 the policy stops calling by step 4
        "--config.warmup.steps=60",
        "--config.warmup.batch_size=8",
        "--config.trainer.val_before_train=False",
        "--config.trainer.test_freq=-1",
        "--config.trainer.save_freq=1",
        "--config.checkpoint.max_to_keep=2",
        "--config.trainer.tensorboard=False",
        "--config.trainer.progress_bar=False",
        "--config.model.tiny.intermediate_size=128",
        "--config.reward.fn=fault_rewards:digit_reward",  # the tool's responses count too
        "--config.reward.num_workers=0",
    )


def test_exact_resume_of_multi_turn_rollouts_after_sigkills(tmp_path, jax_cache):
    """rollout.multi_turn with a tool: SIGKILL while a tool call runs (its response not yet
    appended to the trajectory), mid-checkpoint-write and right after a save; the finished run
    must equal an uninterrupted one bitwise, metrics and params, with no step lost.

    A trajectory's tokens are drawn with keys of its row and response position whatever the
    paged engine's schedule (which follows when the tools answer), so a resumed step samples
    the uninterrupted run's trajectories. The engine's log-probs do follow the schedule, to
    float rounding; without rollout correction and on-policy nothing reads them."""
    base = _multi_turn_overrides(tmp_path)
    tool_log = os.path.join(tmp_path, "tool_calls.log")
    ref = str(tmp_path / "reference")
    rows = _uninterrupted(_train_cmd(ref, base=base), ref, jax_cache)[1:]
    assert [r["training/epoch"] for r in rows] == [0, 0, 1, 1]
    for r in rows:  # every step calls the tool and updates the params
        assert r["multi_turn/tool_calls/mean"] > 0 and r["num_turns/max"] >= 4, r
        assert r["actor/grad_norm"] > 0 and r["actor/update_skipped"] == 0, r
        assert r["critic/advantages/max"] > 0, r
    rng = random.Random(33)
    # A kill while a call sleeps (LoggedAddTool, 0.3 s) is also one mid-step; the single-turn
    # test kills at other points of a step, with nothing multi-turn about them.
    schedule = [
        ("tool", rng.randint(1, 2), rng.uniform(0.0, 0.1)),
        ("save", None, rng.uniform(0.0, 0.03)),
        ("exit_after_save", None, None),
        ("none", None, None),
    ]
    workdir = str(tmp_path / "run")
    kills, lost = _kill_and_resume(tmp_path, workdir, schedule, jax_cache, base=base,
                                   tool_log=tool_log)  # fmt: skip
    assert kills == ["tool", "save", "exit_after_save"]
    _assert_same_run(workdir, ref, revalidates=False)
    FIGURES["kills survived"] += len(kills)
    FIGURES["steps lost beyond the last save"] += lost
    assert lost == 0


# ------------------------------------------------------------------------------------------
# CORRUPT CHECKPOINTS
# ------------------------------------------------------------------------------------------


def _largest_file(step_dir: str, sub: str) -> str:
    files = [
        f for f in glob.glob(os.path.join(step_dir, sub, "**"), recursive=True) if os.path.isfile(f)
    ]
    return max(files, key=os.path.getsize)


def _truncate_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _overwrite_garbage(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"\x00garbage" * (size // 8 + 1))


CORRUPTIONS = {
    # how the newest checkpoint is damaged -> function(step_dir)
    "truncated array data": lambda d: _truncate_half(_largest_file(d, "state")),
    "garbage array data": lambda d: _overwrite_garbage(_largest_file(d, "state")),
    "garbage meta json": lambda d: _overwrite_garbage(os.path.join(d, "meta", "metadata")),
    "missing state metadata": lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
    "empty ocdbt manifest": lambda d: open(os.path.join(d, "state", "manifest.ocdbt"), "w").close(),
}


# orbax leaves un-awaited read coroutines behind when a read fails; pytest reports them.
_ORBAX_READ_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_ORBAX_READ_NOISE
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_in_process(corruption, tmp_path, caplog):
    """restore_latest reports the damaged newest step (step + path), restores the previous one,
    keeps the damaged files for inspection, and saving that step again works."""
    directory = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(directory, max_to_keep=3)
    tree_1 = {"w": jnp.arange(4096, dtype=jnp.float32), "rng": jnp.arange(2, dtype=jnp.uint32)}
    for step in (1, 2):
        checkpoint.save(mngr, step, jax.tree.map(lambda x, s=step: x + s, tree_1), {"step": step})
    CORRUPTIONS[corruption](os.path.join(directory, "2"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree_1)
    mngr = checkpoint.manager(directory, max_to_keep=3)
    with caplog.at_level("ERROR"):
        step, tree, meta = checkpoint.restore_latest(mngr, abstract)
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(tree["w"], np.arange(4096, dtype=np.float32) + 1)
    report = caplog.text
    assert "step 2" in report and directory in report
    aside = [n for n in os.listdir(directory) if n.startswith("2") and n != "2"]
    assert aside, f"the damaged step was deleted or left in place: {os.listdir(directory)}"
    # The resumed run saves step 2 again: that must not collide with the damaged copy.
    checkpoint.save(mngr, 2, jax.tree.map(lambda x: x + 20, tree_1), {"step": 2})
    step, tree, _ = checkpoint.restore_latest(
        checkpoint.manager(directory, max_to_keep=3), abstract
    )
    assert step == 2
    np.testing.assert_array_equal(tree["w"], np.arange(4096, dtype=np.float32) + 20)
    FIGURES["corrupt checkpoints recovered"] += 1


@_ORBAX_READ_NOISE
def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
    directory = str(tmp_path / "checkpoints")
    mngr = checkpoint.manager(directory, max_to_keep=2)
    tree = {"w": jnp.arange(4096, dtype=jnp.float32)}
    for step in (1, 2):
        checkpoint.save(mngr, step, tree, {"step": step})
        _truncate_half(_largest_file(os.path.join(directory, str(step)), "state"))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    with pytest.raises(RuntimeError, match=r"no readable checkpoint in .*step 2.*step 1"):
        checkpoint.restore_latest(checkpoint.manager(directory, max_to_keep=2), abstract)


def test_corrupt_latest_checkpoint_end_to_end(reference, tmp_path, jax_cache):
    """train.py on a finished run whose last checkpoint is truncated: it reports step 4, resumes
    from step 3, redoes step 4 and ends bitwise equal to the reference."""
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    shutil.rmtree(os.path.join(workdir, "hf"))
    assert _complete_steps(workdir) == [3, 4]
    _truncate_half(_largest_file(os.path.join(workdir, "checkpoints", "4"), "state"))
    rc, log = _run(_train_cmd(workdir), workdir + ".log", jax_cache)
    assert rc == 0, log[-4000:]
    assert re.search(r"checkpoint step 4 in \S*checkpoints is unreadable", log), log[-4000:]
    assert _resumed_from(log) == 3
    _assert_same_run(workdir, reference)
    assert _complete_steps(workdir) == [3, 4]
    FIGURES["corrupt checkpoints recovered"] += 1


# ------------------------------------------------------------------------------------------
# NON-FINITE UPDATES
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nan_grad", "inf_grad", "nan_loss"])
def test_nonfinite_update_is_skipped(bad):
    """apply_gradients leaves params and optimizer state bitwise unchanged and flags the skip."""
    tx = actor.make_optimizer(grad_clip=1.0, betas=(0.9, 0.999), weight_decay=0.01)
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    state = actor.init_state(params, tx)
    good = {"w": jnp.full((2, 3), 0.5, jnp.float32)}
    state, m = actor.apply_gradients(state, good, jnp.float32(1.0), jnp.float32(0.1), tx)
    assert float(m["actor/update_skipped"]) == 0.0
    grads, loss_value = good, jnp.float32(1.0)
    if bad == "nan_grad":
        grads = {"w": good["w"].at[0, 1].set(jnp.nan)}
    elif bad == "inf_grad":
        grads = {"w": good["w"].at[1, 2].set(jnp.inf)}
    else:
        loss_value = jnp.float32(jnp.nan)
    new, m = actor.apply_gradients(state, grads, loss_value, jnp.float32(0.1), tx)
    assert float(m["actor/update_skipped"]) == 1.0
    for a, b in zip(
        jax.tree.leaves((new.params, new.opt_state)),
        jax.tree.leaves((state.params, state.opt_state)),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_consecutive_nonfinite_updates_stop_the_run(reference, tmp_path, jax_cache):
    """lr=1e30 is finite and valid, but the first update throws the params to ~1e30, after which
    every forward pass overflows: steps 2 and 3 are skipped and counted, and with
    trainer.max_consecutive_nonfinite=2 the run stops at step 3 with an error naming the limit."""
    workdir = str(tmp_path / "run")
    rc, log = _run(
        _train_cmd(
            workdir, "--config.actor.optim.lr=1e30", "--config.trainer.max_consecutive_nonfinite=2"
        ),
        workdir + ".log",
        jax_cache,
    )
    assert rc != 0
    assert "2 consecutive steps had non-finite losses or gradients" in log, log[-4000:]
    assert "trainer.max_consecutive_nonfinite=2" in log
    rows = metrics.read(workdir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    rows = rows[1:]  # step 0: eval after the warm-up
    assert [r["actor/update_skipped"] for r in rows] == [0.0, 1.0]
    assert [r["actor/nonfinite_consecutive"] for r in rows] == [0.0, 1.0]


# ------------------------------------------------------------------------------------------
# DISK
# ------------------------------------------------------------------------------------------


def _mount_tmpfs(path: str, options: str) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, check=False
    )
    return r.returncode == 0


def test_unwritable_workdir_fails_up_front(tmp_path, jax_cache):
    """A read-only workdir stops train.py before any model or data work, naming the field."""
    workdir = str(tmp_path / "ro")
    mounted = _mount_tmpfs(workdir, "ro,size=1m")
    if not mounted:
        os.chmod(workdir, 0o555)  # root ignores modes, hence the read-only mount above
    try:
        if not mounted and os.access(workdir, os.W_OK):
            pytest.skip("cannot make a directory unwritable here (root without mount)")
        t0 = time.perf_counter()
        rc, log = _run(_train_cmd(os.path.join(workdir, "run")), str(tmp_path / "log"), jax_cache)
        assert rc != 0
        assert "trainer.default_local_dir" in log and "not writable" in log, log[-3000:]
        assert "model ModelConfig" not in log  # failed before loading data and the model
        assert time.perf_counter() - t0 < 120
    finally:
        if mounted:
            subprocess.run(["umount", workdir], check=True)
        else:
            os.chmod(workdir, 0o755)


def _assert_save_failure_keeps_previous(directory: str, fill_tree, arm=lambda: None) -> str:
    """Saves step 1, arms the fault, fails to save step 2; step 1 must be intact and restorable.

    Returns:
      The error message of the failed save.
    """
    mngr = checkpoint.manager(directory, max_to_keep=1)
    small = {"w": jnp.arange(1024, dtype=jnp.float32)}
    checkpoint.save(mngr, 1, small, {"step": 1})
    arm()
    with pytest.raises(RuntimeError) as err:
        checkpoint.save(mngr, 2, fill_tree, {"step": 2})
    msg = str(err.value)
    assert "step 2" in msg and directory in msg, msg
    # max_to_keep=1 must not have deleted step 1 for the failed step 2.
    assert _complete_steps(os.path.dirname(directory)) == [1]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small)
    step, tree, meta = checkpoint.restore_latest(
        checkpoint.manager(directory, max_to_keep=1), abstract
    )
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(tree["w"], np.arange(1024, dtype=np.float32))
    return msg


def test_disk_full_during_save_tmpfs(tmp_path):
    """A real ENOSPC: a 2 MiB tmpfs holds step 1 but not the 8 MiB step 2."""
    mount = str(tmp_path / "small")
    if not _mount_tmpfs(mount, "size=2m"):
        pytest.skip("needs root to mount a small tmpfs; see the injected variant below")
    try:
        big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(2 * 2**20, np.float32))}
        msg = _assert_save_failure_keeps_previous(os.path.join(mount, "checkpoints"), big)
        assert "No space left on device" in msg or "ENOSPC" in msg or "space" in msg, msg
    finally:
        subprocess.run(["umount", mount], check=True)


def test_disk_full_during_save_injected(tmp_path, monkeypatch):
    """ENOSPC injected where orbax renames the finished temporary directory (data written)."""
    from orbax.checkpoint._src.path import async_path

    async def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    directory = str(tmp_path / "checkpoints")
    msg = _assert_save_failure_keeps_previous(
        directory,
        {"w": jnp.ones(1024, jnp.float32)},
        arm=lambda: monkeypatch.setattr(async_path, "rename", no_space),
    )
    assert os.strerror(errno.ENOSPC) in msg
