"""The server's shared core and its one request-to-engine translation.

Every generating API (:mod:`.chat_completions`, :mod:`.completions`, :mod:`.responses`,
:mod:`.anthropic_messages`) and the others (:mod:`.embeddings`, :mod:`.models`,
:mod:`.tokenization`) serve through one :class:`OpenAIServing` over the engine. A request
goes through this module in order:

1. Checks, before any work: the served model names and LoRA adapters ``model`` may name,
   the counts the server limits (:class:`~mlx_ferrum.server.limits.ServerLimits`).
2. Sampling fields -> engine requests: OpenAI's fields (``temperature``, ``top_p``,
   ``seed``, ``stop``, ``logit_bias``, ``logprobs``, ``max_tokens`` /
   ``max_completion_tokens``, ``response_format``) plus the extras vLLM accepts on the
   same endpoints (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
   ``ignore_eos``, ``structured_outputs`` and the ``guided_*`` fields), declared once in
   :mod:`.protocol`'s ``_SamplingFields``, are checked, filled from the model's
   ``generation_config.json`` where the request leaves them unset, and turned into one
   :class:`~mlx_ferrum.engine.SamplingParams` per choice (:func:`engine_requests`, which
   chat and completions both plan through); an invalid value is a 400 naming the field.
3. The chat translation, shared by ``/v1/chat/completions``, ``/v1/responses`` and
   ``/v1/messages``, which differ in their shapes only: each API module turns its request
   into a :class:`~mlx_ferrum.server.protocol.ChatCompletionRequest` (messages in
   OpenAI's chat form, OpenAI ``tools`` / ``tool_choice``, ``response_format``, sampling
   fields, stops, vLLM's ``chat_template_kwargs``), which :func:`prepare_chat` checks,
   renders through the chat template and turns into engine requests (with the grammar of
   ``response_format`` or of a forced ``tool_choice``): a :class:`ChatPlan`. Messages
   reach the template as vLLM passes them (tool-call arguments as objects,
   ``tool_call_id`` kept).
4. Submission (:meth:`OpenAIServing._submit`): the ``n`` engine requests start together
   and each one's first output is awaited, so that every error the engine reports at
   admission (prompt longer than the context, a request the KV pool can never hold)
   becomes a 400 before any byte of a stream is sent; queued prompt tokens are counted.
5. The outputs (:meth:`OpenAIServing._merged`): the choices' outputs merged as they
   arrive; the engine streams closed when a reply ends early (client disconnect,
   shutdown), which aborts their requests and frees their KV blocks. A chat reply goes
   through one :class:`TurnProcessor` per choice, which splits reasoning from the answer
   (``--reasoning-parser``) and reads tool calls from the answer (never from the
   reasoning); the API modules only reshape its :class:`TurnOutput` and stream deltas.
6. ``usage`` (:meth:`OpenAIServing._usage`); errors are :class:`ServingError`, answered
   in OpenAI's shape.

Why one file (about 950 lines): these steps are one translation that every generating
request runs in order, each written against :class:`OpenAIServing` (its limits,
vocabulary, tokenizer and engine) and :class:`ServingError`; split into three files
(the core, the sampling fields, the chat translation), one chat request passed through
all three.

The class takes its name from vLLM's shared serving base; the batching of ``n`` choices
and the ``usage`` fields follow vLLM's ``serving_chat.py`` / ``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.concurrency import run_in_threadpool

from ..engine import AsyncEngine, RequestOutput, SamplingParams
from ..engine.engine import context_full_message
from ..engine.structured import StructuredOutputsParams
from ..errors import (ChatTemplateError, FerrumError, PromptTooLongError, RequestError, SamplingParamsError,
                      StructuredOutputError, UnknownLoraError)
from . import protocol as p
from . import tool_parsers
from .limits import ServerLimits, flag_of
from .reasoning import ReasoningParser, get_reasoning_parser
from .tool_parsers import ToolCall, ToolParser

__all__ = [
    # the shared core
    "ServingError", "engine_failure", "stream_error_event", "Choice", "OpenAIServing", "scored", "chunk_head",
    "json_text",
    # sampling fields -> engine requests
    "TOP_LOGPROBS_MAX", "EngineRequest", "check_unimplemented", "output_constraint", "constraint_fields",
    "engine_requests",
    # the chat translation
    "ChatPlan", "ToolMode", "TurnOutput", "TurnProcessor", "prepare_chat", "turn_processor", "tool_mode",
    "chat_prompt_ids", "template_message", "merge_system", "function_tool", "arguments_object",
    "RESERVED_TEMPLATE_VARIABLES",
]


# ================================================================== the shared core
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


# ================================================================== sampling fields -> engine requests
#: OpenAI's bound on ``top_logprobs`` (chat) and ``logprobs`` (completions).
TOP_LOGPROBS_MAX = 20
_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")

#: One planned engine request: ``(prompt index, prompt ids, SamplingParams)``.
EngineRequest = tuple[int, list[int], SamplingParams]


def _refuse_field(name: str, why: str) -> ServingError:
    return ServingError(400, f"'{name}' is not supported by this server ({why}): remove it from the request", param=name)


def check_unimplemented(req: p._SamplingFields) -> None:
    """Refuse, by name, an OpenAI field whose meaning the server does not implement.

    Raises:
        ServingError: 400 naming the field.
    """
    if req.audio is not None:
        raise _refuse_field("audio", "it generates text only")
    if req.modalities is not None and req.modalities != ["text"]:
        raise _refuse_field("modalities", "it generates text only; send [\"text\"] or leave it out")
    if isinstance(req, p.CompletionRequest):
        if req.suffix is not None:
            raise _refuse_field("suffix", "fill-in-the-middle is not implemented")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise _refuse_field("best_of", "it returns every choice it generates; leave best_of out or set it to n")
    if isinstance(req, p.ChatCompletionRequest):
        if req.functions is not None:
            raise _refuse_field("functions", "function calling is not implemented")
        if req.function_call is not None and req.function_call != "none":
            raise _refuse_field("function_call", "function calling is not implemented")


def output_constraint(req: p._SamplingFields) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint and the field that set it: OpenAI's
    ``response_format``, or one of vLLM's ``structured_outputs`` / ``guided_*`` fields.

    Raises:
        ServingError: 400 for a malformed ``response_format``, or more than one constraint.
    """
    found = []
    rf = req.response_format
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ServingError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                               param="response_format")
        if rf["type"] == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf["type"] == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ServingError(400, "response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                                   "{a JSON schema object}}", param="response_format")
            found.append(("response_format", StructuredOutputsParams(json=schema)))
    try:
        if req.structured_outputs is not None:
            found.append(("structured_outputs", StructuredOutputsParams(**req.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                          ("guided_choice", "choice")):
            if getattr(req, name) is not None:
                found.append((name, StructuredOutputsParams(**{key: getattr(req, name)})))
    except (StructuredOutputError, TypeError) as e:
        raise ServingError(400, f"invalid constraint: {e}", param="structured_outputs") from None
    if len(found) > 1:
        raise ServingError(400, f"give one output constraint, got {[n for n, _ in found]}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def constraint_fields(serving: OpenAIServing, spec: Optional[StructuredOutputsParams], field: Optional[str]) -> dict:
    """``{"structured_outputs": spec}``, compiled once here (a worker thread; the engine
    reuses the compiled grammar), or ``{}`` without a constraint.

    Raises:
        ServingError: 400 naming ``field`` when the constraint does not compile.
    """
    if spec is None:
        return {}
    try:
        serving.engine.compile_constraint(SamplingParams(structured_outputs=spec))
    except StructuredOutputError as e:
        raise ServingError(400, str(e), param=field) from None
    return {"structured_outputs": spec}


def _logit_bias(raw: Optional[dict], vocab_size: int) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (``{"token id": bias}``) as ``{int: float}``, validated.

    Raises:
        ServingError: 400 for a key that is not a token id of the vocabulary, or a
            bias that is not a number in [-100, 100].
    """
    if not raw:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise ServingError(400, f"logit_bias key {key!r} is not a token id: use token ids as keys, e.g. {{\"50\": -100}}",
                               param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise ServingError(400, f"logit_bias key {key!r} is outside the vocabulary [0, {vocab_size}): use valid token ids",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ServingError(400, f"logit_bias[{key!r}]={bias!r} is invalid: use a number in [-100, 100]", param="logit_bias")
        out[tid] = float(bias)
    return out


def engine_requests(serving: OpenAIServing, req: p._SamplingFields, prompts: list[list[int]], max_tokens: Optional[int],
                    logprobs: Optional[int], extra: Optional[dict] = None) -> list[EngineRequest]:
    """``(prompt index, ids, params)`` for each of the ``n`` choices of each prompt;
    ``extra``: more :class:`SamplingParams` fields (prompt logprobs, a constraint).

    Raises:
        ServingError: 400 ``context_length_exceeded`` for a prompt that fills the
            context, 400 naming the field for an invalid sampling value.
    """
    for i, ids in enumerate(prompts):
        if len(ids) >= serving.max_model_len:
            # the engine would refuse it too, but only after checking every id on the event loop
            message = context_full_message(len(ids), serving.max_model_len, serving.engine.model.args.max_position_embeddings)
            raise ServingError(400, message if len(prompts) == 1 else f"prompt {i}: {message}", param="prompt",
                               code="context_length_exceeded")
    bias = _logit_bias(req.logit_bias, serving.vocab_size)
    return [(pi, ids, _sampling_params(serving, req, len(ids), max_tokens, logprobs, j, bias, extra))
            for pi, ids in enumerate(prompts) for j in range(req.n)]


def _sampling_params(serving: OpenAIServing, req: p._SamplingFields, prompt_len: int, max_tokens: Optional[int],
                     logprobs: Optional[int], choice: int, logit_bias: Optional[dict[int, float]] = None,
                     extra: Optional[dict] = None) -> SamplingParams:
    """Choice ``choice``'s parameters: request fields, else the model's defaults, else OpenAI's."""
    default = serving.sampling_defaults
    max_model_len = serving.max_model_len
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
        if "max_tokens" in default:
            max_tokens = min(max_tokens, default["max_tokens"])
    elif prompt_len + max_tokens > max_model_len:
        # vLLM's policy: a limit the context cannot hold is refused, not silently cut
        # (leave the field out for the rest of the context)
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise ServingError(
            400, f"{name}={max_tokens} with a prompt of {prompt_len} tokens needs {prompt_len + max_tokens} tokens, "
            f"over the context of {max_model_len}: ask for at most {max_model_len - prompt_len}, or leave "
            f"{name} unset for the rest of the context", param=name)
    seed = req.seed
    if seed is not None and choice:
        seed = (seed + choice) % 2**64  # n choices of one seeded request differ, reproducibly
    fields = dict(
        temperature=default.get("temperature", 1.0) if req.temperature is None else req.temperature,
        top_p=default.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=default.get("top_k", 0) if req.top_k is None else req.top_k,
        min_p=default.get("min_p", 0.0) if req.min_p is None else req.min_p,
        repetition_penalty=(default.get("repetition_penalty", 1.0) if req.repetition_penalty is None
                            else req.repetition_penalty),
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        seed=seed,
        max_tokens=max_tokens,
        stop=req.stop if req.stop is not None else [],
        stop_token_ids=req.stop_token_ids or [],
        logprobs=logprobs,
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias,
    )
    fields.update(extra or {})
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as e:
        m = _PARAM_RE.search(str(e))
        raise ServingError(400, str(e), param=m.group(1) if m else None) from None


# ================================================================== the chat translation
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
