"""An OpenAI-compatible HTTP server over :class:`~mlx_ferrum.engine.AsyncEngine`.

- :mod:`.protocol`: pydantic request and response models in OpenAI's shapes
  (tokenize/detokenize in vLLM's).
- :mod:`.serving`: turns a request into engine calls and engine outputs into responses.
- :mod:`.metrics`: Prometheus metrics (``prometheus_client``), vLLM's names under ``mlx_ferrum:``.
- :mod:`.app`: the FastAPI app, the uvicorn runner and graceful shutdown.

Run it with ``mlx-ferrum serve --model M``.
"""

from .app import build_app, run_server
from .serving import OpenAIServing

__all__ = ["OpenAIServing", "build_app", "run_server"]
