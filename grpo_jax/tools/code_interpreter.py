"""A Python code interpreter tool: runs the model's code in `grpo_jax.sandbox` and answers its
output. verl's tool interface; the schema's function is `code_interpreter` with one string
argument, `code` (the name and argument of verl's SandboxFusionTool, which runs the code on a
remote SandboxFusion service instead).

Each call is a fresh sandboxed interpreter (a fresh temp dir, CPU-time, address-space, file-size
and process limits, no inherited environment, no network where the host allows it; see
grpo_jax/sandbox.py). The answer is the run's stdout, then its stderr when there is any, then
a status line when the run did not end normally ("[timeout]", "[memory]", ...); the multi-turn
rollout cuts it to rollout.multi_turn.max_tool_response_length characters. The tool's `config`
(the YAML entry's) may set the sandbox limits: cpu_seconds, wall_seconds, memory_bytes,
file_size_bytes, max_processes, max_output_bytes. Keep rollout.multi_turn.tool_timeout above
wall_seconds, so the sandbox ends a run before the executor abandons the call.
"""

from __future__ import annotations

import dataclasses

from grpo_jax import sandbox
from grpo_jax.tools import base

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Runs Python code and returns what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
        },
    },
}
LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(sandbox.Limits))


class CodeInterpreterTool(base.BaseTool):
    """Answers the output of running `code` in the sandbox; its step reward is 0."""

    def __init__(self, config: dict | None = None, tool_schema=None):
        config = dict(config or {})
        super().__init__(config, tool_schema or base.ToolSchema.model_validate(SCHEMA))
        unknown = sorted(set(config) - set(LIMIT_KEYS) - {"type"})
        if unknown:
            raise ValueError(f"code_interpreter config: unknown keys {unknown}; the sandbox "
                             f"limits are {list(LIMIT_KEYS)}")
        self.limits = sandbox.Limits(**{k: config[k] for k in LIMIT_KEYS if k in config})

    def execute(self, instance_id, parameters, **kwargs):
        # sync on purpose: the executor runs it on a worker thread, the sandbox blocks it
        result = sandbox.run_python(str(parameters.get("code", "")), limits=self.limits)
        return base.ToolResponse(text=answer(result)), 0.0, {"status": result.status}


def answer(result: sandbox.Result) -> str:
    """What the model reads back from one run."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.status != "ok":
        parts.append(f"[{result.status}]")
    return "\n".join(p for p in parts if p) or "[no output]"
