"""OpenAI's chat completions: ``POST /v1/chat/completions``.

The request (OpenAI's ``ChatCompletionRequest`` fields, with vLLM's extras: ``top_k``,
``min_p``, ``repetition_penalty``, ``structured_outputs`` / ``guided_*``,
``chat_template_kwargs``) goes through the one chat translation of :mod:`.serving`
(:func:`~mlx_ferrum.server.serving.prepare_chat`, the same as ``/v1/responses`` and
``/v1/messages``), its ``n`` engine requests through
:class:`~mlx_ferrum.server.serving.OpenAIServing`. The reply is a ``chat.completion`` or,
with ``stream``, SSE ``chat.completion.chunk`` events ending in ``data: [DONE]``:
``reasoning_content`` deltas (vLLM's name) when a reasoning parser runs, ``tool_calls``
deltas in OpenAI's shape with ``index``, ``usage`` last with
``stream_options.include_usage``. Shapes follow OpenAI's API reference; the batching of
``n`` choices and the ``usage`` fields follow vLLM's ``serving_chat.py``.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator, Optional

from ..engine import RequestOutput
from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import (ChatPlan, Choice, OpenAIServing, chunk_head, json_text, prepare_chat, scored, stream_error_event,
                      turn_processor)

__all__ = ["ChatCompletionsServing", "chat_completions_router"]


class ChatCompletionsServing:
    """Serves ``/v1/chat/completions`` over an :class:`OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: p.ChatCompletionRequest):
        """The reply to a chat request: a :class:`ChatCompletionResponse` whose ``n``
        choices hold each reply's content, reasoning and tool calls, or with ``stream`` an
        async iterator of its SSE lines (see the module's docstring).

        Raises:
            ServingError: 404 unknown model, 400 invalid request or refused at admission,
                429 server busy, 503 shutting down; a failure after the stream began is
                an error event of the stream instead.
        """
        s = self.serving
        plan = await prepare_chat(s, req)
        mode = plan.mode
        choices = await s._submit(plan.items, plan.lora)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        name = plan.name
        if req.stream:
            if mode.kind is not None or s.reasoning_parser is not None:
                return self._tool_stream(req, choices, rid, name, plan)
            return self._stream(req, choices, rid, name)
        async for _ in s._merged(choices):
            pass
        s._raise_failed(choices)
        out_choices = []
        for c in choices:
            turn = turn_processor(s, plan).finish(c.last)
            out_choices.append(p.ChatCompletionChoice(
                index=c.index, message=p.ChatResponseMessage(content=turn.content, reasoning_content=turn.reasoning,
                                                             tool_calls=[k.openai() for k in turn.calls] or None),
                logprobs=self._logprobs(c.last, 0), finish_reason=turn.finish_reason,
            ))
        return p.ChatCompletionResponse(id=rid, model=name, usage=s._usage(choices), choices=out_choices)

    def _logprobs(self, out: RequestOutput, start: int) -> Optional[p.ChatChoiceLogprobs]:
        """OpenAI's chat ``logprobs`` of the scored tokens ``start:`` of ``out`` (None without logprobs)."""
        if out.logprobs is None:
            return None
        s = self.serving
        content = []
        tops = out.top_logprobs or []
        for i in range(start, scored(out)):
            tid = out.token_ids[i]
            tok = s.token_text(tid)
            alts = [
                p.TopLogprob(token=s.token_text(a), logprob=lp, bytes=list(s.token_text(a).encode()))
                for a, lp in (tops[i].items() if i < len(tops) else ())
            ]
            content.append(p.ChatLogprob(token=tok, logprob=out.logprobs[i], bytes=list(tok.encode()), top_logprobs=alts))
        return p.ChatChoiceLogprobs(content=content)

    async def _stream(self, req, choices: list[Choice], rid: str, name: str) -> AsyncIterator[str]:
        """A streamed chat completion without tools or reasoning parser: each output's
        text delta as it comes (with its logprobs)."""
        s = self.serving
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_list, usage=None) -> str:
            c = p.ChatCompletionChunk(id=rid, model=name, choices=choice_list, usage=usage)
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        head = chunk_head(rid, "chat.completion.chunk", name)
        merged = s._merged(choices)
        try:
            for c in choices:
                yield chunk([p.ChatCompletionStreamChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))])
            sent = {c.index: 0 for c in choices}
            async for c, out in merged:
                if out.finish_reason == "error":
                    yield stream_error_event(out)
                    return
                fresh = out.logprobs is not None and scored(out) > sent[c.index]
                if not out.delta and not out.finished and not fresh:
                    continue  # the detokenizer holds this token back (stop match or partial UTF-8)
                choice = {"index": c.index, "delta": {"content": out.delta}, "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    choice["logprobs"] = self._logprobs(out, sent[c.index]).model_dump(exclude_none=True)
                    sent[c.index] = scored(out)
                # built by hand: this runs once per token per stream, and pydantic here cost
                # more event-loop time than the rest of the request path
                yield head + json_text(choice) + "]}\n\n"
            if include_usage:
                yield chunk([], usage=s._usage(choices))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()

    async def _tool_stream(self, req, choices: list[Choice], rid: str, name: str, plan: ChatPlan) -> AsyncIterator[str]:
        """A streamed chat completion read by a :class:`TurnProcessor` (tools or a
        reasoning parser): reasoning streams as ``reasoning_content`` deltas, content
        until the text may be starting a tool call (auto), and the calls come as
        ``tool_calls`` deltas once the reply is complete (each call whole, OpenAI's delta
        shape with ``index``)."""
        s = self.serving
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = chunk_head(rid, "chat.completion.chunk", name)
        merged = s._merged(choices)
        processors = {c.index: turn_processor(s, plan) for c in choices}

        def delta_chunk(index: int, reasoning: str, content: str) -> str:
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            return head + json_text({"index": index, "delta": delta}) + "]}\n\n" if delta else ""

        try:
            for c in choices:
                yield head + json_text({"index": c.index, "delta": {"role": "assistant", "content": ""}}) + "]}\n\n"
            async for c, out in merged:
                if out.finish_reason == "error":
                    yield stream_error_event(out)
                    return
                proc = processors[c.index]
                if not out.finished:
                    text = delta_chunk(c.index, *proc.step(out))
                    if text:
                        yield text
                    continue
                turn = proc.finish(out)
                text = delta_chunk(c.index, *proc.rest(turn))
                if text:
                    yield text
                if turn.calls:
                    deltas = [k.openai(index=i) for i, k in enumerate(turn.calls)]
                    yield head + json_text({"index": c.index, "delta": {"tool_calls": deltas}}) + "]}\n\n"
                yield head + json_text({"index": c.index, "delta": {}, "finish_reason": turn.finish_reason}) + "]}\n\n"
            if include_usage:
                u = p.ChatCompletionChunk(id=rid, model=name, choices=[], usage=s._usage(choices))
                yield f"data: {u.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()


def chat_completions_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """The ``POST /v1/chat/completions`` route over ``serving``."""
    router = ApiRouter(limits, dependencies=dependencies)
    router.post_reply("/v1/chat/completions", p.ChatCompletionRequest, ChatCompletionsServing(serving).create,
                      name="chat_completions")
    return router
