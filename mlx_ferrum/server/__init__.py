"""An OpenAI- and Anthropic-compatible HTTP server over :class:`~mlx_ferrum.engine.AsyncEngine`.

- :mod:`.protocol`: pydantic request and response models in OpenAI's shapes
  (tokenize/detokenize in vLLM's).
- :mod:`.serving`: turns a request into engine calls and engine outputs into responses;
  ``prepare_chat`` is the one chat planning every chat API calls.
- :mod:`.translation`: the shared output processing of the chat APIs (reasoning split,
  tool calls, stream deltas).
- :mod:`.responses`, :mod:`.anthropic_messages`, :mod:`.embeddings`: OpenAI's Responses
  API, Anthropic's Messages API and OpenAI's embeddings API.
- :mod:`.reasoning`, :mod:`.tool_parsers`: reasoning and tool-call syntaxes.
- :mod:`.limits`: the per-request and per-server limits and the body-size middleware.
- :mod:`.metrics`: Prometheus metrics (``prometheus_client``), vLLM's names under ``mlx_ferrum:``.
- :mod:`.app`: the FastAPI app, the uvicorn runner and graceful shutdown.

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
