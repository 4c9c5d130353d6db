"""Experiment trackers (verl's `trainer.logger`): where a run's metric rows and validation
samples go besides workdir/metrics.jsonl, which stays the source of truth.

Backends (verl 0.9.1's names, verl/utils/tracking.py):
  console      every row printed as one line, `step:N - key:value - ...` (verl's LocalLogger);
  tensorboard  workdir/tensorboard (tensorboardX), keys made legal tags (`tensorboard_tag`);
  wandb        Weights & Biases (`pip install grpo_jax[wandb]`): project `trainer.project_name`,
               run name `trainer.experiment_name`, local files in workdir/wandb; metric keys
               as they are; the validation samples as a wandb.Table under `val/generations`;
  mlflow       MLflow (`pip install grpo_jax[mlflow]`): tracking URI from MLFLOW_TRACKING_URI
               (verl's default when unset: sqlite:////tmp/mlruns.db), experiment
               `trainer.project_name`, run name `trainer.experiment_name`; keys mapped by
               `mlflow_key`; the validation samples as table artifacts (mlflow log_table)
               val_generations/step_<step>.json.
W&B and MLflow get the run's config as parameters (flattened dotted keys, `flatten`).

Resume: workdir/trackers.json keeps each backend's run id (W&B, MLflow) and the last step whose
row, and whose validation samples, it was sent (the samples of a step go out before its row).
A resumed run (restored from a checkpoint) continues the same W&B and MLflow runs and counts
what they hold rather than what they were sent (`WandB.held`, `MLflow.held`): a W&B process
killed with SIGKILL loses the steps it logged last (wandb writes its transaction log in 32 KiB
blocks and has no flush; wandb_log.py reads what the logs hold, as `wandb sync` uploads them),
and MLflow may hold the step whose sending the kill interrupted before trackers.json was
written. It first sends what metrics.jsonl holds up to the restored step and a backend lacks
(`Trackers.catch_up`: a kill's losses, or everything for a backend new in this run), then only
rows of later steps: each backend gets each step once, in order. The rows that a resume drops
from metrics.jsonl and recomputes (after the checkpoint, up to the kill) keep the values the
tracker holds from before the kill, and the validation a resume runs under the restored step
(verl) reaches a tracker only when it lacked that step. A fresh run (no checkpoint) starts new
runs.

Failures never cost the run: a backend that cannot start, or raises while logging, is reported
once (logging.warning) and turned off; the run goes on. A backend whose package is missing is a
config error instead (`missing_package`), raised before the run starts.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pprint
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from grpo_jax.trainer import wandb_log

BACKENDS = ("console", "tensorboard", "wandb", "mlflow")
PIP_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # backend -> what pip installs
STATE_FILE = "trackers.json"
# verl's MLflow tracking URI when MLFLOW_TRACKING_URI is unset
VERL_MLFLOW_URI = "sqlite:////tmp/mlruns.db"
MLFLOW_PARAM_LIMIT = 6000  # characters of a parameter value MLflow stores
GENERATION_COLUMNS = ("step", "input", "output", "score")


def parse_backends(value: str | Sequence[str]) -> tuple[str, ...]:
    """trainer.logger as a tuple of names, from any of the forms a command line gives.

    `['console','wandb']` (a Python list, as the config parser gives it), `console,wandb` (one
    comma-separated string) and Hydra's `[console,wandb]` (one string, as verl's scripts write
    it) all give ("console", "wandb"). Order is kept and repeats dropped; names are not checked.
    """
    items = [value] if isinstance(value, str) else list(value)
    names = []
    for item in ",".join(str(i) for i in items).split(","):
        name = item.strip().strip("[]()").strip().strip("'\"").strip()
        if name and name not in names:
            names.append(name)
    return tuple(names)


def missing_package(backend: str) -> str | None:
    """Why `backend` cannot run here (its package does not import), naming what to install;
    None when it can."""
    module = PIP_PACKAGES.get(backend)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as e:
        return (f"needs the {module} package ({e}): pip install {module} (or "
                f"grpo_jax[{backend}])")  # fmt: skip
    return None


def mlflow_key(key: str) -> str:
    """A metric key as MLflow accepts it (alphanumerics, _ - . / space and colon), verl's
    mapping (verl/utils/tracking.py _MlflowLoggingAdapter): "@" becomes "_at_"
    ("val-core/gsm8k/acc/mean@1" -> ".../mean_at_1"), repeated slashes one, anything else "_"."""
    key = re.sub(r"/+", "/", key.replace("@", "_at_"))
    return re.sub(r"[^/\w.\- :]", "_", key)


def tensorboard_tag(key: str) -> str:
    """A metric key as a legal TensorBoard tag ([-/\\w.] only): verl's "val-core/.../mean@4"
    becomes "val-core/.../mean_at_4"; metrics.jsonl keeps the key itself."""
    return re.sub(r"[^-/\w.]", "_", key.replace("@", "_at_"))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"dotted.key": leaf}, tuples as lists (the run's parameters)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = list(value) if isinstance(value, tuple) else value
    return out


class Tracker(Protocol):
    """A backend: `name`, and three calls that may raise (the caller turns it off then)."""

    name: str

    def log(self, step: int, row: Mapping[str, float]) -> None: ...

    def log_generations(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


class Console:
    """verl's console logger: one printed line per row (through tqdm, under its bar)."""

    name = "console"

    def log(self, step, row):
        import tqdm

        parts = [f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in row.items()]
        tqdm.tqdm.write(" - ".join(parts))

    def log_generations(self, step, samples):
        pass  # the loop logs a few samples itself (validation.write_generations)

    def close(self):
        pass


class TensorBoard:
    """Scalars in workdir/tensorboard under `tensorboard_tag` keys."""

    name = "tensorboard"

    def __init__(self, workdir: str):
        import tensorboardX

        self._writer = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

    def log(self, step, row):
        for k, v in row.items():
            self._writer.add_scalar(tensorboard_tag(k), v, step)
        self._writer.flush()

    def log_generations(self, step, samples):
        pass  # verl logs them as text; workdir/val_generations.jsonl has them

    def close(self):
        self._writer.close()


class WandB:
    """A Weights & Biases run: new, or `run_id`'s continued. Each row is committed as it is
    logged (a step's samples go into the same history row, logged just before it)."""

    name = "wandb"

    def __init__(self, *, workdir, project, experiment, params, run_id=None):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=project, name=experiment, config=params, dir=workdir, id=run_id,
            resume="allow" if run_id else None, reinit="create_new",
        )  # fmt: skip
        self.run_id = self._run.id

    def held(self) -> dict[str, int]:
        """The last step whose history row (metrics and samples) the W&B run holds, as
        trackers.json counts: offline, what the transaction logs of the run's earlier launches
        in this directory hold (wandb_log: what `wandb sync` uploads; a killed launch's file
        lacks the steps logged last); online, the step before the one the server resumes the
        run at (run.starting_step). A launch's file is whole once its process has ended
        (wandb's exit handler waits for wandb-core; run.finish() returns before the last block
        is written): a resume in the process that ran the launch before may find it short."""
        run = self._run
        if run.offline:
            logs = [p for p in wandb_log.offline_logs(run.settings.wandb_dir, run.id)
                    if os.path.abspath(p) != os.path.abspath(run.settings.sync_file)]  # fmt: skip
            step = wandb_log.last_step(logs)
        else:
            step = run.starting_step - 1
        return {"last_step": step, "last_generations_step": step}

    def log(self, step, row):
        self._run.log(dict(row), step=step, commit=True)

    def log_generations(self, step, samples):
        table = self._wandb.Table(columns=list(GENERATION_COLUMNS),
                                  data=[[step, s["input"], s["output"], float(s["score"])]
                                        for s in samples])  # fmt: skip
        self._run.log({"val/generations": table}, step=step, commit=False)  # the row commits

    def close(self):
        self._run.finish()


class MLflow:
    """An MLflow run through its client (no global active run): new, or `run_id`'s (or verl's
    MLFLOW_RUN_ID's) continued. Parameters are immutable in MLflow: on a resume those that
    changed keep their first values, with a warning naming them."""

    name = "mlflow"

    def __init__(self, *, project, experiment, params, run_id=None):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI", VERL_MLFLOW_URI))
        run_id = run_id or os.environ.get("MLFLOW_RUN_ID")
        if run_id is None:
            found = self._client.get_experiment_by_name(project)
            experiment_id = found.experiment_id if found else self._client.create_experiment(
                project)  # fmt: skip
            run_id = self._client.create_run(experiment_id, run_name=experiment).info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_params(params)

    def _log_params(self, params):
        from mlflow.entities import Param

        logged = self._client.get_run(self.run_id).data.params
        values = {k: str(v)[:MLFLOW_PARAM_LIMIT] for k, v in params.items()}
        changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
        if changed:
            logging.warning("mlflow: run %s keeps the first values of the parameters %s (MLflow "
                            "cannot change them; config.json has this run's)", self.run_id,
                            changed)  # fmt: skip
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, params=new[i : i + 100])

    def held(self) -> dict[str, int]:
        """The last step of a metric, and of a samples table, the MLflow run holds (-1: none),
        as trackers.json counts: MLflow stores a batch when log_batch returns, so a kill after
        that and before trackers.json is written leaves it a step ahead of the count."""
        keys = self._client.get_run(self.run_id).data.metrics
        steps = [m.step for k in keys for m in self._client.get_metric_history(self.run_id, k)]
        tables = [int(a.path.rsplit("_", 1)[1].removesuffix(".json"))
                  for a in self._client.list_artifacts(self.run_id, "val_generations")]  # fmt: skip
        return {"last_step": max(steps, default=-1),
                "last_generations_step": max(tables, default=-1)}  # fmt: skip

    def log(self, step, row):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in row.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_generations(self, step, samples):
        data = {c: [step if c == "step" else s[c] for s in samples] for c in GENERATION_COLUMNS}
        data["score"] = [float(v) for v in data["score"]]
        self._client.log_table(self.run_id, data=data,
                               artifact_file=f"val_generations/step_{step}.json")  # fmt: skip

    def close(self):
        self._client.set_terminated(self.run_id)


class Trackers:
    """The run's backends, each guarded: the first exception a backend raises is logged as a
    warning and turns it off. A backend other than the console gets each step once, in order:
    a row only of a step after the last row it got, samples only of a step after the last
    samples and row it got (a step's samples go before its row), as counted in `state`
    ({name: {"last_step": ..., "last_generations_step": ...}}), which is kept in
    workdir/trackers.json as rows go out."""

    def __init__(self, backends: Iterable[Tracker] = (), *, workdir: str | None = None,
                 state: Mapping[str, Mapping] | None = None):  # fmt: skip
        self._on = list(backends)
        self._workdir = workdir
        self._state = {name: dict(v) for name, v in (state or {}).items()}

    @property
    def names(self) -> tuple[str, ...]:
        """The backends still on."""
        return tuple(t.name for t in self._on)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """Sends a metrics row (values as floats, non-finite ones too) to every backend on."""
        row = {k: float(v) for k, v in sorted(row.items())}
        self._each("log", step, lambda t: t.log(step, row))

    def log_generations(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Sends one validation's samples (input, output, score) to every backend on."""
        if samples:
            self._each("log_generations", step, lambda t: t.log_generations(step, samples))

    def catch_up(self, rows: Sequence[Mapping[str, Any]],
                 generations: Mapping[int, Sequence[Mapping[str, Any]]]) -> None:
        """On a resume: sends what metrics.jsonl (`rows`, {"step": ..., ...}) and
        val_generations.jsonl (`generations`, {step: samples}) hold and a backend lacks, in step
        order: what a kill lost (the steps W&B had not yet written to disk, a row between its
        line and its sending), or everything for a backend new in this run. The rows of one
        step go as one (an earlier resume's validation row adds the keys the step's first row
        lacks). The console, which shows this process's rows only, gets none of them."""
        console = [t for t in self._on if t.name == "console"]
        self._on = [t for t in self._on if t.name != "console"]
        by_step: dict[int, dict] = {}
        for row in rows:
            merged = by_step.setdefault(row["step"], {})
            merged |= {k: v for k, v in row.items() if k != "step" and k not in merged}
        try:
            for step in sorted(set(by_step) | set(generations)):
                self.log_generations(step, generations.get(step, ()))
                if step in by_step:
                    self.log(step, by_step[step])
        finally:
            self._on = console + self._on

    def close(self) -> None:
        for tracker in list(self._on):
            self._guard(tracker, "close", tracker.close)
        self._on = []

    def _each(self, what: str, step: int, call) -> None:
        key = "last_step" if what == "log" else "last_generations_step"
        changed = False
        for tracker in list(self._on):
            stateless = tracker.name == "console"  # the terminal: every row this process writes
            entry = self._state.get(tracker.name, {})
            # a step's row goes after its samples: samples of a step whose row went are late
            last = entry.get(key, -1) if what == "log" else max(
                entry.get("last_step", -1), entry.get("last_generations_step", -1))  # fmt: skip
            if not stateless and step <= last:
                continue  # the backend has this step (sent before a resume, or a resume's
                # validation under the restored step): W&B would drop it, MLflow keep it twice
            sent = self._guard(tracker, what, lambda tracker=tracker: call(tracker))
            if sent and not stateless:
                self._state.setdefault(tracker.name, {})[key] = step
                changed = True
        if changed and self._workdir is not None:
            write_state(self._workdir, self._state)

    def _guard(self, tracker: Tracker, what: str, call) -> bool:
        try:
            call()
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never costs the run
            logging.warning("%s: %s failed (%s: %s); %s logging is off for the rest of the run "
                            "(metrics.jsonl has every row)", tracker.name, what,
                            type(e).__name__, e, tracker.name)  # fmt: skip
            self._on.remove(tracker)
            if what != "close":
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001, S110 - already reported as off
                    pass
            return False


def read_state(workdir: str) -> dict:
    """workdir/trackers.json: {backend: {"run_id": ..., "last_step": ...,
    "last_generations_step": ...}} (the last step whose row, and whose samples, the backend
    was sent; {} when none)."""
    path = os.path.join(workdir, STATE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_state(workdir: str, state: Mapping) -> None:
    """Replaces workdir/trackers.json atomically."""
    path = os.path.join(workdir, STATE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def start(backends: Sequence[str], *, workdir: str, project: str, experiment: str,
          params: Mapping[str, Any], resume: bool, extra: Sequence[Tracker] = ()) -> Trackers:
    """Starts `backends` (names from BACKENDS) plus `extra` trackers for a run in `workdir`.

    Args:
      backends: trainer.logger's names.
      workdir: the run's directory (trackers.json, tensorboard/, wandb/).
      project, experiment: trainer.project_name / experiment_name.
      params: the run's config, flattened (`flatten`).
      resume: the run continues from a checkpoint: continue the W&B / MLflow runs named in
        trackers.json and skip the steps each backend was sent; else new runs from step 0.
      extra: the caller's own Tracker objects, guarded the same way (and, by name, resumed).

    Raises:
      errors.InputError: a backend is unknown or its package is missing (`missing_package`).
    """
    from grpo_jax import errors

    for name in backends:
        why = f"is not one of {list(BACKENDS)}" if name not in BACKENDS else missing_package(name)
        if why:
            raise errors.InputError(f"trainer.logger has {name!r}, which {why}")
    state = read_state(workdir) if resume else {}
    started: list[Tracker] = []
    for name in backends:
        entry = state.get(name, {})  # trackers.json's: the run id, the steps counted as sent
        tracker, held = None, None
        try:
            match name:
                case "console":
                    tracker = Console()
                case "tensorboard":
                    tracker = TensorBoard(workdir)
                case "wandb":
                    tracker = WandB(workdir=workdir, project=project, experiment=experiment,
                                    params=params, run_id=entry.get("run_id"))  # fmt: skip
                case "mlflow":
                    tracker = MLflow(project=project, experiment=experiment, params=params,
                                     run_id=entry.get("run_id"))  # fmt: skip
            if resume and isinstance(tracker, (WandB, MLflow)):
                held = tracker.held()  # what a kill left it, which trackers.json cannot know
        except Exception as e:  # noqa: BLE001 - a tracker never costs the run
            logging.warning("%s: could not start (%s: %s); the run goes on without it "
                            "(metrics.jsonl has every row)", name, type(e).__name__, e)
            if tracker is not None:
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001, S110 - already reported as off
                    pass
            continue
        started.append(tracker)
        if isinstance(tracker, (WandB, MLflow)):
            state[name] = entry = {**entry, "run_id": tracker.run_id}
        if held is not None:
            counted = {k: entry.get(k, -1) for k in held}
            if held != counted:
                logging.info("%s: run %s holds the rows up to step %d and the samples up to "
                             "step %d (trackers.json counted %d and %d as sent); what it lacks "
                             "is sent again from metrics.jsonl", name, tracker.run_id,
                             held["last_step"], held["last_generations_step"],
                             counted["last_step"], counted["last_generations_step"])  # fmt: skip
            entry |= held
    write_state(workdir, state)
    return Trackers([*started, *extra], workdir=workdir, state=state)
