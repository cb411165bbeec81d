"""Request and response models of the OpenAI API (chat, completions, models, errors)
and vLLM's tokenize/detokenize, as pydantic models.

Shapes follow OpenAI's API reference (https://platform.openai.com/docs/api-reference)
and vLLM's ``entrypoints/openai/protocol.py`` for the extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``) and ``/tokenize``. Fields OpenAI does not define are
ignored; OpenAI fields this server does not implement (``suffix``, ``best_of`` other
than 1 or ``n``, ``functions``, ``function_call``, ``audio``, non-text ``modalities``) are parsed as
any JSON value so that :mod:`mlx_ferrum.server.serving` can refuse them by name.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by chat and completions requests (``None`` = the server's default)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    #: ``{"token id": bias}``, bias in [-100, 100] (keys are strings in JSON, as OpenAI's)
    logit_bias: Optional[dict[str, Any]] = None
    #: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}``
    response_format: Optional[Any] = None
    # vLLM's constraint fields (one at most; response_format wins over none of them: both is a 400)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    # OpenAI fields the server does not implement: refused by name when set
    audio: Optional[Any] = None
    modalities: Optional[Any] = None


class ChatMessage(_Request):
    """One message; ``content`` may be a string or a list of ``{"type": "text", "text"}`` parts."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    #: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``
    tools: Optional[Any] = None
    #: ``"none"`` / ``"auto"`` / ``"required"`` / ``{"type": "function", "function": {"name"}}``
    tool_choice: Optional[Any] = None
    #: False: at most one call per reply (``tool_choice: "required"`` then asks for exactly one)
    parallel_tool_calls: bool = True
    #: more variables for the chat template (vLLM's field), e.g. ``{"enable_thinking": false}``;
    #: the ones the server sets itself (``messages``, ``tools`` ...) cannot be replaced
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # OpenAI fields the server does not implement: refused by name when set
    functions: Optional[Any] = None
    function_call: Optional[Any] = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``; ``prompt`` is text, texts, token ids, or lists of token ids.

    ``prompt`` is checked by :mod:`~mlx_ferrum.server.completions` in a worker thread, in
    Python: pydantic's validation of a long id list holds the GIL for its whole run.
    """

    prompt: Any
    logprobs: Optional[int] = None
    #: return the prompt before the completion; with ``logprobs``, the prompt tokens'
    #: log-probabilities too (the first is null); ``max_tokens: 0`` then scores the prompt only
    echo: bool = False
    # OpenAI fields the server does not implement: refused by name when set
    suffix: Optional[Any] = None
    best_of: Optional[Any] = None


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM): ``prompt`` text or chat ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM)."""

    model: Optional[str] = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    """Prompt-token detail of ``usage``: ``cached_tokens`` = prompt tokens read from the prefix cache (tokens)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts; ``prompt_tokens_details.cached_tokens`` = prompt tokens read from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class TopLogprob(BaseModel):
    """One candidate token with its natural-log probability (float) and its UTF-8 ``bytes``; OpenAI's chat ``top_logprobs`` entry."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprob(TopLogprob):
    """The chosen token's log-probability plus its ``top_logprobs`` alternatives (OpenAI chat ``logprobs.content`` entry)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one :class:`ChatLogprob` per generated token, or None."""

    content: Optional[list[ChatLogprob]] = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a non-streamed chat choice (OpenAI's ``message``)."""

    role: str = "assistant"
    content: Optional[str] = None
    #: the reasoning a ``--reasoning-parser`` kept apart from ``content`` (vLLM's field)
    reasoning_content: Optional[str] = None
    #: ``[{"id", "type": "function", "function": {"name", "arguments" (JSON text)}}]``
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionChoice(BaseModel):
    """One of the ``n`` choices of a chat completion; ``finish_reason`` is ``stop``, ``length``, ``abort`` or ``error``."""

    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    """A non-streamed ``/v1/chat/completions`` response (OpenAI's ``chat.completion`` object); ``created`` in Unix seconds."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The text a streamed chat chunk adds (``role`` only on a choice's first chunk)."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    """One choice of a streamed chat chunk; ``finish_reason`` is set on its last chunk."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    """One SSE ``data:`` chunk of a streamed chat completion (``chat.completion.chunk``); ``usage`` only on the final chunk when ``stream_options.include_usage`` is set."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionLogprobs(BaseModel):
    """Legacy completions ``logprobs``: per generated token its text, log-probability, top alternatives and character offset in the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One of the ``n`` choices of a ``/v1/completions`` response or chunk."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (``object`` stays ``text_completion``, as OpenAI's)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    """One entry of ``/v1/models``; ``max_model_len`` is the context in tokens."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mlx_ferrum"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    """The ``/v1/models`` response: one :class:`ModelCard` per served model name."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """vLLM's ``/tokenize`` response: the token ids, their ``count`` and the context ``max_model_len`` (tokens)."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """vLLM's ``/detokenize`` response: the decoded text."""

    prompt: str


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI-shaped error body (``message``, ``type``, ``param``, ``code``)."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error body."""

    error: ErrorInfo


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter at ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving ``lora_name``."""

    lora_name: str
    lora_int_id: Optional[int] = None
