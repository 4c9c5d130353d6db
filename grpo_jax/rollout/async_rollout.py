"""Asynchronous rollouts: the next step's batch is sampled while this step updates.

With trainer.async_rollout the loop (grpo_jax/trainer/loop.py) runs one step off-policy, as verl's
one-step-off-policy recipe does:

  step t    take batch t (sampled during step t-1's update by the params of step t-1), sync
            the engine to the params of step t, start sampling batch t+1 with them in the
            background (`Ahead`), then compute old / reference log-probs under the params of
            step t and update with batch t.

So batch t+1 comes from the policy one step before the one it updates: staleness 1 (in loop
steps; the policy-version gap in optimizer steps is ppo_epochs x mini-batches per step). The
engine samples with weights of its own (the vLLM server's, or the native sampler's copy on its
own or the trainer's devices), so the update may overwrite the trainer's params meanwhile.

The old log-probs are the updated policy's (the proximal anchor of the PPO ratio, computed
after the batch arrives), and the engine's log-probs are the behaviour policy's: rollout
correction (algorithm.rollout_correction) weights or rejects samples by their ratio, and
bypass_mode uses the behaviour log-probs as the old ones.

Checkpoints: the loop samples nothing ahead into a step that ends with a checkpoint, so a
checkpoint never has a batch in flight. The step after it samples its batch with the saved
params, in the uninterrupted run and in a resumed one alike: a resumed run repeats the
uninterrupted one exactly, with no sample lost or used twice. Validation waits for the batch in
flight (it uses the same engine).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class StalenessError(RuntimeError):
    """A batch was sampled by a policy more than trainer.max_staleness steps old."""


def check_staleness(sampled_at: int, step: int, max_staleness: int) -> int:
    """The staleness of a batch sampled at loop step `sampled_at` and used at `step`; raises
    StalenessError beyond `max_staleness` (the batch is refused)."""
    staleness = step - sampled_at
    if staleness < 0 or staleness > max_staleness:
        raise StalenessError(
            f"the batch for step {step} was sampled by the params of step {sampled_at}: "
            f"staleness {staleness} is outside [0, trainer.max_staleness={max_staleness}]"
        )
    return staleness


class Ahead:
    """At most one call running in a background thread: the next step's rollout."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-rollout")
        self._future: concurrent.futures.Future | None = None

    @property
    def pending(self) -> bool:
        return self._future is not None

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> None:
        if self._future is not None:
            raise RuntimeError("a rollout is already in flight: take() it first")
        self._future = self._pool.submit(fn, *args, **kwargs)

    def wait(self) -> None:
        """Blocks until the call in flight (if any) has finished; its result stays for take()."""
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def take(self) -> Any:
        """The result of the call in flight (waits for it; re-raises its exception)."""
        if self._future is None:
            raise RuntimeError("no rollout in flight")
        future, self._future = self._future, None
        return future.result()

    def close(self) -> None:
        """Waits for a call in flight (a sampler cannot be interrupted) and drops its result."""
        self.wait()
        self._future = None
        self._pool.shutdown(wait=True)
