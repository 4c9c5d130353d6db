"""Multi-turn rollouts with tool calls (rollout.multi_turn, verl 0.9.1's tool agent loop).

    agent = multi_turn.Agent(turns, tools, settings, unit=dp)
    out = agent.sample(engine, params, prompts, rng, sp)   # out.rollout: a sampler.Rollout

Each of the B = P x n trajectories runs verl's ToolAgentLoop state machine
(verl/experimental/agent_loop/tool_agent_loop.py):
  1. the model samples a turn from the whole context so far (the prompt, rendered with the
     tools' schemas, and every earlier turn);
  2. the turn's tokens are appended as sampled (loss mask 1, the engine's log-probs); the
     trajectory ends when its response reaches data.max_response_length tokens, after
     max_assistant_turns model turns or max_user_turns tool turns, or when the turn holds no
     tool call (the parser, rollout.multi_turn.format, reads the turn's text);
  3. its first max_parallel_calls calls run (`tools.executor`: concurrently, off the decode
     path, with a timeout; a tool that fails, hangs or returns garbage answers with an error
     text), each response cut to max_tool_response_length characters on
     tool_response_truncate_side, and the tool turn's tokens (`chat_turns.ChatTurns`:
     rendered alone, never re-tokenising the model's) are appended with loss mask 0 and
     log-prob 0; if that would reach the response limit the trajectory ends instead, the tool
     turn not appended (verl's order); then back to 1.

Token in, token out: the trainer's sequence of a trajectory (prompt + response) is exactly the
context its last turn was sampled from plus that turn, so the old, reference and policy
log-probs score the tokens the policy produced, with the tool turns as context only
(`Rollout.loss_mask`).

Engines. On the native engine (`engines.NativeEngine`) every trajectory is one row of one
paged-engine call (`rollout.paged.sample_paged` with a turn hook, continuous batching over a
paged KV pool, `max_num_seqs` rows at once): when a row's turn ends (a stop token or the
response limit) the host applies the rules above to its tokens; a row that calls tools leaves
its slot but keeps its KV pages while its calls run on a thread (the executor's timeouts and
crash isolation hold), and the engine meanwhile decodes the other rows and admits waiting ones;
when the calls answer, the tool turn's tokens are fed into the row's own pages (decode steps
that feed, not draw: nothing of the conversation is prefilled again) and it samples its next
turn. Row b's token at response position t (tool turns included in t) is drawn with key
fold_in(fold_in(rng, b), t), so a trajectory depends on the rng, its prompt, its sample index
and the tool outputs, never on slots, the pool or which tool answered first
(tests/test_multi_turn_paged.py: greedy, the lockstep path's rollout token for token; sampled,
the same across slot counts, pool sizes and tool delays).

Any other engine (the vLLM sidecar, which takes and returns token ids), and the native engine
in a run of several JAX processes (whose rows' tool calls end at different times in each process,
while every process must schedule the paged engine alike), runs the turns
in lockstep: each round samples one turn of every unfinished trajectory in one engine call (n =
1 per trajectory, the rows padded to a size of a halving ladder so a run compiles few shapes),
then runs every tool call of the round concurrently, so a trajectory waiting on a slow tool
holds back the next round, and each round prefills every whole context again (vLLM's prefix
cache makes that cheap). A trajectory's keys there are fold_in(rng, round) and its row in the
round's call: a batch's rollout is still a function of its prompts and rng (an exact resume
samples it again). With several processes every process follows every trajectory (the engine's
outputs are gathered to all), but each runs the tool calls of its own rows only (its block of
the prompts, `PromptBatch.rows`), and the outcomes are exchanged before the tool turns are
appended, so all processes build the same trajectories (tests/test_multi_turn.py: two processes
train as one process does through the same lockstep rounds).

Rewards follow verl: the reward function scores the whole response's text (tool turns
included), and a verl-style scorer finds the trajectory's "tool_rewards" (each call's
execute() reward), "turn_scores" ([], verl 0.9.1 has no interaction) and "num_turns" in its
extra_info.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from grpo_jax import distributed, sampler
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rollout import chat_turns, engines

FORMATS = ("hermes",)
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclasses.dataclass(frozen=True)
class Settings:
    """rollout.multi_turn's limits (verl's names and defaults; None = no limit)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"


@dataclasses.dataclass
class _Trajectory:
    context: list[int]  # the prompt and the response so far: what the next turn is sampled from
    tools_kwargs: Mapping[str, Any]
    response: list[int] = dataclasses.field(default_factory=list)
    loss: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    done: bool = False
    cut: str = ""  # why it ended: "answer" (no tool call), "length" or "turns"
    tool_rewards: list[float] = dataclasses.field(default_factory=list)
    statuses: list[str] = dataclasses.field(default_factory=list)  # per tool call
    tool_tokens: int = 0

    def append(self, ids, loss: int, log_probs=None) -> None:
        ids = [int(t) for t in ids]
        self.context += ids
        self.response += ids
        self.loss += [loss] * len(ids)
        self.log_probs += [0.0] * len(ids) if log_probs is None else [float(x) for x in log_probs]


@dataclasses.dataclass(frozen=True)
class AgentRollout:
    """What `Agent.sample` returns.

    Attributes:
      rollout: the B trajectories as a sampler.Rollout (loss_mask and num_turns set).
      examples: the B rows' examples, extra_info with "tool_rewards", "turn_scores" and
        "num_turns" added (what the reward function sees).
      row_stats: per-row arrays for the metrics (`metrics`).
    """

    rollout: sampler.Rollout
    examples: tuple[prompts_lib.Example, ...]
    row_stats: dict[str, np.ndarray]


def metrics(row_stats: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The step's multi-turn metrics from `AgentRollout.row_stats` (of the kept rows)."""
    out = {}
    for key in ("assistant_turns", "tool_calls", "tool_response_tokens"):
        x = np.asarray(row_stats[key], np.float64)
        out |= {f"multi_turn/{key}/mean": float(x.mean()), f"multi_turn/{key}/max": float(x.max())}
    calls = float(np.sum(row_stats["tool_calls"]))
    for key in ("tool_errors", "tool_timeouts"):
        total = float(np.sum(row_stats[key]))
        out[f"multi_turn/{key}"] = total
        out[f"multi_turn/{key}_ratio"] = total / calls if calls else 0.0
    for cut in ("length", "turns"):
        out[f"multi_turn/cut_by_{cut}_ratio"] = float(np.mean(row_stats[f"cut_by_{cut}"]))
    return out


def round_sizes(rows: int, unit: int) -> list[int]:
    """The row counts a round's engine call is padded to: rows, rows / 2, ... down to `unit`
    (each a multiple of it), largest first."""
    sizes = [rows]
    while sizes[-1] % 2 == 0 and (sizes[-1] // 2) % unit == 0 and sizes[-1] // 2 >= unit:
        sizes.append(sizes[-1] // 2)
    return sizes


class Agent:
    """Runs multi-turn rollouts (see the module docstring).

    Args:
      turns: the chat template's tokens between turns.
      runner: a tools.executor.ToolExecutor (the tools, their timeout and concurrency).
      parse: text -> (content, calls) of the format (tools.hermes.parse).
      settings: rollout.multi_turn's limits.
      unit: rows per engine call must be a multiple of this (the engine's data shards).
      pad_id: the padding token.
    """

    def __init__(self, turns: chat_turns.ChatTurns, runner, parse, settings: Settings, *,
                 unit: int = 1, pad_id: int = 0):
        self.turns, self.runner, self.parse, self.settings = turns, runner, parse, settings
        self.unit, self.pad_id = unit, pad_id

    def close(self) -> None:
        """Stops the tool runner (its worker threads)."""
        self.runner.close()

    def sample(
        self,
        engine: engines.Engine,
        params,
        prompts: prompts_lib.PromptBatch,
        rng,
        sp: engines.SamplingParams,
        *,
        policy_version: int | None = None,
    ) -> AgentRollout:
        """sp.n trajectories per prompt of `prompts`, each up to sp.max_new_tokens response
        tokens over all its turns.

        With several JAX processes (`prompts.rows`: this process holds its block of the
        prompts) every process follows every trajectory, but runs only the tool calls of its
        own rows (`_lockstep`)."""
        n, limit = sp.n, sp.max_new_tokens
        ids_PT, mask_PT = prompts.prompt_ids_PT, prompts.prompt_mask_PT
        own = range(len(prompts.examples) * n)  # the rows whose tool calls this process runs
        if prompts.rows is not None:
            if engine.mesh is None:
                raise ValueError(
                    f"rollout engine {type(engine).__name__} samples a whole batch in one "
                    f"process; with {jax.process_count()} JAX processes use rollout.name=jax "
                    "(the native sampler on the global mesh)"
                )
            ids_PT, mask_PT = distributed.gather_rows(ids_PT), distributed.gather_rows(mask_PT)
            own = range(prompts.rows[0] * n, prompts.rows[1] * n)
        trajectories = []
        for p in range(len(prompts.examples)):
            prompt = ids_PT[p][mask_PT[p] == 1].tolist()
            kwargs = dict(prompts.examples[p].extra_info or {}).get("tools_kwargs") or {}
            trajectories += [_Trajectory(list(prompt), kwargs) for _ in range(n)]
        routed = None
        # tool calls end at different times in each process, and every process must schedule
        # the paged engine alike: several processes take the lockstep rounds
        if isinstance(engine, engines.NativeEngine) and prompts.rows is None:
            version, routed = self._paged(engine, params, prompts, rng, sp, trajectories,
                                          policy_version)  # fmt: skip
        else:
            if sp.record_routing:
                raise ValueError(
                    "actor.router_replay.mode='R3' with rollout.multi_turn records the experts "
                    "on the native paged engine in one process only; with several JAX processes "
                    "(or the vLLM sidecar) use actor.router_replay.mode='R2'"
                )
            version = self._lockstep(engine, params, rng, sp, trajectories, policy_version, own)
        return self._collect(trajectories, prompts.examples, ids_PT, mask_PT, n, limit, version,
                             engine, routed)  # fmt: skip

    def _paged(self, engine, params, prompts, rng, sp, trajectories, policy_version):
        """Every trajectory a row of one paged-engine call (continuous batching): a row whose
        turn calls tools waits out of its slot, with its KV pages, while the others decode;
        the tool turn's tokens are then appended and fed into its pages. Returns the weights
        version and, with sp.record_routing, the experts of every token (Rollout.routed_experts
        over the prompts' columns: the engine's bucket cut to them, all left padding)."""
        limit = sp.max_new_tokens
        workers = min(len(trajectories), self.runner.max_workers)
        with concurrent.futures.ThreadPoolExecutor(workers, "grpo_jax-tool-turn") as pool:
            hook = _Turns(self, trajectories, limit, pool)
            out = engine.sample(params, prompts.prompt_ids_PT, prompts.prompt_mask_PT, rng, sp,
                                policy_version, turns=hook)  # fmt: skip
        ids = distributed.to_host(out.response_ids)
        valid = distributed.to_host(out.response_mask)
        lp = distributed.to_host(out.log_probs)
        for b, t in enumerate(trajectories):
            k = len(t.response)
            if not t.done or int(valid[b].sum()) != k or ids[b, :k].tolist() != t.response:
                raise RuntimeError(
                    f"the paged engine's row {b} is not the trajectory its turns built "
                    f"({int(valid[b].sum())} tokens vs {k}, done={t.done})"
                )
            t.log_probs = [float(x) for x in lp[b, :k]]  # the appended turns' are 0
        routed = out.routed_experts
        if routed is not None:
            routed = routed[:, :, routed.shape[2] - limit - prompts.prompt_ids_PT.shape[1]:]
        return out.weights_version, routed

    def _lockstep(self, engine, params, rng, sp, trajectories, policy_version, own):
        """One engine call per round for every unfinished trajectory, each prefilling its
        whole context (the vLLM sidecar's path, and several processes'); this process runs the
        tool calls of the rows in `own`. Returns the weights version."""
        limit = sp.max_new_tokens
        sizes = round_sizes(len(trajectories), self.unit)
        turn_sp = dataclasses.replace(sp, n=1)
        version = None
        for turn in itertools.count():
            active = [b for b, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            size = min(s for s in sizes if s >= len(active))
            rows = active + [active[-1]] * (size - len(active))
            ids, mask = _left_pad([trajectories[b].context for b in rows], self.pad_id)
            out = engine.sample(params, ids, mask, jax.random.fold_in(rng, turn), turn_sp,
                                policy_version)
            version = out.weights_version
            new_ids = distributed.to_host(out.response_ids)
            new_mask = distributed.to_host(out.response_mask)
            new_lp = distributed.to_host(out.log_probs)
            calls_of = []
            for j, b in enumerate(active):
                t = trajectories[b]
                k = min(int(new_mask[j].sum()), limit - len(t.response))
                t.append(new_ids[j, :k], 1, new_lp[j, :k])
                t.assistant_turns += 1
                calls = self._next_calls(t, new_ids[j, :k], limit)
                if calls:
                    calls_of.append((b, calls))
            self._run_tools(trajectories, calls_of, limit, own)
        return version

    def _next_calls(self, t: _Trajectory, turn_ids, limit: int):
        """The tool calls a finished turn asks for, or None when the trajectory ends here
        (verl's checks, in its order)."""
        s = self.settings
        if len(t.response) >= limit:
            t.done, t.cut = True, "length"
        elif s.max_assistant_turns and t.assistant_turns >= s.max_assistant_turns:
            t.done, t.cut = True, "turns"
        elif s.max_user_turns and t.user_turns >= s.max_user_turns:
            t.done, t.cut = True, "turns"
        if t.done:
            return None
        text = self.turns.tokenizer.decode([int(x) for x in turn_ids], skip_special_tokens=False)
        _, calls = self.parse(text)
        if not calls:
            t.done, t.cut = True, "answer"
            return None
        return list(calls)[: s.max_parallel_calls]

    def _run_tools(self, trajectories, calls_of, limit: int, own: range) -> None:
        """Runs a round's calls (`calls_of`: (row, calls), all trajectories' at once) and
        appends the tool turns. Only the rows in `own` run here; with several processes each
        runs its own and every process gets every row's outcomes (gathered in row order)."""
        if not calls_of:
            return
        mine = [(b, calls) for b, calls in calls_of if b in own]
        results = self.runner.run_calls([(calls, trajectories[b].tools_kwargs)
                                         for b, calls in mine])  # fmt: skip
        outcomes = dict(zip([b for b, _ in mine], results, strict=True))
        if len(own) < len(trajectories):  # several processes (the same branch on all)
            outcomes = dict(distributed.gather_objects(list(outcomes.items())))
        for b, calls in calls_of:
            self._tool_turn(trajectories[b], calls, outcomes[b], limit)

    def _tool_turn(self, t: _Trajectory, calls, outcomes, limit: int) -> list[int] | None:
        """Records a turn's tool outcomes and appends the tool turn's tokens (returned), or
        ends the trajectory (None) when they would reach the response limit."""
        s = self.settings
        texts = [
            chat_turns.truncate_text(o.text or "", s.max_tool_response_length,
                                     s.tool_response_truncate_side)
            for o in outcomes
        ]
        t.statuses += [o.status for o in outcomes]
        t.tool_rewards += [float(o.reward) for o in outcomes if o.reward is not None]
        delta = self.turns.boundary(t.context[-1] if t.context else None)
        delta += self.turns.tool_tokens(
            [{"name": c.name, "arguments": c.arguments} for c in calls], texts
        )
        if len(t.response) + len(delta) >= limit:
            t.done, t.cut = True, "length"
            return None
        t.append(delta, 0)
        t.tool_tokens += len(delta)
        t.user_turns += 1
        return delta

    def _collect(self, trajectories, examples, ids_PT, mask_PT, n, limit, version, engine,
                 routed=None) -> AgentRollout:  # fmt: skip
        B = len(trajectories)
        ids = np.full((B, limit), self.pad_id, np.int32)
        valid = np.zeros((B, limit), np.int32)
        loss = np.zeros((B, limit), np.int32)
        lp = np.zeros((B, limit), np.float32)
        for b, t in enumerate(trajectories):
            k = len(t.response)
            ids[b, :k], valid[b, :k], loss[b, :k], lp[b, :k] = t.response, 1, t.loss, t.log_probs
        turns = np.array([t.assistant_turns + t.user_turns + 1 for t in trajectories], np.int32)
        mesh = engine.mesh

        def put(x):
            return jax.numpy.asarray(x) if mesh is None else distributed.to_device(x, mesh)

        P = len(examples)
        rollout = sampler.Rollout(
            prompt_ids=put(np.repeat(ids_PT, n, 0).astype(np.int32)),
            prompt_mask=put(np.repeat(mask_PT, n, 0).astype(np.int32)),
            response_ids=put(ids),
            response_mask=put(valid),
            log_probs=put(lp),
            group_ids=put(np.repeat(np.arange(P, dtype=np.int32), n)),
            weights_version=jax.numpy.asarray(0 if version is None else version, jax.numpy.int32),
            loss_mask=put(loss),
            num_turns=put(turns),
            routed_experts=routed,
        )
        row_examples = tuple(
            dataclasses.replace(
                examples[b // n],
                extra_info={
                    **dict(examples[b // n].extra_info or {}),
                    "tool_rewards": list(t.tool_rewards),
                    "turn_scores": [],
                    "num_turns": int(turns[b]),
                },
            )
            for b, t in enumerate(trajectories)
        )
        row_stats = {
            "assistant_turns": np.array([t.assistant_turns for t in trajectories]),
            "tool_calls": np.array([len(t.statuses) for t in trajectories]),
            "tool_errors": np.array([sum(s not in ("ok", "timeout") for s in t.statuses)
                                     for t in trajectories]),
            "tool_timeouts": np.array([t.statuses.count("timeout") for t in trajectories]),
            "tool_response_tokens": np.array([t.tool_tokens for t in trajectories]),
            "cut_by_length": np.array([t.cut == "length" for t in trajectories]),
            "cut_by_turns": np.array([t.cut == "turns" for t in trajectories]),
        }
        return AgentRollout(rollout, row_examples, row_stats)


class _Turns:
    """The paged engine's turn hook (`rollout.paged.Turns`) over an Agent's trajectories: a
    stopped row's new tokens are its turn; its tool calls run on `pool` (each row's through the
    agent's ToolExecutor, so with its timeouts and crash isolation), and their tool turn is
    what the row appends."""

    def __init__(self, agent: Agent, trajectories, limit: int, pool):
        self.agent, self.trajectories, self.limit, self.pool = agent, trajectories, limit, pool
        self.calls: dict[int, list] = {}

    def ended(self, row: int, response_ids) -> concurrent.futures.Future | None:
        t = self.trajectories[row]
        turn = [int(x) for x in response_ids[len(t.response) :]]
        t.append(turn, 1)  # log-probs: the engine's, read after the call
        t.assistant_turns += 1
        calls = self.agent._next_calls(t, turn, self.limit)
        if not calls:
            return None
        self.calls[row] = calls
        return self.pool.submit(self.agent.runner.run_calls, [(calls, t.tools_kwargs)])

    def resume(self, row: int, result) -> list[int] | None:
        (outcomes,) = result
        return self.agent._tool_turn(self.trajectories[row], self.calls.pop(row), outcomes,
                                     self.limit)  # fmt: skip


def _left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return ids, mask
