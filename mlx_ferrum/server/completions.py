"""OpenAI's (legacy) completions: ``POST /v1/completions``.

``prompt`` is a string, a list of strings, a list of token ids or a list of id lists
(each a prompt, each with ``n`` choices); ``echo`` returns the prompt first, with its
log-probabilities when ``logprobs`` is set, and ``echo`` with ``max_tokens: 0`` scores
the prompt only. The sampling fields (OpenAI's plus vLLM's extras) and the engine
requests go through :mod:`.serving` (:func:`~mlx_ferrum.server.serving.engine_requests`,
:class:`~mlx_ferrum.server.serving.OpenAIServing`). The reply is a ``text_completion``
or, with ``stream``, SSE chunks of the same object ending in ``data: [DONE]``. Shapes
(``logprobs`` with ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``)
follow OpenAI's API reference; ``n`` choices and ``usage`` follow vLLM's
``serving_completion.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from starlette.concurrency import run_in_threadpool

from ..engine import RequestOutput
from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import (TOP_LOGPROBS_MAX, Choice, OpenAIServing, ServingError, check_unimplemented, chunk_head, constraint_fields,
                      engine_requests, json_text, output_constraint, scored, stream_error_event)

__all__ = ["CompletionsServing", "completions_router"]


@dataclass
class _CompletionPlan:
    """A completions request's engine requests, plus what ``echo`` needs: the prompt
    texts (one per prompt; None without echo) and whether only the prompt is returned
    (``max_tokens: 0``)."""

    items: list
    texts: Optional[list[str]]
    prompt_only: bool


class CompletionsServing:
    """Serves ``/v1/completions`` over an :class:`OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: p.CompletionRequest):
        """The reply to a completions request: a :class:`CompletionResponse` with ``n``
        choices per prompt, in prompt order, or with ``stream`` an async iterator of its
        SSE lines.

        Raises:
            ServingError: 404 unknown model, 400 invalid request (a bad prompt shape,
                ``logprobs`` over 20, a prompt over the context) or refused at admission,
                429 server busy, 503 shutting down.
        """
        s = self.serving
        s.check_alive()
        lora = s.check_model(req.model)
        check_unimplemented(req)
        prompt = req.prompt
        # a list of token ids is one prompt; a list of strings or of id lists, several
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        s._check_counts(req.n, len(prompt) if several else 1)
        if req.logprobs is not None and not 0 <= req.logprobs <= TOP_LOGPROBS_MAX:
            raise ServingError(400, f"logprobs={req.logprobs} is invalid: use 0 to {TOP_LOGPROBS_MAX}", param="logprobs")
        plan = await run_in_threadpool(self._plan, req)
        choices = await s._submit(plan.items, lora)
        rid = f"cmpl-{uuid.uuid4().hex}"
        name = req.model or s.model_names[0]
        if req.stream:
            return self._stream(req, choices, rid, name, plan)
        async for _ in s._merged(choices):
            pass
        s._raise_failed(choices)
        return p.CompletionResponse(
            id=rid, model=name, usage=s._usage(choices, plan.prompt_only),
            choices=[self._choice(req, c, plan) for c in choices],
        )

    def _choice(self, req: p.CompletionRequest, c: Choice, plan: _CompletionPlan) -> p.CompletionChoice:
        """A finished choice; with ``echo`` the prompt (and its logprobs) comes first, and
        with ``max_tokens: 0`` only the prompt (the one token generated is dropped)."""
        s = self.serving
        out = c.last
        if not req.echo:
            return p.CompletionChoice(index=c.index, text=out.text, logprobs=self._completion_logprobs(out, 0, 0, s.tokenizer.detokenizer(prompt_ids=c.prompt_ids)),
                                      finish_reason=out.finish_reason)
        head = plan.texts[c.prompt_index]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._echo_logprobs(out, c.prompt_ids)
            if not plan.prompt_only:
                tail = self._completion_logprobs(out, 0, len(head), s.tokenizer.detokenizer(prompt_ids=c.prompt_ids))
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, key).extend(getattr(tail, key))
        if plan.prompt_only:
            return p.CompletionChoice(index=c.index, text=head, logprobs=logprobs, finish_reason="length")
        return p.CompletionChoice(index=c.index, text=head + out.text, logprobs=logprobs, finish_reason=out.finish_reason)

    def _plan(self, req: p.CompletionRequest) -> _CompletionPlan:
        """Tokenize and check the prompts under the prompt-token limit, then build each
        choice's parameters (worker thread: a large prompt never blocks the event loop)."""
        s = self.serving
        prompt = req.prompt
        many = isinstance(prompt, list) and bool(prompt)
        if isinstance(prompt, str):
            texts, id_lists = [prompt], None
        elif many and all(isinstance(x, int) for x in prompt):
            texts, id_lists = None, [prompt]
        elif many and all(isinstance(x, str) for x in prompt):
            texts, id_lists = prompt, None
        elif many and all(isinstance(x, list) for x in prompt):
            texts, id_lists = None, prompt
        else:
            raise ServingError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of lists "
                               "of token ids", param="prompt")
        total = 0
        prompts = []
        if id_lists is not None:
            s._count_prompt_tokens(sum(len(ids) for ids in id_lists))  # before reading any id
        count = len(texts if texts is not None else id_lists)
        for i in range(count):
            ids = s._encode(texts[i]) if texts is not None else list(id_lists[i])
            total += len(ids)
            s._count_prompt_tokens(total)  # stop tokenizing as soon as the request is over
            prompts.append(s._check_ids(ids, what="the prompt" if count == 1 else f"prompt {i}"))
        extra, max_tokens, prompt_only = constraint_fields(s, *output_constraint(req)), req.max_tokens, False
        if req.echo:
            if req.logprobs is not None:
                extra["prompt_logprobs"] = req.logprobs
            if max_tokens == 0:  # score the prompt only: one token is generated and dropped
                max_tokens, prompt_only = 1, True
        echo_texts = None
        if req.echo:
            echo_texts = list(texts) if texts is not None else [s.tokenizer.decode(ids) for ids in prompts]
        return _CompletionPlan(engine_requests(s, req, prompts, max_tokens, req.logprobs, extra), echo_texts, prompt_only)

    async def _stream(self, req, choices: list[Choice], rid: str, name: str, plan: _CompletionPlan) -> AsyncIterator[str]:
        """A streamed completion: the echoed prompt first (with ``echo``), then each
        output's text delta as it comes, with its logprobs and their text offsets."""
        s = self.serving
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = chunk_head(rid, "text_completion", name)
        merged = s._merged(choices)
        try:
            sent = {c.index: 0 for c in choices}
            offsets = {c.index: 0 for c in choices}  # where each completion's text starts (after an echo)
            detoks: dict = {}
            echoed: set[int] = set()
            async for c, out in merged:
                if out.finish_reason == "error":
                    yield stream_error_event(out)
                    return
                if req.echo and c.index not in echoed:
                    # the prompt first (its logprobs arrive with the request's first output)
                    echoed.add(c.index)
                    text = plan.texts[c.prompt_index]
                    offsets[c.index] = len(text)
                    choice = {"index": c.index, "text": text,
                              "finish_reason": "length" if plan.prompt_only and out.finished else None}
                    if req.logprobs is not None:
                        choice["logprobs"] = self._echo_logprobs(out, c.prompt_ids).model_dump(exclude_none=True)
                    yield head + json_text(choice) + "]}\n\n"
                if plan.prompt_only:
                    continue
                fresh = out.logprobs is not None and scored(out) > sent[c.index]
                if not out.delta and not out.finished and not fresh:
                    continue
                choice = {"index": c.index, "text": out.delta, "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    if c.index not in detoks:
                        detoks[c.index] = s.tokenizer.detokenizer(prompt_ids=c.prompt_ids)
                    lp = self._completion_logprobs(out, sent[c.index], offsets[c.index], detoks[c.index])
                    choice["logprobs"] = lp.model_dump(exclude_none=True)
                    sent[c.index] = scored(out)
                yield head + json_text(choice) + "]}\n\n"
            if include_usage:
                u = p.CompletionResponse(id=rid, model=name, choices=[], usage=s._usage(choices, plan.prompt_only))
                yield f"data: {u.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()

    def _echo_logprobs(self, out: RequestOutput, prompt_ids: list[int]) -> p.CompletionLogprobs:
        """The prompt part of an ``echo`` completion's ``logprobs``: every prompt token with
        its log-probability (null for the first) and top alternatives, offsets from 0."""
        s = self.serving
        lp = p.CompletionLogprobs()
        table = out.prompt_logprobs or [None] * len(prompt_ids)
        # offsets into the echoed text, as the prompt decodes: a hidden special token
        # (<s>) takes no characters
        detok = s.tokenizer.detokenizer()
        for tid, entry in zip(prompt_ids, table):
            tok = s.token_text(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry[tid] if entry is not None else None)
            lp.top_logprobs.append({s.token_text(a): v for a, v in entry.items()} if entry is not None else None)
            lp.text_offset.append(len(detok.text))
            detok.add_token(tid)
        return lp

    def _completion_logprobs(self, out: RequestOutput, start: int, offset: int, detok) -> Optional[p.CompletionLogprobs]:
        """The generated tokens ``start:`` of a completion's ``logprobs``. ``detok``: a
        :class:`~mlx_ferrum.tokenizer.StreamingDetokenizer` continuing the prompt, fed every
        earlier token (this call feeds these); token ``i``'s ``text_offset`` is ``offset``
        (where the completion's text starts in the returned text) plus its position in
        the completion's text."""
        s = self.serving
        if out.logprobs is None:
            return None
        lp = p.CompletionLogprobs()
        tops = out.top_logprobs or []
        for i in range(start, scored(out)):
            tok = s.token_text(out.token_ids[i])
            lp.tokens.append(tok)
            lp.token_logprobs.append(out.logprobs[i])
            lp.top_logprobs.append({s.token_text(a): v for a, v in tops[i].items()} if i < len(tops) else None)
            lp.text_offset.append(offset + len(detok.text))
            detok.add_token(out.token_ids[i])
        return lp


def completions_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """The ``POST /v1/completions`` route over ``serving``."""
    router = ApiRouter(limits, dependencies=dependencies)
    router.post_reply("/v1/completions", p.CompletionRequest, CompletionsServing(serving).create, name="completions")
    return router
