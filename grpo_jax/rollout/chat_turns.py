"""Token in, token out: the tokens a multi-turn rollout appends between the model's turns.

A multi-turn trajectory is one token stream: the prompt, the model's first turn as sampled,
the tool responses (or a user turn) in the chat template, the model's next turn, and so on.
The model's tokens are never decoded and re-tokenised: re-templating a conversation changes
token ids (a template that strips the reasoning, moves whitespace or renders tool calls its own
way), and the trainer would score tokens the policy never produced. So, as verl 0.9.1's
"continuous token" builder (verl/utils/tokenizer/continuous_token.py), only the appended
messages are rendered, each against a fixed synthetic prefix, and their tokens are the suffix
the template adds to that prefix:

    tool tokens = render(prefix + [assistant with the calls] + tool messages, generation prompt)
                  minus render(prefix + [assistant with the calls])

`ChatTurns.tool_tokens` and `user_tokens` do that (a template whose render of the prefix is not a
prefix of the longer render raises a ValueError naming the roles). Where the model's turn ended
on a stop token that the template follows with more tokens (ChatML's "<|im_end|>" then "\\n"),
those tokens go in between (`boundary`), as verl's Qwen builder inserts the newline; they are
found once from the template itself, not hard-coded per model family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_SYSTEM = {"role": "system", "content": "synthetic system"}
_USER = {"role": "user", "content": "synthetic user"}
_ASSISTANT_TEXT = "synthetic assistant"


def _ids(out) -> list[int]:
    """apply_chat_template(tokenize=True)'s ids, whatever container this transformers returns."""
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


class ChatTurns:
    """The chat template's tokens around a multi-turn rollout's turns.

    Args:
      tokenizer: a transformers tokenizer with a chat template.
      tools: the OpenAI tool schemas the prompts were rendered with (the template's `tools=`).
      stop_ids: the token ids a model turn ends on (the engine's eos ids).
      chat_template_kwargs: data.apply_chat_template_kwargs.
    """

    def __init__(
        self,
        tokenizer,
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        stop_ids: Sequence[int] = (),
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "rollout.multi_turn needs a tokenizer with a chat template (tool responses and "
                "user turns are rendered in it)"
            )
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] or None
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.kwargs = dict(chat_template_kwargs or {})
        self.after_stop = self._after_stop()

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               generation_prompt: bool) -> list[int]:
        return _ids(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=self.tools,
                tokenize=True,
                add_generation_prompt=generation_prompt,
                **self.kwargs,
            )
        )

    def _after_stop(self) -> list[int]:
        """The tokens the template renders after an assistant turn's stop token ([] when the
        turn's end is not one of the stop ids, or nothing follows it)."""
        ids = self.render([_SYSTEM, _USER, {"role": "assistant", "content": _ASSISTANT_TEXT}],
                          generation_prompt=False)
        ends = [i for i, t in enumerate(ids) if t in self.stop_ids]
        return ids[ends[-1] + 1 :] if ends else []

    def boundary(self, last_token: int | None) -> list[int]:
        """Tokens to insert after a model turn that ended on `last_token`, before the appended
        messages (what the template has there and the sampler did not produce)."""
        return list(self.after_stop) if last_token in self.stop_ids else []

    def _suffix(self, prefix: list[dict], appended: list[dict]) -> list[int]:
        short = self.render(prefix, generation_prompt=False)
        full = self.render(prefix + appended, generation_prompt=True)
        if full[: len(short)] != short:
            roles = [m.get("role") for m in appended]
            raise ValueError(
                f"the chat template does not render {roles} messages by appending to the "
                "conversation (its render of the earlier turns changed), so their tokens cannot "
                "be appended to the sampled ones; use a template that renders turns append-only"
            )
        return full[len(short) :]

    def tool_tokens(self, calls: Sequence[Mapping[str, Any]],
                    responses: Sequence[str]) -> list[int]:
        """The tokens of one turn's tool responses (`responses[i]` answers `calls[i]`, a
        {"name", "arguments"} dict), then the generation prompt of the model's next turn."""
        tool_calls = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": str(c.get("name") or "tool"),
                    "arguments": c.get("arguments") if isinstance(c.get("arguments"), dict)
                    else {},
                },
            }
            for i, c in enumerate(calls)
        ]
        assistant = {"role": "assistant", "content": "", "tool_calls": tool_calls}
        messages = [
            {"role": "tool", "content": text, "tool_call_id": f"call_{i}",
             "name": tool_calls[i]["function"]["name"]}
            for i, text in enumerate(responses)
        ]
        return self._suffix([_SYSTEM, _USER, assistant], messages)

    def user_tokens(self, content: str) -> list[int]:
        """The tokens of a user turn (an interaction's reply), then the generation prompt."""
        assistant = {"role": "assistant", "content": _ASSISTANT_TEXT}
        return self._suffix([_SYSTEM, _USER, assistant], [{"role": "user", "content": content}])


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's tool-response truncation (rollout.multi_turn.max_tool_response_length, in
    characters, and tool_response_truncate_side "left" | "right" | "middle")."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]

