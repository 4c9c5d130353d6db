"""Worker processes for reward functions, with a per-call timeout.

A reward function is user code: it may hang (a regex that backtracks forever on a strange
completion, a sympy simplification that never ends) or kill its process (a C extension
crashing). `Pool` runs each call in one of `num_workers` long-lived processes and waits at
most `timeout_s` for it; a worker that overruns is killed and replaced, one that dies is
replaced, and the call comes back as an `Outcome` with the error, so the trainer decides (per
`reward.on_error`) and never hangs. `Pool.map` runs a list of calls and waits for them all;
`Pool.submit` queues one call and returns at once (`Pool.wait` collects it), which is how a
rollout's rows are scored while the others still decode (rewards/functions.py `Scoring`).

Workers are fresh interpreters (`python -m grpo_jax.reward_pool`), never forks of the trainer:
a fork would copy JAX's threads mid-flight, and multiprocessing's spawn re-imports the trainer's
`__main__` (all of JAX) in every worker. They import only this module and what the functions
need. Functions travel by value or reference with cloudpickle, so functions defined in a
notebook or a script's `__main__`, and closures, work; each worker receives a function once and
keeps it. Messages are length-prefixed pickles on the worker's stdin and a duplicate of its
stdout; what the functions print goes to stderr.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
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
    `done_at` is the `time.perf_counter()` at which the call came back (not compared).
    """

    value: Any = None
    error: str | None = None
    lost: bool = False
    done_at: float | None = dataclasses.field(default=None, compare=False, repr=False)


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
    """`num_workers` reward processes and the thread that feeds them.

    `submit` queues one call and returns at once; `wait` gives the `Outcome`s of submitted calls
    when they are done; `map` is both, for a list of calls. A dispatcher thread (started by the
    first `submit`) hands queued calls to free workers in order, enforces each call's
    `timeout_s` and replaces workers that overrun or die, so calls run while the caller does
    other work (the rows of a rollout that are done score while the others decode). Any thread
    may submit and wait.
    """

    def __init__(self, num_workers: int, *, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers} must be >= 1 for a pool")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s
        self._workers = [_Worker() for _ in range(num_workers)]
        self._blobs: dict[int, tuple[str, bytes]] = {}
        self.restarts = 0
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, tuple]] = collections.deque()  # (ticket, call)
        self._done: dict[int, Outcome] = {}
        self._tickets = itertools.count()
        self._closed, self._failure, self._thread = False, None, None
        # A byte on this pipe wakes the dispatcher from its wait on the workers (a new call).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _blob(self, fn) -> tuple[str, bytes]:
        if id(fn) not in self._blobs:
            blob = cloudpickle.dumps(fn)
            self._blobs[id(fn)] = (hashlib.sha1(blob).hexdigest(), blob)
        return self._blobs[id(fn)]

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker()
        self.restarts += 1

    def submit(self, call: tuple[Callable, tuple, dict]) -> int:
        """Queues the call (fn, args, kwargs); returns its ticket for `wait` at once.

        A worker that does not hold the call's function first loads it (unpickling imports its
        module), within `LOAD_TIMEOUT_S`; the call's own `timeout_s` starts after that.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            ticket = next(self._tickets)
            self._queue.append((ticket, call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name="reward-pool",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        self._wake()
        return ticket

    def wait(self, tickets: Sequence[int]) -> list[Outcome]:
        """The Outcomes of submitted calls, in the order of `tickets`, once all are done."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._failure is not None or all(t in self._done for t in tickets)
            )
            if not all(t in self._done for t in tickets):
                raise RuntimeError("the reward pool stopped") from self._failure
            return [self._done.pop(t) for t in tickets]

    def map(self, calls: Sequence[tuple[Callable, tuple, dict]]) -> list[Outcome]:
        """Runs every (fn, args, kwargs) call; returns their Outcomes in order (see `submit`)."""
        return self.wait([self.submit(call) for call in calls])

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the dispatcher wakes anyway
            pass

    def _dispatch(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - the waiters raise it
            with self._cv:
                self._failure = e
                self._cv.notify_all()

    def _run(self) -> None:
        """The dispatcher: queued calls to free workers, results and timeouts back."""
        busy: dict[int, list] = {}  # worker -> [ticket, call, deadline, loading]
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ, None)

            def start(w: int, ticket: int, call) -> bool:
                fn, args, kwargs = call
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
                busy[w] = [ticket, call, time.monotonic() + limit, loading]
                selector.register(worker.process.stdout, selectors.EVENT_READ, w)
                return True

            def finish(w: int, outcome: Outcome, *, replace: bool) -> None:
                ticket = busy.pop(w)[0]
                selector.unregister(self._workers[w].process.stdout)
                outcome = dataclasses.replace(outcome, done_at=time.perf_counter())
                if replace:
                    self._replace(w)
                with self._cv:
                    self._done[ticket] = outcome
                    self._cv.notify_all()

            while True:
                with self._cv:
                    if self._closed:
                        return
                    free = [w for w in range(len(self._workers)) if w not in busy]
                    todo = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
                retry = [job for w, job in zip(free, todo) if not start(w, *job)]
                if retry:
                    with self._cv:
                        self._queue.extendleft(reversed(retry))
                    continue
                wait_s = None
                if busy:
                    wait_s = max(0.0, min(b[2] for b in busy.values()) - time.monotonic())
                ready = set()
                for key, _ in selector.select(timeout=wait_s):
                    if key.data is None:
                        while True:  # drain the wake-up bytes
                            try:
                                if not os.read(self._wake_r, 4096):
                                    break
                            except BlockingIOError:
                                break
                    else:
                        ready.add(key.data)
                for w in list(busy):
                    ticket, call, deadline, loading = busy[w]
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
                            worker.known.add(self._blob(call[0])[0])
                            selector.unregister(worker.process.stdout)
                            del busy[w]
                            if not start(w, ticket, call):
                                with self._cv:
                                    self._queue.appendleft((ticket, call))
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

    def close(self) -> None:
        """Stops the dispatcher and the workers; calls not done by then never will be."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._failure = self._failure or RuntimeError("the reward pool was closed")
            self._cv.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join()
        for worker in self._workers:
            worker.kill()
        self._workers = []
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_one(call: tuple[Callable, tuple, dict]) -> Outcome:
    """One call in this process, as `run_inline` runs it."""
    fn, args, kwargs = call
    try:
        value = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported like a worker's error
        return Outcome(error=traceback.format_exc(limit=8), done_at=time.perf_counter())
    return Outcome(value=value, done_at=time.perf_counter())


def run_inline(calls: Sequence[tuple[Callable, tuple, dict]]) -> list[Outcome]:
    """The same calls in this process (reward.num_workers=0: no isolation, no timeout)."""
    return [run_one(call) for call in calls]


if __name__ == "__main__":
    _serve()
