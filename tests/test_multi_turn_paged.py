"""Multi-turn rollouts in the paged engine (rollout/multi_turn.py over rollout/paged.py): the
rows decode with continuous batching, a row waiting on a tool keeps its KV pages out of its
slot while the others decode, and its tool turn is fed into its pages. The trajectories are
the lockstep rollout's (every turn re-prefilled) and do not depend on the slots, the pool or
when the tools answer."""

import random
import threading
import time

import jax
import numpy as np
import pytest
import whole_context
from test_multi_turn import qwen_tool_tokenizer

from grpo_jax import model, sharding
from grpo_jax.data import prompts
from grpo_jax.rollout import chat_turns, engines, multi_turn
from grpo_jax.tools import base as tool_base
from grpo_jax.tools import executor as tool_executor
from grpo_jax.tools import hermes

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echoes a number.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                       "required": ["n"]},
    },
}  # fmt: skip


class EchoTool(tool_base.BaseTool):
    """Answers its argument; sleeps `delay(n)` seconds first (the answer never depends on it).
    Records when each call ran."""

    def __init__(self, delay):
        super().__init__({}, tool_base.ToolSchema.model_validate(ECHO_SCHEMA))
        self.delay, self.lock, self.spans = delay, threading.Lock(), []

    async def execute(self, instance_id, parameters, **kwargs):
        start = time.monotonic()
        time.sleep(self.delay(int(parameters["n"])))
        with self.lock:
            self.spans.append((start, time.monotonic()))
        return tool_base.ToolResponse(text=f"echo {parameters['n']}"), 0.0, {}


def parse_by_length(text):
    """A turn calls the tool unless its length is a multiple of 3 (the random model writes no
    hermes calls): which turns call, and with what, is a function of the tokens alone."""
    if len(text) % 3 == 0:
        return text, []
    return "", [hermes.ToolCall(name="echo", arguments={"n": len(text)})]


@pytest.fixture(scope="module")
def setup():
    tok = qwen_tool_tokenizer()
    config = model.ModelConfig.tiny(vocab_size=len(tok))
    # Weights scaled up: the random model's greedy turns then vary and end (unscaled, it
    # repeats one token).
    params = jax.tree.map(lambda x: 4.0 * x, model.init_params(config, jax.random.key(3)))
    # A turn ends on <|im_end|> or a lowercase letter or digit, so turns are short (also greedy).
    letters = list("abcdefghijklmnopqrstuvwxyz0123456789")
    eos = (tok.eos_token_id, *tok.convert_tokens_to_ids(letters))
    examples = [prompts.Example(({"role": "user", "content": q},), ground_truth="0")
                for q in ("1+6?", "2+5?", "30+4?")]  # fmt: skip
    ps = prompts.encode(tok, examples, max_prompt_length=128, filter_overlong_prompts=False,
                        truncation="error", chat_template_kwargs=None)  # fmt: skip
    batch = prompts.make_batch(ps, range(len(examples)), pad_token_id=0)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    return tok, config, params, eos, batch, mesh


def _agent(tok, eos, tool, settings):
    turns = chat_turns.ChatTurns(tok, stop_ids=eos)
    runner = tool_executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=30.0)
    return multi_turn.Agent(turns, runner, parse_by_length, settings, pad_id=0)


class Lockstep:
    """The native engine behind the Engine interface only: the agent's lockstep path."""

    def __init__(self, engine):
        self.engine, self.mesh = engine, engine.mesh
        self.eos_ids, self.pad_id = engine.eos_ids, engine.pad_id

    def sample(self, *args, **kwargs):
        return self.engine.sample(*args, **kwargs)


def _run(setup, *, paged, temperature, slots=256, num_pages=None, delay=lambda n: 0.0,
         settings=multi_turn.Settings(max_assistant_turns=4), limit=240, n=2):
    tok, config, params, eos, batch, mesh = setup
    engine = engines.NativeEngine(config, mesh, eos_ids=eos, pad_id=0, max_num_seqs=slots,
                                  num_pages=num_pages)  # fmt: skip
    tool = EchoTool(delay)
    agent = _agent(tok, eos, tool, settings)
    sp = engines.SamplingParams(n, limit, temperature)
    try:
        out = agent.sample(engine if paged else Lockstep(engine), params, batch,
                           jax.random.key(11), sp)
    finally:
        agent.close()
    return out, tool


def _assert_drawn_from_whole_context(setup, out, rng, temperature):
    """Every sampled token of every trajectory is the one its key draws from the logits of a
    full forward pass over the prompt and the response before it (no cache: what re-prefilling
    the conversation gives), with key fold_in(fold_in(rng, row), response position); the
    log-probs are that pass's."""
    tok, config, params, eos, batch, mesh = setup
    r = out.rollout
    n = r.response_ids.shape[0] // batch.prompt_ids_PT.shape[0]
    ids, valid = np.asarray(r.response_ids), np.asarray(r.response_mask)
    loss, lp = np.asarray(r.loss_mask), np.asarray(r.log_probs)
    lengths = valid.sum(1)
    heads = [batch.prompt_ids_PT[b // n][batch.prompt_mask_PT[b // n] == 1]
             for b in range(ids.shape[0])]  # fmt: skip
    logits = whole_context.sequence_logits(
        config, params, [np.concatenate([p, ids[b, :k]]) for b, (p, k) in
                         enumerate(zip(heads, lengths))],
    )  # fmt: skip
    rows, t_S, logits_SV, keys_S = [], [], [], []
    for b, k in enumerate(lengths):  # every sampled token of every row, in one draw
        sampled = np.flatnonzero(loss[b, :k])
        rows += [b] * len(sampled)
        t_S.append(sampled)
        logits_SV.append(logits[b][len(heads[b]) - 1 + sampled])
        keys_S.append(jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(rng, b), sampled))
        assert (lp[b, :k][loss[b, :k] == 0] == 0).all()
    rows, t_S = np.asarray(rows), np.concatenate(t_S)
    want, want_lp = whole_context.select_tokens(
        np.concatenate(logits_SV), jax.numpy.concatenate(keys_S), temperature=temperature,
        top_k=-1, top_p=1.0)  # fmt: skip
    same = np.asarray(want) == ids[rows, t_S]
    assert same.all(), list(zip(rows[~same], t_S[~same]))
    np.testing.assert_allclose(lp[rows, t_S], np.asarray(want_lp), atol=1e-4)


def _fields(out):
    r = out.rollout
    return {f: np.asarray(getattr(r, f)) for f in ("response_ids", "response_mask", "loss_mask",
                                                   "num_turns", "log_probs")}  # fmt: skip


def test_greedy_paged_rollout_is_the_lockstep_rollout(setup):
    """Greedy, the paged engine's trajectories are the lockstep path's (each turn re-prefilled
    from the whole conversation) token for token, with the same tool turns and limits."""
    want, _ = _run(setup, paged=False, temperature=0.0)
    assert want.row_stats["tool_calls"].sum() >= 4 and want.row_stats["assistant_turns"].max() > 2
    for slots in (2, 6):
        got, _ = _run(setup, paged=True, temperature=0.0, slots=slots)
        a, b = _fields(got), _fields(want)
        for f in ("response_ids", "response_mask", "loss_mask", "num_turns"):
            np.testing.assert_array_equal(a[f], b[f], err_msg=f)
        np.testing.assert_allclose(a["log_probs"], b["log_probs"], atol=1e-4)
        for key in want.row_stats:
            np.testing.assert_array_equal(got.row_stats[key], want.row_stats[key], err_msg=key)
        assert [e.extra_info for e in got.examples] == [e.extra_info for e in want.examples]


def test_sampled_rollout_does_not_depend_on_slots_pool_or_tool_timing(setup):
    """Sampled (temperature 1), a trajectory is a function of the rng, its prompt, its sample
    index and the tool outputs: the same with 6, 2 or 1 slots, with a pool small enough that
    waiting rows lose their pages (and recompute them), and whichever tool call answers
    first; each token is drawn from the whole context's logits with its position's key."""
    want, _ = _run(setup, paged=True, temperature=1.0, slots=6)
    stats = want.row_stats
    assert stats["tool_calls"].sum() >= 4 and stats["assistant_turns"].max() > 2
    _assert_drawn_from_whole_context(setup, want, jax.random.key(11), 1.0)

    def slow_odd(n):
        return 0.2 if n % 2 else 0.0

    def slow_even(n):
        return 0.0 if n % 2 else 0.2

    def jitter(n):
        return random.uniform(0, 0.1)

    for slots, num_pages, delay in ((2, None, slow_odd), (2, None, slow_even), (1, None, jitter),
                                    (3, 40, jitter)):  # fmt: skip
        got, _ = _run(setup, paged=True, temperature=1.0, slots=slots, num_pages=num_pages,
                      delay=delay)  # fmt: skip
        a, b = _fields(got), _fields(want)
        for f in ("response_ids", "response_mask", "loss_mask", "num_turns"):
            np.testing.assert_array_equal(a[f], b[f], err_msg=f"{f} {slots} {num_pages}")
        np.testing.assert_allclose(a["log_probs"], b["log_probs"], atol=1e-5)
