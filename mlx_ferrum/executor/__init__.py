"""Executors: the ``ModelExecutor`` protocol, ``LlmExecutor`` and ``PagedAttentionExecutor``."""

from ..layers.attention import AttentionMetadata
from .llm_executor import LlmExecutor, SeqWork
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
