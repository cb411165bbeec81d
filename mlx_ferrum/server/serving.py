"""The server's shared core: one :class:`OpenAIServing` over the engine that every API module serves through.

It holds what all endpoints share: the served model names and LoRA adapters a request's
``model`` may name, the checks of the counts the server limits
(:class:`~mlx_ferrum.server.limits.ServerLimits`), and the engine side of a request:
submit its ``n`` engine requests together and wait for each one's first output, so that
every error the engine reports at admission (prompt longer than the context, a request the
KV pool can never hold) becomes a 400 before any byte of a stream is sent; merge the
choices' outputs as they arrive; count queued prompt tokens; close the engine streams
when a reply ends early (client disconnect, shutdown), which aborts their requests and
frees their KV blocks. Errors are :class:`ServingError`, answered in OpenAI's shape.

The API modules build on it: :mod:`.chat_completions`, :mod:`.completions`,
:mod:`.responses`, :mod:`.anthropic_messages`, :mod:`.embeddings`, :mod:`.models`,
:mod:`.tokenization`; the chat APIs through the one request translation of
:mod:`.translation`, the sampling fields through :mod:`.sampling`. The class takes its
name from vLLM's shared serving base; the batching of ``n`` choices and the ``usage``
fields follow vLLM's ``serving_chat.py`` / ``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from ..engine import AsyncEngine, RequestOutput, SamplingParams
from ..errors import FerrumError, PromptTooLongError, RequestError, SamplingParamsError, StructuredOutputError, UnknownLoraError
from . import protocol as p
from . import tool_parsers
from .limits import ServerLimits, flag_of
from .reasoning import get_reasoning_parser


class ServingError(Exception):
    """An error answered in OpenAI's shape: ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        #: OpenAI's error ``code`` where one names the problem (``context_length_exceeded``); else the status
        self.code = code

    def body(self) -> p.ErrorResponse:
        return p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code or self.status))


def engine_failure(out: RequestOutput) -> ServingError:
    """The error of a request that ended with ``finish_reason == "error"``: a constraint
    that failed while generating (its grammar's error state) is the request's fault, a 400
    naming ``response_format``; any other failure is a 500."""
    error = out.error or "the request failed in the engine"
    prefix = StructuredOutputError.__name__ + ": "
    if error.startswith(prefix):
        return ServingError(400, error[len(prefix):], param="response_format")
    return ServingError(500, error, type="internal_server_error")


def stream_error_event(out: RequestOutput) -> str:
    """The SSE event that ends a chat or completions stream whose request failed after its
    first chunk: the error in OpenAI's shape as an event of its own (what vLLM sends; the
    official client raises it), followed by ``[DONE]``, never a choice that looks finished."""
    return f"data: {engine_failure(out).body().model_dump_json(exclude_none=True)}\n\ndata: [DONE]\n\n"


@dataclass
class Choice:
    """One engine request behind one choice (``index``) of one prompt (``prompt_index``)."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    request_id: str
    stream: AsyncIterator[RequestOutput]
    first: Optional[RequestOutput]
    last: Optional[RequestOutput] = None


class OpenAIServing:
    """The state every endpoint shares over an :class:`AsyncEngine`: model names, parsers,
    limits, the queued-token account, and the engine calls of a request.

    Args:
        async_engine: the engine front (its ``engine`` must have a tokenizer).
        served_model_names: names accepted in ``model`` (the first one is reported).
        chat_template: a Jinja template string overriding the checkpoint's, or None.
        metrics: a :class:`~mlx_ferrum.server.metrics.ServerMetrics` to record into, or None.
        limits: the :class:`ServerLimits` (None: the defaults).
        tool_call_parser: ``hermes`` / ``llama3_json`` / ``mistral``; None detects it from
            the chat template (``hermes`` when it shows none).
        sampling_defaults: ``{SamplingParams field: value}`` for request fields left unset
            (the model's ``generation_config.json``, see
            :func:`~mlx_ferrum.generation_defaults.generation_defaults`); a field the file
            does not give keeps the OpenAI default, and ``max_tokens`` is capped by the
            room left in the context.
        reasoning_parser: ``qwen3`` / ``deepseek_r1`` / ``gpt_oss`` (see
            :mod:`~mlx_ferrum.server.reasoning`); None keeps replies as written.
    """

    def __init__(self, async_engine: AsyncEngine, served_model_names: list[str], chat_template: Optional[str] = None, metrics=None,
                 limits: Optional[ServerLimits] = None, tool_call_parser: Optional[str] = None,
                 sampling_defaults: Optional[dict] = None, reasoning_parser: Optional[str] = None):
        self.sampling_defaults = dict(sampling_defaults or {})
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise RequestError("the server needs a tokenizer: load the model with mlx_ferrum.load")
        self.model_names = list(served_model_names)
        self.chat_template = chat_template
        self.metrics = metrics
        self.max_model_len = self.engine.runner.kv_capacity()
        args = getattr(self.engine.runner, "args", None)
        self.vocab_size = getattr(args, "vocab_size", None) or self.tokenizer.backend.get_vocab_size()
        self.limits = limits if limits is not None else ServerLimits()
        # engine request id -> its prompt tokens, for every request not yet finished
        self._inflight: dict[str, int] = {}
        self.queued_tokens = 0
        self.shutting_down = False
        self._anchor = list(self.tokenizer.encode("a", add_special_tokens=False))[:1]
        self._anchor_text = self.tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._token_text: dict[int, str] = {}
        if tool_call_parser is None:
            try:
                source = self.tokenizer._template_source(chat_template)
            except FerrumError:
                source = None
            tool_call_parser = tool_parsers.detect_parser(source if isinstance(source, str) else None)
        self.tool_parser = tool_parsers.get_parser(tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)

    # -------------------------------------------------------------- checks
    def check_model(self, name: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's ``model`` names (None: the base model).

        Raises:
            ServingError: 404 for a name that is neither a served model name nor a
                registered adapter.
        """
        if name is None or name in self.model_names:
            return None
        adapters = self.engine.list_loras()
        if name in adapters:
            return name
        served = self.model_names + adapters
        raise ServingError(404, f"the model {name!r} does not exist: this server serves {served}", param="model",
                           type="NotFoundError")

    def check_alive(self) -> None:
        """Raises ServingError(503) while shutting down or when the engine thread has died."""
        if self.shutting_down:
            raise ServingError(503, "the server is shutting down: retry on another instance", type="service_unavailable")
        if not self.async_engine.is_alive():
            raise ServingError(503, "the engine loop has stopped: restart the server", type="service_unavailable")
        # a parallel run's engine says when a rank has stopped answering
        problem = getattr(self.async_engine.engine, "health_problem", None)
        message = problem() if problem is not None else None
        if message:
            raise ServingError(503, message, type="service_unavailable")

    def _check_ids(self, ids: list[int], param: str = "prompt", what: str = "the prompt") -> list[int]:
        vocab = self.vocab_size
        # the index of the first bad entry, not the entry: a bad entry may itself be None
        at = next((i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < vocab), None)  # noqa: E721 - bool is no id
        if at is not None:
            bad = ids[at]
            if type(bad) is not int:  # noqa: E721
                raise ServingError(400, f"{what} holds {bad!r}, which is not a token id: send ints", param=param)
            raise ServingError(400, f"token id {bad!r} in {what} is outside the vocabulary [0, {vocab}): send valid ids", param=param)
        if not ids:
            raise ServingError(400, f"{what} is empty: send at least one token", param=param)
        return ids

    def _over_limit(self, name: str, value: int, what: str, status: int = 400, param: Optional[str] = None) -> ServingError:
        limit = getattr(self.limits, name)
        return ServingError(status, f"{what} ({value}) exceeds the server's limit of {limit} ({flag_of(name)}): "
                            f"send a smaller request, or start the server with a larger {flag_of(name)}", param=param)

    def _check_counts(self, n, num_prompts: int) -> None:
        """The limits on ``n``, prompts and prompts x ``n`` (cheap: run before any work).

        Raises:
            ServingError: 400 naming the limit and its flag.
        """
        if not isinstance(n, int) or n < 1:
            raise ServingError(400, f"n={n!r} is invalid: use an int >= 1", param="n")
        if n > self.limits.max_n:
            raise self._over_limit("max_n", n, "n", param="n")
        if num_prompts > self.limits.max_prompts_per_request:
            raise self._over_limit("max_prompts_per_request", num_prompts, "the number of prompts", param="prompt")
        if num_prompts * n > self.limits.max_choices_per_request:
            raise self._over_limit("max_choices_per_request", num_prompts * n, "prompts x n", param="n")

    def _count_prompt_tokens(self, total: int) -> None:
        if total > self.limits.max_prompt_tokens_per_request:
            raise self._over_limit("max_prompt_tokens_per_request", total, "the request's prompt tokens", param="prompt")

    def _encode(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of ``text``; a text the tokenizer refuses (too long, ...) is a 400."""
        try:
            return list(self.tokenizer.encode(text))
        except FerrumError as e:
            raise ServingError(400, str(e), param=param) from None

    # -------------------------------------------------------------- engine
    async def _submit(self, plan: list[tuple[int, list[int], SamplingParams]], lora: Optional[str] = None) -> list[Choice]:
        """Start the planned engine requests together (with LoRA adapter ``lora``, or the
        base model) and await each one's first output.

        Raises:
            ServingError: 400 when the request alone exceeds ``max_queued_tokens``, 429 when
                it would with the requests already queued (before anything is submitted),
                400 when the engine refuses a request at admission (every other one is aborted).
        """
        tokens = sum(len(ids) for _, ids, _ in plan)
        if tokens > self.limits.max_queued_tokens:
            raise self._over_limit("max_queued_tokens", tokens, "the request's prompt tokens x n", param="prompt")
        if self.queued_tokens + tokens > self.limits.max_queued_tokens:
            raise ServingError(
                429, f"the server is busy: {self.queued_tokens} prompt tokens are queued and this request adds {tokens}, over "
                f"the limit of {self.limits.max_queued_tokens} ({flag_of('max_queued_tokens')}): retry later",
                type="rate_limit_error")
        started = []
        for pi, ids, params in plan:
            rid = uuid.uuid4().hex
            # lora only when set: the base path keeps astream's three-argument call
            extra = {"lora": lora} if lora is not None else {}
            started.append((pi, ids, rid, self.async_engine.astream(ids, params, request_id=rid, **extra)))
            self._inflight[rid] = len(ids)
            self.queued_tokens += len(ids)
        tasks = [asyncio.ensure_future(stream.__anext__()) for *_, stream in started]
        try:
            firsts = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled (client gone): gather cancelled the tasks
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close([Choice(i, pi, ids, rid, stream, None) for i, (pi, ids, rid, stream) in enumerate(started)])
            raise
        choices = [Choice(i, pi, ids, rid, stream, first) for i, ((pi, ids, rid, stream), first) in enumerate(zip(started, firsts))]
        failure: Optional[ServingError] = None
        for c in choices:
            if isinstance(c.first, BaseException):
                self._release(c.request_id)
                if isinstance(c.first, UnknownLoraError):  # unloaded since check_model
                    failure = failure or ServingError(404, str(c.first), param="model", type="NotFoundError")
                elif isinstance(c.first, (PromptTooLongError, RequestError, SamplingParamsError)):
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

    def _release(self, request_id: str) -> bool:
        """Forget a finished or closed engine request; True when it was still counted."""
        tokens = self._inflight.pop(request_id, None)
        if tokens is None:
            return False
        self.queued_tokens -= tokens
        return True

    def _finished(self, choice: Choice, out: RequestOutput) -> None:
        self._release(choice.request_id)
        if self.metrics is not None:
            self.metrics.observe_finished(out)

    async def _close(self, choices: list[Choice]) -> None:
        """Close every engine stream; unfinished requests are aborted and free their blocks."""
        for c in choices:
            if self._release(c.request_id):
                if self.metrics is not None:
                    self.metrics.observe_aborted()
            try:
                await c.stream.aclose()
            except Exception:  # noqa: BLE001 - closing must reach every stream
                pass

    async def _merged(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
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
            tasks: dict[asyncio.Task, Choice] = {}
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
    def token_text(self, tid: int) -> str:
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

    def _usage(self, choices: list[Choice], prompt_only: bool = False) -> p.UsageInfo:
        firsts = {}
        for c in choices:
            firsts.setdefault(c.prompt_index, c)
        prompt = sum(len(c.prompt_ids) for c in firsts.values())
        cached = sum((c.last or c.first).metrics.num_cached_tokens for c in firsts.values())
        completion = 0 if prompt_only else sum(len((c.last or c.first).token_ids) for c in choices)
        return p.UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
        )

    def _raise_failed(self, choices: list[Choice]) -> None:
        """Raise :func:`engine_failure` of the first finished choice that failed, if any."""
        for c in choices:
            if c.last.finish_reason == "error":
                raise engine_failure(c.last)


def scored(out: RequestOutput) -> int:
    """How many leading ``out.token_ids`` are known tokens with a log-probability.

    While a request streams, the engine's pipelined step may end ``token_ids`` with a
    placeholder for a token still being computed; ``logprobs`` holds only known tokens.
    """
    return min(len(out.token_ids), len(out.logprobs or ()))


def chunk_head(request_id: str, object_name: str, model: str) -> str:
    """The start of every SSE chunk of one response, up to its ``choices`` list."""
    return f'data: {{"id":{json_text(request_id)},"object":"{object_name}","created":{int(time.time())},"model":{json_text(model)},"choices":['


def json_text(obj) -> str:
    """``obj`` as compact JSON, non-ASCII kept (what the hand-built stream chunks hold)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
