"""An OpenAI- and Anthropic-compatible HTTP server over :class:`~mlx_ferrum.engine.AsyncEngine`.

One module per API, over one shared core:

- :mod:`.serving`: the shared core, :class:`OpenAIServing` (model names, limits, the
  engine requests of a reply, queued-token account), ``ServingError`` and SSE helpers,
  and the one request-to-engine translation: OpenAI's and vLLM's sampling fields ->
  ``SamplingParams``, every chat API's chat template, tools and grammar, and its output
  processing (reasoning split, tool calls).
- :mod:`.chat_completions`, :mod:`.completions`, :mod:`.responses`,
  :mod:`.anthropic_messages`, :mod:`.embeddings`: OpenAI's chat completions,
  completions, Responses and embeddings APIs and Anthropic's Messages API.
- :mod:`.models`: ``/v1/models`` and vLLM's LoRA load / unload endpoints;
  :mod:`.tokenization`: vLLM's ``/tokenize`` and ``/detokenize``.
- :mod:`.metrics`: ``/metrics`` (Prometheus, vLLM's names under ``mlx_ferrum:``) and ``/health``.
- :mod:`.protocol`: pydantic request and response models in OpenAI's shapes
  (tokenize/detokenize in vLLM's).
- :mod:`.reasoning`, :mod:`.tool_parsers`: reasoning and tool-call syntaxes.
- :mod:`.limits`: the per-request and per-server limits (values only).
- :mod:`.routing`: a request's HTTP side: the body-size middleware, the API-key check,
  JSON bodies read off the event loop, the router each API builds on.
- :mod:`.app`: the FastAPI app (mounts the routers, errors, API key), the uvicorn
  runner and graceful shutdown; :mod:`.web_ui`: the chat page.

Run it with ``mlx-ferrum serve --model M``.
"""

from .limits import ServerLimits

__all__ = ["OpenAIServing", "ServerLimits", "build_app", "run_server"]


def __getattr__(name: str):
    # imported on first use, so that the CLI can read ServerLimits for its flags
    # without importing FastAPI and uvicorn for every command
    if name in ("build_app", "run_server"):
        from . import app

        return getattr(app, name)
    if name == "OpenAIServing":
        from .serving import OpenAIServing

        return OpenAIServing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
