"""The FastAPI app of ``mlx-ferrum serve`` and its uvicorn runner.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(:mod:`.responses`), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(:mod:`.anthropic_messages`), ``POST /v1/embeddings`` (:mod:`.embeddings`), ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``. Every error
is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, except
under ``/v1/messages``, where it takes Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Request bodies pass :class:`~mlx_ferrum.server.limits.BodySizeLimitMiddleware` (413 over
``--max-request-body-bytes``), must be JSON (``Content-Type: application/json``), and are
parsed and validated in a worker thread, as is every tokenization, so that a large
request never delays ``/health`` or the streams of other requests.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections, then every in-flight
request is aborted, so each open stream and each waiting response ends with finish
reason ``abort``; uvicorn then waits for those responses to finish and the process exits 0.

``GET /`` serves the chat page (:mod:`.web_ui`) unless the server runs with ``--no-web-ui``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Callable, Optional

import pydantic
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as p
from .anthropic_messages import CountTokensRequest, MessagesRequest, MessagesServing, error_body
from .embeddings import EmbeddingRequest, EmbeddingsServing
from .limits import BodySizeLimitMiddleware, ServerLimits, count_json_containers, flag_of
from .metrics import CONTENT_TYPE, ServerMetrics
from .responses import ResponsesRequest, ResponsesServing
from .serving import OpenAIServing, ServingError
from .web_ui import add_web_ui

logger = logging.getLogger("mlx_ferrum.server")

_DISCONNECT_POLL_S = 0.25
ANTHROPIC_PREFIX = "/v1/messages"


#: What a field that takes one of several shapes accepts, for errors about it (pydantic
#: would name the union's branches, e.g. ``prompt.str``, which mean nothing to a client).
_UNION_EXPECTED = {
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list", "tuple"}


def _is_branch(part) -> bool:
    """True for a pydantic location entry naming a union branch or a validator, not a field."""
    return isinstance(part, str) and (part in _TYPE_NAMES or any(ch in part for ch in "[]-,"))


def describe_validation_errors(errors: list) -> tuple[str, Optional[str]]:
    """``(message, param)`` of a pydantic error list, in the client's terms.

    The location is the dotted path of field names and list indices (``messages.0.role``);
    union branches and validator names are dropped. A JSON syntax error, including a lone
    UTF-16 surrogate escape (``\\ud800``), says the body is not valid JSON.
    """
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        msg = str(first.get("msg", ""))
        hint = ""
        if "escape" in msg or "surrogate" in msg or "utf-8" in msg.lower():
            hint = " (text must be valid Unicode: a lone UTF-16 surrogate such as \\ud800 is not)"
        return f"the request body is not valid JSON: {msg}{hint}", None
    loc = [x for x in first.get("loc", ()) if x != "body"]
    kept = [str(x) for x in loc if not _is_branch(x)]
    param = ".".join(kept) or None
    names = [x for x in kept if not x.isdigit()]
    if any(_is_branch(x) for x in loc) and names and names[-1] in _UNION_EXPECTED:
        # the value fit no branch: say what the field takes, at the field itself
        cut = max(i for i, x in enumerate(kept) if x == names[-1])
        param = ".".join(kept[: cut + 1])
        return f"invalid parameter {param}: expected {_UNION_EXPECTED[names[-1]]}", param
    if first.get("type") == "model_type" and not kept:
        return "the request body must be a JSON object", None
    return f"invalid parameter {param}: {first.get('msg', 'invalid value')}", param


def _parse(model: type, raw: bytes, limits: ServerLimits):
    """``model`` validated from the JSON ``raw`` (run in a worker thread).

    Raises:
        ServingError: 413 for more JSON arrays/objects than ``limits`` allow (counted
            before parsing), 400 naming the bad parameter.
    """
    bound = limits.max_request_json_containers
    containers = count_json_containers(raw, bound)
    if containers > bound:
        flag = flag_of("max_request_json_containers")
        raise ServingError(413, f"the request body holds {containers} JSON arrays and objects, over the server's limit of "
                           f"{bound} ({flag}): send fewer, longer prompts or messages, or start the server with a larger {flag}")
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise ServingError(400, message, param=param) from None


async def _body(request: Request, model: type, limits: ServerLimits):
    """The request's JSON body as ``model``; parsed off the event loop.

    Raises:
        ServingError: 400 for a Content-Type other than JSON, or an invalid body.
    """
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ServingError(400, f"the request body must be JSON sent with 'Content-Type: application/json', got {media!r} "
                           "(with curl, add -H 'Content-Type: application/json')")
    raw = await request.body()
    return await run_in_threadpool(_parse, model, raw, limits)


def _json_body(model: type) -> dict:
    """The OpenAPI ``requestBody`` of a route that reads ``model`` itself (for ``app.openapi()``,
    which fuzzers read; the routes parse bodies by hand, off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _until_disconnect(request: Request, coro):
    """Run ``coro``; cancel it (aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()


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
    responses = ResponsesServing(serving)
    messages = MessagesServing(serving)
    embeddings = EmbeddingsServing(serving, pooling)

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

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        # OpenAI's clients send "Authorization: Bearer", Anthropic's "x-api-key"
        bearer = request.headers.get("authorization", "")
        given = request.headers.get("x-api-key")
        if given is not None and secrets.compare_digest(given.encode(), api_key.encode()):
            return
        if not secrets.compare_digest(bearer.encode(), f"Bearer {api_key}".encode()):
            raise ServingError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                               "authentication_error")

    guarded = [Depends(check_key)]

    async def _answer(request: Request, coro):
        result = await _until_disconnect(request, coro)
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, p.BaseModel):
            return JSONResponse(result.model_dump(exclude_none=True))
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        return await _answer(request, serving.chat(await _body(request, p.ChatCompletionRequest, limits)))

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        return await _answer(request, serving.completion(await _body(request, p.CompletionRequest, limits)))

    @app.post("/v1/responses", dependencies=guarded, openapi_extra=_json_body(ResponsesRequest))
    async def create_response(request: Request):
        return await _answer(request, responses.create(await _body(request, ResponsesRequest, limits)))

    @app.post("/v1/messages", dependencies=guarded, openapi_extra=_json_body(MessagesRequest))
    async def create_message(request: Request):  # ?beta=true and anthropic-beta headers change nothing here
        return await _answer(request, messages.create(await _body(request, MessagesRequest, limits)))

    @app.post("/v1/messages/count_tokens", dependencies=guarded, openapi_extra=_json_body(CountTokensRequest))
    async def count_tokens(request: Request):
        body = await _body(request, CountTokensRequest, limits)
        return await run_in_threadpool(messages.count_tokens, body)

    @app.post("/v1/embeddings", dependencies=guarded, openapi_extra=_json_body(EmbeddingRequest))
    async def create_embeddings(request: Request):
        return await _answer(request, embeddings.create(await _body(request, EmbeddingRequest, limits)))

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return p.ModelList(data=serving.model_cards()).model_dump()

    @app.post("/v1/load_lora_adapter", dependencies=guarded)
    async def load_lora_adapter(request: Request):
        body = await _body(request, p.LoadLoraAdapterRequest, limits)
        return PlainTextResponse(await run_in_threadpool(serving.load_lora_adapter, body))

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload_lora_adapter(request: Request):
        body = await _body(request, p.UnloadLoraAdapterRequest, limits)
        return PlainTextResponse(await run_in_threadpool(serving.unload_lora_adapter, body))

    @app.get("/health")
    async def health():
        serving.check_alive()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        body = await _body(request, p.TokenizeRequest, limits)
        return (await run_in_threadpool(serving.tokenize, body)).model_dump()

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        body = await _body(request, p.DetokenizeRequest, limits)
        return (await run_in_threadpool(serving.detokenize, body)).model_dump()

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
