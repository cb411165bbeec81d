"""The ferrum-compatible executor surface: the ``ModelExecutor`` protocol, ``LlmExecutor``
and ``PagedAttentionExecutor``, thin adapters over a :class:`~mlx_ferrum.runner.LlmRunner`
(the engine drives the runner directly)."""

from ..layers.attention import AttentionMetadata
from ..runner import SeqWork
from .llm_executor import LlmExecutor
from .paged_attention_executor import IdentityAttentionModel, PagedAttentionExecutor
from .types import (
    AttentionType,
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorMemoryUsage,
    ExecutorState,
    ExecutorStatus,
    KvCacheHandle,
    MemoryRequirements,
    ModelExecutor,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)

__all__ = [
    "AttentionMetadata",
    "AttentionType",
    "DecodeInput",
    "DecodeOutput",
    "ExecutorCapabilities",
    "ExecutorMemoryUsage",
    "ExecutorState",
    "ExecutorStatus",
    "KvCacheHandle",
    "IdentityAttentionModel",
    "LlmExecutor",
    "PagedAttentionExecutor",
    "MemoryRequirements",
    "ModelExecutor",
    "ModelInfo",
    "PrefillInput",
    "PrefillOutput",
    "SeqWork",
]
