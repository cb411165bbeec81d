"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's (or chat messages') token
ids through the served tokenizer and chat template, and the text of ids.

Field names follow vLLM's (``prompt`` / ``messages``, ``add_special_tokens``,
``add_generation_prompt``; the reply's ``count``, ``max_model_len``, ``tokens``); chat
messages render through the same template as ``/v1/chat/completions``
(:func:`~mlx_ferrum.server.serving.chat_prompt_ids`).
"""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..errors import FerrumError
from . import protocol as p
from .limits import ServerLimits
from .routing import ApiRouter
from .serving import OpenAIServing, ServingError, chat_prompt_ids

__all__ = ["tokenize", "detokenize", "tokenization_router"]


def tokenize(serving: OpenAIServing, req: p.TokenizeRequest) -> p.TokenizeResponse:
    """vLLM's ``/tokenize``: ids of ``prompt`` (or of chat ``messages`` through the template).

    Blocking (tokenizes): call it from a worker thread.
    """
    serving.check_model(req.model)
    if req.messages is not None:
        ids = chat_prompt_ids(serving, req.messages, req.add_generation_prompt)
    elif req.prompt is not None:
        try:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except FerrumError as e:
            raise ServingError(400, str(e), param="prompt") from None
    else:
        raise ServingError(400, "give 'prompt' (text) or 'messages'", param="prompt")
    return p.TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=list(ids))


def detokenize(serving: OpenAIServing, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
    """vLLM's ``/detokenize``: the text of ``tokens`` (blocking: call it from a worker thread)."""
    serving.check_model(req.model)
    if req.tokens:
        serving._check_ids(list(req.tokens), param="tokens", what="tokens")
    return p.DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens))


def tokenization_router(serving: OpenAIServing, limits: ServerLimits, dependencies: list) -> ApiRouter:
    """The ``POST /tokenize`` and ``POST /detokenize`` routes over ``serving``."""
    router = ApiRouter(limits, dependencies=dependencies)

    @router.post_json("/tokenize", p.TokenizeRequest, name="tokenize")
    async def tokenize_route(request: Request):
        body = await router.body(request, p.TokenizeRequest)
        return (await run_in_threadpool(tokenize, serving, body)).model_dump()

    @router.post_json("/detokenize", p.DetokenizeRequest, name="detokenize")
    async def detokenize_route(request: Request):
        body = await router.body(request, p.DetokenizeRequest)
        return (await run_in_threadpool(detokenize, serving, body)).model_dump()

    return router
