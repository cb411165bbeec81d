"""mlx_ferrum: an LLM inference runtime for Apple Silicon, built on MLX.

Public API (see ``docs/architecture.md``)::

    import mlx_ferrum as mf
    model, tokenizer = mf.load("Qwen/Qwen2.5-0.5B-Instruct")
    text = mf.generate(model, tokenizer, "Hello", max_tokens=64, temperature=0.0)
    for chunk in mf.stream_generate(model, tokenizer, messages, max_tokens=256): ...
    engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged"))
    executor = mf.LlmExecutor(model)
"""

from . import errors
from .api import GenerationChunk, executor_for, generate, load, stream_generate
from .config import RuntimeConfig
from .engine import AsyncEngine, Engine, RequestOutput
from .engine.sampling import SamplingParams
from .executor import (
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorStatus,
    KvCacheHandle,
    LlmExecutor,
    ModelExecutor,
    ModelInfo,
    PagedAttentionExecutor,
    PrefillInput,
    PrefillOutput,
)
from .tokenizer import Tokenizer

__version__ = "0.1.0"

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
    "Tokenizer",
    "errors",
    "executor_for",
    "generate",
    "load",
    "stream_generate",
]
