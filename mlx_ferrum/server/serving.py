"""The glue between OpenAI-shaped requests and :class:`~mlx_ferrum.engine.AsyncEngine`.

For each request: check the model name, the fields the server does not implement and the
counts the server limits (:class:`~mlx_ferrum.server.limits.ServerLimits`); then, in a
worker thread so that the event loop keeps answering, build the prompt ids (chat template
or tokenizer) under the prompt-token limit and the :class:`SamplingParams` (their
validation names the bad field); then, under the queued-token limit, submit
``n`` engine requests and wait for each one's first output, so that every error the
engine reports at admission (prompt longer than the context, a request the KV pool can
never hold) becomes a 400 before any byte of a stream is sent. Then either collect the
final outputs or stream SSE chunks. Leaving a stream early (client disconnect, shutdown)
closes the engine streams, which aborts their requests and frees their KV blocks.

Chat requests of every API (chat completions here, Responses and Anthropic Messages
translated into a chat request by their modules) share :meth:`OpenAIServing.prepare_chat`
and the output processing of :class:`~mlx_ferrum.server.translation.TurnProcessor`.

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

from starlette.concurrency import run_in_threadpool

from ..engine import AsyncEngine, RequestOutput, SamplingParams
from ..engine.engine import context_full_message
from ..engine.structured import StructuredOutputsParams
from ..errors import (ChatTemplateError, FerrumError, LoraError, PromptTooLongError, RequestError, SamplingParamsError,
                      StructuredOutputError, UnknownLoraError)
from . import protocol as p
from . import tool_parsers
from .limits import ServerLimits, flag_of
from .reasoning import get_reasoning_parser
from .translation import RESERVED_TEMPLATE_VARIABLES, ToolMode, TurnProcessor


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


_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")
_TOP_LOGPROBS_MAX = 20


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


def _refuse_field(name: str, why: str) -> ServingError:
    return ServingError(400, f"'{name}' is not supported by this server ({why}): remove it from the request", param=name)


def _check_unimplemented(req: p._SamplingFields) -> None:
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



def _constraint(req: p._SamplingFields) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
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


def _template_message(m: p.ChatMessage, i: int) -> dict:
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

    # ----------------------------------------------------------------- LoRA
    def model_cards(self) -> list:
        """``/v1/models``: the served names, then each adapter with ``parent`` set to the base."""
        cards = [p.ModelCard(id=n, root=n, max_model_len=self.max_model_len) for n in self.model_names]
        for name in self.engine.list_loras():
            cards.append(p.ModelCard(id=name, root=self.engine.runner.lora_path(name), parent=self.model_names[0],
                                     max_model_len=self.max_model_len))
        return cards

    def load_lora_adapter(self, req: "p.LoadLoraAdapterRequest") -> str:
        """Register an adapter at run time (vLLM's ``/v1/load_lora_adapter``); blocking (reads the folder).

        Raises:
            ServingError: 400 when LoRA is off, the name is taken (or is a served model
                name), or the adapter is refused (the message says why).
        """
        if not self.engine.runner.config.enable_lora:
            raise ServingError(400, "LoRA is off: start the server with --enable-lora", param="lora_name")
        if req.lora_name in self.model_names or req.lora_name in self.engine.list_loras():
            raise ServingError(400, f"the LoRA adapter {req.lora_name!r} has already been loaded (or is a served model "
                               "name): unload it first or pick another name", param="lora_name")
        try:
            self.engine.add_lora(req.lora_name, req.lora_path)
        except LoraError as e:
            raise ServingError(400, str(e), param="lora_path") from None
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload_lora_adapter(self, req: "p.UnloadLoraAdapterRequest") -> str:
        """Unregister an adapter at run time (vLLM's ``/v1/unload_lora_adapter``).

        Raises:
            ServingError: 404 for an unknown adapter, 400 when requests still use it or LoRA is off.
        """
        if not self.engine.runner.config.enable_lora:
            raise ServingError(400, "LoRA is off: start the server with --enable-lora", param="lora_name")
        try:
            self.engine.remove_lora(req.lora_name)
        except UnknownLoraError as e:
            raise ServingError(404, str(e), param="lora_name", type="NotFoundError") from None
        except LoraError as e:
            raise ServingError(400, str(e), param="lora_name") from None
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def check_alive(self) -> None:
        """Raises ServingError(503) while shutting down or when the engine thread has died."""
        if self.shutting_down:
            raise ServingError(503, "the server is shutting down: retry on another instance", type="service_unavailable")
        if not self.async_engine._thread.is_alive():
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

    def _messages_ids(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                      tools: Optional[list] = None, template_kwargs: Optional[dict] = None) -> list[int]:
        msgs = [_template_message(m, i) for i, m in enumerate(messages)]
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_VARIABLES}
        if tools:
            kwargs["tools"] = tools
        try:
            return list(self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=self.chat_template, **kwargs
            ))
        except ChatTemplateError as e:
            raise ServingError(400, f"{e} (or start the server with --chat-template FILE)", param="messages") from None
        except FerrumError as e:  # e.g. the rendered prompt is too long to tokenize
            raise ServingError(400, str(e), param="messages") from None

    def _logit_bias(self, raw: Optional[dict]) -> Optional[dict[int, float]]:
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
            if not 0 <= tid < self.vocab_size:
                raise ServingError(400, f"logit_bias key {key!r} is outside the vocabulary [0, {self.vocab_size}): use valid token ids",
                                   param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ServingError(400, f"logit_bias[{key!r}]={bias!r} is invalid: use a number in [-100, 100]", param="logit_bias")
            out[tid] = float(bias)
        return out

    def _plan(self, req: p._SamplingFields, prompts: list[list[int]], max_tokens, logprobs,
              extra: Optional[dict] = None) -> list[tuple[int, list[int], SamplingParams]]:
        """``(prompt index, ids, params)`` for each of the ``n`` choices of each prompt;
        ``extra``: more :class:`SamplingParams` fields (prompt logprobs, a constraint)."""
        for i, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                # the engine would refuse it too, but only after checking every id on the event loop
                message = context_full_message(len(ids), self.max_model_len, self.engine.model.args.max_position_embeddings)
                raise ServingError(400, message if len(prompts) == 1 else f"prompt {i}: {message}", param="prompt",
                                   code="context_length_exceeded")
        bias = self._logit_bias(req.logit_bias)
        return [(pi, ids, self._params(req, len(ids), max_tokens, logprobs, j, bias, extra))
                for pi, ids in enumerate(prompts) for j in range(req.n)]

    def _constraint_fields(self, spec: Optional[StructuredOutputsParams], field: Optional[str]) -> dict:
        """``{"structured_outputs": spec}``, compiled once here (a worker thread; the engine
        reuses the compiled grammar), or ``{}`` without a constraint.

        Raises:
            ServingError: 400 naming ``field`` when the constraint does not compile.
        """
        if spec is None:
            return {}
        try:
            self.engine.compile_constraint(SamplingParams(structured_outputs=spec))
        except StructuredOutputError as e:
            raise ServingError(400, str(e), param=field) from None
        return {"structured_outputs": spec}

    def _params(self, req: p._SamplingFields, prompt_len: int, max_tokens: Optional[int], logprobs: Optional[int], choice: int,
                logit_bias: Optional[dict[int, float]] = None, extra: Optional[dict] = None) -> SamplingParams:
        default = self.sampling_defaults
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - prompt_len)
            if "max_tokens" in default:
                max_tokens = min(max_tokens, default["max_tokens"])
        elif prompt_len + max_tokens > self.max_model_len:
            # vLLM's policy: a limit the context cannot hold is refused, not silently cut
            # (leave the field out for the rest of the context)
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
            raise ServingError(
                400, f"{name}={max_tokens} with a prompt of {prompt_len} tokens needs {prompt_len + max_tokens} tokens, "
                f"over the context of {self.max_model_len}: ask for at most {self.max_model_len - prompt_len}, or leave "
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

    # -------------------------------------------------------------- engine
    async def _submit(self, plan: list[tuple[int, list[int], SamplingParams]], lora: Optional[str] = None) -> list[_Choice]:
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
            await self._close([_Choice(i, pi, ids, rid, stream, None) for i, (pi, ids, rid, stream) in enumerate(started)])
            raise
        choices = [_Choice(i, pi, ids, rid, stream, first) for i, ((pi, ids, rid, stream), first) in enumerate(zip(started, firsts))]
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

    def _finished(self, choice: _Choice, out: RequestOutput) -> None:
        self._release(choice.request_id)
        if self.metrics is not None:
            self.metrics.observe_finished(out)

    async def _close(self, choices: list[_Choice]) -> None:
        """Close every engine stream; unfinished requests are aborted and free their blocks."""
        for c in choices:
            if self._release(c.request_id):
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

    def _usage(self, choices: list[_Choice], prompt_only: bool = False) -> p.UsageInfo:
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

    def _echo_logprobs(self, out: RequestOutput, prompt_ids: list[int]) -> p.CompletionLogprobs:
        """The prompt part of an ``echo`` completion's ``logprobs``: every prompt token with
        its log-probability (null for the first) and top alternatives, offsets from 0."""
        lp = p.CompletionLogprobs()
        table = out.prompt_logprobs or [None] * len(prompt_ids)
        # offsets into the echoed text, as the prompt decodes: a hidden special token
        # (<s>) takes no characters
        detok = self.tokenizer.detokenizer()
        for tid, entry in zip(prompt_ids, table):
            tok = self._token_str(tid)
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry[tid] if entry is not None else None)
            lp.top_logprobs.append({self._token_str(a): v for a, v in entry.items()} if entry is not None else None)
            lp.text_offset.append(len(detok.text))
            detok.add_token(tid)
        return lp

    def _completion_logprobs(self, out: RequestOutput, start: int, offset: int, detok) -> Optional[p.CompletionLogprobs]:
        """The generated tokens ``start:`` of a completion's ``logprobs``. ``detok``: a
        :class:`~mlx_ferrum.tokenizer.StreamingDetokenizer` continuing the prompt, fed every
        earlier token (this call feeds these); token ``i``'s ``text_offset`` is ``offset``
        (where the completion's text starts in the returned text) plus its position in
        the completion's text."""
        if out.logprobs is None:
            return None
        lp = p.CompletionLogprobs()
        tops = out.top_logprobs or []
        for i in range(start, _scored(out)):
            tok = self._token_str(out.token_ids[i])
            lp.tokens.append(tok)
            lp.token_logprobs.append(out.logprobs[i])
            lp.top_logprobs.append({self._token_str(a): v for a, v in tops[i].items()} if i < len(tops) else None)
            lp.text_offset.append(offset + len(detok.text))
            detok.add_token(out.token_ids[i])
        return lp

    # ---------------------------------------------------------------- chat
    async def prepare_chat(self, req: p.ChatCompletionRequest) -> "ChatPlan":
        """Check a chat request and plan its engine requests (template, tools, sampling,
        grammar); the shared first half of every chat API (chat, Responses, Messages).

        Raises:
            ServingError: 404 unknown model, 400 invalid request, 503 shutting down.
        """
        self.check_alive()
        lora = self.check_model(req.model)
        _check_unimplemented(req)
        self._check_counts(req.n, 1)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= _TOP_LOGPROBS_MAX:
            raise ServingError(400, f"top_logprobs={req.top_logprobs} is invalid: use 0 to {_TOP_LOGPROBS_MAX}", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise ServingError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        mode = tool_mode(req)
        items = await run_in_threadpool(self._chat_plan, req, mode)
        constrained = any(params.structured_outputs is not None for _, _, params in items)
        return ChatPlan(items, mode, lora, constrained, req.model or self.model_names[0])

    def processor(self, plan: "ChatPlan") -> TurnProcessor:
        """A fresh :class:`TurnProcessor` for one choice of ``plan``."""
        return TurnProcessor(self.tokenizer, plan.mode, self.tool_parser, self.reasoning_parser, plan.constrained)

    async def chat(self, req: p.ChatCompletionRequest):
        """A :class:`ChatCompletionResponse`, or an async iterator of SSE lines when ``stream``.

        Raises:
            ServingError: 404 unknown model, 400 invalid request, 503 shutting down.
        """
        plan = await self.prepare_chat(req)
        mode = plan.mode
        choices = await self._submit(plan.items, plan.lora)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        name = plan.name
        if req.stream:
            if mode.kind is not None or self.reasoning_parser is not None:
                return self._chat_tool_stream(req, choices, rid, name, plan)
            return self._chat_stream(req, choices, rid, name)
        async for _ in self._merged(choices):
            pass
        self._raise_failed(choices)
        out_choices = []
        for c in choices:
            turn = self.processor(plan).finish(c.last)
            out_choices.append(p.ChatCompletionChoice(
                index=c.index, message=p.ChatResponseMessage(content=turn.content, reasoning_content=turn.reasoning,
                                                             tool_calls=[k.openai() for k in turn.calls] or None),
                logprobs=self._chat_logprobs(c.last, 0), finish_reason=turn.finish_reason,
            ))
        return p.ChatCompletionResponse(id=rid, model=name, usage=self._usage(choices), choices=out_choices)

    def _chat_plan(self, req: p.ChatCompletionRequest, mode: Optional[ToolMode] = None) -> list:
        """Render and tokenize the messages (with the tools), compile the output
        constraint, then build each choice's parameters (worker thread)."""
        mode = mode or ToolMode()
        ids = self._check_ids(self._messages_ids(req.messages, tools=mode.tools, template_kwargs=req.chat_template_kwargs),
                              param="messages", what="the rendered chat prompt")
        self._count_prompt_tokens(len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        spec, field = _constraint(req)
        if mode.kind == "named":  # the output is the function's arguments
            tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
            spec, field = StructuredOutputsParams(json=tool["function"].get("parameters") or {"type": "object"}), "tools"
        elif mode.kind == "required":  # a non-empty JSON list of calls
            spec, field = StructuredOutputsParams(json=tool_parsers.required_schema(mode.tools, req.parallel_tool_calls)), "tools"
        return self._plan(req, [ids], max_tokens, logprobs, self._constraint_fields(spec, field))

    def _raise_failed(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.last.finish_reason == "error":
                raise engine_failure(c.last)

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
                if out.finish_reason == "error":
                    yield stream_error_event(out)
                    return
                fresh = out.logprobs is not None and _scored(out) > sent[c.index]
                if not out.delta and not out.finished and not fresh:
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

    async def _chat_tool_stream(self, req, choices, rid, name, plan: "ChatPlan") -> AsyncIterator[str]:
        """A streamed chat completion read by a :class:`TurnProcessor` (tools or a
        reasoning parser): reasoning streams as ``reasoning_content`` deltas, content
        until the text may be starting a tool call (auto), and the calls come as
        ``tool_calls`` deltas once the reply is complete (each call whole, OpenAI's delta
        shape with ``index``)."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = _chunk_head(rid, "chat.completion.chunk", name)
        merged = self._merged(choices)
        processors = {c.index: self.processor(plan) for c in choices}

        def delta_chunk(index: int, reasoning: str, content: str) -> str:
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            return head + _json({"index": index, "delta": delta}) + "]}\n\n" if delta else ""

        try:
            for c in choices:
                yield head + _json({"index": c.index, "delta": {"role": "assistant", "content": ""}}) + "]}\n\n"
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
                    yield head + _json({"index": c.index, "delta": {"tool_calls": deltas}}) + "]}\n\n"
                yield head + _json({"index": c.index, "delta": {}, "finish_reason": turn.finish_reason}) + "]}\n\n"
            if include_usage:
                u = p.ChatCompletionChunk(id=rid, model=name, choices=[], usage=self._usage(choices))
                yield f"data: {u.model_dump_json(exclude_none=True)}\n\n"
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
        lora = self.check_model(req.model)
        _check_unimplemented(req)
        prompt = req.prompt
        # a list of token ids is one prompt; a list of strings or of id lists, several
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        self._check_counts(req.n, len(prompt) if several else 1)
        if req.logprobs is not None and not 0 <= req.logprobs <= _TOP_LOGPROBS_MAX:
            raise ServingError(400, f"logprobs={req.logprobs} is invalid: use 0 to {_TOP_LOGPROBS_MAX}", param="logprobs")
        plan = await run_in_threadpool(self._completion_plan, req)
        choices = await self._submit(plan.items, lora)
        rid = f"cmpl-{uuid.uuid4().hex}"
        name = req.model or self.model_names[0]
        if req.stream:
            return self._completion_stream(req, choices, rid, name, plan)
        async for _ in self._merged(choices):
            pass
        self._raise_failed(choices)
        return p.CompletionResponse(
            id=rid, model=name, usage=self._usage(choices, plan.prompt_only),
            choices=[self._completion_choice(req, c, plan) for c in choices],
        )

    def _completion_choice(self, req: p.CompletionRequest, c: _Choice, plan: "_CompletionPlan") -> p.CompletionChoice:
        """A finished choice; with ``echo`` the prompt (and its logprobs) comes first, and
        with ``max_tokens: 0`` only the prompt (the one token generated is dropped)."""
        out = c.last
        if not req.echo:
            return p.CompletionChoice(index=c.index, text=out.text, logprobs=self._completion_logprobs(out, 0, 0, self.tokenizer.detokenizer(prompt_ids=c.prompt_ids)),
                                      finish_reason=out.finish_reason)
        head = plan.texts[c.prompt_index]
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._echo_logprobs(out, c.prompt_ids)
            if not plan.prompt_only:
                tail = self._completion_logprobs(out, 0, len(head), self.tokenizer.detokenizer(prompt_ids=c.prompt_ids))
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, key).extend(getattr(tail, key))
        if plan.prompt_only:
            return p.CompletionChoice(index=c.index, text=head, logprobs=logprobs, finish_reason="length")
        return p.CompletionChoice(index=c.index, text=head + out.text, logprobs=logprobs, finish_reason=out.finish_reason)

    def _completion_plan(self, req: p.CompletionRequest) -> "_CompletionPlan":
        """Tokenize and check the prompts under the prompt-token limit, then build each
        choice's parameters (worker thread: a large prompt never blocks the event loop)."""
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
            self._count_prompt_tokens(sum(len(ids) for ids in id_lists))  # before reading any id
        count = len(texts if texts is not None else id_lists)
        for i in range(count):
            ids = self._encode(texts[i]) if texts is not None else list(id_lists[i])
            total += len(ids)
            self._count_prompt_tokens(total)  # stop tokenizing as soon as the request is over
            prompts.append(self._check_ids(ids, what="the prompt" if count == 1 else f"prompt {i}"))
        extra, max_tokens, prompt_only = self._constraint_fields(*_constraint(req)), req.max_tokens, False
        if req.echo:
            if req.logprobs is not None:
                extra["prompt_logprobs"] = req.logprobs
            if max_tokens == 0:  # score the prompt only: one token is generated and dropped
                max_tokens, prompt_only = 1, True
        echo_texts = None
        if req.echo:
            echo_texts = list(texts) if texts is not None else [self.tokenizer.decode(ids) for ids in prompts]
        return _CompletionPlan(self._plan(req, prompts, max_tokens, req.logprobs, extra), echo_texts, prompt_only)

    async def _completion_stream(self, req, choices, rid, name, plan: "_CompletionPlan") -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = _chunk_head(rid, "text_completion", name)
        merged = self._merged(choices)
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
                    yield head + _json(choice) + "]}\n\n"
                if plan.prompt_only:
                    continue
                fresh = out.logprobs is not None and _scored(out) > sent[c.index]
                if not out.delta and not out.finished and not fresh:
                    continue
                choice = {"index": c.index, "text": out.delta, "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    if c.index not in detoks:
                        detoks[c.index] = self.tokenizer.detokenizer(prompt_ids=c.prompt_ids)
                    lp = self._completion_logprobs(out, sent[c.index], offsets[c.index], detoks[c.index])
                    choice["logprobs"] = lp.model_dump(exclude_none=True)
                    sent[c.index] = _scored(out)
                yield head + _json(choice) + "]}\n\n"
            if include_usage:
                u = p.CompletionResponse(id=rid, model=name, choices=[], usage=self._usage(choices, plan.prompt_only))
                yield f"data: {u.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()

    # ------------------------------------------------------------ tokenize
    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        """vLLM's ``/tokenize``: ids of ``prompt`` (or of chat ``messages`` through the template).

        Blocking (tokenizes): call it from a worker thread.
        """
        self.check_model(req.model)
        if req.messages is not None:
            ids = self._messages_ids(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            try:
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            except FerrumError as e:
                raise ServingError(400, str(e), param="prompt") from None
        else:
            raise ServingError(400, "give 'prompt' (text) or 'messages'", param="prompt")
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=list(ids))

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """vLLM's ``/detokenize``: the text of ``tokens`` (blocking: call it from a worker thread)."""
        self.check_model(req.model)
        if req.tokens:
            self._check_ids(list(req.tokens), param="tokens", what="tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


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
class _CompletionPlan:
    """A completions request's engine requests, plus what ``echo`` needs: the prompt
    texts (one per prompt; None without echo) and whether only the prompt is returned
    (``max_tokens: 0``)."""

    items: list
    texts: Optional[list[str]]
    prompt_only: bool


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
