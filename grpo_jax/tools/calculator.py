"""A calculator tool: evaluates an arithmetic expression (numbers, + - * / // % **, parentheses)
without eval. verl's tool interface (base.BaseTool); the schema's function is `calculator`
with one string argument, `expression`.

Bad expressions (a name, a call, a huge power, division by zero) answer an error text, as a
tool's response does, never raise.
"""

from __future__ import annotations

import ast
import operator

from grpo_jax.tools import base

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression such as 12*(3+4).",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "the expression to evaluate"}
            },
            "required": ["expression"],
        },
    },
}
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_LENGTH = 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression. Raises ValueError for anything else."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents above {MAX_EXPONENT} are refused")
            try:
                return _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed: {expression!r}")

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return result


class CalculatorTool(base.BaseTool):
    """Answers the value of `expression`; its step reward is 0."""

    def __init__(self, config: dict | None = None, tool_schema=None):
        super().__init__(config or {}, tool_schema or base.ToolSchema.model_validate(SCHEMA))

    async def execute(self, instance_id, parameters, **kwargs):
        try:
            text = str(evaluate(str(parameters.get("expression", ""))))
        except ValueError as e:
            text = f"error: {e}"
        return base.ToolResponse(text=text), 0.0, {}
