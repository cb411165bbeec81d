"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(what Claude Code speaks through ``ANTHROPIC_BASE_URL``).

A request is translated into the shared chat request
(:func:`~mlx_ferrum.server.serving.prepare_chat`) and runs through the same planning, engine
requests and output processing as ``/v1/chat/completions``; this module maps shapes:

- ``system`` (a string or text blocks) -> one leading system message; ``messages`` with
  content as a string or blocks: ``text``; ``tool_use`` (assistant) -> ``tool_calls``;
  ``tool_result`` (user, ``is_error`` marked in the text) -> ``tool`` messages, placed
  before the user's other text; ``thinking`` / ``redacted_thinking`` blocks are left out
  of the prompt; ``image`` and ``document`` blocks are refused (the server reads text).
- ``tools`` (``name``, ``description``, ``input_schema``) -> chat tools (Anthropic's
  server tools, which have no ``input_schema``, are skipped); ``tool_choice`` ``auto`` /
  ``any`` (-> ``required``) / ``tool`` (-> that function) / ``none``, with
  ``disable_parallel_tool_use``; ``stop_sequences`` -> ``stop``; ``thinking`` ->
  the template variable ``enable_thinking``.
- The reply -> content blocks ``thinking``, ``text``, ``tool_use`` (``input`` parsed),
  ``stop_reason`` ``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``.

Streaming sends Anthropic's named SSE events: ``message_start`` (with
``usage.input_tokens``), ``ping`` every few seconds until the first token (a long prompt
being prefilled), per block ``content_block_start`` / ``content_block_delta``
(``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``,
then ``message_delta`` (stop reason, ``usage.output_tokens``) and ``message_stop``; a
failure after the stream began is an ``error`` event. Errors are answered in Anthropic's
shape (:func:`error_body`). Shapes follow docs.anthropic.com/en/api/messages and
/en/docs/build-with-claude/streaming.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import (ChatPlan, OpenAIServing, ServingError, TurnOutput, arguments_object, chat_prompt_ids, function_tool,
                      prepare_chat, tool_mode, turn_processor)

__all__ = ["MessagesRequest", "CountTokensRequest", "MessagesServing", "error_body", "messages_router", "ANTHROPIC_ERROR_TYPES",
           "ANTHROPIC_PREFIX"]

#: The path prefix of Anthropic's API: errors under it take Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"

#: Anthropic's error type per HTTP status (docs.anthropic.com/en/api/errors); a server
#: shutting down (503 elsewhere) answers 529 ``overloaded_error``, as Anthropic's API does
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 529: "overloaded_error"}

#: seconds between ``ping`` events while the first token is awaited
PING_INTERVAL_S = 5.0


def error_body(status: int, message: str) -> tuple[int, dict]:
    """``(status, body)`` of an error in Anthropic's shape,
    ``{"type": "error", "error": {"type", "message"}}``; 503 becomes 529 (overloaded)."""
    if status == 503:
        status = 529
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    messages: list[dict[str, Any]]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    #: ``{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}``
    tool_choice: Optional[dict[str, Any]] = None
    #: ``{"type": "enabled", "budget_tokens": N}`` or ``{"type": "disabled"}``
    thinking: Optional[dict[str, Any]] = None


class MessagesRequest(_Request):
    """``POST /v1/messages``; ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    #: ``{"format": {"type": "json_schema", "schema": {...}}, "effort": ...}`` (structured output)
    output_config: Optional[dict[str, Any]] = None


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: the prompt tokens a Messages request would use."""


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or of text blocks (``system``, a ``tool_result``'s content).

    Raises:
        ServingError: 400 for a block that is not text.
    """
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ServingError(400, f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ServingError(400, f"{where}.{j}: block type {kind!r} is not supported here: send text blocks",
                               param=f"{where}.{j}")
        out.append(b["text"])
    return "\n".join(out) if where == "system" else "".join(out)


def _messages(req: _Request) -> list[dict]:
    """Chat messages of an Anthropic request (see the module docstring).

    Raises:
        ServingError: 400 for an unknown role, a block that is not supported, or a
            malformed ``tool_use`` / ``tool_result``.
    """
    system = _text_of(req.system, "system")
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    names: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ServingError(400, f"{where}.role {role!r} is invalid: use user or assistant (system text goes in 'system')",
                               param=f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ServingError(400, f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            at = f"{where}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                    raise ServingError(400, f"{at}: a tool_use block needs 'id' and 'name'", param=at)
                names[b["id"]] = b["name"]
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise ServingError(400, f"{at}: a tool_result block needs 'tool_use_id'", param=f"{at}.tool_use_id")
                text = _text_of(b.get("content"), f"{at}.content")
                if b.get("is_error"):
                    text = f"Error: {text}"
                result = {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}
                if b["tool_use_id"] in names:
                    result["name"] = names[b["tool_use_id"]]
                results.append(result)
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning: no part of the next prompt
            elif kind in ("image", "document"):
                raise ServingError(400, f"{at}: {kind} blocks are not supported: this server serves a text-only model; "
                                   "send the content as text", param=f"{at}.type")
            else:
                raise ServingError(400, f"{at}: content block type {kind!r} is not supported in a {role} message",
                                   param=f"{at}.type")
        out.extend(results)
        if texts or calls or not results:
            message: dict = {"role": role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tools(req: _Request) -> tuple[Optional[list], Any, bool]:
    """``(chat tools, chat tool_choice, parallel_tool_calls)`` of an Anthropic request."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict):
                raise ServingError(400, f"tools.{i} must be a tool object", param=f"tools.{i}")
            if t.get("type") not in (None, "custom"):
                continue  # Anthropic's server tools (web search, bash ...): not run here
            schema = t.get("input_schema")
            if not isinstance(t.get("name"), str) or not isinstance(schema, dict):
                raise ServingError(400, f"tools.{i} needs 'name' and 'input_schema' (a JSON schema object)", param=f"tools.{i}")
            tools.append(function_tool(t["name"], t.get("description"), schema))
    choice, parallel = req.tool_choice, True
    if choice is None:
        return tools, None, parallel
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ServingError(400, "tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                           "\"name\": ...} or {\"type\": \"none\"}", param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return tools, {"any": "required"}.get(kind, kind), parallel


def to_chat_request(req: _Request) -> p.ChatCompletionRequest:
    """The shared chat request of an Anthropic request.

    Raises:
        ServingError: 400 for a malformed request (see :func:`_messages`, :func:`_tools`).
    """
    messages = _messages(req)
    if not any(m["role"] != "system" for m in messages):
        raise ServingError(400, "messages: at least one message is required", param="messages")
    tools, choice, parallel = _tools(req)
    kwargs = {}
    if isinstance(req.thinking, dict) and req.thinking.get("type") in ("enabled", "disabled"):
        kwargs["enable_thinking"] = req.thinking["type"] == "enabled"
    fields: dict = {}
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise ServingError(400, f"max_tokens: {req.max_tokens} is invalid: use an int >= 1", param="max_tokens")
        fields = dict(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k)
        config = req.output_config or {}
        if not isinstance(config, dict):
            raise ServingError(400, "output_config must be an object", param="output_config")
        fmt = config.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ServingError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                   param="output_config.format")
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if config.get("effort") is not None:
            kwargs["reasoning_effort"] = config["effort"]
    return p.ChatCompletionRequest(model=req.model, messages=[p.ChatMessage(**m) for m in messages], tools=tools,
                                   tool_choice=choice, parallel_tool_calls=parallel, chat_template_kwargs=kwargs or None,
                                   **fields)


class MessagesServing:
    """Serves ``/v1/messages`` and ``/v1/messages/count_tokens`` over an :class:`OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def count_tokens(self, req: CountTokensRequest) -> dict:
        """``{"input_tokens": N}``: the rendered prompt's length (blocking: a worker thread).

        Raises:
            ServingError: 404 unknown model, 400 invalid request.
        """
        self.serving.check_model(req.model)
        chat = to_chat_request(req)
        mode = tool_mode(chat)  # the same tool handling as a real request
        ids = chat_prompt_ids(self.serving, chat.messages, tools=mode.tools, template_kwargs=chat.chat_template_kwargs)
        return {"input_tokens": len(ids)}

    def _stop(self, req: MessagesRequest, turn: TurnOutput, out) -> tuple[str, Optional[str]]:
        """``(stop_reason, stop_sequence)`` of a finished reply."""
        if turn.calls and turn.finish_reason == "tool_calls":
            return "tool_use", None
        if turn.finish_reason == "length":
            return "max_tokens", None
        if turn.finish_reason == "stop" and req.stop_sequences:
            # the engine trims the stop string: the untrimmed text shows which one ended it
            full = self.serving.tokenizer.decode(out.token_ids)
            tail = full[len(out.text):] if full.startswith(out.text) else full
            for stop in req.stop_sequences:
                if stop and stop in tail:
                    return "stop_sequence", stop
        return "end_turn", None

    def _usage(self, choices) -> dict:
        u = self.serving._usage(choices)
        cached = u.prompt_tokens_details.cached_tokens
        # Anthropic counts cache reads apart from input_tokens (which are the uncached part)
        return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    async def create(self, req: MessagesRequest):
        """The message object (a dict), or an async iterator of SSE events when ``stream``.

        Raises:
            ServingError: 404 unknown model, 400 invalid request, 500 engine failure,
                503 shutting down (answered as 529 by the app).
        """
        plan = await prepare_chat(self.serving, to_chat_request(req))
        mid = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return self._stream(mid, req, plan)
        choices = await self.serving._submit(plan.items, plan.lora)
        async for _ in self.serving._merged(choices):
            pass
        self.serving._raise_failed(choices)
        out = choices[0].last
        turn = turn_processor(self.serving, plan).finish(out)
        content: list[dict] = []
        if turn.reasoning is not None:
            content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
        if turn.content:
            content.append({"type": "text", "text": turn.content})
        for call in turn.calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call.arguments)})
        stop_reason, stop_sequence = self._stop(req, turn, out)
        return {"id": mid, "type": "message", "role": "assistant", "model": plan.name, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage(choices)}

    async def _stream(self, mid: str, req: MessagesRequest, plan: ChatPlan) -> AsyncIterator[str]:
        """The SSE events of one streamed message (see the module docstring)."""
        start = {"id": mid, "type": "message", "role": "assistant", "model": plan.name, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                           "cache_creation_input_tokens": 0}}
        yield _event("message_start", message=start)
        submit = asyncio.ensure_future(self.serving._submit(plan.items, plan.lora))
        try:
            while True:  # pings while the prompt is prefilled
                done, _ = await asyncio.wait({submit}, timeout=PING_INTERVAL_S)
                if done:
                    break
                yield _event("ping")
            try:
                choices = submit.result()
            except ServingError as e:
                yield _event("error", error=error_body(e.status, e.message)[1]["error"])
                return
        finally:
            if not submit.done():
                submit.cancel()
                await asyncio.gather(submit, return_exceptions=True)
        merged = self.serving._merged(choices)
        proc = turn_processor(self.serving, plan)
        index = -1
        open_kind: Optional[str] = None

        def open_block(kind: str) -> list[str]:
            nonlocal index, open_kind
            events = close_block()
            index += 1
            open_kind = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            events.append(_event("content_block_start", index=index, content_block=block))
            return events

        def close_block() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            events = []
            if open_kind == "thinking":
                events.append(_event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""}))
            events.append(_event("content_block_stop", index=index))
            open_kind = None
            return events

        try:
            turn, out = None, None
            async for _, out in merged:
                reasoning, content, finished = proc.deltas(out)
                turn = finished or turn
                for kind, delta in (("thinking", reasoning), ("text", content)):
                    if not delta:
                        continue
                    if open_kind != kind:
                        for e in open_block(kind):
                            yield e
                    key = "thinking_delta" if kind == "thinking" else "text_delta"
                    yield _event("content_block_delta", index=index, delta={"type": key, kind: delta})
            for e in close_block():
                yield e
            if turn is None or turn.finish_reason == "error":
                message = (out.error if out is not None else None) or "the request failed in the engine"
                yield _event("error", error={"type": "api_error", "message": message})
                return
            for call in turn.calls:
                index += 1
                yield _event("content_block_start", index=index,
                             content_block={"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                yield _event("content_block_delta", index=index,
                             delta={"type": "input_json_delta", "partial_json": call.arguments})
                yield _event("content_block_stop", index=index)
            stop_reason, stop_sequence = self._stop(req, turn, out)
            yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         usage=self._usage(choices))
            yield _event("message_stop")
        finally:
            await merged.aclose()


def _event(kind: str, **fields) -> str:
    data = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def messages_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """The ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` routes over ``serving``."""
    api = MessagesServing(serving)
    router = ApiRouter(limits, dependencies=dependencies)

    # ?beta=true and anthropic-beta headers change nothing here
    router.post_reply(ANTHROPIC_PREFIX, MessagesRequest, api.create, name="create_message")

    @router.post_json(f"{ANTHROPIC_PREFIX}/count_tokens", CountTokensRequest)
    async def count_tokens(request: Request):
        body = await router.body(request, CountTokensRequest)
        return await run_in_threadpool(api.count_tokens, body)

    return router
