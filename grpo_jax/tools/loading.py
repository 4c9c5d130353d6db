"""verl's tool YAML (rollout.multi_turn.tool_config_path) -> tool objects, checked.

    tools:
      - class_name: grpo_jax.tools.gsm8k.Gsm8kTool   # module.Class, imported
        config: {type: native}                       # given to the constructor as is
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: ...}}

Each entry is built as verl's `initialize_tools_from_config` builds it
(verl/tools/tool_registry.py): `cls(config=<config>, tool_schema=<ToolSchema or None>)`. The
class need not subclass base.BaseTool or import verl: any class whose instances have `name`,
`tool_schema` and the four methods (create, execute, calc_reward, release; sync or async) is
a tool, so a verl tool module that does not import verl's internals runs unchanged.

Every problem raises config.ConfigError naming the YAML file, the entry (index and tool name)
and the field; all entries are checked before raising, so one run reports every problem.
Beyond verl's checks: unknown keys are errors (a misspelt `tool_schema` is otherwise silently
absent), the schema's `type` must be "function", its `parameters` must be a valid JSON Schema of
an object (checked against the JSON Schema meta-schema), the constructed tool's `name` must be
its schema's function name, and names must be unique. verl reads the file with OmegaConf;
here it is plain YAML, so an OmegaConf interpolation ("${...}") is reported, not resolved.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import pydantic
import yaml

from grpo_jax import errors
from grpo_jax.tools import base


class ToolConfigError(errors.InputError):
    """Bad tools: `problems` lists each one, naming the file (or source), the entry and the field.
    (trainer/setup.py reports them as config errors of rollout.multi_turn.)"""

    def __init__(self, problems):
        self.problems = tuple(problems)
        super().__init__("invalid tools:\n  " + "\n  ".join(self.problems))


METHODS = ("create", "execute", "calc_reward", "release")
ENTRY_KEYS = ("class_name", "config", "tool_schema")
TOOL_TYPES = ("native",)  # verl 0.9.1's ToolType: its MCP type is removed


def load_tools(path: str) -> list:
    """The tools of a verl tool YAML, constructed and checked.

    Raises:
      config.ConfigError: naming the file, the entry and the field of each problem.
    """
    if not os.path.isfile(path):
        raise ToolConfigError([f"rollout.multi_turn.tool_config_path={path!r}: no such "
                                      "file (a verl tool YAML: tools: - class_name, config, "
                                      "tool_schema)"])  # fmt: skip
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ToolConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(doc, Mapping):
        raise ToolConfigError([f"{path}: must be a mapping with a list `tools:` (verl's "
                                      f"tool YAML), got {type(doc).__name__}"])  # fmt: skip
    if not isinstance(doc.get("tools"), list):
        got = "nothing" if doc.get("tools") is None else type(doc["tools"]).__name__
        raise ToolConfigError([f"{path}: tools: must be a list of tools (class_name, "
                                      f"config, tool_schema), got {got}"])  # fmt: skip
    problems = [f"{path}: unknown top-level key {k!r} (only `tools`)" for k in doc if k != "tools"]
    tools, wheres = [], []
    for i, entry in enumerate(doc["tools"]):
        where = f"{path}: tools[{i}]"
        name = _schema_name(entry.get("tool_schema")) if isinstance(entry, Mapping) else None
        where += f" ({name})" if name else ""
        tool = _build(entry, where, problems)
        if tool is not None:
            tools.append(tool)
            wheres.append(where)
    problems += _duplicates(tools, wheres)
    if problems:
        raise ToolConfigError(problems)
    return tools


def check_tools(tools: Sequence[Any], *, source: str) -> list:
    """Checks tool objects built in code (e.g. loop.train(tools=...)) as load_tools checks a
    YAML's: the four methods, a valid schema, `name` equal to its function name, unique names.

    Raises:
      config.ConfigError: naming `source`, the tool's index and the field.
    """
    problems = []
    for i, tool in enumerate(tools):
        problems += _check_tool(tool, f"{source}[{i}]")
    problems += _duplicates(tools, [f"{source}[{i}]" for i in range(len(tools))])
    if problems:
        raise ToolConfigError(problems)
    return list(tools)


def tool_schemas(tools: Sequence[Any]) -> list[dict]:
    """The tools' OpenAI schemas, as verl passes them to the chat template's `tools=`
    (`model_dump(exclude_unset=True, exclude_none=True)`)."""
    return [base.schema_dict(tool.tool_schema) for tool in tools]


def import_class(dotted: str):
    """`module.attr` -> the attribute (verl's get_tool_class). Raises ValueError saying which
    part failed."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{dotted!r} is not a dotted path module.Class")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure while importing the user's module
        raise ValueError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def schema_problems(schema: Any) -> list[str]:
    """What is wrong with an OpenAI function tool schema ([] when it is valid), each as
    'field: why' with the field dotted from the schema's root."""
    if not isinstance(schema, Mapping):
        return [f": must be a mapping, got {type(schema).__name__}"]
    try:
        base.ToolSchema.model_validate(dict(schema))
    except pydantic.ValidationError as e:
        return [f".{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    problems = []
    if schema["type"] != "function":
        problems.append(f".type: must be 'function', got {schema['type']!r}")
    parameters = schema["function"].get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
            problems.append(".function.parameters.type: must be 'object' (the arguments are a "
                            "JSON object)")  # fmt: skip
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as e:
            where = "".join(f".{p}" for p in e.absolute_path)
            problems.append(f".function.parameters{where}: not a valid JSON Schema: {e.message}")
    return problems


# ---------------------------------------------------------------------------------------------


def _build(entry: Any, where: str, problems: list[str]):
    """One YAML entry -> its constructed tool, or None after adding its problems."""
    if not isinstance(entry, Mapping):
        problems.append(f"{where}: must be a mapping (class_name, config, tool_schema), got "
                        f"{type(entry).__name__}")  # fmt: skip
        return None
    bad = [f"{where}: unknown key {k!r} (allowed: {', '.join(ENTRY_KEYS)})"
           for k in entry if k not in ENTRY_KEYS]  # fmt: skip
    bad += [
        f"{where}.{field}: holds an OmegaConf interpolation '${{...}}', which is not resolved "
        "here: write the value"
        for field in _interpolations(entry)
    ]
    cls_name, config = entry.get("class_name"), entry.get("config")
    if not isinstance(cls_name, str) or not cls_name:
        bad.append(f"{where}.class_name: missing (a dotted path module.Class)")
    if not isinstance(config, Mapping):
        bad.append(f"{where}.config: must be a mapping with type: native, got "
                   f"{type(config).__name__}")  # fmt: skip
    elif config.get("type") not in TOOL_TYPES:
        bad.append(f"{where}.config.type={config.get('type')!r}: must be one of "
                   f"{list(TOOL_TYPES)} (verl 0.9.1's tool types)")  # fmt: skip
    schema = None
    if entry.get("tool_schema") is not None:
        schema_bad = [f"{where}.tool_schema{p}" for p in schema_problems(entry["tool_schema"])]
        bad += schema_bad
        if not schema_bad:
            schema = base.ToolSchema.model_validate(dict(entry["tool_schema"]))
    if bad:
        problems += bad
        return None
    try:
        cls = import_class(cls_name)
    except ValueError as e:
        problems.append(f"{where}.class_name={cls_name!r}: {e}")
        return None
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    if missing:
        problems.append(f"{where}.class_name={cls_name!r}: the class has no method "
                        f"{', '.join(missing)} (a tool needs {', '.join(METHODS)})")  # fmt: skip
        return None
    try:
        tool = cls(config=dict(config), tool_schema=schema)
    except Exception as e:  # noqa: BLE001 - the user's constructor
        problems.append(f"{where}.class_name={cls_name!r}: the constructor raised "
                        f"{type(e).__name__}: {e}")  # fmt: skip
        return None
    tool_bad = _check_tool(tool, where)
    problems += tool_bad
    return None if tool_bad else tool


def _check_tool(tool: Any, where: str) -> list[str]:
    missing = [m for m in METHODS if not callable(getattr(tool, m, None))]
    if missing:
        return [f"{where}: {type(tool).__name__} has no method {', '.join(missing)} (a tool "
                f"needs {', '.join(METHODS)})"]  # fmt: skip
    if not hasattr(tool, "tool_schema"):
        return [f"{where}: {type(tool).__name__} has no attribute tool_schema"]
    schema = tool.tool_schema
    try:
        schema = base.schema_dict(schema)
    except TypeError as e:
        return [f"{where}.tool_schema: {e}"]
    problems = [f"{where}.tool_schema{p}" for p in schema_problems(schema)]
    if problems:
        return problems
    name = getattr(tool, "name", None)
    if name != schema["function"]["name"]:
        return [f"{where}.name={name!r}: must be the schema's function name "
                f"{schema['function']['name']!r} (the name the model calls)"]  # fmt: skip
    return []


def _interpolations(value: Any, field: str = "") -> list[str]:
    """The dotted fields under `value` whose strings hold "${" (an OmegaConf interpolation)."""
    if isinstance(value, str):
        return [field.lstrip(".")] if "${" in value else []
    if isinstance(value, Mapping):
        return [f for k, v in value.items() for f in _interpolations(v, f"{field}.{k}")]
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in _interpolations(v, f"{field}[{i}]")]
    return []


def _schema_name(schema: Any) -> str | None:
    if isinstance(schema, Mapping) and isinstance(schema.get("function"), Mapping):
        name = schema["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def _duplicates(tools: Sequence[Any], wheres: Sequence[str]) -> list[str]:
    seen: dict[str, str] = {}
    problems = []
    for tool, where in zip(tools, wheres, strict=True):
        name = getattr(tool, "name", None)
        if name in seen:
            problems.append(f"{where}: duplicate tool name {name!r} (also {seen[name]}); each "
                            "name must be unique")  # fmt: skip
        else:
            seen[name] = where
    return problems
