"""OpenAI's Responses API: ``POST /v1/responses`` (what Codex CLI speaks).

A request is translated into the shared chat request
(:func:`~mlx_ferrum.server.serving.prepare_chat`) and runs through the same planning, engine
requests and output processing as ``/v1/chat/completions``; this module only maps the
shapes:

- ``input`` (a string or items) -> chat messages: ``message`` items (roles ``user`` /
  ``assistant`` / ``system`` / ``developer``, parts ``input_text`` / ``output_text``),
  ``function_call`` -> an assistant message's ``tool_calls``, ``function_call_output`` ->
  a ``tool`` message; ``reasoning`` items and other item types (web search calls ...)
  are left out of the prompt. ``instructions`` and ``developer`` messages become system
  text, merged into one leading system message.
- ``tools`` of type ``function`` -> chat tools (other types, which Codex sends, are
  skipped); ``tool_choice`` ``auto`` / ``none`` / ``required`` / ``{"type": "function",
  "name"}``; ``text.format`` -> ``response_format``; ``reasoning.effort`` -> the template
  variable ``reasoning_effort``; ``max_output_tokens`` -> ``max_tokens``.
- The reply -> output items ``reasoning``, ``message`` (``output_text``), ``function_call``.

``store`` (default true, as OpenAI's) keeps each finished conversation in a bounded
in-memory :class:`ResponseStore` so that ``previous_response_id`` continues it; an id
the store does not hold (never stored, evicted, or from before a restart) is a 404.

Streaming sends OpenAI's semantic events (``response.created`` ... ``response.completed``)
as SSE with ``event:`` names and an increasing ``sequence_number``; a prompt over the
context is reported as ``response.failed`` with code ``context_length_exceeded``, and an
engine failure as ``response.failed`` with code ``server_error``. Shapes follow OpenAI's
API reference (platform.openai.com/docs/api-reference/responses).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional, Union

from pydantic import BaseModel, ConfigDict

from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import (ChatPlan, OpenAIServing, ServingError, TurnOutput, function_tool, merge_system, prepare_chat,
                      turn_processor)

__all__ = ["ResponsesRequest", "ResponseStore", "ResponsesServing", "responses_router"]


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``; fields OpenAI defines and this server does not use
    (``include``, ``metadata`` beyond echoing it, ``prompt_cache_key``, ``truncation`` ...)
    are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = ""
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    #: ``{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}``
    text: Optional[dict[str, Any]] = None
    #: ``{"effort": "low" | "medium" | "high", "summary": ...}``
    reasoning: Optional[dict[str, Any]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    include: Optional[list[str]] = None
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    user: Optional[str] = None
    background: Optional[bool] = None


class ResponseStore:
    """The conversations of stored responses, ``{response id: chat messages}``; the
    oldest are evicted past ``max_responses`` entries or ``max_chars`` characters of
    message text in all (a bound on memory: each conversation may be up to a request
    body long). Thread-safe."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 1024 * 1024):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> Optional[list[dict]]:
        """A copy of the conversation stored under ``response_id`` (chat messages), or None."""
        with self._lock:
            entry = self._items.get(response_id)
            return None if entry is None else list(entry[0])

    def put(self, response_id: str, messages: list[dict]) -> None:
        """Store a response's whole conversation; the oldest entries go first past
        ``max_responses`` entries or ``max_chars`` characters of content."""
        size = sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or [])) for m in messages)
        with self._lock:
            self._items[response_id] = (messages, size)
            self._chars += size
            while self._items and (len(self._items) > self.max_responses or self._chars > self.max_chars):
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ServingError(400, f"{where} must be a content part object", param=where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise ServingError(400, f"{where}.text must be a string", param=f"{where}.text")
        return text
    if kind == "refusal":
        return str(part.get("refusal") or "")
    raise ServingError(400, f"content part type {kind!r} is not supported: this server reads text only "
                       "(input_text / output_text)", param=f"{where}.type")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))
    raise ServingError(400, f"{where} must be a string or a list of content parts", param=where)


def input_messages(items: Union[str, list], start: int = 0) -> list[dict]:
    """Chat messages of a Responses ``input`` (see the module docstring).

    Raises:
        ServingError: 400 for an item that is not an object, a role the API does not
            define, or a content part that is not text.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ServingError(400, f"{where} must be an input item object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ServingError(400, f"{where}.role {role!r} is invalid: use user, assistant, system or developer",
                                   param=f"{where}.role")
            messages.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ServingError(400, f"{where}: a function_call needs 'name' and 'arguments' (JSON text) as strings",
                                   param=where)
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ServingError(400, f"{where}: a function_call_output needs 'call_id'", param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            message = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        # reasoning items and tool types this server does not run are no part of the prompt
    return messages


def _tools(tools: Optional[list]) -> Optional[list]:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ServingError(400, f"tools.{i} must be a tool object", param=f"tools.{i}")
        if t.get("type") != "function":
            continue  # web_search, custom, local_shell ...: tools this server does not run
        out.append(function_tool(t.get("name"), t.get("description"), t.get("parameters")))
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ServingError(400, "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                       "\"name\": ...}", param="tool_choice")


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ServingError(400, "text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise ServingError(400, "text.format json_schema needs \"schema\": {a JSON schema object}", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"],
                                                   "strict": fmt.get("strict")}}


def to_chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[p.ChatCompletionRequest, list[dict]]:
    """The shared chat request of ``req`` after ``history`` (a stored conversation), and
    the conversation to store (history and input, without ``instructions``).

    Raises:
        ServingError: 400 for a malformed input, tool choice or text format.
    """
    conversation = list(history) + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = merge_system(system + conversation)
    if not any(m["role"] != "system" for m in messages):
        raise ServingError(400, "input is empty: send a string or at least one message item", param="input")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ServingError(400, f"max_output_tokens={req.max_output_tokens} is invalid: use an int >= 1",
                           param="max_output_tokens")
    kwargs = {}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    chat = p.ChatCompletionRequest(
        model=req.model, messages=[p.ChatMessage(**m) for m in messages], max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        chat_template_kwargs=kwargs or None, user=req.user,
    )
    return chat, conversation


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A ``message`` output item; ``in_progress`` (just added to a stream) has no content yet."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                            "logprobs": []}]}


def _reasoning_item(item_id: str, text: Optional[str]) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text is not None else []}


def _call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def _stored_reply(turn: TurnOutput) -> dict:
    """The reply as a chat message, for the stored conversation."""
    message: dict = {"role": "assistant", "content": turn.content or ""}
    if turn.calls:
        message["tool_calls"] = [c.openai() for c in turn.calls]
    return message


class ResponsesServing:
    """Serves ``/v1/responses`` over an :class:`OpenAIServing` (its planning, engine and
    output processing), with a :class:`ResponseStore` for ``previous_response_id``."""

    def __init__(self, serving: OpenAIServing, store: Optional[ResponseStore] = None):
        self.serving = serving
        self.store = store if store is not None else ResponseStore()

    def _history(self, req: ResponsesRequest) -> list[dict]:
        if req.previous_response_id is None:
            return []
        history = self.store.get(req.previous_response_id)
        if history is None:
            raise ServingError(404, f"previous response {req.previous_response_id!r} not found: this server keeps the last "
                               f"{self.store.max_responses} responses created with store=true (in memory, fewer when they are long, "
                               "until it restarts); "
                               "send the whole conversation in 'input' instead", param="previous_response_id",
                               code="previous_response_not_found")
        return history

    def _envelope(self, rid: str, req: ResponsesRequest, name: str, created: int, status: str, output: list,
                  usage: Optional[dict] = None, error: Optional[dict] = None, incomplete: Optional[dict] = None) -> dict:
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    def _usage(self, choices, turn: Optional[TurnOutput]) -> dict:
        u = self.serving._usage(choices)
        reasoning = len(self.serving.tokenizer.encode(turn.reasoning, add_special_tokens=False)) \
            if turn is not None and turn.reasoning else 0
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": min(reasoning, u.completion_tokens)},
                "total_tokens": u.total_tokens}

    @staticmethod
    def _status(turn: TurnOutput) -> tuple[str, Optional[dict]]:
        if turn.finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        if turn.finish_reason == "abort":
            return "incomplete", {"reason": "interrupted"}
        return "completed", None

    async def create(self, req: ResponsesRequest):
        """The response object (a dict), or an async iterator of SSE events when ``stream``.

        Raises:
            ServingError: 404 unknown model or ``previous_response_id``, 400 invalid
                request (a stream reports a prompt over the context as ``response.failed``),
                500 when the engine failed the request, 503 shutting down.
        """
        if req.background:
            raise ServingError(400, "'background' is not supported by this server: leave it out and wait for the "
                               "response (or stream it)", param="background")
        history = self._history(req)
        chat, conversation = to_chat_request(req, history)
        rid, created = _id("resp"), int(time.time())
        name = req.model or self.serving.model_names[0]
        try:
            plan = await prepare_chat(self.serving, chat)
            choices = await self.serving._submit(plan.items, plan.lora)
        except ServingError as e:
            if req.stream and e.code == "context_length_exceeded":
                return self._failed_stream(rid, req, name, created, e)
            raise
        if req.stream:
            return self._stream(rid, req, created, plan, choices, conversation)
        async for _ in self.serving._merged(choices):
            pass
        self.serving._raise_failed(choices)
        turn = turn_processor(self.serving, plan).finish(choices[0].last)
        status, incomplete = self._status(turn)
        output = []
        if turn.reasoning is not None:
            output.append(_reasoning_item(_id("rs"), turn.reasoning))
        if turn.content or not turn.calls:
            output.append(_message_item(_id("msg"), turn.content or "", "completed" if status == "completed" else "incomplete"))
        output.extend(_call_item(_id("fc"), call) for call in turn.calls)
        if req.store:
            self.store.put(rid, conversation + [_stored_reply(turn)])
        return self._envelope(rid, req, plan.name, created, status, output, self._usage(choices, turn), incomplete=incomplete)

    async def _failed_stream(self, rid, req, name, created, error: ServingError) -> AsyncIterator[str]:
        seq = itertools.count()
        for kind in ("response.created", "response.in_progress"):
            yield _event(kind, seq, response=self._envelope(rid, req, name, created, "in_progress", []))
        failed = self._envelope(rid, req, name, created, "failed", [], error={"code": error.code, "message": error.message})
        yield _event("response.failed", seq, response=failed)

    async def _stream(self, rid, req, created, plan: ChatPlan, choices, conversation) -> AsyncIterator[str]:
        """The SSE events of one streamed response (see the module docstring)."""
        seq = itertools.count()
        merged = self.serving._merged(choices)
        proc = turn_processor(self.serving, plan)
        output: list[dict] = []
        open_item: Optional[dict] = None  # the reasoning or message item receiving deltas
        texts: dict[str, str] = {}
        message_status = "completed"  # "incomplete" for the last message of a reply cut short

        def start(kind: str) -> list[str]:
            nonlocal open_item
            events = close()
            index = len(output)
            if kind == "reasoning":
                item = _reasoning_item(_id("rs"), None)
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = _message_item(_id("msg"), "", status="in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            output.append(item)
            open_item = item
            texts[item["id"]] = ""
            events.append(_event("response.output_item.added", seq, output_index=index, item=item))
            events.append(_event("response.content_part.added", seq, item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
            return events

        def add(kind: str, delta: str) -> list[str]:
            events = [] if open_item is not None and open_item["type"] == kind else start(kind)
            item = open_item
            texts[item["id"]] += delta
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(_event(name, seq, item_id=item["id"], output_index=len(output) - 1, content_index=0,
                                 delta=delta, **extra))
            return events

        def close() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            item, index = open_item, len(output) - 1
            text = texts[item["id"]]
            if item["type"] == "reasoning":
                done = _reasoning_item(item["id"], text)
                part = done["content"][0]
                events = [_event("response.reasoning_text.done", seq, item_id=item["id"], output_index=index,
                                 content_index=0, text=text)]
            else:
                done = _message_item(item["id"], text, message_status)
                part = done["content"][0]
                events = [_event("response.output_text.done", seq, item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[])]
            events.append(_event("response.content_part.done", seq, item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
            events.append(_event("response.output_item.done", seq, output_index=index, item=done))
            output[index] = done
            open_item = None
            return events

        try:
            envelope = self._envelope(rid, req, plan.name, created, "in_progress", [])
            yield _event("response.created", seq, response=envelope)
            yield _event("response.in_progress", seq, response=envelope)
            turn = None
            async for _, out in merged:
                reasoning, content, finished = proc.deltas(out)
                turn = finished or turn
                for kind, delta in (("reasoning", reasoning), ("message", content)):
                    if delta:
                        for e in add(kind, delta):
                            yield e
            if turn is None or turn.finish_reason == "error":
                message = (choices[0].last.error if choices[0].last is not None else None) or "the request failed in the engine"
                failed = self._envelope(rid, req, plan.name, created, "failed", output,
                                        error={"code": "server_error", "message": message})
                for e in close():
                    yield e
                yield _event("response.failed", seq, response=failed)
                return
            status, incomplete = self._status(turn)
            message_status = "completed" if status == "completed" else "incomplete"
            if not turn.calls and not output:  # an empty reply is still one message
                for e in start("message"):
                    yield e
            for e in close():
                yield e
            for call in turn.calls:
                index, item_id = len(output), _id("fc")
                yield _event("response.output_item.added", seq, output_index=index, item=_call_item(item_id, call, "in_progress"))
                yield _event("response.function_call_arguments.delta", seq, item_id=item_id, output_index=index,
                             delta=call.arguments)
                yield _event("response.function_call_arguments.done", seq, item_id=item_id, output_index=index,
                             name=call.name, arguments=call.arguments)
                done = _call_item(item_id, call)
                output.append(done)
                yield _event("response.output_item.done", seq, output_index=index, item=done)
            if req.store:
                self.store.put(rid, conversation + [_stored_reply(turn)])
            final = self._envelope(rid, req, plan.name, created, status, output, self._usage(choices, turn),
                                   incomplete=incomplete)
            yield _event("response.completed", seq, response=final)
        finally:
            await merged.aclose()


def _event(kind: str, seq, **fields) -> str:
    """One SSE event: ``event: <type>`` and its JSON with ``type`` and ``sequence_number``."""
    data = {"type": kind, "sequence_number": next(seq), **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def responses_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """The ``POST /v1/responses`` route over ``serving`` (with its own :class:`ResponseStore`)."""
    router = ApiRouter(limits, dependencies=dependencies)
    router.post_reply("/v1/responses", ResponsesRequest, ResponsesServing(serving).create, name="create_response")
    return router
