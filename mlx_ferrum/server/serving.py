"""The glue between OpenAI-shaped requests and :class:`~mlx_ferrum.engine.AsyncEngine`.

For each request: check the model name, build the prompt ids (chat template or
tokenizer), build :class:`SamplingParams` (their validation names the bad field), submit
``n`` engine requests and wait for each one's first output, so that every error the
engine reports at admission (prompt longer than the context, a request the KV pool can
never hold) becomes a 400 before any byte of a stream is sent. Then either collect the
final outputs or stream SSE chunks. Leaving a stream early (client disconnect, shutdown)
closes the engine streams, which aborts their requests and frees their KV blocks.

The shapes follow OpenAI's chat/completions API; the batching of ``n`` choices and the
``usage`` fields follow vLLM's ``serving_chat.py`` / ``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from ..engine import AsyncEngine, RequestOutput, SamplingParams
from ..errors import ChatTemplateError, FerrumError, PromptTooLongError, RequestError, SamplingParamsError
from . import protocol as p


class ServingError(Exception):
    """An error answered in OpenAI's shape: ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    def body(self) -> p.ErrorResponse:
        return p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status))


_PARAM_RE = re.compile(r"SamplingParams\.(\w+)=")
_TOP_LOGPROBS_MAX = 20


def _content_text(content) -> str:
    """A message's text: a string, or the ``text`` of its ``{"type": "text"}`` parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ServingError(400, f"content part type {part.get('type')!r} is not supported: send text parts only", param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


@dataclass
class _Choice:
    """One engine request behind one choice (``index``) of one prompt (``prompt_index``)."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    request_id: str
    stream: AsyncIterator[RequestOutput]
    first: Optional[RequestOutput]
    last: Optional[RequestOutput] = None


class OpenAIServing:
    """Serves chat, completions, tokenize and detokenize over an :class:`AsyncEngine`.

    Args:
        async_engine: the engine front (its ``engine`` must have a tokenizer).
        served_model_names: names accepted in ``model`` (the first one is reported).
        chat_template: a Jinja template string overriding the checkpoint's, or None.
        metrics: a :class:`~mlx_ferrum.server.metrics.ServerMetrics` to record into, or None.
    """

    def __init__(self, async_engine: AsyncEngine, served_model_names: list[str], chat_template: Optional[str] = None, metrics=None):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise RequestError("the server needs a tokenizer: load the model with mlx_ferrum.load")
        self.model_names = list(served_model_names)
        self.chat_template = chat_template
        self.metrics = metrics
        self.max_model_len = self.engine.executor.kv_capacity()
        args = getattr(self.engine.executor, "args", None)
        self.vocab_size = getattr(args, "vocab_size", None) or self.tokenizer.backend.get_vocab_size()
        self._inflight: set[str] = set()
        self.shutting_down = False
        self._anchor = list(self.tokenizer.encode("a", add_special_tokens=False))[:1]
        self._anchor_text = self.tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._token_text: dict[int, str] = {}

    # -------------------------------------------------------------- checks
    def check_model(self, name: Optional[str]) -> None:
        """Raises ServingError(404) for a model name this server does not serve."""
        if name is not None and name not in self.model_names:
            raise ServingError(404, f"the model {name!r} does not exist: this server serves {self.model_names}", param="model", type="NotFoundError")

    def check_alive(self) -> None:
        """Raises ServingError(503) while shutting down or when the engine thread has died."""
        if self.shutting_down:
            raise ServingError(503, "the server is shutting down: retry on another instance", type="service_unavailable")
        if not self.async_engine._thread.is_alive():
            raise ServingError(503, "the engine loop has stopped: restart the server", type="service_unavailable")

    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ServingError(400, f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size}): send valid ids", param="prompt")
        if not ids:
            raise ServingError(400, "the prompt is empty: send at least one token", param="prompt")
        return ids

    def _messages_ids(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        msgs = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        try:
            return list(self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=self.chat_template
            ))
        except ChatTemplateError as e:
            raise ServingError(400, f"{e} (or start the server with --chat-template FILE)", param="messages") from None

    def _params(self, req: p._SamplingFields, prompt_len: int, max_tokens: Optional[int], logprobs: Optional[int], choice: int) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - prompt_len)
        seed = req.seed
        if seed is not None and choice:
            seed = (seed + choice) % 2**64  # n choices of one seeded request differ, reproducibly
        fields = dict(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            seed=seed,
            max_tokens=max_tokens,
            stop=req.stop if req.stop is not None else [],
            stop_token_ids=req.stop_token_ids or [],
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
        )
        try:
            return SamplingParams(**fields)
        except SamplingParamsError as e:
            m = _PARAM_RE.search(str(e))
            raise ServingError(400, str(e), param=m.group(1) if m else None) from None

    # -------------------------------------------------------------- engine
    async def _submit(self, prompts: list[list[int]], req: p._SamplingFields, max_tokens, logprobs) -> list[_Choice]:
        """Start ``n`` engine requests per prompt together and await each one's first output.

        Raises:
            ServingError: 400 when a parameter is invalid (before anything is submitted)
                or the engine refuses a request at admission (every other one is aborted).
        """
        if not isinstance(req.n, int) or req.n < 1:
            raise ServingError(400, f"n={req.n!r} is invalid: use an int >= 1", param="n")
        plan = [(pi, ids, self._params(req, len(ids), max_tokens, logprobs, j))
                for pi, ids in enumerate(prompts) for j in range(req.n)]
        started = []
        for pi, ids, params in plan:
            rid = uuid.uuid4().hex
            started.append((pi, ids, rid, self.async_engine.astream(ids, params, request_id=rid)))
            self._inflight.add(rid)
        tasks = [asyncio.ensure_future(stream.__anext__()) for *_, stream in started]
        try:
            firsts = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled (client gone): gather cancelled the tasks
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close([_Choice(i, pi, ids, rid, stream, None) for i, (pi, ids, rid, stream) in enumerate(started)])
            raise
        choices = [_Choice(i, pi, ids, rid, stream, first) for i, ((pi, ids, rid, stream), first) in enumerate(zip(started, firsts))]
        failure: Optional[ServingError] = None
        for c in choices:
            if isinstance(c.first, BaseException):
                self._inflight.discard(c.request_id)
                if isinstance(c.first, (PromptTooLongError, RequestError)):
                    failure = failure or ServingError(400, str(c.first), param="prompt")
                else:
                    failure = failure or ServingError(500, f"{type(c.first).__name__}: {c.first}", type="internal_server_error")
            elif c.first.finished:
                self._finished(c, c.first)
                if c.first.finish_reason == "error":
                    failure = failure or ServingError(400, c.first.error or "the request failed", param="prompt")
        if failure is not None:
            await self._close(choices)
            raise failure
        return choices

    def _finished(self, choice: _Choice, out: RequestOutput) -> None:
        self._inflight.discard(choice.request_id)
        if self.metrics is not None:
            self.metrics.observe_finished(out)

    async def _close(self, choices: list[_Choice]) -> None:
        """Close every engine stream; unfinished requests are aborted and free their blocks."""
        for c in choices:
            if c.request_id in self._inflight:
                self._inflight.discard(c.request_id)
                if self.metrics is not None:
                    self.metrics.observe_aborted()
            try:
                await c.stream.aclose()
            except Exception:  # noqa: BLE001 - closing must reach every stream
                pass

    async def _merged(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Every choice's outputs as they arrive (first outputs first); closes all on exit."""
        try:
            for c in choices:
                c.last = c.first
                yield c, c.first
            if len(choices) == 1:  # one stream: no tasks needed to merge
                c = choices[0]
                if not c.first.finished:
                    async for out in c.stream:
                        c.last = out
                        if out.finished:
                            self._finished(c, out)
                        yield c, out
                        if out.finished:
                            break
                return
            live = {c.index: c for c in choices if not c.first.finished}
            tasks: dict[asyncio.Task, _Choice] = {}
            try:
                for c in live.values():
                    tasks[asyncio.ensure_future(c.stream.__anext__())] = c
                while tasks:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        c = tasks.pop(t)
                        out = t.result()
                        c.last = out
                        if out.finished:
                            self._finished(c, out)
                        else:
                            tasks[asyncio.ensure_future(c.stream.__anext__())] = c
                        yield c, out
            finally:
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._close(choices)

    def abort_all(self) -> int:
        """Abort every in-flight request (shutdown); each ends with finish reason ``abort``."""
        n = 0
        for rid in list(self._inflight):
            try:
                self.engine.abort(rid)
                n += 1
            except FerrumError:
                pass
        return n

    # ------------------------------------------------------------- helpers
    def _token_str(self, tid: int) -> str:
        """A token's text as it reads inside a sequence (with its leading space).

        Decoding a lone SentencePiece token drops its leading space, so decode it after
        an anchor token and strip the anchor's text.
        """
        text = self._token_text.get(tid)
        if text is None:
            full = self.tokenizer.decode(self._anchor + [tid], skip_special_tokens=False)
            text = full[len(self._anchor_text):] if full.startswith(self._anchor_text) else self.tokenizer.decode([tid], skip_special_tokens=False)
            self._token_text[tid] = text
        return text

    def _usage(self, choices: list[_Choice]) -> p.UsageInfo:
        firsts = {}
        for c in choices:
            firsts.setdefault(c.prompt_index, c)
        prompt = sum(len(c.prompt_ids) for c in firsts.values())
        cached = sum((c.last or c.first).metrics.num_cached_tokens for c in firsts.values())
        completion = sum(len((c.last or c.first).token_ids) for c in choices)
        return p.UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
        )

    def _chat_logprobs(self, out: RequestOutput, start: int) -> Optional[p.ChatChoiceLogprobs]:
        if out.logprobs is None:
            return None
        content = []
        tops = out.top_logprobs or []
        for i in range(start, _scored(out)):
            tid = out.token_ids[i]
            tok = self._token_str(tid)
            alts = [
                p.TopLogprob(token=self._token_str(a), logprob=lp, bytes=list(self._token_str(a).encode()))
                for a, lp in (tops[i].items() if i < len(tops) else ())
            ]
            content.append(p.ChatLogprob(token=tok, logprob=out.logprobs[i], bytes=list(tok.encode()), top_logprobs=alts))
        return p.ChatChoiceLogprobs(content=content)

    def _completion_logprobs(self, out: RequestOutput, start: int, offset: int) -> Optional[p.CompletionLogprobs]:
        if out.logprobs is None:
            return None
        lp = p.CompletionLogprobs()
        tops = out.top_logprobs or []
        for i in range(start, _scored(out)):
            tok = self._token_str(out.token_ids[i])
            lp.tokens.append(tok)
            lp.token_logprobs.append(out.logprobs[i])
            lp.top_logprobs.append({self._token_str(a): v for a, v in tops[i].items()} if i < len(tops) else None)
            lp.text_offset.append(offset)
            offset += len(tok)
        return lp

    # ---------------------------------------------------------------- chat
    async def chat(self, req: p.ChatCompletionRequest):
        """A :class:`ChatCompletionResponse`, or an async iterator of SSE lines when ``stream``.

        Raises:
            ServingError: 404 unknown model, 400 invalid request, 503 shutting down.
        """
        self.check_alive()
        self.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= _TOP_LOGPROBS_MAX:
            raise ServingError(400, f"top_logprobs={req.top_logprobs} is invalid: use 0 to {_TOP_LOGPROBS_MAX}", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise ServingError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        ids = self._check_ids(self._messages_ids(req.messages))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        choices = await self._submit([ids], req, max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        name = req.model or self.model_names[0]
        if req.stream:
            return self._chat_stream(req, choices, rid, name)
        async for _ in self._merged(choices):
            pass
        self._raise_failed(choices)
        return p.ChatCompletionResponse(
            id=rid, model=name, usage=self._usage(choices),
            choices=[
                p.ChatCompletionChoice(
                    index=c.index, message=p.ChatResponseMessage(content=c.last.text),
                    logprobs=self._chat_logprobs(c.last, 0), finish_reason=c.last.finish_reason,
                )
                for c in choices
            ],
        )

    def _raise_failed(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.last.finish_reason == "error":
                raise ServingError(500, c.last.error or "the request failed in the engine", type="internal_server_error")

    async def _chat_stream(self, req, choices, rid, name) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice_list, usage=None) -> str:
            c = p.ChatCompletionChunk(id=rid, model=name, choices=choice_list, usage=usage)
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        head = _chunk_head(rid, "chat.completion.chunk", name)
        merged = self._merged(choices)
        try:
            for c in choices:
                yield chunk([p.ChatCompletionStreamChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))])
            sent = {c.index: 0 for c in choices}
            async for c, out in merged:
                if not out.delta and not out.finished and out.logprobs is None:
                    continue  # the detokenizer holds this token back (stop match or partial UTF-8)
                choice = {"index": c.index, "delta": {"content": out.delta}, "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    choice["logprobs"] = self._chat_logprobs(out, sent[c.index]).model_dump(exclude_none=True)
                    sent[c.index] = _scored(out)
                # built by hand: this runs once per token per stream, and pydantic here cost
                # more event-loop time than the rest of the request path
                yield head + _json(choice) + "]}\n\n"
            if include_usage:
                yield chunk([], usage=self._usage(choices))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()

    # --------------------------------------------------------- completions
    async def completion(self, req: p.CompletionRequest):
        """A :class:`CompletionResponse`, or an async iterator of SSE lines when ``stream``.

        Raises:
            ServingError: 404 unknown model, 400 invalid request, 503 shutting down.
        """
        self.check_alive()
        self.check_model(req.model)
        if req.logprobs is not None and not 0 <= req.logprobs <= _TOP_LOGPROBS_MAX:
            raise ServingError(400, f"logprobs={req.logprobs} is invalid: use 0 to {_TOP_LOGPROBS_MAX}", param="logprobs")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and all(isinstance(x, int) for x in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(x, str) for x in prompt):
            prompts = [self.tokenizer.encode(x) for x in prompt]
        elif prompt and all(isinstance(x, list) for x in prompt):
            prompts = [list(x) for x in prompt]
        else:
            raise ServingError(400, "prompt must be a string, a list of strings, token ids, or lists of token ids", param="prompt")
        prompts = [self._check_ids(ids) for ids in prompts]
        choices = await self._submit(prompts, req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        name = req.model or self.model_names[0]
        if req.stream:
            return self._completion_stream(req, choices, rid, name)
        async for _ in self._merged(choices):
            pass
        self._raise_failed(choices)
        return p.CompletionResponse(
            id=rid, model=name, usage=self._usage(choices),
            choices=[
                p.CompletionChoice(index=c.index, text=c.last.text, logprobs=self._completion_logprobs(c.last, 0, 0), finish_reason=c.last.finish_reason)
                for c in choices
            ],
        )

    async def _completion_stream(self, req, choices, rid, name) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = _chunk_head(rid, "text_completion", name)
        merged = self._merged(choices)
        try:
            sent = {c.index: 0 for c in choices}
            offsets = {c.index: 0 for c in choices}
            async for c, out in merged:
                if not out.delta and not out.finished and out.logprobs is None:
                    continue
                choice = {"index": c.index, "text": out.delta, "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    lp = self._completion_logprobs(out, sent[c.index], offsets[c.index])
                    choice["logprobs"] = lp.model_dump(exclude_none=True)
                    sent[c.index] = _scored(out)
                offsets[c.index] += len(out.delta)
                yield head + _json(choice) + "]}\n\n"
            if include_usage:
                u = p.CompletionResponse(id=rid, model=name, choices=[], usage=self._usage(choices))
                yield f"data: {u.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()

    # ------------------------------------------------------------ tokenize
    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        """vLLM's ``/tokenize``: ids of ``prompt`` (or of chat ``messages`` through the template)."""
        self.check_model(req.model)
        if req.messages is not None:
            ids = self._messages_ids(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise ServingError(400, "give 'prompt' (text) or 'messages'", param="prompt")
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=list(ids))

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """vLLM's ``/detokenize``: the text of ``tokens``."""
        self.check_model(req.model)
        self._check_ids(list(req.tokens))
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


def _scored(out: RequestOutput) -> int:
    """How many leading ``out.token_ids`` are known tokens with a log-probability.

    While a request streams, the engine's pipelined step may end ``token_ids`` with a
    placeholder for a token still being computed; ``logprobs`` holds only known tokens.
    """
    return min(len(out.token_ids), len(out.logprobs or ()))


def _chunk_head(request_id: str, object_name: str, model: str) -> str:
    """The start of every SSE chunk of one response, up to its ``choices`` list."""
    return f'data: {{"id":{_json(request_id)},"object":"{object_name}","created":{int(time.time())},"model":{_json(model)},"choices":['


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
