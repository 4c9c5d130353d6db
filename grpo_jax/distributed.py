"""Multi-process (multi-host) start-up, per-process data shards, and the main-process test.

Owns ``maybe_initialize`` (the one place that calls ``jax.distributed.initialize``), the helpers
that give each process its own slice of the prompts (``process_shard``, ``local_batch_size``),
``to_global`` (assembling per-process host batches into global sharded arrays), ``to_device`` /
``to_host`` (a host array held by every process <-> a global array), ``gather_rows`` /
``gather_objects`` (host arrays and small Python results of every process, in process order),
``share`` / ``process_rows`` (which prompts this process tokenises, and its block of a batch) and
``is_main_process`` (only process 0 writes logs, plots and HF exports).

In a multi-process run each process tokenises its share of the prompts, holds its block of
each step's prompts (``to_global`` makes the global batch), and decodes and scores the
completions of its own prompts; only the reward results and the token ids (which the packed
update reads on every process) are exchanged.

JAX runs one process per host (TPU VM worker, SLURM task, or node); every process executes the
same program over the global mesh, holds only its addressable shards, and feeds only its own part
of the batch. There is no Ray and no home-made cluster: ``jax.distributed.initialize`` connects the
processes, and JAX's own cluster detection (TPU metadata, SLURM, Open MPI) fills in the
coordinator when no explicit address is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from grpo_jax import sharding

_MODES = ("auto", "on", "off")


def multiprocess_env(environ: Mapping[str, str] | None = None) -> str | None:
    """Names the launcher environment that runs several processes, or ``None`` for one process.

    Detected: ``JAX_COORDINATOR_ADDRESS`` (explicit, read by JAX itself), SLURM with more than one
    task (``srun``), Open MPI with more than one rank (``mpirun``), and GKE/multi-host TPU slices
    that list more than one worker in ``TPU_WORKER_HOSTNAMES``. Cloud TPU VM pods started with
    ``gcloud ... ssh --worker=all`` do not always set that variable: use ``mode="on"`` there.
    """
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "jax-env"
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))) > 1:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "openmpi"
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu-pod"
    return None


def maybe_initialize(
    *,
    mode: str = "auto",
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Calls ``jax.distributed.initialize`` when the job runs as several processes.

    Must run before anything touches a JAX backend (``jax.devices()``, array creation).

    Args:
      mode: ``"auto"`` initialises for explicit flags or a detected launcher
        (``multiprocess_env``); ``"on"`` always initialises (Cloud TPU pods, where JAX reads the
        TPU metadata); ``"off"`` never does (a single process).
      coordinator_address: ``host:port`` of process 0; requires ``num_processes`` and
        ``process_id``. Given together they override any detection. Without them, the
        environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
        ``JAX_PROCESS_ID`` play the same role (a plain launcher script sets them per process).
      num_processes: total process count, with ``coordinator_address``.
      process_id: this process's rank in ``[0, num_processes)``, with ``coordinator_address``.

    Returns:
      True if this call initialised the distributed runtime, False if it was not needed (or had
      already been initialised).

    Raises:
      ValueError: for an unknown mode, partial explicit flags, or flags with ``mode="off"``.
    """
    if mode not in _MODES:
        raise ValueError(f"distributed mode {mode!r} must be one of {_MODES}")
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError(
                "coordinator_address, num_processes and process_id must be given together, got "
                f"{coordinator_address!r}, {num_processes!r}, {process_id!r}"
            )
        if mode == "off":
            raise ValueError("explicit coordinator flags contradict mode='off'")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} not in [0, {num_processes})")
    if jax.distributed.is_initialized():
        return False
    if mode == "off":
        return False
    env = os.environ
    if coordinator_address is None and "JAX_NUM_PROCESSES" in env and "JAX_PROCESS_ID" in env:
        # Our launcher convention next to JAX's own JAX_COORDINATOR_ADDRESS (JAX reads only that).
        return maybe_initialize(
            mode=mode,
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    if coordinator_address is not None:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
        return True
    if mode == "on" or multiprocess_env() is not None:
        jax.distributed.initialize()
        return True
    return False


def is_main_process() -> bool:
    """True on process 0, the only one that writes logs, plots, checkpoints' metadata, HF exports."""
    return jax.process_index() == 0


def process_shard(
    items: Sequence[Any], *, process_index: int | None = None, process_count: int | None = None
) -> list[Any]:
    """This process's rows of a dataset: every ``process_count``-th item from ``process_index``.

    Every process gets the same number of rows, so all of them run the same number of steps (a
    process that ran out first would hang the others at the next collective): the tail
    ``len(items) % process_count`` rows are dropped, as ``drop_remainder`` would.
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if not 0 <= index < count:
        raise ValueError(f"process_index {index} not in [0, {count})")
    usable = len(items) - len(items) % count
    return [items[i] for i in range(index, usable, count)]


def local_batch_size(global_batch_size: int, *, process_count: int | None = None) -> int:
    """Rows each process feeds per step; the global batch must split evenly over processes."""
    count = jax.process_count() if process_count is None else process_count
    if global_batch_size % count:
        raise ValueError(f"global batch {global_batch_size} not divisible by {count} processes")
    return global_batch_size // count


def to_global(local_tree: Any, sharding_tree: Any) -> Any:
    """Builds global arrays from each process's host rows (leading axis = this process's part).

    With one process this is a ``device_put``; with several, process p's rows become rows
    ``[p * n, (p + 1) * n)`` of the global array (``jax.make_array_from_process_local_data``).
    """
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
        local_tree,
        sharding_tree,
    )


def gather_rows(x: np.ndarray) -> np.ndarray:
    """Every process's host array, concatenated in process order (all must have one shape)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def gather_objects(items: Sequence[Any]) -> list[Any]:
    """Every process's list of picklable Python values, concatenated in process order.

    For small per-row results (reward scores, an extracted answer string); lists may differ in
    length between processes."""
    if jax.process_count() == 1:
        return list(items)
    import pickle

    blob = np.frombuffer(pickle.dumps(list(items)), np.uint8)
    sizes = gather_rows(np.array([blob.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    blobs = gather_rows(padded[None]).reshape(len(sizes), -1)
    return [v for b, size in zip(blobs, sizes, strict=True) for v in pickle.loads(b[:size].tobytes())]


def share():
    """This process's share of a dataset to tokenise (grpo_jax.data.encode), None for one
    process."""
    if jax.process_count() == 1:
        return None
    from grpo_jax.data import prompts

    return prompts.Share(jax.process_index(), jax.process_count(), gather_rows)


def process_rows(global_rows: int) -> tuple[int, int]:
    """(start, stop): this process's block of a global batch of `global_rows` rows (what
    ``to_global`` and ``to_local`` place on it); the batch must split evenly."""
    local = local_batch_size(global_rows)
    start = jax.process_index() * local
    return start, start + local


def to_device(x: np.ndarray, mesh) -> jax.Array:
    """A host array that every process holds whole -> a global array split over the batch axes.

    `jax.make_array_from_callback` gives each process its own rows, so this is correct on any
    number of processes (for data too big to hold on every host see `to_global`).
    """
    shd = sharding.batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, shd, lambda idx: x[idx])


def to_host(x: jax.Array) -> np.ndarray:
    """A global array -> the whole array on this host (all-gathered across processes)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
