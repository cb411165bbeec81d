"""The HTTP side of every request, from its bytes to its reply: the body-size bound,
the API-key check, reading a JSON body off the event loop, OpenAPI request-body schemas,
the reply of a generating endpoint, and :class:`ApiRouter`, the router each API module
builds its routes on.

A body is read whole by :class:`BodySizeLimitMiddleware` (413 over
``--max-request-body-bytes``, before anything parses it). Request bodies must be JSON
(``Content-Type: application/json``) and are counted (``--max-request-json-containers``),
parsed and validated in a worker thread, so that a large request never delays
``/health`` or the streams of other requests. Validation errors name the field by its
dotted path in the client's terms (OpenAI's ``param``). A reply runs until it is done or
the client leaves: a departure cancels it, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from typing import Callable, Optional

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import protocol as p
from .limits import ServerLimits, flag_of
from .serving import ServingError

__all__ = ["ApiRouter", "BodySizeLimitMiddleware", "api_key_check", "answer", "count_json_containers",
           "describe_validation_errors", "read_body", "json_body", "body_components"]

_DISCONNECT_POLL_S = 0.25


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: reads each HTTP request body, refusing it (413) once it passes
    ``max_bytes``, then hands the app the buffered body.

    A ``Content-Length`` over the limit is refused without buffering anything; a chunked
    body is counted as it arrives. A refused body is still read to its end (and dropped)
    up to ``drain_bytes`` more, so that a client that sends its whole body before
    reading the answer gets the 413 instead of a reset connection.

    Args:
        app: the ASGI app.
        max_bytes: largest body accepted (bytes).
        anthropic_prefix: a path prefix whose refusals take Anthropic's error shape, or None.
        on_refused: called once per refusal (e.g. to count it), or None.
        drain_bytes: at most this many bytes of a refused body are read and dropped.
    """

    def __init__(self, app, max_bytes: int, on_refused: Optional[Callable[[], None]] = None, drain_bytes: int = 256 * 1024 * 1024,
                 anthropic_prefix: Optional[str] = None):
        self.app = app
        #: paths under it (Anthropic's Messages API) get Anthropic's error shape
        self.anthropic_prefix = anthropic_prefix
        self.max_bytes = max_bytes
        self.on_refused = on_refused
        self.drain_bytes = drain_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        chunks: list[bytes] = []
        total = 0
        too_large = declared is not None and declared > self.max_bytes
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            body = message.get("body", b"")
            total += len(body)
            more = message.get("more_body", False)
            if too_large or total > self.max_bytes:
                too_large = True
                if total > self.max_bytes + self.drain_bytes:
                    break  # stop reading; the connection is closed after the answer
                continue
            chunks.append(body)
        if too_large:
            anthropic = self.anthropic_prefix is not None and scope.get("path", "").startswith(self.anthropic_prefix)
            await self._refuse(send, declared if declared is not None else total, anthropic)
            return
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int, anthropic: bool = False) -> None:
        if self.on_refused is not None:
            self.on_refused()
        message = (f"the request body (at least {size} bytes) exceeds the server's limit of {self.max_bytes} bytes "
                   f"({flag_of('max_request_body_bytes')}): send a smaller request, or start the server with a larger "
                   f"{flag_of('max_request_body_bytes')}")
        if anthropic:
            body = {"type": "error", "error": {"type": "request_too_large", "message": message}}
        else:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 413}}
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def api_key_check(api_key: Optional[str]) -> Callable:
    """The FastAPI dependency that guards every API route: with ``api_key`` set, a
    request needs ``Authorization: Bearer <api_key>`` (OpenAI's clients) or
    ``x-api-key: <api_key>`` (Anthropic's); compared in constant time.

    Raises:
        ServingError: 401, from the returned dependency, for a missing or wrong key.
    """

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

    return check_key


#: a JSON string literal, escapes included (to count brackets outside strings)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def count_json_containers(raw: bytes, bound: int) -> int:
    """How many JSON arrays and objects ``raw`` holds, outside string literals.

    Cheap when the raw bracket count is within ``bound`` (two ``bytes.count``); only
    then does it strip the strings (a regex pass) to discount brackets inside text.
    For malformed JSON the count is approximate; the parser reports the error.
    """
    count = raw.count(b"[") + raw.count(b"{")
    if count <= bound:
        return count
    stripped = _JSON_STRING.sub(b'""', raw)
    return stripped.count(b"[") + stripped.count(b"{")


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


async def read_body(request: Request, model: type, limits: ServerLimits):
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


_COMPONENTS_REF = "#/components/schemas/{model}"


def json_body(model: type) -> dict:
    """The OpenAPI ``requestBody`` of a route that reads ``model`` itself (for ``app.openapi()``,
    which fuzzers read; the routes parse bodies by hand, off the event loop).

    The nested models' schemas are referenced under ``#/components/schemas`` (where an
    OpenAPI reader resolves references from the document's root) and
    :func:`body_components` collects them there.
    """
    schema = model.model_json_schema(ref_template=_COMPONENTS_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def body_components(models: list) -> dict:
    """``{name: schema}`` of the nested models that the :func:`json_body` schemas of ``models`` reference.

    Raises:
        ValueError: two models nest different models under one name (a reference would be ambiguous).
    """
    found: dict = {}
    for model in models:
        for name, schema in model.model_json_schema(ref_template=_COMPONENTS_REF).get("$defs", {}).items():
            if found.setdefault(name, schema) != schema:
                raise ValueError(f"two request models nest different schemas named {name!r}: rename one")
    return found


async def until_disconnect(request: Request, coro):
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


async def answer(request: Request, coro):
    """The HTTP reply of a generating endpoint's ``coro``: JSON for a pydantic model or a
    dict, an SSE stream for an async iterator, 499 when the client left first."""
    result = await until_disconnect(request, coro)
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if isinstance(result, p.BaseModel):
        return JSONResponse(result.model_dump(exclude_none=True))
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class ApiRouter(APIRouter):
    """A FastAPI router whose POST routes read their JSON body themselves (:meth:`body`,
    off the event loop), and which keeps each such route's body model so that the app can
    list the nested schemas in its OpenAPI description (:func:`body_components`).

    Args:
        limits: the server's limits (the JSON container bound of :func:`read_body`).
        **kwargs: :class:`fastapi.APIRouter`'s (``dependencies`` for the API-key check).
    """

    def __init__(self, limits: ServerLimits, **kwargs):
        super().__init__(**kwargs)
        self.limits = limits
        self.body_models: list[type] = []

    def post_json(self, path: str, model: type, **kwargs):
        """A decorator adding ``POST path`` whose OpenAPI request body is ``model``'s schema
        (``kwargs``: :meth:`fastapi.APIRouter.post`'s, such as the route's ``name``)."""
        self.body_models.append(model)
        return self.post(path, openapi_extra=json_body(model), **kwargs)

    def post_reply(self, path: str, model: type, create, name: str) -> None:
        """Add ``POST path`` (route ``name``) of a generating endpoint: it reads ``model``
        from the body and answers what ``create(body)`` gives (see :func:`answer`)."""

        async def endpoint(request: Request):
            return await answer(request, create(await self.body(request, model)))

        self.post_json(path, model, name=name)(endpoint)

    async def body(self, request: Request, model: type):
        """The request's JSON body as ``model`` (see :func:`read_body`)."""
        return await read_body(request, model, self.limits)
