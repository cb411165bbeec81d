"""The executor contract: the ``ModelExecutor`` protocol and its input/output dataclasses.

Names and meanings follow ferrum's ``ferrum_interfaces::model_executor`` (see
``shared/seeds``): prefill and decode are separate calls, each returns logits and a
``KvCacheHandle`` naming the sequence's cache, and the engine releases caches with
``release_cache``. Unlike ferrum the calls are synchronous, because MLX is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx

from ..runner.protocol import ModelInfo, SeqWork


@dataclass(frozen=True)
class KvCacheHandle:
    """A sequence's KV cache as the executor reports it after a call.

    Attributes:
        cache_id: the key the executor stores the cache under.
        num_tokens: tokens stored (the sequence's ``context_len``).
        layout: ``"contiguous"`` or ``"paged"``.
        block_size: tokens per block (paged), 0 for contiguous.
        block_table: physical block ids in logical order (paged), else None.
    """

    cache_id: str
    num_tokens: int
    layout: str
    block_size: int = 0
    block_table: Optional[tuple[int, ...]] = None

    @property
    def context_len(self) -> int:
        """Alias of ``num_tokens`` (vLLM's name)."""
        return self.num_tokens


@dataclass
class PrefillInput:
    """Prompt tokens of one sequence.

    Attributes:
        input_ids: ``[1, L]`` int32 token ids.
        kv_cache: an existing handle to extend (chunked prefill, prefix-cache hit),
            or None to start a new cache.
        cache_id: id for a new cache (default: a fresh unique id).
        return_all_logits: return logits of every position (``[1, L, vocab]``)
            instead of the last one only (``[1, 1, vocab]``).
        attention_mask, position_ids: accepted for ferrum parity; positions are
            always the cache's next positions, and a mask other than all-ones is rejected.
    """

    input_ids: mx.array
    kv_cache: Optional[KvCacheHandle] = None
    cache_id: Optional[str] = None
    return_all_logits: bool = False
    attention_mask: Optional[mx.array] = None
    position_ids: Optional[mx.array] = None


@dataclass
class PrefillOutput:
    """Logits ``[1, L or 1, vocab]`` (model dtype) and the populated cache handle."""

    logits: mx.array
    kv_cache: KvCacheHandle
    hidden_states: Optional[list] = None

    def last_token_logits(self) -> mx.array:
        """Logits of the last position, ``[1, vocab]``."""
        return self.logits[:, -1, :]


@dataclass
class DecodeInput:
    """One new token of a sequence: ``input_ids`` ``[1, 1]`` int32 and its cache handle."""

    input_ids: mx.array
    kv_cache: KvCacheHandle
    position_ids: Optional[mx.array] = None


@dataclass
class DecodeOutput:
    """Logits of the next token ``[1, vocab]`` (model dtype) and the updated handle."""

    logits: mx.array
    kv_cache: KvCacheHandle
    hidden_state: Optional[mx.array] = None


class AttentionType(str, enum.Enum):
    """Attention mechanisms an executor may support (ferrum's ``AttentionType``)."""

    MULTI_HEAD = "multi_head"
    MULTI_QUERY = "multi_query"
    GROUPED_QUERY = "grouped_query"
    FLASH = "flash"
    PAGED = "paged"
    SLIDING_WINDOW = "sliding_window"


@dataclass
class MemoryRequirements:
    """Memory estimates in bytes (ferrum's ``MemoryRequirements``)."""

    parameter_memory: int = 0
    activation_memory_per_token: int = 0
    kv_cache_memory_per_token: int = 0
    overhead_memory: int = 0

    def calculate_total_memory(self, batch_size: int, sequence_length: int, num_layers: int) -> int:
        """Bytes for ``batch_size`` sequences of ``sequence_length`` tokens.

        ``kv_cache_memory_per_token`` is per layer, as in ferrum.
        """
        act = self.activation_memory_per_token * batch_size * sequence_length
        kv = self.kv_cache_memory_per_token * batch_size * sequence_length * num_layers
        return self.parameter_memory + act + kv + self.overhead_memory


@dataclass
class ExecutorCapabilities:
    """What an executor can do; every field must be true of the implementation.

    ``supports_tensor_parallelism`` / ``supports_pipeline_parallelism`` are true when
    this executor's model runs split that way (loaded with
    ``mlx_ferrum.load(..., parallel=...)`` in an ``mlx.launch`` group); the sizes in use
    are ``tensor_parallel_size`` / ``pipeline_parallel_size``; ``parameter_memory`` is
    then this rank's shard's bytes."""

    max_batch_size: int
    max_sequence_length: int
    attention_mechanisms: list[AttentionType]
    supports_dynamic_batching: bool
    supports_continuous_batching: bool
    supports_speculative_decoding: bool
    supports_tensor_parallelism: bool
    supports_pipeline_parallelism: bool
    supported_dtypes: list[str]
    supported_devices: list[str]
    memory_requirements: MemoryRequirements
    kv_layout: str = "contiguous"
    #: ranks this executor's model is split across by tensor / pipeline parallelism (1: not split)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


class ExecutorState(str, enum.Enum):
    """Lifecycle state of an executor."""

    INITIALIZING = "initializing"
    READY = "ready"
    BUSY = "busy"
    ERROR = "error"
    SHUTDOWN = "shutdown"


@dataclass
class ExecutorMemoryUsage:
    """Bytes allocated to KV caches, bytes in use by stored tokens, the peak, and utilization (%)."""

    allocated_bytes: int = 0
    used_bytes: int = 0
    peak_bytes: int = 0
    utilization_percent: float = 0.0


@dataclass
class ExecutorStatus:
    """Operation counts and average latencies (milliseconds) of an executor."""

    state: ExecutorState
    is_ready: bool
    current_batch_size: int
    prefill_operations: int
    decode_operations: int
    avg_prefill_time_ms: float
    avg_decode_time_ms: float
    memory_usage: ExecutorMemoryUsage = field(default_factory=ExecutorMemoryUsage)
    last_operation: Optional[float] = None


@runtime_checkable
class ModelExecutor(Protocol):
    """The executor contract (ferrum's ``ModelExecutor`` trait, synchronous), as
    :class:`~mlx_ferrum.executor.LlmExecutor` implements it over a
    :class:`~mlx_ferrum.runner.ModelRunner`.

    Implementations: :class:`~mlx_ferrum.executor.LlmExecutor` (a real model) and
    :class:`~mlx_ferrum.executor.PagedAttentionExecutor` (identity projections).
    Token ids are ``int`` ``mx.array`` s ``[1, L]``; logits are in the model dtype;
    counts are tokens, sizes bytes. Errors are :mod:`mlx_ferrum.errors` types
    (``InvalidInputIdsError``, ``UnknownCacheError``, ``PromptTooLongError``,
    ``KvCacheExhaustedError``, ``ExecutorError`` after ``shutdown``).
    """

    info: ModelInfo

    def prefill(self, input: PrefillInput) -> PrefillOutput:
        """Run a prompt (or a chunk of one) and return its logits and cache handle."""

    def decode(self, input: DecodeInput) -> DecodeOutput:
        """Run one new token and return the next-token logits ``[1, vocab]``."""

    def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        """Several prompts in one forward pass."""

    def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """One token of each of several sequences in one forward pass."""

    def forward_verify(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """N+1 tokens of one sequence in one forward pass, one logits row each."""

    def forward(
        self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None
    ) -> tuple[mx.array, list[mx.array]]:
        """One unevaluated pass over :class:`SeqWork` items: ``(logits [R, vocab], KV state)``."""

    def truncate_kv(self, kv_cache: KvCacheHandle, new_len: int) -> KvCacheHandle:
        """Roll a cache back to its first ``new_len`` tokens."""

    def fork_cache(self, kv_cache: KvCacheHandle, new_cache_id: Optional[str] = None) -> KvCacheHandle:
        """A new cache starting with ``kv_cache``'s tokens."""

    def claim_prefix(self, cache_id: str, token_ids: Sequence[int], num_tokens: int) -> KvCacheHandle:
        """A new paged cache sharing the first ``num_tokens`` prefix-cached tokens."""

    def has_cache(self, cache_id: str) -> bool:
        """True when ``cache_id`` holds a cache."""

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold."""

    def release_cache(self, cache_id: str) -> None:
        """Free a sequence's cache (idempotent)."""

    def cache_metrics_snapshot(self) -> dict:
        """KV cache metrics (paged: the block manager's; contiguous: sequences and bytes)."""

    def capabilities(self) -> ExecutorCapabilities:
        """What this executor supports."""

    def status(self) -> ExecutorStatus:
        """Counts and timings so far."""

    def warmup(self) -> None:
        """Compile/allocate ahead of the first request."""

    def shutdown(self) -> None:
        """Release every cache and refuse further calls."""
