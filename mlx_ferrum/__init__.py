"""mlx_ferrum: an LLM inference runtime for Apple Silicon, built on MLX.

Public API (see ``docs/architecture.md``)::

    import mlx_ferrum as mf
    model, tokenizer = mf.load("Qwen/Qwen2.5-0.5B-Instruct")
    text = mf.generate(model, tokenizer, "Hello", max_tokens=64, temperature=0.0)
    for chunk in mf.stream_generate(model, tokenizer, messages, max_tokens=256): ...
    engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged"))
    executor = mf.LlmExecutor(model)
"""

# The public names are imported on first use (PEP 562): ``import mlx_ferrum`` and the
# ``mlx-ferrum`` command start without loading MLX and the model code, so ``--help`` is
# quick and a Ctrl-C during start-up lands in the CLI's own handler (exit 130, no
# traceback) rather than inside this package's imports.
import importlib

from . import errors
from .config import RuntimeConfig

__version__ = "0.1.0"

_LAZY = {
    "GenerationChunk": ".api",
    "executor_for": ".api",
    "engine_for": ".api",
    "generate": ".api",
    "load": ".api",
    "stream_generate": ".api",
    "AsyncEngine": ".engine",
    "Engine": ".engine",
    "RequestOutput": ".engine",
    "SamplingParams": ".engine.sampling",
    "StructuredOutputsParams": ".engine.structured",
    "DecodeInput": ".executor",
    "DecodeOutput": ".executor",
    "ExecutorCapabilities": ".executor",
    "ExecutorStatus": ".executor",
    "KvCacheHandle": ".executor",
    "LlmExecutor": ".executor",
    "ModelExecutor": ".executor",
    "ModelInfo": ".executor",
    "PagedAttentionExecutor": ".executor",
    "PrefillInput": ".executor",
    "PrefillOutput": ".executor",
    "Tokenizer": ".tokenizer",
}


def __getattr__(name: str):
    """Import a public name (or a submodule, as ``mlx_ferrum.engine``) on first access.

    Raises:
        AttributeError: no such public name or submodule.
    """
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AsyncEngine",
    "Engine",
    "RequestOutput",
    "DecodeInput",
    "DecodeOutput",
    "ExecutorCapabilities",
    "ExecutorStatus",
    "GenerationChunk",
    "KvCacheHandle",
    "LlmExecutor",
    "ModelExecutor",
    "ModelInfo",
    "PagedAttentionExecutor",
    "PrefillInput",
    "PrefillOutput",
    "RuntimeConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "Tokenizer",
    "errors",
    "executor_for",
    "engine_for",
    "generate",
    "load",
    "stream_generate",
]
