"""grpo_jax.tools: verl's tool interface, YAML, hermes format and GSM8K tool, and the executor's
concurrency and crash isolation.

Parity with verl 0.9.1 runs verl in its own venv (GRPO_JAX_VERL_PYTHON), once for the module:
one subprocess gets every case (hermes texts, GSM8K answers, tool schemas) as JSON and answers
with verl's results; without the venv those tests skip (fail under CI=true, tests/reference.py).
verl's parser module is loaded from its file, as its package's __init__ imports the whole agent
loop (and cachetools, which verl's venv lacks).

The executor tests time real sleeps against short timeouts (0.2-0.5 s); each bound leaves a
wide margin for a loaded 2-core machine, and the slow paths being ruled out are several times
longer than the bound (N sleeps one after another, a tool blocking for seconds).
"""

import asyncio
import json
import os
import random
import subprocess
import textwrap
import threading
import time

import pytest
import reference

from grpo_jax.tools import base, executor, gsm8k, hermes, loading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_YAML = os.path.join(ROOT, "configs", "tools", "gsm8k_tool.yaml")

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Checks an answer.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "the answer"}},
            "required": ["answer"],
        },
    },
}


def schema(name, **parameters):
    out = json.loads(json.dumps(SCHEMA))
    out["function"]["name"] = name
    out["function"]["parameters"].update(parameters)
    return out


# ---------------------------------------------------------------------------------------------
# verl, once for the module.

_VERL_SCRIPT = textwrap.dedent(
    """
    import asyncio, importlib.util, json, sys, types
    import verl
    from verl.tools.schemas import OpenAIFunctionToolSchema
    from verl.utils.reward_score import gsm8k

    path = verl.__path__[0] + "/experimental/agent_loop/tool_parser.py"
    spec = importlib.util.spec_from_file_location("_verl_tool_parser", path)
    tool_parser = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool_parser)
    # The "token ids" are the text itself: decode(text) = text.
    parser = tool_parser.HermesToolParser(types.SimpleNamespace(decode=lambda ids, **kw: ids))
    cases = json.load(sys.stdin)

    async def parse_all():
        out = []
        for text in cases["hermes"]:
            content, calls = await parser.extract_tool_calls(text)
            out.append([content, [[c.name, json.loads(c.arguments)] for c in calls]])
        return out

    schemas = []
    for s in cases["schemas"]:
        try:
            m = OpenAIFunctionToolSchema.model_validate(s)
            schemas.append(m.model_dump(exclude_unset=True, exclude_none=True))
        except Exception as e:
            schemas.append(None)
    json.dump({
        "hermes": asyncio.run(parse_all()),
        "gsm8k": [gsm8k.compute_score(r, g, method="flexible", format_score=0.0, score=1.0)
                  for r, g in cases["gsm8k"]],
        "schemas": schemas,
        "version": verl.__version__,
    }, sys.stdout)
    """
)

# Pieces of model turns for the generated hermes cases: tags, JSON of every malformed kind,
# content and the chat template's special tokens.
_PIECES = [
    "<tool_call>", "</tool_call>", "\n", " ", "Let me check.", "<|im_end|>", "<think>", "</think>",
    '{"name": "calc", "arguments": {"answer": "72"}}', '{"name": "calc", "arguments": {}}',
    '{"name": "calc", "arguments": {"answer": 7, "n": [1, {"a": null}]}}',
    '{"name": "wiki", "arguments": {"q": "caf\\u00e9 \\"quoted\\""}}', '{"name": "été", '
    '"arguments": {"x": "日本"}}', '{"name": "calc", "arguments": [1, 2]}',
    '{"name": "calc", "arguments": "answer=7"}', '{"name": "calc", "arguments": null}',
    '{"name": "calc"}', '{"arguments": {}}', '{"name": 5, "arguments": {}}', "[1, 2]", '"calc"',
    '{"name": "calc", "arguments": {"a": 1}', "not json", "{}", '{"name": "", "arguments": {}}',
    '{"name": "calc", "arguments": {"a": 1}, "id": "x"}', '{"name": "a", "name": "b", '
    '"arguments": {}}', "{'name': 'calc'}", "1e400", "true",
]  # fmt: skip

HERMES_CASES = [
    "",
    "The answer is 72.",
    '<tool_call>\n{"name": "calc", "arguments": {"answer": "72"}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"answer": "72"}}\n</tool_call>'
    "<|im_end|>",
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", '
    '"arguments": {"x": 1}}</tool_call> done',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> tail <tool_call>{"name": "b", "ar',
    '<tool_call>{"name": "a", "arguments": {}}',  # unclosed only: all content, no call
    '{"name": "a", "arguments": {}}</tool_call>',  # closing tag only
    '</tool_call> <tool_call>{"name": "a", "arguments": {}}',  # both tags, no block
    "<tool_call></tool_call>",
    '<tool_call>{"name": "a", "arguments": {"s": "</tool_call>"}}</tool_call>',  # cut inside
    '<tool_call>x<tool_call>{"name": "a", "arguments": {}}</tool_call>',  # nested start
    '<tool_call>{"name": "a", "arguments": {}}</tool_call></tool_call>',
    '<TOOL_CALL>{"name": "a", "arguments": {}}</TOOL_CALL>',  # case matters
    '<tool_call>\n\n  {"name": "a",\n "arguments": {"k": "v\\nw"}}  \n\n</tool_call>\n',
] + [f"<tool_call>\n{p}\n</tool_call>" for p in _PIECES if not p.startswith("<")]


def _generated_hermes_cases(n=300, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            piece = rng.choice(_PIECES)
            # Half the JSON pieces go between a pair of tags, so blocks of every kind occur.
            if not piece.startswith("<") and rng.random() < 0.5:
                piece = f"<tool_call>{rng.choice(['', chr(10)])}{piece}</tool_call>"
            parts.append(piece)
        out.append("".join(parts))
    return out


GSM8K_CASES = [  # (answer argument, ground truth)
    ("72", "72"), (72, "72"), ("#### 72", "72"), ("72.0", "72"), (72.0, "72"), ("1,000", "1000"),
    ("1,000", "1,000"), ("-5", "-5"), ("", "5"), ("abc", "5"), ("18 or 19", "19"),
    ("The answer is $18", "18"), ("#### 1,234.5", "1234.5"), ("####72", "72"), (None, "None"),
    (True, "1"), ("3.", "3"), ("72", None), ("x" * 400 + " 5", "5"), ("5 " + "x" * 400, "5"),
]  # fmt: skip

SCHEMA_CASES = [
    SCHEMA,
    schema("arr", properties={"xs": {"type": "array", "items": {"type": "integer"},
                                     "description": "d", "minItems": 1}}),  # fmt: skip
    schema("union", properties={"v": {"type": ["integer", "number"], "enum": [1, 2.5]}},
           required=[]),  # fmt: skip
    {"type": "function", "function": {"name": "bare", "description": "no parameters"}},
    {"type": "function", "function": {"name": "strict", "description": "s", "strict": True,
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]  # fmt: skip


def _gsm8k_response(answer):
    """verl's GSM8K tool's text for an answer argument: str() it, prefix "#### " if missing."""
    answer = answer if isinstance(answer, str) else str(answer)
    return answer if answer.startswith("#### ") else "#### " + answer


@pytest.fixture(scope="module")
def verl_results():
    python = os.environ.get("GRPO_JAX_VERL_PYTHON", "")
    if not (python and os.access(python, os.X_OK)):
        reference.require("verl", f"no verl venv interpreter (GRPO_JAX_VERL_PYTHON={python!r})")
    cases = {
        "hermes": HERMES_CASES + _generated_hermes_cases(),
        "gsm8k": [[_gsm8k_response(a), g] for a, g in GSM8K_CASES],
        "schemas": SCHEMA_CASES,
    }
    out = subprocess.run([python, "-c", _VERL_SCRIPT], input=json.dumps(cases), text=True,
                         capture_output=True, timeout=120)  # fmt: skip
    if out.returncode != 0:
        reference.require("verl", f"verl's tool code does not run in {python}:\n{out.stderr}")
    result = json.loads(out.stdout)
    reference.VERSIONS["verl"] = f"verl {result['version']}"
    return cases, result


def _verl_keeps(call: hermes.ToolCall):
    """What verl makes of a block: (name, arguments) when its JSON is an object with a string
    name and an "arguments" key (whatever its type), else None (verl drops it)."""
    try:
        obj = json.loads(call.raw)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
        return [obj["name"], obj["arguments"]]
    return None


@pytest.mark.reference("verl")
def test_hermes_parse_matches_verl(verl_results):
    cases, result = verl_results
    kinds = set()
    for text, (verl_content, verl_calls) in zip(cases["hermes"], result["hermes"], strict=True):
        content, calls = hermes.parse(text)
        assert content == verl_content, text
        kept = [_verl_keeps(c) for c in calls]
        assert [k for k in kept if k is not None] == verl_calls, text
        for call, k in zip(calls, kept, strict=True):
            # Well-formed here <=> verl runs it with object arguments; everything else carries
            # an error for the model (verl drops it, or passes non-object arguments on).
            assert (call.error is None) == (k is not None and isinstance(k[1], dict)), text
            assert call.error is None or call.arguments == {}
            kinds.add("ok" if call.error is None else "kept" if k is not None else "dropped")
        kinds.add("unclosed" if text.count("<tool_call>") > text.count("</tool_call>") else "")
    assert kinds >= {"ok", "kept", "dropped", "unclosed"}  # every branch was compared


@pytest.mark.reference("verl")
def test_gsm8k_tool_rewards_match_verl_score(verl_results):
    """verl 0.9.1 has no GSM8K tool (verl <= 0.5 had verl/tools/gsm8k_tool.py): its score is
    verl's gsm8k.compute_score(flexible) of the "#### "-prefixed answer, compared here."""
    cases, result = verl_results
    tool = gsm8k.Gsm8kTool({"type": "native"}, None)
    assert sum(result["gsm8k"]) >= 4 and min(result["gsm8k"]) == 0.0  # both outcomes occur
    for (answer, truth), verl_score in zip(GSM8K_CASES, result["gsm8k"], strict=True):
        iid, _ = asyncio.run(tool.create(create_kwargs={"ground_truth": truth}))
        response, step, metrics = asyncio.run(tool.execute(iid, {"answer": answer}))
        assert asyncio.run(tool.calc_reward(iid)) == verl_score, (answer, truth)
        assert response.text == f"Current parsed answer={str(answer)!r} reward={verl_score!r}"
        # A fresh instance's previous score is 0.0: an improvement earns 0.0, else -0.05.
        assert step == (0.0 if verl_score > 0.0 else -0.05) and metrics == {}
        asyncio.run(tool.release(iid))


@pytest.mark.reference("verl")
def test_schema_dump_matches_verl(verl_results):
    """The chat template's tools= entries are verl's: JSON Schema keywords verl does not model
    (items, minItems, additionalProperties) are dropped as verl drops them."""
    cases, result = verl_results
    for s, verl_dump in zip(cases["schemas"], result["schemas"], strict=True):
        assert verl_dump is not None
        assert base.schema_dict(base.ToolSchema.model_validate(s)) == verl_dump


# ---------------------------------------------------------------------------------------------
# hermes: hand cases.


def test_hermes_content_and_errors():
    text = ('Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"answer": "72"}}\n'
            '</tool_call>\n<tool_call>{"name": "calc", "arguments": [1]}</tool_call>'
            '<tool_call>oops</tool_call><|im_end|>')  # fmt: skip
    content, calls = hermes.parse(text)
    assert content == "Let me check.\n\n<|im_end|>"
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("calc", {"answer": "72"}, True), ("calc", {}, False), ("", {}, False)]  # fmt: skip
    assert '"arguments" must be a JSON object, got an array' in calls[1].error
    assert "not valid JSON" in calls[2].error
    # An unclosed block is content, as verl reads it.
    assert hermes.parse('<tool_call>{"name": "calc"') == ('<tool_call>{"name": "calc"', [])


def test_check_call_against_the_tools():
    schemas = {"calc": schema("calc", properties={"answer": {"type": "string"},
                                                  "n": {"type": "integer"}})}  # fmt: skip
    ok = hermes.ToolCall("calc", {"answer": "7", "n": 3})
    assert hermes.check_call(ok, schemas) is None
    unknown = hermes.check_call(hermes.ToolCall("wiki", {}), schemas)
    assert unknown == "Unknown function 'wiki'. Available tools: ['calc']"  # verl's text
    wrong = hermes.check_call(hermes.ToolCall("calc", {"answer": 7, "n": "3"}), schemas)
    assert "Invalid arguments for 'calc'" in wrong
    assert "arguments['answer']: 7 is not of type 'string'" in wrong
    assert "arguments['n']: '3' is not of type 'integer'" in wrong
    missing = hermes.check_call(hermes.ToolCall("calc", {"n": 1}), schemas)
    assert "'answer' is a required property" in missing
    malformed = hermes.parse("<tool_call>[]</tool_call>")[1][0]
    assert hermes.check_call(malformed, schemas) == malformed.error


# ---------------------------------------------------------------------------------------------
# Loading verl's tool YAML.

TOOL_MODULE = '''
"""A tool written as verl users write it; only the import line differs from verl's
(from verl.tools.base_tool import BaseTool / from verl.tools.schemas import ToolResponse)."""
from typing import Any, Optional
from uuid import uuid4

from grpo_jax.tools.base import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class EchoTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.prefix = config.get("prefix", "")

    async def create(self, instance_id: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = kwargs.get("create_kwargs", {}).get("n", 0)
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        n = self._instance_dict[instance_id]
        return ToolResponse(text=f"{self.prefix}{parameters['text']}x{n}"), float(n), {"n": n}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]


class Response:
    def __init__(self, text):
        self.text, self.image, self.video = text, None, None


class DuckTool:
    """No base class, no imports: sync and async methods mixed."""

    def __init__(self, config, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name
        self.released = []

    def create(self, instance_id=None, **kwargs):
        return "duck-1", Response("")

    async def execute(self, instance_id, parameters, **kwargs):
        return Response(f"quack {sorted(parameters)}"), None, {}

    def calc_reward(self, instance_id, **kwargs):
        return 0.5

    def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class NoRelease:
    def __init__(self, config, tool_schema):
        pass

    async def create(self, *a, **k): ...
    async def execute(self, *a, **k): ...
    async def calc_reward(self, *a, **k): ...


class Raises(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("no API key")


class Misnamed(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.name = "other"
'''


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    name = f"user_tools_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _yaml(tmp_path, entries, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(json.dumps({"tools": entries}))  # JSON is YAML
    return str(path)


def _entry(cls, name="calc", **extra):
    return {"class_name": cls, "config": {"type": "native"}, "tool_schema": schema(name), **extra}


def test_gsm8k_yaml_loads_and_gives_the_template_verls_schema():
    tools = loading.load_tools(GSM8K_YAML)
    assert [type(t) for t in tools] == [gsm8k.Gsm8kTool]
    assert loading.tool_schemas(tools) == [gsm8k.SCHEMA]
    assert tools[0].config == {"type": "native"}


def test_verl_style_tool_module_loads_and_runs(tmp_path, tool_module):
    path = _yaml(tmp_path, [
        {"class_name": f"{tool_module}.EchoTool", "config": {"type": "native", "prefix": ">"},
         "tool_schema": schema("echo", properties={"text": {"type": "string"}})},
        {"class_name": f"{tool_module}.DuckTool", "config": {"type": "native"},
         "tool_schema": schema("duck")},
    ])  # fmt: skip
    echo, duck = loading.load_tools(path)
    assert (echo.name, echo.config["prefix"], duck.name) == ("echo", ">", "duck")
    turn = ('<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>\n'
            '<tool_call>{"name": "duck", "arguments": {"b": 1, "a": 2}}</tool_call>')  # fmt: skip
    _, calls = hermes.parse(turn)
    with executor.ToolExecutor([echo, duck], max_parallel_calls=2, timeout_s=2.0) as runner:
        [outcomes] = runner.run_calls([(calls, {"echo": {"create_kwargs": {"n": 3}}})])
        assert [(o.text, o.reward, o.status) for o in outcomes] == [
            (">hix3", 3.0, "ok"), ("quack ['a', 'b']", None, "ok")]  # fmt: skip
        assert outcomes[0].metrics == {"n": 3}
        assert echo._instance_dict == {} and duck.released == ["duck-1"]  # released after
        [reward] = runner.calc_reward([("duck", "duck-1")])
        assert (reward.reward, reward.status) == (0.5, "ok")


BAD_YAML = [  # (entries or raw text, substrings the one error must name)
    ("- just a list", ["must be a mapping with a list `tools:`", "got list"]),
    ("tools: {calc: 1}", ["tools: must be a list", "got dict"]),
    ("tools: [1", ["not valid YAML"]),
    ([3], ["tools[0]: must be a mapping", "got int"]),
    ([{"config": {"type": "native"}, "tool_schema": SCHEMA}],
     ["tools[0] (calc).class_name: missing"]),
    ([_entry("no_such_module_xyz.Tool")],
     ["tools[0] (calc).class_name='no_such_module_xyz.Tool'", "cannot import module "
      "'no_such_module_xyz'", "ModuleNotFoundError"]),
    ([_entry("grpo_jax.tools.gsm8k.NoSuchTool")],
     ["tools[0] (calc).class_name", "module 'grpo_jax.tools.gsm8k' has no attribute 'NoSuchTool'"]),
    ([_entry("Gsm8kTool")], ["tools[0] (calc).class_name", "not a dotted path"]),
    ([_entry("{mod}.NoRelease")], ["tools[0] (calc).class_name", "has no method release"]),
    ([_entry("{mod}.Raises")], ["tools[0] (calc).class_name", "constructor raised RuntimeError: "
                                "no API key"]),
    ([_entry("{mod}.Misnamed")], ["tools[0] (calc).name='other'", "schema's function name 'calc'"]),
    ([{**_entry("{mod}.EchoTool"), "config": {}}], ["tools[0] (calc).config.type=None",
                                                    "['native']"]),
    ([{**_entry("{mod}.EchoTool"), "tool_shema": SCHEMA}], ["tools[0] (calc): unknown key "
                                                            "'tool_shema'"]),
    ([{**_entry("{mod}.EchoTool"), "config": {"type": "native", "url": "${env:URL}"}}],
     ["tools[0] (calc).config.url: holds an OmegaConf interpolation"]),
    ([{**_entry("{mod}.EchoTool"), "tool_schema": {**SCHEMA, "type": "retrieval"}}],
     ["tools[0] (calc).tool_schema.type: must be 'function'"]),
    ([{**_entry("{mod}.EchoTool"), "tool_schema": {"type": "function", "function": {
        "description": "d"}}}], ["tools[0].tool_schema.function.name: Field required"]),
    ([{**_entry("{mod}.EchoTool"), "tool_schema": schema("calc", properties={
        "answer": {"type": "string", "minLength": -1}})}],
     ["tools[0] (calc).tool_schema.function.parameters.properties.answer.minLength: not a "
      "valid JSON Schema", "-1"]),
    ([{**_entry("{mod}.EchoTool"), "tool_schema": schema("calc", type="array")}],
     ["tools[0] (calc).tool_schema.function.parameters.type: must be 'object'"]),
    ([{**_entry("{mod}.EchoTool"), "tool_schema": schema("calc", properties={"a": {}})}],
     ["tools[0] (calc).tool_schema.function.parameters.properties.a.type: Field required"]),
    ([_entry("{mod}.EchoTool"), _entry("{mod}.DuckTool")],
     ["tools[1] (calc): duplicate tool name 'calc' (also", "tools[0] (calc)"]),
]  # fmt: skip


@pytest.mark.parametrize("entries, expected", BAD_YAML)
def test_bad_tool_yaml_names_file_entry_and_field(tmp_path, tool_module, entries, expected):
    if isinstance(entries, str):
        path = tmp_path / "tools.yaml"
        path.write_text(entries)
        path = str(path)
    else:
        entries = json.loads(json.dumps(entries).replace("{mod}", tool_module))
        path = _yaml(tmp_path, entries)
    with pytest.raises(loading.ToolConfigError) as e:
        loading.load_tools(path)
    message = str(e.value)
    assert path in message
    for part in expected:
        assert part in message, message


def test_missing_tool_yaml(tmp_path):
    with pytest.raises(loading.ToolConfigError, match="tool_config_path=.*nope.yaml.*no such file"):
        loading.load_tools(str(tmp_path / "nope.yaml"))


def test_every_bad_entry_is_reported_at_once(tmp_path):
    path = _yaml(tmp_path, [_entry("a_missing_module.T"), {"class_name": "x.Y"}])
    with pytest.raises(loading.ToolConfigError) as e:
        loading.load_tools(path)
    assert len(e.value.problems) == 2  # the first entry's import, the second's config
    assert "tools[1].config: must be a mapping" in str(e.value)


def test_check_tools_built_in_code():
    tool = gsm8k.Gsm8kTool({"type": "native"}, None)
    assert loading.check_tools([tool], source="loop.train(tools=...)") == [tool]
    with pytest.raises(loading.ToolConfigError, match=r"loop.train\(tools=...\)\[1\]: duplicate"):
        loading.check_tools([tool, gsm8k.Gsm8kTool({}, None)], source="loop.train(tools=...)")
    with pytest.raises(loading.ToolConfigError, match=r"tools\[0\]: object has no method create"):
        loading.check_tools([object()], source="tools")


def test_base_tool_defaults_are_verls():
    tool = base.BaseTool({}, base.ToolSchema.model_validate(SCHEMA))
    assert tool.name == "calc" and tool.tool_schema.function.parameters.required == ["answer"]
    iid, created = asyncio.run(tool.create())
    assert isinstance(iid, str) and len(iid) == 36 and created.is_empty()
    assert asyncio.run(tool.create("mine"))[0] == "mine"
    response, reward, metrics = asyncio.run(tool.execute(iid, {}))
    assert (response.text, reward, metrics) == ("Updated the tool state.", 0.0, {})
    assert asyncio.run(tool.calc_reward(iid)) == 0.0 and asyncio.run(tool.release(iid)) is None
    with pytest.raises(ValueError, match="no tool_schema"):
        base.BaseTool({}, None)
    with pytest.raises(ValueError, match="image must be a list"):
        base.ToolResponse(image="img.png")


# ---------------------------------------------------------------------------------------------
# The executor.


class Tool(base.BaseTool):
    """A configurable misbehaving tool: `behaviour(parameters)` runs inside execute."""

    def __init__(self, name, behaviour, *, is_async=True):
        super().__init__({}, base.ToolSchema.model_validate(schema(name)))
        self.behaviour, self.released, self.executed = behaviour, [], []
        if not is_async:  # the same methods, plain functions
            self.create = lambda instance_id=None, **kw: (instance_id or "sync-id",
                                                          base.ToolResponse())  # fmt: skip
            self.execute = self._sync_execute

    async def execute(self, instance_id, parameters, **kwargs):
        self.executed.append(parameters)
        out = self.behaviour(parameters)
        return await out if asyncio.iscoroutine(out) else out

    def _sync_execute(self, instance_id, parameters, **kwargs):
        self.executed.append(parameters)
        return self.behaviour(parameters)

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


def ok(text="done", reward=1.0):
    return lambda p: (base.ToolResponse(text=text), reward, {})


async def _slow_async(seconds):
    await asyncio.sleep(seconds)
    return base.ToolResponse(text="slow"), 1.0, {}


def _call(name, **arguments):
    return hermes.ToolCall(name, arguments)


def test_calls_run_concurrently_not_one_after_another():
    n, sleep = 8, 0.3
    tools = [Tool("a", lambda p: _slow_async(sleep)),
             Tool("s", lambda p: (time.sleep(sleep), ok()(p))[1], is_async=False)]  # fmt: skip
    with executor.ToolExecutor(tools, max_parallel_calls=1, timeout_s=5.0) as runner:
        start = time.monotonic()
        out = runner.run_calls([([_call("a" if i % 2 else "s")], {}) for i in range(n)])
        elapsed = time.monotonic() - start
    assert [o[0].status for o in out] == ["ok"] * n
    assert elapsed < 3 * sleep, elapsed  # one after another: n * sleep = 2.4 s


def test_timeout_starts_when_a_worker_takes_the_call():
    """4 calls of 0.3 s on 2 workers take two rounds; none times out at 0.5 s, as the waiting
    ones' clocks start when a worker takes them."""
    tools = [Tool("a", lambda p: _slow_async(0.3))]
    with executor.ToolExecutor(tools, max_parallel_calls=1, timeout_s=0.5, max_workers=2) as r:
        start = time.monotonic()
        out = r.run_calls([([_call("a")], {}) for _ in range(4)])
        assert [o[0].status for o in out] == ["ok"] * 4
        assert 0.55 < time.monotonic() - start < 1.5


def test_a_raising_tool_answers_verls_error_and_is_released():
    def boom(p):
        raise RuntimeError("boom")

    tool = Tool("t", boom)
    with executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=1.0) as runner:
        [[o]] = runner.run_calls([([_call("t")], {})])
    assert (o.text, o.reward, o.status) == ("Error executing tool 't': boom", 0.0, "error")
    assert len(tool.released) == 1


@pytest.mark.parametrize("kind", ["async_blocks_its_loop", "sync", "async_awaits"])
def test_a_hanging_tool_times_out_without_stalling_the_others(kind):
    timeout = 0.3
    if kind == "async_blocks_its_loop":  # an `async def` calling time.sleep: the loop is stuck

        async def hang(p):
            time.sleep(1.5)
            return ok()(p)

        hung = Tool("hung", hang)
    elif kind == "sync":
        hung = Tool("hung", lambda p: (time.sleep(1.5), ok()(p))[1], is_async=False)
    else:  # cooperative: cancelled at the timeout, so its release still runs
        hung = Tool("hung", lambda p: _slow_async(30))
    fast = Tool("fast", ok("fast"))
    runner = executor.ToolExecutor([hung, fast], max_parallel_calls=2, timeout_s=timeout)
    start = time.monotonic()
    [[h, f], [f2]] = runner.run_calls([([_call("hung"), _call("fast")], {}),
                                       ([_call("fast")], {})])  # fmt: skip
    elapsed = time.monotonic() - start
    assert (h.status, h.reward) == ("timeout", 0.0)
    assert h.text == "Error executing tool 'hung': timed out after 0.3 s"
    assert (f.text, f.status, f2.status) == ("fast", "ok", "ok")
    assert timeout <= elapsed < timeout + 0.8, elapsed
    # The pool replaced the abandoned worker: the next turn runs at once.
    start = time.monotonic()
    assert runner.run_calls([([_call("fast")], {})])[0][0].status == "ok"
    assert time.monotonic() - start < 0.5
    stats = runner.stats()
    assert (stats["timeout"], stats["ok"]) == (1, 3)
    if kind == "async_awaits":
        deadline = time.monotonic() + 2.0
        while runner.stats()["abandoned_threads"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.stats()["abandoned_threads"] == 0 and len(hung.released) == 1
    else:
        assert stats["abandoned_threads"] == 1
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < timeout + 0.5  # does not wait for the blocked thread
    with pytest.raises(RuntimeError, match="closed"):
        runner.run_calls([([_call("fast")], {})])


GARBAGE = [
    ("a string", lambda p: "done"),
    ("two values", lambda p: (base.ToolResponse(text="x"), 1.0)),
    ("no response", lambda p: ("text", 1.0, {})),
    ("reward a string", lambda p: (base.ToolResponse(text="x"), "1.0", {})),
    ("metrics a list", lambda p: (base.ToolResponse(text="x"), 1.0, [])),
    ("none", lambda p: None),
]


@pytest.mark.parametrize("why, behaviour", GARBAGE, ids=[g[0] for g in GARBAGE])
def test_garbage_from_execute_is_invalid(why, behaviour):
    tool = Tool("t", behaviour)
    with executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=1.0) as runner:
        [[o]] = runner.run_calls([([_call("t")], {})])
    assert (o.status, o.reward) == ("invalid", 0.0), o.detail
    assert o.text == "Error executing tool 't': it returned an invalid result"
    assert len(tool.released) == 1


def test_garbage_from_create_is_invalid_and_nothing_is_released():
    tool = Tool("t", ok())

    async def create(instance_id=None, **kwargs):
        return "only-an-id"

    tool.create = create
    with executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=1.0) as runner:
        [[o]] = runner.run_calls([([_call("t")], {})])
    assert o.status == "invalid" and "create() must return" in o.detail
    assert tool.executed == [] and tool.released == []


def test_max_parallel_calls_runs_the_first_calls_and_drops_the_rest():
    tool = Tool("t", lambda p: ok(str(p["i"]))(p))
    with executor.ToolExecutor([tool], max_parallel_calls=2, timeout_s=1.0) as runner:
        out = runner.run_calls([([_call("t", i=i) for i in range(5)], {}), ([], {}),
                                ([_call("t", i=9)], {})])  # fmt: skip
    assert [[o.text for o in row] for row in out] == [["0", "1"], [], ["9"]]
    assert sorted(p["i"] for p in tool.executed) == [0, 1, 9]


def test_bad_calls_do_not_reach_the_tools():
    tool = Tool("t", ok())
    _, calls = hermes.parse("<tool_call>{bad</tool_call>")
    with executor.ToolExecutor([tool], max_parallel_calls=3, timeout_s=1.0,
                               validate_arguments=True) as runner:  # fmt: skip
        [[malformed, unknown, invalid]] = runner.run_calls(
            [([calls[0], _call("nope"), _call("t", answer=7)], {})]
        )
    assert (malformed.status, malformed.reward, malformed.text) == ("bad_call", None,
                                                                    calls[0].error)  # fmt: skip
    assert (unknown.status, unknown.reward) == ("bad_call", 0.0)
    assert unknown.text == "Unknown function 'nope'. Available tools: ['t']"
    assert invalid.status == "bad_call" and "7 is not of type 'string'" in invalid.text
    assert tool.executed == []


def test_gsm8k_tool_through_the_executor_with_verls_lifecycle():
    """verl 0.9.1 creates an instance per call, so the ground truth comes from the row's
    tools_kwargs each time and the step reward is 0.0 (right) or -0.05 (wrong)."""
    [tool] = loading.load_tools(GSM8K_YAML)
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    _, right = hermes.parse('<tool_call>{"name": "calc_gsm8k_reward", "arguments": '
                            '{"answer": 72}}</tool_call>')  # fmt: skip
    wrong = [_call("calc_gsm8k_reward", answer="71")]
    with executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=2.0) as runner:
        [[r], [w]] = runner.run_calls([(right, kwargs), (wrong, kwargs)])
        assert (r.text, r.reward) == ("Current parsed answer='72' reward=1.0", 0.0)
        assert (w.text, w.reward) == ("Current parsed answer='71' reward=0.0", -0.05)
        assert tool._instances == {}  # each call's instance was released
        # The methods alone keep an instance across calls: a repeated right answer is no
        # improvement (-0.05), and calc_reward is the score.
        [created] = runner.create([("calc_gsm8k_reward", {"ground_truth": "72"})])
        iid = created.instance_id
        steps = runner.execute([("calc_gsm8k_reward", iid, {"answer": "72"})] * 1)
        steps += runner.execute([("calc_gsm8k_reward", iid, {"answer": "#### 72"})])
        assert [s.reward for s in steps] == [0.0, -0.05]
        assert runner.calc_reward([("calc_gsm8k_reward", iid)])[0].reward == 1.0
        assert runner.release([("calc_gsm8k_reward", iid)])[0].status == "ok"
        [gone] = runner.calc_reward([("calc_gsm8k_reward", iid)])  # released: KeyError
        assert gone.status == "error" and tool._instances == {}


def test_executor_is_off_the_callers_thread():
    seen = []
    tool = Tool("t", lambda p: (seen.append(threading.get_ident()), ok()(p))[1], is_async=False)
    with executor.ToolExecutor([tool], max_parallel_calls=1, timeout_s=1.0) as runner:
        runner.run_calls([([_call("t")], {})])
    assert seen and seen[0] != threading.get_ident()


def test_calculator_evaluates_arithmetic_and_answers_errors():
    from grpo_jax.tools import calculator

    assert calculator.evaluate("12*(3+4)") == 84
    assert calculator.evaluate("7/2") == 3.5 and calculator.evaluate("8/2") == 4
    assert calculator.evaluate("-3**2 + 2**10 // 3 % 7") == -9 + (1024 // 3) % 7
    for bad in ("__import__('os')", "x+1", "2**1000", "1/0", "len('a')", "1" * 300, "1 +"):
        with pytest.raises(ValueError):
            calculator.evaluate(bad)
    with executor.ToolExecutor([calculator.CalculatorTool()], max_parallel_calls=2,
                               timeout_s=2.0) as runner:
        (outs,) = runner.run_calls([(
            [hermes.ToolCall("calculator", {"expression": "2+3"}),
             hermes.ToolCall("calculator", {"expression": "os.system('x')"})], {})])
    assert [o.text for o in outs] == ["5", outs[1].text] and outs[1].text.startswith("error:")
    assert [o.status for o in outs] == ["ok", "ok"]


def test_code_interpreter_runs_code_in_the_sandbox_and_answers_failures():
    from grpo_jax.tools import code_interpreter

    (tool,) = loading.load_tools(os.path.join(ROOT, "configs", "tools", "code_interpreter.yaml"))
    assert tool.limits.wall_seconds == 8.0
    fast = code_interpreter.CodeInterpreterTool({"cpu_seconds": 1, "wall_seconds": 2.0})
    with executor.ToolExecutor([fast], max_parallel_calls=3, timeout_s=10.0) as runner:
        (outs,) = runner.run_calls([([
            hermes.ToolCall("code_interpreter", {"code": "print(sum(range(10)))"}),
            hermes.ToolCall("code_interpreter", {"code": "while True: pass"}),
            hermes.ToolCall("code_interpreter", {"code": "1/0"}),
        ], {})])  # fmt: skip
    assert outs[0].text == "45\n" or outs[0].text.strip() == "45"
    assert outs[1].text.endswith("[timeout]")
    assert "ZeroDivisionError" in outs[2].text and outs[2].text.endswith("[error]")
    assert [o.status for o in outs] == ["ok"] * 3  # the tool answered; the code failed
    with pytest.raises(ValueError, match="unknown keys"):
        code_interpreter.CodeInterpreterTool({"cpu_secs": 1})
