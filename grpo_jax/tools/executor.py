"""Runs tool calls off the caller's thread, concurrently, each bounded by a timeout.

    with ToolExecutor(tools, max_parallel_calls=1, timeout_s=30.0) as runner:
        outcomes = runner.run_calls([(calls_of_row_0, tools_kwargs_0), ...])  # [[Outcome]]

`run_calls` runs one turn's calls of many trajectories at once with verl 0.9.1's ToolAgentLoop
semantics (`_call_tool`): of a trajectory's calls only the first `max_parallel_calls` run (the
rest are dropped: no response, no reward), and each call gets its own instance: `create(
create_kwargs=tools_kwargs[name]["create_kwargs"])`, `execute(instance_id, arguments)`, then
`release(instance_id)` whatever happened. A call of an unknown tool answers verl's "Unknown
function ..." and a tool that raises answers verl's "Error executing tool '<name>': <error>",
both with step reward 0.0. `create`, `execute`, `calc_reward` and `release` run the methods
alone, for callers that keep an instance across turns.

Crash isolation (grpo_jax's; verl awaits tools on its own event loop with no timeout, so one
hung or blocking tool stalls its rollout worker):
  * Every call runs in a worker thread with its own event loop, never on the caller's thread:
    a sync method runs on the worker thread, an async one on its loop, so a tool that blocks
    (an `async def` calling time.sleep, a sync method in a loop) blocks only its worker.
  * `timeout_s` bounds each call (create, execute and release together) from when a worker
    starts it. Past it the call answers a timeout error; its worker is abandoned (asked to
    cancel the call, which frees it when the tool awaits; a blocked one is left running, as a
    daemon thread, counted in `stats()["abandoned_threads"]`) and replaced, so the pool keeps
    its size and nothing waits forever.
  * A tool that raises answers "error"; one that returns something other than verl's shapes
    ((instance_id, ToolResponse) from create, (ToolResponse, reward, metrics) from execute, a
    number from calc_reward) answers "invalid"; a call the model got wrong (hermes parse error,
    unknown tool, arguments failing the schema when validate_arguments) answers "bad_call"
    without reaching the tool. Nothing a tool does makes these methods raise.

Tools run in threads, not interleaved on one loop as in verl: state a tool shares across
calls must be thread-safe, and an asyncio primitive a tool creates once and uses from every
call (an asyncio.Lock in __init__) fails, as it is bound to one loop. State per instance is
fine: create, execute and release of one call run on one worker's loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo_jax.tools import base, hermes

_log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "invalid", "bad_call")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one tool call (or one method) came to.

    Attributes:
      response: what the model sees as the tool's answer (an error text when status != "ok").
      reward: execute's step reward, calc_reward's value; 0.0 when the call failed (verl's), None
        for a call the model wrote malformed (verl drops those) and for create and release.
      status: one of STATUSES.
      metrics: execute's metrics dict ({} otherwise).
      instance_id: create's instance id (None otherwise, or when create failed).
      detail: for a status other than "ok", what went wrong, for the logs.
    """

    response: base.ToolResponse
    reward: float | None
    status: str
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    instance_id: Any = None
    detail: str = ""

    @property
    def text(self) -> str:
        return self.response.text or ""


class _Invalid(Exception):
    """A tool's return value is not of verl's shape."""


@dataclasses.dataclass(eq=False)
class _Job:
    run: Callable[[_Job], Any]  # async; returns the Outcome; may set `partial` before finishing
    on_timeout: Outcome
    started: float | None = None
    done: bool = False
    result: Outcome | None = None
    partial: Outcome | None = None  # execute's outcome while release still runs
    worker: _Worker | None = None


@dataclasses.dataclass(eq=False)
class _Worker:
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task | None = None
    abandoned: bool = False


class ToolExecutor:
    """A pool of tool-call worker threads (see the module docstring).

    Args:
      tools: the tool objects (loading.load_tools / check_tools), unique `name`s.
      max_parallel_calls: calls of one turn that run per trajectory
        (rollout.multi_turn.max_parallel_calls); later ones are dropped, as in verl.
      timeout_s: seconds one call may take (rollout.multi_turn.tool_timeout).
      max_workers: calls running at once over all trajectories; more wait for a worker (their
        timeout starts when one takes them).
      validate_arguments: check the model's arguments against the tool's parameters schema and
        answer a violation without running the tool. Off by default, as verl passes any
        arguments through (the GSM8K tool, for one, accepts a number for its string "answer").
    """

    def __init__(
        self,
        tools: Sequence[Any],
        *,
        max_parallel_calls: int,
        timeout_s: float,
        max_workers: int = 64,
        validate_arguments: bool = False,
    ):
        if max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls={max_parallel_calls} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be >= 1")
        self.tools = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"duplicate tool name {tool.name!r}")
            self.tools[tool.name] = tool
        self.schemas = {name: base.schema_dict(t.tool_schema) for name, t in self.tools.items()}
        self.max_parallel_calls, self.timeout_s = max_parallel_calls, float(timeout_s)
        self.max_workers, self.validate_arguments = max_workers, validate_arguments
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._workers: list[_Worker] = []  # live, not abandoned
        self._abandoned: list[_Worker] = []
        self._idle = 0
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()

    # -----------------------------------------------------------------------------------------
    # Public methods: each runs its requests concurrently and returns one Outcome per request.

    def run_calls(
        self, batch: Sequence[tuple[Sequence[hermes.ToolCall], Mapping[str, Any] | None]]
    ) -> list[list[Outcome]]:
        """One turn's tool calls of many trajectories, as verl's agent loop runs them.

        Args:
          batch: per trajectory, (its parsed calls, its row's tools_kwargs: tool name ->
            {"create_kwargs": {...}}).

        Returns:
          Per trajectory, one Outcome for each of its first max_parallel_calls calls.
        """
        jobs, slots = [], []
        for calls, tools_kwargs in batch:
            row = []
            for call in list(calls)[: self.max_parallel_calls]:
                bad = self._bad_call(call)
                if bad is not None:
                    row.append(bad)
                else:
                    jobs.append(self._call_job(call, tools_kwargs or {}))
                    row.append(jobs[-1])
            slots.append(row)
        self._run(jobs)
        return [[x if isinstance(x, Outcome) else x.result for x in row] for row in slots]

    def create(self, requests: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Outcome]:
        """`tool.create(create_kwargs=...)` per (tool name, create_kwargs); `.instance_id`."""
        return self._methods(requests, self._create_job)

    def execute(self, requests: Sequence[tuple[str, Any, Mapping[str, Any]]]) -> list[Outcome]:
        """`tool.execute(instance_id, arguments)` per (tool name, instance_id, arguments)."""
        return self._methods(requests, self._execute_job)

    def calc_reward(self, requests: Sequence[tuple[str, Any]]) -> list[Outcome]:
        """`tool.calc_reward(instance_id)` per (tool name, instance_id); the value is `.reward`."""
        return self._methods(requests, self._calc_reward_job)

    def release(self, requests: Sequence[tuple[str, Any]]) -> list[Outcome]:
        """`tool.release(instance_id)` per (tool name, instance_id)."""
        return self._methods(requests, self._release_job)

    def stats(self) -> dict[str, int]:
        """Counts since construction: outcomes per status, release failures, and the abandoned
        worker threads still running (blocked tools)."""
        with self._cond:
            alive = sum(w.thread.is_alive() for w in self._abandoned)
            return {**{s: self._counts[s] for s in STATUSES},
                    "release_errors": self._counts["release_errors"],
                    "abandoned_threads": alive}  # fmt: skip

    def close(self) -> None:
        """Stops the idle workers and waits (at most timeout_s in all) for busy ones; abandoned
        threads are daemons and are left to finish or die with the process."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = [w.thread for w in self._workers]
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # The jobs: async functions run on a worker's loop. Each catches everything the tool does.

    def _bad_call(self, call) -> Outcome | None:
        """The answer to a call that must not reach a tool, else None."""
        error = getattr(call, "error", None)
        if error is not None:  # verl drops these calls: no reward
            return self._count(Outcome(base.ToolResponse(text=error), None, "bad_call",
                                       detail=error))  # fmt: skip
        if call.name not in self.tools:
            text = hermes.unknown_tool_message(call.name, list(self.tools))
            return self._count(Outcome(base.ToolResponse(text=text), 0.0, "bad_call", detail=text))
        if self.validate_arguments:
            text = hermes.check_call(call, self.schemas)
            if text is not None:
                return self._count(Outcome(base.ToolResponse(text=text), 0.0, "bad_call",
                                           detail=text))  # fmt: skip
        return None

    def _call_job(self, call, tools_kwargs: Mapping[str, Any]) -> _Job:
        name, tool = call.name, self.tools[call.name]

        async def run(job: _Job) -> Outcome:
            instance_id = None
            try:
                kwargs = tools_kwargs.get(name, {}) or {}
                created = await _maybe_await(tool.create(create_kwargs=kwargs.get("create_kwargs",
                                                                                  {})))  # fmt: skip
                instance_id = _instance_id(created)
                job.partial = _execute_outcome(await _maybe_await(
                    tool.execute(instance_id, call.arguments)))  # fmt: skip
            except BaseException as e:  # noqa: BLE001 - crash isolation: anything the tool does
                job.partial = _failure(name, e)
            finally:
                if instance_id:  # verl releases only what create returned a (truthy) id for
                    try:
                        await _maybe_await(tool.release(instance_id))  # its return is unused
                    except BaseException as e:  # noqa: BLE001
                        self._release_failed(name, e)
            return job.partial

        return _Job(run, self._timeout_outcome(name))

    def _method_job(self, name: str, call, convert, *, rewarded: bool = True) -> _Job:
        """A job awaiting `call()` (one tool method) and turning its result into an Outcome
        with `convert`; a raise or a timeout answers the failure (reward None unless
        `rewarded`: create and release carry none)."""

        def own(outcome: Outcome) -> Outcome:
            return outcome if rewarded else dataclasses.replace(outcome, reward=None)

        async def run(job: _Job) -> Outcome:
            try:
                return convert(await _maybe_await(call()))
            except BaseException as e:  # noqa: BLE001
                return own(_failure(name, e))

        return _Job(run, own(self._timeout_outcome(name)))

    def _create_job(self, name: str, create_kwargs: Mapping[str, Any]) -> _Job:
        tool = self.tools[name]

        def convert(created) -> Outcome:
            instance_id = _instance_id(created)
            return Outcome(_response(created[1]), None, "ok", instance_id=instance_id)

        return self._method_job(name, lambda: tool.create(create_kwargs=create_kwargs), convert,
                                rewarded=False)  # fmt: skip

    def _execute_job(self, name: str, instance_id: Any, arguments: Mapping[str, Any]) -> _Job:
        tool = self.tools[name]
        return self._method_job(name, lambda: tool.execute(instance_id, arguments),
                                _execute_outcome)  # fmt: skip

    def _calc_reward_job(self, name: str, instance_id: Any) -> _Job:
        tool = self.tools[name]
        return self._method_job(
            name, lambda: tool.calc_reward(instance_id),
            lambda r: Outcome(base.ToolResponse(), _reward(r, allow_none=False), "ok"),
        )  # fmt: skip

    def _release_job(self, name: str, instance_id: Any) -> _Job:
        tool = self.tools[name]
        # verl ignores what release returns
        return self._method_job(name, lambda: tool.release(instance_id),
                                lambda _: Outcome(base.ToolResponse(), None, "ok"),
                                rewarded=False)  # fmt: skip

    def _methods(self, requests, make_job) -> list[Outcome]:
        slots = []
        for request in requests:
            if request[0] in self.tools:
                slots.append(make_job(*request))
            else:
                text = hermes.unknown_tool_message(request[0], list(self.tools))
                slots.append(self._count(Outcome(base.ToolResponse(text=text), None, "bad_call",
                                                 detail=text)))  # fmt: skip
        self._run([s for s in slots if isinstance(s, _Job)])
        return [s if isinstance(s, Outcome) else s.result for s in slots]

    def _timeout_outcome(self, name: str) -> Outcome:
        text = f"Error executing tool '{name}': timed out after {self.timeout_s:g} s"
        return Outcome(base.ToolResponse(text=text), 0.0, "timeout", detail=text)

    def _release_failed(self, name: str, e: BaseException) -> None:
        _log.warning("tool %r: release() failed: %s: %s", name, type(e).__name__, e)
        with self._cond:
            self._counts["release_errors"] += 1

    def _count(self, outcome: Outcome) -> Outcome:
        with self._cond:
            self._counts[outcome.status] += 1
        return outcome

    # -----------------------------------------------------------------------------------------
    # The pool.

    def _run(self, jobs: Sequence[_Job]) -> None:
        """Queues `jobs` and returns once each has a result (its own, or a timeout)."""
        if not jobs:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("ToolExecutor is closed")
            self._queue.extend(jobs)
            self._grow()
            self._cond.notify_all()
            while True:
                now, deadlines = time.monotonic(), []
                for job in jobs:
                    if job.done or job.started is None:
                        continue
                    if now >= job.started + self.timeout_s:
                        self._time_out(job)
                    else:
                        deadlines.append(job.started + self.timeout_s)
                if all(job.done for job in jobs):
                    break
                self._cond.wait(min(deadlines) - now if deadlines else None)
            for job in jobs:
                self._counts[job.result.status] += 1
        failed = [job.result for job in jobs if job.result.status != "ok"]
        if failed:  # one line per batch: a broken tool fails every call of a turn
            counts = collections.Counter(o.status for o in failed)
            summary = ", ".join(f"{n} {status}" for status, n in counts.items())
            _log.warning(
                "%d of %d tool calls failed (%s); first: %s",
                len(failed), len(jobs), summary, failed[0].detail,
            )  # fmt: skip

    def _time_out(self, job: _Job) -> None:
        """(Lock held.) Ends a job past its deadline and abandons its worker."""
        job.done = True
        if job.partial is not None:  # executed; only release() is hanging
            job.result = job.partial
            self._counts["release_errors"] += 1
        else:
            job.result = job.on_timeout
        worker = job.worker
        worker.abandoned = True
        self._workers.remove(worker)
        self._abandoned.append(worker)
        try:  # frees the worker if the tool is awaiting; a blocked loop never sees it
            worker.loop.call_soon_threadsafe(worker.task.cancel)
        except RuntimeError:  # the loop has closed: the worker has just finished
            pass
        self._grow()

    def _grow(self) -> None:
        """(Lock held.) Starts workers for the queued jobs the idle ones cannot take."""
        want = min(len(self._queue) - self._idle, self.max_workers - len(self._workers))
        for _ in range(max(0, want)):
            worker = _Worker()
            worker.thread = threading.Thread(target=self._work, args=(worker,), daemon=True,
                                             name="grpo_jax-tool-worker")  # fmt: skip
            self._workers.append(worker)
            self._idle += 1  # counted idle until it takes a job, so _grow does not overshoot
            worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        worker.loop = asyncio.new_event_loop()
        idle = True
        try:
            while True:
                with self._cond:
                    if not idle:
                        self._idle += 1
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    self._idle -= 1
                    idle = False
                    if not self._queue:  # closed
                        return
                    job = self._queue.popleft()
                    job.worker, job.started = worker, time.monotonic()
                    worker.task = worker.loop.create_task(job.run(job))
                    self._cond.notify_all()  # the waiting caller now has a deadline
                try:
                    result = worker.loop.run_until_complete(worker.task)
                except BaseException as e:  # noqa: BLE001 - cancelled after its timeout
                    result = _failure("?", e)
                with self._cond:
                    if not job.done:
                        job.result, job.done = result, True
                        self._cond.notify_all()
                    if worker.abandoned:
                        return
        finally:
            worker.loop.close()


# ---------------------------------------------------------------------------------------------
# Checking what a tool returned against verl's shapes.


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _instance_id(created: Any) -> Any:
    """create()'s (instance_id, ToolResponse) -> instance_id."""
    if not (isinstance(created, (tuple, list)) and len(created) == 2):
        raise _Invalid(f"create() must return (instance_id, ToolResponse), got "
                       f"{_describe(created)}")  # fmt: skip
    return created[0]


def _response(value: Any) -> base.ToolResponse:
    if isinstance(value, base.ToolResponse):
        return value
    if not hasattr(value, "text"):  # duck-typed: another ToolResponse class (verl's own)
        raise _Invalid(f"expected a ToolResponse, got {_describe(value)}")
    try:
        return base.ToolResponse(text=value.text, image=getattr(value, "image", None),
                                 video=getattr(value, "video", None))  # fmt: skip
    except ValueError as e:
        raise _Invalid(f"expected a ToolResponse: {e}") from None


def _reward(value: Any, *, allow_none: bool) -> float | None:
    if value is None and allow_none:  # verl skips a None step reward
        return None
    if not isinstance(value, numbers.Real):
        raise _Invalid(f"the reward must be a number, got {_describe(value)}")
    return float(value)


def _execute_outcome(out: Any) -> Outcome:
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        raise _Invalid(f"execute() must return (ToolResponse, reward, metrics), got "
                       f"{_describe(out)}")  # fmt: skip
    response, reward, metrics = out
    if metrics is not None and not isinstance(metrics, Mapping):
        raise _Invalid(f"execute()'s metrics must be a dict, got {_describe(metrics)}")
    return Outcome(_response(response), _reward(reward, allow_none=True), "ok",
                   dict(metrics or {}))  # fmt: skip


def _failure(name: str, e: BaseException) -> Outcome:
    if isinstance(e, _Invalid):
        text = f"Error executing tool '{name}': it returned an invalid result"
        return Outcome(base.ToolResponse(text=text), 0.0, "invalid", detail=f"{name}: {e}")
    # verl's text for a tool that raised (tool_agent_loop._call_tool)
    text = f"Error executing tool '{name}': {e}"
    return Outcome(base.ToolResponse(text=text), 0.0, "error",
                   detail=f"{name}: {type(e).__name__}: {e}")  # fmt: skip


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
