"""Orbax checkpoints of a GRPO run: device state plus the host state needed for exact resume.

A checkpoint at training step s holds two items:
  * "state": the `trainer.TrainState` (params, optimizer state, update counter) and the root rng
    key data, restored straight into their shardings (`abstract_with_shardings`).
  * "meta": JSON host state: the training step, the data `Position` (epoch, index) and counters
    (consecutive non-finite updates, finished warm-up steps).

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact, and `max_to_keep` deletes old steps only after a
newer one is finalised. `restore_latest` walks the steps newest-first and falls back to an older
one when the newest cannot be read (reporting why), so a corrupt latest checkpoint costs the
steps since the previous save but never the run. Once an older step restored, the unreadable
newer step directories are renamed to `<step>.unreadable[.k]` (kept for inspection, ignored by
orbax), so the resumed run can save those steps again; when no step restores, nothing is touched
and the error lists every step. A failed save (e.g. a full disk) raises an error naming the step
and directory; older checkpoints are intact because orbax deletes them only after a newer one is
final.
"""

import logging
import os

import jax
import orbax.checkpoint as ocp


def manager(directory: str, *, max_to_keep: int) -> ocp.CheckpointManager:
    """A CheckpointManager for `directory` (created if missing) keeping `max_to_keep` steps."""
    if max_to_keep < 1:
        raise ValueError(f"checkpoint.max_to_keep must be >= 1, got {max_to_keep}")
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_names=("state", "meta")
    )


def save(mngr: ocp.CheckpointManager, step: int, state_tree, meta: dict) -> None:
    """Saves `state_tree` (device pytree) and `meta` (JSON dict) as step `step`, and waits.

    Waiting makes the save durable before the loop goes on, so "steps lost beyond the last save"
    is exactly the steps after it.
    """
    try:
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state_tree), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        mngr.wait_until_finished()
    except Exception as e:
        raise RuntimeError(
            f"saving checkpoint step {step} to {mngr.directory} failed ({e!r}); the previous "
            f"checkpoints {sorted(mngr.all_steps())} are intact. Free disk space (or fix the "
            "directory) and rerun: the run resumes from the newest of them."
        ) from e


def restore_latest(mngr: ocp.CheckpointManager, abstract_state_tree, *, check_meta=None):
    """Restores the newest readable checkpoint.

    Args:
      mngr: from `manager`.
      abstract_state_tree: ShapeDtypeStruct tree (with shardings) of the "state" item.
      check_meta: optional `fn(step, meta)`, called with a step's "meta" item before its state
        is read; it raises (ValueError) when the checkpoint belongs to another run setup (e.g.
        LoRA adapters of another base). That error propagates: the checkpoint is not unreadable,
        nothing is moved.

    Returns:
      (step, state_tree, meta), or None when the directory holds no checkpoint.

    Raises:
      RuntimeError: checkpoints exist but none could be restored (every error is listed).
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
        return None
    errors = []

    def unreadable(step, e):
        logging.error(
            "checkpoint step %d in %s is unreadable (%r); trying an older one",
            step,
            mngr.directory,
            e,
        )
        errors.append((step, f"step {step}: {e!r}"))

    for step in steps:
        if check_meta is not None:
            try:
                meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
                unreadable(step, e)
                continue
            check_meta(step, dict(meta["meta"]))
        try:
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state_tree),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
            unreadable(step, e)
            continue
        # Only once an older step restored: the newer, unreadable ones would block saving their
        # step numbers again. They are renamed, not deleted (a transient read error loses nothing).
        for bad_step, _ in errors:
            logging.error(
                "moved unreadable checkpoint step %d to %s; resuming from step %d",
                bad_step,
                _move_aside(mngr, bad_step),
                step,
            )
        if errors:
            mngr.reload()
        return step, restored["state"], dict(restored["meta"])
    raise RuntimeError(
        f"no readable checkpoint in {mngr.directory}: "
        + "; ".join(msg for _, msg in errors)
        + " (nothing was moved or deleted; set trainer.resume_mode='disable' or "
        "another trainer.default_local_dir to start afresh)"
    )


def _move_aside(mngr: ocp.CheckpointManager, step: int) -> str:
    """Renames step directory `step` to `<step>.unreadable[.k]` (process 0 only); returns it."""
    src = os.path.join(str(mngr.directory), str(step))
    dst = src + ".unreadable"
    k = 0
    while os.path.exists(dst):
        k += 1
        dst = f"{src}.unreadable.{k}"
    if jax.process_index() == 0:
        os.rename(src, dst)
    return dst
