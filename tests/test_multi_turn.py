"""Multi-turn rollouts with tools (rollout/multi_turn.py, rollout/chat_turns.py): token in,
token out, the loss mask, verl's termination rules, and the trainer on such rollouts."""

import json
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tools import SCHEMA  # calc(answer: string)

from grpo_jax import config, distributed, sampler
from grpo_jax.data import demo_task, prompts
from grpo_jax.rollout import chat_turns, engines, multi_turn
from grpo_jax.tools import base as tool_base
from grpo_jax.tools import executor as tool_executor
from grpo_jax.tools import hermes

HERE = os.path.dirname(__file__)


def qwen_tool_tokenizer():
    """The character tokenizer with ChatML specials and Qwen2.5's real tool chat template."""
    tok = demo_task.char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    with open(os.path.join(HERE, "fixtures", "qwen2_5_chat_template.jinja")) as f:
        tok.chat_template = f.read()
    tok.eos_token = "<|im_end|>"
    return tok


class CalcTool(tool_base.BaseTool):
    """verl's interface: scores the answer against the ground truth given at create time."""

    async def create(self, instance_id=None, **kwargs):
        self.truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        return await super().create(instance_id)

    async def execute(self, instance_id, parameters, **kwargs):
        ok = str(parameters.get("answer")) == str(self.truth)
        return tool_base.ToolResponse(text=f"answer {parameters.get('answer')}: "
                                      f"{'right' if ok else 'wrong'}"), float(ok), {}


class ScriptedEngine:
    """An engine whose turns are scripted from the context's text: a call while the context
    holds fewer than `calls` tool responses, then a plain answer. Log-probs are -(t + 1) / 100
    so each sampled token's is known."""

    mesh = None
    pad_id = 0

    def __init__(self, tok, calls=1, answer="7", call_text=None):
        self.tok, self.calls, self.answer = tok, calls, answer
        self.call_text = call_text or ('<tool_call>\n{"name": "calc", "arguments": '
                                       '{"answer": "ANSWER"}}\n</tool_call><|im_end|>')
        self.eos_ids = (tok.eos_token_id,)
        self.contexts = []  # every row's context, every call

    def sample(self, params, ids, mask, rng, sp, policy_version=None):
        ids, mask = np.asarray(ids), np.asarray(mask)
        R = sp.max_new_tokens
        out = np.zeros((len(ids), R), np.int32)
        out_mask = np.zeros((len(ids), R), np.int32)
        for b in range(len(ids)):
            context = ids[b][mask[b] == 1].tolist()
            self.contexts.append(context)
            text = self.tok.decode(context)
            if text.count("<tool_response>") < self.calls:
                turn = self.call_text.replace("ANSWER", self.answer)
            else:
                turn = f"It is {self.answer}.<|im_end|>"
            new = self.tok(turn, add_special_tokens=False)["input_ids"][:R]
            out[b, : len(new)], out_mask[b, : len(new)] = new, 1
        lp = -(np.arange(R, dtype=np.float32)[None] + 1) / 100 * out_mask
        return sampler.Rollout(
            prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(mask),
            response_ids=jnp.asarray(out), response_mask=jnp.asarray(out_mask),
            log_probs=jnp.asarray(lp), group_ids=jnp.arange(len(ids)),
            weights_version=jnp.asarray(0),
        )  # fmt: skip


def _agent(tok, *, settings=multi_turn.Settings(), tools=None, timeout=2.0):
    tools = tools or [CalcTool({}, tool_base.ToolSchema.model_validate(SCHEMA))]
    turns = chat_turns.ChatTurns(tok, tools=[SCHEMA], stop_ids=[tok.eos_token_id])
    runner = tool_executor.ToolExecutor(
        tools, max_parallel_calls=settings.max_parallel_calls, timeout_s=timeout,
        validate_arguments=True,
    )
    return multi_turn.Agent(turns, runner, hermes.parse, settings, pad_id=0)


def _prompts(tok, questions=("1+6?", "2+5?"), truth="7"):
    examples = [
        prompts.Example(
            ({"role": "user", "content": q},), ground_truth=truth,
            extra_info={"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": truth}}}},
        )
        for q in questions
    ]  # fmt: skip
    ps = prompts.encode(tok, examples, max_prompt_length=4096, filter_overlong_prompts=False,
                        truncation="error", chat_template_kwargs={"tools": [SCHEMA]})  # fmt: skip
    return prompts.make_batch(ps, range(len(examples)), pad_token_id=0)


def _sample(agent, engine, batch, *, n=2, limit=400):
    sp = engines.SamplingParams(n, limit, 1.0)
    return agent.sample(engine, None, batch, jax.random.key(0), sp)


def test_trajectory_is_the_sampled_tokens_and_the_tool_turns_between():
    tok = qwen_tool_tokenizer()
    engine, agent = ScriptedEngine(tok, calls=2), _agent(tok)
    batch = _prompts(tok)
    out = _sample(agent, engine, batch)
    r = out.rollout
    ids, valid = np.asarray(r.response_ids), np.asarray(r.response_mask)
    loss, lp = np.asarray(r.loss_mask), np.asarray(r.log_probs)
    for b in range(4):
        k = int(valid[b].sum())
        assert valid[b, :k].all() and not valid[b, k:].any()  # a prefix
        prompt = batch.prompt_ids_PT[b // 2][batch.prompt_mask_PT[b // 2] == 1].tolist()
        # The last turn was sampled from the prompt and everything before it, token for token:
        # the trainer's sequence is exactly what the model saw plus its last turn.
        last_turn = tok("It is 7.<|im_end|>", add_special_tokens=False)["input_ids"]
        assert prompt + ids[b, :k].tolist() == engine.contexts[-4 + b] + last_turn
        # The sampled tokens are under the loss mask with their log-probs; the rest is context.
        runs = np.split(np.arange(k), np.flatnonzero(np.diff(loss[b, :k])) + 1)
        sampled = [seg for seg in runs if loss[b, seg[0]]]
        assert len(sampled) == 3  # two calls and the answer
        for seg in sampled:
            np.testing.assert_allclose(lp[b, seg], -(np.arange(len(seg)) + 1) / 100, rtol=1e-6)
        tool_text = tok.decode(ids[b, :k][loss[b, :k] == 0])
        assert tool_text.count("<tool_response>\nanswer 7: right\n</tool_response>") == 2
        assert (lp[b][loss[b] == 0] == 0).all()
    assert np.asarray(r.num_turns).tolist() == [6] * 4  # 3 model turns + 2 tool turns + 1
    assert [ex.extra_info["tool_rewards"] for ex in out.examples] == [[1.0, 1.0]] * 4
    assert out.row_stats["tool_calls"].tolist() == [2] * 4


def test_model_tokens_are_never_retokenised():
    """A turn whose text the template would render differently (spacing of the call's JSON)
    stays as sampled; re-templating the conversation would have changed its tokens."""
    tok = qwen_tool_tokenizer()
    odd = '<tool_call>{"name":"calc","arguments":{"answer":"ANSWER"}}</tool_call><|im_end|>'
    engine, agent = ScriptedEngine(tok, calls=1, call_text=odd), _agent(tok)
    out = _sample(agent, engine, _prompts(tok, questions=("1+6?",)), n=1)
    ids = np.asarray(out.rollout.response_ids)[0]
    first = tok(odd.replace("ANSWER", "7"), add_special_tokens=False)["input_ids"]
    assert ids[: len(first)].tolist() == first
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "1+6?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "calc", "arguments": {"answer": "7"}}}]}],
        tools=[SCHEMA], tokenize=False,
    )  # fmt: skip
    assert tok.decode(first) not in rendered  # the template's own render differs


def test_limits_end_trajectories_as_verl():
    tok = qwen_tool_tokenizer()
    batch = _prompts(tok, questions=("1+6?",))
    # max_assistant_turns: the turn that reaches it ends the trajectory, its call not run
    agent = _agent(tok, settings=multi_turn.Settings(max_assistant_turns=2))
    out = _sample(agent, ScriptedEngine(tok, calls=5), batch, n=1)
    assert int(out.rollout.num_turns[0]) == 2 + 1 + 1
    assert out.row_stats["cut_by_turns"].tolist() == [True]
    # max_user_turns
    agent = _agent(tok, settings=multi_turn.Settings(max_user_turns=1))
    out = _sample(agent, ScriptedEngine(tok, calls=5), batch, n=1)
    assert int(out.rollout.num_turns[0]) == 2 + 1 + 1
    # the response limit: a tool turn that would reach it is not appended
    engine = ScriptedEngine(tok, calls=5)
    first = len(tok(engine.call_text.replace("ANSWER", "7"), add_special_tokens=False)["input_ids"])
    out = _sample(_agent(tok), engine, batch, n=1, limit=first + 10)
    r = out.rollout
    assert int(np.asarray(r.response_mask).sum()) == first
    assert np.asarray(r.loss_mask)[0, :first].all()
    assert out.row_stats["cut_by_length"].tolist() == [True]
    # a turn cut by the limit mid-way is kept as sampled, up to the limit
    out = _sample(_agent(tok), ScriptedEngine(tok, calls=5), batch, n=1, limit=9)
    assert int(np.asarray(out.rollout.response_mask).sum()) == 9


def test_bad_calls_answer_the_model_and_are_counted():
    tok = qwen_tool_tokenizer()
    batch = _prompts(tok, questions=("1+6?",))
    for text, expect in [
        ('<tool_call>{"name": "calc", "arguments": {"answer": 7</tool_call><|im_end|>', "json"),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call><|im_end|>', "nope"),
        ('<tool_call>{"name": "calc", "arguments": {"answer": 7}}</tool_call><|im_end|>',
         "answer"),
    ]:
        engine = ScriptedEngine(tok, calls=1, call_text=text)
        out = _sample(_agent(tok), engine, batch, n=1)
        ids, loss = np.asarray(out.rollout.response_ids)[0], np.asarray(out.rollout.loss_mask)[0]
        k = int(np.asarray(out.rollout.response_mask)[0].sum())
        feedback = tok.decode(ids[:k][loss[:k] == 0]).lower()
        assert expect in feedback, feedback
        assert out.row_stats["tool_errors"].tolist() == [1]


def test_round_sizes_halve_down_to_the_unit():
    assert multi_turn.round_sizes(16, 1) == [16, 8, 4, 2, 1]
    assert multi_turn.round_sizes(16, 4) == [16, 8, 4]
    assert multi_turn.round_sizes(12, 4) == [12]
    assert multi_turn.round_sizes(24, 2) == [24, 12, 6]


def test_config_checks_name_the_field():
    with pytest.raises(config.ConfigError, match="rollout.multi_turn.max_assistant_turns"):
        config.MultiTurnConfig(max_assistant_turns=0)
    with pytest.raises(config.ConfigError, match="rollout.multi_turn.format"):
        config.MultiTurnConfig(format="llama3_json")
    with pytest.raises(config.ConfigError, match="interaction_config_path"):
        config.MultiTurnConfig(interaction_config_path="x.yaml")


def test_a_template_that_rewrites_history_is_refused():
    tok = qwen_tool_tokenizer()
    # renders only the last two messages: the earlier turns change as the chat grows
    tok.chat_template = (
        "{%- for m in messages[-2:] %}{{- '<|im_start|>' + m['role'] + '\\n' + "
        "(m['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    turns = chat_turns.ChatTurns(tok, stop_ids=[tok.eos_token_id])
    with pytest.raises(ValueError, match="append"):
        turns.tool_tokens([{"name": "calc", "arguments": {}}], ["x"])


def test_truncation_sides_are_verls():
    assert chat_turns.truncate_text("abcdefgh", 4, "left") == "(truncated)...efgh"
    assert chat_turns.truncate_text("abcdefgh", 4, "right") == "abcd...(truncated)"
    assert chat_turns.truncate_text("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert chat_turns.truncate_text("abc", 4, "middle") == "abc"


# ---------------------------------------------------------------------------------------------
# The loop on multi-turn rollouts: the tiny random model, warmed up to call the tool


ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class AddTool(tool_base.BaseTool):
    executed = 0  # calls this process ran (an instance's count)

    async def execute(self, instance_id, parameters, **kwargs):
        self.executed += 1
        total = int(parameters["a"]) + int(parameters["b"])
        return tool_base.ToolResponse(text=str(total)), 0.0, {}


def add_tool():
    return AddTool({}, tool_base.ToolSchema.model_validate(ADD_SCHEMA))


def tool_rows(n, seed=0):
    """Sums whose warm-up answer is the call of the add tool."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 5, 2))
        rows.append({
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "data_source": "tool_sum",
            "reward_model": {"ground_truth": str(a + b)},
            "extra_info": {"answer": '<tool_call>{"name":"add","arguments":{"a":%d,"b":%d}}'
                                     "</tool_call>" % (a, b)},
        })  # fmt: skip
    return rows


def final_sum_reward(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the text after the last tool response is "#### <sum>"."""
    tail = solution_str.rsplit("</tool_response>", 1)[-1]
    return float(tail.strip() == f"#### {ground_truth}")


def tool_use_reward(data_source, solution_str, ground_truth, extra_info=None):
    """final_sum_reward, plus 1 for a trajectory that got a tool response: the warmed-up model
    calls the tool in some samples of a group only, so DAPO's filter keeps some groups and
    drops others."""
    used = float("</tool_response>" in solution_str)
    return used + final_sum_reward(data_source, solution_str, ground_truth, extra_info)


class LoopRun(NamedTuple):
    result: Any  # loop.TrainResult
    batches: list  # the RolloutBatch each step trained on (trainer/batch.py)


def _tool_run(tmp_path, *, steps=2, warmup=60, save_freq=-1, algorithm=None, lora_rank=0,
              base=None, base_leaves=None, loss_mode="vanilla", trainer=None, devices=None,
              tool=None, **mt) -> LoopRun:
    """The loop on tool rows (two mini-batches, packed) on a data-parallel mesh of `devices`
    (default: one). `base` (params) or `base_leaves` (their leaves on the host): the model to
    start from (with lora_rank, the frozen base) instead of the random one."""
    from grpo_jax import loading, sharding
    from grpo_jax.trainer import loop, train_stage

    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((-1, 1, 1), devices=devices or jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=48, max_response_length=128,
                               val_batch_size=4),
        # two mini-batches: the old log-probs are recomputed and compared with the engine's
        # packed token-budget micro-batches (verl's recipes): the tool turns are packed as
        # context and the loss reads the loss mask through the slots
        actor=config.ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                                 use_dynamic_bsz=True, ppo_max_token_len_per_gpu=512,
                                 optim=config.OptimConfig(lr=1e-3),
                                 policy_loss=config.PolicyLossConfig(loss_mode=loss_mode)),
        rollout=config.RolloutConfig(
            n=2, log_prob_micro_batch_size_per_gpu=8,
            multi_turn=config.MultiTurnConfig(enable=True, max_assistant_turns=2, **mt)),
        algorithm=algorithm or config.AlgorithmConfig(),
        reward=config.RewardConfig(num_workers=0),
        warmup=config.WarmupConfig(steps=warmup, batch_size=16, lr=3e-3),
        model=config.ModelSpec(source="random", tokenizer="char", path=None,
                               lora_rank=lora_rank, lora_alpha=2.0 * max(1, lora_rank)),
        trainer=config.TrainerConfig(total_training_steps=steps, save_freq=save_freq,
                                     test_freq=-1, val_before_train=False, progress_bar=False,
                                     tensorboard=False, default_local_dir=str(tmp_path),
                                     **(trainer or {})),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None)
    batches = []
    real_train_stage = train_stage.train_stage

    def recording(ctx, state, ref_params, rollout_batch, lr, **kw):
        batches.append(rollout_batch)
        return real_train_stage(ctx, state, ref_params, rollout_batch, lr, **kw)

    with sharding.use_mesh(mesh), pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_stage, "train_stage", recording)
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=256)
        if base_leaves is not None:  # placed as the random params (every process holds all)
            base = jax.tree.unflatten(jax.tree.structure(params), [
                jax.make_array_from_callback(x.shape, like.sharding, lambda i, x=x: x[i])
                for x, like in zip(base_leaves, jax.tree.leaves(params), strict=True)])
        result = loop.train(run, model_config=model_config,
                            params=params if base is None else base, tokenizer=tok,
                            train_data=tool_rows(64), reward_fn=tool_use_reward, mesh=mesh,
                            tools=[tool or add_tool()])
    return LoopRun(result, batches)


# DAPO's dynamic sampling and token-level rollout correction (IS and rejection), on every run
# of the synchronous fixture (its resume included)
DAPO_TOKEN_IS = config.AlgorithmConfig(
    filter_groups=config.FilterGroupsConfig(enable=True),
    rollout_correction=config.RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0"),
)  # fmt: skip


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """The warmed-up model trained 2 steps, DAPO and token-level rollout correction on,
    checkpointed each step."""
    return _tool_run(tmp_path_factory.mktemp("mt_full"), save_freq=1, algorithm=DAPO_TOKEN_IS)


@pytest.fixture(scope="module")
def async_lora(two_steps, tmp_path_factory):
    """Asynchronous rollouts (one step ahead) with LoRA adapters on two_steps' final model (a
    model that calls the tool), bypass mode with verl's bypass loss (token-level IS against
    the engine's log-probs inside the loss) and DAPO's filter; 3 steps. Also returns a host
    copy of the base taken before the run."""
    base = two_steps.result.state.params
    before = [np.array(x) for x in jax.tree.leaves(base)]
    out = _tool_run(
        tmp_path_factory.mktemp("mt_async_lora"), steps=3, warmup=0, base=base, lora_rank=8,
        loss_mode="bypass_mode", trainer=dict(async_rollout=True),
        algorithm=config.AlgorithmConfig(
            filter_groups=config.FilterGroupsConfig(enable=True),
            rollout_correction=config.RolloutCorrectionConfig(
                bypass_mode=True, rollout_is="token", rollout_is_threshold=2.0)),
    )  # fmt: skip
    return out, base, before


def _step_rows(result):
    return [r for r in result.history if "actor/pg_loss" in r]


def test_loop_trains_on_multi_turn_rollouts(two_steps):
    rows = _step_rows(two_steps.result)
    assert len(rows) == 2
    for r in rows:
        # the warmed-up model calls the tool (a random one never writes a call): 3 to 6 of a
        # step's 8 trajectories did in the runs seen
        assert r["multi_turn/tool_calls/mean"] > 0.25
        assert r["num_turns/max"] >= 4  # a call, its response and the next turn
        assert np.isfinite(r["actor/pg_loss"])
        # token in, token out: the trainer's log-probs of the sampled tokens, recomputed on
        # whole trajectories (tool turns as context), are the engine's
        assert r["training/rollout_probs_diff_max"] < 1e-3, r["training/rollout_probs_diff_max"]
        # so rollout correction's weights are 1 and it rejects nothing; a tool token (rollout
        # log-prob 0) under the loss would pull the mean below 1 and be rejected
        assert abs(r["rollout_corr/rollout_is_mean"] - 1) < 1e-3
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 0
        assert r["response_length/mean"] > r["multi_turn/tool_response_tokens/mean"] > 0
    # DAPO: groups were dropped, and every group trained on has rewards that vary
    assert sum(r.get("training/filter_groups/evicted_samples", 0) for r in rows) > 0
    for b in two_steps.batches:
        scores_GN = np.asarray(b.result.scores_B, np.float64).reshape(-1, 2)
        assert len(scores_GN) == 4 and (scores_GN.std(1) > 0).all(), scores_GN


TOOL_TURN = re.compile(r"<\|user\|><tool_response>(.*)</tool_response><\|assistant\|>", re.S)
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _check_tool_turns_are_context(tok, batch) -> int:
    """In a trained batch, the loss mask is 0 exactly on the tool turns: each run of masked
    tokens is one tool turn of the demo template, answering the call of the model turn just
    before it (the sum, for a well-formed call), with rollout log-prob 0; the model's turns
    hold no user turn. Returns the number of well-formed calls answered."""
    r = batch.rollout
    ids, valid, loss, lp = (distributed.to_host(x) for x in (
        r.response_ids, r.response_mask, r.loss_mask, r.log_probs))  # fmt: skip
    answered = 0
    for b in range(len(ids)):
        k = int(valid[b].sum())
        assert valid[b, :k].all() and not valid[b, k:].any() and not loss[b, k:].any()
        runs = np.split(np.arange(k), np.flatnonzero(np.diff(loss[b, :k])) + 1)
        assert loss[b, 0] == 1  # a response starts with the model's turn
        for prev, seg in zip([None, *runs[:-1]], runs):
            text = tok.decode(ids[b, seg], skip_special_tokens=False)
            if loss[b, seg[0]]:
                assert "<|user|>" not in text, text
                continue
            match = TOOL_TURN.fullmatch(text)
            assert match, text
            assert (lp[b, seg] == 0).all()
            (call, *_) = CALL.findall(tok.decode(ids[b, prev], skip_special_tokens=False))
            try:
                call = json.loads(call)
                a, c = call["arguments"]["a"], call["arguments"]["b"]
            except (ValueError, KeyError, TypeError):
                continue  # a malformed call: answered with an error text
            if call.get("name") == "add" and all(type(x) is int for x in (a, c)):
                assert match.group(1) == str(a + c), (text, call)
                answered += 1
    return answered


def test_trained_batches_hold_the_loss_mask_on_the_models_tokens(two_steps, async_lora):
    tok = demo_task.char_tokenizer()
    (lora_run, _, _) = async_lora
    for run in (two_steps, lora_run):
        assert len(run.batches) == len(_step_rows(run.result))
        assert sum(_check_tool_turns_are_context(tok, b) for b in run.batches) > 0


def test_async_lora_bypass_multi_turn(async_lora):
    """Asynchronous multi-turn rollouts with LoRA and bypass mode: each batch after the first
    was sampled one step ahead, by the merged adapters of the step before; only the adapters
    train."""
    from grpo_jax.models import lora

    run, base, before = async_lora
    rows = _step_rows(run.result)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    # a batch sampled one step ahead missed that step's two updates (two mini-batches)
    assert [r["async/policy_version_lag"] for r in rows] == [0, 2, 2]
    assert max(r["multi_turn/tool_calls/mean"] for r in rows) > 0
    for r in rows:
        assert "timing_s/old_log_prob" not in r  # bypass: the engine's log-probs are the old
        # the bypass loss's weights, current policy over the engine's log-probs of the sampled
        # tokens; a tool token (log-prob 0) under the loss would weigh exp(its log-prob) << 1
        assert abs(r["rollout_corr/rollout_is_mean"] - 1) < 0.1, r["rollout_corr/rollout_is_mean"]
    # DAPO's filter ran in the background sampler too: every group trained on varies
    for b in run.batches:
        scores_GN = np.asarray(b.result.scores_B, np.float64).reshape(-1, 2)
        assert (scores_GN.std(1) > 0).all(), scores_GN
    # LoRA: the state holds the adapters only and they trained; the base is untouched
    adapters = run.result.state.params
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters)]
    assert paths and all(p.endswith(("['lora_a']", "['lora_b']")) for p in paths), paths[:3]
    assert lora.split(base)[1] is None
    b_max = max(float(np.abs(np.asarray(x)).max()) for p, x in
                jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(p[-1]))
    assert b_max > 0  # B starts at zeros (PEFT's init)
    for x, y in zip(jax.tree.leaves(base), before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_a_resumed_multi_turn_run_is_the_run_that_was_not_stopped(two_steps, tmp_path):
    """Stopped after step 1 and resumed from its checkpoint, step 2 samples the same
    trajectories (tools included), keeps the same groups (DAPO) and trains the same.

    What the samples decide is equal exactly. The engine's log-probs are not bitwise: the
    paged engine's schedule follows when the tool calls answer, and its log-probs agree across
    schedules to float rounding (test_multi_turn_paged.py), so what reads them (rollout
    correction's weights, hence the loss and step 1's update) agrees to rounding too."""
    _tool_run(tmp_path, steps=1, save_freq=1, algorithm=DAPO_TOKEN_IS)
    resumed = _step_rows(_tool_run(tmp_path, steps=2, save_freq=1,
                                   algorithm=DAPO_TOKEN_IS).result)
    want = _step_rows(two_steps.result)[-1]
    got = resumed[-1]
    assert got["step"] == want["step"] == 2
    for key in ("multi_turn/tool_calls/mean", "num_turns/mean", "response_length/mean",
                "critic/score/mean", "critic/advantages/mean",
                "training/filter_groups/evicted_samples"):
        assert got.get(key) == want.get(key), key
    for key in ("actor/pg_loss", "actor/entropy", "rollout_corr/rollout_is_mean"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def train_tools_and_summarise(workdir: str, devices, base_path: str) -> dict:
    """2 steps of the tool loop from the model saved at `base_path` (two_steps' final one,
    which calls the tool) on a data-parallel mesh of `devices`: the metrics, a fingerprint of
    the final params and the tool calls this process ran."""
    with np.load(base_path) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    tool = add_tool()
    out = _tool_run(workdir, warmup=0, base_leaves=leaves, devices=devices, tool=tool)
    params = [distributed.to_host(x) for x in jax.tree.leaves(out.result.state.params)]
    return {
        "history": out.result.history,
        "param_sums": [float(np.sum(x, dtype=np.float64)) for x in params],
        "param_abs": [float(np.sum(np.abs(x), dtype=np.float64)) for x in params],
        "executed": tool.executed,
    }


_WORKER = """
import sys
pid, port, workdir, base_path = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
from grpo_jax import distributed
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
import jax
import test_multi_turn as t
import workers
workers.answer(t.train_tools_and_summarise(workdir, jax.devices(), base_path))
"""


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
def test_two_processes_run_their_own_tool_calls_and_train_as_one(two_steps, tmp_path,
                                                                  monkeypatch):
    """Two JAX processes (2 CPU devices each, one 4-device mesh): each runs the tool calls of
    its own rows only, and together they train as one process on 4 devices does through the
    same lockstep turns (tool calls end at different times in each process, and the paged
    engine must be scheduled alike in all, so several take the lockstep rounds)."""
    import numerics
    import workers

    base_path = str(tmp_path / "base.npz")
    np.savez(base_path, *[np.asarray(x) for x in jax.tree.leaves(two_steps.result.state.params)])
    two = workers.run(_WORKER, tmp_path / "workers", args=(tmp_path / "two", base_path),
                      timeout=900)  # fmt: skip

    def lockstep(self, engine, params, prompts, rng, sp, trajectories, policy_version):
        version = self._lockstep(engine, params, rng, sp, trajectories, policy_version,
                                 range(len(trajectories)))  # fmt: skip
        return version, None  # no routing recorded (a dense model)

    monkeypatch.setattr(multi_turn.Agent, "_paged", lockstep)
    one = train_tools_and_summarise(str(tmp_path / "one"), jax.devices()[:4], base_path)
    # every call ran once, in the process that holds its row
    assert two[0]["executed"] > 0 and two[1]["executed"] > 0
    assert two[0]["executed"] + two[1]["executed"] == one["executed"]
    numerics.assert_close(two[0]["param_sums"], one["param_sums"], ulps=256,
                          scale=one["param_abs"], err_msg="param sums")  # fmt: skip
    rows = [(g, w) for g, w in zip(two[0]["history"], one["history"], strict=True)
            if "actor/pg_loss" in w]
    assert len(rows) == 2
    for g, w in rows:
        for k, v in w.items():
            if k.startswith(("timing", "perf/", "actor/perf/")) or not isinstance(v, float | int):
                continue
            numerics.assert_close(g[k], v, ulps=64, scale=max(abs(v), 1.0), err_msg=k)
        assert w["multi_turn/tool_calls/mean"] > 0
    assert two[0]["param_sums"] == two[1]["param_sums"]  # both processes end alike


def test_prompt_messages_keep_their_tool_calls():
    """A verl row's messages reach the chat template whole: an assistant turn's tool_calls (and
    None content), a tool turn's name; parquet's None-filled keys are dropped."""
    from grpo_jax.data import readers

    call = {"type": "function", "function": {"name": "calc", "arguments": {"answer": "7"}}}
    row = {"prompt": [
        {"role": "user", "content": "1+6?", "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": np.array([call], dtype=object)},
        {"role": "tool", "content": "right", "name": "calc"},
    ], "data_source": "x", "reward_model": {"ground_truth": "7"}}  # fmt: skip
    (ex,) = readers.parse_rows([row], source="t", on_malformed="error")
    assert ex.prompt[0] == {"role": "user", "content": "1+6?"}
    assert ex.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert ex.prompt[2]["name"] == "calc"
    tok = qwen_tool_tokenizer()
    text = prompts.prompt_text(tok, ex.prompt, {"tools": [SCHEMA]})
    assert '<tool_call>\n{"name": "calc", "arguments": {"answer": "7"}}\n</tool_call>' in text


def test_bad_tool_settings_are_config_errors(tmp_path):
    from grpo_jax.trainer import setup

    def run(**mt):
        return config.RunConfig(rollout=config.RolloutConfig(
            multi_turn=config.MultiTurnConfig(**mt)))  # fmt: skip

    with pytest.raises(config.ConfigError, match="tool_config_path=.*nope.yaml"):
        setup.tool_set(run(enable=True, tool_config_path=str(tmp_path / "nope.yaml")))
    with pytest.raises(config.ConfigError, match="needs tools"):
        setup.tool_set(run(enable=True))
    with pytest.raises(config.ConfigError, match="enable=False"):
        setup.tool_set(run(), tools=[CalcTool({}, tool_base.ToolSchema.model_validate(SCHEMA))])
    assert setup.tool_set(run()) is None
