"""The server's per-request and per-server limits (values only: the CLI reads them for
its flags without importing FastAPI).

Every limit is checked before any work for the request starts, so one request can
neither block the event loop nor fill the memory: a body over
``max_request_body_bytes`` is refused (413) while it is read, before it is parsed
(:class:`~mlx_ferrum.server.routing.BodySizeLimitMiddleware`); the JSON containers are
counted before parsing, the counts (``n``, prompts, choices) checked right after, the
prompt tokens while the prompts are tokenized (in a worker thread), and the queued
tokens when the request's engine requests are submitted
(:class:`~mlx_ferrum.server.serving.OpenAIServing`). Each refusal names the limit and
the ``mlx-ferrum serve`` flag that raises it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigurationError

__all__ = ["ServerLimits", "flag_of"]


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


def flag_of(name: str) -> str:
    """The ``serve`` flag of the limit field ``name`` (e.g. ``--max-n``)."""
    return "--" + name.replace("_", "-")
