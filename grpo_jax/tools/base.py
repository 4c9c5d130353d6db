"""verl 0.9.1's tool interface: `BaseTool`, its OpenAI function schema and `ToolResponse`.

A tool written for verl (`verl/tools/base_tool.py`, `verl/tools/schemas.py`) ports by changing
its imports to this module: the same constructor `(config, tool_schema)`, the same four async
methods with verl's signatures, defaults and return shapes, and schema objects with verl's
fields (`tool_schema.function.name`, `.function.parameters.properties`, `model_dump()`).

The schema models keep verl's fields only, as verl's pydantic models do: a JSON Schema keyword
verl does not model (`items`, `minimum`, ...) is dropped on validation, so
`model_dump(exclude_unset=True, exclude_none=True)`, what the chat template's `tools=` gets, is
the dict verl renders. Tools need not subclass `BaseTool`: the loader and the executor duck-type
them (any object with `name`, `tool_schema` and the four methods, sync or async).

Differences from verl: the constructor does not print the schema, and a missing schema raises
a ValueError saying so (verl's base `get_openai_tool_schema` reads an attribute not yet set).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pydantic


class ToolResponse(pydantic.BaseModel):
    """What a tool answers: text, and images or videos for a vision model (lists, as verl)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values):
        # verl rejects a bare image (or a tuple) instead of wrapping it: a tool that returns one
        # image must write [image]. (verl also rejects an explicit None; here None is "none".)
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}; "
                        f"wrap a single one: {key}=[x]"
                    )
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


class PropertySchema(pydantic.BaseModel):
    """One parameter: a JSON type (or a list of types for a union), description, enum."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class ParametersSchema(pydantic.BaseModel):
    """The function's parameters: an object schema (verl's fields; `required` may be omitted)."""

    type: str
    properties: dict[str, PropertySchema]
    required: list[str] = pydantic.Field(default_factory=list)


class FunctionSchema(pydantic.BaseModel):
    """The function a tool exposes: its name (what the model calls), description, parameters."""

    name: str
    description: str
    parameters: ParametersSchema = pydantic.Field(
        default_factory=lambda: ParametersSchema(type="object", properties={}, required=[])
    )
    strict: bool = False


class ToolSchema(pydantic.BaseModel):
    """An OpenAI function tool: {"type": "function", "function": {...}} (verl's
    OpenAIFunctionToolSchema)."""

    type: str
    function: FunctionSchema


# verl's name, so a verl tool's annotations port with its imports.
OpenAIFunctionToolSchema = ToolSchema


def schema_dict(schema: Any) -> dict:
    """A tool's schema as the chat template's `tools=` entry: verl's
    `model_dump(exclude_unset=True, exclude_none=True)` of a schema object, or a mapping as is.

    Raises:
      TypeError: neither a schema object nor a mapping.
    """
    if isinstance(schema, Mapping):
        return dict(schema)
    if callable(getattr(schema, "model_dump", None)):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    raise TypeError(f"must be a ToolSchema or a mapping, got {type(schema).__name__}")


class BaseTool:
    """verl's BaseTool: one object per tool, many instances (one per call in verl 0.9.1's agent
    loop, which creates, executes and releases an instance for every call).

    Args:
      config: the YAML entry's `config` mapping (its `type` included).
      tool_schema: the YAML entry's `tool_schema`, or None when the subclass's
        `get_openai_tool_schema` supplies it.
    """

    def __init__(self, config: dict, tool_schema: ToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"{type(self).__name__}: no tool_schema given and get_openai_tool_schema() "
                "returned None: add tool_schema to the tool's YAML entry"
            )
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> ToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Starts an instance (verl passes `create_kwargs=` from the row's tools_kwargs).

        Returns:
          (instance_id, the tool's creation response): a fresh uuid4 string when none is given.
        """
        return (str(uuid.uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        """Runs one call with the model's arguments.

        Returns:
          (response shown to the model, step reward, metrics).
        """
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The reward of the instance's state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Frees the instance."""
