"""The FastAPI app of ``mlx-ferrum serve`` and its uvicorn runner.

The app mounts one router per API, each from its module: ``POST /v1/chat/completions``
(:mod:`.chat_completions`), ``POST /v1/completions`` (:mod:`.completions`), ``POST
/v1/responses`` (:mod:`.responses`), ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` (:mod:`.anthropic_messages`), ``POST /v1/embeddings``
(:mod:`.embeddings`), ``GET /v1/models`` and the LoRA load / unload endpoints
(:mod:`.models`), ``POST /tokenize`` and ``POST /detokenize`` (:mod:`.tokenization`),
``GET /health`` and ``GET /metrics`` (:mod:`.metrics`), and ``GET /``, the chat page
(:mod:`.web_ui`), unless the server runs with ``--no-web-ui``. Here live only what spans
them: the API-key check and the body-size limit (both from :mod:`.routing`:
:func:`~mlx_ferrum.server.routing.api_key_check`,
:class:`~mlx_ferrum.server.routing.BodySizeLimitMiddleware`, 413 over
``--max-request-body-bytes``), and the error handlers: every error is answered in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, except under
``/v1/messages``, where it takes Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections, then every in-flight
request is aborted, so each open stream and each waiting response ends with finish
reason ``abort``; uvicorn then waits for those responses to finish and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_messages import ANTHROPIC_PREFIX, error_body, messages_router
from .chat_completions import chat_completions_router
from .completions import completions_router
from .embeddings import embeddings_router
from .limits import ServerLimits
from .metrics import ServerMetrics, monitoring_router
from .models import models_router
from .responses import responses_router
from .routing import BodySizeLimitMiddleware, api_key_check, body_components, describe_validation_errors
from .serving import OpenAIServing, ServingError
from .tokenization import tokenization_router
from .web_ui import add_web_ui

logger = logging.getLogger("mlx_ferrum.server")


def build_app(serving: OpenAIServing, metrics: Optional[ServerMetrics] = None, api_key: Optional[str] = None,
              limits: Optional[ServerLimits] = None, web_ui: bool = True, pooling: str = "last") -> FastAPI:
    """The FastAPI app over ``serving``.

    Args:
        serving: the :class:`OpenAIServing` that answers requests.
        metrics: the registry served at ``/metrics`` (None: built over ``serving.engine``).
        api_key: when set, every path but ``/health`` and ``/metrics`` needs
            ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>`` (else 401).
        limits: the server's limits (None: ``serving.limits``); the body limit is applied here.
        web_ui: serve the chat page at ``GET /`` (see :mod:`.web_ui`).
        pooling: ``/v1/embeddings``' pooling, ``last`` or ``mean``.

    Raises:
        ValueError: an unknown ``pooling``.
    """
    metrics = metrics if metrics is not None else (serving.metrics or ServerMetrics(serving.engine))
    serving.metrics = metrics
    limits = limits if limits is not None else serving.limits
    serving.limits = limits
    app = FastAPI(title="mlx-ferrum", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes,
                       on_refused=lambda: metrics.http_errors.labels(status="413").inc(),
                       anthropic_prefix=ANTHROPIC_PREFIX)

    def fail(status: int, message: str, type: str, param: Optional[str] = None, request: Optional[Request] = None,
             code=None) -> JSONResponse:
        if request is not None and request.url.path.startswith(ANTHROPIC_PREFIX):
            status, body = error_body(status, message)
            metrics.http_errors.labels(status=str(status)).inc()
            return JSONResponse(body, status_code=status)
        metrics.http_errors.labels(status=str(status)).inc()
        return JSONResponse(ServingError(status, message, type, param, code).body().model_dump(), status_code=status)

    @app.exception_handler(ServingError)
    async def _serving_error(request: Request, exc: ServingError):
        return fail(exc.status, exc.message, exc.type, exc.param, request, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return fail(400, message, "invalid_request_error", param, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return fail(exc.status_code, str(exc.detail), "invalid_request_error", request=request)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("request failed")
        return fail(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error", request=request)

    guarded = [Depends(api_key_check(api_key))]
    routers = [
        chat_completions_router(serving, limits, guarded),
        completions_router(serving, limits, guarded),
        responses_router(serving, limits, guarded),
        messages_router(serving, limits, guarded),
        embeddings_router(serving, limits, guarded, pooling),
        models_router(serving, limits, guarded),
        monitoring_router(serving, metrics),
        tokenization_router(serving, limits, guarded),
    ]
    for router in routers:
        app.include_router(router)
    body_models = [model for router in routers for model in getattr(router, "body_models", ())]

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(body_components(body_models))
        return app.openapi_schema

    app.openapi = openapi
    if web_ui:
        add_web_ui(app)
    return app


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: a signal first aborts in-flight requests, and the process
    exits 0 instead of re-raising the signal after the graceful shutdown."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing):
        super().__init__(config)
        self.serving = serving
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        self.serving.shutting_down = True
        if self._loop is not None:
            # Deferred to the loop: the handler may have interrupted code holding the engine lock.
            self._loop.call_soon_threadsafe(self._abort_all)
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()  # a clean, requested exit: status 0, not the signal re-raised

    def _abort_all(self) -> None:
        n = self.serving.abort_all()
        if n:
            logger.info("shutdown: aborted %d in-flight request(s)", n)


def run_server(
    model,
    tokenizer,
    config=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: Optional[list[str]] = None,
    api_key: Optional[str] = None,
    chat_template: Optional[str] = None,
    log_level: str = "info",
    limits: Optional[ServerLimits] = None,
    sockets: Optional[list] = None,
    on_ready: Optional[Callable[[], None]] = None,
    tool_call_parser: Optional[str] = None,
    lora_modules: Optional[dict[str, str]] = None,
    engine=None,
    web_ui: bool = True,
    sampling_defaults: Optional[dict] = None,
    reasoning_parser: Optional[str] = None,
    pooling: str = "last",
) -> int:
    """Serve ``model`` until SIGINT/SIGTERM; returns the exit status (0).

    Args:
        model, tokenizer: from :func:`mlx_ferrum.load`.
        config: the engine's :class:`~mlx_ferrum.config.RuntimeConfig` (None reads the environment).
        host, port: where to listen (loopback by default).
        served_model_names: names accepted in requests' ``model`` (default ``["default"]``).
        api_key: require ``Authorization: Bearer <api_key>``.
        chat_template: a Jinja template string overriding the checkpoint's.
        log_level: uvicorn's log level.
        limits: the :class:`ServerLimits` (None: the defaults).
        sockets: already bound sockets to serve on instead of binding ``host:port``
            (the CLI binds first, so a taken port fails before the model loads).
        on_ready: called once the engine is built, just before serving starts.
        tool_call_parser: ``hermes``, ``llama3_json`` or ``mistral`` (None: from the chat template).
        lora_modules: LoRA adapters to serve from the start, ``{name: folder or hub id}``
            (needs ``config.enable_lora``); a request whose ``model`` is a name uses it.
        engine: an engine built by the caller (a parallel run's rank-0
            :class:`~mlx_ferrum.distributed.lockstep.LockstepEngine`) instead of a new
            ``Engine``; its ``close()``, if any, is called when the server stops.
        web_ui: serve the chat page at ``GET /``.
        sampling_defaults: defaults for request fields left unset, ``{SamplingParams field:
            value}`` (the model's ``generation_config.json``; None: OpenAI's defaults).
        reasoning_parser: ``qwen3``, ``deepseek_r1`` or ``gpt_oss`` (None: replies as written).
        pooling: ``/v1/embeddings``' pooling over the last hidden states, ``last`` or ``mean``.

    Raises:
        LoraError: an adapter of ``lora_modules`` is refused (before the server listens).
    """
    from ..engine import AsyncEngine, Engine

    engine = engine if engine is not None else Engine(model, tokenizer, config)
    for name, path in (lora_modules or {}).items():
        engine.add_lora(name, path)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(async_engine, served_model_names or ["default"], chat_template, metrics, limits,
                            tool_call_parser=tool_call_parser, sampling_defaults=sampling_defaults,
                            reasoning_parser=reasoning_parser)
    if sampling_defaults:
        logger.info("sampling defaults from the model's generation_config.json (request fields win): %s",
                    ", ".join(f"{k}={v}" for k, v in sampling_defaults.items()))
    app = build_app(serving, metrics, api_key, limits, web_ui=web_ui, pooling=pooling)
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30,
        backlog=2048, timeout_keep_alive=30,
    )
    server = _GracefulServer(uv_config, serving)
    if on_ready is not None:
        on_ready()
    try:
        server.run(sockets=sockets)
    finally:
        async_engine.shutdown()
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return 0
