"""The server's per-request and per-server limits, and the ASGI middleware that bounds bodies.

Every limit is checked before any work for the request starts, so one request can
neither block the event loop nor fill the memory: a body over
``max_request_body_bytes`` is refused (413) while it is read, before it is parsed; the
counts (``n``, prompts, choices) are checked right after parsing, the prompt tokens
while the prompts are tokenized (in a worker thread), and the queued tokens when the
request's engine requests are submitted. Each refusal names the limit and the
``mlx-ferrum serve`` flag that raises it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Callable, Optional

from ..errors import ConfigurationError

__all__ = ["ServerLimits", "BodySizeLimitMiddleware", "count_json_containers", "flag_of"]


@dataclass(frozen=True)
class ServerLimits:
    """Limits of ``mlx-ferrum serve``; each field is the flag ``--<field-with-dashes>``.

    - ``max_request_body_bytes`` (bytes): a larger HTTP body gets a 413 before it is parsed.
    - ``max_request_json_containers``: most JSON arrays and objects (outside strings) one
      body may hold (else 413, before parsing). Parsing holds Python's GIL, so it delays
      every other request, and many small containers (``[[1], [1], ...]``) are what makes
      it slow: about 0.5 us each, against 0.04 us per number and little per string byte.
    - ``max_n``: largest ``n`` (choices per prompt).
    - ``max_prompts_per_request``: largest number of prompts in one ``/v1/completions`` request.
    - ``max_choices_per_request``: largest prompts x ``n`` of one request (each choice is
      one engine request).
    - ``max_prompt_tokens_per_request`` (tokens): largest sum of the prompt lengths of one request.
    - ``max_queued_tokens`` (tokens): largest sum of prompt tokens over every engine
      request the server holds (running or waiting; ``n`` choices count ``n`` times). A
      request that would pass it gets a 429 (retry later); one that alone exceeds it, a 400.

    The defaults keep a small machine responsive: the worst body they admit parses in
    about 50 ms on one slow core (the parse runs in a worker thread, but the JSON and
    pydantic parsers do not release the GIL while they run), and nothing a request asks
    for grows without bound. A body of 1 MiB holds about 150,000 token ids or a
    1,000,000-character prompt.

    Raises:
        ConfigurationError: a limit is not an int >= 1 (the message names its flag).
    """

    max_request_body_bytes: int = 1024 * 1024
    max_request_json_containers: int = 32_768
    max_n: int = 32
    max_prompts_per_request: int = 64
    max_choices_per_request: int = 64
    max_prompt_tokens_per_request: int = 262_144
    max_queued_tokens: int = 1_048_576

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{flag_of(f.name)} {value!r} is invalid: use an int >= 1")


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


def flag_of(name: str) -> str:
    """The ``serve`` flag of the limit field ``name`` (e.g. ``--max-n``)."""
    return "--" + name.replace("_", "-")


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
