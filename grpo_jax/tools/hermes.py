"""The "hermes" tool-call format (rollout.multi_turn.format), as verl 0.9.1's HermesToolParser
reads it (verl/experimental/agent_loop/tool_parser.py), and checks of a call against the tools.

The model writes each call as a JSON object between tags, e.g. (Qwen2.5's chat template):

    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>

verl's rules, kept exactly:
  * Unless the text holds both "<tool_call>" and "</tool_call>" somewhere, it is all content
    and there is no call.
  * The calls are the non-greedy `<tool_call>(.*?)</tool_call>` matches (across newlines);
    the content is the text with those matches removed and nothing else: text between and
    around the blocks stays, untrimmed, and so does a trailing unclosed "<tool_call>...".
  * A block is a call when its JSON is an object with a string "name" and an "arguments" key.

The difference: verl silently drops a block that is not a call (it logs an error), so a turn
whose only block is malformed ends the trajectory, and passes any JSON "arguments" (a list, a
string, null) on to the tool. Here every block is a `ToolCall`, in order, and a malformed one
(unparseable JSON, not an object, no string "name", no "arguments", arguments not an object)
carries an `error` to send back to the model as the tool's response. verl's calls are the
`error is None` ones, plus the non-object-arguments ones verl runs. `check_call` adds what verl
checks when it runs a call (unknown tool name, with verl's message) and what it does not (the
arguments against the tool's JSON Schema).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block.

    Attributes:
      name: the function the model called ("" when the block has no string name).
      arguments: its arguments ({} when the block is malformed).
      error: None for a well-formed call; else why not, worded for the model.
      raw: the text between the tags.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    raw: str = ""


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _call(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"Invalid tool call: not valid JSON ({e.msg} at character "
                                f"{e.pos}).", raw)  # fmt: skip
    if not isinstance(obj, dict):
        return ToolCall("", {}, 'Invalid tool call: expected a JSON object {"name": ..., '
                                f'"arguments": {{...}}}}, got {_json_type(obj)}.', raw)  # fmt: skip
    name = obj.get("name")
    if not isinstance(name, str):
        why = "has no" if "name" not in obj else f"has {_json_type(name)} as its"
        return ToolCall("", {}, f'Invalid tool call: it {why} "name" (a string).', raw)
    if "arguments" not in obj:
        return ToolCall(name, {}, f'Invalid tool call to {name!r}: it has no "arguments" '
                                  "(a JSON object).", raw)  # fmt: skip
    arguments = obj["arguments"]
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'Invalid tool call to {name!r}: "arguments" must be a JSON '
                                  f"object, got {_json_type(arguments)}.", raw)  # fmt: skip
    return ToolCall(name, arguments, None, raw)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """Splits a model turn into its content and its tool calls (verl's HermesToolParser).

    Args:
      text: the decoded turn (special tokens kept, as verl decodes it).

    Returns:
      (content, calls): the text without the complete `<tool_call>` blocks, and one ToolCall per
      block in order, malformed ones with `error` set.
    """
    if START not in text or END not in text:
        return text, []
    calls = [_call(raw) for raw in _CALL_RE.findall(text)]
    return _CALL_RE.sub("", text), calls


def unknown_tool_message(name: str, available: Sequence[str]) -> str:
    """verl's response to a call of a tool it does not have."""
    return f"Unknown function '{name}'. Available tools: {list(available)}"


def check_call(call: ToolCall, schemas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Checks a parsed call against the tool set.

    Args:
      call: a ToolCall from `parse`.
      schemas: tool name -> its OpenAI function schema ({"type": "function", "function":
        {"name", "parameters", ...}}, as loading.tool_schemas gives).

    Returns:
      None when the call can run; else the message to send back as the tool's response: the
      block's parse error, verl's unknown-function message, or the arguments' first JSON Schema
      violations (wrong type, missing required property, ...).
    """
    if call.error is not None:
        return call.error
    if call.name not in schemas:
        return unknown_tool_message(call.name, list(schemas))
    parameters = schemas[call.name].get("function", {}).get("parameters")
    if not parameters:
        return None
    validator = jsonschema.validators.validator_for(parameters)(parameters)
    errors = sorted(validator.iter_errors(call.arguments), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    problems = []
    for e in errors[:3]:
        where = "arguments" + "".join(f"[{p!r}]" for p in e.absolute_path)
        problems.append(f"{where}: {e.message}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return f"Invalid arguments for '{call.name}': " + "; ".join(problems) + more + "."
