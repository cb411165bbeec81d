"""The one request-to-engine translation every chat API goes through, and its output processing.

``/v1/chat/completions`` (:mod:`.chat_completions`), ``/v1/responses`` (:mod:`.responses`)
and ``/v1/messages`` (:mod:`.anthropic_messages`) differ in their shapes only. Each API
module turns its request into a :class:`~mlx_ferrum.server.protocol.ChatCompletionRequest`
(messages in OpenAI's chat form, OpenAI ``tools`` / ``tool_choice``, ``response_format``,
sampling fields, stops, vLLM's ``chat_template_kwargs``), which :func:`prepare_chat`
checks, renders through the chat template and turns into engine requests (the sampling
parameters of :mod:`.sampling`, the grammar of ``response_format`` or of a forced
``tool_choice``): a :class:`ChatPlan`. Every engine output then goes through one
:class:`TurnProcessor`, which splits reasoning from the answer (``--reasoning-parser``)
and reads tool calls from the answer (never from the reasoning); the API modules only
reshape its :class:`TurnOutput` and stream deltas. Messages reach the template as vLLM
passes them (tool-call arguments as objects, ``tool_call_id`` kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.concurrency import run_in_threadpool

from ..engine.structured import StructuredOutputsParams
from ..errors import ChatTemplateError, FerrumError
from . import protocol as p
from . import tool_parsers
from .reasoning import ReasoningParser
from .sampling import (TOP_LOGPROBS_MAX, EngineRequest, check_unimplemented, constraint_fields, engine_requests,
                       output_constraint)
from .serving import OpenAIServing, ServingError
from .tool_parsers import ToolCall, ToolParser

__all__ = ["ChatPlan", "ToolMode", "TurnOutput", "TurnProcessor", "prepare_chat", "turn_processor", "tool_mode",
           "chat_prompt_ids", "template_message", "merge_system", "function_tool", "arguments_object",
           "RESERVED_TEMPLATE_VARIABLES"]

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
class ChatPlan:
    """A checked chat request (of any chat API): its engine requests ``items``
    (``(prompt index, ids, SamplingParams)``), tool ``mode``, LoRA adapter, whether a
    grammar constrains the output, and the model ``name`` to report."""

    items: list
    mode: ToolMode
    lora: Optional[str]
    constrained: bool
    name: str

    @property
    def prompt_tokens(self) -> int:
        return len(self.items[0][1])



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


# ------------------------------------------------------------------ the request side
async def prepare_chat(serving: OpenAIServing, req: p.ChatCompletionRequest) -> ChatPlan:
    """Check a chat request and plan its engine requests (template, tools, sampling,
    grammar); the shared first half of every chat API (chat, Responses, Messages).

    Raises:
        ServingError: 404 unknown model, 400 invalid request, 503 shutting down.
    """
    serving.check_alive()
    lora = serving.check_model(req.model)
    check_unimplemented(req)
    serving._check_counts(req.n, 1)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= TOP_LOGPROBS_MAX:
        raise ServingError(400, f"top_logprobs={req.top_logprobs} is invalid: use 0 to {TOP_LOGPROBS_MAX}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ServingError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    mode = tool_mode(req)
    items = await run_in_threadpool(_chat_engine_requests, serving, req, mode)
    constrained = any(params.structured_outputs is not None for _, _, params in items)
    return ChatPlan(items, mode, lora, constrained, req.model or serving.model_names[0])


def turn_processor(serving: OpenAIServing, plan: ChatPlan) -> TurnProcessor:
    """A fresh :class:`TurnProcessor` for one choice of ``plan``, with the server's parsers."""
    return TurnProcessor(serving.tokenizer, plan.mode, serving.tool_parser, serving.reasoning_parser, plan.constrained)


def _chat_engine_requests(serving: OpenAIServing, req: p.ChatCompletionRequest, mode: ToolMode) -> list[EngineRequest]:
    """Render and tokenize the messages (with the tools), compile the output
    constraint, then build each choice's parameters (worker thread)."""
    ids = serving._check_ids(chat_prompt_ids(serving, req.messages, tools=mode.tools, template_kwargs=req.chat_template_kwargs),
                             param="messages", what="the rendered chat prompt")
    serving._count_prompt_tokens(len(ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    spec, field = output_constraint(req)
    if mode.kind == "named":  # the output is the function's arguments
        tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
        spec, field = StructuredOutputsParams(json=tool["function"].get("parameters") or {"type": "object"}), "tools"
    elif mode.kind == "required":  # a non-empty JSON list of calls
        spec, field = StructuredOutputsParams(json=tool_parsers.required_schema(mode.tools, req.parallel_tool_calls)), "tools"
    return engine_requests(serving, req, [ids], max_tokens, logprobs, constraint_fields(serving, spec, field))


def chat_prompt_ids(serving: OpenAIServing, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                    tools: Optional[list] = None, template_kwargs: Optional[dict] = None) -> list[int]:
    """The prompt ids of ``messages`` rendered through the server's chat template
    (blocking: tokenizes; call it from a worker thread). ``template_kwargs``: vLLM's
    ``chat_template_kwargs``, less the variables the server sets itself.

    Raises:
        ServingError: 400 naming ``messages`` for a bad message or a template that fails.
    """
    msgs = [template_message(m, i) for i, m in enumerate(messages)]
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_VARIABLES}
    if tools:
        kwargs["tools"] = tools
    try:
        return list(serving.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=serving.chat_template, **kwargs
        ))
    except ChatTemplateError as e:
        raise ServingError(400, f"{e} (or start the server with --chat-template FILE)", param="messages") from None
    except FerrumError as e:  # e.g. the rendered prompt is too long to tokenize
        raise ServingError(400, str(e), param="messages") from None


def tool_mode(req: p.ChatCompletionRequest) -> ToolMode:
    """Validate ``tools`` / ``tool_choice``.

    Raises:
        ServingError: 400 for a malformed tool, an unknown choice, or a named function
            that is not among the tools.
    """
    tools, choice = req.tools, req.tool_choice
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ServingError(400, "tool_choice needs tools: send the functions in 'tools'", param="tool_choice")
        return ToolMode()
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
        raise ServingError(400, "tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                           "\"parameters\": {...}}}", param="tools")
    for t in tools:
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ServingError(400, f"tool {t['function']['name']!r}: parameters must be a JSON schema object", param="tools")
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto"):
        return ToolMode("auto", tools=tools)
    if choice == "none":
        return ToolMode()
    if choice == "required":
        return ToolMode("required", tools=tools)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ServingError(400, f"tool_choice names {name!r}, which is not among the tools {names}", param="tool_choice")
        return ToolMode("named", name=name, tools=tools)
    raise ServingError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def template_message(m: p.ChatMessage, i: int) -> dict:
    """A message as chat templates read it: ``tool_calls`` with their arguments as dicts
    (vLLM does the same: templates write them with ``tojson``), ``tool_call_id`` and
    ``name`` of tool results kept.

    Raises:
        ServingError: 400 for a ``tool`` message without ``tool_call_id`` (a string) or
            without ``content``, as OpenAI answers: the template could not tie the
            result to its call.
    """
    extra = m.model_extra or {}
    if m.role == "tool":
        call_id = extra.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ServingError(400, "a message with role 'tool' needs 'tool_call_id', the id of the assistant tool "
                               "call it answers", param=f"messages.{i}.tool_call_id")
        if m.content is None:
            raise ServingError(400, "a message with role 'tool' needs 'content', the tool's result",
                               param=f"messages.{i}.content")
    msg = {"role": m.role, "content": _content_text(m.content, f"messages.{i}")}
    calls = extra.get("tool_calls")
    if calls:
        out = []
        for call in calls:
            call = dict(call)
            f = dict(call.get("function") or {})
            if isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = json.loads(f["arguments"])
                except ValueError:
                    pass
            call["function"] = f
            out.append(call)
        msg["tool_calls"] = out
    for key in ("tool_call_id", "name"):
        if extra.get(key) is not None:
            msg[key] = extra[key]
    return msg



def _content_text(content, where: str) -> str:
    """A message's text: a string, or the ``text`` of its ``{"type": "text"}`` parts joined.

    Raises:
        ServingError: 400 for a part that is not text, or whose ``text`` is not a string
            (``where`` names the message in the error's ``param``).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise ServingError(400, f"content part type {part.get('type')!r} is not supported: send text parts only",
                               param=f"{where}.content.{j}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise ServingError(400, f"a text content part needs 'text' as a string, got {type(text).__name__}: "
                               "send {\"type\": \"text\", \"text\": \"...\"}", param=f"{where}.content.{j}.text")
        parts.append(text)
    return "".join(parts)
