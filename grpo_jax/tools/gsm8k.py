"""verl's GSM8K answer tool (`Gsm8kTool`, verl/tools/gsm8k_tool.py up to verl 0.5; verl 0.9.1
ships none): the model submits its answer by calling `calc_gsm8k_reward`, and the tool scores it
against the row's ground truth.

configs/tools/gsm8k_tool.yaml declares it; a row passes its ground truth as
extra_info.tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}.

verl's semantics, kept:
  * execute(answer): a non-string answer is str()-ed; "#### " is prepended unless the answer
    starts with it; the instance's reward becomes verl's GSM8K score of that text against the
    ground truth ("flexible" extraction: the last number in it; 1.0 on an exact string match,
    else 0.0), and the response text is verl's: `Current parsed answer='72' reward=1.0`.
  * the step reward is 0.0 when the score beats the instance's previous one, else -0.05 (a
    penalty for an answer that does not improve). verl 0.9.1's agent loop creates a new instance
    for every call (tools.executor does the same), so the previous score is always 0.0 there: a
    right answer earns 0.0 and a wrong one -0.05.
  * with no number in the answer the score is the int 0, as verl's ("reward=0" in the text).
  * calc_reward returns the instance's score; release forgets the instance.
The score is grpo_jax.rewards.scorers.gsm8k_score, which reproduces verl's compute_score.
"""

from __future__ import annotations

import uuid
from typing import Any

from grpo_jax.rewards import scorers
from grpo_jax.tools import base

# verl's schema for this tool (its docstring and examples/.../gsm8k_tool_config.yaml), used when
# the YAML entry gives none.
SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if your answer is "
        "correct, 0.0 if your answer is incorrect)",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "The model's answer to the GSM8K math problem, must be a digits",
                },
            },
            "required": ["answer"],
        },
    },
}
NO_IMPROVEMENT_PENALTY = -0.05  # verl's step reward for an answer that does not beat the last


class Gsm8kTool(base.BaseTool):
    """Scores submitted GSM8K answers; one instance per trajectory call (see module docstring)."""

    def __init__(self, config: dict, tool_schema: base.ToolSchema | None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> base.ToolSchema:
        schema = getattr(self, "tool_schema", None)
        return schema if schema is not None else base.ToolSchema.model_validate(SCHEMA)

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ) -> tuple[str, base.ToolResponse]:
        """Args: ground_truth directly, or in create_kwargs={"ground_truth": ...} (verl's)."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth,
                                        "reward": 0.0}  # fmt: skip
        return instance_id, base.ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[base.ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        # verl's f"Current parsed {answer=} {reward=}": both repr()-ed
        text = f"Current parsed answer={answer!r} reward={reward!r}"
        return base.ToolResponse(text=text), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        if scorers.gsm8k_extract(state["response"], method="flexible") is None:
            # verl's compute_score returns the int 0 when it finds no number, and the tool's
            # text shows it ("reward=0"); gsm8k_score's float 0.0 would print "reward=0.0".
            return 0
        return scorers.gsm8k_score(state["response"], state["ground_truth"], method="flexible",
                                   format_score=0.0, score=1.0)  # fmt: skip

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instances[instance_id]
