"""Worker processes for reward functions, with a per-call timeout.

A reward function is user code: it may hang (a regex that backtracks forever on a strange
completion, a sympy simplification that never ends) or kill its process (a C extension
crashing). `Pool.map` runs each call in one of `num_workers` long-lived processes and waits at
most `timeout_s` for it; a worker that overruns is killed and replaced, one that dies is
replaced, and the call comes back as an `Outcome` with the error, so the trainer decides (per
`reward.on_error`) and never hangs.

Workers are fresh interpreters (`python -m grpo_jax.reward_pool`), never forks of the trainer:
a fork would copy JAX's threads mid-flight, and multiprocessing's spawn re-imports the trainer's
`__main__` (all of JAX) in every worker. They import only this module and what the functions
need. Functions travel by value or reference with cloudpickle, so functions defined in a
notebook or a script's `__main__`, and closures, work; each worker receives a function once and
keeps it. Messages are length-prefixed pickles on the worker's stdin and a duplicate of its
stdout; what the functions print goes to stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

# Unpickling a function imports its module (and everything that imports), once per worker.
LOAD_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One call's result: `value`, or `error` ("... timed out ...", "worker died ...", a traceback).

    `lost` marks a call that timed out or whose worker died: no fault of the function's code.
    """

    value: Any = None
    error: str | None = None
    lost: bool = False


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("reward worker closed its pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


def _serve() -> None:
    """A worker's loop: ("load", key, pickled fn) or ("call", key, args, kwargs) -> (ok, value)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of the reward functions must not corrupt the protocol
    inp = sys.stdin.buffer
    functions: dict[str, Callable] = {}
    while True:
        try:
            kind, key, *payload = _recv(inp)
        except EOFError:
            return
        try:
            if kind == "load":
                functions[key] = cloudpickle.loads(payload[0])
                reply = (True, None)
            else:
                args, kwargs = payload
                reply = (True, functions[key](*args, **kwargs))
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)  # fail here, not later
        except Exception:  # noqa: BLE001 - reported to the trainer with the traceback
            data = pickle.dumps((False, traceback.format_exc(limit=8)))
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()


class _Worker:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "grpo_jax.rewards.pool"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.known: set[str] = set()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


class Pool:
    """`num_workers` reward processes; `map` runs calls with a per-call timeout."""

    def __init__(self, num_workers: int, *, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers} must be >= 1 for a pool")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s
        self._workers = [_Worker() for _ in range(num_workers)]
        self._blobs: dict[int, tuple[str, bytes]] = {}
        self.restarts = 0

    def _blob(self, fn) -> tuple[str, bytes]:
        if id(fn) not in self._blobs:
            blob = cloudpickle.dumps(fn)
            self._blobs[id(fn)] = (hashlib.sha1(blob).hexdigest(), blob)
        return self._blobs[id(fn)]

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker()
        self.restarts += 1

    def map(self, calls: Sequence[tuple[Callable, tuple, dict]]) -> list[Outcome]:
        """Runs every (fn, args, kwargs) call; returns their Outcomes in order.

        A worker that does not hold a call's function first loads it (unpickling imports its
        module), within `LOAD_TIMEOUT_S`; the call's own `timeout_s` starts after that.
        """
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]
        busy: dict[int, list] = {}  # worker -> [call index, deadline, loading]
        with selectors.DefaultSelector() as selector:

            def start(w: int, i: int) -> bool:
                fn, args, kwargs = calls[i]
                key, blob = self._blob(fn)
                worker = self._workers[w]
                loading = key not in worker.known
                message = ("load", key, blob) if loading else ("call", key, args, kwargs)
                try:
                    _send(worker.process.stdin, message)
                except (BrokenPipeError, OSError):  # died between calls: retry on a new one
                    self._replace(w)
                    return False
                limit = LOAD_TIMEOUT_S if loading else self.timeout_s
                busy[w] = [i, time.monotonic() + limit, loading]
                return True

            def finish(w: int, outcome: Outcome, *, replace: bool) -> None:
                outcomes[busy.pop(w)[0]] = outcome
                selector.unregister(self._workers[w].process.stdout)
                if replace:
                    self._replace(w)

            while pending or busy:
                for w in range(len(self._workers)):
                    if w not in busy and pending:
                        i = pending.pop()
                        if start(w, i):
                            selector.register(
                                self._workers[w].process.stdout, selectors.EVENT_READ, w
                            )
                        else:
                            pending.append(i)
                if not busy:
                    continue
                wait_s = max(0.0, min(b[1] for b in busy.values()) - time.monotonic())
                ready = {key.data for key, _ in selector.select(timeout=wait_s)}
                for w in list(busy):
                    i, deadline, loading = busy[w]
                    worker = self._workers[w]
                    if w in ready:
                        try:
                            ok, value = _recv(worker.process.stdout)
                        except (EOFError, OSError, pickle.UnpicklingError):
                            code = worker.process.wait(timeout=10)
                            finish(
                                w,
                                Outcome(error=f"worker died (exit code {code})", lost=True),
                                replace=True,
                            )
                            continue
                        if not ok:
                            finish(w, Outcome(error=value), replace=False)
                        elif loading:  # loaded: now the call itself, with its own timeout
                            worker.known.add(self._blob(calls[i][0])[0])
                            selector.unregister(worker.process.stdout)
                            del busy[w]
                            if start(w, i):
                                selector.register(worker.process.stdout, selectors.EVENT_READ, w)
                            else:
                                pending.append(i)
                        else:
                            finish(w, Outcome(value=value), replace=False)
                    elif time.monotonic() >= deadline:
                        what = "loading the function" if loading else "the call"
                        limit = LOAD_TIMEOUT_S if loading else self.timeout_s
                        finish(
                            w,
                            Outcome(error=f"{what} timed out after {limit:g} s", lost=True),
                            replace=True,
                        )
        return outcomes

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_inline(calls: Sequence[tuple[Callable, tuple, dict]]) -> list[Outcome]:
    """The same calls in this process (reward.num_workers=0: no isolation, no timeout)."""
    out = []
    for fn, args, kwargs in calls:
        try:
            out.append(Outcome(value=fn(*args, **kwargs)))
        except Exception:  # noqa: BLE001 - reported like a worker's error
            out.append(Outcome(error=traceback.format_exc(limit=8)))
    return out


if __name__ == "__main__":
    _serve()
