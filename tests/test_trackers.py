"""Experiment tracking (trainer.logger, grpo_jax/trainer/trackers.py): verl's names on the
command line, what W&B and MLflow receive, resume into the same runs, and failures that never
cost the run.

W&B runs offline (WANDB_MODE=offline, files in the workdir) and MLflow on a local SQLite store;
both are read back after real `train.py --config=configs/demo.py:tiny` runs. The resume is a
kill's aftermath without the kill: a run of steps 0..2 (a checkpoint after each step), its
step-2 checkpoint deleted, then the command again with 3 steps: it resumes from step 1, redoes
step 2 and adds step 3, as after a kill between step 2's metrics row and its checkpoint. A
real kill too: train.py SIGKILLed as soon as step 3's row appears (a checkpoint after step 2),
then the same command: one W&B and one MLflow run, every step once, the redone step 3 as the
trackers held it after the kill (metrics.jsonl has the redone row: equal but for timings). W&B
is read back as `wandb sync` would upload it: the killed launch's file lacks the steps logged
last (wandb writes it in 32 KiB blocks), which the resume sends again.
W&B and MLflow are test dependencies (scripts/test.sh installs them): under CI=true a missing
one fails these tests instead of skipping them (tests/reference.py).
"""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
import reference
from test_faults import TIMING_KEYS, TIMING_PREFIX

from grpo_jax import config, errors, loading, sharding
from grpo_jax.data import demo_task
from grpo_jax.trainer import loop, metrics, trackers, validation, wandb_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (
    "--config=configs/demo.py:tiny",
    "--config.warmup.steps=0",
    "--config.data.arithmetic.num_val=4",
    "--config.data.val_batch_size=4",
    "--config.data.train_batch_size=4",
    "--config.actor.ppo_mini_batch_size=4",
    "--config.actor.ppo_micro_batch_size_per_gpu=16",
    "--config.rollout.n=4",
    "--config.trainer.test_freq=1",  # a validation (and its samples) at every step
    "--config.trainer.save_freq=1",
    "--config.checkpoint.max_to_keep=3",
    "--config.trainer.log_val_generations=3",
    "--config.trainer.progress_bar=False",
    "--config.model.tiny.hidden_size=32",
    "--config.model.tiny.intermediate_size=64",
    "--config.checkpoint.export_hf=False",
    "--config.trainer.logger=console,wandb,mlflow",  # the comma-separated form
    "--config.trainer.project_name=grpo_jax_tests",
    "--config.trainer.experiment_name=tiny",
)
HINT = "scripts/test.sh installs it (requirements.txt)"
# The tests that run W&B and MLflow themselves (conftest.py counts them in its summary).
WITH_TRACKERS = pytest.mark.reference("trackers")


# ---------------------------------------------------------------------------------------------
# Config: verl's names and list forms, the default, the missing package


def _cli(*overrides):
    """The checked RunConfig train.py builds from these overrides (in-process)."""
    from absl import flags
    from ml_collections import config_flags

    sys.path.insert(0, ROOT)
    import train

    argv = ["train.py", "--config=configs/gsm8k.py:smoke", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                    sys_argv=argv)  # fmt: skip
    fv(argv)
    return train.check_config(fv.config)


def test_logger_takes_verls_list_forms_from_the_command_line():
    assert _cli().trainer.logger == ("console", "tensorboard")
    for form in ("console,mlflow", "['console','mlflow']", "[console,mlflow]", "[console, mlflow]"):
        assert _cli(f"--config.trainer.logger={form}").trainer.logger == ("console", "mlflow")
    run = _cli("--config.trainer.project_name=p", "--config.trainer.experiment_name=e")
    assert (run.trainer.project_name, run.trainer.experiment_name) == ("p", "e")


def test_default_needs_no_tracker_package_and_tensorboard_false_still_turns_it_off():
    t = config.TrainerConfig()
    assert t.logger == ("console", "tensorboard") and t.backends == t.logger
    assert config.TrainerConfig(tensorboard=False).backends == ("console",)
    assert config.TrainerConfig(logger=("wandb",), tensorboard=False).backends == ("wandb",)
    with pytest.raises(config.ConfigError, match=r"'swanlab', not one of \['console'"):
        config.TrainerConfig(logger="console,swanlab")


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_a_config_error_naming_it(monkeypatch, tmp_path, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # `import wandb` raises ImportError
    with pytest.raises(config.ConfigError, match=f"needs the {backend} package .*pip install "
                       f"{backend} \\(or grpo_jax\\[{backend}\\]\\)"):  # fmt: skip
        config.TrainerConfig(logger=("console", backend))
    with pytest.raises(errors.InputError, match=f"pip install {backend}"):
        trackers.start((backend,), workdir=str(tmp_path), project="p", experiment="e",
                       params={}, resume=False)  # fmt: skip


def test_keys_mapped_for_mlflow_and_tensorboard():
    # verl's MLflow mapping: "@" -> "_at_", repeated slashes one, other illegal characters "_"
    key = "val-core/openai/gsm8k/acc/mean@1"
    assert trackers.mlflow_key(key) == "val-core/openai/gsm8k/acc/mean_at_1"
    assert trackers.tensorboard_tag(key) == "val-core/openai/gsm8k/acc/mean_at_1"
    assert trackers.mlflow_key("a//b c:d+e") == "a/b c:d_e"
    assert trackers.flatten({"a": {"b": 1, "c": (1, 2)}, "d": {}}) == {
        "a.b": 1, "a.c": [1, 2], "d": {}}  # fmt: skip


class _Recorder:
    """A tracker that records what it gets."""

    def __init__(self, name):
        self.name, self.rows, self.samples = name, [], []

    def log(self, step, row):
        self.rows.append((step, row))

    def log_generations(self, step, samples):
        self.samples.append((step, list(samples)))

    def close(self):
        pass


def test_a_resume_sends_what_a_tracker_missed_and_no_step_twice(tmp_path):
    # "old" was sent steps 0..1 before a kill; "new" joins in the resumed run.
    workdir = str(tmp_path)
    trackers.write_state(workdir, {"old": {"last_step": 1}})
    old, new = _Recorder("old"), _Recorder("new")
    tracked = trackers.start((), workdir=workdir, project="p", experiment="e", params={},
                             resume=True, extra=[old, new])  # fmt: skip
    rows = [{"step": s, "x": s} for s in range(3)] + [{"step": 2, "val": 1}]
    tracked.catch_up(rows, {0: [{"input": "a"}], 2: [{"input": "b"}]})
    assert old.rows == [(2, {"x": 2.0, "val": 1.0})]  # a step's rows go as one
    assert old.samples == [(2, [{"input": "b"}])]
    assert [s for s, _ in new.rows] == [0, 1, 2] and [s for s, _ in new.samples] == [0, 2]
    tracked.log(1, {"x": 9})  # a redone step: "old" has it already
    tracked.log_generations(2, [{"input": "c"}])  # the resume's validation under step 2
    tracked.log(2, {"val": 2})
    tracked.log(3, {"x": 3})
    assert [s for s, _ in old.rows] == [2, 3] and [s for s, _ in new.rows] == [0, 1, 2, 3]
    assert [s for s, _ in old.samples] == [2] and [s for s, _ in new.samples] == [0, 2]
    assert trackers.read_state(workdir) == {
        "old": {"last_step": 3, "last_generations_step": 2},
        "new": {"last_step": 3, "last_generations_step": 2}}  # fmt: skip
    # killed after step 4's samples went out, before its row did: the resume sends the row
    trackers.write_state(workdir, {"old": {"last_step": 3, "last_generations_step": 4}})
    old = _Recorder("old")
    tracked = trackers.start((), workdir=workdir, project="p", experiment="e", params={},
                             resume=True, extra=[old])  # fmt: skip
    tracked.log_generations(4, [{"input": "c"}])
    tracked.log(4, {"x": 4})
    assert old.rows == [(4, {"x": 4.0})] and old.samples == []
    # a fresh run (no checkpoint) forgets the old runs and steps
    trackers.start((), workdir=workdir, project="p", experiment="e", params={}, resume=False)
    assert trackers.read_state(workdir) == {}


@WITH_TRACKERS
def test_wandb_log_reads_a_cut_file_as_a_prefix(tmp_path, monkeypatch):
    # W&B's own file of a finished offline run, over several 32 KiB blocks (a config record
    # over two of them), then the same file cut anywhere (a kill leaves it cut at a block's
    # end, or inside one mid-write) and with a flipped byte: always a prefix of the records.
    wandb = reference.import_or_require("wandb", "trackers", HINT)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="p", dir=str(tmp_path), mode="offline", reinit="create_new",
                     config={"big": "x" * 70_000})  # fmt: skip
    for step in range(40):
        run.log({f"k{i}": float(step * i) for i in range(50)}, step=step, commit=True)
    run.finish()
    wandb.teardown()  # finish() returns before wandb-core writes the last block; this waits
    (path,) = wandb_log.offline_logs(str(tmp_path / "wandb"), run.id)
    full = list(wandb_log.records(path))
    assert [r.num for r in full] == list(range(1, len(full) + 1))  # wandb numbers each record
    assert [r.history.step.num for r in full if r.WhichOneof("record_type") == "history"] == (
        list(range(40)))  # fmt: skip
    assert wandb_log.last_step([path]) == 39
    data, block = open(path, "rb").read(), wandb_log.BLOCK_BYTES
    assert len(data) > 3 * block
    full = [r.SerializeToString() for r in full]
    cut, counts = tmp_path / "cut.wandb", []
    ends = {*range(7, len(data), 997), len(data)}
    ends |= {b + d for b in range(block, len(data), block) for d in (-1, 0, 1, 7, 8)}
    for end in sorted(ends):
        cut.write_bytes(data[:end])
        got = [r.SerializeToString() for r in wandb_log.records(str(cut))]
        assert got == full[: len(got)], end
        counts.append(len(got))
    assert counts == sorted(counts) and counts[-1] == len(full) and counts[0] == 0
    for at in (100, block + 100, 2 * block + 5):  # a chunk whose checksum fails ends it
        bad = bytearray(data)
        bad[at] ^= 1
        cut.write_bytes(bytes(bad))
        got = [r.SerializeToString() for r in wandb_log.records(str(cut))]
        assert got == full[: len(got)] and len(got) < len(full), at


@WITH_TRACKERS
def test_a_resume_counts_what_wandb_holds_not_what_it_was_sent(tmp_path, monkeypatch):
    # W&B offline got steps 0..5, but its file lost what a kill loses (cut at a block's end):
    # the resume sends the steps the file lacks, and only those, into the next launch's file.
    wandb = reference.import_or_require("wandb", "trackers", HINT)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # wandb reads the environment once a process: again, with these
    workdir = str(tmp_path)
    rows = [{"step": s, **{f"k{i}": float(s + i) for i in range(400)}} for s in range(6)]
    start = dict(workdir=workdir, project="p", experiment="e", params={})
    tracked = trackers.start(("wandb",), resume=False, **start)
    for row in rows:
        tracked.log(row["step"], {k: v for k, v in row.items() if k != "step"})
    tracked.close()
    wandb.teardown()  # the file whole, as when train.py exits
    run_id = trackers.read_state(workdir)["wandb"]["run_id"]
    (first,) = wandb_log.offline_logs(str(tmp_path / "wandb"), run_id)
    data = open(first, "rb").read()
    open(first, "wb").write(data[: len(data) // wandb_log.BLOCK_BYTES * wandb_log.BLOCK_BYTES])
    held = wandb_log.last_step([first])
    assert 0 <= held < 5 and trackers.read_state(workdir)["wandb"]["last_step"] == 5
    time.sleep(1)  # W&B names a launch's directory by its start's second: two, not one
    tracked = trackers.start(("wandb",), resume=True, **start)
    assert trackers.read_state(workdir)["wandb"] == {
        "run_id": run_id, "last_step": held, "last_generations_step": held}  # fmt: skip
    tracked.catch_up(rows, {})
    tracked.log(5, {"k0": -1.0})  # a redone step: W&B has it now
    tracked.close()
    wandb.teardown()
    runs = [_wandb_run(p) for p in wandb_log.offline_logs(str(tmp_path / "wandb"), run_id)]
    assert [sorted(h) for _, _, h in runs] == [list(range(held + 1)), list(range(held + 1, 6))]
    for _, _, history in runs:
        for step, logged in history.items():
            assert logged == {k: v for k, v in rows[step].items() if k != "step"}


@WITH_TRACKERS
def test_a_resume_counts_what_mlflow_holds_not_what_trackers_json_says(tmp_path, monkeypatch):
    # a kill after MLflow stored step 2's row and samples, before trackers.json counted them
    reference.import_or_require("mlflow", "trackers", HINT)
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.create_experiment("p", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    start = dict(workdir=workdir, project="p", experiment="e", params={})
    sample = {"input": "1+1", "output": "2", "score": 1.0}
    tracked = trackers.start(("mlflow",), resume=False, **start)
    for step in range(3):
        tracked.log_generations(step, [sample])
        tracked.log(step, {"x": step})
    tracked.close()
    state = trackers.read_state(workdir)
    run_id = state["mlflow"]["run_id"]
    trackers.write_state(workdir, {"mlflow": {"run_id": run_id, "last_step": 1,
                                              "last_generations_step": 1}})  # fmt: skip
    tracked = trackers.start(("mlflow",), resume=True, **start)
    assert trackers.read_state(workdir)["mlflow"] == state["mlflow"]  # steps 2 and 2
    tracked.catch_up([{"step": s, "x": s} for s in range(3)], {s: [sample] for s in range(3)})
    tracked.log(2, {"x": 9})
    tracked.log(3, {"x": 3})
    tracked.close()
    assert _mlflow_history(client, run_id, "x") == [(s, float(s)) for s in range(4)]


# ---------------------------------------------------------------------------------------------
# W&B offline and MLflow, read back after real runs


def _wandb_run(path):
    """(run id, config, {step: {key: value}}) of one offline run file, as `wandb sync` would
    upload it (wandb_log.records: the records before a chunk a kill cut)."""
    run_id, params, history = None, {}, {}
    for r in wandb_log.records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            params = {i.key: json.loads(i.value_json) for i in r.run.config.update}
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}  # fmt: skip
            history[r.history.step.num] = {k: v for k, v in items.items()
                                           if not k.startswith("_")}  # fmt: skip
    return run_id, params, history


def _train(workdir, env, *extra):
    cmd = [sys.executable, "train.py", *TINY, f"--config.trainer.default_local_dir={workdir}",
           *extra]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _stores(tmp):
    """(the environment of train.py runs logging to W&B offline and to MLflow's SQLite store
    in `tmp`, an MlflowClient of that store)."""
    wandb = reference.import_or_require("wandb", "trackers", HINT)
    mlflow = reference.import_or_require("mlflow", "trackers", HINT)
    reference.VERSIONS["trackers"] = f"wandb {wandb.__version__}, mlflow {mlflow.__version__}"
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)  # artifacts in tmp, not the working directory's ./mlruns
    client.create_experiment("grpo_jax_tests", artifact_location=str(tmp / "artifacts"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "WANDB_MODE": "offline",
           "MLFLOW_TRACKING_URI": uri, "WANDB_SILENT": "true"}  # fmt: skip
    env.pop("MLFLOW_RUN_ID", None)
    return env, client


def _wandb_runs(workdir):
    """_wandb_run of each launch's offline run file, oldest first."""
    return [_wandb_run(f) for f in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*"
                                                         / "*.wandb")))]  # fmt: skip


def _wandb_tables(workdir):
    """{step: rows} of the val/generations tables the history rows of W&B's offline run files
    in `workdir` point to (a table file whose row a kill lost is no table of the W&B run)."""
    tables = {}
    for path in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "*.wandb"))):
        for step, logged in _wandb_run(path)[2].items():
            if "val/generations/path" not in logged:
                continue
            files = os.path.join(os.path.dirname(path), "files")
            table = json.load(open(os.path.join(files, logged["val/generations/path"])))
            assert table["columns"] == ["step", "input", "output", "score"]
            assert table["data"][0][0] == step and step not in tables, f"two tables of {step}"
            tables[step] = table["data"]
    return tables


def _mlflow_tables(client, run_id, dest):
    """{step: rows} of the val_generations/step_<step>.json artifacts of an MLflow run."""
    tables = {}
    for artifact in client.list_artifacts(run_id, "val_generations"):
        table = json.load(open(client.download_artifacts(run_id, artifact.path, str(dest))))
        assert table["columns"] == ["step", "input", "output", "score"]
        tables[int(artifact.path.rsplit("_", 1)[1].removesuffix(".json"))] = table["data"]
    return tables


def _mlflow_history(client, run_id, key):
    """[(step, value)] of a metric (verl's key) in an MLflow run, by step."""
    return sorted((m.step, m.value) for m in client.get_metric_history(
        run_id, trackers.mlflow_key(key)))  # fmt: skip


def _table(step, samples):
    """The generations table rows of one validation's samples (val_generations.jsonl)."""
    return [[step, s["input"], s["output"], s["score"]] for s in samples]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Steps 0..2 logged to W&B (offline) and MLflow (SQLite), then the resume (module
    docstring): (tmp, metrics rows of the first run and of the resumed one, both runs' output,
    the MLflow client)."""
    tmp = tmp_path_factory.mktemp("trackers")
    env, client = _stores(tmp)
    workdir = tmp / "run"
    first = _train(workdir, env, "--config.trainer.total_training_steps=2")
    first_rows = metrics.read(str(workdir))
    shutil.rmtree(workdir / "checkpoints" / "2")
    second = _train(workdir, env, "--config.trainer.total_training_steps=3")
    return tmp, first_rows, metrics.read(str(workdir)), (first, second), client


def _training_rows(rows):
    """{step: row} of the rows the trackers get: a step's first row (a resume's validation
    under an earlier step is metrics.jsonl's only)."""
    out = {}
    for r in rows:
        out.setdefault(r["step"], {k: v for k, v in r.items() if k != "step"})
    return out


@WITH_TRACKERS
def test_resume_keeps_metrics_jsonl_whole(tracked):
    _, first, second, _, _ = tracked
    assert [r["step"] for r in first] == [0, 1, 2]
    # the resume from step 1 validates under step 1 (verl) and redoes step 2
    assert [r["step"] for r in second] == [0, 1, 1, 2, 3]


@WITH_TRACKERS
def test_wandb_gets_every_step_once_in_one_run(tracked):
    tmp, first, second, _, _ = tracked
    state = trackers.read_state(str(tmp / "run"))
    runs = _wandb_runs(tmp / "run")
    assert len(runs) == 2  # one per launch, both of the same run
    assert [r[0] for r in runs] == [state["wandb"]["run_id"]] * 2
    assert [sorted(r[2]) for r in runs] == [[0, 1, 2], [3]]  # no step sent twice
    rows = _training_rows(first) | {3: _training_rows(second)[3]}
    for _, _, history in runs:
        for step, logged in history.items():
            table = {k: logged.pop(k) for k in list(logged) if k.startswith("val/generations")}
            assert logged == rows[step]  # verl's keys ("mean@1" too) and values
            assert table["val/generations/_type"] == "table-file"
            assert table["val/generations/nrows"] == 3 and table["val/generations/ncols"] == 4
    params = runs[0][1]
    assert params["trainer.logger"] == ["console", "wandb", "mlflow"]
    assert params["trainer.total_training_steps"] == 2 and params["rollout.n"] == 4
    assert runs[1][1]["trainer.total_training_steps"] == 3  # W&B takes the resume's config


@WITH_TRACKERS
def test_wandb_generations_tables_are_the_logged_samples(tmp_path, tracked):
    tmp, *_ = tracked
    samples = validation.read_generations(str(tmp / "run"))
    tables = _wandb_tables(tmp / "run")
    assert sorted(tables) == [0, 1, 2, 3]
    # steps 0, 1 and 2 from the first run; the resumed run redid step 2's validation, whose
    # samples val_generations.jsonl now holds (the same policy and seed: the same samples)
    for step, data in tables.items():
        assert data == _table(step, samples[step])


@WITH_TRACKERS
def test_mlflow_gets_every_step_once_with_mapped_keys(tracked):
    tmp, first, second, (run1, run2), client = tracked
    state = trackers.read_state(str(tmp / "run"))
    experiment = client.get_experiment_by_name("grpo_jax_tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.run_name == "tiny"
    assert run.info.status == "FINISHED"
    rows = _training_rows(first) | {3: _training_rows(second)[3]}
    keys = {k for row in rows.values() for k in row}
    assert set(run.data.metrics) == {trackers.mlflow_key(k) for k in keys}
    assert "val-core/arithmetic/acc/mean_at_1" in run.data.metrics
    for key in ("val-core/arithmetic/acc/mean@1", "actor/pg_loss", "critic/score/mean"):
        got = _mlflow_history(client, run.info.run_id, key)
        assert got == sorted((s, r[key]) for s, r in rows.items() if key in r)  # once a step
    assert run.data.params["trainer.logger"] == "['console', 'wandb', 'mlflow']"
    assert run.data.params["trainer.total_training_steps"] == "2"  # MLflow keeps the first
    assert "keeps the first values of the parameters ['trainer.total_training_steps']" in (
        run2.stderr)
    for out in (run1, run2):  # the keys needed no renaming by MLflow or TensorBoard
        assert "sanitized" not in out.stderr and "illegal" not in out.stderr.lower()


@WITH_TRACKERS
def test_mlflow_generations_tables_are_the_logged_samples(tmp_path, tracked):
    tmp, _, _, _, client = tracked
    samples = validation.read_generations(str(tmp / "run"))
    run_id = trackers.read_state(str(tmp / "run"))["mlflow"]["run_id"]
    tables = _mlflow_tables(client, run_id, tmp_path)
    assert sorted(tables) == [0, 1, 2, 3]
    for step, data in tables.items():
        assert data == _table(step, samples[step])


@WITH_TRACKERS
def test_console_prints_verls_lines(tracked):
    _, first, _, (run1, _), _ = tracked
    lines = [ln for ln in run1.stdout.splitlines() if ln.startswith("step:")]
    assert [ln.split(" - ")[0] for ln in lines] == ["step:0", "step:1", "step:2"]
    assert f"critic/score/mean:{first[1]['critic/score/mean']!r}" in lines[1]


# ---------------------------------------------------------------------------------------------
# A real kill: SIGKILL mid-run, the same command again

KILLED = ("--config.trainer.total_training_steps=4", "--config.trainer.save_freq=2")
KILL_AFTER = 3  # SIGKILL as soon as step 3's row is in metrics.jsonl: after the step-2 save


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """train.py (steps 0..4, a checkpoint after steps 2 and 4) SIGKILLed as soon as step 3's
    metrics row appears, then the same command again: it resumes from step 2, validates under
    step 2 (verl), redoes step 3, whose row and samples W&B and MLflow got before the kill, and
    adds step 4. (tmp, metrics rows at the kill and at the end, trackers.json at the kill, the
    last step whose row MLflow held at the kill, the resumed run's output, the MLflow client)."""
    tmp = tmp_path_factory.mktemp("killed")
    env, client = _stores(tmp)
    workdir = tmp / "run"
    cmd = [sys.executable, "train.py", *TINY, f"--config.trainer.default_local_dir={workdir}",
           *KILLED]  # fmt: skip
    with open(tmp / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if any(r["step"] >= KILL_AFTER for r in metrics.read(str(workdir))):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.005)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == -signal.SIGKILL, f"ended (rc {rc}) before the kill: " + open(
        tmp / "killed.log").read()[-4000:]  # fmt: skip
    at_kill, state = metrics.read(str(workdir)), trackers.read_state(str(workdir))
    assert [r["step"] for r in at_kill] == [0, 1, 2, 3], "the kill landed late: step 4 done"
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]  # saves 2 done, 4 not begun
    # MLflow stores a row when log_batch returns: the kill may have come after that and before
    # trackers.json counted it
    mlflow_held = max(s for s, _ in _mlflow_history(client, state["mlflow"]["run_id"],
                                                    "actor/pg_loss"))  # fmt: skip
    resumed = _train(workdir, env, *KILLED)
    assert "resumed from step 2" in resumed.stderr
    return tmp, at_kill, metrics.read(str(workdir)), state, mlflow_held, resumed, client


def _measured(key):
    """A key that measures the machine and the process (tests/test_faults.py), not the run."""
    return key.startswith(TIMING_PREFIX) or key in TIMING_KEYS


@WITH_TRACKERS
def test_a_killed_run_resumes_into_the_same_tracker_runs(killed):
    tmp, at_kill, final, state, _, _, client = killed
    # the killed run had sent step 3's samples, and its row unless the kill came between the
    # row's line and its sending (then the resume sends the redone row)
    assert {name: v["last_generations_step"] for name, v in state.items()} == {
        "wandb": 3, "mlflow": 3}  # fmt: skip
    assert all(v["last_step"] in (2, 3) for v in state.values()), state
    end = trackers.read_state(str(tmp / "run"))
    assert {n: v["run_id"] for n, v in end.items()} == {n: v["run_id"] for n, v in state.items()}
    assert {name: v["last_step"] for name, v in end.items()} == {"wandb": 4, "mlflow": 4}
    # metrics.jsonl, the source of truth: the resume validated under step 2 and redid step 3
    assert [r["step"] for r in final] == [0, 1, 2, 2, 3, 4]
    assert final[:3] == at_kill[:3]
    redone = {k for k, v in final[4].items() if at_kill[3].get(k) != v}
    assert final[4].keys() == at_kill[3].keys() and all(map(_measured, redone)), redone
    wandb_ids = {r[0] for r in _wandb_runs(tmp / "run")}
    assert wandb_ids == {state["wandb"]["run_id"]}
    experiment = client.get_experiment_by_name("grpo_jax_tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.status == "FINISHED"


def _killed_expectation(at_kill, final, last_step):
    """{step: row} a tracker that held the rows up to `last_step` after the kill must hold
    after the resume: metrics.jsonl's rows, but the redone step 3 as the killed run sent it
    when it held it (the steps a resume redoes keep the values the tracker holds from before
    the kill): equal to the redone row but for its timings."""
    return _training_rows(final) | ({3: _training_rows(at_kill)[3]} if last_step >= 3 else {})


@WITH_TRACKERS
def test_a_killed_run_logs_every_step_once_to_wandb(killed):
    tmp, at_kill, final, state, _, resumed, _ = killed
    runs = _wandb_runs(tmp / "run")
    assert len(runs) == 2  # one file per launch, both of the same run
    # the killed launch's file lacks the steps logged last (written in 32 KiB blocks; with
    # wandb 0.31 it holds steps 0 and 1), which the resume sends again: every step once
    held = max(runs[0][2], default=-1)
    want = _killed_expectation(at_kill, final, held)
    if held < state["wandb"]["last_step"]:  # the resume says what it sends again, and why
        assert (f"wandb: run {state['wandb']['run_id']} holds the rows up to step {held} "
                in resumed.stderr)  # fmt: skip
    steps = [step for _, _, history in runs for step in sorted(history)]
    assert steps == [0, 1, 2, 3, 4], steps  # the killed launch's steps, then the rest
    for _, _, history in runs:
        for step, logged in history.items():
            table = {k: logged.pop(k) for k in list(logged) if k.startswith("val/generations")}
            assert logged == want[step], step
            assert table["val/generations/nrows"] == 3
    assert [r[1]["trainer.total_training_steps"] for r in runs] == [4, 4]
    assert [r[1]["trainer.save_freq"] for r in runs] == [2, 2]


@WITH_TRACKERS
def test_a_killed_run_logs_every_generations_table_once_to_wandb(killed):
    tmp, *_ = killed
    samples = validation.read_generations(str(tmp / "run"))
    tables = _wandb_tables(tmp / "run")
    assert sorted(tables) == [0, 1, 2, 3, 4]
    for step, data in tables.items():  # step 3's killed samples equal the redone ones
        assert data == _table(step, samples[step]), step


@WITH_TRACKERS
def test_a_killed_run_logs_every_step_once_to_mlflow(tmp_path, killed):
    tmp, at_kill, final, state, mlflow_held, resumed, client = killed
    run_id = state["mlflow"]["run_id"]
    assert mlflow_held >= state["mlflow"]["last_step"]  # trackers.json never counts ahead
    want = _killed_expectation(at_kill, final, mlflow_held)
    run = client.get_run(run_id)
    assert set(run.data.metrics) == {trackers.mlflow_key(k) for r in want.values() for k in r}
    keys = {k for r in want.values() for k in r}
    for key in sorted(keys):
        got = _mlflow_history(client, run_id, key)
        assert got == [(s, r[key]) for s, r in sorted(want.items()) if key in r], key
    assert run.data.params["trainer.total_training_steps"] == "4"
    assert "keeps the first values" not in resumed.stderr  # the same command: the same config
    samples = validation.read_generations(str(tmp / "run"))
    tables = _mlflow_tables(client, run_id, tmp_path)
    assert sorted(tables) == [0, 1, 2, 3, 4]
    for step, data in tables.items():
        assert data == _table(step, samples[step]), step


# ---------------------------------------------------------------------------------------------
# Failures never cost the run


class _Flaky:
    """A tracker that raises at its `fail_at` step."""

    name = "flaky"

    def __init__(self, fail_at):
        self.fail_at, self.steps, self.closed = fail_at, [], 0

    def log(self, step, row):
        if step == self.fail_at:
            raise ConnectionError("connection lost")
        self.steps.append(step)

    def log_generations(self, step, samples):
        pass

    def close(self):
        self.closed += 1


@WITH_TRACKERS
def test_a_tracker_that_fails_is_reported_once_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                     caplog):  # fmt: skip
    # MLflow cannot start (nothing listens on the port) and a tracker raises at step 2 of 3.
    reference.import_or_require("mlflow", "trackers", HINT)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tok = loading.tokenizer(config.ModelSpec(source="random", tokenizer="char", path=None))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=2, max_prompt_length=16, max_response_length=4,
                               val_batch_size=2),
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4),
        rollout=config.RolloutConfig(n=2, log_prob_micro_batch_size_per_gpu=4),
        reward=config.RewardConfig(num_workers=0),
        trainer=config.TrainerConfig(total_training_steps=3, progress_bar=False,
                                     default_local_dir=str(tmp_path), logger=("mlflow",)),
        checkpoint=config.CheckpointConfig(save_last=False, export_hf=False),
    )  # fmt: skip
    flaky = _Flaky(fail_at=2)
    train_rows, val_rows = demo_task.arithmetic_rows(8, 2, max_operand=9, seed=0)
    with sharding.use_mesh(mesh), caplog.at_level(logging.WARNING):
        model_config, params = loading.model(config.ModelSpec(source="random", tokenizer="char",
                                             path=None), tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=32)  # fmt: skip
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=train_rows, val_data=val_rows, mesh=mesh,
                            reward_fn=lambda solution_str, ground_truth: 0.0,
                            trackers=[flaky])  # fmt: skip
    assert [r["step"] for r in result.history] == [0, 1, 2, 3]
    assert [r["step"] for r in metrics.read(str(tmp_path))] == [0, 1, 2, 3]
    assert flaky.steps == [0, 1] and flaky.closed == 1  # off after step 2's failure
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(w.startswith("mlflow: could not start") for w in warnings) == 1
    assert sum(w.startswith("flaky: log failed (ConnectionError: connection lost)")
               for w in warnings) == 1  # fmt: skip
