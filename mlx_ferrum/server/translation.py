"""The one translation every chat API goes through, and its output processing.

``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` differ in their shapes
only. Each API module turns its request into a :class:`~mlx_ferrum.server.protocol.ChatCompletionRequest`
(messages in OpenAI's chat form, OpenAI ``tools`` / ``tool_choice``, ``response_format``,
sampling fields, stops, ``chat_template_kwargs``), which
:meth:`~mlx_ferrum.server.serving.OpenAIServing.plan_chat` renders through the chat
template, checks and turns into engine requests (sampling parameters, stops, the grammar
of ``response_format`` or of a forced ``tool_choice``). Every engine output then goes
through one :class:`TurnProcessor`, which splits reasoning from the answer
(``--reasoning-parser``) and reads tool calls from the answer (never from the
reasoning); the API modules only reshape its :class:`TurnOutput` and stream deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from . import tool_parsers
from .reasoning import ReasoningParser
from .tool_parsers import ToolCall, ToolParser

__all__ = ["ToolMode", "TurnOutput", "TurnProcessor", "merge_system", "function_tool", "RESERVED_TEMPLATE_VARIABLES"]

#: Template variables the server sets itself: ``chat_template_kwargs`` may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                         "unk_token", "pad_token", "documents", "chat_template"})


@dataclass
class ToolMode:
    """How a chat request uses tools: ``kind`` ``auto`` (parse the model's own syntax),
    ``required`` or ``named`` (the output is constrained JSON), or None (no tools, or
    ``tool_choice: "none"``, which hides them from the template)."""

    kind: Optional[str] = None
    name: Optional[str] = None
    tools: Optional[list] = None


@dataclass
class TurnOutput:
    """A finished reply, read: ``reasoning`` (None without a reasoning parser or when the
    model wrote none), ``content`` (None when the reply is only tool calls), ``calls``,
    and ``finish_reason`` (``tool_calls`` when calls ended the reply; else the engine's
    ``stop`` / ``length`` / ``abort`` / ``error``)."""

    reasoning: Optional[str]
    content: Optional[str]
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: Optional[str] = None


class TurnProcessor:
    """Reads one choice's outputs: what may be streamed now, and the final reading.

    Args:
        tokenizer: decodes the ids again with special tokens where a parser needs them.
        mode: the request's :class:`ToolMode`.
        tool_parser: the server's :class:`~mlx_ferrum.server.tool_parsers.ToolParser`.
        reasoning_parser: the server's parser, or None (the text stays as written).
        constrained: True when a grammar shapes the output from its first token
            (``response_format``, a forced tool): there is no reasoning to split then.

    Streaming: :meth:`step` on each unfinished output returns the ``(reasoning, content)``
    text added since the last call that is certain (no partial marker, no possible start
    of a tool call); :meth:`finish` on the last output gives the whole reading and
    :meth:`rest` what of it was not streamed yet.
    """

    def __init__(self, tokenizer, mode: ToolMode, tool_parser: ToolParser,
                 reasoning_parser: Optional[ReasoningParser] = None, constrained: bool = False):
        self.tokenizer = tokenizer
        self.mode = mode
        self.tool_parser = tool_parser
        forced = mode.kind in ("required", "named")
        self.reasoning = None if (constrained or forced) else reasoning_parser
        self.sent_reasoning = 0
        self.sent_content = 0

    def _full_text(self, out) -> str:
        """The reply decoded with its special tokens (end-of-sequence ids left out)."""
        eos = getattr(self.tokenizer, "eos_token_ids", set()) or set()
        return self.tokenizer.decode([t for t in out.token_ids if t not in eos], skip_special_tokens=False)

    def _split(self, out, finished: bool):
        if self.reasoning is None:
            return None, out.text, []
        source = self._full_text(out) if self.reasoning.needs_special_tokens else out.text
        s = self.reasoning.split(source, finished)
        return s.reasoning, s.content, s.calls

    def step(self, out) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` that may be sent for an unfinished output."""
        reasoning, content, _ = self._split(out, False)
        reasoning = reasoning or ""
        if self.mode.kind in ("required", "named"):
            end = 0  # the reply is the calls' JSON: sent as calls once complete
        elif self.mode.kind == "auto":
            end = self.tool_parser.content_end(content)
        else:
            end = len(content)
        r_delta = reasoning[self.sent_reasoning:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        c_delta = content[self.sent_content:end] if end > self.sent_content else ""
        self.sent_content = max(self.sent_content, end)
        return r_delta, c_delta

    def finish(self, out) -> TurnOutput:
        """The reading of a finished output (reasoning, answer, tool calls)."""
        reasoning, text, harmony_calls = self._split(out, True)
        kind = self.mode.kind
        if kind is None:
            content, calls = text, []
        elif kind in ("required", "named"):
            calls = tool_parsers.forced_calls(text, self.mode.name)
            content = None if calls else text
        elif harmony_calls:
            content, calls = (text or None), harmony_calls
        elif self.reasoning is not None:
            parsed, calls = self.tool_parser.parse(text)
            content = parsed if calls else text
        else:
            # the model's own syntax may use special tokens (Mistral's [TOOL_CALLS]): read them too
            parsed, calls = self.tool_parser.parse(self._full_text(out))
            content = parsed if calls else text
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return TurnOutput(reasoning, content, calls, finish)

    def deltas(self, out) -> tuple[str, str, Optional[TurnOutput]]:
        """``(reasoning delta, content delta, turn)`` of one engine output: the turn (see
        :meth:`finish`) once ``out`` is finished, with whatever :meth:`step` held back."""
        if not out.finished:
            return (*self.step(out), None)
        turn = self.finish(out)
        return (*self.rest(turn), turn)

    def rest(self, result: TurnOutput) -> tuple[str, str]:
        """``(reasoning, content)`` of ``result`` not yet sent by :meth:`step`."""
        r_rest = (result.reasoning or "")[self.sent_reasoning:]
        c_rest = (result.content or "")[self.sent_content:]
        self.sent_reasoning += len(r_rest)
        self.sent_content += len(c_rest)
        return r_rest, c_rest


def merge_system(messages: list[dict]) -> list[dict]:
    """``messages`` with every ``system`` / ``developer`` message's text merged into one
    leading system message (joined by blank lines), since many chat templates (Qwen's
    among them) refuse a system message after the first; other messages keep their order."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m.get("content")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def function_tool(name: Any, description: Any, parameters: Any) -> dict:
    """An OpenAI chat ``tools`` entry ``{"type": "function", "function": {...}}``."""
    fn: dict = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def arguments_object(arguments: str) -> Any:
    """A call's JSON ``arguments`` text as a value (``{}`` for text that is not JSON)."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
